//! Key encodings. Integers are big-endian with the sign bit flipped so byte order is numeric
//! order, which makes "everything before a cutoff" a key range.

use std::cmp::Ordering;

use compact_str::CompactString;
use tally_core::{GroupKey, PartitionId, WindowKey};

fn i32_key(v: i32) -> [u8; 4] {
    ((v as u32) ^ 0x8000_0000).to_be_bytes()
}

fn i64_key(v: i64) -> [u8; 8] {
    ((v as u64) ^ 0x8000_0000_0000_0000).to_be_bytes()
}

fn read_i32(b: &[u8]) -> Option<i32> {
    Some((u32::from_be_bytes(b.get(..4)?.try_into().ok()?) ^ 0x8000_0000) as i32)
}

fn read_i64(b: &[u8]) -> Option<i64> {
    Some((u64::from_be_bytes(b.get(..8)?.try_into().ok()?) ^ 0x8000_0000_0000_0000) as i64)
}

pub fn window_prefix(p: PartitionId, window_start_ms: i64) -> Vec<u8> {
    let mut k = Vec::with_capacity(12);
    push_window_prefix(&mut k, p, window_start_ms);
    k
}

fn push_window_prefix(k: &mut Vec<u8>, p: PartitionId, window_start_ms: i64) {
    k.extend_from_slice(&i32_key(p));
    k.extend_from_slice(&i64_key(window_start_ms));
}

/// partition | window start | every key part but the last as its length (u32) and bytes | the
/// last part's bytes. revenue_agg's (customer, currency) keys are customer length | customer |
/// currency, as every release wrote them.
pub fn window(p: PartitionId, key: &WindowKey) -> Vec<u8> {
    let mut k = Vec::with_capacity(12 + 4 * key.key.parts().len() + key.key.text_len());
    window_into(&mut k, p, key);
    k
}

/// [`window`] written into `k` (cleared first), reusing its allocation.
pub fn window_into(k: &mut Vec<u8>, p: PartitionId, key: &WindowKey) {
    k.clear();
    push_window_prefix(k, p, key.window_start_ms);
    if let Some((last, init)) = key.key.parts().split_last() {
        for part in init {
            k.extend_from_slice(&(part.len() as u32).to_be_bytes());
            k.extend_from_slice(part.as_bytes());
        }
        k.extend_from_slice(last.as_bytes());
    }
}

/// Orders windows as their encoded keys are ordered, without encoding them.
pub fn window_order(p: PartitionId, key: &WindowKey) -> impl Ord + '_ {
    (p, key.window_start_ms, EncodedOrder(&key.key))
}

/// A group key ordered as its encoding is: each part but the last by length, then bytes.
#[derive(PartialEq, Eq)]
struct EncodedOrder<'a>(&'a GroupKey);

impl Ord for EncodedOrder<'_> {
    fn cmp(&self, other: &Self) -> Ordering {
        let (a, b) = (self.0.parts(), other.0.parts());
        if a.len() != b.len() {
            // Never within one store, whose keys all have the job's parts: the bytes decide.
            let encode = |key: &GroupKey| {
                window(
                    0,
                    &WindowKey {
                        window_start_ms: 0,
                        key: key.clone(),
                    },
                )
            };
            return encode(self.0).cmp(&encode(other.0));
        }
        let last = a.len().saturating_sub(1);
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let order = if i < last {
                (x.len(), x.as_bytes()).cmp(&(y.len(), y.as_bytes()))
            } else {
                x.as_bytes().cmp(y.as_bytes())
            };
            if order != Ordering::Equal {
                return order;
            }
        }
        Ordering::Equal
    }
}

impl PartialOrd for EncodedOrder<'_> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Decodes a window key whose group key has `key_parts` parts.
pub fn decode_window(k: &[u8], key_parts: usize) -> Option<(PartitionId, WindowKey)> {
    let p = read_i32(k)?;
    let window_start_ms = read_i64(k.get(4..)?)?;
    let mut rest = k.get(12..)?;
    let mut parts = Vec::with_capacity(key_parts);
    for _ in 1..key_parts {
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        parts.push(CompactString::from(
            std::str::from_utf8(rest.get(4..4 + len)?).ok()?,
        ));
        rest = rest.get(4 + len..)?;
    }
    if key_parts > 0 {
        parts.push(CompactString::from(std::str::from_utf8(rest).ok()?));
    } else if !rest.is_empty() {
        return None;
    }
    Some((
        p,
        WindowKey {
            window_start_ms,
            key: GroupKey::new(parts),
        },
    ))
}

pub fn seen_id(p: PartitionId, id: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(4 + id.len());
    seen_id_into(&mut k, p, id);
    k
}

/// [`seen_id`] written into `k` (cleared first), reusing its allocation.
pub fn seen_id_into(k: &mut Vec<u8>, p: PartitionId, id: &[u8]) {
    k.clear();
    k.extend_from_slice(&i32_key(p));
    k.extend_from_slice(id);
}

/// Orders dedup ids as their encoded keys are ordered, without encoding them.
pub fn seen_id_order(p: PartitionId, id: &[u8]) -> impl Ord + '_ {
    (p, id)
}

pub fn decode_seen_id(k: &[u8]) -> Option<(PartitionId, &[u8])> {
    Some((read_i32(k)?, k.get(4..)?))
}

/// A change job's row by primary key: partition | the key's text, as a dedup id is keyed.
pub fn source_row_into(k: &mut Vec<u8>, p: PartitionId, key: &str) {
    seen_id_into(k, p, key.as_bytes());
}

/// Orders source rows as their encoded keys are ordered, without encoding them.
pub fn source_row_order(p: PartitionId, key: &str) -> impl Ord + '_ {
    seen_id_order(p, key.as_bytes())
}

pub fn decode_source_row(k: &[u8]) -> Option<(PartitionId, &str)> {
    let (p, key) = decode_seen_id(k)?;
    Some((p, std::str::from_utf8(key).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numeric_order_is_byte_order() {
        let values = [i64::MIN, -5, -1, 0, 1, 60_000, i64::MAX];
        for w in values.windows(2) {
            assert!(window_prefix(3, w[0]) < window_prefix(3, w[1]));
        }
        assert!(window_prefix(-1, i64::MAX) < window_prefix(0, i64::MIN));
        assert!(seen_id(-1, b"\xff\xff") < seen_id(0, b""));
        assert_eq!(decode_seen_id(&seen_id(-7, b"id")), Some((-7, &b"id"[..])));
    }

    proptest::proptest! {
        /// The order the pre-commit sorts by before writing is the keys' byte order.
        #[test]
        fn sorting_without_encoding_is_key_order(
            parts in 0usize..4,
            a in (-3i32..3, -2i64..2, proptest::collection::vec("[a-c\\x00ü]{0,3}", 4)),
            b in (-3i32..3, -2i64..2, proptest::collection::vec("[a-c\\x00ü]{0,3}", 4)),
            ida in proptest::collection::vec(proptest::num::u8::ANY, 0..4),
            idb in proptest::collection::vec(proptest::num::u8::ANY, 0..4),
        ) {
            let key = |(p, w, values): &(i32, i64, Vec<String>)| (*p, WindowKey {
                window_start_ms: w * 60_000,
                key: GroupKey::new(values[..parts].iter().map(|v| CompactString::from(v.as_str()))),
            });
            let ((pa, ka), (pb, kb)) = (key(&a), key(&b));
            proptest::prop_assert_eq!(
                window_order(pa, &ka).cmp(&window_order(pb, &kb)),
                window(pa, &ka).cmp(&window(pb, &kb))
            );
            proptest::prop_assert_eq!(decode_window(&window(pa, &ka), parts), Some((pa, ka)));
            proptest::prop_assert_eq!(
                seen_id_order(a.0, &ida).cmp(&seen_id_order(b.0, &idb)),
                seen_id(a.0, &ida).cmp(&seen_id(b.0, &idb))
            );
        }
    }

    #[test]
    fn window_keys_round_trip_with_awkward_customers() {
        for customer in ["", "a\0b", "ü", "x".repeat(300).as_str()] {
            let key = WindowKey::of_orders(-60_000, customer, "EUR");
            assert_eq!(decode_window(&window(7, &key), 2), Some((7, key)));
        }
        assert_eq!(decode_window(b"short", 2), None);
        // The bytes every release wrote for revenue_agg: customer length | customer | currency.
        let mut expected = window_prefix(7, 60_000);
        expected.extend_from_slice(&[0, 0, 0, 4]);
        expected.extend_from_slice(b"custEUR");
        assert_eq!(
            window(7, &WindowKey::of_orders(60_000, "cust", "EUR")),
            expected
        );
    }
}
