//! What every record format shares: the dead-letter reasons, and reading a JSON record's document,
//! strings and times (into a poison reason with a message naming the field).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;

use crate::time;

/// Why a record went to the dead-letter topic. A closed set: dashboards and alerts key on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoisonReason {
    InvalidUtf8,
    InvalidJson,
    MissingField,
    WrongType,
    InvalidAmount,
    InvalidCurrency,
    InvalidTime,
    TooLarge,
    Late,
    /// Not a change event tally applies: no op or position, or an op such as truncate.
    InvalidChange,
    /// Not in the Confluent wire format (its magic byte, its header).
    WireFormat,
    /// A writer schema id the schema registry does not know.
    UnknownSchema,
    /// An Avro or Protobuf payload its writer schema does not decode (truncated, corrupt).
    Undecodable,
}

impl PoisonReason {
    pub const ALL: [PoisonReason; 13] = [
        PoisonReason::InvalidUtf8,
        PoisonReason::InvalidJson,
        PoisonReason::MissingField,
        PoisonReason::WrongType,
        PoisonReason::InvalidAmount,
        PoisonReason::InvalidCurrency,
        PoisonReason::InvalidTime,
        PoisonReason::TooLarge,
        PoisonReason::Late,
        PoisonReason::InvalidChange,
        PoisonReason::WireFormat,
        PoisonReason::UnknownSchema,
        PoisonReason::Undecodable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PoisonReason::InvalidUtf8 => "invalid_utf8",
            PoisonReason::InvalidJson => "invalid_json",
            PoisonReason::MissingField => "missing_field",
            PoisonReason::WrongType => "wrong_type",
            PoisonReason::InvalidAmount => "invalid_amount",
            PoisonReason::InvalidCurrency => "invalid_currency",
            PoisonReason::InvalidTime => "invalid_time",
            PoisonReason::TooLarge => "too_large",
            PoisonReason::Late => "late",
            PoisonReason::InvalidChange => "invalid_change",
            PoisonReason::WireFormat => "wire_format",
            PoisonReason::UnknownSchema => "unknown_schema",
            PoisonReason::Undecodable => "undecodable",
        }
    }

    pub fn parse(text: &str) -> Option<PoisonReason> {
        PoisonReason::ALL.into_iter().find(|r| r.as_str() == text)
    }
}

impl fmt::Display for PoisonReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A record that is not a valid order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poison {
    pub reason: PoisonReason,
    pub message: String,
}

impl Poison {
    pub fn new(reason: PoisonReason, message: impl Into<String>) -> Poison {
        Poison {
            reason,
            message: message.into(),
        }
    }
}

pub(crate) struct Key<'a>(pub(crate) Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

/// The JSON kind of a raw value, from its first byte (serde_json has validated it).
pub(crate) enum Raw<'a> {
    Str(&'a RawValue),
    Number(&'a str),
    Null,
    Other(&'static str),
}

pub(crate) fn classify(raw: &RawValue) -> Raw<'_> {
    let text = raw.get();
    match text.as_bytes().first() {
        Some(b'"') => Raw::Str(raw),
        Some(b'-' | b'0'..=b'9') => Raw::Number(text),
        Some(b'n') => Raw::Null,
        Some(b't' | b'f') => Raw::Other("a boolean"),
        Some(b'[') => Raw::Other("an array"),
        Some(b'{') => Raw::Other("an object"),
        _ => Raw::Other("an unknown value"),
    }
}

/// A JSON string's text, borrowed from the record when it has no escape (almost always): serde_json
/// has validated the raw value, so the text between the quotes is the string. Decoding then
/// allocates only for the fields the operator keeps.
pub(crate) fn string_of(raw: &RawValue) -> Result<Cow<'_, str>, Poison> {
    let text = raw.get();
    match text.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        Some(inner) if !inner.contains('\\') => Ok(Cow::Borrowed(inner)),
        _ => serde_json::from_str::<String>(text)
            .map(Cow::Owned)
            .map_err(|e| Poison::new(PoisonReason::InvalidJson, format!("bad string: {e}"))),
    }
}

/// The text of a record value that may hold a JSON document: present, within the size limit and
/// UTF-8.
pub(crate) fn document(value: Option<&[u8]>, max_record_bytes: usize) -> Result<&str, Poison> {
    let bytes = value
        .ok_or_else(|| Poison::new(PoisonReason::InvalidJson, "record has no value (tombstone)"))?;
    if bytes.len() > max_record_bytes {
        return Err(Poison::new(
            PoisonReason::TooLarge,
            format!(
                "record value is {} bytes, limit is {}",
                bytes.len(),
                max_record_bytes
            ),
        ));
    }
    std::str::from_utf8(bytes).map_err(|e| {
        Poison::new(
            PoisonReason::InvalidUtf8,
            format!("value is not UTF-8: {e}"),
        )
    })
}

/// An event time written as RFC 3339 text.
pub(crate) fn event_time_of_text(text: &str) -> Result<i64, Poison> {
    time::parse_rfc3339_ms(text).ok_or_else(|| {
        Poison::new(
            PoisonReason::InvalidTime,
            format!("event time {text:?} is not RFC 3339 with an offset"),
        )
    })
}

/// An event time written as an integer of `unit`s, `ms_per_unit` milliseconds each.
pub(crate) fn event_time_of_number(
    text: &str,
    unit: &str,
    ms_per_unit: i64,
) -> Result<i64, Poison> {
    text.parse::<i64>()
        .map(|n| n.saturating_mul(ms_per_unit))
        .map_err(|_| {
            Poison::new(
                PoisonReason::InvalidTime,
                format!("event time {text} is not an integer of epoch {unit}"),
            )
        })
}

/// An event time within what a ClickHouse `DateTime` holds.
pub(crate) fn event_time_in_range(ms: i64) -> Result<i64, Poison> {
    if time::in_range(ms) {
        Ok(ms)
    } else {
        Err(Poison::new(
            PoisonReason::InvalidTime,
            format!("event time {ms} ms is outside 1970-01-01..2105-12-31"),
        ))
    }
}

/// The poison of a record value that is not one JSON object.
pub(crate) fn not_a_json_object(e: serde_json::Error) -> Poison {
    let what = if e.is_data() {
        "expected a JSON object"
    } else {
        "malformed JSON"
    };
    Poison::new(PoisonReason::InvalidJson, format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_names_round_trip() {
        for r in PoisonReason::ALL {
            assert_eq!(PoisonReason::parse(r.as_str()), Some(r));
        }
    }
}
