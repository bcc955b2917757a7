//! The ClickHouse sink with several writers of one job (real server): each writer numbers its
//! epochs on its own and commits its own source partitions, partitions move between writers,
//! and a zombie writes late. The view, folding and the commit-log checks go by partition and
//! offset, never by epoch.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use tally_clickhouse::{
    Batch, ClickHouseSink, Cut, FoldRules, ReadLease, SinkSettings, WriteOutcome,
};
use tally_core::{Amount, Epoch, OutputRow, WindowAgg, WindowKey};

/// 2026-09-21 14:20:00 UTC.
const T0: i64 = 1_790_000_400_000;
const MINUTE: i64 = 60_000;

type View = BTreeMap<(i64, String, String), (u64, i64)>;

async fn sink(database: &str) -> ClickHouseSink {
    let settings = SinkSettings {
        url: common::CLICKHOUSE.into(),
        database: database.into(),
        table: "revenue_agg".into(),
        user: "default".into(),
        password: tally_clickhouse::Secret::default(),
        ca_file: None,
        request_timeout: Duration::from_secs(30),
        shape: tally_clickhouse::Shape::revenue_agg(),
        cluster: None,
    };
    let sink = ClickHouseSink::connect(&settings).await.unwrap();
    sink.ensure_schema().await.unwrap();
    sink
}

fn row(partition: i32, minute: i64, customer: &str, orders: u64, revenue: &str) -> OutputRow {
    OutputRow {
        partition,
        key: WindowKey::of_orders(T0 + minute * MINUTE, customer, "EUR"),
        window_end_ms: T0 + (minute + 1) * MINUTE,
        value: WindowAgg::of_orders(orders, Amount::parse(revenue).unwrap()),
    }
}

/// One writer's batch: `offsets` (partition, from, to), each partition's watermark in minutes.
fn batch<'a>(
    epoch: u64,
    offsets: &[(i32, i64, i64)],
    watermark_minutes: &[i64],
    rows: &'a [OutputRow],
) -> Batch<'a> {
    Batch {
        job: "writers",
        epoch: Epoch(epoch),
        offsets: offsets.to_vec(),
        watermarks: watermark_minutes.iter().map(|m| T0 + m * MINUTE).collect(),
        rows,
        event_count: rows.iter().map(|r| r.value.orders()).sum(),
        revenue_units: 0,
        dead_letters: 0,
        filtered_count: 0,
        duplicate_count: 0,
        stale_count: 0,
        tombstone_count: 0,
        source_lsn: 0,
    }
}

/// The job's read side, as the worker holding it claims it: a generation of its own.
async fn read_side(sink: &ClickHouseSink) -> ReadLease {
    sink.claim_read_side("writers").await.unwrap().unwrap()
}

/// Writes a batch and publishes the answer, as the job's read side does after a commit.
async fn write(sink: &ClickHouseSink, lease: &ReadLease, batch: &Batch<'_>) -> WriteOutcome {
    let outcome = sink.write_batch(batch, "orders", |_| {}).await.unwrap();
    sink.publish(lease, |_| {}, false).await.unwrap();
    outcome
}

fn expected(rows: &[(i64, &str, u64, &str)]) -> View {
    rows.iter()
        .map(|(minute, customer, orders, revenue)| {
            (
                (
                    T0 + minute * MINUTE,
                    (*customer).to_owned(),
                    "EUR".to_owned(),
                ),
                (*orders, Amount::parse(revenue).unwrap().units()),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn writers_with_their_own_epochs_share_a_job_and_a_partition_moves_between_them() {
    let database = common::unique("writers");
    let sink = sink(&database).await;
    let lease = read_side(&sink).await;

    // Writer A runs partitions 0 and 1, writer B partition 2; both number epochs from 1.
    let a1 = [row(0, 0, "c1", 3, "30"), row(1, 0, "c1", 2, "2")];
    let b1 = [row(2, 0, "c2", 1, "1.5")];
    let a2 = [row(0, 0, "c1", 5, "50"), row(1, 1, "c3", 1, "1")];
    assert_eq!(
        write(
            &sink,
            &lease,
            &batch(1, &[(0, 0, 10), (1, 0, 8)], &[1, 1], &a1)
        )
        .await,
        WriteOutcome::Written
    );
    assert_eq!(
        write(&sink, &lease, &batch(1, &[(2, 0, 4)], &[1], &b1)).await,
        WriteOutcome::Written,
        "a second writer's epoch 1 is another batch, not a copy of the first writer's"
    );
    write(
        &sink,
        &lease,
        &batch(2, &[(0, 10, 20), (1, 8, 12)], &[2, 2], &a2),
    )
    .await;

    // Partition 1 moves to B, which continues its offsets (and so its versions) in its own
    // epoch 2; A keeps partition 0.
    let b2 = [row(1, 1, "c3", 4, "4"), row(2, 1, "c2", 2, "3")];
    write(
        &sink,
        &lease,
        &batch(2, &[(1, 12, 15), (2, 4, 9)], &[3, 3], &b2),
    )
    .await;
    let a3 = [row(0, 2, "c1", 1, "1")];
    write(&sink, &lease, &batch(3, &[(0, 20, 25)], &[4], &a3)).await;

    let want = expected(&[
        (0, "c1", 7, "52"),
        (0, "c2", 1, "1.5"),
        (1, "c3", 4, "4"),
        (1, "c2", 2, "3"),
        (2, "c1", 1, "1"),
    ]);
    assert_eq!(sink.read_view().await.unwrap(), want);

    // A zombie (A after it lost partition 1) writes its last batch of the partition again:
    // the same batch, already committed whoever wrote it, under any epoch.
    assert_eq!(
        write(
            &sink,
            &lease,
            &batch(9, &[(0, 10, 20), (1, 8, 12)], &[2, 2], &a2)
        )
        .await,
        WriteOutcome::AlreadyCommitted
    );
    let batches = sink.committed_batches().await.unwrap();
    assert_eq!(batches.len(), 5);
    assert!(tally_tools::prove::commit_log_gaps(&batches).is_empty());
    assert_eq!(
        sink.committed_offsets().await.unwrap(),
        BTreeMap::from([(0, 25), (1, 15), (2, 9)])
    );

    // The view as of a cut: A's first two batches and B's first.
    let cut = Cut(BTreeMap::from([(0, 20), (1, 12), (2, 4)]));
    assert_eq!(
        sink.read_view_at(&cut).await.unwrap(),
        expected(&[(0, "c1", 7, "52"), (0, "c2", 1, "1.5"), (1, "c3", 1, "1")])
    );

    // A late batch that is no copy (two histories of partition 1) cannot change the view,
    // being older than what readers see, and the chain check names it.
    let stale = [row(1, 1, "c3", 99, "99")];
    write(&sink, &lease, &batch(3, &[(1, 8, 11)], &[2], &stale)).await;
    assert_eq!(sink.read_view().await.unwrap(), want);
    let gaps = tally_tools::prove::commit_log_gaps(&sink.committed_batches().await.unwrap());
    assert!(
        gaps.iter()
            .any(|g| g.contains("two batches start partition 1 at offset 8")),
        "{gaps:?}"
    );

    // Folding waits for a watermark from every partition of the job, whoever committed it.
    let rules = FoldRules {
        window_size_ms: MINUTE,
        window_slide_ms: MINUTE,
        allowed_lateness_ms: MINUTE,
        retention_ms: None,
        step_rows: tally_clickhouse::FOLD_STEP_ROWS,
    };
    let outcome = sink.fold(&lease, rules, 4, |_| {}, false).await.unwrap();
    assert_eq!(
        outcome.frontier.seconds, 0,
        "a fourth partition has no watermark yet"
    );
    // Lowest watermark: partition 1 and 2 at minute 3 -> windows ending by minute 2 are final.
    let outcome = sink.fold(&lease, rules, 3, |_| {}, false).await.unwrap();
    assert_eq!(
        i64::from(outcome.frontier.seconds) * 1000,
        T0 + 2 * MINUTE,
        "{outcome:?}"
    );
    assert_eq!(outcome.folded_rows, 4);
    assert_eq!(sink.read_view().await.unwrap(), want);
    common::ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_log_sorted_by_epoch_is_rebuilt_sorted_by_window() {
    let database = common::unique("legacy");
    let sink = sink(&database).await;
    let lease = read_side(&sink).await;
    let rows = [row(0, 0, "c1", 3, "30"), row(1, 0, "c2", 1, "1")];
    write(
        &sink,
        &lease,
        &batch(1, &[(0, 0, 5), (1, 0, 3)], &[1, 1], &rows),
    )
    .await;
    let before = sink.read_view().await.unwrap();
    // The earlier layout: the same columns, sorted by epoch.
    let commits = format!("{database}.revenue_agg_commits");
    common::ch(&format!(
        "CREATE TABLE {commits}_legacy AS {commits} ENGINE = MergeTree ORDER BY epoch"
    ))
    .await;
    common::ch(&format!(
        "INSERT INTO {commits}_legacy SELECT * FROM {commits}"
    ))
    .await;
    common::ch(&format!("DROP TABLE {commits}")).await;
    common::ch(&format!("RENAME TABLE {commits}_legacy TO {commits}")).await;

    let sink = self::sink(&database).await;
    let key: String = common::clickhouse()
        .query(&format!(
            "SELECT sorting_key FROM system.tables WHERE database = '{database}' AND name = 'revenue_agg_commits'"
        ))
        .fetch_one()
        .await
        .unwrap();
    assert_eq!(key, "max_window_start, batch_id");
    assert_eq!(sink.read_view().await.unwrap(), before);
    assert_eq!(sink.committed_batches().await.unwrap().len(), 1);
    // And the job goes on writing into it.
    let more = [row(0, 1, "c1", 1, "1")];
    write(
        &sink,
        &lease,
        &batch(2, &[(0, 5, 6), (1, 3, 3)], &[2, 2], &more),
    )
    .await;
    assert_eq!(sink.read_view().await.unwrap().len(), 3);
    common::ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
}

/// Every batch sets every key to its own number, in two windows either side of a version
/// partition's boundary (so its rows land as two parts), while readers poll the view: a read
/// that shows two numbers saw half a batch.
#[tokio::test(flavor = "multi_thread")]
async fn a_reader_never_sees_half_a_batch() {
    let database = common::unique("halves");
    let sink = std::sync::Arc::new(sink(&database).await);
    let lease = read_side(&sink).await;
    // T0 is 14:20, so minute 9 and minute 10 fall in two 10-minute version partitions.
    let customers: Vec<String> = (0..100).map(|c| format!("c{c}")).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (sink, stop) = (sink.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut reads, mut halves) = (0u64, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let view = sink.read_view().await.unwrap();
                    let numbers: std::collections::BTreeSet<u64> =
                        view.values().map(|(orders, _)| *orders).collect();
                    reads += 1;
                    if numbers.len() > 1 {
                        halves.push(numbers);
                    }
                }
                (reads, halves)
            })
        })
        .collect();
    for n in 1..=300u64 {
        let rows: Vec<OutputRow> = [9, 10]
            .iter()
            .flat_map(|&minute| customers.iter().map(move |c| row(0, minute, c, n, "1")))
            .collect();
        let offsets = [(0, i64::try_from(n - 1).unwrap(), i64::try_from(n).unwrap())];
        write(&sink, &lease, &batch(n, &offsets, &[0], &rows)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut reads = 0;
    for reader in readers {
        let (n, halves) = reader.await.unwrap();
        reads += n;
        assert!(halves.is_empty(), "reads that saw two batches: {halves:?}");
    }
    assert!(reads > 100, "only {reads} reads");
    common::ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
}

/// Tables of the layout before publishing: a view that read the versions itself and no live
/// table. The read side's next holder publishes the answer, then swaps in the view that reads
/// it; until then the view of the earlier layout stays.
#[tokio::test(flavor = "multi_thread")]
async fn a_view_that_read_the_versions_is_replaced_once_the_answer_is_published() {
    let database = common::unique("prepublish");
    let sink = sink(&database).await;
    let lease = read_side(&sink).await;
    let rows = [row(0, 0, "c1", 3, "30"), row(1, 0, "c2", 1, "1")];
    write(
        &sink,
        &lease,
        &batch(1, &[(0, 0, 5), (1, 0, 3)], &[1, 1], &rows),
    )
    .await;
    let before = sink.read_view().await.unwrap();
    assert_eq!(before.len(), 2);
    let t = format!("{database}.revenue_agg");
    common::ch(&format!("DROP TABLE {t}")).await;
    common::ch(&format!("DROP TABLE {t}_live")).await;
    common::ch(&format!(
        "CREATE VIEW {t} AS SELECT window_start, window_end, customer_id, currency, \
         sum(orders) AS orders, toDecimal64(sum(revenue), 4) AS revenue FROM {t}_data \
         GROUP BY window_start, window_end, customer_id, currency"
    ))
    .await;
    let sink = self::sink(&database).await;
    assert_eq!(sink.read_view().await.unwrap(), before);
    let lease = read_side(&sink).await;
    sink.publish(&lease, |_| {}, false).await.unwrap();
    sink.install_logged_view(&lease).await.unwrap();
    assert_eq!(sink.read_view().await.unwrap(), before);
    let definition: String = common::clickhouse()
        .query(&format!(
            "SELECT create_table_query FROM system.tables WHERE database = '{database}' AND name = 'revenue_agg'"
        ))
        .fetch_one()
        .await
        .unwrap();
    assert!(definition.contains("revenue_agg_live"), "{definition}");
    common::ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
}
