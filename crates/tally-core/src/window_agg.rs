//! A window's value: what each aggregate of the job keeps, a word or two each, in declaration
//! order (`declare::Aggregate` says which words and what they mean). Every job's windows are
//! stored, checkpointed and written alike; only the declaration reads them.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

use crate::amount::Amount;

/// One word of a window's value.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub enum Word {
    /// A count of records.
    Count(u64),
    /// An exact number: an integer, decimal units or epoch milliseconds (a sum, min or max).
    Exact(i64),
    /// A float (a sum, min or max).
    Float(f64),
}

/// What a word holds, without its value: what the store needs to read a value it wrote without
/// tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WordKind {
    Count,
    Exact,
    Float,
}

impl Word {
    pub fn kind(self) -> WordKind {
        match self {
            Word::Count(_) => WordKind::Count,
            Word::Exact(_) => WordKind::Exact,
            Word::Float(_) => WordKind::Float,
        }
    }
}

/// Floats compare by their bits, so that a value equals itself (NaN included) and a value read
/// back equals the one written.
impl PartialEq for Word {
    fn eq(&self, other: &Word) -> bool {
        match (self, other) {
            (Word::Count(a), Word::Count(b)) => a == b,
            (Word::Exact(a), Word::Exact(b)) => a == b,
            (Word::Float(a), Word::Float(b)) => a.to_bits() == b.to_bits(),
            _ => false,
        }
    }
}

impl Eq for Word {}

/// The full current value of one window in one source partition. Two words are kept inline,
/// revenue_agg's count and sum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowAgg(SmallVec<[Word; 2]>);

/// revenue_agg's words: its order count, then its revenue in 10^-4 units.
pub const ORDERS_WORDS: [WordKind; 2] = [WordKind::Count, WordKind::Exact];

/// The shape of a job's rows: the parts of its window keys and the words of its values, which
/// the store's bytes cannot say (it records the shape beside them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowShape {
    pub key_parts: usize,
    pub words: Vec<WordKind>,
}

impl RowShape {
    /// revenue_agg's rows: (customer, currency) and (orders, revenue).
    pub fn orders() -> RowShape {
        RowShape {
            key_parts: 2,
            words: ORDERS_WORDS.to_vec(),
        }
    }
}

impl std::fmt::Display for RowShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "keys of {} part(s), values of words {:?}",
            self.key_parts, self.words
        )
    }
}

impl WindowAgg {
    pub fn new(words: impl IntoIterator<Item = Word>) -> WindowAgg {
        WindowAgg(words.into_iter().collect())
    }

    /// revenue_agg's value of a window: its order count and revenue.
    pub fn of_orders(orders: u64, revenue: Amount) -> WindowAgg {
        WindowAgg(SmallVec::from_buf([
            Word::Count(orders),
            Word::Exact(revenue.0),
        ]))
    }

    pub fn words(&self) -> &[Word] {
        &self.0
    }

    pub fn words_mut(&mut self) -> &mut [Word] {
        &mut self.0
    }

    /// Whether the words are of `kinds`, in order: a value of the job's shape.
    pub fn has_kinds(&self, kinds: &[WordKind]) -> bool {
        self.0.len() == kinds.len() && self.0.iter().zip(kinds).all(|(w, k)| w.kind() == *k)
    }

    /// revenue_agg's order count (0 for a value of another shape).
    pub fn orders(&self) -> u64 {
        match self.0.first() {
            Some(Word::Count(n)) => *n,
            _ => 0,
        }
    }

    /// revenue_agg's revenue (0 for a value of another shape).
    pub fn revenue(&self) -> Amount {
        match self.0.get(1) {
            Some(Word::Exact(units)) => Amount(*units),
            _ => Amount(0),
        }
    }
}

/// Written as a sequence of tagged words: a changelog record or a pending batch says what it
/// holds, whatever the job.
impl Serialize for WindowAgg {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.as_slice().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for WindowAgg {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<WindowAgg, D::Error> {
        Vec::<Word>::deserialize(deserializer).map(|words| WindowAgg(SmallVec::from_vec(words)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revenue_aggs_words_read_back_as_orders_and_revenue() {
        let v = WindowAgg::of_orders(3, Amount(-12_500));
        assert_eq!((v.orders(), v.revenue()), (3, Amount(-12_500)));
        assert!(v.has_kinds(&ORDERS_WORDS));
        assert!(!v.has_kinds(&[WordKind::Count]));
        let other = WindowAgg::new([Word::Float(1.5)]);
        assert_eq!((other.orders(), other.revenue()), (0, Amount(0)));
    }

    /// Every window in memory holds one: two words inline and no more (the operator's memory
    /// estimate counts on it).
    #[test]
    fn a_value_of_two_words_stays_inline_in_40_bytes() {
        assert_eq!(std::mem::size_of::<Word>(), 16);
        assert!(std::mem::size_of::<WindowAgg>() <= 40);
        assert!(!WindowAgg::of_orders(1, Amount(1)).0.spilled());
    }

    #[test]
    fn floats_equal_by_their_bits() {
        assert_eq!(Word::Float(f64::NAN), Word::Float(f64::NAN));
        assert_ne!(Word::Float(0.0), Word::Float(-0.0));
        assert_ne!(Word::Count(1), Word::Exact(1));
    }

    #[test]
    fn a_value_round_trips_through_its_tagged_encoding() {
        let v = WindowAgg::new([Word::Count(7), Word::Exact(-3), Word::Float(0.25)]);
        let bytes = bincode::serde::encode_to_vec(&v, bincode::config::standard()).unwrap();
        let (back, _): (WindowAgg, usize) =
            bincode::serde::decode_from_slice(&bytes, bincode::config::standard()).unwrap();
        assert_eq!(back, v);
    }
}
