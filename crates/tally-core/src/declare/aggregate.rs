//! Declared aggregates: what one window keeps per aggregate, how a record adds to it, how the
//! values of several source partitions merge (in the view: sum of sums, min of mins, ...), and
//! the column each one shows.

use serde::Deserialize;

use super::value::{FieldKind, FieldType, MAX_DECIMAL18_UNITS, Value};
use crate::window_agg::{Word, WordKind};

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

    /// The words a window keeps for this aggregate, in order: one, or a sum and a count for
    /// `avg`.
    pub fn word_kinds(&self) -> &'static [WordKind] {
        let float = self.input.is_some_and(|t| t.kind == FieldKind::Float);
        match (self.function, float) {
            (Function::Count, _) => &[WordKind::Count],
            (Function::Avg, false) => &[WordKind::Exact, WordKind::Count],
            (Function::Avg, true) => &[WordKind::Float, WordKind::Count],
            (_, false) => &[WordKind::Exact],
            (_, true) => &[WordKind::Float],
        }
    }

    /// This aggregate's words of a window no record was added to yet. A min starts at the
    /// largest value and a max at the smallest, so that the first record's value replaces it
    /// (a window exists only once a record was added to it).
    pub fn empty(&self) -> impl Iterator<Item = Word> + '_ {
        self.word_kinds()
            .iter()
            .map(|kind| match (self.function, kind) {
                (_, WordKind::Count) => Word::Count(0),
                (Function::Min, WordKind::Exact) => Word::Exact(i64::MAX),
                (Function::Max, WordKind::Exact) => Word::Exact(i64::MIN),
                (Function::Min, WordKind::Float) => Word::Float(f64::INFINITY),
                (Function::Max, WordKind::Float) => Word::Float(f64::NEG_INFINITY),
                (_, WordKind::Exact) => Word::Exact(0),
                (_, WordKind::Float) => Word::Float(0.0),
            })
    }

    fn sum_limit(&self) -> i64 {
        match self.input.map(|t| t.kind) {
            Some(FieldKind::Decimal) => MAX_DECIMAL18_UNITS,
            _ => i64::MAX,
        }
    }

    /// Adds one record's value (`None` for `count`) to this aggregate's `words`; on an overflow
    /// they are left as they were.
    pub fn add(&self, words: &mut [Word], value: Option<&Value>) -> Result<(), Overflow> {
        let overflow = || Overflow {
            column: self.column.clone(),
        };
        let input = || value.and_then(Word::of).ok_or_else(overflow);
        let limit = self.sum_limit();
        match (self.function, &mut *words) {
            (Function::Count, [Word::Count(n)]) => *n = n.checked_add(1).ok_or_else(overflow)?,
            (Function::Sum, [sum]) => {
                *sum = add_within(*sum, input()?, limit).ok_or_else(overflow)?
            }
            (Function::Min | Function::Max, [held]) => *held = self.pick(*held, input()?),
            (Function::Avg, [sum, Word::Count(n)]) => {
                let (s, c) = (
                    add_within(*sum, input()?, limit).ok_or_else(overflow)?,
                    n.checked_add(1).ok_or_else(overflow)?,
                );
                (*sum, *n) = (s, c);
            }
            _ => return Err(overflow()),
        }
        Ok(())
    }

    /// The smaller (min) or larger (max) of two words of this aggregate.
    fn pick(&self, held: Word, new: Word) -> Word {
        let new_wins = match (held, new) {
            (Word::Exact(a), Word::Exact(b)) => b.cmp(&a),
            (Word::Float(a), Word::Float(b)) => b.total_cmp(&a),
            _ => return held,
        };
        let keep_new = match self.function {
            Function::Min => new_wins.is_lt(),
            _ => new_wins.is_gt(),
        };
        if keep_new { new } else { held }
    }

    /// Merges into `into` the words another source partition holds for the window, as the view
    /// does (sum of sums, min of mins, ...); across partitions sums may reach the full `i64`,
    /// since only the shown value must fit its column.
    pub fn merge(&self, into: &mut [Word], other: &[Word]) -> Result<(), Overflow> {
        let overflow = || Overflow {
            column: self.column.clone(),
        };
        if into.len() != other.len() {
            return Err(overflow());
        }
        for (a, b) in into.iter_mut().zip(other) {
            *a = match (self.function, *a, *b) {
                (_, Word::Count(x), Word::Count(y)) => {
                    Word::Count(x.checked_add(y).ok_or_else(overflow)?)
                }
                (Function::Min | Function::Max, x, y) => self.pick(x, y),
                (_, x, y) => add_within(x, y, i64::MAX).ok_or_else(overflow)?,
            };
        }
        Ok(())
    }
}

impl Aggregate {
    /// Adds a contribution's words (what one row adds) to `into`, or takes them back out
    /// (`retract`), for count, sum and avg, within the column's range; a min or max cannot be
    /// retracted (the declaration refuses them for changes).
    pub fn shift(
        &self,
        into: &mut [Word],
        contribution: &[Word],
        retract: bool,
    ) -> Result<(), Overflow> {
        let overflow = || Overflow {
            column: self.column.clone(),
        };
        if into.len() != contribution.len()
            || matches!(self.function, Function::Min | Function::Max)
        {
            return Err(overflow());
        }
        let limit = self.sum_limit();
        for (a, b) in into.iter_mut().zip(contribution) {
            *a = match (*a, *b, retract) {
                (Word::Count(x), Word::Count(y), false) => x.checked_add(y).map(Word::Count),
                (Word::Count(x), Word::Count(y), true) => x.checked_sub(y).map(Word::Count),
                (x, Word::Exact(y), true) => {
                    add_within(x, Word::Exact(y.checked_neg().ok_or_else(overflow)?), limit)
                }
                (x, Word::Float(y), true) => add_within(x, Word::Float(-y), limit),
                (x, y, false) => add_within(x, y, limit),
                _ => None,
            }
            .ok_or_else(overflow)?;
        }
        Ok(())
    }
}

/// `a + b` for two exact words within `±limit`, or two floats; `None` otherwise.
fn add_within(a: Word, b: Word, limit: i64) -> Option<Word> {
    match (a, b) {
        (Word::Exact(a), Word::Exact(b)) => a
            .checked_add(b)
            .filter(|s| s.unsigned_abs() <= limit.unsigned_abs())
            .map(Word::Exact),
        (Word::Float(a), Word::Float(b)) => Some(Word::Float(a + b)),
        _ => None,
    }
}

impl Word {
    /// The word a field's value adds to a sum, min or max: numbers and times as they are held.
    fn of(value: &Value) -> Option<Word> {
        match value {
            Value::Int(i) | Value::Decimal(i) | Value::Time(i) => Some(Word::Exact(*i)),
            Value::Float(x) => Some(Word::Float(*x)),
            Value::Str(_) | Value::Bool(_) => None,
        }
    }
}

/// Why a record cannot be added: the window's value would leave its column's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overflow {
    pub column: String,
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

    fn fold(a: &Aggregate, values: &[i64]) -> Vec<Word> {
        let mut words: Vec<Word> = a.empty().collect();
        for v in values {
            a.add(&mut words, Some(&Value::Decimal(*v)))
                .expect("in range");
        }
        words
    }

    #[test]
    fn a_decimal_sum_stops_at_the_columns_range() {
        let a = agg(Function::Sum, FieldKind::Decimal);
        let near = fold(&a, &[MAX_DECIMAL18_UNITS - 1]);
        assert!(a.add(&mut near.clone(), Some(&Value::Decimal(1))).is_ok());
        let mut words = near.clone();
        assert_eq!(
            a.add(&mut words, Some(&Value::Decimal(2))),
            Err(Overflow { column: "c".into() })
        );
        assert_eq!(words, near, "an overflow leaves the words as they were");
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
            let mut merged = fold(&a, &values[..cut]);
            a.merge(&mut merged, &fold(&a, &values[cut..])).expect("in range");
            prop_assert_eq!(merged, whole);
        }
    }
}
