//! Several processes of one job, as a `replicas: 3` deployment starts them (same config, each
//! with its own state directory): one of them commits the job, the others refuse with the
//! reason, and the view and the dead-letter topic stay exact through kills of the one that
//! commits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::process::Child;
use std::time::{Duration, Instant};

use common::*;
use tally_state::StateStore;

const REFUSAL: &str = "another worker commits job";
const CATCH_UP: Duration = Duration::from_secs(120);

/// Waits until all but one of `workers` have exited; returns the index of the one running.
fn wait_for_one_survivor(workers: &mut [Child], jobs: &[&Job], timeout: Duration) -> usize {
    let until = Instant::now() + timeout;
    loop {
        let running: Vec<usize> = (0..workers.len())
            .filter(|&i| matches!(workers[i].try_wait(), Ok(None)))
            .collect();
        if running.len() == 1 {
            return running[0];
        }
        if running.is_empty() || Instant::now() > until {
            let logs: Vec<String> = jobs.iter().map(|j| j.log()).collect();
            panic!(
                "{} workers running, expected one; logs:\n{}",
                running.len(),
                logs.join("\n-----\n")
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn assert_refused(worker: &mut Child, job: &Job) {
    let status = wait_exit(worker, Duration::from_secs(60)).expect("the replica stops");
    assert!(!status.success(), "a refusal is an error exit");
    assert!(
        job.log().contains(REFUSAL),
        "the replica says why it stopped; log:\n{}",
        job.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_started_together_leave_one_writer_and_the_results_exact() {
    let topic = unique("orders");
    create_topic(&topic, 3).await;
    let records = generate(23, 3, 60_000);
    let mut manifest = tally::loadgen::Manifest::default();
    produce_into(&topic, &records[..40_000], &mut manifest).await;
    let first = Job::new(&topic, "");
    let (second, third) = (first.replica(), first.replica());
    let jobs = [&first, &second, &third];
    let mut workers: Vec<Child> = jobs.iter().map(|j| j.spawn(&[])).collect();

    let survivor = wait_for_one_survivor(&mut workers, &jobs, Duration::from_secs(90));
    for i in (0..workers.len()).filter(|&i| i != survivor) {
        assert_refused(&mut workers[i], jobs[i]);
    }
    let owner = jobs[survivor];

    // The owner is killed mid-run and restarted; more input arrives meanwhile.
    wait_for_first_batch(owner).await;
    workers[survivor].kill().unwrap();
    workers[survivor].wait().unwrap();
    produce_into(&topic, &records[40_000..], &mut manifest).await;

    // A refused replica started again while the owner is down still refuses: its state
    // directory is not the job's.
    let loser = (0..jobs.len()).find(|&i| i != survivor).unwrap();
    let before = jobs[loser].log().len();
    let mut again = jobs[loser].spawn(&[]);
    assert_refused(&mut again, jobs[loser]);
    assert!(jobs[loser].log()[before..].contains(REFUSAL));

    let before = owner.log().len();
    let mut worker = owner.spawn(&[]);
    owner.wait_until_consuming(before).await;
    let view = wait_for_view(owner, &manifest, CATCH_UP).await;
    assert_stops_exact(owner, &mut worker, &view, &manifest);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replica_started_beside_a_running_worker_refuses_and_the_worker_carries_on() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(29, 2, 20_000);
    let mut manifest = tally::loadgen::Manifest::default();
    produce_into(&topic, &records[..10_000], &mut manifest).await;
    let owner = Job::new(&topic, "");
    let before = owner.log().len();
    let mut worker = owner.spawn(&[]);
    owner.wait_until_consuming(before).await;
    wait_for_first_batch(&owner).await;

    let replica = owner.replica();
    let mut second = replica.spawn(&[]);
    assert_refused(&mut second, &replica);
    // On call, doctor says the same of the replica's directory.
    let (ok, report) = doctor(&replica);
    assert!(!ok, "{report}");
    assert_eq!(
        status_of(&report, "Persisted → Processed"),
        "FAIL",
        "{report}"
    );
    assert!(report.contains("not the job's state directory"), "{report}");
    produce_into(&topic, &records[10_000..], &mut manifest).await;

    // The owner carried on: it catches up and stops cleanly.
    let view = wait_for_view(&owner, &manifest, CATCH_UP).await;
    assert_stops_exact(&owner, &mut worker, &view, &manifest);
    let (_, report) = doctor(&owner);
    assert_eq!(
        status_of(&report, "Persisted → Processed"),
        "PASS",
        "{report}"
    );
    assert!(
        report.contains("committed by this state directory's writer"),
        "{report}"
    );
}

/// The state a directory holds: windows, dedup entries and the checkpoint (progress, cutoffs).
#[derive(Debug, PartialEq)]
struct State {
    windows: Vec<(i32, tally_core::WindowKey, tally_core::WindowAgg)>,
    seen: Vec<(i32, String, i64)>,
    checkpoint: tally_state::CheckpointMeta,
}

fn state_of(job: &Job) -> State {
    let store = StateStore::open(&job.state_dir(), &format!("it@{}", job.topic)).unwrap();
    State {
        windows: store.windows().unwrap(),
        seen: store.seen_entries().unwrap(),
        checkpoint: store.meta().expect("a checkpoint"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_state_directory_is_rebuilt_from_the_changelog_exactly_and_the_job_goes_on() {
    let topic = unique("orders");
    create_topic(&topic, 3).await;
    // Ten minutes of event time per partition: some windows close, some stay open.
    let records = generate_spaced(31, 3, 30_000, 60);
    let mut manifest = tally::loadgen::Manifest::default();
    produce_into(&topic, &records[..20_000], &mut manifest).await;
    let first = Job::new(&topic, "");
    let before = first.log().len();
    let mut worker = first.spawn(&[]);
    first.wait_until_consuming(before).await;
    let view = wait_for_view(&first, &manifest, CATCH_UP).await;
    assert_stops_exact(&first, &mut worker, &view, &manifest);

    // The machine is lost; a new one restores the job from the changelog into an empty
    // directory: the state is the previous owner's, exactly.
    let second = first.replica();
    let (ok, out) = tally_command(&second, "restore", &[]);
    assert!(ok, "{out}");
    assert!(out.contains("restored epoch"), "{out}");
    let (restored, original) = (state_of(&second), state_of(&first));
    assert!(!original.windows.is_empty() && !original.seen.is_empty());
    assert!(!original.checkpoint.closed_windows_before.is_empty());
    assert_eq!(restored, original);
    // Restoring again over a checkpoint is refused.
    let (ok, out) = tally_command(&second, "restore", &[]);
    assert!(
        !ok && out.contains("restore only into an empty directory"),
        "{out}"
    );

    // The new worker carries on; the old one, should it come back, is refused.
    produce_into(&topic, &records[20_000..], &mut manifest).await;
    let before = second.log().len();
    let mut worker = second.spawn(&[]);
    second.wait_until_consuming(before).await;
    let view = wait_for_view(&second, &manifest, CATCH_UP).await;
    let mut old = first.spawn(&[]);
    assert_refused(&mut old, &first);
    assert_stops_exact(&second, &mut worker, &view, &manifest);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_completes_the_epoch_the_lost_worker_committed_in_kafka_only() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 37, 6_000).await;
    let first = Job::new(&topic, "");
    // Killed right after the first epoch's transaction committed: ClickHouse lacks that epoch.
    let mut worker = first.spawn(&[("TALLY_FAULT", "after_dlq_commit")]);
    let status = wait_exit(&mut worker, Duration::from_secs(60)).expect("killed by the fault");
    assert!(!status.success());

    let second = first.replica();
    let (ok, out) = tally_command(&second, "restore", &[]);
    assert!(ok, "{out}");
    assert!(out.contains("not in ClickHouse yet"), "{out}");
    let before = second.log().len();
    let mut worker = second.spawn(&[]);
    second.wait_until_consuming(before).await;
    let view = wait_for_view(&second, &manifest, CATCH_UP).await;
    assert_stops_exact(&second, &mut worker, &view, &manifest);
}
