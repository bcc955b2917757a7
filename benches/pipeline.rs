//! Throughput of the per-record hot path of revenue_agg (as declared): decode alone, and decode +
//! dedup + window update against the in-memory model and the RocksDB store, then the checkpoint
//! write; and reading records of other declarations (`[aggregation]`).
#![allow(clippy::expect_used)] // a benchmark that cannot set up should stop at once

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use tally_core::declare::{Declaration, Evaluation, Job, Value, WindowRules};
use tally_core::{
    CheckpointBarrier, Epoch, FieldMapping, GroupKey, MemStore, OperatorConfig, Program, Record,
    StateReader, WindowAgg, WindowKey, WindowOperator, WindowSpec,
};
use tally_state::StateStore;

const N: usize = 20_000;

fn records() -> Vec<Vec<u8>> {
    (0..N)
        .map(|i| {
            format!(
                r#"{{"event_id":"ord-{i}","customer_id":"cust-{:04}","currency":"EUR","amount":"{}.{:02}","event_time":{},"source":"bench"}}"#,
                i % 1000,
                i % 500,
                i % 100,
                1_790_000_000_000i64 + i as i64 * 10
            )
            .into_bytes()
        })
        .collect()
}

/// One epoch of `values`, processed and pre-committed as its first checkpoint.
fn process_and_pre_commit(store: &StateStore, values: &[Vec<u8>]) {
    let mut op = run(store, values);
    store
        .pre_commit(&op.handle_checkpoint(CheckpointBarrier {
            epoch: Epoch(1),
            is_final: false,
        }))
        .expect("pre-commit");
}

fn rules() -> OperatorConfig {
    OperatorConfig {
        window: WindowSpec::tumbling(60_000),
        out_of_orderness_ms: 5_000,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
        windows_from_ms: None,
    }
}

/// revenue_agg as config/revenue_agg.toml declares it.
fn revenue_agg() -> Program {
    Program::revenue_agg(&FieldMapping::default(), &rules(), 1 << 20).expect("revenue_agg")
}

fn run<S: StateReader>(store: &S, values: &[Vec<u8>]) -> WindowOperator {
    let mut op = WindowOperator::restore(rules(), revenue_agg(), Epoch(0), &BTreeMap::new());
    for (i, v) in values.iter().enumerate() {
        let r = Record {
            partition: (i % 4) as i32,
            offset: (i / 4) as i64,
            timestamp_ms: None,
            key: None,
            value: Some(v),
        };
        let _ = black_box(op.process(store, r).is_ok());
    }
    op
}

fn bench(c: &mut Criterion) {
    let values = records();
    let mut group = c.benchmark_group("hot_path");
    group.throughput(Throughput::Elements(N as u64));
    let job = revenue_agg().job;
    group.bench_function("decode", |b| {
        b.iter(|| {
            values
                .iter()
                .filter(|v| matches!(job.evaluate(Some(v), 1 << 20), Ok(Evaluation::Event(_))))
                .count()
        })
    });
    group.bench_function("process_mem_store", |b| {
        b.iter(|| run(&MemStore::default(), &values))
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let store = StateStore::open(dir.path(), "bench").expect("store");
    // Warm state: one epoch already checkpointed, so lookups hit RocksDB.
    process_and_pre_commit(&store, &values);
    group.bench_function("process_rocksdb_store", |b| b.iter(|| run(&store, &values)));
    group.bench_function("process_and_pre_commit_rocksdb", |b| {
        b.iter_batched(
            || tempfile::tempdir().expect("tempdir"),
            |dir| {
                let store = StateStore::open(dir.path(), "bench").expect("store");
                process_and_pre_commit(&store, &values);
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

fn page_views() -> Vec<Vec<u8>> {
    (0..N)
        .map(|i| {
            format!(
                r#"{{"view_id":"v-{i}","viewed_at":{},"page":"/p/{}","country":"{}","device":"{}","load_ms":{},"referrer":{{"host":"example.com"}}}}"#,
                1_790_000_000_000i64 + i as i64 * 10,
                i % 200,
                ["NL", "DE", "FR", "US"][i % 4],
                ["mobile", "desktop"][i % 2],
                100 + i % 900
            )
            .into_bytes()
        })
        .collect()
}

/// The `[aggregation]` section of a shipped job file, resolved with its window.
fn job(file: &str, rules: WindowRules) -> Job {
    let text = std::fs::read_to_string(format!(
        "{}/../../config/{file}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("job file");
    let table: toml::Table = toml::from_str(&text).expect("TOML");
    let declaration: Declaration = table
        .get("aggregation")
        .cloned()
        .expect("an [aggregation] section")
        .try_into()
        .expect("a declaration");
    declaration.resolve(rules).expect("valid")
}

/// Reading records by declaration: revenue_agg, and a hopping job's evaluation with its
/// windows per record.
fn declared(c: &mut Criterion) {
    let values = records();
    let mut group = c.benchmark_group("declare");
    group.throughput(Throughput::Elements(N as u64));
    let tumbling = WindowRules {
        size_ms: 60_000,
        slide_ms: None,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
    };
    let declared = job("revenue_agg.toml", tumbling);
    group.bench_function("revenue_agg_declared", |b| {
        b.iter(|| {
            values
                .iter()
                .filter(|v| {
                    matches!(
                        declared.evaluate(Some(v), 1 << 20),
                        Ok(Evaluation::Event(_))
                    )
                })
                .count()
        })
    });
    let hopping = job(
        "page_views.toml",
        WindowRules {
            size_ms: 300_000,
            slide_ms: Some(60_000),
            ..tumbling
        },
    );
    let views = page_views();
    group.bench_function("page_views_hopping_declared", |b| {
        b.iter(|| {
            let mut windows = 0usize;
            for v in &views {
                if let Ok(Evaluation::Event(e)) = hopping.evaluate(Some(v), 1 << 20) {
                    windows += hopping.windows.starts_of(e.event_time_ms).count();
                }
            }
            black_box(windows)
        })
    });
    // And the aggregation itself: each record's value added to its five windows' (count, min,
    // max, avg), windows held in a map hashed as the operator's (no dedup, no store).
    group.bench_function("page_views_hopping_aggregated", |b| {
        b.iter(|| {
            let mut windows: HashMap<WindowKey, WindowAgg, foldhash::quality::RandomState> =
                HashMap::default();
            for v in &views {
                let Ok(Evaluation::Event(e)) = hopping.evaluate(Some(v), 1 << 20) else {
                    continue;
                };
                let key = GroupKey::new(e.key.iter().map(|k| match k {
                    Value::Str(s) => s.clone(),
                    other => other.display(0).to_string().into(),
                }));
                for start in hopping.windows.starts_of(e.event_time_ms) {
                    let value = windows
                        .entry(WindowKey {
                            window_start_ms: start,
                            key: key.clone(),
                        })
                        .or_insert_with(|| hopping.empty_value());
                    hopping.add(value, &e.inputs).expect("in range");
                }
            }
            black_box(windows.len())
        })
    });
    // Nested objects: config/api_latency.toml reads seven fields under four parents.
    let api = job("api_latency.toml", tumbling);
    let requests: Vec<Vec<u8>> = (0..N)
        .map(|i| {
            format!(
                r#"{{"request_id":"r-{i}","service":{{"name":"svc-{}","env":"prod","region":"eu"}},"request":{{"route":"/api/{}","method":"GET"}},"response":{{"status":{},"bytes":512}},"timing":{{"started":{},"latency_ms":"{}.{:03}"}}}}"#,
                i % 20,
                i % 50,
                200 + (i % 3) * 100,
                1_790_000_000_000i64 + i as i64 * 10,
                i % 900,
                i % 1000
            )
            .into_bytes()
        })
        .collect();
    group.bench_function("api_latency_nested_declared", |b| {
        b.iter(|| {
            requests
                .iter()
                .filter(|v| matches!(api.evaluate(Some(v), 1 << 20), Ok(Evaluation::Event(_))))
                .count()
        })
    });
    // A job of change events: Debezium's envelope (about 600 bytes, the row under `after`)
    // read as config/orders.toml declares it.
    let orders = job(
        "orders.toml",
        WindowRules {
            size_ms: 3_600_000,
            slide_ms: None,
            allowed_lateness_ms: 6 * 3_600_000,
            dedup_horizon_ms: 0,
        },
    );
    let changes = changes();
    group.bench_function("orders_change_evaluated", |b| {
        b.iter(|| {
            changes
                .iter()
                .filter(|v| orders.evaluate_change(Some(v), 1 << 20).is_ok())
                .count()
        })
    });
    group.finish();
}

/// Debezium change events of config/orders.toml's table, as the connector writes them (updates
/// with `before` null, as under REPLICA IDENTITY DEFAULT).
fn changes() -> Vec<Vec<u8>> {
    (0..N)
        .map(|i| {
            let lsn = 26_000_000 + i as u64 * 216;
            format!(
                r#"{{"before":null,"after":{{"order_id":{i},"customer_id":"customer-{}","amount":"{}.{:02}","status":"paid","created_at":"2026-12-05T{:02}:{:02}:{:02}.{:06}Z"}},"source":{{"version":"3.6.1.Final","connector":"postgresql","name":"shop","ts_ms":1796506539710,"snapshot":"false","db":"tally","sequence":"[\"{}\",\"{lsn}\"]","ts_us":1796506539710421,"ts_ns":1796506539710421000,"schema":"public","table":"orders","txId":{},"lsn":{lsn},"xmin":null,"origin":null,"origin_lsn":null}},"transaction":null,"op":"u","ts_ms":1796506539860,"ts_us":1796506539860154,"ts_ns":1796506539860154691}}"#,
                i % 10_000,
                i % 500,
                i % 100,
                (i / 3600) % 24,
                (i / 60) % 60,
                i % 60,
                i % 1_000_000,
                lsn - 56,
                700 + i
            )
            .into_bytes()
        })
        .collect()
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench, declared
}
criterion_main!(benches);
