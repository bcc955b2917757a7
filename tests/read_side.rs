//! The read side (publishing and folding) against the real services: one holder at a time, and
//! nothing an earlier holder still runs on the server can land after a later one's fence.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use common::*;

/// The fold steps of `job` that the server runs now (earlier builds folded straight into the
/// folded table; this one into a stage table of the read side's generation).
async fn running_fold_inserts(job: &Job) -> u64 {
    let db = &job.database;
    ch_count(&format!(
        "SELECT count() FROM system.processes WHERE query LIKE 'INSERT INTO {db}.revenue_agg_final %' \
         OR query LIKE 'INSERT INTO {db}__revenue_agg__read%.fold%'"
    ))
    .await
}

/// (rows, distinct keys) of the folded table.
async fn folded_rows_and_keys(job: &Job) -> (u64, u64) {
    let (db, t) = (&job.database, &job.table);
    clickhouse()
        .query(&format!(
            "SELECT count(), uniqExact(window_start, customer_id, currency) FROM {db}.{t}_final"
        ))
        .fetch_one()
        .await
        .unwrap()
}

/// The reproduction: a backlog folded in one long step, the worker SIGKILLed while the
/// server runs that step's insert (which the server finishes on its own), and restarted at
/// once. Before the read side was fenced, the restarted worker folded the same range again and
/// the orphaned insert landed too: every key of the step twice, for good.
#[tokio::test(flavor = "multi_thread")]
async fn a_folder_killed_mid_insert_and_restarted_at_once_counts_nothing_twice() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    // 200k customers over 6 hours of event time: nearly every event is a window of its own, so
    // the step folds about as many versions as there are events.
    let events: usize = std::env::var("TALLY_TEST_FOLD_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(600_000);
    let spec = tally_tools::loadgen::LoadSpec {
        customers: 200_000,
        skew: 0.0,
        duplicate_fraction: 0.0,
        poison_fraction: 0.0,
        late_fraction: 0.0,
        filtered_fraction: 0.0,
        step_ms: i64::try_from(6 * 3_600_000 * 2 / events).unwrap().max(1),
        ..spec(31, 2)
    };
    let mut generator =
        tally_tools::loadgen::Generator::new(spec, common::revenue_agg(), rules()).unwrap();
    let records: Vec<_> = (0..events).map(|_| generator.next_record()).collect();
    let mut manifest = common::Manifest {
        source_topic: topic.clone(),
        ..Default::default()
    };
    for chunk in records.chunks(50_000) {
        produce_into(&topic, chunk, &mut manifest).await;
    }
    drop(records);
    let job = Job::new(&topic, "");
    let started = Instant::now();
    eprintln!("produced {events} records");

    // Catch up with folding off: every final window's versions wait for one step.
    let before = job.log().len();
    let mut worker = job.spawn(&[("TALLY_CLICKHOUSE__FOLD_INTERVAL", "0s")]);
    job.wait_until_consuming(before).await;
    let caught_up = wait_for_view(&job, &manifest, Duration::from_secs(600)).await;
    assert_view_eq(&caught_up, &manifest.rows, &job.log());
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(60)).is_some_and(|s| s.success()));
    eprintln!("caught up in {:?}", started.elapsed());

    // Fold it all in one step, and kill the worker while the server runs the step's insert.
    let folding = [
        ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s"),
        ("TALLY_CLICKHOUSE__FOLD_STEP_ROWS", "100000000"),
    ];
    let mut worker = job.spawn(&folding);
    let until = Instant::now() + Duration::from_secs(120);
    while running_fold_inserts(&job).await == 0 {
        assert!(
            Instant::now() < until,
            "no fold step started; log:\n{}",
            job.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker.kill().unwrap();
    let status = worker.wait().unwrap();
    assert_eq!(status.signal(), Some(9));
    assert!(
        running_fold_inserts(&job).await > 0,
        "the killed step's insert must outlast the worker for this test to mean anything: \
         raise TALLY_TEST_FOLD_EVENTS"
    );
    let killed_at = Instant::now();

    // Restarted at once, as a supervisor would.
    let before = job.log().len();
    let mut worker = job.spawn(&folding);
    job.wait_until_consuming(before).await;
    eprintln!(
        "restarted {:?} after the kill; the killed step's insert {}",
        killed_at.elapsed(),
        if running_fold_inserts(&job).await > 0 {
            "runs still"
        } else {
            "ended (killed by the new holder's fence, or done)"
        }
    );
    let orphan = tokio::spawn({
        let database = job.database.clone();
        async move {
            let (db, t0) = (database, Instant::now());
            loop {
                let running: u64 = ch_count(&format!(
                    "SELECT count() FROM system.processes WHERE query LIKE 'INSERT INTO {db}.revenue_agg_final %' \
                     OR query LIKE 'INSERT INTO {db}__revenue_agg__read%.fold%'"
                ))
                .await;
                if running == 0 {
                    return t0.elapsed();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    // Until folding has caught up: the logged frontier stops moving.
    let logged = format!(
        "SELECT toUInt64(max(frontier)) FROM {}.{}_folds",
        job.database, job.table
    );
    let until = Instant::now() + Duration::from_secs(300);
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_secs(4)).await;
        let now = ch_count(&logged).await;
        if now > 0 && now == last {
            break;
        }
        last = now;
        assert!(
            Instant::now() < until,
            "folding did not settle; log:\n{}",
            job.log()
        );
    }
    assert_eq!(
        running_fold_inserts(&job).await,
        0,
        "nothing of the killed step runs any more"
    );
    eprintln!("settled {:?} after the kill", killed_at.elapsed());
    eprintln!(
        "the restart saw fold inserts for {:?}",
        orphan.await.unwrap()
    );
    let (rows, keys) = folded_rows_and_keys(&job).await;
    assert!(rows > 0, "the backlog was folded");
    assert_eq!(rows, keys, "every folded window and key once");
    let view = view(&job.database, &job.table).await.unwrap_or_else(|e| {
        panic!("the view shows a key twice or cannot be read: {e}");
    });
    assert_stops_exact(&job, &mut worker, &view, &manifest);
}

fn signal(worker: &Worker, name: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(worker.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

/// The read side is any worker's: when its holder goes silent (paused past the session timeout,
/// as a hung or partitioned host is), another worker claims it, fencing the silent one, and
/// publishing resumes within the session timeout. The woken holder's statements are refused.
#[tokio::test(flavor = "multi_thread")]
async fn the_read_side_moves_to_another_worker_when_its_holder_goes_silent() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(53, 2, 6_000);
    let mut manifest = common::Manifest {
        source_topic: topic.clone(),
        ..Default::default()
    };
    produce_into(&topic, &records[..3_000], &mut manifest).await;
    let first = Job::new(&topic, "");
    let second = first.replica();
    let folding = [("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s")];
    let before = first.log().len();
    let mut a = first.spawn(&folding);
    first.wait_until_consuming(before).await;
    wait_for_view(&first, &manifest, Duration::from_secs(90)).await;
    first
        .wait_for_log(0, "holding the read side", Duration::from_secs(30))
        .await;
    let mut b = second.spawn(&folding);
    second
        .wait_for_log(
            0,
            "another process holds the read side",
            Duration::from_secs(60),
        )
        .await;

    // The holder goes silent; the other worker takes the read side (and the job) over.
    signal(&a, "STOP");
    let silent = Instant::now();
    produce_into(&topic, &records[3_000..], &mut manifest).await;
    second
        .wait_for_log(0, "holding the read side", Duration::from_secs(60))
        .await;
    let moved = silent.elapsed();
    eprintln!("the read side moved {moved:?} after its holder went silent");
    assert!(
        moved < Duration::from_secs(10 + 4),
        "publishing resumes within the session timeout (10 s) and a watch: {moved:?}"
    );
    let caught_up = wait_for_view(&second, &manifest, Duration::from_secs(120)).await;
    assert_view_eq(&caught_up, &manifest.rows, &second.log());

    // Woken, the old holder is fenced: it stands down, and the view stays exact.
    signal(&a, "CONT");
    let woken = wait_exit(&mut a, Duration::from_secs(60));
    eprintln!("the woken worker exited: {woken:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let view = view(&second.database, &second.table)
        .await
        .unwrap_or_else(|e| panic!("the view after the old holder woke: {e}"));
    assert_stops_exact(&second, &mut b, &view, &manifest);
    let (rows, keys) = folded_rows_and_keys(&second).await;
    assert_eq!(rows, keys, "every folded window and key once");
}
