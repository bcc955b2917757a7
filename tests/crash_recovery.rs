//! Crash safety end to end: a worker child process is SIGKILLed at random and at every step of
//! the commit protocol, restarted, and the view and the dead-letter topic (read_committed) must
//! equal the ground truth exactly: nothing lost, nothing counted twice.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::*;

const CATCH_UP: Duration = Duration::from_secs(90);

async fn finish_and_check(job: &Job, manifest: &common::Manifest) {
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(job, manifest, CATCH_UP).await;
    assert_stops_exact(job, &mut worker, &view, manifest);
    assert_accounting(job, manifest.produced);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_run_then_restart_loses_and_duplicates_nothing() {
    let topic = unique("orders");
    create_topic(&topic, 3).await;
    let records = generate(7, 3, 90_000);
    let mut manifest = common::Manifest::default();
    produce_into(&topic, &records[..60_000], &mut manifest).await;
    let job = Job::new(&topic, "");
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    // Let it commit some epochs, then kill -9 wherever it is.
    wait_for_first_batch(&job).await;
    worker.kill().unwrap();
    let status = worker.wait().unwrap();
    assert_eq!(status.signal(), Some(9));
    // More input arrives while it is down; the restart must resume, not recompute.
    produce_into(&topic, &records[60_000..], &mut manifest).await;
    finish_and_check(&job, &manifest).await;
    assert!(job.log().contains("resuming partition from checkpoint"));
}

async fn crash_at(point: &str, extra_runs: &[&str]) {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 11, 3_000).await;
    let job = Job::new(&topic, "");
    for fault in std::iter::once(&point).chain(extra_runs) {
        let mut worker = job.spawn(&[("TALLY_FAULT", fault)]);
        let status =
            wait_exit(&mut worker, Duration::from_secs(60)).expect("the fault kills the worker");
        assert_eq!(
            status.signal(),
            Some(9),
            "{fault}: killed by SIGKILL; log:\n{}",
            job.log()
        );
        assert!(
            job.log().contains(&format!("point=\"{fault}\"")) || job.log().contains(fault),
            "{fault} reached"
        );
    }
    finish_and_check(&job, &manifest).await;
}

/// Kills the worker at a step of its first fold after epoch 1, then checks that the restart
/// repairs the fold and the view is exact.
async fn crash_while_folding(point: &str) {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    // One event per second and partition: 25 minutes of event time, most windows final.
    let manifest = produce_spaced(&topic, 2, 13, 3_000, 1_000).await;
    let job = Job::new(&topic, "");
    let mut worker = job.spawn(&[
        ("TALLY_FAULT", point),
        ("TALLY_FAULT_EPOCH", "1"),
        ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s"),
    ]);
    let status =
        wait_exit(&mut worker, Duration::from_secs(60)).expect("the fault kills the worker");
    assert_eq!(status.signal(), Some(9), "{point}: log:\n{}", job.log());
    assert!(job.log().contains(point), "{point} reached");
    finish_and_check(&job, &manifest).await;
    assert_folded(&job).await;
}

/// Kills the worker at a step of the publish after its first epoch, then checks that the
/// restart publishes and the view is exact.
async fn crash_while_publishing(point: &str) {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 15, 3_000).await;
    let job = Job::new(&topic, "");
    let mut worker = job.spawn(&[("TALLY_FAULT", point), ("TALLY_FAULT_EPOCH", "1")]);
    let status =
        wait_exit(&mut worker, Duration::from_secs(60)).expect("the fault kills the worker");
    assert_eq!(status.signal(), Some(9), "{point}: log:\n{}", job.log());
    assert!(job.log().contains(point), "{point} reached");
    finish_and_check(&job, &manifest).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_publish_stage() {
    crash_while_publishing("publish_after_stage").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_publish_replace() {
    crash_while_publishing("publish_after_replace").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_fold_insert() {
    crash_while_folding("fold_after_insert").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_fold_log() {
    crash_while_folding("fold_after_log").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_fold_install() {
    crash_while_folding("fold_after_install").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_pre_commit() {
    crash_at("after_precommit", &[]).await;
}

/// Pipelined checkpoints: the worker dies when an epoch is pre-committed while the one before
/// it is still on its way to the sinks. The restart completes both, oldest first.
#[tokio::test(flavor = "multi_thread")]
async fn crash_with_two_epochs_in_flight_recovers_both() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    // A backlog and short epochs: barriers come faster than the sinks commit.
    let manifest = produce_generated(&topic, 2, 14, 40_000).await;
    let job = Job::new(&topic, "");
    let mut worker = job.spawn(&[
        ("TALLY_FAULT", "two_in_flight"),
        ("TALLY_JOB__CHECKPOINT_INTERVAL", "20ms"),
    ]);
    let status =
        wait_exit(&mut worker, Duration::from_secs(90)).expect("the fault kills the worker");
    assert_eq!(status.signal(), Some(9), "log:\n{}", job.log());
    assert!(job.log().contains("two_in_flight"), "two_in_flight reached");
    let before = job.log().len();
    finish_and_check(&job, &manifest).await;
    let restart = &job.log()[before..];
    let recovered = restart
        .matches("completed the commit of a pre-committed epoch")
        .count();
    assert!(
        recovered >= 2,
        "the restart completes both epochs in flight, got {recovered}; log:\n{restart}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_dead_letter_commit() {
    crash_at("after_dlq_commit", &[]).await;
}

/// A first run commits half the input and stops cleanly, so the store holds a committed epoch
/// and the group's offsets show it; a second run, armed with `fault`, reads the other half
/// (dead letters included) in its first epoch and is killed there. Returns the manifest.
async fn second_run_killed_at(job: &Job, fault: &str) -> common::Manifest {
    let records = generate(15, 2, 6_000);
    let mut manifest = common::Manifest::default();
    produce_into(&job.topic, &records[..3_000], &mut manifest).await;
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(job, &manifest, CATCH_UP).await;
    assert_stops_exact(job, &mut worker, &view, &manifest);
    let first_half = manifest.dead_letters.len();
    produce_into(&job.topic, &records[3_000..], &mut manifest).await;
    assert!(
        manifest.dead_letters.len() > first_half,
        "the second half has poison"
    );
    let mut worker = job.spawn(&[("TALLY_FAULT", fault)]);
    let status =
        wait_exit(&mut worker, Duration::from_secs(60)).expect("the fault kills the worker");
    assert_eq!(status.signal(), Some(9), "log:\n{}", job.log());
    manifest
}

/// A committed epoch whose Kafka transaction is undone afterwards (as an abort by hand of a
/// hanging transaction does: its dead letters, changelog records and offsets are dropped). The
/// restart finds the group's offsets older than its last committed epoch and sends that epoch's
/// transaction again: dead letters exactly once, and a restore from the changelog equals the
/// worker's own state.
#[tokio::test(flavor = "multi_thread")]
async fn a_committed_epoch_that_kafka_lost_is_sent_again() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let job = Job::new(&topic, "");
    let manifest = second_run_killed_at(&job, "kafka_commit_lost").await;
    let before = job.log().len();
    finish_and_check(&job, &manifest).await;
    let restart = &job.log()[before..];
    assert!(
        restart.contains("the Kafka transaction of the last committed epoch is gone"),
        "the restart sends the lost epoch again; log:\n{restart}"
    );

    let replica = job.replica();
    let (ok, out) = tally_command(&replica, "restore", &[]);
    assert!(ok, "{out}");
    let state = |job: &Job| {
        let store =
            tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
                .unwrap();
        let meta = store.meta().unwrap();
        (
            store.windows().unwrap(),
            store.seen_entries().unwrap(),
            meta.epoch,
            meta.partitions,
        )
    };
    assert_eq!(
        state(&replica),
        state(&job),
        "the changelog holds every committed epoch"
    );
}

/// The same crash as `crash_after_dead_letter_commit`, with an earlier committed epoch held in
/// the store: checking that one against the group's offsets at the restart must not stop the
/// pending epoch from checking whether its own transaction committed (it did: sending it again
/// would repeat its dead letters).
#[tokio::test(flavor = "multi_thread")]
async fn crash_after_dead_letter_commit_of_a_later_epoch() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let job = Job::new(&topic, "");
    let manifest = second_run_killed_at(&job, "after_dlq_commit").await;
    let before = job.log().len();
    finish_and_check(&job, &manifest).await;
    let restart = &job.log()[before..];
    assert!(
        restart.contains("dead-letter transaction of this epoch already committed"),
        "{restart}"
    );
    assert!(
        !restart.contains("the Kafka transaction of the last committed epoch is gone"),
        "{restart}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_clickhouse_insert() {
    crash_at("after_clickhouse_insert", &[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_during_restore() {
    // Leave an epoch pre-committed, then die again while restoring it.
    crash_at("after_precommit", &["during_restore"]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_mid_clickhouse_insert_never_shows_half_a_batch() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 12, 3_000).await;
    let job = Job::new(&topic, "");
    let mut worker = job.spawn(&[("TALLY_FAULT", "mid_clickhouse_insert")]);
    let status = wait_exit(&mut worker, Duration::from_secs(60)).expect("killed");
    assert_eq!(status.signal(), Some(9), "log:\n{}", job.log());
    // Half the batch is in the data table, but the view shows none of it.
    let data_rows: u64 = clickhouse()
        .query(&format!(
            "SELECT count() FROM {}.{}_data",
            job.database, job.table
        ))
        .fetch_one()
        .await
        .unwrap();
    assert!(data_rows > 0, "half a batch was written");
    assert!(
        view(&job.database, &job.table).await.unwrap().is_empty(),
        "a reader never sees half a batch"
    );
    finish_and_check(&job, &manifest).await;
}

/// A committed epoch that Kafka undid, with the state directory that made it lost: a worker on
/// a directory restored from the changelog (which lacks the epoch) makes the epoch again from
/// the source, checks it against ClickHouse's record of it, and sends its transaction again:
/// dead letters exactly once, the view exact, nothing counted twice.
#[tokio::test(flavor = "multi_thread")]
async fn an_epoch_kafka_undid_is_made_again_without_the_directory_that_made_it() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let job = Job::new(&topic, "");
    let manifest = second_run_killed_at(&job, "kafka_commit_lost").await;
    // The machine of `job` is gone; another one restores the job from the changelog.
    let replica = job.replica();
    let (ok, out) = tally_command(&replica, "restore", &[]);
    assert!(ok, "{out}");
    let before = replica.log().len();
    let mut worker = replica.spawn(&[]);
    replica.wait_until_consuming(before).await;
    let view = wait_for_view(&replica, &manifest, CATCH_UP).await;
    assert_stops_exact(&replica, &mut worker, &view, &manifest);
    assert!(
        replica.log().contains("made it again from the source"),
        "log:\n{}",
        replica.log()
    );
    assert_accounting(&replica, manifest.produced);
}

/// The same, with the epoch's source records deleted meanwhile: it cannot be made again, and
/// the worker stops saying what was lost and what to run.
#[tokio::test(flavor = "multi_thread")]
async fn an_undone_epoch_that_cannot_be_made_again_stops_the_worker_saying_what_was_lost() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let job = Job::new(&topic, "");
    second_run_killed_at(&job, "kafka_commit_lost").await;
    let replica = job.replica();
    let (ok, out) = tally_command(&replica, "restore", &[]);
    assert!(ok, "{out}");
    // Retention takes the source records of the undone epoch.
    let ends = tally_kafka::topic_extent(
        &tally_kafka::KafkaSettings {
            brokers: BROKERS.into(),
            client: Default::default(),
        },
        &topic,
    )
    .unwrap();
    let deleter = tally_kafka::RecordDeleter::connect(&tally_kafka::KafkaSettings {
        brokers: BROKERS.into(),
        client: Default::default(),
    })
    .unwrap();
    deleter
        .delete_before(
            &topic,
            &ends.iter().map(|(p, (_, high))| (*p, *high)).collect(),
        )
        .await
        .unwrap();
    let before = replica.log().len();
    let mut worker = replica.spawn(&[]);
    let status = wait_exit(&mut worker, Duration::from_secs(90)).expect("the worker stops");
    assert!(!status.success());
    let log = &replica.log()[before..];
    let error = log
        .lines()
        .rev()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line; log:\n{log}"));
    eprintln!("{error}");
    assert!(error.contains("that Kafka no longer holds"), "{error}");
    assert!(error.contains("What is lost"), "{error}");
    assert!(
        error.contains("Run the worker whose state directory committed it"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_after_fold_stage() {
    crash_while_folding("fold_after_stage").await;
}

/// Killed while the server runs the step's (or the publish's) insert, which the server then
/// finishes on its own into a stage table nothing reads; enough versions for the insert to be
/// seen running.
async fn crash_during_insert(point: &str) {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_spaced(&topic, 2, 17, 20_000, 1_000).await;
    let job = Job::new(&topic, "");
    let mut worker = job.spawn(&[
        ("TALLY_FAULT", point),
        ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s"),
    ]);
    let status =
        wait_exit(&mut worker, Duration::from_secs(120)).expect("the fault kills the worker");
    assert_eq!(status.signal(), Some(9), "{point}: log:\n{}", job.log());
    assert!(job.log().contains(point), "{point} reached");
    finish_and_check(&job, &manifest).await;
    assert_folded(&job).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_during_fold_insert() {
    crash_during_insert("fold_during_insert").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn crash_during_publish_insert() {
    crash_during_insert("publish_during_insert").await;
}
