//! Jobs by declaration against the real services: a deployment whose job file named its fields
//! in `[fields]` switches to the declared revenue_agg (`config/revenue_agg.toml`'s
//! `[aggregation]`) on the same state directory, changelog and tables, after a kill -9, and
//! continues exactly once with the records produced since: it resumes from its checkpoint and
//! reprocesses nothing. The shipped example job files run as written through a kill -9 and
//! verify exactly against loadgen's manifest.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;

/// The `[aggregation]` section of the shipped job file, as it is written.
fn shipped_declaration() -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/revenue_agg.toml"
    ))
    .unwrap();
    let at = text
        .find("\n[aggregation]")
        .expect("an [aggregation] section");
    text[at..].to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_named_by_fields_continues_under_its_declaration_exactly_once() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(34, 2, 20_000);
    let (first, second) = records.split_at(10_000);
    let mut manifest = Manifest::default();
    produce_into(&topic, first, &mut manifest).await;
    let job = Job::new(&topic, "");
    let before_fields = std::fs::read_to_string(&job.config).unwrap();
    assert!(!before_fields.contains("[aggregation]"));

    // The deployment as it ran before, with the built-in field names: it catches up with the
    // first half and is killed.
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_view_eq(&view, &manifest.rows, &job.log());
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let committed_before = ch_count(&format!(
        "SELECT count() FROM {}.{}_commits",
        job.database, job.table
    ))
    .await;
    assert!(committed_before >= 1);
    let consumed_before: u64 = {
        let store =
            tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
                .unwrap();
        let meta = store.meta().expect("a checkpoint");
        meta.partitions.values().map(|c| c.totals.consumed).sum()
    };
    assert_eq!(consumed_before, manifest.produced);
    produce_into(&topic, second, &mut manifest).await;

    // The same job, its fields now declared.
    std::fs::write(
        &job.config,
        format!("{before_fields}\n{}", shipped_declaration()),
    )
    .unwrap();
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let restarted = job.log()[before..].to_owned();
    assert!(
        restarted.contains("resuming partition from checkpoint"),
        "resumed, not recomputed:\n{restarted}"
    );
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    // Every offset consumed exactly once across the two job files: nothing reprocessed.
    assert_eq!(assert_accounting(&job, manifest.produced), 2);
}

/// Runs `tally` with `args`, returning (success, stdout and stderr).
fn tally(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(worker_binary())
        .args(args)
        .output()
        .expect("run tally");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A shipped example job file, run as written against the real services: `tally loadgen`
/// produces its records by the declaration (filtered ones, duplicates, late and poison records
/// mixed in) while the worker runs; the worker is killed with SIGKILL after its first commit,
/// in the middle of the stream, and started again. `tally verify` must then find the view, the
/// committed versions and the dead-letter topic exactly as the manifest says, `tally reconcile`
/// the view as the source recomputed, and every offset must be accounted for once, as the
/// manifest's fate for it.
async fn a_shipped_example_is_exact_after_a_kill_9(file: &str) {
    let topic = unique(file.trim_end_matches(".toml"));
    create_topic(&topic, 2).await;
    let job = Job::shipped(file, &topic);
    let config = job.config.to_str().unwrap().to_owned();
    let manifest_path = job.dir.path().join("manifest.json");
    let manifest = manifest_path.to_str().unwrap().to_owned();
    let (mut worker, loadgen) = declared_stream_through_a_kill_9(&job, &manifest).await;
    // `reconcile --every` checks each round's new input while the stream goes on.
    let rounds_path = job.dir.path().join("rounds.out");
    let reconciler = Worker(
        std::process::Command::new(worker_binary())
            .args(["reconcile", "--config", &config])
            .args(["--every", "500ms", "--full-every", "1000"])
            .stdout(std::fs::File::create(&rounds_path).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = loadgen.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = verify_exact_then_stop(&job, &mut worker.0, &manifest).await;
    println!("{file} after a kill -9: {line}");

    // The source recomputed through the declaration agrees with the view at the last commit.
    let (ok, text) = tally(&["reconcile", "--config", &config]);
    let line = text
        .lines()
        .find(|l| l.starts_with("records counted"))
        .unwrap_or_default();
    println!("{file} reconcile: {line}");
    assert!(ok && text.contains("reconcile: OK"), "{text}");

    let m = tally_tools::loadgen::Manifest::load(&manifest_path).unwrap();
    // Its rounds read every record once, one full round then the new input, and every
    // window they recomputed matches the view.
    let mut text = String::new();
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let read = |text: &str| -> u64 {
        reconcile_rounds(text, "full")
            .iter()
            .chain(&reconcile_rounds(text, "incremental"))
            .map(|r| r.0)
            .sum()
    };
    while std::time::Instant::now() < until {
        text = std::fs::read_to_string(&rounds_path).unwrap();
        if read(&text) >= m.produced {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(reconciler);
    let (full, incremental) = (
        reconcile_rounds(&text, "full"),
        reconcile_rounds(&text, "incremental"),
    );
    println!(
        "{file} reconcile --every: {} full and {} incremental rounds read {} records, {} differ",
        full.len(),
        incremental.len(),
        read(&text),
        full.iter().chain(&incremental).map(|r| r.1).sum::<u64>()
    );
    assert_eq!(full.len(), 1, "{text}");
    assert_eq!(read(&text), m.produced, "{text}");
    assert!(incremental.iter().any(|r| r.0 > 0), "{text}");
    assert!(
        full.iter().chain(&incremental).all(|r| r.1 == 0),
        "every round matches: {text}"
    );
    // And verify does fail: one window counted once more in a copy of the manifest is found.
    let mut wrong = m.clone();
    let first = &mut wrong.windows[0].2[0];
    let tally_tools::loadgen::Running::Count(n) = *first else {
        panic!("the first column counts: {first:?}")
    };
    *first = tally_tools::loadgen::Running::Count(n + 1);
    let wrong_path = job.dir.path().join("wrong.json");
    wrong.save(&wrong_path).unwrap();
    let (ok, text) = tally(&[
        "verify",
        "--config",
        &config,
        "--manifest",
        wrong_path.to_str().unwrap(),
    ]);
    assert!(
        !ok && text.contains("rows: missing 0, extra 0, different 1"),
        "{text}"
    );
    assert!(text.contains("over_counted=0 lost=1"), "{text}");

    assert_eq!(assert_accounting(&job, m.produced), 2);
    assert_fates(&job, &m);

    // doctor walks every hop of the declared job: the view cell by cell against the committed
    // versions at its published cut, and the reconciliation through the declaration.
    let (ok, report) = doctor(&job);
    println!("{file} doctor:\n{report}");
    assert!(ok, "{report}");
    for hop in [
        "Persisted → Processed",
        "Processed → Written",
        "Written → Queryable",
        "Queryable → Reported",
    ] {
        assert_eq!(status_of(&report, hop), "PASS", "{hop}: {report}");
    }
    assert!(
        report.contains("= the committed versions at the published cut"),
        "{report}"
    );
    // A row copied into the published snapshot behind tally's back shows a key twice.
    ch(&format!(
        "INSERT INTO {db}.{t}_live SELECT * FROM {db}.{t}_live ORDER BY window_start DESC LIMIT 1",
        db = job.database,
        t = job.table
    ))
    .await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert_eq!(
        status_of(&report, "Written → Queryable"),
        "FAIL",
        "{report}"
    );
    assert!(report.contains("appears twice"), "{report}");
}

/// `config/page_views.toml`: a 5-minute window sliding by a minute, three keys, min/max/avg.
#[tokio::test(flavor = "multi_thread")]
async fn the_page_views_example_is_exact_after_a_kill_9() {
    a_shipped_example_is_exact_after_a_kill_9("page_views.toml").await;
}

/// `config/api_latency.toml`: a filter of three conditions, nested fields, epoch seconds,
/// decimal sums and maxima.
#[tokio::test(flavor = "multi_thread")]
async fn the_api_latency_example_is_exact_after_a_kill_9() {
    a_shipped_example_is_exact_after_a_kill_9("api_latency.toml").await;
}
