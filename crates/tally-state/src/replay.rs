//! Replaying committed changelog records into a store: a whole restore into an empty store, or
//! a catch-up of a store that holds an earlier committed state of the same job (a warm
//! standby). Both check that each partition's records chain into its history and end at the
//! epoch the group committed, and both leave the store with restore points of its own.

use std::collections::BTreeMap;

use tally_core::{Checkpoint, Epoch, Offset, OutputRow, PartitionId};

use crate::changelog::{
    ChainCheck, ChangelogError, ChangelogRecord, EpochLiveness, Liveness, RestorePoints,
};
use crate::checkpoint::EpochStatus;
use crate::store::{StateError, StateStore};

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Changelog(#[from] ChangelogError),
    #[error(transparent)]
    State(#[from] StateError),
    /// The store cannot be caught up: it needs a whole restore into an empty directory.
    #[error("the state directory cannot be caught up from the changelog: {0}")]
    NotContinuable(NotContinuable),
}

/// What a replay read and applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayStats {
    pub records: u64,
    pub bytes: u64,
    pub windows: u64,
    pub ids: u64,
}

/// One epoch of one partition as read: where its first record is, what it keeps alive, and
/// the partition's cutoffs after it.
#[derive(Debug, Clone, Copy)]
struct EpochRead {
    first_offset: Offset,
    liveness: EpochLiveness,
}

/// A replay in progress. Feed it each partition's records in changelog order with
/// [`Replay::apply`], then [`Replay::finish`].
pub struct Replay<'s> {
    store: &'s StateStore,
    window_size_ms: i64,
    /// The epoch the group committed: later records were committed after it was read and are
    /// left for the next replay.
    up_to: Epoch,
    /// Records of this epoch or earlier are in the store already.
    applied: Option<Epoch>,
    /// Where reading starts, per partition: every partition the job commits.
    starts: BTreeMap<PartitionId, Offset>,
    chains: BTreeMap<PartitionId, ChainCheck>,
    points: RestorePoints,
    read: BTreeMap<PartitionId, Vec<EpochRead>>,
    ends: BTreeMap<PartitionId, Offset>,
    /// The records of epoch `up_to`, should a sink lack its batch.
    last_epoch: Vec<Checkpoint>,
    stats: ReplayStats,
    /// The store is marked as being replayed into.
    began: bool,
}

/// Why a store cannot be caught up and needs a whole restore instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotContinuable {
    #[error("it holds no checkpoint")]
    Empty,
    /// Its state may be ahead of the job's, on a branch that never committed.
    #[error("it holds pre-committed epochs")]
    Pending,
    /// A replay into it began and did not finish.
    #[error("a replay into it did not finish")]
    Interrupted,
    #[error("{0}")]
    Diverged(String),
}

impl<'s> Replay<'s> {
    /// A whole restore into an empty store, reading each partition from `starts` (its
    /// committed restore point, 0 for the start of the log).
    pub fn whole(
        store: &'s StateStore,
        window_size_ms: i64,
        up_to: Epoch,
        starts: BTreeMap<PartitionId, Offset>,
    ) -> Replay<'s> {
        let chains = starts
            .iter()
            .map(|(&p, &from)| {
                let check = if from > 0 {
                    ChainCheck::from_restore_point()
                } else {
                    ChainCheck::default()
                };
                (p, check)
            })
            .collect();
        Replay {
            store,
            window_size_ms,
            up_to,
            applied: None,
            starts,
            chains,
            points: RestorePoints::default(),
            read: BTreeMap::new(),
            ends: BTreeMap::new(),
            last_epoch: Vec::new(),
            stats: ReplayStats::default(),
            began: false,
        }
    }

    /// A catch-up of `store` to epoch `up_to` of `partitions`: each partition is read from
    /// where the store's restore points say its next epoch starts, and the first new record
    /// must start at the offset the store's state of it ends.
    pub fn continuing(
        store: &'s StateStore,
        window_size_ms: i64,
        up_to: Epoch,
        partitions: &[PartitionId],
    ) -> Result<Replay<'s>, ReplayError> {
        let not = |why| Err(ReplayError::NotContinuable(why));
        let Some(meta) = store.meta() else {
            return not(NotContinuable::Empty);
        };
        if meta.status != EpochStatus::Committed || !store.pending_epochs()?.is_empty() {
            return not(NotContinuable::Pending);
        }
        if store.is_replaying()? {
            return not(NotContinuable::Interrupted);
        }
        if meta.epoch > up_to {
            return not(NotContinuable::Diverged(format!(
                "it is at epoch {}, past the committed epoch {up_to}",
                meta.epoch
            )));
        }
        let held: Vec<PartitionId> = meta.partitions.keys().copied().collect();
        if held != partitions {
            return not(NotContinuable::Diverged(format!(
                "it holds partitions {held:?}, the job commits {partitions:?}"
            )));
        }
        let points = store.restore_points()?;
        let starts = partitions
            .iter()
            .map(|&p| (p, points.next_from(p)))
            .collect();
        let chains = meta
            .partitions
            .iter()
            .map(|(&p, progress)| (p, ChainCheck::after(meta.epoch, progress.next_offset)))
            .collect();
        Ok(Replay {
            store,
            window_size_ms,
            up_to,
            applied: Some(meta.epoch),
            starts,
            chains,
            points,
            read: BTreeMap::new(),
            ends: BTreeMap::new(),
            last_epoch: Vec::new(),
            stats: ReplayStats::default(),
            began: false,
        })
    }

    /// Whether the store already is at the epoch to replay to: nothing to read.
    /// The state directory the replay applies to.
    pub fn store(&self) -> &'s StateStore {
        self.store
    }

    pub fn is_current(&self) -> bool {
        self.applied == Some(self.up_to)
    }

    /// Where to start reading each partition of the changelog.
    pub fn starts(&self) -> &BTreeMap<PartitionId, Offset> {
        &self.starts
    }

    /// Applies the record at `offset` of changelog partition `changelog_partition`.
    pub fn apply(
        &mut self,
        changelog_partition: PartitionId,
        offset: Offset,
        bytes: &[u8],
    ) -> Result<(), ReplayError> {
        let record = ChangelogRecord::decode(bytes)?;
        let p = record.partition;
        if p != changelog_partition || !self.starts.contains_key(&p) {
            return Err(ChangelogError::Broken {
                partition: changelog_partition,
                detail: format!("offset {offset} holds a record of partition {p}, not of this one"),
            }
            .into());
        }
        if record.epoch > self.up_to {
            return Ok(());
        }
        self.ends.insert(p, offset + 1);
        if self.applied.is_some_and(|applied| record.epoch <= applied) {
            return Ok(());
        }
        self.chains.entry(p).or_default().accept(&record)?;
        let liveness = EpochLiveness {
            liveness: Liveness::of_record(&record),
            close_windows_before: record.close_windows_before,
            expire_seen_before: record.expire_seen_before,
        };
        let epochs = self.read.entry(p).or_default();
        match epochs.last_mut() {
            Some(last) if record.chunk > 0 => {
                last.liveness.liveness = last.liveness.liveness.merge(liveness.liveness);
            }
            _ => epochs.push(EpochRead {
                first_offset: offset,
                liveness,
            }),
        }
        if !self.began {
            self.store.begin_replay()?;
            self.began = true;
        }
        let checkpoint = record.to_checkpoint(self.window_size_ms);
        self.store.apply_restored(&checkpoint)?;
        self.stats.records += 1;
        self.stats.bytes += bytes.len() as u64;
        self.stats.windows += record.windows.len() as u64;
        self.stats.ids += record.seen.len() as u64;
        if record.epoch == self.up_to {
            self.last_epoch.push(checkpoint);
        }
        Ok(())
    }

    /// Checks that every partition reached epoch `up_to`.
    pub fn check_complete(&self) -> Result<(), ReplayError> {
        for &p in self.starts.keys() {
            let reached = match self.chains.get(&p) {
                Some(chain) => chain.finish(p)?,
                None => None,
            };
            let reached = reached.or(self.applied);
            if reached != Some(self.up_to) {
                return Err(ChangelogError::Broken {
                    partition: p,
                    detail: format!(
                        "the records read end at {}, but the group committed epoch {}: the changelog is incomplete (deleted or written by another job)",
                        reached.map_or("no record".to_string(), |e| format!("epoch {e}")),
                        self.up_to
                    ),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Epoch `up_to`'s checkpoint as one (what its ClickHouse batch needs), when this replay
    /// read it; `None` when the store had it already.
    pub fn last_epoch(&self) -> Option<Checkpoint> {
        if self.applied == Some(self.up_to) || self.last_epoch.is_empty() {
            return None;
        }
        let mut merged = Checkpoint {
            epoch: self.up_to,
            ..Checkpoint::default()
        };
        for part in &self.last_epoch {
            merged.partitions.extend(part.partitions.clone());
            merged.rows.extend(part.rows.iter().cloned());
            merged
                .close_windows_before
                .extend(part.close_windows_before.iter().copied());
            merged
                .expire_seen_before
                .extend(part.expire_seen_before.iter().copied());
        }
        // Chunks of one partition repeat its cutoffs.
        merged.close_windows_before.dedup();
        merged.expire_seen_before.dedup();
        OutputRow::sort_batch(&mut merged.rows);
        Some(merged)
    }

    /// Ends the replay at epoch `up_to`, continuing the commits of `writer`: the store's
    /// restore points cover what was read, and `pending` (epoch `up_to`'s outputs, when a sink
    /// may lack them) is left for the next run to complete. Call [`Replay::check_complete`]
    /// first.
    pub fn finish(
        self,
        writer: &str,
        pending: Option<&Checkpoint>,
    ) -> Result<ReplayStats, ReplayError> {
        let current = self.is_current();
        let mut points = self.points;
        for (&p, epochs) in &self.read {
            for e in epochs {
                points.set_end(p, e.first_offset);
                points = points.with_epoch(&BTreeMap::from([(p, e.liveness)]));
            }
        }
        for (&p, &end) in &self.ends {
            points.set_end(p, end);
        }
        if !current || pending.is_some() {
            self.store
                .finish_restore(self.up_to, pending, (writer, self.up_to))?;
        }
        self.store.save_restore_points(&points)?;
        if self.applied.is_none() || self.stats.records > 0 {
            // The store is opened again next (a whole restore after its move into place, the
            // worker after a takeover, the standby's next round): with its files holding
            // everything, opening it does not replay the write-ahead log of this replay.
            self.store.flush()?;
        }
        Ok(self.stats)
    }
}
