//! The change events Debezium 3.6.1 really emitted for a PostgreSQL `orders` table
//! (`scripts/connect/samples/`, recorded from the local services by `record.sh`: the initial
//! snapshot, updates and deletes under both replica identities, key changes, one and
//! interleaved transactions, incremental and blocking snapshots, a replay after a kill -9 of
//! Kafka Connect, a PostgreSQL restart, the JSON converter with and without schemas) read by the
//! operator of a change job. The table they describe, rebuilt by applying each row's events in
//! the order Kafka delivered them, aggregated by hour, customer and currency, must be what the
//! operator's windows say.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value as Json;
use tally_core::declare::{Declaration, WindowRules};
use tally_core::{
    CheckpointBarrier, Epoch, MemStore, OperatorConfig, Outcome, Program, Record, WindowAgg,
    WindowOperator, Word,
};

const HOUR_MS: i64 = 3_600_000;

const ORDERS: &str = r#"
format = "debezium-json"
primary_key = ["order_id"]
event_time = "created_at"
group_by = ["customer_id", "currency"]

[[field]]
name = "order_id"
type = "integer"
[[field]]
name = "customer_id"
type = "string"
allow_empty = true
[[field]]
name = "currency"
type = "string"
allow_empty = true
[[field]]
name = "amount"
type = "decimal"
scale = 2
[[field]]
name = "created_at"
type = "timestamp"

[[aggregate]]
column = "orders"
function = "count"
[[aggregate]]
column = "revenue"
function = "sum"
field = "amount"
"#;

/// One recorded Kafka record: partition, offset, value (`None`: a tombstone).
struct Sample {
    partition: i32,
    offset: i64,
    value: Option<Json>,
}

fn samples(file: &str) -> Vec<Sample> {
    let path = format!(
        "{}/../../scripts/connect/samples/{file}.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let r: Json = serde_json::from_str(l).expect("a recorded record");
            Sample {
                partition: r["partition"].as_i64().expect("partition") as i32,
                offset: r["offset"].as_i64().expect("offset"),
                value: Some(r["value"].clone()).filter(|v| !v.is_null()),
            }
        })
        .collect()
}

fn operator() -> (WindowOperator, Arc<tally_core::declare::Job>) {
    let declaration: Declaration = toml::from_str(ORDERS).expect("declaration");
    let rules = WindowRules {
        size_ms: HOUR_MS,
        slide_ms: None,
        // The recorded rows span 1999 to 2026: nothing is late.
        allowed_lateness_ms: 40 * 365 * 24 * HOUR_MS,
        dedup_horizon_ms: 0,
    };
    let job = Arc::new(declaration.resolve(rules).expect("valid declaration"));
    let config = OperatorConfig {
        window: job.windows,
        out_of_orderness_ms: 0,
        allowed_lateness_ms: rules.allowed_lateness_ms,
        dedup_horizon_ms: 0,
        windows_from_ms: None,
    };
    let program = Program::declared(Arc::clone(&job), 1 << 20);
    (
        WindowOperator::restore(config, program, Epoch(0), &BTreeMap::new()),
        job,
    )
}

/// The payload of a value, with or without the schema envelope.
fn payload(value: &Json) -> &Json {
    value.get("payload").unwrap_or(value)
}

/// (hour, customer, currency) -> (count, amount in cents) of `rows`.
fn aggregate(rows: &BTreeMap<i64, Json>) -> BTreeMap<(i64, String, String), (u64, i64)> {
    let mut out: BTreeMap<(i64, String, String), (u64, i64)> = BTreeMap::new();
    for row in rows.values() {
        let t = tally_core::time::parse_rfc3339_ms(row["created_at"].as_str().expect("created_at"))
            .expect("a time");
        let amount = tally_core::declare::parse_decimal(row["amount"].as_str().expect("amount"), 2)
            .expect("a decimal");
        let key = (
            t - t.rem_euclid(HOUR_MS),
            row["customer_id"].as_str().expect("customer").to_owned(),
            row["currency"].as_str().expect("currency").to_owned(),
        );
        let slot = out.entry(key).or_default();
        slot.0 += 1;
        slot.1 += amount;
    }
    out
}

/// The operator's windows merged over partitions, emptied groups left out.
fn windows(
    store: &MemStore,
    job: &tally_core::declare::Job,
) -> BTreeMap<(i64, String, String), (u64, i64)> {
    let mut merged: BTreeMap<(i64, String, String), WindowAgg> = BTreeMap::new();
    for ((_, k), v) in &store.windows {
        let slot = merged
            .entry((
                k.window_start_ms,
                k.key.part(0).to_owned(),
                k.key.part(1).to_owned(),
            ))
            .or_insert_with(|| job.empty_value());
        job.merge(slot, v).expect("merge");
    }
    merged
        .into_iter()
        .filter_map(|(k, v)| match v.words() {
            [Word::Count(0), ..] => None,
            [Word::Count(n), Word::Exact(s)] => Some((k, (*n, *s))),
            other => panic!("words {other:?}"),
        })
        .collect()
}

/// What a replay of recorded files gives: each record's outcome (named `file:line`), the table
/// rebuilt in delivery order, the store and the job.
struct Replayed {
    outcomes: Vec<(String, Outcome)>,
    table: BTreeMap<i64, Json>,
    store: MemStore,
    job: Arc<tally_core::declare::Job>,
}

/// Feeds `files` in order, with a checkpoint every 37 records.
fn replay(files: &[&str]) -> Replayed {
    let (mut op, job) = operator();
    let mut store = MemStore::default();
    let mut table: BTreeMap<i64, Json> = BTreeMap::new();
    let mut outcomes = Vec::new();
    for file in files {
        for (i, s) in samples(file).into_iter().enumerate() {
            let bytes = s.value.as_ref().map(|v| v.to_string().into_bytes());
            let record = Record {
                partition: s.partition,
                offset: s.offset,
                timestamp_ms: None,
                key: None,
                value: bytes.as_deref(),
            };
            let Ok(outcome) = op.process(&store, record);
            outcomes.push((format!("{file}:{}", i + 1), outcome));
            if let Some(v) = &s.value {
                let p = payload(v);
                match p["op"].as_str() {
                    Some("d") => {
                        table.remove(&p["before"]["order_id"].as_i64().expect("key"));
                    }
                    Some(_) => {
                        table.insert(
                            p["after"]["order_id"].as_i64().expect("key"),
                            p["after"].clone(),
                        );
                    }
                    None => panic!("no op in {v}"),
                }
            }
            if i % 37 == 36 {
                let epoch = op.current_epoch();
                store.apply(&op.handle_checkpoint(CheckpointBarrier {
                    epoch,
                    is_final: false,
                }));
            }
        }
    }
    let epoch = op.current_epoch();
    let cp = op.handle_checkpoint(CheckpointBarrier {
        epoch,
        is_final: false,
    });
    store.apply(&cp);
    for p in store.partitions.values() {
        assert!(p.totals.balances(), "{:?}", p.totals);
    }
    Replayed {
        outcomes,
        table,
        store,
        job,
    }
}

/// What one connector delivered, in order, up to the blocking snapshot raced by an open
/// transaction (09b, below).
const BEFORE_THE_RACE: [&str; 10] = [
    "01-initial-snapshot",
    "02-replica-identity-default",
    "03-replica-identity-full",
    "04-primary-key-update-full",
    "05-primary-key-update-default",
    "06-one-transaction",
    "07-interleaved-transactions",
    "08-incremental-snapshot",
    "08b-incremental-snapshot-open-transaction",
    "09-blocking-snapshot",
];

/// Everything one connector delivered, but the blocking snapshot raced by an open transaction
/// (below): the table Kafka's order describes is the view's.
#[test]
fn the_recorded_changes_aggregate_to_the_table_they_describe() {
    let mut files = BEFORE_THE_RACE.to_vec();
    files.extend(["11-kill-9-replay", "12-after-postgres-restart"]);
    let Replayed {
        outcomes,
        table,
        store,
        job,
    } = replay(&files);
    let count = |o: Outcome| outcomes.iter().filter(|(_, x)| *x == o).count();
    let odd: Vec<_> = outcomes
        .iter()
        .filter(|(_, o)| matches!(o, Outcome::DeadLettered(_) | Outcome::Stale))
        .collect();
    assert!(odd.is_empty(), "{odd:?}");
    // The replay after Connect's kill -9 re-sent the changes since its last offset flush.
    assert!(
        count(Outcome::Duplicate) >= 10,
        "{}",
        count(Outcome::Duplicate)
    );
    assert!(count(Outcome::Tombstone) >= 4);
    assert_eq!(windows(&store, &job), aggregate(&table));
    assert!(table.len() > 400, "{}", table.len());
}

/// The JSON converter's schema envelope reads as the bare payload does.
#[test]
fn changes_with_the_schema_envelope_read_as_without() {
    let Replayed {
        outcomes,
        table,
        store,
        job,
    } = replay(&["10-schemas-enabled"]);
    assert!(
        outcomes
            .iter()
            .all(|(_, o)| matches!(o, Outcome::Aggregated | Outcome::Tombstone)),
        "{outcomes:?}"
    );
    assert_eq!(windows(&store, &job), aggregate(&table));
}

/// A blocking snapshot whose signal raced a transaction left open across it: Debezium can give
/// the snapshot's reads the position of the next commit, so that the open transaction's
/// update, delivered after the read, sorts before it. tally orders by position and counts that
/// update stale: the reason the docs ask for incremental snapshots (whose positions order every
/// such case, as above). This test pins the behaviour, so that a change in either shows.
#[test]
fn a_blocking_snapshot_raced_by_an_open_transaction_can_sort_after_a_newer_update() {
    let mut files = BEFORE_THE_RACE.to_vec();
    files.push("09b-blocking-snapshot-open-transaction");
    let outcomes = replay(&files).outcomes;
    let stale: Vec<_> = outcomes
        .iter()
        .filter(|(at, o)| *o == Outcome::Stale && at.starts_with("09b"))
        .collect();
    assert!(!stale.is_empty(), "the recorded race no longer shows");
}
