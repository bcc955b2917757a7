//! The decoder revenue_agg ran on before it became a declaration, kept as a test oracle: the
//! declared revenue_agg must read every record as it did (the same event or the same reason).

use std::borrow::Cow;
use std::fmt;

use compact_str::CompactString;
use serde::Deserializer;
use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

use super::revenue_agg::FieldMapping;
use crate::amount::Amount;
use crate::decode::{
    Key, Poison, PoisonReason, Raw, classify, document, event_time_in_range, event_time_of_number,
    event_time_of_text, not_a_json_object, string_of,
};

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
