//! An epoch's changes between the barrier and the moment they are durable.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use compact_str::CompactString;

use super::{Checkpoint, FastMap, PartitionCheckpoint, StateReader};
use crate::source_row::SourceRow;
use crate::types::{DeadLetter, Epoch, OutputRow, PartitionId, WindowKey};
use crate::window_agg::WindowAgg;

/// An epoch's changes as the operator held them at the barrier: what a [`Checkpoint`] is made
/// of, before sorting.
#[derive(Debug, Default)]
pub struct EpochCut {
    pub epoch: Epoch,
    pub(super) window_size_ms: i64,
    pub(super) windows: FastMap<PartitionId, FastMap<WindowKey, WindowAgg>>,
    pub(super) seen: FastMap<PartitionId, FastMap<CompactString, i64>>,
    pub(super) rows: FastMap<PartitionId, FastMap<CompactString, SourceRow>>,
    pub dead_letters: Vec<DeadLetter>,
    pub partitions: BTreeMap<PartitionId, PartitionCheckpoint>,
    pub(super) close_windows_before: Vec<(PartitionId, i64)>,
    pub(super) expire_seen_before: Vec<(PartitionId, i64)>,
}

impl EpochCut {
    /// The checkpoint of this cut, rows and seen ids sorted so that it encodes the same
    /// whatever the hash order.
    pub fn to_checkpoint(&self) -> Checkpoint {
        let mut seen: Vec<(PartitionId, String, i64)> = self
            .seen_ids()
            .map(|(p, id, t)| (p, id.to_owned(), t))
            .collect();
        seen.sort();
        let mut source_rows: Vec<(PartitionId, String, SourceRow)> = self
            .source_rows()
            .map(|(p, key, row)| (p, key.to_owned(), row.clone()))
            .collect();
        source_rows.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        Checkpoint {
            seen,
            source_rows,
            ..self.to_checkpoint_without_ids()
        }
    }

    /// The epoch's changed rows of a change job, in no particular order.
    pub fn source_rows(&self) -> impl Iterator<Item = (PartitionId, &str, &SourceRow)> {
        self.rows
            .iter()
            .flat_map(|(&p, rows)| rows.iter().map(move |(key, row)| (p, key.as_str(), row)))
    }

    /// One partition's changed rows, in no particular order.
    pub fn source_rows_of(
        &self,
        partition: PartitionId,
    ) -> impl Iterator<Item = (&str, &SourceRow)> {
        self.rows
            .get(&partition)
            .into_iter()
            .flatten()
            .map(|(key, row)| (key.as_str(), row))
    }

    /// The epoch's new dedup ids with their event times, in no particular order.
    pub fn seen_ids(&self) -> impl Iterator<Item = (PartitionId, &str, i64)> {
        self.seen
            .iter()
            .flat_map(|(&p, ids)| ids.iter().map(move |(id, &t)| (p, id.as_str(), t)))
    }

    /// [`EpochCut::to_checkpoint`] with `seen` left empty: what the sinks need, without a copy
    /// of every id (the largest part of an epoch).
    pub fn to_checkpoint_without_ids(&self) -> Checkpoint {
        // Sized up front: collected from a flat map, the vector grew by doubling, copying the
        // rows each time and holding up to twice their memory (heap profile of a catch-up).
        let mut rows = Vec::with_capacity(self.windows.values().map(|w| w.len()).sum());
        rows.extend(self.windows.iter().flat_map(|(&partition, windows)| {
            windows.iter().map(move |(key, value)| OutputRow {
                partition,
                window_end_ms: key.window_start_ms + self.window_size_ms,
                key: key.clone(),
                value: value.clone(),
            })
        }));
        OutputRow::sort_batch(&mut rows);
        Checkpoint {
            epoch: self.epoch,
            partitions: self.partitions.clone(),
            rows,
            seen: Vec::new(),
            dead_letters: self.dead_letters.clone(),
            source_rows: Vec::new(),
            close_windows_before: self.close_windows_before.clone(),
            expire_seen_before: self.expire_seen_before.clone(),
        }
    }

    /// One partition's changed windows (full values), in no particular order.
    pub fn windows_of(
        &self,
        partition: PartitionId,
    ) -> impl Iterator<Item = (&WindowKey, &WindowAgg)> {
        self.windows.get(&partition).into_iter().flatten()
    }

    /// One partition's new dedup ids with their event times, in no particular order.
    pub fn seen_of(&self, partition: PartitionId) -> impl Iterator<Item = (&str, i64)> {
        self.seen
            .get(&partition)
            .into_iter()
            .flatten()
            .map(|(id, &t)| (id.as_str(), t))
    }

    /// One partition's (window close, dedup expiry) cutoffs at this barrier: `None` before
    /// its watermark exists.
    pub fn cutoffs_of(&self, partition: PartitionId) -> (Option<i64>, Option<i64>) {
        let find = |list: &[(PartitionId, i64)]| {
            list.iter()
                .find(|(p, _)| *p == partition)
                .map(|&(_, cutoff)| cutoff)
        };
        (
            find(&self.close_windows_before),
            find(&self.expire_seen_before),
        )
    }

    /// Records consumed in this epoch.
    pub fn consumed(&self) -> u64 {
        self.partitions.values().map(|p| p.epoch.consumed).sum()
    }
}

/// The durable state as it will be once the cuts in flight are written: the newest cut that
/// changed a key wins, then the store. Windows a cut closed and dedup entries it expired can
/// still be read here, and give the same decisions as their absence: a record for a closed
/// window is late, and an expired entry is past the horizon either way.
pub struct WithInFlight<'a, S> {
    /// Oldest first.
    pub cuts: &'a VecDeque<Arc<EpochCut>>,
    pub store: &'a S,
}

impl<S: StateReader> StateReader for WithInFlight<'_, S> {
    type Error = S::Error;

    fn window(
        &self,
        partition: PartitionId,
        key: &WindowKey,
    ) -> Result<Option<WindowAgg>, S::Error> {
        for cut in self.cuts.iter().rev() {
            if let Some(agg) = cut.windows.get(&partition).and_then(|w| w.get(key)) {
                return Ok(Some(agg.clone()));
            }
        }
        self.store.window(partition, key)
    }

    fn seen_event_time(
        &self,
        partition: PartitionId,
        event_id: &str,
    ) -> Result<Option<i64>, S::Error> {
        for cut in self.cuts.iter().rev() {
            if let Some(t) = cut.seen.get(&partition).and_then(|ids| ids.get(event_id)) {
                return Ok(Some(*t));
            }
        }
        self.store.seen_event_time(partition, event_id)
    }

    fn source_row(&self, partition: PartitionId, key: &str) -> Result<Option<SourceRow>, S::Error> {
        for cut in self.cuts.iter().rev() {
            if let Some(row) = cut.rows.get(&partition).and_then(|rows| rows.get(key)) {
                return Ok(Some(row.clone()));
            }
        }
        self.store.source_row(partition, key)
    }
}
