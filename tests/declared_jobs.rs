//! Jobs by declaration against the real services: a deployment whose job file named its fields
//! in `[fields]` switches to the declared revenue_agg (`config/revenue_agg.toml`'s
//! `[aggregation]`) on the same state directory, changelog and tables, after a kill -9, and
//! continues exactly once with the records produced since: it resumes from its checkpoint and
//! reprocesses nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;
use tally::loadgen::Manifest;

/// The `[aggregation]` section of the shipped job file, as it is written.
fn shipped_declaration() -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/revenue_agg.toml"
    ))
    .unwrap();
    let at = text
        .find("\n[aggregation]")
        .expect("an [aggregation] section");
    text[at..].to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_named_by_fields_continues_under_its_declaration_exactly_once() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(34, 2, 20_000);
    let (first, second) = records.split_at(10_000);
    let mut manifest = Manifest::default();
    produce_into(&topic, first, &mut manifest).await;
    let job = Job::new(&topic, "");
    let before_fields = std::fs::read_to_string(&job.config).unwrap();
    assert!(!before_fields.contains("[aggregation]"));

    // The deployment as it ran before, with the built-in field names: it catches up with the
    // first half and is killed.
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_view_eq(&view, &manifest.rows, &job.log());
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let committed_before = ch_count(&format!(
        "SELECT count() FROM {}.{}_commits",
        job.database, job.table
    ))
    .await;
    assert!(committed_before >= 1);
    let consumed_before: u64 = {
        let store =
            tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
                .unwrap();
        let meta = store.meta().expect("a checkpoint");
        meta.partitions.values().map(|c| c.totals.consumed).sum()
    };
    assert_eq!(consumed_before, manifest.produced);
    produce_into(&topic, second, &mut manifest).await;

    // The same job, its fields now declared.
    std::fs::write(
        &job.config,
        format!("{before_fields}\n{}", shipped_declaration()),
    )
    .unwrap();
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let restarted = job.log()[before..].to_owned();
    assert!(
        restarted.contains("resuming partition from checkpoint"),
        "resumed, not recomputed:\n{restarted}"
    );
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    // Every offset consumed exactly once across the two job files: nothing reprocessed.
    assert_eq!(assert_accounting(&job, manifest.produced), 2);
}

/// A hopping job of another shape: 5-minute windows sliding by a minute, keys read from a
/// nested path, a filter, count/min/max/avg of an integer. Records filtered out, duplicates and
/// poison are mixed in; the worker is killed with SIGKILL midway and restarted. The view then
/// holds exactly the windows computed here from the records, and every offset is accounted for
/// once (filtered ones included).
#[tokio::test(flavor = "multi_thread")]
async fn a_declared_hopping_job_with_a_filter_is_exact_after_a_kill_9() {
    const DECLARATION: &str = r#"
[window]
size = "5m"
slide = "1m"
out_of_orderness = "5s"
allowed_lateness = "1m"
dedup_horizon = "1h"

[aggregation]
event_id = "view_id"
event_time = "at"
group_by = ["page", "country"]
[[aggregation.field]]
name = "view_id"
type = "string"
[[aggregation.field]]
name = "at"
type = "timestamp"
[[aggregation.field]]
name = "page"
type = "string"
[[aggregation.field]]
name = "country"
type = "string"
path = "visitor.geo.country"
[[aggregation.field]]
name = "kind"
type = "string"
[[aggregation.field]]
name = "load_ms"
type = "integer"
[[aggregation.filter]]
field = "kind"
equals = "view"
[[aggregation.aggregate]]
column = "views"
function = "count"
[[aggregation.aggregate]]
column = "fastest_ms"
function = "min"
field = "load_ms"
[[aggregation.aggregate]]
column = "slowest_ms"
function = "max"
field = "load_ms"
[[aggregation.aggregate]]
column = "mean_ms"
function = "avg"
field = "load_ms"
"#;
    let topic = unique("views");
    create_topic(&topic, 2).await;
    let job = Job::new(&topic, "");
    let base = std::fs::read_to_string(&job.config).unwrap();
    std::fs::write(&job.config, format!("{base}\n{DECLARATION}")).unwrap();

    // Per partition, in event-time order (nothing late): 1 in 7 filtered, 1 in 11 a duplicate
    // of the record before it, 1 in 29 poison.
    let t0: i64 = 1_780_000_000_000;
    let mut records: Vec<(i32, Vec<u8>, Vec<u8>)> = Vec::new();
    // Per (window start in seconds, page, country): (views, min, max, sum of load_ms).
    type Window = (i64, String, String);
    let mut expected: std::collections::BTreeMap<Window, (u64, i64, i64, i64)> = Default::default();
    let (mut filtered, mut poison, mut duplicates) = (0u64, 0u64, 0u64);
    for i in 0..6_000i64 {
        let p = (i % 2) as i32;
        let at = t0 + i * 150;
        let page = format!("/p{}", i % 5);
        let country = ["NL", "DE", "FR"][(i % 3) as usize];
        let kind = if i % 7 == 3 { "click" } else { "view" };
        let load = (i * 37) % 900 + 1;
        let value = format!(
            r#"{{"view_id":"v{i}","at":{at},"page":"{page}","visitor":{{"geo":{{"country":"{country}"}}}},"kind":"{kind}","load_ms":{load}}}"#
        );
        if i % 29 == 5 {
            records.push((p, Vec::new(), b"{\"view_id\":".to_vec()));
            poison += 1;
        }
        records.push((p, Vec::new(), value.clone().into_bytes()));
        if kind == "click" {
            filtered += 1;
        } else {
            let newest = at.div_euclid(60_000) * 60_000;
            for k in 0..5 {
                let start = newest - k * 60_000;
                let w = expected
                    .entry((start / 1000, page.clone(), country.to_owned()))
                    .or_insert((0, i64::MAX, i64::MIN, 0));
                w.0 += 1;
                w.1 = w.1.min(load);
                w.2 = w.2.max(load);
                w.3 += load;
            }
        }
        if i % 11 == 4 {
            records.push((p, Vec::new(), value.into_bytes()));
            // The filter comes first: a filtered record's id is not remembered.
            if kind == "click" {
                filtered += 1;
            } else {
                duplicates += 1;
            }
        }
    }
    let (first, second) = records.split_at(records.len() / 2);
    produce(&topic, first).await;

    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    job.wait_for_log(before, "checkpoint committed", Duration::from_secs(60))
        .await;
    produce(&topic, second).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();

    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let sql = format!(
        "SELECT toUInt32(window_start), page, country, views, fastest_ms, slowest_ms, mean_ms \
         FROM {}.{} ORDER BY window_start, page, country",
        job.database, job.table
    );
    let until = std::time::Instant::now() + Duration::from_secs(120);
    type Row = (u32, String, String, u64, i64, i64, f64);
    let rows: Vec<Row> = loop {
        let rows: Vec<Row> = clickhouse()
            .query(&sql)
            .fetch_all()
            .await
            .unwrap_or_default();
        let views: u64 = rows.iter().map(|r| r.3).sum();
        let want: u64 = expected.values().map(|w| w.0).sum();
        if views == want || std::time::Instant::now() > until {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(rows.len(), expected.len(), "one row per window and key");
    for ((start, page, country, views, fastest, slowest, mean), ((w, p, c), e)) in
        rows.iter().zip(&expected)
    {
        assert_eq!(
            (i64::from(*start), page, country, *views, *fastest, *slowest),
            (*w, p, c, e.0, e.1, e.2)
        );
        let want = e.3 as f64 / e.0 as f64;
        assert!((mean - want).abs() <= want * 1e-9, "{mean} vs {want}");
    }
    let produced = records.len() as u64;
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    assert_eq!(assert_accounting(&job, produced), 2);
    let store =
        tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
            .unwrap();
    let mut totals = tally_core::Accounting::default();
    for c in store.meta().unwrap().partitions.values() {
        totals.add(&c.totals);
    }
    assert_eq!(
        (
            totals.filtered,
            totals.duplicates,
            totals.dead_lettered,
            totals.late
        ),
        (filtered, duplicates, poison, 0)
    );
    assert_eq!(read_dead_letters(&job.dlq_topic()).len() as u64, poison);
}
