use apache_avro::types::Value as Avro;
use tally_core::declare::{Declaration, Evaluation, Job, WindowRules};
use tally_core::{Poison, PoisonReason};

use super::*;

const JOB: &str = r#"
event_id = "id"
event_time = "at"
group_by = ["customer", "country"]
[[field]]
name = "id"
type = "integer"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "customer"
type = "string"
[[field]]
name = "country"
type = "string"
path = "visitor.geo.country"
[[field]]
name = "qty"
type = "integer"
[[field]]
name = "price"
type = "decimal"
scale = 2
[[field]]
name = "load"
type = "float"
path = "visitor.load"
[[field]]
name = "paid"
type = "boolean"
[[aggregate]]
column = "n"
function = "count"
[[filter]]
field = "paid"
equals = true
[[aggregate]]
column = "revenue"
function = "sum"
field = "price"
[[aggregate]]
column = "qty"
function = "sum"
field = "qty"
[[aggregate]]
column = "load"
function = "avg"
field = "load"
"#;

fn job(format: &str) -> Job {
    let declaration: Declaration =
        toml::from_str(&format!("format = \"{format}\"\n{JOB}")).unwrap();
    declaration
        .resolve(WindowRules {
            size_ms: 60_000,
            slide_ms: None,
            allowed_lateness_ms: 0,
            dedup_horizon_ms: 60_000,
        })
        .unwrap()
}

fn values() -> Vec<Option<Value>> {
    vec![
        Some(Value::Int(7_000_000_000_123)),
        Some(Value::Time(1_790_000_123_456)),
        Some(Value::Str("c-0042".into())),
        Some(Value::Str("NZ".into())),
        Some(Value::Int(-3)),
        Some(Value::Decimal(-12_345)),
        Some(Value::Float(0.25)),
        Some(Value::Bool(true)),
    ]
}

fn writer(job: &Job) -> FramedWriter {
    FramedWriter::offline(job, 30, [1, 2, 3, 4, 5]).unwrap()
}

/// A record read as the operator reads it: a missing field is its poison (none is late here).
fn read(job: &Job, writer: &FramedWriter, bytes: &[u8]) -> Result<Evaluation, Poison> {
    let schemas = writer.schemas(job).unwrap();
    match job.evaluate_framed(Some(bytes), 4096, schemas.as_ref()) {
        Ok(Evaluation::Incomplete { poison, .. }) => Err(poison),
        other => other,
    }
}

fn expected_event(job: &Job) -> Evaluation {
    let writer = writer(job);
    read(job, &writer, &writer.encode(0, &values())).expect("the first record reads")
}

/// Every stage's record reads back as written, in both formats: the schema changes (a field
/// added and an int widened, then a field removed) change nothing tally reads.
#[test]
fn every_stage_of_the_stream_reads_back_as_written() {
    for format in ["avro", "protobuf"] {
        let job = job(format);
        let writer = writer(&job);
        let expected = expected_event(&job);
        let Evaluation::Event(event) = &expected else {
            unreachable!()
        };
        assert_eq!(event.event_id, "7000000000123", "{format}");
        assert_eq!(event.event_time_ms, 1_790_000_123_456, "{format}");
        assert_eq!(
            event.key.to_vec(),
            vec![Value::Str("c-0042".into()), Value::Str("NZ".into())],
            "{format}"
        );
        assert_eq!(
            event.inputs.to_vec(),
            vec![
                None,
                Some(Value::Decimal(-12_345)),
                Some(Value::Int(-3)),
                Some(Value::Float(0.25))
            ],
            "{format}"
        );
        let mut ids = Vec::new();
        for record in [0, 10, 20] {
            let bytes = writer.encode(record, &values());
            ids.push(u32::from_be_bytes(bytes[1..5].try_into().unwrap()));
            assert_eq!(
                read(&job, &writer, &bytes).unwrap(),
                expected,
                "{format} record {record}"
            );
        }
        assert_eq!(ids, [1, 2, 3], "{format}: the stream changes schema twice");
    }
}

/// loadgen's Avro, read by the Apache Avro project's implementation with each stage's schema:
/// the bytes are Avro, not merely what tally's decoder expects.
#[test]
fn loadgen_avro_is_read_by_apache_avro() {
    let job = job("avro");
    let writer = writer(&job);
    let texts = writer.texts();
    for (stage, record) in [0u64, 10, 20].into_iter().enumerate() {
        let schema = apache_avro::Schema::parse_str(&texts[stage].1).unwrap();
        let bytes = writer.encode(record, &values());
        let decoded =
            apache_avro::from_avro_datum(&schema, &mut &bytes[5..], None).expect("Avro datum");
        let Avro::Record(fields) = decoded else {
            panic!("a record: {decoded:?}")
        };
        let field = |name: &str| {
            fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("{name} in {fields:?}"))
        };
        let inner = |v: Avro| match v {
            Avro::Union(1, inner) => *inner,
            other => panic!("the value branch of a union: {other:?}"),
        };
        assert_eq!(inner(field("id")), Avro::Long(7_000_000_000_123));
        assert_eq!(inner(field("at")), Avro::TimestampMillis(1_790_000_123_456));
        assert_eq!(inner(field("customer")), Avro::String("c-0042".into()));
        let qty = inner(field("qty"));
        assert_eq!(
            qty,
            if stage == 0 {
                Avro::Int(-3)
            } else {
                Avro::Long(-3)
            },
            "stage {stage}: the int widened to a long"
        );
        let Avro::Decimal(price) = inner(field("price")) else {
            panic!("a decimal")
        };
        let units = <Vec<u8>>::try_from(price).unwrap();
        assert_eq!(units, (-12_345i16).to_be_bytes().to_vec());
        assert_eq!(inner(field("paid")), Avro::Boolean(true));
        let Avro::Record(visitor) = field("visitor") else {
            panic!("a nested record")
        };
        assert_eq!(visitor[0].0, "geo");
        assert_eq!(
            visitor[1],
            ("load".into(), Avro::Union(1, Box::new(Avro::Double(0.25))))
        );
        let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            (names.contains(&NOTE), names.contains(&CHANNEL)),
            [(true, false), (true, true), (false, true)][stage],
            "stage {stage}: {names:?}"
        );
    }
}

/// Each poison record is refused for its reason, naming the field and the schema id where
/// the schema is the fault.
#[test]
fn poison_records_are_refused_for_their_reasons() {
    for format in ["avro", "protobuf"] {
        let job = job(format);
        let writer = writer(&job);
        for reason in POISON {
            let bytes = writer
                .poison(reason, &mut values(), 2)
                .unwrap_or_else(|| panic!("{format}: {reason:?} is generated"));
            let poison = read(&job, &writer, &bytes).expect_err("poison");
            assert_eq!(poison.reason, reason, "{format}: {}", poison.message);
            let names = match reason {
                PoisonReason::MissingField => vec!["customer", "schema id 1"],
                PoisonReason::WrongType => vec!["id", "schema id 4"],
                PoisonReason::InvalidTime => vec!["schema id 5"],
                PoisonReason::UnknownSchema => vec!["2147480000"],
                PoisonReason::WireFormat => vec!["magic byte 1"],
                _ => vec!["schema id 1"],
            };
            for name in names {
                assert!(
                    poison.message.contains(name),
                    "{format} {reason:?}: {}",
                    poison.message
                );
            }
        }
    }
}

/// A declared path loadgen cannot name in a schema is refused naming it.
#[test]
fn names_a_schema_cannot_hold_are_refused() {
    let text = JOB.replace("path = \"visitor.load\"", "path = \"visitor.load-avg\"");
    let declaration: Declaration = toml::from_str(&format!("format = \"avro\"\n{text}")).unwrap();
    let job = declaration
        .resolve(WindowRules {
            size_ms: 60_000,
            slide_ms: None,
            allowed_lateness_ms: 0,
            dedup_horizon_ms: 60_000,
        })
        .unwrap();
    let e = FramedWriter::offline(&job, 30, [1, 2, 3, 4, 5]).unwrap_err();
    assert!(e.to_string().contains("load-avg"), "{e}");
}

#[test]
fn decimals_are_written_in_the_fewest_bytes() {
    for (units, bytes) in [
        (0i64, vec![0u8]),
        (127, vec![0x7f]),
        (128, vec![0x00, 0x80]),
        (-1, vec![0xff]),
        (-128, vec![0x80]),
        (-129, vec![0xff, 0x7f]),
        (i64::MAX, i64::MAX.to_be_bytes().to_vec()),
    ] {
        assert_eq!(decimal_bytes(units), bytes, "{units}");
    }
}
