//! A window's value as the store keeps it, and the shape of its rows: its words in order without
//! tags (a count as a varint, an exact number zigzag, a float as 8 bytes), as bincode writes
//! those numbers. For revenue_agg (a count, then an exact sum) these are the bytes every release
//! wrote for `(orders, revenue)`, so its windows need no rewrite. Decoding takes the rows' shape
//! (value words, and key parts for keys.rs), since the bytes cannot say it: the directory
//! records it.

use bincode::config::Configuration;
use tally_core::{RowShape, WindowAgg, Word, WordKind};

use crate::format::CF_META;
use crate::store::{StateError, StateStore};

/// The rows' shape (`RowShape`); absent in a directory written before format 4: revenue_agg's.
const KEY_ROW_SHAPE: &[u8] = b"row_shape";

impl StateStore {
    /// Opens the store to run the job whose rows have `shape`: a new directory records it, one
    /// holding rows of another shape is refused ([`StateError::ShapeMismatch`]).
    pub fn open_for(
        path: &std::path::Path,
        job: &str,
        shape: &RowShape,
    ) -> Result<StateStore, StateError> {
        StateStore::open_with(path, job, Some(shape))
    }

    /// The shape of the rows the store holds.
    pub fn row_shape(&self) -> &RowShape {
        &self.shape
    }

    pub(crate) fn recorded_shape(&self) -> Result<Option<RowShape>, StateError> {
        self.db
            .get_cf(self.cf(CF_META)?, KEY_ROW_SHAPE)
            .map_err(|e| self.rocks(e))?
            .map(|bytes| self.decode(&bytes, "row shape"))
            .transpose()
    }

    /// Makes `want` the store's shape, recording it, unless the store holds rows of another.
    pub(crate) fn take_shape(&mut self, want: &RowShape, recorded: bool) -> Result<(), StateError> {
        if recorded && self.shape == *want {
            return Ok(());
        }
        // A directory without a checkpoint holds no rows yet: it takes the job's shape.
        if self.shape != *want && self.meta().is_some() {
            return Err(StateError::ShapeMismatch {
                path: self.path.clone(),
                found: self.shape.clone(),
                expected: want.clone(),
            });
        }
        let mut batch = rocksdb::WriteBatch::default();
        batch.put_cf(
            self.cf(CF_META)?,
            KEY_ROW_SHAPE,
            self.encode(want, "row shape")?,
        );
        self.write(batch)?;
        self.shape = want.clone();
        Ok(())
    }

    /// A window's value in its words; one of another shape than the store's is refused, since
    /// it could not be read back.
    pub(crate) fn encode_window_value(
        &self,
        value: &WindowAgg,
        out: &mut Vec<u8>,
    ) -> Result<(), StateError> {
        let refused = |detail: String| StateError::Encode {
            path: self.path.clone(),
            what: "window aggregate",
            detail,
        };
        if !value.has_kinds(&self.shape.words) {
            return Err(refused(format!(
                "{:?} is not a value of the store's words {:?}",
                value.words(),
                self.shape.words
            )));
        }
        encode_value(value, out).map_err(|e| refused(e.to_string()))
    }

    pub(crate) fn decode_window_value(&self, bytes: &[u8]) -> Result<WindowAgg, StateError> {
        decode_value(bytes, &self.shape.words).ok_or_else(|| StateError::Corrupt {
            path: self.path.clone(),
            what: "window aggregate",
            detail: format!(
                "{} bytes are not a value of words {:?}",
                bytes.len(),
                self.shape.words
            ),
        })
    }
}

fn config() -> Configuration {
    bincode::config::standard()
}

/// Appends `value`'s words to `out`.
pub fn encode_value(
    value: &WindowAgg,
    out: &mut Vec<u8>,
) -> Result<(), bincode::error::EncodeError> {
    for word in value.words() {
        match *word {
            Word::Count(n) => bincode::encode_into_std_write(n, out, config())?,
            Word::Exact(i) => bincode::encode_into_std_write(i, out, config())?,
            Word::Float(x) => bincode::encode_into_std_write(x, out, config())?,
        };
    }
    Ok(())
}

/// Reads a value of `kinds` that [`encode_value`] wrote; `None` if the bytes are not one.
pub fn decode_value(bytes: &[u8], kinds: &[WordKind]) -> Option<WindowAgg> {
    let mut rest = bytes;
    let mut complete = true;
    // Collected straight into the value: a window read is on the path of every record whose
    // window is not in memory.
    let value = WindowAgg::new(kinds.iter().map_while(|kind| {
        let decoded =
            match kind {
                WordKind::Count => bincode::decode_from_slice(rest, config())
                    .map(|(n, read)| (Word::Count(n), read)),
                WordKind::Exact => bincode::decode_from_slice(rest, config())
                    .map(|(i, read)| (Word::Exact(i), read)),
                WordKind::Float => bincode::decode_from_slice(rest, config())
                    .map(|(x, read)| (Word::Float(x), read)),
            };
        let Ok((word, read)) = decoded else {
            complete = false;
            return None;
        };
        rest = rest.get(read..).unwrap_or_default();
        Some(word)
    }));
    (complete && rest.is_empty()).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::old_formats::WindowAggV2;
    use proptest::prelude::*;
    use tally_core::{Amount, ORDERS_WORDS};

    fn word() -> impl Strategy<Value = Word> {
        prop_oneof![
            any::<u64>().prop_map(Word::Count),
            any::<i64>().prop_map(Word::Exact),
            any::<f64>().prop_map(Word::Float),
        ]
    }

    proptest! {
        /// revenue_agg's windows keep the bytes the releases before wrote for (orders, revenue).
        #[test]
        fn revenue_aggs_values_are_the_bytes_written_before(orders: u64, revenue: i64) {
            let old = WindowAggV2 { orders, revenue: Amount(revenue) };
            let before = bincode::serde::encode_to_vec(old, config()).unwrap();
            let mut now = Vec::new();
            encode_value(&WindowAgg::of_orders(orders, Amount(revenue)), &mut now).unwrap();
            prop_assert_eq!(&now, &before);
            prop_assert_eq!(decode_value(&before, &ORDERS_WORDS), Some(WindowAgg::from(old)));
        }

        /// Any value reads back as written, given its kinds; cut short or with a byte more, it
        /// is not read at all.
        #[test]
        fn a_value_round_trips_and_a_damaged_one_is_refused(words in proptest::collection::vec(word(), 0..6)) {
            let value = WindowAgg::new(words.iter().copied());
            let kinds: Vec<WordKind> = words.iter().map(|w| w.kind()).collect();
            let mut bytes = Vec::new();
            encode_value(&value, &mut bytes).unwrap();
            prop_assert_eq!(decode_value(&bytes, &kinds), Some(value));
            if !bytes.is_empty() {
                prop_assert_eq!(decode_value(&bytes[..bytes.len() - 1], &kinds), None);
            }
            bytes.push(0);
            prop_assert_eq!(decode_value(&bytes, &kinds), None);
        }
    }
}
