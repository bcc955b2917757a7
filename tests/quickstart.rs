//! The README's "Your first job in five minutes", run as written against the real services:
//! every `$ ` line of its `console` blocks is run in order (a line ending in `&` in the
//! background, stopped at the end), and every output line the README shows under a command must
//! appear in what the command printed. Numbers are compared as numbers, not by value (timings,
//! counts and times change from run to run); a line `…` stands for lines left out. The job's
//! names all contain `quickstart`: the test runs the commands on copies made unique
//! (`quickstart_<n>`), and reads their output back under the README's names.
//!
//! So a command, an option or an output line renamed in the code and not in the README (or the
//! reverse) fails here; `a_renamed_command_or_option_fails_the_doc_test` shows that it does.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const README: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/quickstart.toml");
const SECTION: &str = "## Your first job in five minutes";

/// One command of the quickstart and the output lines the README shows for it.
#[derive(Debug)]
struct Step {
    command: String,
    expected: Vec<String>,
}

/// The `$ ` commands of the README section's `console` blocks, in order.
fn steps(readme: &str) -> Vec<Step> {
    let start = readme.find(SECTION).expect("the quickstart section");
    let rest = &readme[start + SECTION.len()..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut steps: Vec<Step> = Vec::new();
    let mut in_console = false;
    for line in section.lines() {
        if line.starts_with("```") {
            in_console = !in_console && line.trim() == "```console";
            continue;
        }
        if !in_console {
            continue;
        }
        if let Some(command) = line.strip_prefix("$ ") {
            steps.push(Step {
                command: command.to_owned(),
                expected: Vec::new(),
            });
        } else if let Some(step) = steps.last_mut()
            && !line.trim().is_empty()
            && line.trim() != "…"
        {
            step.expected.push(line.to_owned());
        }
    }
    steps
}

/// A line with every run of digits as one `0`, spaces collapsed: what the comparison sees.
fn shape(line: &str) -> String {
    let mut out = String::new();
    let mut in_digits = false;
    for c in line.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('0');
            }
            in_digits = true;
        } else {
            in_digits = false;
            out.push(c);
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The expected lines not found in `output`.
fn missing(expected: &[String], output: &str) -> Vec<String> {
    let seen: Vec<String> = output.lines().map(shape).collect();
    expected
        .iter()
        .filter(|e| {
            // A line ending in `…` shows its start only.
            let e = shape(e.trim_end_matches('…'));
            !seen.iter().any(|s| s.contains(&e))
        })
        .cloned()
        .collect()
}

/// Runs the quickstart of `readme` with `config` as `config/quickstart.toml`, in a scratch
/// directory, with `tally` (this build's) first on the PATH. The first failure, named.
fn run_quickstart(readme: &str, config: &str) -> Result<(), String> {
    let unique = common::unique("quickstart");
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(
        dir.path().join(format!("config/{unique}.toml")),
        config.replace("quickstart", &unique),
    )
    .unwrap();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_tally"))
        .parent()
        .unwrap()
        .to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let steps = steps(readme);
    if steps.len() < 5 {
        return Err(format!("the quickstart shows {} commands", steps.len()));
    }
    let mut background: Vec<(Child, PathBuf, &Step)> = Vec::new();
    let stop = |background: &mut Vec<(Child, PathBuf, &Step)>| {
        for (child, _, _) in background.iter_mut() {
            if matches!(child.try_wait(), Ok(Some(_))) {
                continue;
            }
            common::sigterm(child);
            let _ = common::wait_exit(child, std::time::Duration::from_secs(30));
            let _ = child.kill();
        }
    };
    let mut result = Ok(());
    for step in &steps {
        let command = step.command.replace("quickstart", &unique);
        // `kill %N`: the shell's job N, a background command of the quickstart, stopped and
        // waited for as an interactive shell would.
        if let Some(n) = command.strip_prefix("kill %") {
            let Ok(n) = n.trim().parse::<usize>() else {
                result = Err(format!("`{command}`: which job?"));
                break;
            };
            let Some((child, _, _)) = background.get_mut(n.wrapping_sub(1)) else {
                result = Err(format!("`{command}`: no background job {n}"));
                break;
            };
            common::sigterm(child);
            let status = common::wait_exit(child, std::time::Duration::from_secs(30));
            if !status.is_some_and(|s| s.success()) {
                result = Err(format!("`{}` stopped it with {status:?}", step.command));
                break;
            }
            continue;
        }
        let mut shell = Command::new("bash");
        shell.current_dir(dir.path()).env("PATH", &path);
        if let Some(command) = command.strip_suffix('&') {
            let log = dir
                .path()
                .join(format!("background-{}.log", background.len()));
            let file = std::fs::File::create(&log).unwrap();
            let child = shell
                .args(["-c", &format!("exec {command}")])
                .stdin(Stdio::null())
                .stdout(file.try_clone().unwrap())
                .stderr(file)
                .spawn()
                .unwrap();
            background.push((child, log, step));
            continue;
        }
        let out = shell.args(["-c", &command]).output().unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .replace(&unique, "quickstart");
        println!("$ {}\n{printed}", step.command);
        if !out.status.success() {
            result = Err(format!(
                "`{}` failed ({}):\n{printed}",
                step.command, out.status
            ));
            break;
        }
        let lost = missing(&step.expected, &printed);
        if !lost.is_empty() {
            result = Err(format!(
                "`{}` printed none of these lines the README shows: {lost:#?}\nit printed:\n{printed}",
                step.command
            ));
            break;
        }
    }
    stop(&mut background);
    for (_, log, step) in &background {
        let printed = std::fs::read_to_string(log)
            .unwrap_or_default()
            .replace(&unique, "quickstart");
        let lost = missing(&step.expected, &printed);
        if result.is_ok() && !lost.is_empty() {
            result = Err(format!(
                "`{}` printed none of these lines the README shows: {lost:#?}\nit printed:\n{printed}",
                step.command
            ));
        }
    }
    result
}

/// The quickstart, as the README writes it, against the real services.
#[test]
fn the_readme_quickstart_runs_as_written() {
    let readme = std::fs::read_to_string(README).unwrap();
    let config = std::fs::read_to_string(CONFIG).unwrap();
    run_quickstart(&readme, &config).unwrap();
}

/// The doc test fails when the README names a command the binary does not have, and when
/// the code no longer takes an option the README's job file uses.
#[test]
fn a_renamed_command_or_option_fails_the_doc_test() {
    let readme = std::fs::read_to_string(README).unwrap();
    let config = std::fs::read_to_string(CONFIG).unwrap();
    assert!(
        readme.contains("tally check-config --config"),
        "the quickstart checks its file"
    );
    let renamed = readme.replace("tally check-config --config", "tally check-conf --config");
    let e = run_quickstart(&renamed, &config).unwrap_err();
    assert!(e.contains("check-conf") && e.contains("failed"), "{e}");
    let renamed = config.replace("checkpoint_interval", "checkpoint_every");
    let e = run_quickstart(&readme, &renamed).unwrap_err();
    assert!(e.contains("checkpoint_every"), "{e}");
}

#[test]
fn numbers_are_compared_as_numbers() {
    assert_eq!(
        shape("produced 20000 records in 1.25s"),
        "produced 0 records in 0.0s"
    );
    assert!(
        missing(
            &["checkpoint committed epoch=1 consumed=20 …".into()],
            "x checkpoint committed epoch=2 consumed=7 rows=3"
        )
        .is_empty()
    );
    let out = "2026-12-06T00:01:02Z  INFO  verify: OK: exact match\n";
    assert!(missing(&["verify: OK: exact match".into()], out).is_empty());
    assert_eq!(
        missing(&["verify: FAILED".into()], out),
        vec!["verify: FAILED".to_owned()]
    );
}

/// `tally check-config ... | head` as a reader would type it: the reader goes first, and tally
/// ends like any Unix tool (SIGPIPE) instead of panicking in `println!`.
#[test]
fn a_report_piped_into_head_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["check-config", "--config", CONFIG])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader has gone before tally prints
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        out.status
    );
}
