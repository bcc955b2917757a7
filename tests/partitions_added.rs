//! Partitions added to the source topic are consumed, while the worker runs and across a
//! restart, with the same exactness as the others: the view and the dead-letter topic equal the
//! ground truth, and every partition's accounting balances.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};

const CATCH_UP: Duration = Duration::from_secs(90);

/// Grows `topic` to `count` partitions, as an operator would (`kafka-topics --alter`).
async fn add_partitions(topic: &str, count: usize) {
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .unwrap();
    let result = admin
        .create_partitions(
            &[NewPartitions::new(topic, count)],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .unwrap();
    assert!(result.iter().all(|r| r.is_ok()), "{result:?}");
}

fn partition_count(topic: &str) -> usize {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .unwrap();
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    metadata.topics()[0].partitions().len()
}

/// Grows `topic` from `from` to `to` partitions and produces records on the new ones: those of
/// a `to`-partition stream that fall on them. Each partition's stream is generated on its own,
/// so that subset is a stream with known fates too.
async fn grow_and_produce(
    topic: &str,
    from: i32,
    to: i32,
    seed: u64,
    n: usize,
    manifest: &mut Manifest,
) {
    add_partitions(topic, to as usize).await;
    let records: Vec<_> = generate(seed, to, n)
        .into_iter()
        .filter(|r| r.partition >= from)
        .collect();
    produce_into(topic, &records, manifest).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn partitions_added_while_running_and_while_stopped_are_consumed_exactly() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let first = generate(31, 2, 4_000);
    let mut manifest = Manifest {
        source_topic: topic.clone(),
        ..Manifest::default()
    };
    produce_into(&topic, &first[..2_000], &mut manifest).await;
    let job = Job::new(&topic, "");
    discover_partitions_every_second(&job);

    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(&job, &manifest, CATCH_UP).await;
    assert_view_eq(&view, &manifest.rows, &job.log());

    // While it runs: two more partitions, with records on them and on the old ones.
    let grown = job.log().len();
    grow_and_produce(&topic, 2, 4, 32, 4_000, &mut manifest).await;
    produce_into(&topic, &first[2_000..], &mut manifest).await;
    job.wait_for_log(grown, "partitions added to the source topic", CATCH_UP)
        .await;
    let view = wait_for_view(&job, &manifest, CATCH_UP).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    assert_eq!(assert_accounting(&job, manifest.produced), 4);
    // tally's own per-partition topic grew with the source.
    assert_eq!(partition_count(&format!("tally-{topic}-changelog")), 4);

    // While it is stopped: two more, with records, then a restart.
    grow_and_produce(&topic, 4, 6, 33, 6_000, &mut manifest).await;
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(&job, &manifest, CATCH_UP).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    assert_eq!(assert_accounting(&job, manifest.produced), 6);
    assert_eq!(partition_count(&format!("tally-{topic}-changelog")), 6);

    // The producer learnt the changelog's new partitions before writing to them: no
    // transaction failed on the way.
    assert!(
        !job.log().contains("sink write failed"),
        "a commit was retried:\n{}",
        job.log()
    );
    let (ok, out) = doctor(&job);
    assert!(ok, "doctor after the partitions were added:\n{out}");
}

/// A hand-made order of `partition` at event time `t_ms`: (record, what it is).
fn order(
    partition: i32,
    id: &str,
    t_ms: i64,
    kind: tally_tools::loadgen::Kind,
) -> tally_tools::loadgen::GeneratedRecord {
    let value = format!(
        r#"{{"event_id":"{id}","customer_id":"cust-new","currency":"EUR","amount":"1.5","event_time":{t_ms}}}"#
    );
    let contributes =
        (kind == tally_tools::loadgen::Kind::Valid).then(|| tally_tools::loadgen::Contribution {
            time_ms: t_ms,
            keys: vec!["cust-new".to_owned(), "EUR".to_owned()],
            inputs: vec![
                tally_tools::loadgen::Input::None,
                tally_tools::loadgen::Input::Exact(15_000),
            ],
        });
    tally_tools::loadgen::GeneratedRecord {
        partition,
        key: b"cust-new".to_vec(),
        value: value.into_bytes(),
        kind,
        contributes,
        late_ms: (kind == tally_tools::loadgen::Kind::Late).then_some(t_ms),
    }
}

/// A partition added after the job folded: its events in windows the job had made final (and
/// folded) are dead-lettered as late, not counted where no reader ever sees them; its later
/// events are aggregated. View and dead-letter topic equal the truth.
#[tokio::test(flavor = "multi_thread")]
async fn an_added_partition_s_events_in_windows_already_folded_are_late_not_lost() {
    use tally_tools::loadgen::Kind;
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    // One event per second and partition: 25 minutes of event time, most windows final.
    let mut manifest = produce_spaced(&topic, 2, 35, 3_000, 1_000).await;
    let start = spec(35, 2).start_ms;
    let newest = start + 3_000 * 1_000 / 2;
    let job = Job::new(&topic, "");
    discover_partitions_every_second(&job);
    let before = job.log().len();
    let mut worker = job.spawn(&[("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s")]);
    job.wait_until_consuming(before).await;
    wait_for_view(&job, &manifest, CATCH_UP).await;
    // Folded past the old events' windows.
    let folded = format!(
        "SELECT toUInt64(max(frontier)) FROM {}.{}_folds",
        job.database, job.table
    );
    let until = std::time::Instant::now() + CATCH_UP;
    loop {
        let frontier = ch_count(&folded).await;
        if frontier * 1_000 > u64::try_from(start + 600_000).unwrap() {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "no fold; log:\n{}",
            job.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let grown = job.log().len();
    add_partitions(&topic, 3).await;
    job.wait_for_log(grown, "partitions added to the source topic", CATCH_UP)
        .await;
    let records = [
        // In windows folded long ago: late for the job whichever partition carries them.
        order(2, "old-1", start + 60_000, Kind::Late),
        order(2, "old-2", start + 300_500, Kind::Late),
        // Newer than anything the job saw: aggregated.
        order(2, "new-1", newest + 30_000, Kind::Valid),
        order(2, "new-2", newest + 31_000, Kind::Valid),
    ];
    produce_into(&topic, &records, &mut manifest).await;
    let view = wait_for_view(&job, &manifest, CATCH_UP).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    assert_accounting(&job, manifest.produced);
    assert!(
        job.log().contains("already final for the job are late"),
        "log:\n{}",
        job.log()
    );
}
