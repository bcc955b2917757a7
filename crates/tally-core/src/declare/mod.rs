//! Jobs by declaration: the `[aggregation]` section of a job file says which typed fields a record
//! holds, which records count, what they are grouped by and what is computed per window. It is
//! checked as a whole before anything starts ([`Declaration::resolve`]: every mistake, each named
//! by its key), and resolves to a [`Job`] that turns a record's bytes into the windows, key and
//! values it adds, or into the reason it is dead-lettered.

mod aggregate;
mod avro;
mod change;
mod extract;
mod filter;
mod framed;
mod protobuf;
mod value;

#[cfg(test)]
mod framed_tests;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeSet;
use std::fmt;

use compact_str::CompactString;
use serde::Deserialize;
use serde_json::value::RawValue;

pub use aggregate::{Aggregate, Function, Overflow};
pub use avro::{AvroDecoder, AvroSchema};
pub use change::{Change, Op, Position, lsn_text, parse_lsn};
pub use extract::{Cell, FieldReader, PathTree, StringFormat, TimeUnit};
pub use filter::{Condition, ConditionDecl, Test};
pub use framed::{Schemas, WriterSchema, message_indexes, schema_id};
pub use protobuf::ProtobufDecoder;
pub use value::{
    FieldKind, FieldType, MAX_DECIMAL_SCALE, MAX_DECIMAL18_UNITS, Value, format_decimal,
    parse_decimal,
};

use crate::decode::{Poison, document, not_a_json_object};
use crate::window::WindowSpec;
use crate::window_agg::{RowShape, WindowAgg, Word, WordKind};

/// Record formats a job can read: JSON events, Avro or Protobuf events in the Confluent wire
/// format (their schemas in a schema registry), or Debezium change events in JSON (a row of a
/// source table, its changes retracting what its earlier image added).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum Format {
    #[default]
    #[serde(rename = "json")]
    Json,
    #[serde(rename = "avro")]
    Avro,
    #[serde(rename = "protobuf")]
    Protobuf,
    #[serde(rename = "debezium-json")]
    DebeziumJson,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Avro => "avro",
            Format::Protobuf => "protobuf",
            Format::DebeziumJson => "debezium-json",
        }
    }

    /// Whether records are changes of a table's rows rather than events.
    pub fn is_changes(self) -> bool {
        self == Format::DebeziumJson
    }

    /// Whether records are in the Confluent wire format, their writer schemas in a registry.
    pub fn is_framed(self) -> bool {
        matches!(self, Format::Avro | Format::Protobuf)
    }
}

/// `[[aggregation.field]]`: one typed field of the record.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldDecl {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FieldKind,
    /// Dotted path from the record's root (`customer.address.country`); default: the name.
    pub path: Option<String>,
    /// Fractional digits of a decimal (0..=18).
    pub scale: Option<u32>,
    /// For timestamps given as numbers: `ms` (default) or `s`.
    pub unit: Option<String>,
    /// For strings: `currency_code` (three upper-case letters).
    pub format: Option<String>,
    /// An empty string counts as missing unless this is set.
    #[serde(default)]
    pub allow_empty: bool,
}

/// `[[aggregation.aggregate]]`: one output column.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregateDecl {
    pub column: String,
    pub function: Function,
    pub field: Option<String>,
}

/// The `[aggregation]` section as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Declaration {
    #[serde(default)]
    pub format: Format,
    #[serde(default, rename = "field")]
    pub fields: Vec<FieldDecl>,
    /// The field naming an event (events; a change job's rows are named by `primary_key`).
    #[serde(default)]
    pub event_id: Option<String>,
    /// A change job's primary key: the fields naming its rows.
    #[serde(default)]
    pub primary_key: Vec<String>,
    pub event_time: String,
    #[serde(default)]
    pub group_by: Vec<String>,
    #[serde(default)]
    pub filter: Vec<ConditionDecl>,
    #[serde(default, rename = "aggregate")]
    pub aggregates: Vec<AggregateDecl>,
}

/// The window rules of the `[window]` section, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowRules {
    pub size_ms: i64,
    /// `None`: tumbling (slide = size).
    pub slide_ms: Option<i64>,
    pub allowed_lateness_ms: i64,
    pub dedup_horizon_ms: i64,
}

/// A declaration mistake: the key it is at and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mistake {
    pub key: String,
    pub message: String,
}

/// Every mistake of a declaration, so that one edit can fix them all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct DeclarationError {
    pub mistakes: Vec<Mistake>,
}

impl fmt::Display for DeclarationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the job declaration has {} mistake(s):",
            self.mistakes.len()
        )?;
        for m in &self.mistakes {
            write!(f, "\n  {}: {}", m.key, m.message)?;
        }
        Ok(())
    }
}

/// Columns tally writes beside the declared ones; a declared column may not take their names.
pub const RESERVED_COLUMNS: [&str; 4] =
    ["window_start", "window_end", "version", "source_partition"];

/// A checked declaration: how to read, filter, key and aggregate a record.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub format: Format,
    pub fields: Vec<FieldReader>,
    paths: PathTree,
    pub event_id: usize,
    pub event_time: usize,
    pub keys: Vec<usize>,
    pub filter: Vec<Condition>,
    pub aggregates: Vec<Aggregate>,
    pub windows: WindowSpec,
    /// Set for a job of change events: its primary key and the envelope around its rows.
    pub changes: Option<ChangeSchema>,
}

/// How a change job's records name and carry their rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeSchema {
    /// Indexes of the primary key's fields, in order.
    pub primary_key: Vec<usize>,
    envelope: change::Envelope,
}

/// What one record adds: its id and time, its group key, and each aggregate's input value
/// (`None` for `count`).
#[derive(Debug, Clone, PartialEq)]
pub struct DeclaredEvent {
    pub event_id: CompactString,
    pub event_time_ms: i64,
    pub key: Vec<Value>,
    pub inputs: Vec<Option<Value>>,
}

/// One record's declared field values as a format read them, by field index: JSON's raw
/// values, or the cells a binary format decoded.
pub(crate) trait FieldValues {
    /// Whether field `i` has a value (not missing, not null).
    fn present(&self, i: usize) -> bool;
    /// Field `i`'s value as `field` reads it.
    fn read(&self, field: &FieldReader, i: usize) -> Result<Value, Poison>;
}

impl FieldValues for [Option<&RawValue>] {
    fn present(&self, i: usize) -> bool {
        self[i].is_some_and(|raw| raw.get() != "null")
    }

    fn read(&self, field: &FieldReader, i: usize) -> Result<Value, Poison> {
        field.read(self[i])
    }
}

impl FieldValues for [Option<Cell<'_>>] {
    fn present(&self, i: usize) -> bool {
        !matches!(self[i], None | Some(Cell::Null))
    }

    fn read(&self, field: &FieldReader, i: usize) -> Result<Value, Poison> {
        field.read_cell(self[i].as_ref())
    }
}

/// A valid record either counts or is filtered out.
#[derive(Debug, Clone, PartialEq)]
pub enum Evaluation {
    Event(DeclaredEvent),
    Filtered,
}

fn is_identifier(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

struct Checker {
    mistakes: Vec<Mistake>,
}

impl Checker {
    fn refuse(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.mistakes.push(Mistake {
            key: key.into(),
            message: message.into(),
        });
    }
}

/// A duration as the job file writes it (`90s`, `5m`, `1h`).
pub fn format_duration(ms: i64) -> String {
    match ms {
        ms if ms % 3_600_000 == 0 && ms != 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 && ms != 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

impl Declaration {
    /// Checks the declaration with the job's window rules; every mistake is reported at once.
    pub fn resolve(&self, rules: WindowRules) -> Result<Job, DeclarationError> {
        let mut c = Checker {
            mistakes: Vec::new(),
        };
        // A change job names its rows by primary key: it keeps no event ids to expire.
        let windows = check_windows(&mut c, rules, !self.format.is_changes());
        let fields = self.check_fields(&mut c);
        let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
        let mut used = BTreeSet::new();
        let mut find = |c: &mut Checker, key: String, name: &str| -> Option<usize> {
            match names.iter().position(|n| *n == name) {
                Some(i) => {
                    used.insert(i);
                    Some(i)
                }
                None => {
                    c.refuse(
                        key,
                        format!(
                            "no field named {name:?} (declared: {})",
                            if names.is_empty() {
                                "none".to_owned()
                            } else {
                                names.join(", ")
                            }
                        ),
                    );
                    None
                }
            }
        };
        let kind_of = |i: usize| fields.get(i).map(|f: &FieldReader| f.kind);

        let changes = self.format.is_changes();
        // An event names itself by its id; a change names its row by the primary key, and
        // the key's first field stands for the id (the operator keeps no ids of changes).
        let mut primary_key = Vec::new();
        for (i, name) in self.primary_key.iter().enumerate() {
            let key = format!("aggregation.primary_key[{i}]");
            let Some(index) = find(&mut c, key.clone(), name) else {
                continue;
            };
            if let Some(kind) = kind_of(index)
                && !matches!(
                    kind,
                    FieldKind::String | FieldKind::Integer | FieldKind::Decimal
                )
            {
                c.refuse(
                    key.clone(),
                    format!(
                        "field {name:?} is a {}; a primary key is strings, integers or decimals",
                        kind.as_str()
                    ),
                );
            }
            if primary_key.contains(&index) {
                c.refuse(key, format!("field {name:?} is in the key twice"));
            }
            primary_key.push(index);
        }
        let event_id = match (changes, &self.event_id) {
            (false, Some(name)) => find(&mut c, "aggregation.event_id".into(), name),
            (false, None) => {
                c.refuse("aggregation.event_id", "missing: name the field that identifies an event (a repeated id is a duplicate)");
                None
            }
            (true, Some(_)) => {
                c.refuse("aggregation.event_id", format!("a job of {} changes names its rows by aggregation.primary_key, not by an event id", self.format.as_str()));
                None
            }
            (true, None) => primary_key.first().copied(),
        };
        if changes && self.primary_key.is_empty() {
            c.refuse("aggregation.primary_key", format!("missing: a job of {} changes names the fields of the table's primary key, which identify a row across its changes", self.format.as_str()));
        }
        if !changes && !self.primary_key.is_empty() {
            c.refuse(
                "aggregation.primary_key",
                "only a job of change events (format = \"debezium-json\") has a primary key; events are named by aggregation.event_id",
            );
        }
        if let (false, Some(kind)) = (changes, event_id.and_then(kind_of))
            && !matches!(kind, FieldKind::String | FieldKind::Integer)
        {
            c.refuse(
                "aggregation.event_id",
                format!(
                    "field {:?} is a {}; an event id is a string or an integer",
                    self.event_id.as_deref().unwrap_or_default(),
                    kind.as_str()
                ),
            );
        }
        let event_time = find(&mut c, "aggregation.event_time".into(), &self.event_time);
        if let Some(kind) = event_time.and_then(kind_of)
            && kind != FieldKind::Timestamp
        {
            c.refuse(
                "aggregation.event_time",
                format!(
                    "field {:?} is a {}; the event time is a timestamp",
                    self.event_time,
                    kind.as_str()
                ),
            );
        }

        if self.group_by.is_empty() {
            c.refuse(
                "aggregation.group_by",
                "groups by no field; name at least one",
            );
        }
        let mut keys = Vec::new();
        let mut columns: Vec<(String, String)> = Vec::new();
        for (i, name) in self.group_by.iter().enumerate() {
            let key = format!("aggregation.group_by[{i}]");
            let Some(index) = find(&mut c, key.clone(), name) else {
                continue;
            };
            if kind_of(index) == Some(FieldKind::Float) {
                c.refuse(key.clone(), format!("field {name:?} is a float; grouping by a float splits equal-looking values, use a decimal"));
            }
            if keys.contains(&index) {
                c.refuse(key.clone(), format!("field {name:?} is a key twice"));
            }
            keys.push(index);
            columns.push((name.clone(), key));
        }

        let mut filter = Vec::new();
        for (i, decl) in self.filter.iter().enumerate() {
            let key = format!("aggregation.filter[{i}]");
            let Some(index) = find(&mut c, format!("{key}.field"), &decl.field) else {
                continue;
            };
            let Some(field) = fields.get(index) else {
                continue;
            };
            if let Some(test) = check_condition(&mut c, &key, decl, field) {
                filter.push(Condition { field: index, test });
            }
        }

        if self.aggregates.is_empty() {
            c.refuse(
                "aggregation.aggregate",
                "computes nothing; declare at least one aggregate",
            );
        }
        let mut aggregates = Vec::new();
        for (i, decl) in self.aggregates.iter().enumerate() {
            let key = format!("aggregation.aggregate[{i}]");
            columns.push((decl.column.clone(), format!("{key}.column")));
            if changes && matches!(decl.function, Function::Min | Function::Max) {
                c.refuse(
                    format!("{key}.function"),
                    format!(
                        "{} is not exact under retraction: when a row is updated or deleted, a window keeping one word per aggregate cannot tell its next {} without every value of the window; a job of changes takes count, sum and avg",
                        decl.function.as_str(),
                        if decl.function == Function::Min { "smallest" } else { "largest" }
                    ),
                );
            }
            let field = match (&decl.field, decl.function) {
                (None, Function::Count) => None,
                (Some(_), Function::Count) => {
                    c.refuse(
                        format!("{key}.field"),
                        "count takes no field: it counts the records of the window",
                    );
                    None
                }
                (None, f) => {
                    c.refuse(
                        format!("{key}.field"),
                        format!("{} needs a field", f.as_str()),
                    );
                    continue;
                }
                (Some(name), f) => {
                    let Some(index) = find(&mut c, format!("{key}.field"), name) else {
                        continue;
                    };
                    let Some(input) = fields.get(index) else {
                        continue;
                    };
                    // A window keeps each aggregate in a word or two: a min or max of
                    // strings would need the string.
                    let fits = match f {
                        Function::Sum | Function::Avg => input.kind.is_numeric(),
                        _ => input.kind.is_numeric() || input.kind == FieldKind::Timestamp,
                    };
                    if changes && fits && input.kind == FieldKind::Float {
                        c.refuse(
                            format!("{key}.field"),
                            format!(
                                "{} of a float cannot be retracted exactly (x + y - y is not always x in floating point), and a job of changes retracts every update and delete; declare {name:?} as a decimal (type = \"decimal\" with its scale) or an integer",
                                f.as_str()
                            ),
                        );
                    }
                    if !fits {
                        let needs = if matches!(f, Function::Sum | Function::Avg) {
                            "an integer, decimal or float field"
                        } else {
                            "an integer, decimal, float or timestamp field"
                        };
                        c.refuse(
                            format!("{key}.function"),
                            format!(
                                "{} needs {needs}; {name:?} is a {}",
                                f.as_str(),
                                input.kind.as_str()
                            ),
                        );
                    }
                    Some(index)
                }
            };
            aggregates.push(Aggregate {
                column: decl.column.clone(),
                function: decl.function,
                field,
                input: field.and_then(|i| fields.get(i)).map(|f| FieldType {
                    kind: f.kind,
                    scale: f.scale,
                }),
            });
        }

        if changes
            && !self.aggregates.is_empty()
            && !self
                .aggregates
                .iter()
                .any(|a| a.function == Function::Count)
        {
            c.refuse(
                "aggregation.aggregate",
                "a job of changes counts its rows (declare a count aggregate): the view leaves out a group once its last row is deleted or moves away, when the count reaches 0",
            );
        }
        let mut seen = BTreeSet::new();
        for (column, key) in &columns {
            if !is_identifier(column) {
                c.refuse(key.clone(), format!("column {column:?} is not a name ClickHouse takes unquoted (letters, digits, _)"));
            } else if RESERVED_COLUMNS.contains(&column.as_str()) {
                c.refuse(
                    key.clone(),
                    format!("column {column:?} is written by tally itself; choose another name"),
                );
            } else if !seen.insert(column.as_str()) {
                c.refuse(key.clone(), format!("two columns are named {column:?}"));
            }
        }
        for (i, field) in self.fields.iter().enumerate() {
            if !used.contains(&i) {
                c.refuse(
                    format!("aggregation.field[{i}]"),
                    format!("field {:?} is declared but no key, filter, aggregate, event_id or event_time uses it", field.name),
                );
            }
        }

        match (c.mistakes.is_empty(), event_id, event_time, windows) {
            (true, Some(event_id), Some(event_time), Some(windows)) => {
                let paths = PathTree::new(fields.iter().map(|f| f.path.as_slice()));
                let changes = changes.then(|| ChangeSchema {
                    envelope: change::Envelope::new(&fields, &primary_key),
                    primary_key,
                });
                Ok(Job {
                    changes,
                    format: self.format,
                    fields,
                    paths,
                    event_id,
                    event_time,
                    keys,
                    filter,
                    aggregates,
                    windows,
                })
            }
            _ => Err(DeclarationError {
                mistakes: c.mistakes,
            }),
        }
    }

    fn check_fields(&self, c: &mut Checker) -> Vec<FieldReader> {
        let mut readers = Vec::new();
        let mut names = BTreeSet::new();
        for (i, f) in self.fields.iter().enumerate() {
            let key = format!("aggregation.field[{i}]");
            if !names.insert(f.name.as_str()) {
                c.refuse(
                    format!("{key}.name"),
                    format!("field {:?} is declared twice", f.name),
                );
            }
            let path: Vec<String> = f
                .path
                .as_deref()
                .unwrap_or(&f.name)
                .split('.')
                .map(str::to_owned)
                .collect();
            if path.iter().any(String::is_empty) {
                c.refuse(
                    format!("{key}.path"),
                    "a path is object keys joined by dots, none of them empty",
                );
            }
            let scale = match (f.kind, f.scale) {
                (FieldKind::Decimal, Some(s)) if s <= MAX_DECIMAL_SCALE => s,
                (FieldKind::Decimal, Some(s)) => {
                    c.refuse(format!("{key}.scale"), format!("scale {s} is over {MAX_DECIMAL_SCALE}: a Decimal(18, s) keeps 18 digits in all"));
                    0
                }
                (FieldKind::Decimal, None) => {
                    c.refuse(
                        format!("{key}.scale"),
                        "a decimal needs its scale (fractional digits, 0..=18)",
                    );
                    0
                }
                (kind, Some(_)) => {
                    c.refuse(
                        format!("{key}.scale"),
                        format!(
                            "only a decimal has a scale; this field is a {}",
                            kind.as_str()
                        ),
                    );
                    0
                }
                (_, None) => 0,
            };
            let unit = match (f.kind, f.unit.as_deref()) {
                (_, None) | (FieldKind::Timestamp, Some("ms")) => TimeUnit::Millis,
                (FieldKind::Timestamp, Some("s")) => TimeUnit::Seconds,
                (FieldKind::Timestamp, Some("us")) => TimeUnit::Micros,
                (FieldKind::Timestamp, Some(other)) => {
                    c.refuse(
                        format!("{key}.unit"),
                        format!("unit {other:?} is not \"ms\", \"s\" or \"us\""),
                    );
                    TimeUnit::Millis
                }
                (kind, Some(_)) => {
                    c.refuse(
                        format!("{key}.unit"),
                        format!(
                            "only a timestamp has a unit; this field is a {}",
                            kind.as_str()
                        ),
                    );
                    TimeUnit::Millis
                }
            };
            let format = match (f.kind, f.format.as_deref()) {
                (_, None) => StringFormat::Any,
                (FieldKind::String, Some("currency_code")) => StringFormat::CurrencyCode,
                (FieldKind::String, Some(other)) => {
                    c.refuse(
                        format!("{key}.format"),
                        format!("format {other:?} is unknown (known: \"currency_code\")"),
                    );
                    StringFormat::Any
                }
                (kind, Some(_)) => {
                    c.refuse(
                        format!("{key}.format"),
                        format!(
                            "only a string has a format; this field is a {}",
                            kind.as_str()
                        ),
                    );
                    StringFormat::Any
                }
            };
            readers.push(FieldReader {
                name: f.name.clone(),
                path,
                kind: f.kind,
                scale,
                format,
                unit,
                allow_empty: f.allow_empty,
            });
        }
        readers
    }
}

fn check_windows(c: &mut Checker, rules: WindowRules, dedup: bool) -> Option<WindowSpec> {
    let size = rules.size_ms;
    let slide = rules.slide_ms.unwrap_or(size);
    let before = c.mistakes.len();
    if size <= 0 {
        c.refuse("window.size", "must be longer than 0s");
    } else if slide <= 0 || slide > size {
        c.refuse(
            "window.slide",
            format!(
                "{} must be longer than 0s and at most window.size ({})",
                format_duration(slide),
                format_duration(size)
            ),
        );
    } else if size % slide != 0 {
        c.refuse(
            "window.slide",
            format!(
                "{} does not divide window.size ({}): windows would not align",
                format_duration(slide),
                format_duration(size)
            ),
        );
    }
    let needed = size.saturating_add(rules.allowed_lateness_ms);
    if dedup && rules.dedup_horizon_ms < needed {
        c.refuse(
            "window.dedup_horizon",
            format!(
                "{} is shorter than window.size + window.allowed_lateness ({}): a duplicate could count again in a window still open",
                format_duration(rules.dedup_horizon_ms),
                format_duration(needed)
            ),
        );
    }
    (c.mistakes.len() == before).then_some(WindowSpec {
        size_ms: size,
        slide_ms: slide,
    })
}

fn check_condition(
    c: &mut Checker,
    key: &str,
    decl: &ConditionDecl,
    field: &FieldReader,
) -> Option<Test> {
    let constant = |c: &mut Checker, name: &str, written: &serde_json::Value| {
        filter::constant(field, written)
            .map_err(|e| c.refuse(format!("{key}.{name}"), e))
            .ok()
    };
    let tests = [
        decl.equals.is_some(),
        decl.not_equals.is_some(),
        decl.one_of.is_some(),
        decl.not_in.is_some(),
        decl.min.is_some() || decl.max.is_some(),
        decl.present.is_some(),
    ];
    if tests.iter().filter(|t| **t).count() != 1 {
        c.refuse(key, "a condition has exactly one test: equals, not_equals, in, not_in, min/max or present (write several conditions to combine them)");
        return None;
    }
    if let Some(v) = &decl.equals {
        return constant(c, "equals", v).map(Test::Equals);
    }
    if let Some(v) = &decl.not_equals {
        return constant(c, "not_equals", v).map(Test::NotEquals);
    }
    if let Some(set) = decl.one_of.as_ref().or(decl.not_in.as_ref()) {
        let name = if decl.one_of.is_some() {
            "in"
        } else {
            "not_in"
        };
        let values: Option<Vec<Value>> = set.iter().map(|v| constant(c, name, v)).collect();
        let values = values?;
        return Some(if decl.one_of.is_some() {
            Test::In(values)
        } else {
            Test::NotIn(values)
        });
    }
    if let Some(p) = decl.present {
        return Some(Test::Present(p));
    }
    if !field.kind.is_ordered() {
        c.refuse(
            key,
            format!(
                "a range needs a field with an order; {:?} is a {}",
                field.name,
                field.kind.as_str()
            ),
        );
        return None;
    }
    let min = match &decl.min {
        Some(v) => Some(constant(c, "min", v)?),
        None => None,
    };
    let max = match &decl.max {
        Some(v) => Some(constant(c, "max", v)?),
        None => None,
    };
    Some(Test::Range { min, max })
}

/// Fields a job may declare before [`Job::evaluate`] keeps its scratch on the heap.
const SMALL: usize = 16;

impl Job {
    /// Reads one record value: the poison reason when it is not a valid record of the job, else
    /// whether it passes the filter and what it adds.
    pub fn evaluate(
        &self,
        value: Option<&[u8]>,
        max_record_bytes: usize,
    ) -> Result<Evaluation, Poison> {
        let text = document(value, max_record_bytes)?;
        // Per-record scratch on the stack for jobs of up to 16 fields: the allocations of these
        // two vectors cost about a tenth of reading a record (perf).
        let n = self.fields.len();
        let (mut small_raws, mut large_raws);
        let raws: &mut [Option<&RawValue>] = if n <= SMALL {
            small_raws = [None; SMALL];
            &mut small_raws[..n]
        } else {
            large_raws = vec![None; n];
            &mut large_raws
        };
        self.paths.read(text, raws).map_err(not_a_json_object)?;
        self.evaluate_fields(raws)
    }

    /// Checks and filters one record's field values (field `i`'s at `fields`' index `i`), as
    /// [`Job::evaluate`] reads them from an event and [`Job::evaluate_change`] from a row image.
    pub(crate) fn evaluate_fields<F: FieldValues + ?Sized>(
        &self,
        raws: &F,
    ) -> Result<Evaluation, Poison> {
        let n = self.fields.len();
        // The filter first: records it leaves out may have another shape altogether.
        for condition in &self.filter {
            let field = &self.fields[condition.field];
            let value = if raws.present(condition.field) {
                Some(raws.read(field, condition.field)?)
            } else {
                None
            };
            if !condition.test.holds(value.as_ref()) {
                return Ok(Evaluation::Filtered);
            }
        }
        // Then every field in declaration order, so that the first mistake named is the first
        // declared field's.
        let (mut small_values, mut large_values);
        let values: &mut [Option<Value>] = if n <= SMALL {
            small_values = [const { None }; SMALL];
            &mut small_values[..n]
        } else {
            large_values = vec![None; n];
            &mut large_values
        };
        for (i, (field, value)) in self.fields.iter().zip(values.iter_mut()).enumerate() {
            *value = Some(raws.read(field, i)?);
        }
        let take = |i: usize| values[i].clone();
        let event_id = match take(self.event_id) {
            Some(Value::Str(s)) => s,
            Some(Value::Int(i)) => CompactString::from(i.to_string()),
            _ => CompactString::default(),
        };
        let event_time_ms = match take(self.event_time) {
            Some(Value::Time(ms)) => ms,
            _ => 0,
        };
        Ok(Evaluation::Event(DeclaredEvent {
            event_id,
            event_time_ms,
            key: self.keys.iter().filter_map(|i| take(*i)).collect(),
            inputs: self
                .aggregates
                .iter()
                .map(|a| a.field.and_then(take))
                .collect(),
        }))
    }

    /// The words of a window's value, aggregate by aggregate (what the store reads back).
    pub fn word_kinds(&self) -> Vec<WordKind> {
        self.aggregates
            .iter()
            .flat_map(|a| a.word_kinds().iter().copied())
            .collect()
    }

    /// The shape of the job's rows: its group-by keys and its values' words.
    pub fn row_shape(&self) -> RowShape {
        RowShape {
            key_parts: self.keys.len(),
            words: self.word_kinds(),
        }
    }

    /// A window's value before its first record.
    pub fn empty_value(&self) -> WindowAgg {
        WindowAgg::new(self.aggregates.iter().flat_map(|a| a.empty()))
    }

    /// Adds an event's inputs ([`DeclaredEvent::inputs`]) to a window's value. On an overflow
    /// the value is left as it was and the error names the column.
    pub fn add(&self, value: &mut WindowAgg, inputs: &[Option<Value>]) -> Result<(), Overflow> {
        let mut next = value.clone();
        let mut words = next.words_mut();
        for (a, input) in self.aggregates.iter().zip(inputs) {
            let (mine, rest) = words.split_at_mut(a.word_kinds().len().min(words.len()));
            a.add(mine, input.as_ref())?;
            words = rest;
        }
        *value = next;
        Ok(())
    }

    /// What one event adds to each of its windows: its inputs added to an empty value.
    pub fn contribution(&self, inputs: &[Option<Value>]) -> Result<WindowAgg, Overflow> {
        let mut value = self.empty_value();
        self.add(&mut value, inputs)?;
        Ok(value)
    }

    /// Adds a row's `contribution` to a window's value, or takes it back out (`retract`):
    /// count, sum and avg shift exactly (change jobs have no min or max). On an overflow the
    /// value is left as it was.
    pub fn shift(
        &self,
        value: &mut WindowAgg,
        contribution: &WindowAgg,
        retract: bool,
    ) -> Result<(), Overflow> {
        let mut next = value.clone();
        self.by_aggregate(&mut next, contribution, |a, mine, theirs| {
            a.shift(mine, theirs, retract)
        })?;
        *value = next;
        Ok(())
    }

    /// Merges into `into` another source partition's value of the same window, as the view does.
    pub fn merge(&self, into: &mut WindowAgg, other: &WindowAgg) -> Result<(), Overflow> {
        self.by_aggregate(into, other, |a, mine, theirs| a.merge(mine, theirs))
    }

    /// Calls `f` with each aggregate and its words of `into` and of `other`.
    fn by_aggregate(
        &self,
        into: &mut WindowAgg,
        other: &WindowAgg,
        mut f: impl FnMut(&Aggregate, &mut [Word], &[Word]) -> Result<(), Overflow>,
    ) -> Result<(), Overflow> {
        let (mut words, mut theirs) = (into.words_mut(), other.words());
        for a in &self.aggregates {
            let n = a.word_kinds().len();
            if words.len() < n || theirs.len() < n {
                return Err(Overflow {
                    column: a.column.clone(),
                });
            }
            let (mine, rest) = words.split_at_mut(n);
            f(a, mine, &theirs[..n])?;
            (words, theirs) = (rest, &theirs[n..]);
        }
        Ok(())
    }

    /// The view's columns and their ClickHouse types: window bounds, keys, aggregates.
    pub fn columns(&self) -> Vec<(String, String)> {
        let mut columns = vec![
            ("window_start".to_owned(), "DateTime".to_owned()),
            ("window_end".to_owned(), "DateTime".to_owned()),
        ];
        for &k in &self.keys {
            let f = &self.fields[k];
            columns.push((
                f.name.clone(),
                FieldType {
                    kind: f.kind,
                    scale: f.scale,
                }
                .clickhouse_type(),
            ));
        }
        for a in &self.aggregates {
            columns.push((a.column.clone(), a.clickhouse_type()));
        }
        columns
    }
}
