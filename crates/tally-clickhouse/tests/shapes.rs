//! The sink against the local ClickHouse server (`scripts/services.sh up`): rows of a declared
//! shape written through `write_batch` read back exactly from the view, revenue_agg's as before,
//! and a commit log of an earlier release gains `filtered_count` in place.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use tally_clickhouse::{Batch, ClickHouseSink, Shape, SinkSettings, WriteOutcome};
use tally_core::declare::{Declaration, WindowRules};
use tally_core::{Amount, Epoch, GroupKey, OutputRow, WindowAgg, WindowKey, Word};

const CLICKHOUSE: &str = "http://127.0.0.1:8123";
/// 2026-09-21 14:20:00 UTC.
const T0: i64 = 1_790_000_400_000;
const MINUTE: i64 = 60_000;

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{}", std::process::id(), nanos % 1_000_000)
}

fn client() -> clickhouse::Client {
    clickhouse::Client::default()
        .with_url(CLICKHOUSE)
        .with_setting("wait_end_of_query", "1")
        .with_validation(false)
}

async fn ch(sql: &str) {
    client()
        .query(sql)
        .execute()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn sink(database: &str, table: &str, shape: Option<Shape>) -> ClickHouseSink {
    let settings = SinkSettings {
        url: CLICKHOUSE.into(),
        database: database.into(),
        table: table.into(),
        user: "default".into(),
        password: tally_clickhouse::Secret::default(),
        ca_file: None,
        request_timeout: Duration::from_secs(30),
        shape: tally_clickhouse::Shape::revenue_agg(),
        cluster: None,
    };
    let mut sink = ClickHouseSink::connect(&settings)
        .await
        .unwrap_or_else(|e| panic!("is ClickHouse up (scripts/services.sh up)? {e}"));
    if let Some(shape) = shape {
        sink = sink.with_shape(shape).unwrap();
    }
    sink.ensure_schema().await.unwrap();
    sink
}

/// Writes `batch` and publishes the answer, as the job's read side does after a commit.
async fn write_and_publish(sink: &ClickHouseSink, batch: &Batch<'_>) -> WriteOutcome {
    let outcome = sink.write_batch(batch, "events", |_| {}).await.unwrap();
    let lease = sink.claim_read_side("shapes").await.unwrap().unwrap();
    sink.publish(&lease, |_| {}, false).await.unwrap();
    sink.release_read_side(&lease).await.unwrap();
    outcome
}

fn batch<'a>(
    job: &'a str,
    epoch: u64,
    offsets: &[(i32, i64, i64)],
    rows: &'a [OutputRow],
    filtered_count: u64,
) -> Batch<'a> {
    Batch {
        job,
        epoch: Epoch(epoch),
        offsets: offsets.to_vec(),
        watermarks: vec![T0; offsets.len()],
        rows,
        event_count: rows.len() as u64,
        revenue_units: 0,
        dead_letters: 0,
        filtered_count,
        duplicate_count: 0,
        stale_count: 0,
        tombstone_count: 0,
        source_lsn: 0,
    }
}

/// Three keys of different types (String, Int64, Decimal(18, 2), UInt8); count, max of a float,
/// avg of a float (kept as sum and count) and min of a decimal.
fn mixed_shape() -> Shape {
    let declaration: Declaration = serde_json::from_value(serde_json::json!({
        "event_id": "id",
        "event_time": "at",
        "group_by": ["page", "user", "price", "mobile"],
        "field": [
            {"name": "id", "type": "string"},
            {"name": "at", "type": "timestamp"},
            {"name": "page", "type": "string"},
            {"name": "user", "type": "integer"},
            {"name": "price", "type": "decimal", "scale": 2},
            {"name": "mobile", "type": "boolean"},
            {"name": "load", "type": "float"},
        ],
        "aggregate": [
            {"column": "views", "function": "count"},
            {"column": "slowest", "function": "max", "field": "load"},
            {"column": "mean", "function": "avg", "field": "load"},
            {"column": "cheapest", "function": "min", "field": "price"},
        ],
    }))
    .unwrap();
    let job = declaration
        .resolve(WindowRules {
            size_ms: MINUTE,
            slide_ms: None,
            allowed_lateness_ms: 0,
            dedup_horizon_ms: 3_600_000,
        })
        .unwrap();
    Shape::of(&job)
}

/// A window of the mixed shape: (views, slowest, mean's sum, cheapest in cents).
fn mixed(
    partition: i32,
    minute: i64,
    key: [&str; 4],
    (views, slowest, sum, cheapest): (u64, f64, f64, i64),
) -> OutputRow {
    OutputRow {
        partition,
        key: WindowKey {
            window_start_ms: T0 + minute * MINUTE,
            key: GroupKey::from(key),
        },
        window_end_ms: T0 + (minute + 1) * MINUTE,
        value: WindowAgg::new([
            Word::Count(views),
            Word::Float(slowest),
            Word::Float(sum),
            Word::Count(views),
            Word::Exact(cheapest),
        ]),
    }
}

/// A row of the mixed shape's view, by position: DateTime as seconds, decimals as cents.
#[derive(Debug, PartialEq, Deserialize, clickhouse::Row)]
struct MixedRow {
    window_start: u32,
    window_end: u32,
    page: String,
    user: i64,
    price: i64,
    mobile: u8,
    views: u64,
    slowest: f64,
    mean: f64,
    cheapest: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declared_shape_is_written_and_read_back_exactly() {
    let database = unique("tally_shapes");
    let sink = sink(&database, "mixed", Some(mixed_shape())).await;
    assert_eq!(
        sink.names().shape.view_columns(),
        [
            ("window_start", "DateTime"),
            ("window_end", "DateTime"),
            ("page", "String"),
            ("user", "Int64"),
            ("price", "Decimal(18, 2)"),
            ("mobile", "UInt8"),
            ("views", "UInt64"),
            ("slowest", "Float64"),
            ("mean", "Float64"),
            ("cheapest", "Decimal(18, 2)"),
        ]
        .map(|(n, t)| (n.to_owned(), t.to_owned()))
    );
    // Bytes RowBinary must not escape: a quote, a tab, a newline, a multi-byte character.
    let home = "/home?q='x'\t\nü";
    let first = [
        mixed(0, 0, [home, "-42", "12.30", "1"], (3, 2.5, 6.0, 999)),
        mixed(1, 0, [home, "-42", "12.30", "1"], (1, 4.0, 4.0, 1005)),
        mixed(1, 1, ["/cart", "7", "0.05", "0"], (1, 0.25, 0.25, 5)),
    ];
    let b1 = batch("mixed", 1, &[(0, 0, 10), (1, 0, 4)], &first, 2);
    assert_eq!(write_and_publish(&sink, &b1).await, WriteOutcome::Written);
    // Partition 0's window again, at a later version: it replaces the earlier one.
    let second = [mixed(0, 0, [home, "-42", "12.30", "1"], (4, 3.5, 9.5, 950))];
    let b2 = batch("mixed", 2, &[(0, 10, 12)], &second, 0);
    assert_eq!(write_and_publish(&sink, &b2).await, WriteOutcome::Written);
    assert_eq!(
        sink.write_batch(&b2, "events", |_| {}).await.unwrap(),
        WriteOutcome::AlreadyCommitted
    );

    let rows: Vec<MixedRow> = client()
        .query(&format!(
            "SELECT * FROM {database}.mixed ORDER BY window_start, page"
        ))
        .fetch_all()
        .await
        .unwrap();
    let t0 = u32::try_from(T0 / 1000).unwrap();
    assert_eq!(
        rows,
        [
            // Partition 0's newest version merged with partition 1's: views summed, the
            // slowest the max, the mean (9.5 + 4.0) / (4 + 1), the cheapest the min.
            MixedRow {
                window_start: t0,
                window_end: t0 + 60,
                page: home.to_owned(),
                user: -42,
                price: 1230,
                mobile: 1,
                views: 5,
                slowest: 4.0,
                mean: 2.7,
                cheapest: 950,
            },
            MixedRow {
                window_start: t0 + 60,
                window_end: t0 + 120,
                page: "/cart".to_owned(),
                user: 7,
                price: 5,
                mobile: 0,
                views: 1,
                slowest: 0.25,
                mean: 0.25,
                cheapest: 5,
            },
        ]
    );
    // The versions as written, key types included.
    let versions: Vec<(i64, i32, String, i64, String, u8)> = client()
        .query(&format!(
            "SELECT version, source_partition, page, user, toString(price), mobile FROM {database}.mixed_data \
             ORDER BY version, source_partition, page"
        ))
        .fetch_all()
        .await
        .unwrap();
    assert_eq!(
        versions,
        [
            (4, 1, "/cart".into(), 7, "0.05".into(), 0),
            (4, 1, home.into(), -42, "12.30".into(), 1),
            (10, 0, home.into(), -42, "12.30".into(), 1),
            (12, 0, home.into(), -42, "12.30".into(), 1),
        ]
    );
    let filtered: Vec<(u64, u64)> = client()
        .query(&format!(
            "SELECT epoch, filtered_count FROM {database}.mixed_commits ORDER BY epoch"
        ))
        .fetch_all()
        .await
        .unwrap();
    assert_eq!(filtered, [(1, 2), (2, 0)]);

    // A row that does not fit the shape is refused before anything is written.
    let bad = [mixed(0, 2, ["/x", "1.5", "1.00", "1"], (1, 1.0, 1.0, 1))];
    let refused = sink
        .write_batch(
            &batch("mixed", 3, &[(0, 12, 13)], &bad, 0),
            "events",
            |_| {},
        )
        .await;
    assert!(
        matches!(&refused, Err(tally_clickhouse::SinkError::Row(e)) if e.contains("user") && e.contains("1.5")),
        "{refused:?}"
    );
    let count: u64 = client()
        .query(&format!("SELECT count() FROM {database}.mixed_data"))
        .fetch_one()
        .await
        .unwrap();
    assert_eq!(count, 4);
    ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
}

fn orders(partition: i32, minute: i64, customer: &str, n: u64, revenue: &str) -> OutputRow {
    OutputRow {
        partition,
        key: WindowKey::of_orders(T0 + minute * MINUTE, customer, "EUR"),
        window_end_ms: T0 + (minute + 1) * MINUTE,
        value: WindowAgg::of_orders(n, Amount::parse(revenue).unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn revenue_aggs_rows_read_back_as_before() {
    let database = unique("tally_shapes_rev");
    let sink = sink(&database, "revenue_agg", None).await;
    let rows = [
        orders(0, 0, "c1", 3, "30.5"),
        orders(1, 0, "c1", 2, "-1.25"),
        orders(1, 1, "", 1, "0.0001"),
    ];
    let b1 = batch("revenue_agg", 1, &[(0, 0, 10), (1, 0, 8)], &rows, 1);
    assert_eq!(write_and_publish(&sink, &b1).await, WriteOutcome::Written);
    let want: BTreeMap<_, _> = [
        ((T0, "c1".to_owned(), "EUR".to_owned()), (5, 292_500)),
        ((T0 + MINUTE, String::new(), "EUR".to_owned()), (1, 1)),
    ]
    .into_iter()
    .collect();
    assert_eq!(sink.read_view().await.unwrap(), want);
    assert_eq!(sink.read_committed_answer().await.unwrap(), want);
    ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
}

/// The commit log as releases before `filtered_count` created it.
const EARLIER_COMMIT_COLUMNS: &str = "batch_id String, job String, epoch UInt64, partitions Array(Int32), \
     from_offsets Array(Int64), to_offsets Array(Int64), watermarks Array(Int64), max_window_start DateTime, \
     row_count UInt64, event_count UInt64, revenue_sum Decimal(38, 4), dead_letters UInt64, committed_at DateTime";

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_log_of_an_earlier_release_gains_filtered_count() {
    // Sorted by window (the current key), and by epoch (rebuilt with the key after the column
    // is added).
    for key in ["max_window_start, batch_id", "epoch"] {
        let database = unique("tally_shapes_upgrade");
        let commits = format!("{database}.revenue_agg_commits");
        ch(&format!("CREATE DATABASE {database}")).await;
        ch(&format!(
            "CREATE TABLE {commits} ({EARLIER_COMMIT_COLUMNS}) ENGINE = MergeTree ORDER BY ({key})"
        ))
        .await;
        ch(&format!(
            "INSERT INTO {commits} (batch_id, job, epoch, partitions, from_offsets, to_offsets, watermarks, \
             max_window_start, row_count, event_count, revenue_sum, dead_letters, committed_at) VALUES \
             ('revenue_agg/events[0:5]', 'revenue_agg', 1, [0], [0], [5], [0], toDateTime(0), 0, 5, 0, 0, now())"
        ))
        .await;
        let sink = sink(&database, "revenue_agg", None).await;
        let column: Vec<(String, String)> = client()
            .query(&format!(
                "SELECT type, default_expression FROM system.columns WHERE database = '{database}' \
                 AND table = 'revenue_agg_commits' AND name = 'filtered_count'"
            ))
            .fetch_all()
            .await
            .unwrap();
        assert_eq!(column.len(), 1, "{key}: {column:?}");
        assert_eq!(column[0].0, "UInt64");
        // Validated again as it is now: nothing more to add.
        sink.ensure_schema().await.unwrap();
        let rows = [orders(0, 0, "c1", 1, "1")];
        let b2 = batch("revenue_agg", 2, &[(0, 5, 6)], &rows, 3);
        assert_eq!(
            sink.write_batch(&b2, "events", |_| {}).await.unwrap(),
            WriteOutcome::Written
        );
        let filtered: Vec<(u64, u64)> = client()
            .query(&format!(
                "SELECT epoch, filtered_count FROM {commits} ORDER BY epoch"
            ))
            .fetch_all()
            .await
            .unwrap();
        assert_eq!(filtered, [(1, 0), (2, 3)], "{key}");
        let sorting_key: String = client()
            .query(&format!(
                "SELECT sorting_key FROM system.tables WHERE database = '{database}' AND name = 'revenue_agg_commits'"
            ))
            .fetch_one()
            .await
            .unwrap();
        assert_eq!(sorting_key, "max_window_start, batch_id", "{key}");
        ch(&format!("DROP DATABASE IF EXISTS {database}")).await;
    }
}
