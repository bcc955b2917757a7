//! An in-memory filter of the event ids a partition's dedup set holds, so that a new id (most
//! ids are new) is recognised without a store lookup. It may answer "maybe" for an id never seen
//! (about 1 % of them, which then cost a lookup), and never "no" for an id the store holds
//! within the dedup horizon.
//!
//! Ids are kept in generations, each a blocked Bloom filter (all bits of one id in one 64-byte
//! block: one cache miss per probe). A generation spans at most half the horizon of event time
//! and is dropped as a whole once its newest id is past the horizon, so memory follows the ids
//! within the horizon (about 1.3 bytes each, and up to twice that while a new generation, sized
//! for the ids of the last half horizon, fills) and deletion is never needed.

use std::collections::BTreeMap;
use std::hash::BuildHasher;

/// Bits per id: about 1 % false positives for a blocked filter with [`PROBES`] probes.
const BITS_PER_ID: usize = 10;
const PROBES: u32 = 7;
const BLOCK_BITS: u64 = 512;
/// Capacity of a partition's first generation (320 KiB); later ones are sized from the
/// previous one.
pub const DEFAULT_FIRST_CAPACITY: usize = 1 << 18;
/// A full generation's successor is this many times larger: a lookup of a new id probes every
/// generation, so a partition that grows should reach its size in few of them.
const GROWTH: usize = 4;

/// The hash the filter uses for an id: fixed, so a filter built by one thread answers for ids
/// hashed by another.
pub fn id_hash(id: &[u8]) -> u64 {
    foldhash::quality::FixedState::with_seed(0x7a11_7a11_5eed_0001).hash_one(id)
}

/// A blocked Bloom filter over id hashes.
#[derive(Debug, Clone)]
struct BlockedBloom {
    blocks: Vec<[u64; 8]>,
}

impl BlockedBloom {
    fn with_capacity(ids: usize) -> BlockedBloom {
        let bits = ids.max(1).saturating_mul(BITS_PER_ID) as u64;
        let blocks = bits.div_ceil(BLOCK_BITS).max(1) as usize;
        BlockedBloom {
            blocks: vec![[0; 8]; blocks],
        }
    }

    /// The block (from the high half of the hash) and the probe sequence (from the low half).
    fn locate(&self, hash: u64) -> (usize, u32, u32) {
        let block = (((hash >> 32) * self.blocks.len() as u64) >> 32) as usize;
        let low = hash as u32;
        (block, low, low.rotate_left(16) | 1)
    }

    fn insert(&mut self, hash: u64) {
        let (block, h1, h2) = self.locate(hash);
        if let Some(words) = self.blocks.get_mut(block) {
            for i in 0..PROBES {
                let bit = h1.wrapping_add(i.wrapping_mul(h2)) >> 23;
                words[(bit / 64) as usize] |= 1 << (bit % 64);
            }
        }
    }

    fn maybe_contains(&self, hash: u64) -> bool {
        let (block, h1, h2) = self.locate(hash);
        let Some(words) = self.blocks.get(block) else {
            return true;
        };
        (0..PROBES).all(|i| {
            let bit = h1.wrapping_add(i.wrapping_mul(h2)) >> 23;
            words[(bit / 64) as usize] & (1 << (bit % 64)) != 0
        })
    }

    fn bytes(&self) -> usize {
        self.blocks.len() * 64
    }
}

#[derive(Debug, Clone)]
struct Generation {
    bloom: BlockedBloom,
    capacity: usize,
    count: usize,
    /// Event times of the oldest and newest id inserted.
    earliest_ms: i64,
    latest_ms: i64,
}

impl Generation {
    fn new(capacity: usize) -> Generation {
        Generation {
            bloom: BlockedBloom::with_capacity(capacity),
            capacity,
            count: 0,
            earliest_ms: i64::MAX,
            latest_ms: i64::MIN,
        }
    }

    fn add(&mut self, hash: u64, event_time_ms: i64) {
        self.bloom.insert(hash);
        self.count += 1;
        self.earliest_ms = self.earliest_ms.min(event_time_ms);
        self.latest_ms = self.latest_ms.max(event_time_ms);
    }
}

/// The ids of one partition's dedup set, as a filter. See the module documentation.
#[derive(Debug, Clone)]
pub struct SeenIdFilter {
    horizon_ms: i64,
    /// Oldest first; ids are inserted into the last.
    generations: Vec<Generation>,
}

impl SeenIdFilter {
    pub fn new(horizon_ms: i64, first_capacity: usize) -> SeenIdFilter {
        SeenIdFilter {
            horizon_ms,
            generations: vec![Generation::new(first_capacity.max(1))],
        }
    }

    /// Records an id with its event time.
    pub fn insert(&mut self, hash: u64, event_time_ms: i64) {
        let span = self.horizon_ms / 2;
        let rotate = self.generations.last().is_none_or(|g| {
            g.count >= g.capacity
                || (g.count > 0
                    && (event_time_ms.max(g.latest_ms))
                        .saturating_sub(event_time_ms.min(g.earliest_ms))
                        > span)
        });
        if rotate {
            // Full: `GROWTH` times the size. Spanning half the horizon: sized for as many ids
            // again.
            let capacity = self.generations.last().map_or(1, |g| {
                if g.count >= g.capacity {
                    g.capacity.saturating_mul(GROWTH)
                } else {
                    g.count.saturating_add(g.count / 4).max(1)
                }
            });
            self.generations.push(Generation::new(capacity));
        }
        if let Some(g) = self.generations.last_mut() {
            g.add(hash, event_time_ms);
        }
    }

    /// `false` only if no id with this hash was inserted (or it is past the horizon).
    pub fn maybe_contains(&self, hash: u64) -> bool {
        self.generations
            .iter()
            .any(|g| g.count > 0 && g.bloom.maybe_contains(hash))
    }

    /// Drops the generations whose every id is past the horizon at `watermark_ms`: an id seen at
    /// `t` is a duplicate only while `t + horizon > watermark`.
    pub fn expire(&mut self, watermark_ms: i64) {
        let horizon = self.horizon_ms;
        let last = self.generations.len().saturating_sub(1);
        let mut index = 0;
        self.generations.retain(|g| {
            let keep = index == last
                || (g.count > 0 && g.latest_ms.saturating_add(horizon) > watermark_ms);
            index += 1;
            keep
        });
    }

    /// Takes over the generations of a filter built from the store (at restore).
    pub fn absorb(&mut self, restored: SeenIdFilter) {
        let current = self.generations.pop();
        self.generations
            .extend(restored.generations.into_iter().filter(|g| g.count > 0));
        self.generations.extend(current);
    }

    /// Memory held by the filter's bits.
    pub fn bytes(&self) -> usize {
        self.generations.iter().map(|g| g.bloom.bytes()).sum()
    }

    /// Ids inserted into the generations still held.
    pub fn len(&self) -> usize {
        self.generations.iter().map(|g| g.count).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Builds a partition's filter from its stored ids in any order (the store keeps them by id).
/// A first pass counts the ids per half horizon of event time, a second inserts each id into the
/// generation of its span, sized for that count: the generations come out as compact and as
/// time-ordered as those of ids inserted in time order, so they expire the same way. Ids added
/// between the passes only make a generation denser (more "maybe"), never forgotten.
#[derive(Debug, Clone)]
pub struct FilterBuilder {
    horizon_ms: i64,
    counts: BTreeMap<i64, usize>,
}

impl FilterBuilder {
    pub fn new(horizon_ms: i64) -> FilterBuilder {
        FilterBuilder {
            horizon_ms,
            counts: BTreeMap::new(),
        }
    }

    fn span(horizon_ms: i64) -> i64 {
        (horizon_ms / 2).max(1)
    }

    /// First pass: one call per id.
    pub fn count(&mut self, event_time_ms: i64) {
        let span = Self::span(self.horizon_ms);
        *self
            .counts
            .entry(event_time_ms.div_euclid(span))
            .or_default() += 1;
    }

    /// Ends the first pass.
    pub fn into_fill(self) -> FilterFill {
        FilterFill {
            horizon_ms: self.horizon_ms,
            generations: self
                .counts
                .into_iter()
                .map(|(span, count)| (span, Generation::new(count.max(1))))
                .collect(),
        }
    }
}

/// Second pass of a [`FilterBuilder`].
#[derive(Debug, Clone)]
pub struct FilterFill {
    horizon_ms: i64,
    generations: BTreeMap<i64, Generation>,
}

impl FilterFill {
    pub fn insert(&mut self, hash: u64, event_time_ms: i64) {
        let span = FilterBuilder::span(self.horizon_ms);
        self.generations
            .entry(event_time_ms.div_euclid(span))
            .or_insert_with(|| Generation::new(DEFAULT_FIRST_CAPACITY))
            .add(hash, event_time_ms);
    }

    /// The filter, oldest generation first, for [`SeenIdFilter::absorb`].
    pub fn finish(self) -> SeenIdFilter {
        let mut generations: Vec<Generation> = self
            .generations
            .into_values()
            .filter(|g| g.count > 0)
            .collect();
        if generations.is_empty() {
            generations.push(Generation::new(DEFAULT_FIRST_CAPACITY));
        }
        SeenIdFilter {
            horizon_ms: self.horizon_ms,
            generations,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn hash(n: u64) -> u64 {
        id_hash(format!("id-{n}").as_bytes())
    }

    #[test]
    fn false_positives_stay_near_one_percent_at_capacity() {
        let mut f = SeenIdFilter::new(i64::MAX / 4, 100_000);
        for n in 0..100_000 {
            f.insert(hash(n), 0);
        }
        let fp = (1_000_000..1_100_000)
            .filter(|&n| f.maybe_contains(hash(n)))
            .count();
        assert!(fp < 2_000, "{fp} false positives in 100k");
        assert!(f.bytes() <= 100_000 * 10 / 8 + 64);
    }

    #[test]
    fn generations_past_the_horizon_are_dropped() {
        let mut f = SeenIdFilter::new(1_000, 16);
        for t in 0..2_000 {
            f.insert(hash(t as u64), t);
        }
        let before = f.bytes();
        f.expire(2_000 + 1_000);
        // Only the ids of the last half horizon remain reachable, with their generations.
        assert!(f.bytes() < before);
        assert!(f.maybe_contains(hash(1_999)));
        assert!(f.len() < 2_000);
    }

    #[test]
    fn a_filter_built_from_unordered_ids_has_one_generation_per_half_horizon() {
        let mut builder = FilterBuilder::new(1_000);
        let times: Vec<i64> = (0..3_000).map(|n| (n * 7_919) % 1_500).collect();
        for &t in &times {
            builder.count(t);
        }
        let mut fill = builder.into_fill();
        for (n, &t) in times.iter().enumerate() {
            fill.insert(hash(n as u64), t);
        }
        let f = fill.finish();
        assert_eq!(
            f.generations.len(),
            3,
            "spans [0, 500), [500, 1000), [1000, 1500)"
        );
        assert_eq!(f.len(), 3_000);
        assert!(f.bytes() <= 3_000 * BITS_PER_ID / 8 + 3 * 64);
    }

    proptest! {
        /// No false negative for any id within the horizon, whatever the order of event times,
        /// the capacity (tiny capacities saturate and rotate constantly) or the expiries.
        #[test]
        fn never_forgets_an_id_within_the_horizon(
            times in prop::collection::vec(0i64..5_000, 1..400),
            capacity in 1usize..64,
            horizon in 1i64..3_000,
            expire_every in 1usize..50,
            restored_prefix in 0usize..100,
        ) {
            let mut restored = SeenIdFilter::new(horizon, capacity);
            let mut f = SeenIdFilter::new(horizon, capacity);
            let mut watermark = i64::MIN;
            for (n, &t) in times.iter().enumerate() {
                if n < restored_prefix {
                    restored.insert(hash(n as u64), t);
                } else {
                    if n == restored_prefix {
                        f.absorb(std::mem::replace(&mut restored, SeenIdFilter::new(horizon, 1)));
                    }
                    f.insert(hash(n as u64), t);
                }
                watermark = watermark.max(t - 100);
                if n % expire_every == 0 && n >= restored_prefix {
                    f.expire(watermark);
                }
            }
            if restored_prefix >= times.len() {
                f.absorb(restored);
            }
            for (n, &t) in times.iter().enumerate() {
                if t + horizon > watermark {
                    prop_assert!(f.maybe_contains(hash(n as u64)), "id {n} at {t} forgotten at watermark {watermark}");
                }
            }
        }

        /// Built from the ids in any order, in two passes (with ids the first pass did not
        /// count, as when the store gains ids between them) and absorbed into a live filter, no
        /// id within the horizon is forgotten.
        #[test]
        fn a_filter_built_in_any_order_never_forgets_an_id_within_the_horizon(
            times in prop::collection::vec(-3_000i64..5_000, 1..400),
            uncounted in 0usize..50,
            horizon in 1i64..3_000,
            later in prop::collection::vec(0i64..6_000, 0..50),
        ) {
            let mut builder = FilterBuilder::new(horizon);
            for &t in times.iter().skip(uncounted) {
                builder.count(t);
            }
            let mut fill = builder.into_fill();
            for (n, &t) in times.iter().enumerate() {
                fill.insert(hash(n as u64), t);
            }
            let mut f = SeenIdFilter::new(horizon, 4);
            f.absorb(fill.finish());
            let mut watermark = times.iter().copied().max().unwrap_or(0) - horizon / 2;
            for (n, &t) in later.iter().enumerate() {
                f.insert(hash(10_000 + n as u64), t);
                watermark = watermark.max(t - 100);
                f.expire(watermark);
            }
            for (n, &t) in times.iter().enumerate() {
                if t + horizon > watermark {
                    prop_assert!(f.maybe_contains(hash(n as u64)), "id {n} at {t} forgotten at watermark {watermark}");
                }
            }
            for (n, &t) in later.iter().enumerate() {
                if t + horizon > watermark {
                    prop_assert!(f.maybe_contains(hash(10_000 + n as u64)));
                }
            }
        }
    }
}
