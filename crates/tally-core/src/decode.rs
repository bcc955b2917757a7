//! Decoding one Kafka record value into an order, or into a poison reason with a message.

use std::borrow::Cow;
use std::fmt;

use compact_str::CompactString;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;

use crate::amount::Amount;
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

/// Names of the input JSON fields, from the job config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldMapping {
    pub event_id: String,
    pub customer_id: String,
    pub currency: String,
    pub amount: String,
    pub event_time: String,
}

impl Default for FieldMapping {
    fn default() -> Self {
        FieldMapping {
            event_id: "event_id".into(),
            customer_id: "customer_id".into(),
            currency: "currency".into(),
            amount: "amount".into(),
            event_time: "event_time".into(),
        }
    }
}

/// A valid order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderEvent {
    pub event_id: CompactString,
    pub customer_id: CompactString,
    pub currency: CompactString,
    pub amount: Amount,
    pub event_time_ms: i64,
}

/// Turns record values into orders. Holds the mapping and the size limit.
#[derive(Debug, Clone)]
pub struct RecordDecoder {
    pub mapping: FieldMapping,
    pub max_record_bytes: usize,
}

#[derive(Clone, Copy)]
enum Field {
    EventId,
    CustomerId,
    Currency,
    Amount,
    EventTime,
}

const FIELD_COUNT: usize = 5;

impl Field {
    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Default)]
struct RawFields<'a> {
    values: [Option<&'a RawValue>; FIELD_COUNT],
}

struct FieldsSeed<'m> {
    mapping: &'m FieldMapping,
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

impl<'de> DeserializeSeed<'de> for FieldsSeed<'_> {
    type Value = RawFields<'de>;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FieldsSeed<'_> {
    type Value = RawFields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = RawFields::default();
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            let m = self.mapping;
            let field = if key == m.event_id {
                Some(Field::EventId)
            } else if key == m.customer_id {
                Some(Field::CustomerId)
            } else if key == m.currency {
                Some(Field::Currency)
            } else if key == m.amount {
                Some(Field::Amount)
            } else if key == m.event_time {
                Some(Field::EventTime)
            } else {
                None
            };
            match field {
                // The last occurrence wins, as in JavaScript's JSON.parse.
                Some(f) => fields.values[f.index()] = Some(map.next_value::<&'de RawValue>()?),
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(fields)
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

/// `text` unless it is empty, which counts as missing.
fn non_empty<'t>(text: Cow<'t, str>, name: &str) -> Result<Cow<'t, str>, Poison> {
    if text.is_empty() {
        return Err(Poison::new(
            PoisonReason::MissingField,
            format!("field {name:?} is empty"),
        ));
    }
    Ok(text)
}

impl RecordDecoder {
    pub fn new(mapping: FieldMapping, max_record_bytes: usize) -> RecordDecoder {
        RecordDecoder {
            mapping,
            max_record_bytes,
        }
    }

    pub fn decode(&self, value: Option<&[u8]>) -> Result<OrderEvent, Poison> {
        let text = document(value, self.max_record_bytes)?;
        let mut de = serde_json::Deserializer::from_str(text);
        let fields = FieldsSeed {
            mapping: &self.mapping,
        }
        .deserialize(&mut de)
        .and_then(|f| de.end().map(|()| f))
        .map_err(not_a_json_object)?;
        let get = |field: Field, name: &str| -> Result<&RawValue, Poison> {
            match fields.values[field.index()] {
                Some(raw) if !matches!(classify(raw), Raw::Null) => Ok(raw),
                _ => Err(Poison::new(
                    PoisonReason::MissingField,
                    format!("field {name:?} is missing or null"),
                )),
            }
        };
        let required_string = |field: Field, name: &str| -> Result<Cow<'_, str>, Poison> {
            match classify(get(field, name)?) {
                Raw::Str(raw) => string_of(raw),
                Raw::Number(_) => Err(Poison::new(
                    PoisonReason::WrongType,
                    format!("field {name:?} is a number, expected a string"),
                )),
                Raw::Other(kind) => Err(Poison::new(
                    PoisonReason::WrongType,
                    format!("field {name:?} is {kind}, expected a string"),
                )),
                Raw::Null => Err(Poison::new(
                    PoisonReason::MissingField,
                    format!("field {name:?} is null"),
                )),
            }
        };
        let m = &self.mapping;
        let event_id =
            required_string(Field::EventId, &m.event_id).and_then(|id| non_empty(id, &m.event_id));
        let customer_id = required_string(Field::CustomerId, &m.customer_id)
            .and_then(|id| non_empty(id, &m.customer_id));
        let currency = required_string(Field::Currency, &m.currency).and_then(|currency| {
            if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
                return Err(Poison::new(
                    PoisonReason::InvalidCurrency,
                    format!("currency {currency:?} is not three upper-case letters"),
                ));
            }
            Ok(currency)
        });
        let amount = (|| {
            let amount_text = match classify(get(Field::Amount, &m.amount)?) {
                Raw::Str(raw) => string_of(raw)?,
                Raw::Number(text) => Cow::Borrowed(text),
                Raw::Other(kind) => {
                    return Err(Poison::new(
                        PoisonReason::WrongType,
                        format!(
                            "field {:?} is {kind}, expected a number or decimal string",
                            m.amount
                        ),
                    ));
                }
                Raw::Null => {
                    return Err(Poison::new(
                        PoisonReason::MissingField,
                        format!("field {:?} is null", m.amount),
                    ));
                }
            };
            Amount::parse(&amount_text)
                .map_err(|e| Poison::new(PoisonReason::InvalidAmount, e.to_string()))
        })();
        let event_time_ms = (|| {
            let ms = match classify(get(Field::EventTime, &m.event_time)?) {
                Raw::Str(raw) => event_time_of_text(&string_of(raw)?)?,
                Raw::Number(text) => event_time_of_number(text, "milliseconds", 1)?,
                Raw::Other(kind) => {
                    return Err(Poison::new(
                        PoisonReason::WrongType,
                        format!(
                            "field {:?} is {kind}, expected a string or integer",
                            m.event_time
                        ),
                    ));
                }
                Raw::Null => {
                    return Err(Poison::new(
                        PoisonReason::MissingField,
                        format!("field {:?} is null", m.event_time),
                    ));
                }
            };
            event_time_in_range(ms)
        })();
        // A wrong value is named before a missing field, as a declared job names them
        // (docs/formats.md: the order of dead-letter reasons).
        let (event_id, customer_id, currency, amount, event_time_ms) =
            match (event_id, customer_id, currency, amount, event_time_ms) {
                (Ok(a), Ok(b), Ok(c), Ok(d), Ok(e)) => (a, b, c, d, e),
                (a, b, c, d, e) => {
                    let errors = [a.err(), b.err(), c.err(), d.err(), e.err()];
                    let mut errors = errors.into_iter().flatten();
                    let first = errors.next().unwrap_or_else(|| {
                        Poison::new(PoisonReason::InvalidJson, "no field could be read")
                    });
                    if first.reason != PoisonReason::MissingField {
                        return Err(first);
                    }
                    let wrong = errors.find(|p| p.reason != PoisonReason::MissingField);
                    return Err(wrong.unwrap_or(first));
                }
            };
        Ok(OrderEvent {
            event_id: CompactString::from(event_id.as_ref()),
            customer_id: CompactString::from(customer_id.as_ref()),
            currency: CompactString::from(currency.as_ref()),
            amount,
            event_time_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoder() -> RecordDecoder {
        RecordDecoder::new(FieldMapping::default(), 1024)
    }

    fn reason(value: &[u8]) -> PoisonReason {
        match decoder().decode(Some(value)) {
            Ok(ev) => panic!("expected poison, decoded {ev:?}"),
            Err(p) => p.reason,
        }
    }

    const GOOD: &str = r#"{"event_id":"e1","customer_id":"c1","currency":"EUR","amount":"12.34","event_time":"2026-11-29T10:00:00Z","extra":[1,{"x":2}]}"#;

    #[test]
    fn decodes_a_valid_order() {
        let ev = decoder().decode(Some(GOOD.as_bytes())).expect("valid");
        assert_eq!(ev.event_id, "e1");
        assert_eq!(ev.customer_id, "c1");
        assert_eq!(ev.currency, "EUR");
        assert_eq!(ev.amount, Amount(123_400));
        assert_eq!(ev.event_time_ms, 1_795_946_400_000);
    }

    #[test]
    fn accepts_numbers_and_epoch_millis_and_escapes() {
        let v = br#"{"event_id":"e\u0031","customer_id":"c\"1","currency":"USD","amount":-0.5,"event_time":1000}"#;
        let ev = decoder().decode(Some(v)).expect("valid");
        assert_eq!(ev.event_id, "e1");
        assert_eq!(ev.customer_id, "c\"1");
        assert_eq!(ev.amount, Amount(-5_000));
        assert_eq!(ev.event_time_ms, 1000);
    }

    /// Strings without escapes are read in place: that relies on serde_json rejecting what a
    /// JSON string may not hold raw, and escaped amounts and times still decode.
    #[test]
    fn strings_read_in_place_are_validated_and_escaped_ones_unescaped() {
        let raw_newline = b"{\"event_id\":\"e\n1\",\"customer_id\":\"c1\",\"currency\":\"EUR\",\"amount\":\"1.5\",\"event_time\":1000}";
        let err = decoder()
            .decode(Some(raw_newline))
            .expect_err("control character");
        assert_eq!(err.reason, PoisonReason::InvalidJson, "{err:?}");
        let escaped = br#"{"event_id":"e1","customer_id":"c1","currency":"E\u0055R","amount":"1\u002e5","event_time":"2026-12-01T00:00:00\u005a"}"#;
        let ev = decoder().decode(Some(escaped)).expect("valid");
        assert_eq!(ev.currency, "EUR");
        assert_eq!(ev.amount, Amount(15_000));
        assert_eq!(ev.event_time_ms, 1_796_083_200_000);
    }

    #[test]
    fn honours_the_field_mapping() {
        let mapping = FieldMapping {
            event_id: "id".into(),
            customer_id: "cust".into(),
            currency: "ccy".into(),
            amount: "amt".into(),
            event_time: "ts".into(),
        };
        let d = RecordDecoder::new(mapping, 1024);
        let ev = d
            .decode(Some(br#"{"id":"x","cust":"y","ccy":"GBP","amt":1,"ts":5}"#))
            .expect("valid");
        assert_eq!(ev.customer_id, "y");
        assert_eq!(
            d.decode(Some(GOOD.as_bytes())).map_err(|p| p.reason),
            Err(PoisonReason::MissingField)
        );
    }

    #[test]
    fn every_poison_reason() {
        assert_eq!(reason(b"\xff\xfe{}"), PoisonReason::InvalidUtf8);
        assert_eq!(reason(b"{\"event_id\":"), PoisonReason::InvalidJson);
        assert_eq!(reason(b"[1,2]"), PoisonReason::InvalidJson);
        assert_eq!(reason(b"{} trailing"), PoisonReason::InvalidJson);
        assert_eq!(
            decoder().decode(None).map_err(|p| p.reason),
            Err(PoisonReason::InvalidJson)
        );
        assert_eq!(
            reason(br#"{"customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#),
            PoisonReason::MissingField
        );
        assert_eq!(
            reason(
                br#"{"event_id":"","customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#
            ),
            PoisonReason::MissingField
        );
        assert_eq!(reason(br#"{"event_id":"e","customer_id":null,"currency":"EUR","amount":1,"event_time":1}"#), PoisonReason::MissingField);
        assert_eq!(
            reason(
                br#"{"event_id":7,"customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#
            ),
            PoisonReason::WrongType
        );
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":true,"event_time":1}"#), PoisonReason::WrongType);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":[1]}"#), PoisonReason::WrongType);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1e3,"event_time":1}"#), PoisonReason::InvalidAmount);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":"1.23456","event_time":1}"#), PoisonReason::InvalidAmount);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":100000000000000,"event_time":1}"#), PoisonReason::InvalidAmount);
        assert_eq!(
            reason(
                br#"{"event_id":"e","customer_id":"c","currency":"eur","amount":1,"event_time":1}"#
            ),
            PoisonReason::InvalidCurrency
        );
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EURO","amount":1,"event_time":1}"#), PoisonReason::InvalidCurrency);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":"yesterday"}"#), PoisonReason::InvalidTime);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":1.5}"#), PoisonReason::InvalidTime);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":-1}"#), PoisonReason::InvalidTime);
        let big = format!(
            r#"{{"event_id":"e","customer_id":"{}","currency":"EUR","amount":1,"event_time":1}}"#,
            "x".repeat(2000)
        );
        assert_eq!(reason(big.as_bytes()), PoisonReason::TooLarge);
    }

    #[test]
    fn poison_messages_name_the_field() {
        let err = decoder()
            .decode(Some(
                br#"{"event_id":"e","customer_id":"c","currency":"EUR","event_time":1}"#,
            ))
            .err()
            .map(|p| p.message)
            .unwrap_or_default();
        assert!(err.contains("\"amount\""), "{err}");
    }

    #[test]
    fn reason_names_round_trip() {
        for r in PoisonReason::ALL {
            assert_eq!(PoisonReason::parse(r.as_str()), Some(r));
        }
    }
}
