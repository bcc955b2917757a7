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
mod resolve;
mod revenue_agg;
mod value;

#[cfg(test)]
pub(crate) mod built_in_oracle;

#[cfg(test)]
mod framed_tests;
#[cfg(test)]
mod presence_tests;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeSet;
use std::fmt;

use compact_str::{CompactString, ToCompactString};
use serde::Deserialize;
use serde_json::value::RawValue;
use smallvec::SmallVec;

pub use aggregate::{Aggregate, Function, Overflow};
pub use avro::{AvroDecoder, AvroSchema};
pub use change::{Change, Op, Position, lsn_text, parse_lsn};
pub use extract::{Cell, FieldReader, PathTree, StringFormat, TimeUnit};
pub use filter::{Condition, ConditionDecl, Test};
pub use framed::{Schemas, WriterSchema, message_indexes, schema_id};
pub use protobuf::ProtobufDecoder;
pub use revenue_agg::{FieldMapping, revenue_agg};
pub use value::{
    FieldKind, FieldType, MAX_DECIMAL_SCALE, MAX_DECIMAL18_UNITS, Value, format_decimal,
    parse_decimal,
};

use crate::decode::{Poison, PoisonReason, document, not_a_json_object};
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
    /// Per field: the filter lets it be absent (`present = false`), so it is not read.
    may_be_absent: Vec<bool>,
    /// A key or an aggregate reads the event id's field too, so the id is copied, not moved.
    event_id_shared: bool,
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
    /// Inline for up to four keys and aggregates: a record allocates nothing for them.
    pub key: SmallVec<[Value; 4]>,
    pub inputs: SmallVec<[Option<Value>; 4]>,
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

/// A record the filter passes counts, or lacks a field it needs; else it is filtered out.
#[derive(Debug, Clone, PartialEq)]
pub enum Evaluation {
    Event(DeclaredEvent),
    Filtered,
    /// Every value there is valid, but a required field is missing: the record is
    /// dead-lettered with `poison`, or as late when `event_time_ms` is behind the watermark.
    Incomplete {
        event_time_ms: i64,
        poison: Poison,
    },
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

/// Fields a job may declare before [`Job::evaluate`] keeps its scratch on the heap.
const SMALL: usize = 16;

/// Fields a job may declare before [`Job::evaluate_fields`] keeps their values on the heap
/// (each slot is initialised and dropped per record, so fewer than [`SMALL`]).
const SMALL_VALUES: usize = 8;

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
    ///
    /// The reason a record is dead-lettered is the first that applies, in this order (the
    /// record's bytes and format were read before): a value the filter tests is of the wrong
    /// type; a declared value is of the wrong type or invalid (first in declaration order);
    /// a field is missing ([`Evaluation::Incomplete`]: the operator names it late first when
    /// its event time is). A field the filter lets be absent (`present = false`) is not read.
    pub(crate) fn evaluate_fields<F: FieldValues + ?Sized>(
        &self,
        raws: &F,
    ) -> Result<Evaluation, Poison> {
        let n = self.fields.len();
        // The filter first: records it leaves out may have another shape altogether.
        for condition in &self.filter {
            let i = condition.field;
            let value = if raws.present(i) {
                match raws.read(&self.fields[i], i) {
                    Ok(value) => Some(value),
                    // An empty string counts as missing, so as absent to the filter.
                    Err(p) if p.reason == PoisonReason::MissingField => None,
                    // A presence test asks only whether a value is there.
                    Err(_) if matches!(condition.test, Test::Present(false)) => {
                        return Ok(Evaluation::Filtered);
                    }
                    Err(p) => return Err(p),
                }
            } else {
                None
            };
            if !condition.test.holds(value.as_ref()) {
                return Ok(Evaluation::Filtered);
            }
        }
        // Then every field in declaration order: a wrong value is named at once, a missing
        // field only if no later field holds a wrong value.
        let (mut small_values, mut large_values);
        let values: &mut [Option<Value>] = if n <= SMALL_VALUES {
            small_values = [const { None }; SMALL_VALUES];
            &mut small_values[..n]
        } else {
            large_values = vec![None; n];
            &mut large_values
        };
        let mut missing = None;
        for (i, (field, value)) in self.fields.iter().zip(values.iter_mut()).enumerate() {
            if self.may_be_absent[i] {
                continue;
            }
            match raws.read(field, i) {
                Ok(v) => *value = Some(v),
                Err(p) if p.reason == PoisonReason::MissingField => {
                    missing.get_or_insert(p);
                }
                Err(p) => return Err(p),
            }
        }
        let event_time_ms = match (&values[self.event_time], missing) {
            (Some(Value::Time(ms)), Some(poison)) => {
                return Ok(Evaluation::Incomplete {
                    event_time_ms: *ms,
                    poison,
                });
            }
            (_, Some(poison)) => return Err(poison),
            (Some(Value::Time(ms)), None) => *ms,
            (_, None) => 0,
        };
        let event_id = match &mut values[self.event_id] {
            Some(Value::Str(s)) if !self.event_id_shared => std::mem::take(s),
            Some(Value::Str(s)) => s.clone(),
            Some(Value::Int(i)) => i.to_compact_string(),
            _ => CompactString::default(),
        };
        // A value is moved out at its last use, copied before it (a field may be a key and an
        // input, or the input of several aggregates).
        let inputs_of = |i: usize| {
            self.aggregates
                .iter()
                .filter(|a| a.field == Some(i))
                .count()
        };
        let mut key = SmallVec::new();
        for &i in &self.keys {
            let value = match inputs_of(i) {
                0 => values[i].take(),
                _ => values[i].clone(),
            };
            if let Some(value) = value {
                key.push(value);
            }
        }
        let mut inputs = SmallVec::new();
        for (at, a) in self.aggregates.iter().enumerate() {
            let value = a.field.and_then(|i| {
                let later = self.aggregates[at + 1..].iter().any(|b| b.field == Some(i));
                if later {
                    values[i].clone()
                } else {
                    values[i].take()
                }
            });
            inputs.push(value);
        }
        Ok(Evaluation::Event(DeclaredEvent {
            event_id,
            event_time_ms,
            key,
            inputs,
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

    /// What an event adds to the commit log's sum (`revenue_sum`, revenue_agg's revenue): the
    /// input of the job's first exact sum, in units of its field's scale; 0 without one.
    pub fn counted_units(&self, inputs: &[Option<Value>]) -> i128 {
        let first_sum = self
            .aggregates
            .iter()
            .zip(inputs)
            .find(|(a, _)| a.function == Function::Sum && a.word_kinds() == [WordKind::Exact]);
        match first_sum {
            Some((_, Some(Value::Int(units) | Value::Decimal(units)))) => i128::from(*units),
            _ => 0,
        }
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
