//! Typed field values: what a declared field holds once read from a record, how it is compared
//! and how it is written in ClickHouse.

use std::cmp::Ordering;
use std::fmt;

use compact_str::CompactString;
use serde::Deserialize;

pub use crate::amount::MAX_DECIMAL18_UNITS;
use crate::amount::{DecimalError, parse_scaled};
use crate::time;

/// The largest scale a decimal field may have: a `Decimal(18, s)` column keeps 18 digits in all.
pub const MAX_DECIMAL_SCALE: u32 = 18;

/// A declared field's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldKind {
    String,
    Integer,
    /// Exact fixed point with `scale` fractional digits, stored as scaled `i64` units.
    Decimal,
    Float,
    Boolean,
    /// Epoch milliseconds or seconds (by `unit`) as a number, or RFC 3339 text.
    Timestamp,
}

impl FieldKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FieldKind::String => "string",
            FieldKind::Integer => "integer",
            FieldKind::Decimal => "decimal",
            FieldKind::Float => "float",
            FieldKind::Boolean => "boolean",
            FieldKind::Timestamp => "timestamp",
        }
    }

    /// Whether values of this kind can be summed exactly or averaged.
    pub fn is_numeric(self) -> bool {
        matches!(
            self,
            FieldKind::Integer | FieldKind::Decimal | FieldKind::Float
        )
    }

    /// Whether values of this kind have an order worth a min or a max.
    pub fn is_ordered(self) -> bool {
        !matches!(self, FieldKind::Boolean)
    }
}

/// A field's complete type: its kind and, for decimals, the scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldType {
    pub kind: FieldKind,
    pub scale: u32,
}

impl FieldType {
    /// The ClickHouse type a column of this field has, on 18.16 and on current servers.
    pub fn clickhouse_type(self) -> String {
        match self.kind {
            FieldKind::String => "String".into(),
            FieldKind::Integer => "Int64".into(),
            FieldKind::Decimal => format!("Decimal(18, {})", self.scale),
            FieldKind::Float => "Float64".into(),
            FieldKind::Boolean => "UInt8".into(),
            FieldKind::Timestamp => "DateTime".into(),
        }
    }
}

/// One value of a declared field.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(CompactString),
    Int(i64),
    /// Units of 10^-scale; the scale is the field's.
    Decimal(i64),
    Float(f64),
    Bool(bool),
    /// Epoch milliseconds.
    Time(i64),
}

impl Value {
    /// Orders two values of one field; values of different kinds are never compared (the
    /// declaration is checked so that they cannot meet), and order as their kinds' positions.
    pub fn compare(&self, other: &Value) -> Ordering {
        match (self, other) {
            (Value::Str(a), Value::Str(b)) => a.cmp(b),
            (Value::Int(a), Value::Int(b))
            | (Value::Decimal(a), Value::Decimal(b))
            | (Value::Time(a), Value::Time(b)) => a.cmp(b),
            (Value::Float(a), Value::Float(b)) => a.total_cmp(b),
            (Value::Bool(a), Value::Bool(b)) => a.cmp(b),
            _ => self.rank().cmp(&other.rank()),
        }
    }

    fn rank(&self) -> u8 {
        match self {
            Value::Str(_) => 0,
            Value::Int(_) => 1,
            Value::Decimal(_) => 2,
            Value::Float(_) => 3,
            Value::Bool(_) => 4,
            Value::Time(_) => 5,
        }
    }

    /// The value as a part of a group key, which holds every key as text: a string as it is,
    /// a decimal at the field's scale, a boolean `1` or `0`, a time as epoch milliseconds,
    /// other numbers as Rust prints them (the sink reads each back by its column's type).
    pub fn key_text(&self, scale: u32) -> CompactString {
        use compact_str::ToCompactString;
        match self {
            Value::Str(s) => s.clone(),
            Value::Int(i) | Value::Time(i) => i.to_compact_string(),
            Value::Decimal(units) => format_decimal(i128::from(*units), scale).into(),
            Value::Float(x) => x.to_compact_string(),
            Value::Bool(b) => CompactString::const_new(if *b { "1" } else { "0" }),
        }
    }

    /// [`Value::key_text`], moving a string rather than copying it.
    pub fn into_key_text(self, scale: u32) -> CompactString {
        match self {
            Value::Str(s) => s,
            other => other.key_text(scale),
        }
    }

    /// The value as ClickHouse reads it in a `VALUES` or TSV cell of the field's column.
    pub fn display(&self, scale: u32) -> ValueDisplay<'_> {
        ValueDisplay { value: self, scale }
    }
}

pub struct ValueDisplay<'a> {
    value: &'a Value,
    scale: u32,
}

impl fmt::Display for ValueDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.value {
            Value::Str(s) => f.write_str(s),
            Value::Int(i) => write!(f, "{i}"),
            Value::Decimal(units) => f.write_str(&format_decimal(i128::from(*units), self.scale)),
            Value::Float(x) => write!(f, "{x}"),
            Value::Bool(b) => f.write_str(if *b { "1" } else { "0" }),
            Value::Time(ms) => f.write_str(&time::format_ms(*ms)),
        }
    }
}

/// Formats units of 10^-scale as a plain decimal.
pub fn format_decimal(units: i128, scale: u32) -> String {
    let sign = if units < 0 { "-" } else { "" };
    let abs = units.unsigned_abs();
    if scale == 0 {
        return format!("{sign}{abs}");
    }
    let one = 10u128.pow(scale);
    format!(
        "{sign}{}.{:0width$}",
        abs / one,
        abs % one,
        width = scale as usize
    )
}

/// Parses a decimal of `scale` fractional digits into units of 10^-scale, with a message
/// naming what is wrong.
pub fn parse_decimal(text: &str, scale: u32) -> Result<i64, String> {
    parse_scaled(text, scale).map_err(|e| match e {
        DecimalError::Empty => "the decimal is empty".to_owned(),
        DecimalError::Syntax => {
            format!("{text:?} is not a plain decimal number (digits, optional sign and point)")
        }
        DecimalError::TooPrecise => format!("{text:?} has more than {scale} fractional digits"),
        DecimalError::OutOfRange => format!("{text:?} does not fit Decimal(18, {scale})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decimals_parse_exactly_at_their_scale() {
        assert_eq!(parse_decimal("12.5", 4), Ok(125_000));
        assert_eq!(parse_decimal("-0.0001", 4), Ok(-1));
        assert_eq!(parse_decimal("007", 0), Ok(7));
        assert!(parse_decimal("1.23", 1).is_err());
        assert!(parse_decimal("1e3", 2).is_err());
        assert!(parse_decimal("", 2).is_err());
        assert!(parse_decimal(".5", 2).is_err());
        assert_eq!(
            parse_decimal("999999999999999999", 0),
            Ok(MAX_DECIMAL18_UNITS)
        );
        assert!(parse_decimal("1000000000000000000", 0).is_err());
        assert!(parse_decimal("0.5", 18).is_ok());
        assert!(parse_decimal("1", 18).is_err());
    }

    proptest! {
        #[test]
        fn a_formatted_decimal_parses_back(units in -MAX_DECIMAL18_UNITS..=MAX_DECIMAL18_UNITS, scale in 0u32..=18) {
            let text = format_decimal(i128::from(units), scale);
            prop_assert_eq!(parse_decimal(&text, scale), Ok(units));
        }
    }
}
