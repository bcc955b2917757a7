//! Declared aggregates: what one window keeps per aggregate, how a record adds to it, how the
//! values of several source partitions merge (in the view: sum of sums, min of mins, ...), and
//! the column each one shows.

use serde::Deserialize;

use super::value::{FieldKind, FieldType, MAX_DECIMAL18_UNITS, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Function {
    Count,
    Sum,
    Min,
    Max,
    Avg,
}

impl Function {
    pub fn as_str(self) -> &'static str {
        match self {
            Function::Count => "count",
            Function::Sum => "sum",
            Function::Min => "min",
            Function::Max => "max",
            Function::Avg => "avg",
        }
    }
}

/// One aggregate of a job, resolved against its field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aggregate {
    pub column: String,
    pub function: Function,
    /// Index of the input field among the job's fields; `None` for `count`.
    pub field: Option<usize>,
    /// The input field's type (`count` has none).
    pub input: Option<FieldType>,
}

impl Aggregate {
    /// The column's ClickHouse type in the view.
    pub fn clickhouse_type(&self) -> String {
        match (self.function, self.input) {
            (Function::Count, _) | (_, None) => "UInt64".into(),
            (Function::Sum | Function::Min | Function::Max, Some(t)) => t.clickhouse_type(),
            (Function::Avg, Some(t)) if t.kind == FieldKind::Decimal => {
                format!("Decimal(18, {})", t.scale)
            }
            (Function::Avg, Some(_)) => "Float64".into(),
        }
    }

    /// An empty accumulator of this aggregate.
    pub fn empty(&self) -> Acc {
        match self.function {
            Function::Count => Acc::Count(0),
            Function::Sum => Acc::Sum(Number::zero(self.input)),
            Function::Min | Function::Max => Acc::Extreme(None),
            Function::Avg => Acc::Avg {
                sum: Number::zero(self.input),
                count: 0,
            },
        }
    }
}

/// A running sum: exact for integers and decimals (within the column's range), `f64` for floats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Number {
    Exact(i64),
    Float(f64),
}

impl Number {
    fn zero(input: Option<FieldType>) -> Number {
        match input.map(|t| t.kind) {
            Some(FieldKind::Float) => Number::Float(0.0),
            _ => Number::Exact(0),
        }
    }

    fn checked_add(self, other: Number, limit: i64) -> Option<Number> {
        match (self, other) {
            (Number::Exact(a), Number::Exact(b)) => a
                .checked_add(b)
                .filter(|s| s.unsigned_abs() <= limit.unsigned_abs())
                .map(Number::Exact),
            (Number::Float(a), Number::Float(b)) => Some(Number::Float(a + b)),
            _ => None,
        }
    }

    fn of(value: &Value) -> Option<Number> {
        match value {
            Value::Int(i) | Value::Decimal(i) => Some(Number::Exact(*i)),
            Value::Float(x) => Some(Number::Float(*x)),
            _ => None,
        }
    }
}

/// What one window keeps for one aggregate.
#[derive(Debug, Clone, PartialEq)]
pub enum Acc {
    Count(u64),
    Sum(Number),
    /// The smallest (min) or largest (max) value seen; `None` before the first.
    Extreme(Option<Value>),
    Avg {
        sum: Number,
        count: u64,
    },
}

/// Why a record cannot be added: the window's value would leave its column's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overflow {
    pub column: String,
}

impl Aggregate {
    fn sum_limit(&self) -> i64 {
        match self.input.map(|t| t.kind) {
            Some(FieldKind::Decimal) => MAX_DECIMAL18_UNITS,
            _ => i64::MAX,
        }
    }

    /// Adds one record's value (`None` for `count`) to the accumulator.
    pub fn add(&self, acc: &Acc, value: Option<&Value>) -> Result<Acc, Overflow> {
        let overflow = || Overflow {
            column: self.column.clone(),
        };
        let number = || value.and_then(Number::of).ok_or_else(overflow);
        Ok(match (self.function, acc) {
            (Function::Count, Acc::Count(n)) => Acc::Count(n.checked_add(1).ok_or_else(overflow)?),
            (Function::Sum, Acc::Sum(s)) => Acc::Sum(
                s.checked_add(number()?, self.sum_limit())
                    .ok_or_else(overflow)?,
            ),
            (Function::Min | Function::Max, Acc::Extreme(held)) => {
                let value = value.ok_or_else(overflow)?;
                Acc::Extreme(Some(self.pick(held.as_ref(), value)))
            }
            (Function::Avg, Acc::Avg { sum, count }) => Acc::Avg {
                sum: sum
                    .checked_add(number()?, self.sum_limit())
                    .ok_or_else(overflow)?,
                count: count.checked_add(1).ok_or_else(overflow)?,
            },
            _ => return Err(overflow()),
        })
    }

    fn pick(&self, held: Option<&Value>, value: &Value) -> Value {
        match held {
            None => value.clone(),
            Some(held) => {
                let keep_new = match self.function {
                    Function::Min => value.compare(held).is_lt(),
                    _ => value.compare(held).is_gt(),
                };
                if keep_new { value } else { held }.clone()
            }
        }
    }

    /// Merges the values two source partitions hold for one window, as the view does.
    pub fn merge(&self, a: &Acc, b: &Acc) -> Result<Acc, Overflow> {
        let overflow = || Overflow {
            column: self.column.clone(),
        };
        // Across partitions the view sums in a wider type: only the shown value must fit.
        let wide = i64::MAX;
        Ok(match (a, b) {
            (Acc::Count(x), Acc::Count(y)) => Acc::Count(x.checked_add(*y).ok_or_else(overflow)?),
            (Acc::Sum(x), Acc::Sum(y)) => Acc::Sum(x.checked_add(*y, wide).ok_or_else(overflow)?),
            (Acc::Extreme(x), Acc::Extreme(y)) => Acc::Extreme(match (x, y) {
                (None, other) | (other, None) => other.clone(),
                (Some(x), Some(y)) => Some(self.pick(Some(x), y)),
            }),
            (Acc::Avg { sum: s1, count: c1 }, Acc::Avg { sum: s2, count: c2 }) => Acc::Avg {
                sum: s1.checked_add(*s2, wide).ok_or_else(overflow)?,
                count: c1.checked_add(*c2).ok_or_else(overflow)?,
            },
            _ => return Err(overflow()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn agg(function: Function, kind: FieldKind) -> Aggregate {
        Aggregate {
            column: "c".into(),
            function,
            field: (function != Function::Count).then_some(0),
            input: (function != Function::Count).then_some(FieldType { kind, scale: 2 }),
        }
    }

    fn fold(a: &Aggregate, values: &[i64]) -> Acc {
        values.iter().fold(a.empty(), |acc, v| {
            a.add(&acc, Some(&Value::Decimal(*v))).expect("in range")
        })
    }

    #[test]
    fn a_decimal_sum_stops_at_the_columns_range() {
        let a = agg(Function::Sum, FieldKind::Decimal);
        let near = fold(&a, &[MAX_DECIMAL18_UNITS - 1]);
        assert!(a.add(&near, Some(&Value::Decimal(1))).is_ok());
        assert_eq!(
            a.add(&near, Some(&Value::Decimal(2))),
            Err(Overflow { column: "c".into() })
        );
    }

    #[test]
    fn columns_take_their_types_from_the_function_and_the_field() {
        assert_eq!(
            agg(Function::Count, FieldKind::String).clickhouse_type(),
            "UInt64"
        );
        assert_eq!(
            agg(Function::Sum, FieldKind::Decimal).clickhouse_type(),
            "Decimal(18, 2)"
        );
        assert_eq!(
            agg(Function::Avg, FieldKind::Integer).clickhouse_type(),
            "Float64"
        );
        assert_eq!(
            agg(Function::Max, FieldKind::Timestamp).clickhouse_type(),
            "DateTime"
        );
    }

    proptest! {
        /// Whatever way a window's records are split among source partitions, merging the
        /// partitions' values gives the value of all records at once.
        #[test]
        fn merging_partitions_equals_aggregating_everything(
            values in proptest::collection::vec(-1_000_000i64..1_000_000, 0..40),
            cut in 0usize..40,
            function in prop_oneof![Just(Function::Count), Just(Function::Sum), Just(Function::Min), Just(Function::Max), Just(Function::Avg)],
        ) {
            let a = agg(function, FieldKind::Decimal);
            let cut = cut.min(values.len());
            let whole = fold(&a, &values);
            let merged = a.merge(&fold(&a, &values[..cut]), &fold(&a, &values[cut..])).expect("in range");
            prop_assert_eq!(merged, whole);
        }
    }
}
