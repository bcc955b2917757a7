//! Several processes of one job, as a `replicas: 3` deployment starts them (same config, each
//! with its own state directory): one runs the job and the others stand by, keeping their state
//! near the job's from the changelog; when it is killed, stopped, or paused past the session
//! timeout, a standby catches up the last epochs (or restores whole) and carries on, and the view
//! and the dead-letter topic stay exact throughout. A paused worker that wakes after its lease
//! moved changes nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::process::{Child, Command};
use std::time::Duration;

use common::*;
use tally_state::StateStore;

const CATCH_UP: Duration = Duration::from_secs(120);
const HOLDING: &str = "holding the job's lease";
const STANDING_BY: &str = "standing by";
const WARM: &str = "restored the job's state from the changelog";
const WARM_TAKEOVER: &str = "caught the state up with the changelog on taking the lease";
/// The broker's smallest session timeout: how long a silent worker keeps the lease.
const SESSION: &str = "session_timeout = \"6s\"";

fn signal(child: &Child, signal: &str) {
    Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
}

/// Waits until one of `jobs` logs that it holds the lease (after `from[i]`); returns its index.
async fn wait_for_holder(jobs: &[&Job], from: &[usize], timeout: Duration) -> usize {
    let until = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < until {
        for (i, job) in jobs.iter().enumerate() {
            if job.log().get(from[i]..).unwrap_or("").contains(HOLDING) {
                return i;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let logs: Vec<String> = jobs.iter().map(|j| j.log()).collect();
    panic!(
        "no worker took the lease; logs:\n{}",
        logs.join("\n-----\n")
    );
}

fn stop_standby(worker: &mut Child, job: &Job) {
    sigterm(worker);
    let status = wait_exit(worker, Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "a standby stops cleanly; log:\n{}",
        job.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replicas_run_one_worker_and_a_standby_takes_over_exactly_when_it_is_killed() {
    let topic = unique("orders");
    create_topic(&topic, 3).await;
    let records = generate(23, 3, 60_000);
    let mut manifest = common::Manifest::default();
    produce_into(&topic, &records[..30_000], &mut manifest).await;
    let first = Job::new(&topic, SESSION);
    let (second, third) = (first.replica(), first.replica());
    let jobs = [&first, &second, &third];
    let mut workers: Vec<Worker> = jobs
        .iter()
        .map(|j| j.spawn(&[("TALLY_JOB__STANDBY_REFRESH", "2s")]))
        .collect();

    let active = wait_for_holder(&jobs, &[0, 0, 0], Duration::from_secs(60)).await;
    wait_for_first_batch(jobs[active]).await;
    for (i, job) in jobs.iter().enumerate().filter(|(i, _)| *i != active) {
        job.wait_for_log(0, STANDING_BY, Duration::from_secs(30))
            .await;
        // Warm standbys: each restores the job's state while the active worker runs.
        job.wait_for_log(0, WARM, Duration::from_secs(60)).await;
        assert!(!job.log().contains(HOLDING), "only one worker runs the job");
        assert!(matches!(workers[i].try_wait(), Ok(None)), "a standby waits");
    }
    workers[active].kill().unwrap();
    workers[active].wait().unwrap();
    produce_into(&topic, &records[30_000..], &mut manifest).await;

    let standbys: Vec<usize> = (0..3).filter(|&i| i != active).collect();
    let candidates: Vec<&Job> = standbys.iter().map(|&i| jobs[i]).collect();
    let from: Vec<usize> = candidates.iter().map(|j| j.log().len()).collect();
    let next = standbys[wait_for_holder(&candidates, &from, Duration::from_secs(60)).await];
    let took_over = from[standbys.iter().position(|&i| i == next).unwrap()];
    // The takeover replays only what was committed since the standby's last round.
    jobs[next]
        .wait_for_log(took_over, WARM_TAKEOVER, Duration::from_secs(60))
        .await;
    assert!(
        !jobs[next].log()[took_over..].contains(WARM),
        "no whole restore at the takeover; log:\n{}",
        jobs[next].log()
    );
    let view = wait_for_view(jobs[next], &manifest, CATCH_UP).await;
    let last = standbys.into_iter().find(|&i| i != next).unwrap();
    stop_standby(&mut workers[last], jobs[last]);
    assert_stops_exact(jobs[next], &mut workers[next], &view, &manifest);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_worker_loses_its_lease_and_on_waking_changes_nothing() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(29, 2, 30_000);
    let mut manifest = common::Manifest::default();
    produce_into(&topic, &records[..15_000], &mut manifest).await;
    let zombie = Job::new(&topic, SESSION);
    let mut paused = zombie.spawn(&[]);
    zombie
        .wait_for_log(0, HOLDING, Duration::from_secs(60))
        .await;
    wait_for_first_batch(&zombie).await;
    let standby = zombie.replica();
    // A cold standby: its directory stays empty until it takes over.
    let mut worker = standby.spawn(&[("TALLY_JOB__STANDBY_REFRESH", "0s")]);
    standby
        .wait_for_log(0, STANDING_BY, Duration::from_secs(30))
        .await;
    // On call, doctor says what the standby's directory is.
    let (_, report) = doctor(&standby);
    assert_eq!(
        status_of(&report, "Persisted → Processed"),
        "WARN",
        "{report}"
    );
    assert!(report.contains("a standby's directory"), "{report}");

    // Paused mid-run past the session timeout: the standby takes the job over.
    signal(&paused, "STOP");
    produce_into(&topic, &records[15_000..], &mut manifest).await;
    standby
        .wait_for_log(0, HOLDING, Duration::from_secs(60))
        .await;
    let caught_up = wait_for_view(&standby, &manifest, CATCH_UP).await;
    assert_view_eq(&caught_up, &manifest.rows, &standby.log());

    // Woken, the paused worker finds its lease gone and stops without committing anything.
    signal(&paused, "CONT");
    let status = wait_exit(&mut paused, Duration::from_secs(60)).expect("the zombie stops");
    assert!(!status.success(), "{}", zombie.log());
    let log = zombie.log();
    assert!(
        log.contains("lost the lease") || log.contains("another worker commits job"),
        "{log}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = view(&standby.database, &standby.table).await.unwrap();
    assert_eq!(after, caught_up, "the zombie changed the view");
    assert_stops_exact(&standby, &mut worker, &after, &manifest);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_state_directory_is_rebuilt_exactly_and_a_stale_one_caught_up_or_set_aside() {
    let topic = unique("orders");
    create_topic(&topic, 3).await;
    // Ten minutes of event time per partition: some windows close, some stay open.
    let records = generate_spaced(31, 3, 45_000, 40);
    let mut manifest = common::Manifest::default();
    produce_into(&topic, &records[..20_000], &mut manifest).await;
    let first = Job::new(&topic, SESSION);
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

    // The new worker carries on from the restored state.
    produce_into(&topic, &records[20_000..30_000], &mut manifest).await;
    let before = second.log().len();
    let mut worker = second.spawn(&[]);
    second.wait_until_consuming(before).await;
    assert!(!second.log().contains("restored the job's state"));
    let view = wait_for_view(&second, &manifest, CATCH_UP).await;
    assert_stops_exact(&second, &mut worker, &view, &manifest);

    // The first directory comes back, behind the job: it is caught up with what the second
    // committed since, not resumed as it was and not restored whole.
    produce_into(&topic, &records[30_000..38_000], &mut manifest).await;
    let before = first.log().len();
    let mut worker = first.spawn(&[]);
    first
        .wait_for_log(before, WARM_TAKEOVER, Duration::from_secs(60))
        .await;
    assert!(!first.log()[before..].contains(WARM), "{}", first.log());
    let view = wait_for_view(&first, &manifest, CATCH_UP).await;
    assert_stops_exact(&first, &mut worker, &view, &manifest);

    // A directory holding an epoch pre-committed and never committed cannot be caught up (its
    // state may be ahead of the job's): it is set aside and the job restored.
    produce_into(&topic, &records[38_000..], &mut manifest).await;
    let third = first.replica();
    let mut worker = third.spawn(&[("TALLY_FAULT", "after_precommit")]);
    let status = wait_exit(&mut worker, Duration::from_secs(90)).expect("killed by the fault");
    assert!(!status.success(), "{}", third.log());
    assert!(third.log().contains(WARM), "{}", third.log());
    let before = first.log().len();
    let mut worker = first.spawn(&[]);
    first.wait_until_consuming(before).await;
    let view = wait_for_view(&first, &manifest, CATCH_UP).await;
    assert_stops_exact(&first, &mut worker, &view, &manifest);
    let before = third.log().len();
    let mut worker = third.spawn(&[]);
    third
        .wait_for_log(before, "moving it aside", Duration::from_secs(60))
        .await;
    let view = wait_for_view(&third, &manifest, CATCH_UP).await;
    assert_stops_exact(&third, &mut worker, &view, &manifest);
}

/// The state a directory holds: windows, dedup entries and the checkpoint (progress, cutoffs).
#[derive(Debug, PartialEq)]
struct State {
    windows: Vec<(i32, tally_core::WindowKey, tally_core::WindowAgg)>,
    seen: Vec<(i32, String, i64)>,
    checkpoint: tally_state::CheckpointMeta,
}

fn state_of(job: &Job) -> State {
    let store = StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic)).unwrap();
    State {
        windows: store.windows().unwrap(),
        seen: store.seen_entries().unwrap(),
        checkpoint: store.meta().expect("a checkpoint"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_changelog_truncated_below_its_restore_points_still_restores_exactly() {
    let topic = unique("orders");
    create_topic(&topic, 3).await;
    // Four hours of event time per partition, past the one-hour dedup horizon: the records of
    // the first hours end up dead, and the changelog is truncated below them.
    let records = generate_spaced(41, 3, 45_000, 1_000);
    let mut manifest = common::Manifest::default();
    let first = Job::new(&topic, SESSION);
    let before = first.log().len();
    let mut worker = first.spawn(&[]);
    first.wait_until_consuming(before).await;
    for part in records.chunks(9_000) {
        produce_into(&topic, part, &mut manifest).await;
        wait_for_view(&first, &manifest, CATCH_UP).await;
    }
    let view = wait_for_view(&first, &manifest, CATCH_UP).await;
    assert_stops_exact(&first, &mut worker, &view, &manifest);
    let changelog = format!("tally-{topic}-changelog");
    let extent = tally_kafka::topic_extent(
        &tally_kafka::KafkaSettings {
            brokers: BROKERS.into(),
            client: Default::default(),
        },
        &changelog,
    )
    .unwrap();
    assert!(
        extent.values().any(|(low, _)| *low > 0),
        "the changelog was truncated: {extent:?}; log:\n{}",
        first.log()
    );

    let second = first.replica();
    let (ok, out) = tally_command(&second, "restore", &[]);
    assert!(ok, "{out}");
    assert_eq!(state_of(&second), state_of(&first));
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

#[tokio::test(flavor = "multi_thread")]
async fn a_warm_standby_writes_the_epoch_the_lost_worker_committed_in_kafka_only() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 43, 6_000).await;
    let first = Job::new(&topic, "session_timeout = \"10s\"");
    // Killed right after the first epoch's transaction committed: ClickHouse lacks that epoch.
    let mut worker = first.spawn(&[("TALLY_FAULT", "after_dlq_commit")]);
    let status = wait_exit(&mut worker, Duration::from_secs(60)).expect("killed by the fault");
    assert!(!status.success());

    // Standing by until the killed worker's session ends, the standby applies that epoch from
    // the changelog; taking over, it finds the batch missing in ClickHouse and writes it.
    let second = first.replica();
    let mut worker = second.spawn(&[("TALLY_JOB__STANDBY_REFRESH", "1s")]);
    second
        .wait_for_log(0, HOLDING, Duration::from_secs(60))
        .await;
    let log = second.log();
    let held_at = log.find(HOLDING).unwrap();
    assert!(
        log[..held_at].contains(WARM),
        "the standby restored the state before taking over; log:\n{log}"
    );
    second
        .wait_for_log(
            held_at,
            "the last epoch's batch is not in ClickHouse and a standby round applied it",
            Duration::from_secs(30),
        )
        .await;
    let view = wait_for_view(&second, &manifest, CATCH_UP).await;
    assert_stops_exact(&second, &mut worker, &view, &manifest);
}
