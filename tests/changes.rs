//! The chain from the source database, end to end against the real services: a PostgreSQL
//! table changed by `tally loadgen` (inserts, updates of amounts, status, customer and hour,
//! deletes, key changes, several changes per transaction, a new snapshot asked for in the
//! middle), captured by Debezium through Kafka Connect, aggregated by the shipped `orders` job
//! into ClickHouse. Meanwhile tally is killed with SIGKILL, then Kafka Connect (so that Debezium
//! sends its last changes again), then PostgreSQL restarts. Afterwards every change the
//! workload made must be in the topic once, applied once (each repeat counted), and the view
//! must equal the same aggregation run on the table: `tally verify` and
//! `tally reconcile --source --strict`. Alone in its file: it restarts shared services.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::{Duration, Instant};

use common::capture::{captured_table, field, finish, loadgen, tail, verify_when_caught_up};
use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_changing_table_reaches_the_view_exactly_once_through_kills_and_restarts() {
    // Rows that exist before the connector: its first snapshot reads them.
    let (capture, job, manifest) = captured_table(400).await;
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;

    // The workload: about 25 s of changes, a new snapshot asked for half way.
    let started = Instant::now();
    let mut load = loadgen(
        &job,
        &manifest,
        &["--events", "5000", "--rate", "200", "--snapshots", "1"],
    );
    let at = |s: u64| async move {
        let until = started + Duration::from_secs(s);
        tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    };
    // tally killed after its first commit of the workload's changes, and started again.
    at(5).await;
    let committed = job.log().len();
    job.wait_for_log(committed, "checkpoint committed", Duration::from_secs(60))
        .await;
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    // Kafka Connect killed while it streams: Debezium sends again what it had not flushed.
    at(10).await;
    kill_9_service("connect");
    services(&["up", "connect"]);
    // PostgreSQL restarted under the workload and the connector.
    at(16).await;
    services(&["restart", "postgres"]);
    let load_out = tokio::task::spawn_blocking(move || {
        let _ = load.wait();
        load
    })
    .await
    .unwrap();
    let text = finish(load_out);
    assert!(text.contains("1 snapshots asked for"), "{text}");
    assert!(
        capture.revive().await,
        "the connector runs: {}",
        capture.status()
    );

    // Until Debezium and tally have caught up: verify passes, or says why not.
    let (ok, report, summary) = verify_when_caught_up(&job, &manifest).await;
    println!("{report}");
    assert!(ok, "verify:\n{report}\nlog tail:\n{}", tail(&job.log()));
    // The connector's replay was counted, not applied: repeats are duplicates (or stale).
    assert!(
        field(&summary, "repeated") > 0,
        "no replay was seen: {summary}"
    );
    assert_eq!(
        field(&summary, "repeated"),
        field(&summary, "duplicates") + field(&summary, "stale")
    );
    assert!(field(&summary, "snapshot_reads") > 400, "{summary}");
    assert_eq!(field(&summary, "dead_lettered"), 0);

    // The independent check alone, as an operator runs it.
    let (ok, reconciled) = tally_command(&job, "reconcile", &["--source", "--strict"]);
    println!("{reconciled}");
    assert!(ok, "{reconciled}");
    assert!(reconciled.contains("OK: every window matches the source table"));
    let (_, report) = doctor(&job);
    println!("{report}");
    assert_eq!(
        status_of(&report, "every change the source commits"),
        "PASS",
        "{report}"
    );
    sigterm(&worker);
    wait_exit(&mut worker, Duration::from_secs(60));
}
