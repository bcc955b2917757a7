//! Several workers share one job (`job.tasks`), through Kafka's group protocol: each task runs
//! on one worker at a time and moves when a worker is killed, stops or joins. The view and the
//! dead-letter topic stay exact, every partition's accounting balances, and the commit log is
//! one chain per partition (no offset range committed twice).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const PARTITIONS: i32 = 4;
const CATCH_UP: Duration = Duration::from_secs(120);

/// Each task's newest checkpoint over every worker's directory: balanced per partition, each
/// partition consumed exactly up to its offset, summing to `produced`.
fn assert_tasks_account_for(workers: &[&Job], produced: u64) {
    let mut consumed = 0;
    let mut partitions = BTreeSet::new();
    for task in 0..PARTITIONS {
        let newest = workers
            .iter()
            .filter_map(|w| {
                let dir = w.state_dir().join(format!("task-{task}"));
                dir.exists().then(|| {
                    let store = tally_state::StateStore::open(
                        &dir,
                        &format!("{}@{}#task-{task}", w.name, w.topic),
                    )
                    .unwrap();
                    store.meta()
                })?
            })
            .max_by_key(|m| m.epoch)
            .unwrap_or_else(|| panic!("no worker holds a checkpoint of task {task}"));
        assert_eq!(newest.status, tally_state::EpochStatus::Committed);
        for (p, c) in &newest.partitions {
            assert_eq!(
                *p % PARTITIONS,
                task,
                "task {task} holds only its partitions"
            );
            assert!(c.totals.balances(), "partition {p}: {:?}", c.totals);
            assert_eq!(c.totals.consumed as i64, c.next_offset, "partition {p}");
            consumed += c.totals.consumed;
            partitions.insert(*p);
        }
    }
    assert_eq!(partitions.len(), PARTITIONS as usize);
    assert_eq!(consumed, produced);
}

/// A task's state in a worker's directory: windows, dedup entries, checkpoint.
type TaskState = (
    Vec<(i32, tally_core::WindowKey, tally_core::WindowAgg)>,
    Vec<(i32, String, i64)>,
    tally_state::CheckpointMeta,
);

fn task_state(worker: &Job, task: i32) -> Option<TaskState> {
    let dir = worker.state_dir().join(format!("task-{task}"));
    if !dir.exists() {
        return None;
    }
    let store = tally_state::StateStore::open(
        &dir,
        &format!("{}@{}#task-{task}", worker.name, worker.topic),
    )
    .unwrap();
    let meta = store.meta()?;
    Some((
        store.windows().unwrap(),
        store.seen_entries().unwrap(),
        meta,
    ))
}

#[tokio::test(flavor = "multi_thread")]
async fn three_workers_share_a_job_and_its_tasks_move_on_kill_stop_and_join() {
    let topic = unique("orders");
    create_topic(&topic, PARTITIONS).await;
    let a = Job::new(&topic, "tasks = 4\nsession_timeout = \"6s\"");
    let (b, c, d) = (a.replica(), a.replica(), a.replica());
    let records = generate(71, PARTITIONS, 9_000);
    let mut manifest = Manifest::default();

    let mut workers = [a.spawn(&[]), b.spawn(&[]), c.spawn(&[])];
    produce_into(&topic, &records[..3_000], &mut manifest).await;
    let view = wait_for_view(&a, &manifest, CATCH_UP).await;
    assert_view_eq(
        &view,
        &manifest.rows,
        &format!("{}\n{}\n{}", a.log(), b.log(), c.log()),
    );
    // The group spread the four tasks: every task runs, on more than one worker. The view can
    // be complete before the last worker's join has moved a task to it, so allow that a while.
    let started =
        || -> Vec<Vec<u32>> { [&a, &b, &c].iter().map(|w| started_tasks(w, 0)).collect() };
    wait_until(Duration::from_secs(30), || {
        started().iter().filter(|t| !t.is_empty()).count() >= 2
    })
    .await;
    let spread = started();
    println!("tasks started per worker: {spread:?}");
    let all: BTreeSet<u32> = spread.iter().flatten().copied().collect();
    assert_eq!(all, (0..4).collect(), "{spread:?}");
    assert!(
        spread.iter().filter(|t| !t.is_empty()).count() >= 2,
        "{spread:?}"
    );

    // Kill a worker that runs tasks: after the session timeout they move and resume.
    let victim = spread.iter().position(|t| !t.is_empty()).unwrap();
    let _ = workers[victim].kill();
    let _ = workers[victim].wait();
    produce_into(&topic, &records[3_000..6_000], &mut manifest).await;
    let view = wait_for_view(&a, &manifest, CATCH_UP).await;
    assert_view_eq(
        &view,
        &manifest.rows,
        &format!("{}\n{}\n{}", a.log(), b.log(), c.log()),
    );

    // Stop another with SIGTERM (final checkpoints, then it leaves), and a fourth joins.
    let stopping = (0..3).find(|i| *i != victim).unwrap();
    sigterm(&workers[stopping]);
    assert!(
        wait_exit(&mut workers[stopping], Duration::from_secs(60)).is_some_and(|s| s.success()),
        "clean stop"
    );
    let joined_at = d.log().len();
    let mut fourth = d.spawn(&[]);
    produce_into(&topic, &records[6_000..], &mut manifest).await;
    let view = wait_for_view(&a, &manifest, CATCH_UP).await;
    let logs = || format!("{}\n{}\n{}\n{}", a.log(), b.log(), c.log(), d.log());
    assert_view_eq(&view, &manifest.rows, &logs());
    let remaining = (0..3).find(|i| *i != victim && *i != stopping).unwrap();
    // The group rebalanced onto the newcomer, which ran at least one task.
    wait_until(Duration::from_secs(30), || {
        !started_tasks(&d, joined_at).is_empty()
    })
    .await;
    assert!(!started_tasks(&d, joined_at).is_empty(), "{}", d.log());
    // It joined a running job: it warmed its copies first, so a task given to it resumed
    // after a catch-up, not a whole restore while the task waited.
    let newcomer = d.log()[joined_at..].to_owned();
    assert!(
        newcomer.contains("warming this worker's copies of its tasks before joining"),
        "{newcomer}"
    );
    assert!(
        newcomer.contains("caught the state up with the changelog on taking the lease"),
        "{newcomer}"
    );
    println!(
        "after the kill of worker {victim} and the stop of worker {stopping}: {:?}; the fourth runs {:?}",
        [&a, &b, &c].map(|w| started_tasks(w, 0)),
        started_tasks(&d, joined_at)
    );

    for worker in [&mut workers[remaining], &mut fourth] {
        sigterm(worker);
        assert!(
            wait_exit(worker, Duration::from_secs(60)).is_some_and(|s| s.success()),
            "clean stop:\n{}",
            logs()
        );
    }
    let view = common::view(&a.database, &a.table).await.unwrap();
    assert_view_eq(&view, &manifest.rows, &logs());
    let dead = read_dead_letters(&a.dlq_topic());
    assert_eq!(
        sorted(dead),
        expected_dead_letters(&manifest),
        "dead letters exactly once"
    );
    assert_tasks_account_for(&[&a, &b, &c, &d], manifest.produced);

    // Tasks taken away from a live worker (when another joined) were handed over after their
    // epochs committed, never taken by fencing their old holder.
    let all_logs = logs();
    assert!(all_logs.contains("handed tasks over"), "{all_logs}");
    assert!(!all_logs.contains("its new holder fenced it"), "{all_logs}");

    // A task restored from the changelog on a machine that never held it equals, key by key,
    // the state its last holder had.
    let newcomer = a.replica();
    let (ok, out) = tally_command(&newcomer, "restore", &["--task", "2"]);
    assert!(ok, "{out}");
    let restored = task_state(&newcomer, 2).expect("the restored task");
    let last_holder = [&a, &b, &c, &d]
        .into_iter()
        .filter_map(|w| task_state(w, 2))
        .max_by_key(|s| s.2.epoch)
        .unwrap();
    assert_eq!(restored.2.epoch, last_holder.2.epoch);
    assert_eq!(
        restored, last_holder,
        "restored task 2 differs from its last holder's state"
    );

    // One chain per partition: no offset range committed twice, none missing.
    let (ok, report) = doctor(&a);
    let written = status_of(&report, "Processed → Written");
    assert_eq!(written, "PASS", "{report}");
    assert!(report.contains("contiguous"), "{report}");
    let _ = ok;
}

fn signal(child: &std::process::Child, signal: &str) {
    std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_worker_wakes_to_find_its_tasks_moved_changes_nothing_and_carries_on() {
    let topic = unique("orders");
    create_topic(&topic, PARTITIONS).await;
    let a = Job::new(&topic, "tasks = 4\nsession_timeout = \"6s\"");
    let b = a.replica();
    let records = generate(73, PARTITIONS, 9_000);
    let mut manifest = Manifest::default();
    produce_into(&topic, &records[..3_000], &mut manifest).await;
    let mut paused = a.spawn(&[]);
    wait_for_first_batch(&a).await;
    let mut other = b.spawn(&[]);
    b.wait_for_log(0, "starting task", Duration::from_secs(60))
        .await;
    let logs = || format!("{}\n{}", a.log(), b.log());
    let view = wait_for_view(&a, &manifest, CATCH_UP).await;
    assert_view_eq(&view, &manifest.rows, &logs());

    // Paused past the session timeout: its tasks move to the other worker, which goes on.
    signal(&paused, "STOP");
    produce_into(&topic, &records[3_000..6_000], &mut manifest).await;
    let caught_up = wait_for_view(&b, &manifest, CATCH_UP).await;
    assert_view_eq(&caught_up, &manifest.rows, &logs());

    // Woken: it finds its tasks gone (fenced, or stopped by the group), writes nothing that
    // changes the view, and stays up for whatever the group gives it.
    let woken_at = a.log().len();
    signal(&paused, "CONT");
    a.wait_for_log(woken_at, "task", Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        matches!(paused.try_wait(), Ok(None)),
        "the woken worker stays up:\n{}",
        a.log()
    );
    let after = common::view(&a.database, &a.table).await.unwrap();
    assert_eq!(after, caught_up, "the woken worker changed the view");

    // Both carry on with the tasks the group gives them.
    produce_into(&topic, &records[6_000..], &mut manifest).await;
    let view = wait_for_view(&a, &manifest, CATCH_UP).await;
    assert_view_eq(&view, &manifest.rows, &logs());
    for worker in [&mut paused, &mut other] {
        sigterm(worker);
        assert!(
            wait_exit(worker, Duration::from_secs(60)).is_some_and(|s| s.success()),
            "clean stop:\n{}",
            logs()
        );
    }
    let dead = read_dead_letters(&a.dlq_topic());
    assert_eq!(
        sorted(dead),
        expected_dead_letters(&manifest),
        "dead letters exactly once"
    );
    assert_tasks_account_for(&[&a, &b], manifest.produced);
    println!(
        "tasks started: paused worker {:?}, other {:?}",
        started_tasks(&a, 0),
        started_tasks(&b, 0)
    );
}
