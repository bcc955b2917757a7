use std::collections::{BTreeMap, BTreeSet};

use tally_core::declare::{Declaration, WindowRules};
use tally_core::{Program, WindowSpec};

use crate::loadgen::run_through_operator;

use super::*;

/// A hopping job with three keys (one nested), a filter of each kind loadgen generates, and
/// every aggregate over integer, decimal, float and timestamp inputs.
const JOB: &str = r#"
event_id = "id"
event_time = "at"
group_by = ["page", "country", "status"]
[[field]]
name = "id"
type = "string"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "page"
type = "string"
[[field]]
name = "country"
type = "string"
path = "visitor.geo.country"
[[field]]
name = "status"
type = "integer"
[[field]]
name = "kind"
type = "string"
[[field]]
name = "method"
type = "string"
[[field]]
name = "bytes"
type = "integer"
[[field]]
name = "price"
type = "decimal"
scale = 2
[[field]]
name = "load"
type = "float"
[[field]]
name = "seen"
type = "timestamp"
[[field]]
name = "beta"
type = "boolean"
[[filter]]
field = "kind"
equals = "view"
[[filter]]
field = "method"
in = ["GET", "HEAD"]
[[filter]]
field = "bytes"
min = 0
max = 4000
[[filter]]
field = "beta"
present = true
[[aggregate]]
column = "n"
function = "count"
[[aggregate]]
column = "bytes_sum"
function = "sum"
field = "bytes"
[[aggregate]]
column = "price_avg"
function = "avg"
field = "price"
[[aggregate]]
column = "price_max"
function = "max"
field = "price"
[[aggregate]]
column = "load_min"
function = "min"
field = "load"
[[aggregate]]
column = "load_avg"
function = "avg"
field = "load"
[[aggregate]]
column = "bytes_avg"
function = "avg"
field = "bytes"
[[aggregate]]
column = "last_seen"
function = "max"
field = "seen"
"#;

fn rules() -> OperatorConfig {
    OperatorConfig {
        window: WindowSpec {
            size_ms: 300_000,
            slide_ms: 60_000,
        },
        out_of_orderness_ms: 5_000,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
        windows_from_ms: None,
    }
}

fn job() -> Arc<Job> {
    let declaration: Declaration = toml::from_str(JOB).unwrap();
    Arc::new(resolved(&declaration))
}

fn spec(seed: u64) -> LoadSpec {
    LoadSpec {
        seed,
        partitions: 3,
        customers: 40,
        currencies: Vec::new(),
        skew: 1.1,
        duplicate_fraction: 0.05,
        poison_fraction: 0.03,
        late_fraction: 0.02,
        filtered_fraction: 0.1,
        start_ms: 1_790_000_000_000,
        step_ms: 50,
        max_record_bytes: 2048,
    }
}

/// The construction and tally's operator agree on every record's fate and every window.
#[test]
fn declared_ground_truth_matches_the_operator() {
    assert_ground_truth(&job(), rules(), 8);
}

/// The same for the shipped example declarations, as their job files write them.
#[test]
fn the_shipped_examples_ground_truth_matches_the_operator() {
    for (file, reasons) in [
        ("page_views.toml", 7),
        ("api_latency.toml", 8),
        ("payments.toml", 8),
        ("revenue_agg.toml", 9),
    ] {
        let path = format!("{}/../../config/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let config = tally_runtime::config::Config::parse(file, &text, &[]).unwrap();
        let job = config.declared.clone();
        assert_ground_truth(&job, config.operator(), reasons);
    }
}

/// Generates 20,000 records for three seeds, runs them through the operator with checkpoints
/// now and then, and compares every window, dead letter and count with the manifest.
fn assert_ground_truth(job: &Arc<Job>, rules: OperatorConfig, reasons: usize) {
    for seed in [1, 2, 3] {
        let mut generator = Generator::new(spec(seed), Arc::clone(job), rules).unwrap();
        let mut program = Program::declared(Arc::clone(job), 2048);
        if job.format.is_framed() {
            let writer = FramedWriter::offline(job, 20_000, [11, 12, 13, 14, 15]).unwrap();
            program = Program {
                job: Arc::clone(job),
                max_record_bytes: 2048,
                schemas: Some(writer.schemas(job).unwrap()),
            };
            generator = generator.with_writer(writer);
        }
        let mut builder = ManifestBuilder::new(job, None, String::new());
        let run = run_through_operator(
            rules,
            program,
            20_000,
            || generator.next_record(),
            |r, offset| builder.record(r, offset),
        );
        let (latest, dead, totals) = (run.latest, run.dead, run.totals);
        let manifest = builder.finish();
        // The view's merge of source partitions, by tally's own merge.
        let mut merged: BTreeMap<(i64, Vec<String>), tally_core::WindowAgg> = BTreeMap::new();
        for ((_, k), v) in latest {
            let key = (
                k.window_start_ms,
                k.key.parts().iter().map(|p| p.to_string()).collect(),
            );
            match merged.get_mut(&key) {
                Some(held) => job.merge(held, &v).unwrap(),
                None => {
                    merged.insert(key, v);
                }
            }
        }
        let found: BTreeMap<_, _> = merged
            .into_iter()
            .map(|(k, v)| (k, crate::prove::shown_of(job, &v)))
            .collect();
        let expected = manifest.shown(job);
        assert_eq!(
            found.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>(),
            "seed {seed}: the same windows"
        );
        for (k, e) in &expected {
            let f = &found[k];
            assert!(
                e.iter().zip(f).all(|(e, f)| e.matches(f)),
                "seed {seed} {k:?}: expected {e:?}, found {f:?}"
            );
        }
        let expected_dead: BTreeSet<_> = manifest.dead_letters.iter().copied().collect();
        assert_eq!(dead, expected_dead, "seed {seed}");
        assert_eq!(totals.fates(), manifest.fates(), "seed {seed}");
        assert!(
            manifest.duplicates > 500
                && manifest.late > 200
                && manifest.poison > 300
                && (manifest.filtered > 1_000) != job.filter.is_empty(),
            "{:?}",
            (
                manifest.duplicates,
                manifest.late,
                manifest.poison,
                manifest.filtered
            )
        );
        let found: BTreeSet<_> = manifest.dead_letters.iter().map(|d| d.2).collect();
        assert_eq!(found.len(), reasons, "every reason appears: {found:?}");
    }
}

/// `declaration` resolved with [`rules`].
fn resolved(declaration: &Declaration) -> Job {
    let rules = rules();
    declaration
        .resolve(WindowRules {
            size_ms: rules.window.size_ms,
            slide_ms: Some(rules.window.slide_ms),
            allowed_lateness_ms: rules.allowed_lateness_ms,
            dedup_horizon_ms: rules.dedup_horizon_ms,
        })
        .unwrap()
}

/// The same job's records in Avro and in Protobuf, written with three schemas in turn (a
/// field added, then one removed) and the poison schemas, read by tally's decoders.
#[test]
fn framed_ground_truth_matches_the_operator() {
    for format in ["avro", "protobuf"] {
        let declaration: Declaration =
            toml::from_str(&format!("format = \"{format}\"\n{JOB}")).unwrap();
        let rules = rules();
        let job = resolved(&declaration);
        // The six faults of the wire format and the schemas, too_large and late.
        assert_ground_truth(&Arc::new(job), rules, 8);
    }
}

/// A field the filter lets be absent (`present = false`): the records passing it lack the
/// field (absent, or null) and are aggregated, in JSON, Avro and Protobuf alike.
#[test]
fn a_present_false_filter_ground_truth_matches_the_operator() {
    let absent = JOB.replace("present = true", "present = false");
    assert_ne!(absent, JOB);
    for (format, reasons) in [("json", 8), ("avro", 8), ("protobuf", 8)] {
        let declaration: Declaration =
            toml::from_str(&format!("format = \"{format}\"\n{absent}")).unwrap();
        let rules = rules();
        let job = resolved(&declaration);
        assert_ground_truth(&Arc::new(job), rules, reasons);
    }
}

#[test]
fn loadgen_refuses_what_it_cannot_generate_by_name() {
    let on_key = format!("{JOB}\n[[filter]]\nfield = \"status\"\nmin = 200\n");
    let declaration: Declaration = toml::from_str(&on_key).unwrap();
    let rules = rules();
    let job = resolved(&declaration);
    let Err(e) = Generator::new(spec(1), Arc::new(job), rules) else {
        panic!("a range filter on a key is refused");
    };
    assert!(
        e.contains("\"status\"") && e.contains("group-by key"),
        "{e}"
    );
}
