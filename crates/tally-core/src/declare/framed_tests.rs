//! Avro and Protobuf records in the Confluent wire format: recorded samples, schema evolution,
//! the Apache Avro implementation's encoding against tally's decoding, and bytes that are not
//! records.

use std::collections::HashMap;
use std::sync::Arc;

use apache_avro::types::Value as Avro;
use proptest::prelude::*;

use super::tests::job;
use super::*;
use crate::decode::PoisonReason;

const RULES: WindowRules = WindowRules {
    size_ms: 60_000,
    slide_ms: None,
    allowed_lateness_ms: 60_000,
    dedup_horizon_ms: 3_600_000,
};

const SAMPLES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../scripts/registry/samples"
);

fn sample(name: &str) -> String {
    std::fs::read_to_string(format!("{SAMPLES}/{name}")).expect("a recorded sample")
}

fn hex(text: &str) -> Vec<u8> {
    let text = text.trim();
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

/// A registry's schemas by id, compiled for one job.
#[derive(Debug)]
struct Registry(HashMap<u32, Arc<WriterSchema>>);

impl Registry {
    fn of(job: &Job, schemas: &[(u32, &str)]) -> Registry {
        Registry(
            schemas
                .iter()
                .map(|(id, text)| {
                    let (writer, _) =
                        WriterSchema::compile(job, text).expect("the schema compiles");
                    (*id, Arc::new(writer))
                })
                .collect(),
        )
    }
}

impl Schemas for Registry {
    fn writer(&self, id: u32) -> Result<Arc<WriterSchema>, Poison> {
        self.0.get(&id).cloned().ok_or_else(|| {
            Poison::new(
                PoisonReason::UnknownSchema,
                format!("schema id {id} is unknown"),
            )
        })
    }
}

fn framed(id: u32, body: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(body);
    out
}

fn read(job: &Job, registry: &Registry, bytes: &[u8]) -> Result<DeclaredEvent, Poison> {
    match job.read(Some(bytes), 1 << 20, Some(registry))? {
        Evaluation::Event(e) => Ok(e),
        Evaluation::Filtered => panic!("no filter is declared"),
        Evaluation::Incomplete { poison, .. } => Err(poison),
    }
}

/// The sample order's fields: `amount` read from `amount_path`.
fn order_job(format: &str, amount_path: &str, currency_path: &str) -> Job {
    job(
        &format!(
            r#"
format = "{format}"
event_id = "order_id"
event_time = "created_at"
group_by = ["customer_id", "currency"]
[[field]]
name = "order_id"
type = "integer"
[[field]]
name = "customer_id"
type = "integer"
[[field]]
name = "amount"
type = "decimal"
scale = 2
path = "{amount_path}"
[[field]]
name = "currency"
type = "string"
format = "currency_code"
path = "{currency_path}"
[[field]]
name = "created_at"
type = "timestamp"
[[aggregate]]
column = "revenue"
function = "sum"
field = "amount"
"#
        ),
        RULES,
    )
}

/// 2026-01-02T03:04:05.123456Z, as the samples hold it, in ms.
const CREATED_MS: i64 = 1_767_323_045_123;

/// The Avro sample as Apicurio served its schema and confluent-kafka-python's serializer wrote
/// the same bytes (scripts/registry/NOTES.md).
#[test]
fn the_recorded_avro_sample_reads_as_written() {
    let job = order_job("avro", "amount_cents", "currency");
    let registry = Registry::of(&job, &[(1, &sample("order.avsc"))]);
    let event = read(&job, &registry, &hex(&sample("order-v1.avro.hex"))).unwrap();
    assert_eq!(event.event_id, "1001");
    assert_eq!(event.event_time_ms, CREATED_MS);
    assert_eq!(
        event.key.to_vec(),
        vec![Value::Int(42), Value::Str("EUR".into())]
    );
    // A long of cents read as a decimal of scale 2: 12345 cents are 12345.00.
    assert_eq!(event.inputs.to_vec(), vec![Some(Value::Decimal(1_234_500))]);
}

#[test]
fn the_recorded_protobuf_sample_reads_as_written() {
    let job = order_job("protobuf", "amount.cents", "amount.currency");
    let registry = Registry::of(&job, &[(2, &sample("order.proto"))]);
    let bytes = hex(&sample("order.protobuf.hex"));
    let event = read(&job, &registry, &bytes).unwrap();
    assert_eq!(event.event_id, "1001");
    assert_eq!(event.event_time_ms, CREATED_MS);
    assert_eq!(
        event.key.to_vec(),
        vec![Value::Int(42), Value::Str("EUR".into())]
    );
    assert_eq!(event.inputs.to_vec(), vec![Some(Value::Decimal(1_234_500))]);
    // The long form of the message indexes [0] reads the same.
    let mut long_form = bytes[..5].to_vec();
    long_form.extend_from_slice(&[2, 0]);
    long_form.extend_from_slice(&bytes[6..]);
    assert_eq!(read(&job, &registry, &long_form).unwrap(), event);
}

/// The schema history the registry accepted under BACKWARD compatibility (NOTES.md §2): a
/// field added, one removed, an int widened, a union branch added. Records of every version
/// read; the one that removed a declared field dead-letters naming it and the schema id.
#[test]
fn avro_schema_evolution_keeps_running_and_names_what_a_schema_lost() {
    let job = order_job("avro", "amount_cents", "currency");
    let v1 = sample("order.avsc");
    let note = r#"{"name": "note", "type": ["null", "string"], "default": null}"#;
    let v2 = v1.replace(
        r#"{"name": "created_at""#,
        &format!("{note},\n    {{\"name\": \"created_at\""),
    );
    let v3 = v2.replace(r#"{"name": "currency", "type": "string"},"#, "");
    let v4 = v2.replace(
        r#"{"name": "customer_id", "type": "int"}"#,
        r#"{"name": "customer_id", "type": "long"}"#,
    );
    let v5 = v4.replace(r#"["null", "string"]"#, r#"["null", "string", "long"]"#);
    for (name, text) in [("v2", &v2), ("v3", &v3), ("v4", &v4), ("v5", &v5)] {
        assert_ne!(text, &v1, "{name} changes the schema");
    }
    let registry = Registry::of(&job, &[(1, &v1), (2, &v2), (3, &v3), (4, &v4), (5, &v5)]);
    let v1_body = hex(&sample("order-v1.avro.hex"))[5..].to_vec();
    let expected = read(&job, &registry, &framed(1, &v1_body)).unwrap();
    // v2, v4: v1's fields then a null note (branch 0).
    let mut with_note = v1_body[..v1_body.len() - 8].to_vec();
    with_note.push(0);
    with_note.extend_from_slice(&v1_body[v1_body.len() - 8..]);
    assert_eq!(
        read(&job, &registry, &framed(2, &with_note)).unwrap(),
        expected
    );
    assert_eq!(
        read(&job, &registry, &framed(4, &with_note)).unwrap(),
        expected
    );
    // v5: the note as its new long branch (2), 7.
    let mut long_note = v1_body[..v1_body.len() - 8].to_vec();
    long_note.extend_from_slice(&[4, 14]);
    long_note.extend_from_slice(&v1_body[v1_body.len() - 8..]);
    assert_eq!(
        read(&job, &registry, &framed(5, &long_note)).unwrap(),
        expected
    );
    // v3 has no currency: poison naming the field and the schema.
    let (_, problems) = WriterSchema::compile(&job, &v3).unwrap();
    assert!(
        problems.iter().any(|p| p.contains("currency")),
        "check-config names the missing field: {problems:?}"
    );
    let no_currency: Vec<u8> = {
        let mut b = v1_body[..6].to_vec(); // order_id, customer_id, amount_cents
        b.push(0); // note: null
        b.extend_from_slice(&v1_body[v1_body.len() - 8..]);
        b
    };
    let poison = read(&job, &registry, &framed(3, &no_currency)).unwrap_err();
    assert_eq!(
        poison.reason,
        PoisonReason::MissingField,
        "{}",
        poison.message
    );
    assert!(
        poison.message.contains("currency") && poison.message.contains("schema id 3"),
        "{}",
        poison.message
    );
}

/// A schema giving a declared field another type: check-config names it, and its records
/// are poison naming the field and the schema id, never a panic or a wrong value.
#[test]
fn a_field_of_another_type_is_named_with_the_schema_id() {
    let job = order_job("avro", "amount_cents", "currency");
    let text = sample("order.avsc").replace(
        r#"{"name": "currency", "type": "string"}"#,
        r#"{"name": "currency", "type": "boolean"}"#,
    );
    let (_, problems) = WriterSchema::compile(&job, &text).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("currency") && problems[0].contains("boolean"),
        "{problems:?}"
    );
    let registry = Registry::of(&job, &[(9, &text)]);
    let body = hex(&sample("order-v1.avro.hex"))[5..].to_vec();
    let mut wrong = body[..6].to_vec();
    wrong.push(1); // currency: true
    wrong.extend_from_slice(&body[body.len() - 8..]);
    let poison = read(&job, &registry, &framed(9, &wrong)).unwrap_err();
    assert_eq!(poison.reason, PoisonReason::WrongType, "{}", poison.message);
    assert!(poison.message.contains("currency") && poison.message.contains("schema id 9"));
}

#[test]
fn the_wire_format_s_faults_are_poison_for_their_reasons() {
    let job = order_job("avro", "amount_cents", "currency");
    let registry = Registry::of(&job, &[(1, &sample("order.avsc"))]);
    let good = hex(&sample("order-v1.avro.hex"));
    let cases: Vec<(Vec<u8>, PoisonReason, &str)> = vec![
        (
            [&[1u8][..], &good[1..]].concat(),
            PoisonReason::WireFormat,
            "magic byte 1",
        ),
        (good[..3].to_vec(), PoisonReason::WireFormat, "3 bytes"),
        (
            good[..good.len() - 1].to_vec(),
            PoisonReason::Undecodable,
            "schema id 1",
        ),
        (
            [&good[..], &[0u8][..]].concat(),
            PoisonReason::Undecodable,
            "1 bytes left",
        ),
        (framed(77, &good[5..]), PoisonReason::UnknownSchema, "77"),
        (
            b"{\"order_id\": 1}".to_vec(),
            PoisonReason::WireFormat,
            "magic byte 123",
        ),
    ];
    for (bytes, reason, names) in cases {
        let poison = read(&job, &registry, &bytes).unwrap_err();
        assert_eq!(poison.reason, reason, "{}", poison.message);
        assert!(
            poison.message.contains(names),
            "{reason:?}: {}",
            poison.message
        );
    }
    let poison = job.read(None, 1024, Some(&registry)).unwrap_err();
    assert_eq!(poison.reason, PoisonReason::WireFormat);
    let poison = job.read(Some(&good), 10, Some(&registry)).unwrap_err();
    assert_eq!(poison.reason, PoisonReason::TooLarge);
    let poison = job.read(Some(&good), 1024, None).unwrap_err();
    assert_eq!(poison.reason, PoisonReason::UnknownSchema);
}

const PROTO: &str = r#"
syntax = "proto3";
package t;
import "google/protobuf/timestamp.proto";
import "google/protobuf/wrappers.proto";
message Other { string x = 1; }
message Event {
  string id = 1;
  google.protobuf.Timestamp at = 2;
  Status status = 3;
  int64 qty = 4;
  optional string label = 5;
  google.protobuf.DoubleValue load = 6;
  Inner inner = 7;
  repeated string tags = 8;
  map<string, int64> counts = 9;
  message Inner { sint64 delta = 1; bool ok = 2; }
  enum Status { UNKNOWN = 0; PAID = 1; }
}
"#;

fn event_job() -> Job {
    job(
        r#"
format = "protobuf"
event_id = "id"
event_time = "at"
group_by = ["status", "ok"]
[[field]]
name = "id"
type = "string"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "status"
type = "string"
allow_empty = true
[[field]]
name = "qty"
type = "integer"
[[field]]
name = "load"
type = "float"
[[field]]
name = "delta"
type = "integer"
path = "inner.delta"
[[field]]
name = "ok"
type = "boolean"
path = "inner.ok"
[[aggregate]]
column = "qty"
function = "sum"
field = "qty"
[[aggregate]]
column = "delta"
function = "sum"
field = "delta"
[[aggregate]]
column = "load"
function = "avg"
field = "load"
"#,
        RULES,
    )
}

fn tag(out: &mut Vec<u8>, number: u64, wire: u64) {
    varint(out, (number << 3) | wire);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn delimited(out: &mut Vec<u8>, number: u64, body: &[u8]) {
    tag(out, number, 2);
    varint(out, body.len() as u64);
    out.extend_from_slice(body);
}

/// An `Event` written field by field: unknown fields, repeated and map fields between the
/// declared ones; proto3's absent scalars read as their defaults.
#[test]
fn protobuf_reads_declared_fields_by_number_and_skips_the_rest() {
    let job = event_job();
    let registry = Registry::of(&job, &[(3, PROTO)]);
    let mut body = Vec::new();
    delimited(&mut body, 1, b"e-1");
    delimited(&mut body, 8, b"red"); // tags: skipped
    let mut stamp = Vec::new();
    tag(&mut stamp, 1, 0);
    varint(&mut stamp, 1_790_000_000);
    tag(&mut stamp, 2, 0);
    varint(&mut stamp, 250_000_000);
    delimited(&mut body, 2, &stamp);
    tag(&mut body, 3, 0);
    varint(&mut body, 1); // PAID
    tag(&mut body, 4, 0);
    varint(&mut body, (-5i64) as u64); // int64 -5: ten bytes
    let mut entry = Vec::new();
    delimited(&mut entry, 1, b"k");
    tag(&mut entry, 2, 0);
    varint(&mut entry, 3);
    delimited(&mut body, 9, &entry); // counts: skipped
    tag(&mut body, 99, 5);
    body.extend_from_slice(&[1, 2, 3, 4]); // a field of a newer schema: skipped
    let mut load = Vec::new();
    tag(&mut load, 1, 1);
    load.extend_from_slice(&1.5f64.to_le_bytes());
    delimited(&mut body, 6, &load);
    let mut inner = Vec::new();
    tag(&mut inner, 1, 0);
    varint(&mut inner, 7); // sint64 -4
    delimited(&mut body, 7, &inner);
    // Message indexes [1]: Event, the second message.
    let bytes = framed(3, &[&[2u8, 2][..], &body].concat());
    let event = read(&job, &registry, &bytes).unwrap();
    assert_eq!(event.event_id, "e-1");
    assert_eq!(event.event_time_ms, 1_790_000_000_250);
    assert_eq!(
        event.key.to_vec(),
        vec![Value::Str("PAID".into()), Value::Bool(false)]
    );
    assert_eq!(
        event.inputs.to_vec(),
        vec![
            Some(Value::Int(-5)),
            Some(Value::Int(-4)),
            Some(Value::Float(1.5))
        ]
    );

    // The same without status, qty and inner.ok: proto3's defaults (UNKNOWN, 0, false).
    let mut sparse = Vec::new();
    delimited(&mut sparse, 1, b"e-2");
    delimited(&mut sparse, 2, &stamp);
    delimited(&mut sparse, 6, &load);
    delimited(&mut sparse, 7, &inner);
    let event = read(
        &job,
        &registry,
        &framed(3, &[&[2u8, 2][..], &sparse].concat()),
    )
    .unwrap();
    assert_eq!(
        event.key.to_vec(),
        vec![Value::Str("UNKNOWN".into()), Value::Bool(false)]
    );
    assert_eq!(
        event.inputs.to_vec(),
        vec![
            Some(Value::Int(0)),
            Some(Value::Int(-4)),
            Some(Value::Float(1.5))
        ]
    );

    // Without the wrapper (it has presence): the field is missing, named with the schema id.
    let mut no_load = Vec::new();
    delimited(&mut no_load, 1, b"e-3");
    delimited(&mut no_load, 2, &stamp);
    delimited(&mut no_load, 7, &inner);
    let poison = read(
        &job,
        &registry,
        &framed(3, &[&[2u8, 2][..], &no_load].concat()),
    )
    .unwrap_err();
    assert_eq!(poison.reason, PoisonReason::MissingField);
    assert!(poison.message.contains("load") && poison.message.contains("schema id 3"));

    // Message indexes naming `Other`, or no message at all.
    for indexes in [&[0u8][..], &[2, 8][..], &[4, 2, 2][..]] {
        let poison = read(&job, &registry, &framed(3, &[indexes, &body].concat())).unwrap_err();
        assert!(
            matches!(
                poison.reason,
                PoisonReason::MissingField | PoisonReason::Undecodable
            ),
            "{indexes:?}: {poison:?}"
        );
    }
    // A field sent with another wire type than its schema's.
    let mut wrong_wire = Vec::new();
    tag(&mut wrong_wire, 4, 2);
    varint(&mut wrong_wire, 1);
    wrong_wire.push(0);
    let poison = read(
        &job,
        &registry,
        &framed(3, &[&[2u8, 2][..], &wrong_wire].concat()),
    )
    .unwrap_err();
    assert_eq!(
        poison.reason,
        PoisonReason::Undecodable,
        "{}",
        poison.message
    );
}

#[test]
fn protobuf_schemas_name_what_they_lack() {
    let job = event_job();
    let (_, problems) = WriterSchema::compile(&job, PROTO).unwrap();
    // The first message, `Other`, is the default one: it holds none of the declared fields.
    assert!(
        problems.iter().any(|p| p.contains("no field id")),
        "{problems:?}"
    );
    let first = PROTO.replace("message Other { string x = 1; }\n", "");
    let (_, problems) = WriterSchema::compile(&job, &first).unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    let changed = first.replace("int64 qty = 4;", "string qty = 4;");
    let (_, problems) = WriterSchema::compile(&job, &changed).unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.contains("\"qty\"") && p.contains("string")),
        "{problems:?}"
    );
    let broken = WriterSchema::compile(&job, "syntax = \"proto3\"; message {").unwrap_err();
    assert!(broken.contains("does not compile"), "{broken}");
    let imports = WriterSchema::compile(
        &job,
        "syntax = \"proto3\"; import \"shop/money.proto\"; message A { string id = 1; }",
    )
    .unwrap_err();
    assert!(imports.contains("money.proto"), "{imports}");
}

/// A recursive schema with data nested deeper than the limit is refused, not recursed into
/// without bound.
#[test]
fn deep_nesting_is_refused_not_recursed() {
    let job = order_job("avro", "amount_cents", "currency");
    let text = r#"{"type":"record","name":"Node","fields":[
        {"name":"next","type":["null","Node"]},
        {"name":"order_id","type":"long"}]}"#;
    let (writer, _) = WriterSchema::compile(&job, text).unwrap();
    let WriterSchema::Avro(decoder) = writer else {
        unreachable!()
    };
    // 10,000 levels of `next`, then null.
    let mut body = vec![2u8; 10_000];
    body.push(0);
    body.push(2);
    let mut cells = vec![None; job.fields.len()];
    let e = decoder.decode(&body, &mut cells).unwrap_err();
    assert!(e.contains("nested"), "{e}");
}

const RECORD: &str = r#"{"type":"record","name":"R","namespace":"t","fields":[
  {"name":"id","type":"long"},
  {"name":"at","type":{"type":"long","logicalType":"timestamp-micros"}},
  {"name":"who","type":["null","string"]},
  {"name":"skip","type":{"type":"array","items":{"type":"map","values":"double"}}},
  {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":20,"scale":3}},
  {"name":"size","type":["null","float","double"]},
  {"name":"kind","type":{"type":"enum","name":"Kind","symbols":["A","B","C"]}},
  {"name":"inner","type":["null",{"type":"record","name":"Inner","fields":[
     {"name":"pad","type":{"type":"fixed","name":"Pad","size":3}},
     {"name":"day","type":{"type":"int","logicalType":"date"}}]}]}
]}"#;

fn record_job() -> Job {
    job(
        r#"
format = "avro"
event_id = "id"
event_time = "at"
group_by = ["kind", "who"]
[[field]]
name = "id"
type = "integer"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "who"
type = "string"
[[field]]
name = "price"
type = "decimal"
scale = 3
[[field]]
name = "size"
type = "float"
[[field]]
name = "kind"
type = "string"
[[field]]
name = "day"
type = "timestamp"
path = "inner.day"
[[aggregate]]
column = "price"
function = "sum"
field = "price"
[[aggregate]]
column = "size"
function = "sum"
field = "size"
[[aggregate]]
column = "day"
function = "max"
field = "day"
"#,
        RULES,
    )
}

prop_compose! {
    fn avro_record()(
        id in any::<i64>(),
        at_us in 0i64..4_000_000_000_000_000,
        who in proptest::option::of("[a-zé]{1,12}"),
        skip in proptest::collection::vec(proptest::collection::hash_map("[a-z]{0,3}", any::<f64>(), 0..3), 0..3),
        // Decimal(18, 3): under 10^18 units.
        price in -(10i64.pow(17))..10i64.pow(17),
        size in prop_oneof![Just(None), any::<f32>().prop_map(|x| Some(Avro::Float(x))), any::<f64>().prop_map(|x| Some(Avro::Double(x)))],
        kind in 0u32..3,
        day in proptest::option::of((0i32..40_000, any::<[u8; 3]>())),
    ) -> (Avro, i64, i64, Option<String>) {
        let record = Avro::Record(vec![
            ("id".into(), Avro::Long(id)),
            ("at".into(), Avro::TimestampMicros(at_us)),
            ("who".into(), match &who { None => Avro::Union(0, Box::new(Avro::Null)), Some(w) => Avro::Union(1, Box::new(Avro::String(w.clone()))) }),
            ("skip".into(), Avro::Array(skip.into_iter().map(|m| Avro::Map(m.into_iter().map(|(k, v)| (k, Avro::Double(v))).collect())).collect())),
            ("price".into(), Avro::Decimal(apache_avro::Decimal::from(price.to_be_bytes().to_vec()))),
            ("size".into(), match size { None => Avro::Union(0, Box::new(Avro::Null)), Some(v @ Avro::Float(_)) => Avro::Union(1, Box::new(v)), Some(v) => Avro::Union(2, Box::new(v)) }),
            ("kind".into(), Avro::Enum(kind, ["A", "B", "C"][kind as usize].into())),
            ("inner".into(), match day { None => Avro::Union(0, Box::new(Avro::Null)), Some((d, pad)) => Avro::Union(1, Box::new(Avro::Record(vec![("pad".into(), Avro::Fixed(3, pad.to_vec())), ("day".into(), Avro::Date(d))]))) }),
        ]);
        (record, id, price, who)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever the Apache Avro implementation writes, tally reads the same values (or, for a
    /// null where a value is declared, names the field).
    #[test]
    fn apache_avro_records_read_as_written((record, id, price, who) in avro_record()) {
        let job = record_job();
        let schema = apache_avro::Schema::parse_str(RECORD).unwrap();
        let body = apache_avro::to_avro_datum(&schema, record.clone()).unwrap();
        let registry = Registry::of(&job, &[(5, RECORD)]);
        let Avro::Record(fields) = &record else { unreachable!() };
        let size = match &fields[5].1 { Avro::Union(_, v) => match v.as_ref() { Avro::Float(x) => Some(f64::from(*x)), Avro::Double(x) => Some(*x), _ => None }, _ => None };
        let day = match &fields[7].1 { Avro::Union(1, inner) => match inner.as_ref() { Avro::Record(f) => match f[1].1 { Avro::Date(d) => Some(i64::from(d) * 86_400_000), _ => None }, _ => None }, _ => None };
        let result = read(&job, &registry, &framed(5, &body));
        match (who, size, day) {
            (Some(_), Some(size), Some(day)) if size.is_finite() => {
                let event = result.unwrap();
                prop_assert_eq!(event.event_id.as_str(), id.to_string());
                prop_assert_eq!(&event.inputs[0], &Some(Value::Decimal(price)));
                prop_assert_eq!(&event.inputs[1], &Some(Value::Float(size)));
                prop_assert_eq!(&event.inputs[2], &Some(Value::Time(day)));
            }
            _ => {
                let poison = result.unwrap_err();
                prop_assert!(matches!(poison.reason, PoisonReason::MissingField | PoisonReason::WrongType | PoisonReason::InvalidTime), "{:?}", poison);
                prop_assert!(poison.message.contains("schema id 5"), "{}", poison.message);
            }
        }
    }

    /// Bytes that are not records are poison or a record, never a panic; so are records cut
    /// anywhere.
    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..200), cut in 0usize..200) {
        let avro = record_job();
        let registry = Registry::of(&avro, &[(5, RECORD)]);
        let _ = read(&avro, &registry, &framed(5, &body));
        let proto = event_job();
        let proto_registry = Registry::of(&proto, &[(3, PROTO)]);
        let _ = read(&proto, &proto_registry, &framed(3, &body));
        let recorded = hex(&sample("order.protobuf.hex"));
        let order = order_job("protobuf", "amount.cents", "amount.currency");
        let order_registry = Registry::of(&order, &[(2, &sample("order.proto"))]);
        let _ = read(&order, &order_registry, &recorded[..cut.min(recorded.len())]);
    }
}
