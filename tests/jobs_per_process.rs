//! Several jobs in one `tally run` process, against the real services: the two shipped example
//! jobs, a third whose state directory cannot be opened and a fourth whose ClickHouse is
//! unreachable. The broken job stops alone and the cut-off one waits; the others run through a
//! kill -9 of the process and verify exactly, each with its own series; each metrics address
//! serves the jobs that name it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// `tally run` with every job's file, logging to the first job's log.
fn spawn_process(jobs: &[&Job]) -> Worker {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(jobs[0].dir.path().join("tally.log"))
        .unwrap();
    let mut cmd = Command::new(worker_binary());
    cmd.arg("run");
    for job in jobs {
        cmd.arg("--config").arg(&job.config);
    }
    Worker(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// Waits until the log past `from` has a line of job `name` containing any of `needles`.
async fn wait_for_job_line(log_of: &Job, from: usize, name: &str, needles: &[&str]) {
    let until = Instant::now() + Duration::from_secs(60);
    let prefix = format!("job{{job={name}}}");
    while Instant::now() < until {
        let log = log_of.log();
        if log
            .get(from..)
            .unwrap_or("")
            .lines()
            .any(|l| l.contains(&prefix) && needles.iter().any(|n| l.contains(n)))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no {needles:?} of job {name}; log:\n{}", log_of.log());
}

/// One `GET` on the metrics address: the whole response.
fn get(address: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn jobs_of_one_process_are_exact_after_a_kill_9_beside_a_broken_and_a_cut_off_one() {
    // The examples share one metrics address, the two others have one of their own.
    let (address, other_address) = {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        (
            a.local_addr().unwrap().to_string(),
            b.local_addr().unwrap().to_string(),
        )
    };
    let metrics_at = |job: &Job, address: &str| {
        let text = std::fs::read_to_string(&job.config).unwrap();
        write_file(
            &job.config,
            &text.replace("address = \"\"", &format!("address = \"{address}\"")),
        );
    };
    let mut jobs = Vec::new();
    for file in ["page_views.toml", "api_latency.toml"] {
        let topic = unique(file.trim_end_matches(".toml"));
        create_topic(&topic, 2).await;
        let job = Job::shipped(file, &topic);
        metrics_at(&job, &address);
        jobs.push(job);
    }
    // A job whose state directory is a file: it cannot start.
    let broken_topic = unique("orders");
    create_topic(&broken_topic, 1).await;
    let broken = Job::new(&broken_topic, "");
    write_file(&broken.state_dir(), "not a directory");
    metrics_at(&broken, &other_address);
    // A job whose ClickHouse does not answer: it waits for it, and stops at SIGTERM.
    let cut_off_topic = unique("orders");
    create_topic(&cut_off_topic, 1).await;
    let cut_off = Job::new(&cut_off_topic, "");
    let text = std::fs::read_to_string(&cut_off.config).unwrap();
    write_file(
        &cut_off.config,
        &text.replace(CLICKHOUSE, "http://127.0.0.1:9"),
    );
    metrics_at(&cut_off, &other_address);
    let log_of = &jobs[0];
    let all = [&jobs[0], &jobs[1], &broken, &cut_off];

    let before = log_of.log().len();
    let mut process = spawn_process(&all);
    for job in &jobs {
        wait_for_job_line(log_of, before, &job.name, &["partition has no checkpoint"]).await;
    }
    wait_for_job_line(
        log_of,
        before,
        &broken.name,
        &["the job stopped; the process's other jobs run on"],
    )
    .await;

    let manifests: Vec<String> = jobs
        .iter()
        .map(|j| j.dir.path().join("manifest.json").display().to_string())
        .collect();
    let loadgens: Vec<_> = jobs
        .iter()
        .zip(&manifests)
        .map(|(j, m)| declared_loadgen(j, m))
        .collect();
    let before = log_of.log().len();
    for job in &jobs {
        wait_for_job_line(log_of, before, &job.name, &["checkpoint committed"]).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    process.0.kill().unwrap();
    process.0.wait().unwrap();

    let before = log_of.log().len();
    let mut process = spawn_process(&all);
    for job in &jobs {
        wait_for_job_line(
            log_of,
            before,
            &job.name,
            &["resuming partition from checkpoint"],
        )
        .await;
    }
    let mut loadgens = loadgens;
    for loadgen in &mut loadgens {
        assert!(
            loadgen.try_wait().unwrap().is_none(),
            "killed in the middle of the stream"
        );
    }
    for loadgen in loadgens {
        let out = loadgen.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for (job, manifest) in jobs.iter().zip(&manifests) {
        let until = Instant::now() + Duration::from_secs(120);
        while !tally_command(job, "verify", &["--manifest", manifest]).0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    // An address serves the series of the jobs that name it, each labelled with its job, and
    // /ready for them: 200 for the examples; 503 for the others, naming the broken one.
    let metrics = get(&address, "/metrics");
    for job in &jobs {
        let series = format!("tally_records_consumed_total{{tally_job=\"{}\"}}", job.name);
        assert!(metrics.contains(&series), "{series}:\n{metrics}");
    }
    assert!(
        !metrics.contains(&broken.name) && !metrics.contains(&cut_off.name),
        "{metrics}"
    );
    let ready = get(&address, "/ready");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    for job in &jobs {
        assert!(ready.contains(&format!("{}: ready", job.name)), "{ready}");
    }
    let ready = get(&other_address, "/ready");
    println!("/ready: {ready}");
    assert!(ready.starts_with("HTTP/1.1 503"), "{ready}");
    assert!(
        ready.contains(&format!(
            "{}: stopped: the job ended with an error",
            broken.name
        )),
        "{ready}"
    );
    let waiting = ready
        .lines()
        .find(|l| l.starts_with(&format!("{}: ", cut_off.name)));
    assert!(
        waiting.is_some_and(|l| !l.ends_with(": ready")),
        "the job cut off from ClickHouse is not ready: {ready}"
    );

    sigterm(&process.0);
    let status = wait_exit(&mut process.0, Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| !s.success()),
        "a job failed, so the process exits 1 once the others stop; log:\n{}",
        log_of.log()
    );
    let log = log_of.log();
    let exit = log
        .lines()
        .find(|l| l.starts_with(&format!("error: job {}:", broken.name)));
    println!("exit: {}", exit.unwrap_or_default());
    assert!(exit.is_some(), "the exit names the broken job:\n{log}");
    for (job, manifest) in jobs.iter().zip(&manifests) {
        let (ok, text) = tally_command(job, "verify", &["--manifest", manifest]);
        let line = text
            .lines()
            .find(|l| l.starts_with("verify-summary"))
            .unwrap_or_default();
        println!("{} in one process after a kill -9: {line}", job.table);
        assert!(ok && text.contains("verify: OK: exact match"), "{text}");
        let (ok, text) = tally_command(job, "reconcile", &[]);
        assert!(ok && text.contains("reconcile: OK"), "{text}");
        let m = tally_tools::loadgen::Manifest::load(std::path::Path::new(manifest)).unwrap();
        assert_eq!(assert_accounting(job, m.produced), 2);
        assert_fates(job, &m);
        // Its own group, state directory and tables: stopped cleanly, under its own name.
        assert!(log.contains(&format!("job{{job={}}}", job.name)), "{log}");
    }
}
