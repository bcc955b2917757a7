//! ClickHouse restarted right after the read side changed what readers see. On 18.16 the parts
//! a `REPLACE PARTITION` replaced come back as active when the server starts again within
//! `old_parts_lifetime`, so a publish or a fold repair made that way would show rows twice after
//! a restart. Alone in its file because it restarts the shared server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::*;

/// The tests of this file restart the server one at a time.
static SERVER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Restarts ClickHouse (within seconds of the job's last publish, well inside
/// `old_parts_lifetime`), then reads the view once: exact, every key once, one snapshot live.
async fn restart_clickhouse_and_check(job: &Job, manifest: &common::Manifest) {
    services(&["down", "clickhouse"]);
    services(&["up", "clickhouse"]);
    let after = view(&job.database, &job.table)
        .await
        .expect("the view after the restart, no key twice");
    assert_view_eq(&after, &manifest.rows, &job.log());
    let snapshots = ch_count(&format!(
        "SELECT uniqExact(published_from, cut_partitions, cut_offsets) FROM {}.{}_live",
        job.database, job.table
    ))
    .await;
    assert_eq!(snapshots, 1, "the live table holds one snapshot");
}

/// Several publishes, no folding (every window is in the live table), then a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_clickhouse_restart_brings_back_no_replaced_snapshot() {
    let _server = SERVER.lock().await;
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(19, 2, 6_000);
    let mut manifest = common::Manifest::default();
    let job = Job::new(&topic, "");
    let no_folding = ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "0s");
    let before = job.log().len();
    let mut worker = job.spawn(&[no_folding]);
    job.wait_until_consuming(before).await;
    // Three bursts, each published before the next: the live table is replaced three times.
    for burst in records.chunks(2_000) {
        produce_into(&topic, burst, &mut manifest).await;
        let found = wait_for_view(&job, &manifest, Duration::from_secs(60)).await;
        assert_view_eq(&found, &manifest.rows, &job.log());
    }
    let found = wait_for_view(&job, &manifest, Duration::from_secs(60)).await;
    assert_stops_exact(&job, &mut worker, &found, &manifest);
    restart_clickhouse_and_check(&job, &manifest).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clickhouse_restart_brings_back_no_rows_a_fold_repair_removed() {
    let _server = SERVER.lock().await;
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    // One event per second and partition: 25 minutes of event time, most windows final.
    let manifest = produce_spaced(&topic, 2, 17, 3_000, 1_000).await;
    let job = Job::new(&topic, "");
    let fold_often = ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s");
    // A fold step killed after attaching its rows, before logging its frontier: the next holder
    // rebuilds the folded table without them.
    let mut worker = job.spawn(&[
        ("TALLY_FAULT", "fold_after_insert"),
        ("TALLY_FAULT_EPOCH", "1"),
        fold_often,
    ]);
    let status =
        wait_exit(&mut worker, Duration::from_secs(60)).expect("the fault kills the worker");
    assert_eq!(status.signal(), Some(9), "log:\n{}", job.log());
    let before = job.log().len();
    let mut worker = job.spawn(&[fold_often]);
    job.wait_until_consuming(before).await;
    let found = wait_for_view(&job, &manifest, Duration::from_secs(90)).await;
    assert_stops_exact(&job, &mut worker, &found, &manifest);
    let run = &job.log()[before..];
    assert!(
        run.contains("repaired=true"),
        "the restart repairs the fold; log:\n{run}"
    );

    restart_clickhouse_and_check(&job, &manifest).await;
    let folded = ch_count(&format!(
        "SELECT count() FROM {}.{}_final",
        job.database, job.table
    ))
    .await;
    let distinct = ch_count(&format!(
        "SELECT uniqExact(window_start, customer_id, currency) FROM {}.{}_final",
        job.database, job.table
    ))
    .await;
    assert!(folded > 0, "the job folded");
    assert_eq!(folded, distinct, "each folded key once");
}
