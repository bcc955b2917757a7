//! Avro records: a writer schema (as a schema registry serves it) parsed into a graph of types,
//! compiled against a declaration into a plan that reads the declared fields' values by path and
//! skips every other byte, and records decoded by that plan into [`Cell`]s. Only what the
//! declaration reads is kept; nothing is allocated per record.

use std::collections::HashMap;

use serde_json::Value as Json;

use super::FieldReader;
use super::extract::{Cell, PathTree};
use super::value::FieldKind;

/// An index into [`AvroSchema::nodes`].
type NodeId = usize;

/// One Avro type; named types appear once and are referred to by index.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Null,
    Boolean,
    Int(IntLogical),
    Long(LongLogical),
    Float,
    Double,
    /// `Some(scale)`: the `decimal` logical type.
    Bytes(Option<u32>),
    String,
    Fixed {
        size: usize,
        decimal: Option<u32>,
    },
    Enum(Vec<String>),
    Array(NodeId),
    Map(NodeId),
    Union(Vec<NodeId>),
    Record(Vec<(String, NodeId)>),
    /// A named type whose definition is still being read (a record naming itself).
    Pending,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntLogical {
    Plain,
    /// Days since the epoch.
    Date,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LongLogical {
    Plain,
    Millis,
    Micros,
}

/// A writer schema.
#[derive(Debug, Clone, PartialEq)]
pub struct AvroSchema {
    nodes: Vec<Node>,
    root: NodeId,
}

impl AvroSchema {
    /// Parses a schema's JSON text.
    pub fn parse(text: &str) -> Result<AvroSchema, String> {
        let json: Json =
            serde_json::from_str(text).map_err(|e| format!("not a JSON Avro schema: {e}"))?;
        let mut parser = Parser {
            nodes: Vec::new(),
            named: HashMap::new(),
        };
        let root = parser.node(&json, "")?;
        Ok(AvroSchema {
            nodes: parser.nodes,
            root,
        })
    }

    fn describe(&self, node: NodeId) -> String {
        match &self.nodes[node] {
            Node::Null => "null".into(),
            Node::Boolean => "boolean".into(),
            Node::Int(IntLogical::Plain) => "int".into(),
            Node::Int(IntLogical::Date) => "int (date)".into(),
            Node::Long(LongLogical::Plain) => "long".into(),
            Node::Long(LongLogical::Millis) => "long (timestamp-millis)".into(),
            Node::Long(LongLogical::Micros) => "long (timestamp-micros)".into(),
            Node::Float => "float".into(),
            Node::Double => "double".into(),
            Node::Bytes(None) => "bytes".into(),
            Node::Bytes(Some(s))
            | Node::Fixed {
                decimal: Some(s), ..
            } => {
                format!("decimal (scale {s})")
            }
            Node::String => "string".into(),
            Node::Fixed { size, .. } => format!("fixed({size})"),
            Node::Enum(_) => "enum".into(),
            Node::Array(_) => "array".into(),
            Node::Map(_) => "map".into(),
            Node::Record(_) | Node::Pending => "record".into(),
            Node::Union(branches) => branches
                .iter()
                .map(|&b| self.describe(b))
                .collect::<Vec<_>>()
                .join(" | "),
        }
    }
}

struct Parser {
    nodes: Vec<Node>,
    /// Full name -> node.
    named: HashMap<String, NodeId>,
}

fn full_name(name: &str, namespace: &str) -> String {
    if name.contains('.') || namespace.is_empty() {
        name.to_owned()
    } else {
        format!("{namespace}.{name}")
    }
}

impl Parser {
    fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn node(&mut self, json: &Json, namespace: &str) -> Result<NodeId, String> {
        match json {
            Json::String(name) => self.named_or_primitive(name, namespace, None),
            Json::Array(branches) => {
                let mut ids = Vec::with_capacity(branches.len());
                for b in branches {
                    ids.push(self.node(b, namespace)?);
                }
                Ok(self.push(Node::Union(ids)))
            }
            Json::Object(map) => {
                let kind = map
                    .get("type")
                    .ok_or_else(|| format!("a schema object without \"type\": {json}"))?;
                let logical = map.get("logicalType").and_then(Json::as_str);
                let kind = match kind {
                    Json::String(kind) => kind.as_str(),
                    // {"type": {...}} or {"type": [...]}: the inner schema.
                    other => return self.node(other, namespace),
                };
                let named =
                    |map: &serde_json::Map<String, Json>| -> Result<(String, String), String> {
                        let name = map
                            .get("name")
                            .and_then(Json::as_str)
                            .ok_or_else(|| format!("a {kind} without a name"))?;
                        let ns = map
                            .get("namespace")
                            .and_then(Json::as_str)
                            .unwrap_or(namespace);
                        let full = full_name(name, ns);
                        let ns = full.rsplit_once('.').map_or("", |(ns, _)| ns).to_owned();
                        Ok((full, ns))
                    };
                match kind {
                    "record" | "error" => {
                        let (full, ns) = named(map)?;
                        let id = self.push(Node::Pending);
                        self.named.insert(full.clone(), id);
                        let fields = map
                            .get("fields")
                            .and_then(Json::as_array)
                            .ok_or_else(|| format!("record {full} has no \"fields\" array"))?;
                        let mut out = Vec::with_capacity(fields.len());
                        for f in fields {
                            let name = f
                                .get("name")
                                .and_then(Json::as_str)
                                .ok_or_else(|| format!("a field of {full} without a name"))?;
                            let ty = f
                                .get("type")
                                .ok_or_else(|| format!("field {full}.{name} has no type"))?;
                            out.push((name.to_owned(), self.node(ty, &ns)?));
                        }
                        self.nodes[id] = Node::Record(out);
                        Ok(id)
                    }
                    "enum" => {
                        let (full, _) = named(map)?;
                        let symbols = map
                            .get("symbols")
                            .and_then(Json::as_array)
                            .ok_or_else(|| format!("enum {full} has no symbols"))?
                            .iter()
                            .map(|s| s.as_str().unwrap_or_default().to_owned())
                            .collect();
                        let id = self.push(Node::Enum(symbols));
                        self.named.insert(full, id);
                        Ok(id)
                    }
                    "fixed" => {
                        let (full, _) = named(map)?;
                        let size = map
                            .get("size")
                            .and_then(Json::as_u64)
                            .ok_or_else(|| format!("fixed {full} has no size"))?;
                        let decimal = (logical == Some("decimal")).then(|| scale_of(map));
                        let id = self.push(Node::Fixed {
                            size: usize::try_from(size).unwrap_or(usize::MAX),
                            decimal,
                        });
                        self.named.insert(full, id);
                        Ok(id)
                    }
                    "array" => {
                        let items = map.get("items").ok_or("an array without \"items\"")?;
                        let items = self.node(items, namespace)?;
                        Ok(self.push(Node::Array(items)))
                    }
                    "map" => {
                        let values = map.get("values").ok_or("a map without \"values\"")?;
                        let values = self.node(values, namespace)?;
                        Ok(self.push(Node::Map(values)))
                    }
                    primitive => {
                        let scale = (logical == Some("decimal")).then(|| scale_of(map));
                        self.named_or_primitive(primitive, namespace, logical.map(|l| (l, scale)))
                    }
                }
            }
            other => Err(format!("{other} is not an Avro schema")),
        }
    }

    fn named_or_primitive(
        &mut self,
        name: &str,
        namespace: &str,
        logical: Option<(&str, Option<u32>)>,
    ) -> Result<NodeId, String> {
        let (logical, scale) = logical.unwrap_or(("", None));
        let node = match name {
            "null" => Node::Null,
            "boolean" => Node::Boolean,
            "int" => Node::Int(if logical == "date" {
                IntLogical::Date
            } else {
                IntLogical::Plain
            }),
            "long" => Node::Long(match logical {
                "timestamp-millis" | "local-timestamp-millis" => LongLogical::Millis,
                "timestamp-micros" | "local-timestamp-micros" => LongLogical::Micros,
                _ => LongLogical::Plain,
            }),
            "float" => Node::Float,
            "double" => Node::Double,
            "bytes" => Node::Bytes(scale),
            "string" => Node::String,
            named => {
                return self
                    .named
                    .get(&full_name(named, namespace))
                    .or_else(|| self.named.get(named))
                    .copied()
                    .ok_or_else(|| format!("unknown Avro type {named:?}"));
            }
        };
        Ok(self.push(node))
    }
}

fn scale_of(map: &serde_json::Map<String, Json>) -> u32 {
    map.get("scale")
        .and_then(Json::as_u64)
        .and_then(|s| u32::try_from(s).ok())
        .unwrap_or(0)
}

/// How one record (or a nested record of it) is read: a step per writer field, in order.
#[derive(Debug, Clone, PartialEq)]
struct RecordPlan {
    steps: Vec<Step>,
}

#[derive(Debug, Clone, PartialEq)]
enum Step {
    Skip(NodeId),
    /// A declared field's value, into cell `slot`.
    Leaf {
        slot: usize,
        node: NodeId,
    },
    /// A parent of declared fields: a record, or a union holding one.
    Parent {
        node: NodeId,
        plan: RecordPlan,
    },
}

/// A writer schema compiled for one declaration.
#[derive(Debug, Clone, PartialEq)]
pub struct AvroDecoder {
    schema: AvroSchema,
    plan: RecordPlan,
}

impl AvroDecoder {
    /// Compiles `schema` for `fields`; also returns what the schema lacks or holds of another
    /// type than a field declares (such fields read as missing, or poison, per record).
    pub fn compile(schema: AvroSchema, fields: &[FieldReader]) -> (AvroDecoder, Vec<String>) {
        let paths = PathTree::new(fields.iter().map(|f| f.path.as_slice()));
        let mut problems = Vec::new();
        let plan = compile_record(&schema, schema.root, &paths, fields, &mut problems, "");
        (AvroDecoder { schema, plan }, problems)
    }

    /// Decodes an Avro body into `cells` (`cells[i]`: field `i`'s; an enum's symbol borrowed
    /// from the schema). An error says why the bytes are not a record of the schema.
    pub fn decode<'a>(
        &'a self,
        body: &'a [u8],
        cells: &mut [Option<Cell<'a>>],
    ) -> Result<(), String> {
        let mut r = Reader {
            buf: body,
            at: 0,
            depth: 0,
        };
        self.read_plan(&mut r, &self.plan, cells)?;
        if r.at != body.len() {
            return Err(format!("{} bytes left after the record", body.len() - r.at));
        }
        Ok(())
    }

    fn read_plan<'a>(
        &'a self,
        r: &mut Reader<'a>,
        plan: &RecordPlan,
        cells: &mut [Option<Cell<'a>>],
    ) -> Result<(), String> {
        for step in &plan.steps {
            match step {
                Step::Skip(node) => self.skip(r, *node)?,
                Step::Leaf { slot, node } => {
                    let cell = self.cell(r, *node)?;
                    if let Some(c) = cells.get_mut(*slot) {
                        *c = Some(cell);
                    }
                }
                Step::Parent { node, plan } => {
                    // A union holding the record: its branch says whether the record is there.
                    let node = match &self.schema.nodes[*node] {
                        Node::Union(branches) => {
                            let b = r.branch(branches.len())?;
                            branches[b]
                        }
                        _ => *node,
                    };
                    if matches!(self.schema.nodes[node], Node::Record(_)) {
                        r.enter()?;
                        self.read_plan(r, plan, cells)?;
                        r.depth -= 1;
                    } else {
                        self.skip(r, node)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// A value as a cell.
    fn cell<'a>(&'a self, r: &mut Reader<'a>, node: NodeId) -> Result<Cell<'a>, String> {
        Ok(match &self.schema.nodes[node] {
            Node::Null => Cell::Null,
            Node::Boolean => Cell::Bool(r.byte()? != 0),
            Node::Int(IntLogical::Plain) => Cell::Int(r.long()?),
            Node::Int(IntLogical::Date) => Cell::Millis(r.long()?.saturating_mul(86_400_000)),
            Node::Long(LongLogical::Plain) => Cell::Int(r.long()?),
            Node::Long(LongLogical::Millis) => Cell::Millis(r.long()?),
            Node::Long(LongLogical::Micros) => Cell::Micros(r.long()?),
            Node::Float => Cell::Float(f64::from(f32::from_le_bytes(r.array()?))),
            Node::Double => Cell::Float(f64::from_le_bytes(r.array()?)),
            Node::String => {
                let bytes = r.bytes()?;
                Cell::Str(std::str::from_utf8(bytes).map_err(|_| "a string that is not UTF-8")?)
            }
            Node::Bytes(None) => {
                r.bytes()?;
                Cell::Other("bytes")
            }
            Node::Bytes(Some(scale)) => decimal(r.bytes()?, *scale)?,
            Node::Fixed { size, decimal: d } => {
                let bytes = r.take(*size)?;
                match d {
                    Some(scale) => decimal(bytes, *scale)?,
                    None => Cell::Other("a fixed"),
                }
            }
            Node::Enum(symbols) => Cell::Str(&symbols[r.branch(symbols.len())?]),
            Node::Union(branches) => {
                let b = r.branch(branches.len())?;
                return self.cell(r, branches[b]);
            }
            Node::Array(_) | Node::Map(_) | Node::Record(_) | Node::Pending => {
                let what = match &self.schema.nodes[node] {
                    Node::Array(_) => "an array",
                    Node::Map(_) => "a map",
                    _ => "a record",
                };
                self.skip(r, node)?;
                Cell::Other(what)
            }
        })
    }

    fn skip(&self, r: &mut Reader<'_>, node: NodeId) -> Result<(), String> {
        match &self.schema.nodes[node] {
            Node::Null => {}
            Node::Boolean => {
                r.take(1)?;
            }
            Node::Int(_) | Node::Long(_) | Node::Enum(_) => {
                r.long()?;
            }
            Node::Float => {
                r.take(4)?;
            }
            Node::Double => {
                r.take(8)?;
            }
            Node::Bytes(_) | Node::String => {
                r.bytes()?;
            }
            Node::Fixed { size, .. } => {
                r.take(*size)?;
            }
            Node::Union(branches) => {
                let b = r.branch(branches.len())?;
                self.skip(r, branches[b])?;
            }
            Node::Record(fields) => {
                r.enter()?;
                for (_, f) in fields {
                    self.skip(r, *f)?;
                }
                r.depth -= 1;
            }
            Node::Array(items) => {
                r.enter()?;
                self.skip_blocks(r, *items, false)?;
                r.depth -= 1;
            }
            Node::Map(values) => {
                r.enter()?;
                self.skip_blocks(r, *values, true)?;
                r.depth -= 1;
            }
            Node::Pending => return Err("a record used before its definition ends".into()),
        }
        Ok(())
    }

    /// Skips array or map blocks: a count (negative: followed by the block's byte size), then
    /// that many items (a map's: a string key, then the value), until a count of 0.
    fn skip_blocks(&self, r: &mut Reader<'_>, item: NodeId, keyed: bool) -> Result<(), String> {
        loop {
            let count = r.long()?;
            if count == 0 {
                return Ok(());
            }
            if count < 0 {
                let size = r.long()?;
                r.take(usize::try_from(size).map_err(|_| "a negative block size")?)?;
                continue;
            }
            for _ in 0..count {
                if keyed {
                    r.bytes()?;
                }
                self.skip(r, item)?;
            }
        }
    }
}

/// A decimal's two's-complement big-endian unscaled bytes.
fn decimal<'a>(bytes: &[u8], scale: u32) -> Result<Cell<'a>, String> {
    if bytes.len() > 16 {
        return Err(format!(
            "a decimal of {} bytes (at most 16 read)",
            bytes.len()
        ));
    }
    let mut units: i128 = if bytes.first().is_some_and(|b| b & 0x80 != 0) {
        -1
    } else {
        0
    };
    for b in bytes {
        units = (units << 8) | i128::from(*b);
    }
    Ok(Cell::Decimal { units, scale })
}

fn compile_record(
    schema: &AvroSchema,
    node: NodeId,
    paths: &PathTree,
    fields: &[FieldReader],
    problems: &mut Vec<String>,
    at: &str,
) -> RecordPlan {
    let Node::Record(writer_fields) = &schema.nodes[node] else {
        return RecordPlan { steps: Vec::new() };
    };
    let mut steps = Vec::with_capacity(writer_fields.len());
    for (name, ty) in writer_fields {
        let Some((_, child)) = paths.children.iter().find(|(k, _)| k == name) else {
            steps.push(Step::Skip(*ty));
            continue;
        };
        let path = if at.is_empty() {
            name.clone()
        } else {
            format!("{at}.{name}")
        };
        if !child.children.is_empty() {
            // A record, or a union of null and a record.
            let record = match &schema.nodes[*ty] {
                Node::Record(_) => Some(*ty),
                Node::Union(branches) => branches
                    .iter()
                    .copied()
                    .find(|&b| matches!(schema.nodes[b], Node::Record(_))),
                _ => None,
            };
            match record {
                Some(record) => {
                    let plan = compile_record(schema, record, child, fields, problems, &path);
                    steps.push(Step::Parent { node: *ty, plan });
                }
                None => {
                    problems.push(format!(
                        "{path} is {}, not a record holding {}",
                        schema.describe(*ty),
                        child
                            .children
                            .iter()
                            .map(|(k, _)| format!("{path}.{k}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                    steps.push(Step::Skip(*ty));
                }
            }
            continue;
        }
        if let Some(slot) = child.field {
            if let Some(problem) = fits(schema, *ty, &fields[slot]) {
                problems.push(format!(
                    "field {:?} at {path}: {problem}",
                    fields[slot].name
                ));
            }
            steps.push(Step::Leaf { slot, node: *ty });
        }
    }
    for (name, child) in &paths.children {
        if !writer_fields.iter().any(|(n, _)| n == name) {
            let path = if at.is_empty() {
                name.clone()
            } else {
                format!("{at}.{name}")
            };
            let declared: Vec<String> = declared_under(child, fields);
            problems.push(format!(
                "the schema has no field {path} ({} reads it)",
                declared.join(", ")
            ));
        }
    }
    RecordPlan { steps }
}

fn declared_under(paths: &PathTree, fields: &[FieldReader]) -> Vec<String> {
    let mut out: Vec<String> = paths
        .field
        .iter()
        .map(|&i| format!("field {:?}", fields[i].name))
        .collect();
    for (_, child) in &paths.children {
        out.extend(declared_under(child, fields));
    }
    out
}

/// Why values of `node` cannot be read as `field` declares, if they cannot; unions are
/// judged by their non-null branches (a null reads as missing, per record).
fn fits(schema: &AvroSchema, node: NodeId, field: &FieldReader) -> Option<String> {
    let branches: Vec<NodeId> = match &schema.nodes[node] {
        Node::Union(b) => b
            .iter()
            .copied()
            .filter(|&b| schema.nodes[b] != Node::Null)
            .collect(),
        _ => vec![node],
    };
    let reads = |n: &Node| match field.kind {
        FieldKind::String => matches!(n, Node::String | Node::Enum(_)),
        FieldKind::Integer => matches!(
            n,
            Node::Int(IntLogical::Plain) | Node::Long(LongLogical::Plain)
        ),
        FieldKind::Decimal => matches!(
            n,
            Node::Int(IntLogical::Plain)
                | Node::Long(LongLogical::Plain)
                | Node::String
                | Node::Bytes(Some(_))
                | Node::Fixed {
                    decimal: Some(_),
                    ..
                }
        ),
        FieldKind::Float => matches!(
            n,
            Node::Float
                | Node::Double
                | Node::Int(IntLogical::Plain)
                | Node::Long(LongLogical::Plain)
        ),
        FieldKind::Boolean => matches!(n, Node::Boolean),
        FieldKind::Timestamp => matches!(n, Node::Int(_) | Node::Long(_) | Node::String),
    };
    let bad: Vec<String> = branches
        .iter()
        .filter(|&&b| !reads(&schema.nodes[b]))
        .map(|&b| schema.describe(b))
        .collect();
    if branches.is_empty() {
        return Some("the schema's type is null".into());
    }
    (!bad.is_empty()).then(|| {
        format!(
            "the schema's type is {}, which a {} field does not read",
            schema.describe(node),
            field.kind.as_str()
        )
    })
}

/// How deep records, arrays and maps may nest in a record read: a recursive schema with data
/// nested deeper is refused rather than recursed into without bound.
const MAX_DEPTH: u32 = 64;

/// A cursor over an Avro body.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    depth: u32,
}

impl<'a> Reader<'a> {
    fn enter(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("values nested more than {MAX_DEPTH} deep"));
        }
        Ok(())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                format!(
                    "the payload ends at byte {} of a value needing {n}",
                    self.buf.len() - self.at
                )
            })?;
        let out = &self.buf[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn byte(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// A zig-zag varint.
    fn long(&mut self) -> Result<i64, String> {
        let mut value: u64 = 0;
        for shift in (0..70).step_by(7) {
            let b = self.byte()?;
            if shift == 63 && b > 1 {
                return Err("a varint longer than 64 bits".into());
            }
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(((value >> 1) as i64) ^ -((value & 1) as i64));
            }
        }
        Err("a varint longer than 64 bits".into())
    }

    fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.long()?;
        let n = usize::try_from(n).map_err(|_| format!("a negative length {n}"))?;
        self.take(n)
    }

    fn branch(&mut self, branches: usize) -> Result<usize, String> {
        let b = self.long()?;
        usize::try_from(b)
            .ok()
            .filter(|&b| b < branches)
            .ok_or_else(|| format!("branch {b} of a union or enum of {branches}"))
    }
}
