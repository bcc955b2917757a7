//! A job of change events killed at each step of its commit, against the real chain
//! (PostgreSQL → Debezium → Kafka → tally → ClickHouse): before a pre-committed epoch is
//! committed, while that epoch is restored, half way through and just after its ClickHouse
//! insert, and inside a publish. Each run is armed with one step and reads a new batch of
//! changes (updates, deletes and key changes retract what earlier runs applied), so every crash
//! falls on rows whose earlier contributions are committed. Afterwards every change must be
//! applied once and the view must equal the same aggregation run on the table (`tally verify`,
//! which runs `reconcile --source --strict`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::capture::{captured_table, field, finish, loadgen, tail, verify_when_caught_up};
use common::*;

/// Runs the job armed with `fault` until the fault kills it.
fn killed_at(job: &Job, fault: &str) {
    let before = job.log().len();
    let mut worker = job.spawn(&[("TALLY_FAULT", fault)]);
    let status = wait_exit(&mut worker, Duration::from_secs(90))
        .unwrap_or_else(|| panic!("{fault} was not reached; log:\n{}", tail(&job.log())));
    let log = &job.log()[before..];
    assert!(
        std::os::unix::process::ExitStatusExt::signal(&status) == Some(9)
            && log.contains(&format!("point=\"{fault}\"")),
        "{fault}: killed there ({status:?}); log:\n{}",
        tail(log)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_change_job_killed_at_each_step_of_its_commit_applies_every_change_once() {
    let (_capture, job, manifest) = captured_table(300).await;
    let changes = |n: &str| finish(loadgen(&job, &manifest, &["--events", n, "--rate", "500"]));

    // A pre-committed epoch left behind, then a death while restoring it.
    killed_at(&job, "after_precommit");
    killed_at(&job, "during_restore");
    for fault in [
        "mid_clickhouse_insert",
        "after_clickhouse_insert",
        "publish_after_stage",
        "publish_after_replace",
    ] {
        changes("400");
        killed_at(&job, fault);
    }
    changes("400");

    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let (ok, report, summary) = verify_when_caught_up(&job, &manifest).await;
    println!("{report}");
    assert!(ok, "verify:\n{report}\nlog tail:\n{}", tail(&job.log()));
    assert_eq!(field(&summary, "dead_lettered"), 0, "{summary}");
    let recovered = job
        .log()
        .matches("completed the commit of a pre-committed epoch")
        .count();
    assert!(recovered >= 1, "a restart completed a pre-committed epoch");
    sigterm(&worker);
    wait_exit(&mut worker, Duration::from_secs(60));
}
