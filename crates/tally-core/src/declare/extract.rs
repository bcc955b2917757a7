//! Reads the declared fields of one JSON record, by path, in one pass over the bytes: only the
//! objects on a declared path are descended into, and only the values of declared fields are
//! kept (borrowed from the record).

use std::borrow::Cow;
use std::fmt;

use compact_str::CompactString;
use serde::Deserializer;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::value::{FieldKind, Value, parse_decimal};
use crate::decode::{
    Key, Poison, PoisonReason, Raw, classify, event_time_in_range, event_time_of_number,
    event_time_of_text, string_of,
};

/// What a string field must look like besides being a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StringFormat {
    Any,
    /// Three upper-case ASCII letters (ISO 4217 style); other text is `invalid_currency`.
    CurrencyCode,
}

/// How a timestamp field's numbers are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeUnit {
    Millis,
    Seconds,
    /// Debezium's `MicroTimestamp` (a PostgreSQL `timestamp` without time zone).
    Micros,
}

/// One declared field, resolved: where it is and how its value is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldReader {
    pub name: String,
    /// Object keys from the record's root to the value.
    pub path: Vec<String>,
    pub kind: FieldKind,
    pub scale: u32,
    pub format: StringFormat,
    pub unit: TimeUnit,
    pub allow_empty: bool,
}

impl FieldReader {
    fn label(&self) -> String {
        self.path.join(".")
    }

    /// The field's value, or the poison of a record whose field is missing or invalid.
    pub fn read(&self, raw: Option<&RawValue>) -> Result<Value, Poison> {
        // Built only for a poison message: joining the path on every read cost 7 % of reading
        // revenue_agg by declaration (perf).
        let label = || self.label();
        let missing = || {
            poison(
                PoisonReason::MissingField,
                format!("field {:?} is missing or null", label()),
            )
        };
        let raw_value = raw.ok_or_else(missing)?;
        let raw = classify(raw_value);
        if matches!(raw, Raw::Null) {
            return Err(missing());
        }
        let wrong = |found: &str, expected: &str| {
            poison(
                PoisonReason::WrongType,
                format!("field {:?} is {found}, expected {expected}", label()),
            )
        };
        match self.kind {
            FieldKind::String => {
                let text = match raw {
                    Raw::Str(raw) => string_of(raw)?,
                    other => return Err(wrong(kind_of(&other), "a string")),
                };
                self.checked_text(&text)
            }
            FieldKind::Integer => match raw {
                Raw::Number(text) => text
                    .parse::<i64>()
                    .map(Value::Int)
                    .map_err(|_| wrong(text, "an integer in the range of Int64")),
                other => Err(wrong(kind_of(&other), "an integer")),
            },
            FieldKind::Decimal => {
                let text = match raw {
                    Raw::Str(raw) => string_of(raw)?,
                    Raw::Number(text) => Cow::Borrowed(text),
                    other => return Err(wrong(kind_of(&other), "a number or decimal string")),
                };
                parse_decimal(&text, self.scale)
                    .map(Value::Decimal)
                    .map_err(|e| {
                        poison(
                            PoisonReason::InvalidAmount,
                            format!("field {:?}: {e}", label()),
                        )
                    })
            }
            FieldKind::Float => match raw {
                Raw::Number(text) => text
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .map(Value::Float)
                    .ok_or_else(|| wrong(text, "a finite number")),
                other => Err(wrong(kind_of(&other), "a number")),
            },
            FieldKind::Boolean => match raw_value.get() {
                "true" => Ok(Value::Bool(true)),
                "false" => Ok(Value::Bool(false)),
                _ => Err(wrong(kind_of(&raw), "a boolean")),
            },
            FieldKind::Timestamp => {
                let ms = match raw {
                    Raw::Str(raw) => event_time_of_text(&string_of(raw)?)?,
                    Raw::Number(text) => match self.unit {
                        TimeUnit::Millis => event_time_of_number(text, "milliseconds", 1)?,
                        TimeUnit::Seconds => event_time_of_number(text, "seconds", 1000)?,
                        TimeUnit::Micros => {
                            event_time_of_number(text, "microseconds", 1)?.div_euclid(1000)
                        }
                    },
                    other => return Err(wrong(kind_of(&other), "a string or integer")),
                };
                let ms = event_time_in_range(ms)?;
                Ok(Value::Time(ms))
            }
        }
    }
}

/// A field's value as a binary format (Avro, Protobuf) decoded it by its schema, before the
/// declaration reads it: what JSON's raw values are to [`FieldReader::read`].
#[derive(Debug, Clone, PartialEq)]
pub enum Cell<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    /// An exact decimal: `units` of 10^-`scale`.
    Decimal {
        units: i128,
        scale: u32,
    },
    /// A time since the epoch in milliseconds (Avro timestamp-millis, a date) or microseconds
    /// (Avro timestamp-micros, Protobuf's Timestamp).
    Millis(i64),
    Micros(i64),
    /// A value no declared type reads (bytes without a logical type, a record, an array, a
    /// map), named for the message.
    Other(&'static str),
}

impl Cell<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Cell::Null => "null",
            Cell::Bool(_) => "a boolean",
            Cell::Int(_) => "an integer",
            Cell::Float(_) => "a float",
            Cell::Str(_) => "a string",
            Cell::Decimal { .. } => "a decimal",
            Cell::Millis(_) | Cell::Micros(_) => "a timestamp",
            Cell::Other(what) => what,
        }
    }
}

impl FieldReader {
    /// The field's value read from a decoded cell, with the checks [`FieldReader::read`] makes
    /// of JSON: missing or null is `missing_field`, another type `wrong_type`, and so on.
    pub fn read_cell(&self, cell: Option<&Cell<'_>>) -> Result<Value, Poison> {
        let label = || self.label();
        let missing = || {
            poison(
                PoisonReason::MissingField,
                format!("field {:?} is missing or null", label()),
            )
        };
        let cell = match cell {
            None | Some(Cell::Null) => return Err(missing()),
            Some(cell) => cell,
        };
        let wrong = |expected: &str| {
            poison(
                PoisonReason::WrongType,
                format!(
                    "field {:?} is {}, expected {expected}",
                    label(),
                    cell.kind()
                ),
            )
        };
        let amount = |e: String| {
            poison(
                PoisonReason::InvalidAmount,
                format!("field {:?}: {e}", label()),
            )
        };
        match self.kind {
            FieldKind::String => {
                let Cell::Str(text) = cell else {
                    return Err(wrong("a string"));
                };
                self.checked_text(text)
            }
            FieldKind::Integer => match cell {
                Cell::Int(i) => Ok(Value::Int(*i)),
                _ => Err(wrong("an integer")),
            },
            FieldKind::Decimal => match cell {
                Cell::Int(i) => rescale(i128::from(*i), 0, self.scale).map_err(amount),
                Cell::Decimal { units, scale } => {
                    rescale(*units, *scale, self.scale).map_err(amount)
                }
                Cell::Str(text) => parse_decimal(text, self.scale)
                    .map(Value::Decimal)
                    .map_err(amount),
                _ => Err(wrong("a decimal, an integer or a decimal string")),
            },
            FieldKind::Float => match cell {
                Cell::Float(x) if x.is_finite() => Ok(Value::Float(*x)),
                Cell::Int(i) => Ok(Value::Float(*i as f64)),
                Cell::Float(_) => Err(wrong("a finite number")),
                _ => Err(wrong("a number")),
            },
            FieldKind::Boolean => match cell {
                Cell::Bool(b) => Ok(Value::Bool(*b)),
                _ => Err(wrong("a boolean")),
            },
            FieldKind::Timestamp => {
                let ms = match cell {
                    Cell::Millis(ms) => *ms,
                    Cell::Micros(us) => us.div_euclid(1000),
                    Cell::Int(n) => match self.unit {
                        TimeUnit::Millis => *n,
                        TimeUnit::Seconds => n.saturating_mul(1000),
                        TimeUnit::Micros => n.div_euclid(1000),
                    },
                    Cell::Str(text) => event_time_of_text(text)?,
                    _ => return Err(wrong("a timestamp, an integer or RFC 3339 text")),
                };
                Ok(Value::Time(event_time_in_range(ms)?))
            }
        }
    }

    /// A string field's text with its checks: a currency's format, emptiness.
    fn checked_text(&self, text: &str) -> Result<Value, Poison> {
        if self.format == StringFormat::CurrencyCode
            && (text.len() != 3 || !text.bytes().all(|b| b.is_ascii_uppercase()))
        {
            return Err(poison(
                PoisonReason::InvalidCurrency,
                format!("currency {text:?} is not three upper-case letters"),
            ));
        }
        if text.is_empty() && !self.allow_empty {
            return Err(poison(
                PoisonReason::MissingField,
                format!("field {:?} is empty", self.label()),
            ));
        }
        Ok(Value::Str(CompactString::from(text)))
    }
}

/// `units` of 10^-`from` as a decimal of scale `to`, exactly and within `Decimal(18, to)`.
fn rescale(units: i128, from: u32, to: u32) -> Result<Value, String> {
    let exact = if from <= to {
        10i128
            .checked_pow(to - from)
            .and_then(|f| units.checked_mul(f))
    } else {
        let f = 10i128.checked_pow(from - to).unwrap_or(i128::MAX);
        (units % f == 0).then(|| units / f)
    };
    match exact {
        None if from > to => Err(format!(
            "{} has more than {to} fractional digits",
            super::value::format_decimal(units, from)
        )),
        Some(u) if u.unsigned_abs() <= super::value::MAX_DECIMAL18_UNITS.unsigned_abs() as u128 => {
            Ok(Value::Decimal(u as i64))
        }
        _ => Err(format!(
            "{} is out of the range of Decimal(18, {to})",
            super::value::format_decimal(units, from)
        )),
    }
}

fn poison(reason: PoisonReason, message: String) -> Poison {
    Poison::new(reason, message)
}

fn kind_of(raw: &Raw<'_>) -> &'static str {
    match raw {
        Raw::Str(_) => "a string",
        Raw::Number(_) => "a number",
        Raw::Null => "null",
        Raw::Other(kind) => kind,
    }
}

/// The declared paths as a tree of object keys; a node may be a field, a parent, or both.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PathTree {
    pub(crate) children: Vec<(String, PathTree)>,
    pub(crate) field: Option<usize>,
}

impl PathTree {
    pub fn new<'a>(paths: impl IntoIterator<Item = &'a [String]>) -> PathTree {
        let mut root = PathTree::default();
        for (index, path) in paths.into_iter().enumerate() {
            let mut node = &mut root;
            for key in path {
                let at = match node.children.iter().position(|(k, _)| k == key) {
                    Some(at) => at,
                    None => {
                        node.children.push((key.clone(), PathTree::default()));
                        node.children.len() - 1
                    }
                };
                node = &mut node.children[at].1;
            }
            node.field = Some(index);
        }
        root
    }

    /// Reads the raw values of every path from one JSON document; `fields[i]` is path `i`'s.
    /// A document that is not an object is an error; a parent that is not an object leaves its
    /// fields missing.
    pub fn read<'a>(
        &self,
        text: &'a str,
        fields: &mut [Option<&'a RawValue>],
    ) -> Result<(), serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        Seed { tree: self, fields }.deserialize(&mut de)?;
        de.end()
    }
}

struct Seed<'t, 'f, 'a> {
    tree: &'t PathTree,
    fields: &'f mut [Option<&'a RawValue>],
}

impl<'de> DeserializeSeed<'de> for Seed<'_, '_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Seed<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            let Some((_, node)) = self.tree.children.iter().find(|(k, _)| *k == key) else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            // A later occurrence of a parent replaces what an earlier one held.
            node.clear(self.fields);
            let Some(index) = node.field else {
                // Only a parent: its object is read in the same pass (a value of another type
                // leaves its fields missing).
                map.next_value_seed(Parent {
                    tree: node,
                    fields: &mut *self.fields,
                })?;
                continue;
            };
            // The last occurrence of a key wins, as in JavaScript's JSON.parse.
            let raw = map.next_value::<&'de RawValue>()?;
            self.fields[index] = Some(raw);
            if !node.children.is_empty() && raw.get().starts_with('{') {
                let mut de = serde_json::Deserializer::from_str(raw.get());
                Seed {
                    tree: node,
                    fields: &mut *self.fields,
                }
                .deserialize(&mut de)
                .map_err(de::Error::custom)?;
            }
        }
        Ok(())
    }
}

/// A node that is only a parent: an object is read into its fields; any other value is
/// skipped, leaving them missing.
struct Parent<'t, 'f, 'a> {
    tree: &'t PathTree,
    fields: &'f mut [Option<&'a RawValue>],
}

impl<'de> DeserializeSeed<'de> for Parent<'_, '_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Parent<'_, '_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        Seed {
            tree: self.tree,
            fields: self.fields,
        }
        .visit_map(map)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
}

impl PathTree {
    /// Forgets the values of every field below this node.
    fn clear(&self, fields: &mut [Option<&RawValue>]) {
        for (_, child) in &self.children {
            if let Some(index) = child.field {
                fields[index] = None;
            }
            child.clear(fields);
        }
    }
}
