//! Records of a job reading Avro or Protobuf: writer schemas generated from the declaration,
//! registered in the schema registry, and values in the Confluent wire format. The stream
//! changes schema twice, as producers do when they evolve: a third of it is written with the
//! first schema, a third with one that adds a field (and widens an int to a long, and adds a
//! union branch), the last third with one that removes a field. Poison records break the wire
//! format, the payload, the schema id, or are written with a schema that gives a declared
//! field another type.
//!
//! Avro is encoded here by the Avro specification; Protobuf by `prost-reflect`'s dynamic
//! messages (another implementation than tally's reader).

use anyhow::{Context, Result, bail};
use prost_reflect::{DynamicMessage, MessageDescriptor, ReflectMessage};
use std::collections::HashMap;
use std::sync::Arc;

use tally_core::declare::{FieldKind, Format, Job, Schemas, Value, WriterSchema, format_decimal};
use tally_core::{Poison, PoisonReason};

use tally_runtime::config::Config;
use tally_runtime::schemas::{SchemaRegistry, schema_type};

/// A field the first and second schemas have and the third removes.
const NOTE: &str = "loadgen_note";
/// A field the second schema adds.
const CHANNEL: &str = "loadgen_channel";
/// An id no registry hands out soon: records naming it are `unknown_schema`.
const UNKNOWN_ID: u32 = 2_147_480_000;

/// The schemas a stream is written with, in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The declared fields (integers other than the event id as Avro `int` or Protobuf
    /// `int32`), and [`NOTE`].
    First,
    /// [`CHANNEL`] added; integers widened to `long`/`int64`; Avro's [`NOTE`] union gains a
    /// branch.
    Added,
    /// [`NOTE`] removed.
    Removed,
}

/// A value's type in a generated schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    Str,
    Int,
    Long,
    Decimal(u32),
    Double,
    Bool,
    Time,
}

/// Where a leaf's value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    Field(usize),
    Note,
    Channel,
}

#[derive(Debug, Clone)]
enum Member {
    Leaf {
        name: String,
        number: u32,
        ty: Ty,
        source: Origin,
    },
    Record {
        name: String,
        number: u32,
        /// The record type's name (Avro) or nested message's (Protobuf).
        type_name: String,
        members: Vec<Member>,
    },
}

/// A generated writer schema: its members, its text, and (Protobuf) its message.
#[derive(Debug, Clone)]
struct Shape {
    members: Vec<Member>,
    text: String,
    message: Option<MessageDescriptor>,
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The declared fields as records of members, in the order their paths first appear;
/// `retype` gives some fields another type (poison schemas).
fn members(job: &Job, stage: Stage, retype: &[(usize, Ty)]) -> Result<Vec<Member>> {
    let mut root: Vec<Member> = Vec::new();
    for (i, field) in job.fields.iter().enumerate() {
        // Only integers loadgen draws itself fit an `int`: not the event id, not a filter's.
        let small = i != job.event_id && !job.filter.iter().any(|c| c.field == i);
        for key in &field.path {
            if !valid_name(key) {
                bail!(
                    "loadgen cannot name {key:?} (field {:?}) in an Avro or Protobuf schema: names are letters, digits and _",
                    field.name
                );
            }
        }
        let ty = retype
            .iter()
            .find(|(f, _)| *f == i)
            .map(|(_, t)| *t)
            .unwrap_or(match field.kind {
                FieldKind::String => Ty::Str,
                FieldKind::Integer if small && stage == Stage::First => Ty::Int,
                FieldKind::Integer => Ty::Long,
                FieldKind::Decimal => Ty::Decimal(field.scale),
                FieldKind::Float => Ty::Double,
                FieldKind::Boolean => Ty::Bool,
                FieldKind::Timestamp => Ty::Time,
            });
        let Some((leaf, parents)) = field.path.split_last() else {
            bail!("field {:?} has an empty path", field.name);
        };
        let mut level = &mut root;
        let mut type_name = String::from("Event");
        for parent in parents {
            type_name = format!("{type_name}_{parent}");
            let at = match level
                .iter()
                .position(|m| matches!(m, Member::Record { name, .. } if name == parent))
            {
                Some(at) => at,
                None => {
                    let number = next_number(level);
                    level.push(Member::Record {
                        name: parent.clone(),
                        number,
                        type_name: type_name.clone(),
                        members: Vec::new(),
                    });
                    level.len() - 1
                }
            };
            let Member::Record { members, .. } = &mut level[at] else {
                bail!(
                    "field {:?}: {parent} is both a value and a record",
                    field.name
                );
            };
            level = members;
        }
        let number = next_number(level);
        level.push(Member::Leaf {
            name: leaf.clone(),
            number,
            ty,
            source: Origin::Field(i),
        });
    }
    if stage != Stage::Removed {
        root.push(Member::Leaf {
            name: NOTE.into(),
            number: 100,
            ty: Ty::Str,
            source: Origin::Note,
        });
    }
    if stage != Stage::First {
        root.push(Member::Leaf {
            name: CHANNEL.into(),
            number: 101,
            ty: Ty::Str,
            source: Origin::Channel,
        });
    }
    Ok(root)
}

fn next_number(level: &[Member]) -> u32 {
    u32::try_from(level.len()).unwrap_or(u32::MAX - 1) + 1
}

fn avro_type(ty: Ty) -> serde_json::Value {
    use serde_json::json;
    match ty {
        Ty::Str => json!("string"),
        Ty::Int => json!("int"),
        Ty::Long => json!("long"),
        Ty::Decimal(scale) => {
            json!({"type": "bytes", "logicalType": "decimal", "precision": 38, "scale": scale})
        }
        Ty::Double => json!("double"),
        Ty::Bool => json!("boolean"),
        Ty::Time => json!({"type": "long", "logicalType": "timestamp-millis"}),
    }
}

fn avro_record(name: &str, members: &[Member], stage: Stage) -> serde_json::Value {
    use serde_json::json;
    let fields: Vec<serde_json::Value> = members
        .iter()
        .map(|m| match m {
            Member::Leaf {
                name, ty, source, ..
            } => {
                let mut union = vec![json!("null"), avro_type(*ty)];
                if *source == Origin::Note && stage == Stage::Added {
                    union.push(json!("long"));
                }
                json!({"name": name, "type": union, "default": null})
            }
            Member::Record {
                name,
                type_name,
                members,
                ..
            } => json!({"name": name, "type": avro_record(type_name, members, stage)}),
        })
        .collect();
    json!({"type": "record", "name": name, "namespace": "tally.loadgen", "fields": fields})
}

fn proto_type(ty: Ty) -> &'static str {
    match ty {
        Ty::Str | Ty::Decimal(_) => "string",
        Ty::Int => "int32",
        Ty::Long => "int64",
        Ty::Double => "double",
        Ty::Bool => "bool",
        Ty::Time => "google.protobuf.Timestamp",
    }
}

fn proto_message(out: &mut String, name: &str, members: &[Member], indent: usize) {
    let pad = "  ".repeat(indent);
    out.push_str(&format!("{pad}message {name} {{\n"));
    for m in members {
        match m {
            Member::Leaf {
                name, number, ty, ..
            } => {
                // Messages have presence; scalars get it from `optional`.
                let optional = if *ty == Ty::Time { "" } else { "optional " };
                out.push_str(&format!(
                    "{pad}  {optional}{} {name} = {number};\n",
                    proto_type(*ty)
                ));
            }
            Member::Record {
                name,
                number,
                type_name,
                members,
            } => {
                proto_message(out, type_name, members, indent + 1);
                out.push_str(&format!("{pad}  {type_name} {name} = {number};\n"));
            }
        }
    }
    out.push_str(&format!("{pad}}}\n"));
}

impl Shape {
    fn new(job: &Job, stage: Stage, retype: &[(usize, Ty)]) -> Result<Shape> {
        let members = members(job, stage, retype)?;
        match job.format {
            Format::Avro => Ok(Shape {
                text: avro_record("Event", &members, stage).to_string(),
                members,
                message: None,
            }),
            Format::Protobuf => {
                let mut text = String::from(
                    "syntax = \"proto3\";\n\npackage tally.loadgen;\n\nimport \"google/protobuf/timestamp.proto\";\n\n",
                );
                proto_message(&mut text, "Event", &members, 0);
                let message = compile_proto(&text)?;
                Ok(Shape {
                    members,
                    text,
                    message: Some(message),
                })
            }
            other => bail!(
                "loadgen writes no registry schema for {} records",
                other.as_str()
            ),
        }
    }
}

/// The first message of a `.proto` text.
fn compile_proto(text: &str) -> Result<MessageDescriptor> {
    struct One(String);
    impl protox::file::FileResolver for One {
        fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
            if name == "loadgen.proto" {
                protox::file::File::from_source(name, &self.0)
            } else {
                Err(protox::Error::file_not_found(name))
            }
        }
    }
    let mut resolver = protox::file::ChainFileResolver::new();
    resolver.add(One(text.to_owned()));
    resolver.add(protox::file::GoogleFileResolver::new());
    let mut compiler = protox::Compiler::with_file_resolver(resolver);
    compiler
        .open_file("loadgen.proto")
        .map_err(|e| anyhow::anyhow!("the generated .proto does not compile: {e}\n{text}"))?;
    compiler
        .descriptor_pool()
        .get_message_by_name("tally.loadgen.Event")
        .context("the generated .proto has no message Event")
}

/// A value the stream writes where a field has another type than declared, or the event time
/// is text: the record's only fault.
fn poison_value(ty: Ty) -> Value {
    match ty {
        Ty::Bool => Value::Bool(true),
        _ => Value::Str("tomorrow".into()),
    }
}

/// Schemas by id without a registry.
#[derive(Debug)]
struct Offline(HashMap<u32, Arc<WriterSchema>>);

impl Schemas for Offline {
    fn writer(&self, id: u32) -> Result<Arc<WriterSchema>, Poison> {
        self.0.get(&id).cloned().ok_or_else(|| {
            Poison::new(
                PoisonReason::UnknownSchema,
                format!("schema id {id} is not in the registry"),
            )
        })
    }
}

/// A registered schema and what it writes.
#[derive(Debug, Clone)]
struct Registered {
    id: u32,
    shape: Shape,
}

/// How loadgen writes a framed job's records.
#[derive(Debug, Clone)]
pub struct FramedWriter {
    format: Format,
    stages: [Registered; 3],
    /// Records per stage (the last takes the rest).
    per_stage: u64,
    /// A field made a boolean (a string, if declared boolean), and its schema.
    wrong_type: Option<(usize, Registered)>,
    /// The event time as text.
    text_time: (usize, Registered),
}

/// What the poison of a framed job is: one fault each.
pub const POISON: [PoisonReason; 6] = [
    PoisonReason::WireFormat,
    PoisonReason::Undecodable,
    PoisonReason::UnknownSchema,
    PoisonReason::MissingField,
    PoisonReason::WrongType,
    PoisonReason::InvalidTime,
];

impl FramedWriter {
    /// Generates the job's schemas and registers them: the stream's three under the job's
    /// subject, the poison schemas under subjects of their own (so that the job's subject
    /// keeps only compatible changes).
    pub async fn register(config: &Config, job: &Job, events: u64) -> Result<FramedWriter> {
        let registry = SchemaRegistry::new(&config.registry)?;
        let subject = config.registry_subject();
        let kind = schema_type(job.format);
        let shapes = FramedWriter::shapes(job)?;
        let (stages, wrong_type, text_time) = shapes;
        let mut registered = Vec::new();
        for shape in stages {
            let id = registry
                .register(&subject, &shape.text, kind)
                .await
                .with_context(|| format!("registering a schema under subject {subject}"))?;
            registered.push(Registered { id, shape });
        }
        let poison = |suffix: &'static str, shape: Shape| {
            let registry = &registry;
            let subject = format!("{subject}-loadgen-{suffix}");
            async move {
                let id = registry
                    .register(&subject, &shape.text, kind)
                    .await
                    .with_context(|| format!("registering a schema under subject {subject}"))?;
                anyhow::Ok(Registered { id, shape })
            }
        };
        let wrong_type = match wrong_type {
            Some((victim, shape)) => Some((victim, poison("wrong-type", shape).await?)),
            None => None,
        };
        let text_time = (text_time.0, poison("text-time", text_time.1).await?);
        if registry
            .schema(UNKNOWN_ID)
            .await
            .context("asking the registry for a schema id it should not know")?
            .is_some()
        {
            bail!(
                "the schema registry knows schema id {UNKNOWN_ID}, which loadgen writes as an unknown id"
            );
        }
        let stages: [Registered; 3] = registered
            .try_into()
            .map_err(|_| anyhow::anyhow!("three schemas were registered"))?;
        println!(
            "registered under {subject}: schema ids {}, {}, {} (a field added, then one removed)",
            stages[0].id, stages[1].id, stages[2].id
        );
        Ok(FramedWriter {
            format: job.format,
            stages,
            per_stage: (events / 3).max(1),
            wrong_type,
            text_time,
        })
    }

    /// The stream's three schemas, the wrong-type schema (if a field can be the victim) and
    /// the text-time schema.
    #[allow(clippy::type_complexity)] // the three kinds of schema, named at the caller
    fn shapes(job: &Job) -> Result<([Shape; 3], Option<(usize, Shape)>, (usize, Shape))> {
        let stages = [
            Shape::new(job, Stage::First, &[])?,
            Shape::new(job, Stage::Added, &[])?,
            Shape::new(job, Stage::Removed, &[])?,
        ];
        // A field no filter reads and that is not the event time: its wrong type is the
        // record's only fault.
        let filtered: Vec<usize> = job.filter.iter().map(|c| c.field).collect();
        let victim = (0..job.fields.len()).find(|&i| i != job.event_time && !filtered.contains(&i));
        let wrong_type = match victim {
            Some(v) => {
                let ty = if job.fields[v].kind == FieldKind::Boolean {
                    Ty::Str
                } else {
                    Ty::Bool
                };
                Some((v, Shape::new(job, Stage::First, &[(v, ty)])?))
            }
            None => None,
        };
        let time = job.event_time;
        let text_time = (time, Shape::new(job, Stage::First, &[(time, Ty::Str)])?);
        Ok((stages, wrong_type, text_time))
    }

    /// A writer whose schemas have the given ids, none registered: for tests and benches,
    /// which read with [`FramedWriter::schemas`] instead of a registry.
    pub fn offline(job: &Job, events: u64, ids: [u32; 5]) -> Result<FramedWriter> {
        let (stages, wrong_type, text_time) = FramedWriter::shapes(job)?;
        let [a, b, c] = stages;
        Ok(FramedWriter {
            format: job.format,
            stages: [
                Registered {
                    id: ids[0],
                    shape: a,
                },
                Registered {
                    id: ids[1],
                    shape: b,
                },
                Registered {
                    id: ids[2],
                    shape: c,
                },
            ],
            per_stage: (events / 3).max(1),
            wrong_type: wrong_type.map(|(v, shape)| (v, Registered { id: ids[3], shape })),
            text_time: (
                text_time.0,
                Registered {
                    id: ids[4],
                    shape: text_time.1,
                },
            ),
        })
    }

    /// Every schema's id and text: the stream's stages, then the poison schemas.
    pub fn texts(&self) -> Vec<(u32, String)> {
        self.stages
            .iter()
            .chain(self.wrong_type.as_ref().map(|(_, r)| r))
            .chain(std::iter::once(&self.text_time.1))
            .map(|r| (r.id, r.shape.text.clone()))
            .collect()
    }

    /// The writer schemas as tally compiles them for `job`, by id, as a registry would serve
    /// them (an id not among them is unknown).
    pub fn schemas(&self, job: &Job) -> Result<Arc<dyn Schemas>> {
        let mut by_id = HashMap::new();
        for (id, text) in self.texts() {
            let (writer, _) = WriterSchema::compile(job, &text)
                .map_err(|e| anyhow::anyhow!("schema {id} does not compile: {e}\n{text}"))?;
            by_id.insert(id, Arc::new(writer));
        }
        Ok(Arc::new(Offline(by_id)))
    }

    fn stage(&self, record: u64) -> &Registered {
        let at = usize::try_from(record / self.per_stage).unwrap_or(2).min(2);
        &self.stages[at]
    }

    /// Record number `record` of the stream with `values` (by field; `None`: absent).
    pub fn encode(&self, record: u64, values: &[Option<Value>]) -> Vec<u8> {
        self.write(self.stage(record), values)
    }

    /// A record of `values` broken by `reason`, if this job's stream can break that way.
    pub fn poison(
        &self,
        reason: PoisonReason,
        values: &mut [Option<Value>],
        missing: usize,
    ) -> Option<Vec<u8>> {
        use PoisonReason as R;
        let first = &self.stages[0];
        Some(match reason {
            R::WireFormat => {
                let mut bytes = self.write(first, values);
                bytes[0] = 1;
                bytes
            }
            R::Undecodable => {
                let mut bytes = self.write(first, values);
                bytes.pop();
                bytes
            }
            R::UnknownSchema => {
                let mut bytes = self.write(first, values);
                bytes[1..5].copy_from_slice(&UNKNOWN_ID.to_be_bytes());
                bytes
            }
            R::MissingField => {
                *values.get_mut(missing)? = None;
                self.write(first, values)
            }
            R::WrongType => {
                let (victim, schema) = self.wrong_type.as_ref()?;
                let ty = if matches!(values.get(*victim)?, Some(Value::Bool(_))) {
                    Ty::Str
                } else {
                    Ty::Bool
                };
                values[*victim] = Some(poison_value(ty));
                self.write(schema, values)
            }
            R::InvalidTime => {
                let (time, schema) = &self.text_time;
                *values.get_mut(*time)? = Some(poison_value(Ty::Str));
                self.write(schema, values)
            }
            _ => return None,
        })
    }

    fn write(&self, schema: &Registered, values: &[Option<Value>]) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        out.push(0);
        out.extend_from_slice(&schema.id.to_be_bytes());
        match (self.format, &schema.shape.message) {
            (Format::Protobuf, Some(message)) => {
                // Message indexes [0]: the first message, in Confluent's short form.
                out.push(0);
                let mut m = DynamicMessage::new(message.clone());
                proto_fill(&mut m, &schema.shape.members, values);
                out.extend_from_slice(&prost_reflect::prost::Message::encode_to_vec(&m));
            }
            _ => avro_write(&mut out, &schema.shape.members, values),
        }
        out
    }
}

fn value_of<'a>(
    source: Origin,
    values: &'a [Option<Value>],
    note: &'a Value,
    channel: &'a Value,
) -> Option<&'a Value> {
    match source {
        Origin::Field(i) => values.get(i).and_then(Option::as_ref),
        Origin::Note => Some(note),
        Origin::Channel => Some(channel),
    }
}

fn text_of(value: &Value, ty: Ty) -> String {
    match (value, ty) {
        (Value::Str(s), _) => s.to_string(),
        (Value::Decimal(units), Ty::Decimal(scale)) => format_decimal(i128::from(*units), scale),
        (Value::Int(i) | Value::Decimal(i) | Value::Time(i), _) => i.to_string(),
        (Value::Float(x), _) => x.to_string(),
        (Value::Bool(b), _) => b.to_string(),
    }
}

fn number_of(value: &Value) -> i64 {
    match value {
        Value::Int(i) | Value::Decimal(i) | Value::Time(i) => *i,
        Value::Float(x) => *x as i64,
        Value::Bool(b) => i64::from(*b),
        Value::Str(_) => 0,
    }
}

fn zigzag(out: &mut Vec<u8>, n: i64) {
    let mut v = ((n << 1) ^ (n >> 63)) as u64;
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn avro_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    zigzag(out, i64::try_from(bytes.len()).unwrap_or(i64::MAX));
    out.extend_from_slice(bytes);
}

/// A decimal's unscaled value as Avro's `decimal`: big-endian two's complement, shortest.
fn decimal_bytes(units: i64) -> Vec<u8> {
    let bytes = units.to_be_bytes();
    let mut start = 0;
    while start < 7 {
        let (b, next) = (bytes[start], bytes[start + 1]);
        let redundant = (b == 0 && next & 0x80 == 0) || (b == 0xff && next & 0x80 != 0);
        if !redundant {
            break;
        }
        start += 1;
    }
    bytes[start..].to_vec()
}

fn avro_write(out: &mut Vec<u8>, members: &[Member], values: &[Option<Value>]) {
    let (note, channel) = (Value::Str("loadgen".into()), Value::Str("web".into()));
    for m in members {
        match m {
            Member::Record { members, .. } => avro_write(out, members, values),
            Member::Leaf { ty, source, .. } => match value_of(*source, values, &note, &channel) {
                // Every leaf is a union of null (branch 0) and its type (branch 1).
                None => zigzag(out, 0),
                Some(value) => {
                    zigzag(out, 1);
                    match ty {
                        Ty::Str => avro_bytes(out, text_of(value, *ty).as_bytes()),
                        Ty::Int | Ty::Long | Ty::Time => zigzag(out, number_of(value)),
                        Ty::Decimal(_) => avro_bytes(out, &decimal_bytes(number_of(value))),
                        Ty::Double => {
                            let x = match value {
                                Value::Float(x) => *x,
                                other => number_of(other) as f64,
                            };
                            out.extend_from_slice(&x.to_le_bytes());
                        }
                        Ty::Bool => out.push(u8::from(matches!(value, Value::Bool(true)))),
                    }
                }
            },
        }
    }
}

fn proto_fill(message: &mut DynamicMessage, members: &[Member], values: &[Option<Value>]) {
    use prost_reflect::Value as P;
    let (note, channel) = (Value::Str("loadgen".into()), Value::Str("web".into()));
    let descriptor = message.descriptor();
    for m in members {
        match m {
            Member::Record { name, .. } | Member::Leaf { name, .. } => {
                let Some(field) = descriptor.get_field_by_name(name) else {
                    continue;
                };
                let value = match m {
                    Member::Record { members, .. } => {
                        let prost_reflect::Kind::Message(nested) = field.kind() else {
                            continue;
                        };
                        let mut inner = DynamicMessage::new(nested);
                        proto_fill(&mut inner, members, values);
                        P::Message(inner)
                    }
                    Member::Leaf { ty, source, .. } => {
                        let Some(value) = value_of(*source, values, &note, &channel) else {
                            continue;
                        };
                        match ty {
                            Ty::Str | Ty::Decimal(_) => P::String(text_of(value, *ty)),
                            Ty::Int => P::I32(i32::try_from(number_of(value)).unwrap_or(i32::MAX)),
                            Ty::Long => P::I64(number_of(value)),
                            Ty::Double => P::F64(match value {
                                Value::Float(x) => *x,
                                other => number_of(other) as f64,
                            }),
                            Ty::Bool => P::Bool(matches!(value, Value::Bool(true))),
                            Ty::Time => {
                                let prost_reflect::Kind::Message(stamp) = field.kind() else {
                                    continue;
                                };
                                let ms = number_of(value);
                                let mut t = DynamicMessage::new(stamp);
                                t.set_field_by_number(1, P::I64(ms.div_euclid(1000)));
                                let nanos =
                                    i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap_or(0);
                                t.set_field_by_number(2, P::I32(nanos));
                                P::Message(t)
                            }
                        }
                    }
                };
                message.set_field(&field, value);
            }
        }
    }
}

#[cfg(test)]
mod tests;
