//! Protobuf records: a writer schema (a `.proto` file as a schema registry serves it, its
//! imports of Google's well-known types resolved) compiled against a declaration into a plan per
//! message, which reads the declared fields' values by field number and skips every other
//! byte. `google.protobuf.Timestamp` reads as a time, the wrapper types as their value; a
//! proto3 scalar without presence reads as its default when absent, as Protobuf defines it.

use prost_reflect::{Kind, MessageDescriptor};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

use super::FieldReader;
use super::extract::{Cell, PathTree};
use super::value::FieldKind;

/// The file name the registry's schema text is compiled under.
const SCHEMA_FILE: &str = "schema.proto";

/// How one message is read.
#[derive(Debug, Clone, PartialEq)]
struct MessagePlan {
    /// Declared fields and parents of this message, by field number.
    fields: Vec<(u32, FieldStep)>,
    /// Cells set when the message is read, before its fields: the defaults of proto3 scalars
    /// without presence, which the wire leaves out.
    defaults: Vec<(usize, Default)>,
}

#[derive(Debug, Clone, PartialEq)]
enum Default {
    Int,
    Float,
    Bool,
    Str,
    /// An enum's value numbered 0, by name.
    Symbol(String),
}

#[derive(Debug, Clone, PartialEq)]
enum FieldStep {
    Leaf { slot: usize, kind: Scalar },
    Parent(Box<MessagePlan>),
}

/// What a declared field's wire value is.
#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    Int,
    Uint,
    Sint,
    Bool,
    Fixed32,
    Sfixed32,
    Fixed64,
    Sfixed64,
    Float,
    Double,
    Str,
    /// An enum, read as its value's name.
    Enum(Vec<(i32, String)>),
    /// `google.protobuf.Timestamp`: seconds (1) and nanos (2).
    Timestamp,
    /// A wrapper (`google.protobuf.StringValue`, ...): its field 1.
    Wrapper(Box<Scalar>),
    /// Something no declared type reads: bytes, a message, a repeated field, a map.
    Other(&'static str),
}

impl Scalar {
    fn is_integer(&self) -> bool {
        matches!(
            self,
            Scalar::Int
                | Scalar::Uint
                | Scalar::Sint
                | Scalar::Fixed32
                | Scalar::Sfixed32
                | Scalar::Fixed64
                | Scalar::Sfixed64
        )
    }
}

/// A writer schema compiled for one declaration: a plan per message it holds, by the message
/// indexes the Confluent framing names a record's message with.
#[derive(Debug, Clone, PartialEq)]
pub struct ProtobufDecoder {
    messages: Vec<(Vec<i32>, MessagePlan)>,
}

struct Source(String);

impl FileResolver for Source {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        if name == SCHEMA_FILE {
            File::from_source(name, &self.0)
        } else {
            Err(protox::Error::file_not_found(name))
        }
    }
}

impl ProtobufDecoder {
    /// Compiles the schema text `proto` for `fields`; also returns what the schema's first
    /// message (the one a record names by default) lacks or holds of another type.
    pub fn compile(
        proto: &str,
        fields: &[FieldReader],
    ) -> Result<(ProtobufDecoder, Vec<String>), String> {
        let mut resolver = ChainFileResolver::new();
        resolver.add(Source(proto.to_owned()));
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler.include_imports(true);
        compiler
            .open_file(SCHEMA_FILE)
            .map_err(|e| format!("the Protobuf schema does not compile: {e}"))?;
        let pool = compiler.descriptor_pool();
        let file = pool
            .get_file_by_name(SCHEMA_FILE)
            .ok_or("the Protobuf schema holds no file")?;
        let paths = PathTree::new(fields.iter().map(|f| f.path.as_slice()));
        let mut messages = Vec::new();
        let mut first_problems = None;
        let mut stack: Vec<(Vec<i32>, MessageDescriptor)> = file
            .messages()
            .enumerate()
            .map(|(i, m)| (vec![i32::try_from(i).unwrap_or(i32::MAX)], m))
            .collect();
        while let Some((indexes, message)) = stack.pop() {
            let mut problems = Vec::new();
            let plan = compile_message(&message, &paths, fields, &mut problems, "", 0);
            if indexes == [0] {
                first_problems = Some(problems);
            }
            for (i, child) in message.child_messages().enumerate() {
                if child.is_map_entry() {
                    continue;
                }
                let mut nested = indexes.clone();
                nested.push(i32::try_from(i).unwrap_or(i32::MAX));
                stack.push((nested, child));
            }
            messages.push((indexes, plan));
        }
        if messages.is_empty() {
            return Err("the Protobuf schema defines no message".into());
        }
        Ok((
            ProtobufDecoder { messages },
            first_problems.unwrap_or_default(),
        ))
    }

    /// Decodes the message named by `indexes` (Confluent's message indexes) into `cells`.
    pub fn decode<'a>(
        &'a self,
        indexes: &[i32],
        body: &'a [u8],
        cells: &mut [Option<Cell<'a>>],
    ) -> Result<(), String> {
        let plan = self
            .messages
            .iter()
            .find(|(i, _)| i == indexes)
            .map(|(_, p)| p)
            .ok_or_else(|| format!("the schema has no message at indexes {indexes:?}"))?;
        read_message(plan, body, cells, 0)
    }
}

/// How deep messages may nest in a record read.
const MAX_DEPTH: u32 = 64;

fn compile_message(
    message: &MessageDescriptor,
    paths: &PathTree,
    fields: &[FieldReader],
    problems: &mut Vec<String>,
    at: &str,
    depth: u32,
) -> MessagePlan {
    let mut plan = MessagePlan {
        fields: Vec::new(),
        defaults: Vec::new(),
    };
    if depth > MAX_DEPTH {
        return plan;
    }
    for (name, child) in &paths.children {
        let path = if at.is_empty() {
            name.clone()
        } else {
            format!("{at}.{name}")
        };
        let Some(field) = message.get_field_by_name(name) else {
            problems.push(format!(
                "message {} has no field {name} ({path})",
                message.full_name()
            ));
            continue;
        };
        if !child.children.is_empty() {
            match field.kind() {
                Kind::Message(m) if !field.is_list() && !field.is_map() => {
                    let nested = compile_message(&m, child, fields, problems, &path, depth + 1);
                    plan.fields
                        .push((field.number(), FieldStep::Parent(Box::new(nested))));
                }
                _ => problems.push(format!(
                    "{path} is not a message holding its declared fields"
                )),
            }
            continue;
        }
        let Some(slot) = child.field else {
            continue;
        };
        let scalar = if field.is_list() || field.is_map() {
            Scalar::Other("a repeated field")
        } else {
            scalar_of(&field.kind())
        };
        if let Some(problem) = fits(&scalar, &fields[slot]) {
            problems.push(format!(
                "field {:?} at {path}: {problem}",
                fields[slot].name
            ));
        }
        // proto3's implicit presence: absent on the wire means the default value.
        if !field.supports_presence() && !field.is_list() && !field.is_map() {
            let default = match &scalar {
                Scalar::Str => Some(Default::Str),
                Scalar::Enum(values) => Some(Default::Symbol(
                    values
                        .iter()
                        .find(|(n, _)| *n == 0)
                        .map_or(String::new(), |(_, name)| name.clone()),
                )),
                Scalar::Bool => Some(Default::Bool),
                Scalar::Float | Scalar::Double => Some(Default::Float),
                integer if integer.is_integer() => Some(Default::Int),
                _ => None,
            };
            if let Some(d) = default {
                plan.defaults.push((slot, d));
            }
        }
        plan.fields
            .push((field.number(), FieldStep::Leaf { slot, kind: scalar }));
    }
    plan.fields.sort_by_key(|(n, _)| *n);
    plan
}

fn scalar_of(kind: &Kind) -> Scalar {
    match kind {
        Kind::Int32 | Kind::Int64 => Scalar::Int,
        Kind::Uint32 | Kind::Uint64 => Scalar::Uint,
        Kind::Sint32 | Kind::Sint64 => Scalar::Sint,
        Kind::Bool => Scalar::Bool,
        Kind::Fixed32 => Scalar::Fixed32,
        Kind::Sfixed32 => Scalar::Sfixed32,
        Kind::Fixed64 => Scalar::Fixed64,
        Kind::Sfixed64 => Scalar::Sfixed64,
        Kind::Float => Scalar::Float,
        Kind::Double => Scalar::Double,
        Kind::String => Scalar::Str,
        Kind::Bytes => Scalar::Other("bytes"),
        Kind::Enum(e) => Scalar::Enum(
            e.values()
                .map(|v| (v.number(), v.name().to_owned()))
                .collect(),
        ),
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Timestamp" => Scalar::Timestamp,
            "google.protobuf.StringValue" => Scalar::Wrapper(Box::new(Scalar::Str)),
            "google.protobuf.Int64Value" | "google.protobuf.Int32Value" => {
                Scalar::Wrapper(Box::new(Scalar::Int))
            }
            "google.protobuf.UInt64Value" | "google.protobuf.UInt32Value" => {
                Scalar::Wrapper(Box::new(Scalar::Uint))
            }
            "google.protobuf.DoubleValue" => Scalar::Wrapper(Box::new(Scalar::Double)),
            "google.protobuf.FloatValue" => Scalar::Wrapper(Box::new(Scalar::Float)),
            "google.protobuf.BoolValue" => Scalar::Wrapper(Box::new(Scalar::Bool)),
            _ => Scalar::Other("a message"),
        },
    }
}

/// Why values of `scalar` cannot be read as `field` declares, if they cannot.
fn fits(scalar: &Scalar, field: &FieldReader) -> Option<String> {
    let inner = match scalar {
        Scalar::Wrapper(inner) => inner.as_ref(),
        other => other,
    };
    let integer = inner.is_integer();
    let ok = match field.kind {
        FieldKind::String => matches!(inner, Scalar::Str | Scalar::Enum(_)),
        FieldKind::Integer => integer,
        FieldKind::Decimal => integer || matches!(inner, Scalar::Str),
        FieldKind::Float => integer || matches!(inner, Scalar::Float | Scalar::Double),
        FieldKind::Boolean => matches!(inner, Scalar::Bool),
        FieldKind::Timestamp => integer || matches!(inner, Scalar::Timestamp | Scalar::Str),
    };
    (!ok).then(|| {
        format!(
            "the schema's type is {}, which a {} field does not read",
            describe(scalar),
            field.kind.as_str()
        )
    })
}

fn describe(scalar: &Scalar) -> String {
    match scalar {
        Scalar::Int => "int32/int64".into(),
        Scalar::Uint => "uint32/uint64".into(),
        Scalar::Sint => "sint32/sint64".into(),
        Scalar::Bool => "bool".into(),
        Scalar::Fixed32 => "fixed32".into(),
        Scalar::Sfixed32 => "sfixed32".into(),
        Scalar::Fixed64 => "fixed64".into(),
        Scalar::Sfixed64 => "sfixed64".into(),
        Scalar::Float => "float".into(),
        Scalar::Double => "double".into(),
        Scalar::Str => "string".into(),
        Scalar::Enum(_) => "an enum".into(),
        Scalar::Timestamp => "google.protobuf.Timestamp".into(),
        Scalar::Wrapper(inner) => format!("a wrapper of {}", describe(inner)),
        Scalar::Other(what) => (*what).into(),
    }
}

/// A cursor over a Protobuf message.
struct Wire<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Wire<'a> {
    fn done(&self) -> bool {
        self.at >= self.buf.len()
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("the payload ends inside a value of {n} bytes"))?;
        let out = &self.buf[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut value: u64 = 0;
        for shift in (0..70).step_by(7) {
            let b = *self.take(1)?.first().unwrap_or(&0);
            if shift == 63 && b > 1 {
                return Err("a varint longer than 64 bits".into());
            }
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a varint longer than 64 bits".into())
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn delimited(&mut self) -> Result<&'a [u8], String> {
        let n = self.varint()?;
        self.take(usize::try_from(n).map_err(|_| "a length beyond memory")?)
    }

    /// Skips a value of wire type `wire`.
    fn skip(&mut self, wire: u64) -> Result<(), String> {
        match wire {
            0 => {
                self.varint()?;
            }
            1 => {
                self.take(8)?;
            }
            2 => {
                self.delimited()?;
            }
            5 => {
                self.take(4)?;
            }
            other => return Err(format!("wire type {other} (groups are not read)")),
        }
        Ok(())
    }
}

fn read_message<'a>(
    plan: &'a MessagePlan,
    body: &'a [u8],
    cells: &mut [Option<Cell<'a>>],
    depth: u32,
) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Err(format!("messages nested more than {MAX_DEPTH} deep"));
    }
    for (slot, default) in &plan.defaults {
        if let Some(c) = cells.get_mut(*slot) {
            *c = Some(match default {
                Default::Int => Cell::Int(0),
                Default::Float => Cell::Float(0.0),
                Default::Bool => Cell::Bool(false),
                Default::Str => Cell::Str(""),
                Default::Symbol(name) => Cell::Str(name),
            });
        }
    }
    let mut w = Wire { buf: body, at: 0 };
    while !w.done() {
        let tag = w.varint()?;
        let (number, wire) = (tag >> 3, tag & 7);
        let step = plan
            .fields
            .binary_search_by_key(&number, |(n, _)| u64::from(*n))
            .ok()
            .map(|i| &plan.fields[i].1);
        match step {
            None => w.skip(wire)?,
            Some(FieldStep::Parent(nested)) => {
                if wire != 2 {
                    return Err(format!(
                        "field {number}: a message sent as wire type {wire}"
                    ));
                }
                let inner = w.delimited()?;
                read_message(nested, inner, cells, depth + 1)?;
            }
            Some(FieldStep::Leaf { slot, kind }) => {
                let cell = read_scalar(&mut w, wire, kind, number)?;
                if let Some(c) = cells.get_mut(*slot) {
                    *c = Some(cell);
                }
            }
        }
    }
    Ok(())
}

fn read_scalar<'a>(
    w: &mut Wire<'a>,
    wire: u64,
    kind: &'a Scalar,
    number: u64,
) -> Result<Cell<'a>, String> {
    let expect = |want: u64| {
        if wire == want {
            Ok(())
        } else {
            Err(format!(
                "field {number}: wire type {wire}, the schema's type needs {want}"
            ))
        }
    };
    Ok(match kind {
        Scalar::Int => {
            expect(0)?;
            Cell::Int(w.varint()? as i64)
        }
        Scalar::Uint => {
            expect(0)?;
            let v = w.varint()?;
            i64::try_from(v).map_or(Cell::Other("an unsigned integer beyond Int64"), Cell::Int)
        }
        Scalar::Sint => {
            expect(0)?;
            let v = w.varint()?;
            Cell::Int(((v >> 1) as i64) ^ -((v & 1) as i64))
        }
        Scalar::Bool => {
            expect(0)?;
            Cell::Bool(w.varint()? != 0)
        }
        Scalar::Fixed32 => {
            expect(5)?;
            Cell::Int(i64::from(u32::from_le_bytes(w.fixed()?)))
        }
        Scalar::Sfixed32 => {
            expect(5)?;
            Cell::Int(i64::from(i32::from_le_bytes(w.fixed()?)))
        }
        Scalar::Fixed64 => {
            expect(1)?;
            let v = u64::from_le_bytes(w.fixed()?);
            i64::try_from(v).map_or(Cell::Other("an unsigned integer beyond Int64"), Cell::Int)
        }
        Scalar::Sfixed64 => {
            expect(1)?;
            Cell::Int(i64::from_le_bytes(w.fixed()?))
        }
        Scalar::Float => {
            expect(5)?;
            Cell::Float(f64::from(f32::from_le_bytes(w.fixed()?)))
        }
        Scalar::Double => {
            expect(1)?;
            Cell::Float(f64::from_le_bytes(w.fixed()?))
        }
        Scalar::Str => {
            expect(2)?;
            let bytes = w.delimited()?;
            Cell::Str(
                std::str::from_utf8(bytes)
                    .map_err(|_| format!("field {number}: a string that is not UTF-8"))?,
            )
        }
        Scalar::Enum(values) => {
            expect(0)?;
            let n = w.varint()? as i64;
            match values.iter().find(|(v, _)| i64::from(*v) == n) {
                Some((_, name)) => Cell::Str(name),
                None => Cell::Int(n),
            }
        }
        Scalar::Timestamp => {
            expect(2)?;
            let inner = w.delimited()?;
            let mut t = Wire { buf: inner, at: 0 };
            let (mut seconds, mut nanos) = (0i64, 0i64);
            while !t.done() {
                let tag = t.varint()?;
                match (tag >> 3, tag & 7) {
                    (1, 0) => seconds = t.varint()? as i64,
                    (2, 0) => nanos = i64::from(t.varint()? as i32),
                    (_, wire) => t.skip(wire)?,
                }
            }
            Cell::Micros(
                seconds
                    .saturating_mul(1_000_000)
                    .saturating_add(nanos.div_euclid(1000)),
            )
        }
        Scalar::Wrapper(inner) => {
            expect(2)?;
            let body = w.delimited()?;
            let mut t = Wire { buf: body, at: 0 };
            // Absent inside the wrapper: the inner type's default.
            let mut value = match inner.as_ref() {
                Scalar::Str => Cell::Str(""),
                Scalar::Bool => Cell::Bool(false),
                Scalar::Float | Scalar::Double => Cell::Float(0.0),
                _ => Cell::Int(0),
            };
            while !t.done() {
                let tag = t.varint()?;
                if tag >> 3 == 1 {
                    value = read_scalar(&mut t, tag & 7, inner, 1)?;
                } else {
                    t.skip(tag & 7)?;
                }
            }
            value
        }
        Scalar::Other(what) => {
            w.skip(wire)?;
            Cell::Other(what)
        }
    })
}
