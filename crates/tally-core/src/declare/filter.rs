//! A declared filter: conditions on fields, all of which a record must meet to be aggregated.
//! A record that does not is counted as filtered, never dead-lettered.

use serde::Deserialize;

use super::extract::FieldReader;
use super::value::{FieldKind, Value, parse_decimal};
use crate::time;

/// One `[[aggregation.filter]]` entry as written: a field and one test (`min` and `max` may
/// go together, as a range).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConditionDecl {
    pub field: String,
    pub equals: Option<serde_json::Value>,
    pub not_equals: Option<serde_json::Value>,
    #[serde(rename = "in")]
    pub one_of: Option<Vec<serde_json::Value>>,
    pub not_in: Option<Vec<serde_json::Value>>,
    /// Inclusive lower bound.
    pub min: Option<serde_json::Value>,
    /// Inclusive upper bound.
    pub max: Option<serde_json::Value>,
    /// `true`: the field is present and not null; `false`: it is absent or null.
    pub present: Option<bool>,
}

/// A resolved condition on field `field` (an index among the job's fields).
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    pub field: usize,
    pub test: Test,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Test {
    Equals(Value),
    NotEquals(Value),
    In(Vec<Value>),
    NotIn(Vec<Value>),
    Range {
        min: Option<Value>,
        max: Option<Value>,
    },
    Present(bool),
}

impl Test {
    /// Whether a record whose field holds `value` (`None`: absent or null) meets the test. An
    /// absent field meets only `present = false`, as `NULL = x` is not true in SQL.
    pub fn holds(&self, value: Option<&Value>) -> bool {
        let Some(value) = value else {
            return matches!(self, Test::Present(false));
        };
        let same = |c: &Value| value.compare(c).is_eq();
        match self {
            Test::Equals(c) => same(c),
            Test::NotEquals(c) => !same(c),
            Test::In(set) => set.iter().any(same),
            Test::NotIn(set) => !set.iter().any(same),
            Test::Range { min, max } => {
                min.as_ref().is_none_or(|m| value.compare(m).is_ge())
                    && max.as_ref().is_none_or(|m| value.compare(m).is_le())
            }
            Test::Present(p) => *p,
        }
    }
}

/// Converts a constant written in the declaration to a value of the field's type.
pub fn constant(field: &FieldReader, written: &serde_json::Value) -> Result<Value, String> {
    let expected = field.kind.as_str();
    let refuse = || {
        format!(
            "{written} is not a {expected} (the type of field {:?})",
            field.name
        )
    };
    match (field.kind, written) {
        (FieldKind::String, serde_json::Value::String(s)) => Ok(Value::Str(s.as_str().into())),
        (FieldKind::Integer, serde_json::Value::Number(n)) => {
            n.as_i64().map(Value::Int).ok_or_else(refuse)
        }
        (FieldKind::Decimal, serde_json::Value::String(s)) => {
            parse_decimal(s, field.scale).map(Value::Decimal)
        }
        (FieldKind::Decimal, serde_json::Value::Number(n)) => {
            parse_decimal(&n.to_string(), field.scale).map(Value::Decimal)
        }
        (FieldKind::Float, serde_json::Value::Number(n)) => {
            n.as_f64().map(Value::Float).ok_or_else(refuse)
        }
        (FieldKind::Boolean, serde_json::Value::Bool(b)) => Ok(Value::Bool(*b)),
        (FieldKind::Timestamp, serde_json::Value::String(s)) => time::parse_rfc3339_ms(s)
            .map(Value::Time)
            .ok_or_else(|| format!("{s:?} is not RFC 3339 with an offset")),
        _ => Err(refuse()),
    }
}
