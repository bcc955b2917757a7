//! The changelog: each epoch's state changes, one record per source partition (split in chunks
//! when large), written to a Kafka topic in the epoch's transaction. Replaying a partition's
//! records in order through the store rebuilds exactly the state its worker committed, on a
//! machine that never held it.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use tally_core::{
    Checkpoint, Epoch, EpochCut, Offset, OutputRow, PartitionCheckpoint, PartitionId, WindowAgg,
    WindowKey,
};

/// Version of the record layout this build writes; a reader refuses any but this and
/// [`CHANGELOG_FORMAT_V1`].
/// 2: a window's group key is its parts (any number), not (customer, currency).
pub const CHANGELOG_FORMAT: u8 = 2;
/// Written by the releases before group keys: read as revenue_agg's (customer, currency).
pub const CHANGELOG_FORMAT_V1: u8 = 1;
/// Estimated bytes of windows and ids per record at most: records stay well below the
/// producer's and the topic's message limit (16 MiB), however large an epoch.
const CHUNK_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ChangelogError {
    #[error("changelog record: {0}")]
    Undecodable(String),
    #[error(
        "changelog record: format {found} is not supported (this build reads {CHANGELOG_FORMAT_V1} and {CHANGELOG_FORMAT}); a newer release wrote it: run that release"
    )]
    UnknownFormat { found: u8 },
    #[error("cannot encode a changelog record: {0}")]
    Encode(String),
    /// The records read do not chain into the whole history of the partition.
    #[error("changelog of partition {partition}: {detail}")]
    Broken {
        partition: PartitionId,
        detail: String,
    },
}

/// One partition's part of one epoch (or a chunk of it): what the store applies for the
/// partition at that checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "RecordFields<WindowKey>")]
pub struct ChangelogRecord {
    format: u8,
    pub epoch: Epoch,
    pub partition: PartitionId,
    /// Chunk `chunk` of `chunks`; every chunk carries the progress and cutoffs.
    pub chunk: u32,
    pub chunks: u32,
    pub progress: PartitionCheckpoint,
    pub close_windows_before: Option<i64>,
    pub expire_seen_before: Option<i64>,
    /// Full current values of the windows changed in this epoch.
    pub windows: Vec<(WindowKey, WindowAgg)>,
    /// Event ids aggregated in this epoch, with their event times.
    pub seen: Vec<(String, i64)>,
}

/// A record's fields with the window key of its format: one layout, read twice.
#[derive(Deserialize)]
struct RecordFields<K> {
    format: u8,
    epoch: Epoch,
    partition: PartitionId,
    chunk: u32,
    chunks: u32,
    progress: PartitionCheckpoint,
    close_windows_before: Option<i64>,
    expire_seen_before: Option<i64>,
    windows: Vec<(K, WindowAgg)>,
    seen: Vec<(String, i64)>,
}

impl<K: Into<WindowKey>> From<RecordFields<K>> for ChangelogRecord {
    fn from(r: RecordFields<K>) -> ChangelogRecord {
        ChangelogRecord {
            format: r.format,
            epoch: r.epoch,
            partition: r.partition,
            chunk: r.chunk,
            chunks: r.chunks,
            progress: r.progress,
            close_windows_before: r.close_windows_before,
            expire_seen_before: r.expire_seen_before,
            windows: r.windows.into_iter().map(|(k, v)| (k.into(), v)).collect(),
            seen: r.seen,
        }
    }
}

/// Encodes as [`ChangelogRecord`] decodes, borrowing from the cut (`K`: the format's window
/// key, a [`WindowKey`] but in tests).
#[derive(Serialize)]
struct RecordRef<'a, K = WindowKey> {
    format: u8,
    epoch: Epoch,
    partition: PartitionId,
    chunk: u32,
    chunks: u32,
    progress: &'a PartitionCheckpoint,
    close_windows_before: Option<i64>,
    expire_seen_before: Option<i64>,
    windows: &'a [(&'a K, &'a WindowAgg)],
    seen: &'a [(&'a str, i64)],
}

fn config() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// The epoch's changelog records, per partition of the cut (every partition, changed or not,
/// so that each partition's records form an unbroken chain of epochs).
pub fn encode_epoch(cut: &EpochCut) -> Result<Vec<(PartitionId, Vec<u8>)>, ChangelogError> {
    encode_in_chunks(cut, CHUNK_BYTES)
}

fn encode_in_chunks(
    cut: &EpochCut,
    chunk_bytes: usize,
) -> Result<Vec<(PartitionId, Vec<u8>)>, ChangelogError> {
    let mut out = Vec::with_capacity(cut.partitions.len());
    for (&partition, progress) in &cut.partitions {
        let windows: Vec<_> = cut.windows_of(partition).collect();
        let seen: Vec<_> = cut.seen_of(partition).collect();
        let (close_windows_before, expire_seen_before) = cut.cutoffs_of(partition);
        let window_size =
            |(k, _): &(&WindowKey, &WindowAgg)| k.key.text_len() + 5 * k.key.parts().len() + 30;
        let id_size = |(id, _): &(&str, i64)| id.len() + 10;
        let mut parts: Vec<(&[_], &[_])> = chunks(&windows, chunk_bytes, window_size)
            .into_iter()
            .map(|w| (w, &[][..]))
            .collect();
        for ids in chunks(&seen, chunk_bytes, id_size) {
            // The ids share the windows' last chunk when both fit in one.
            match parts.last_mut() {
                Some((w, s))
                    if s.is_empty()
                        && w.iter().map(window_size).sum::<usize>()
                            + ids.iter().map(id_size).sum::<usize>()
                            <= chunk_bytes =>
                {
                    *s = ids
                }
                _ => parts.push((&[][..], ids)),
            }
        }
        // An epoch without changes still gets its one record: it carries the progress.
        if parts.is_empty() {
            parts.push((&[][..], &[][..]));
        }
        let total = parts.len() as u32;
        for (chunk, (windows, seen)) in parts.into_iter().enumerate() {
            let record = RecordRef {
                format: CHANGELOG_FORMAT,
                epoch: cut.epoch,
                partition,
                chunk: chunk as u32,
                chunks: total,
                progress,
                close_windows_before,
                expire_seen_before,
                windows,
                seen,
            };
            let bytes = bincode::serde::encode_to_vec(&record, config())
                .map_err(|e| ChangelogError::Encode(e.to_string()))?;
            out.push((partition, bytes));
        }
    }
    Ok(out)
}

/// Splits `items` into runs of at most `limit` estimated bytes (or one item).
fn chunks<T>(items: &[T], limit: usize, size: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        let s = size(item);
        if bytes + s > limit && i > start {
            out.push(&items[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += s;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

impl ChangelogRecord {
    pub fn decode(bytes: &[u8]) -> Result<ChangelogRecord, ChangelogError> {
        // The format is the first field: checked before the rest is trusted.
        let decoded = match bytes.first() {
            Some(&CHANGELOG_FORMAT) => bincode::serde::decode_from_slice(bytes, config()),
            Some(&CHANGELOG_FORMAT_V1) => bincode::serde::decode_from_slice::<
                RecordFields<crate::legacy::WindowKeyV1>,
                _,
            >(bytes, config())
            .map(|(fields, read)| (ChangelogRecord::from(fields), read)),
            Some(&found) => return Err(ChangelogError::UnknownFormat { found }),
            None => return Err(ChangelogError::Undecodable("empty".into())),
        };
        decoded
            .map(|(record, _)| record)
            .map_err(|e| ChangelogError::Undecodable(e.to_string()))
    }

    /// The windows of this record as rows of the epoch's batch.
    pub fn output_rows(&self, window_size_ms: i64) -> impl Iterator<Item = OutputRow> + '_ {
        self.windows.iter().map(move |(key, value)| OutputRow {
            partition: self.partition,
            window_end_ms: key.window_start_ms + window_size_ms,
            key: key.clone(),
            value: *value,
        })
    }

    /// The checkpoint this record stands for, as the store applies it: this partition only,
    /// without dead letters (they are in the dead-letter topic already).
    pub fn to_checkpoint(&self, window_size_ms: i64) -> Checkpoint {
        let p = self.partition;
        Checkpoint {
            epoch: self.epoch,
            partitions: [(p, self.progress)].into(),
            rows: self.output_rows(window_size_ms).collect(),
            seen: self
                .seen
                .iter()
                .map(|(id, t)| (p, id.clone(), *t))
                .collect(),
            dead_letters: Vec::new(),
            close_windows_before: self
                .close_windows_before
                .map(|c| (p, c))
                .into_iter()
                .collect(),
            expire_seen_before: self
                .expire_seen_before
                .map(|c| (p, c))
                .into_iter()
                .collect(),
        }
    }
}

/// What one epoch's records of a partition hold that can outlive the epoch: the latest window
/// start and the latest id time in them. The records are dead (nothing in the state comes from
/// them alone) once the partition's close cutoff is past the one and its expiry cutoff past the
/// other.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    pub max_window_start: Option<i64>,
    pub max_seen_time: Option<i64>,
}

impl Liveness {
    pub fn of_cut(cut: &EpochCut, partition: PartitionId) -> Liveness {
        Liveness {
            max_window_start: cut
                .windows_of(partition)
                .map(|(k, _)| k.window_start_ms)
                .max(),
            max_seen_time: cut.seen_of(partition).map(|(_, t)| t).max(),
        }
    }

    pub fn of_record(record: &ChangelogRecord) -> Liveness {
        Liveness {
            max_window_start: record.windows.iter().map(|(k, _)| k.window_start_ms).max(),
            max_seen_time: record.seen.iter().map(|(_, t)| *t).max(),
        }
    }

    pub fn merge(self, other: Liveness) -> Liveness {
        Liveness {
            max_window_start: self.max_window_start.max(other.max_window_start),
            max_seen_time: self.max_seen_time.max(other.max_seen_time),
        }
    }

    /// Under the partition's cutoffs (windows starting before `close` are closed, ids before
    /// `expire` expired), nothing of these records is in the state any more.
    fn is_dead(&self, close: Option<i64>, expire: Option<i64>) -> bool {
        let gone = |latest: Option<i64>, cutoff: Option<i64>| match (latest, cutoff) {
            (None, _) => true,
            (Some(latest), Some(cutoff)) => latest < cutoff,
            (Some(_), None) => false,
        };
        gone(self.max_window_start, close) && gone(self.max_seen_time, expire)
    }
}

/// Per source partition, where a restore may start reading the changelog: the offset of the
/// oldest committed epoch whose records still hold live state (the newest epoch's always do:
/// they carry the partition's progress). Every record before it holds only closed windows and
/// expired ids, so a replay from there rebuilds the same state as one from the beginning, and
/// the changelog can be truncated below it. Offsets are lower bounds (an epoch's records start
/// at or after the changelog's end after the previous commit), so a restore point may lag but
/// never skips a live record.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestorePoints {
    partitions: BTreeMap<PartitionId, PartitionPoints>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct PartitionPoints {
    /// Where the next epoch's records start, at the latest: the changelog's end after the last
    /// commit (0 when unknown: the start of the log).
    next_from: Offset,
    /// Committed epochs that may still hold live state, oldest first: (from offset, liveness).
    live: VecDeque<(Offset, Liveness)>,
}

impl PartitionPoints {
    /// Drops the oldest epochs while they are dead under the cutoffs; the newest always stays.
    fn forget_dead(&mut self, close: Option<i64>, expire: Option<i64>) {
        while self.live.len() > 1
            && self
                .live
                .front()
                .is_some_and(|(_, l)| l.is_dead(close, expire))
        {
            self.live.pop_front();
        }
    }
}

/// One epoch of a partition, for [`RestorePoints::with_epoch`]: its records' liveness and the
/// partition's cutoffs after it.
#[derive(Debug, Clone, Copy)]
pub struct EpochLiveness {
    pub liveness: Liveness,
    pub close_windows_before: Option<i64>,
    pub expire_seen_before: Option<i64>,
}

impl RestorePoints {
    /// The points once `epoch` is committed too, without changing these (its transaction may
    /// fail and be retried).
    pub fn with_epoch(&self, epoch: &BTreeMap<PartitionId, EpochLiveness>) -> RestorePoints {
        let mut next = self.clone();
        for (&p, e) in epoch {
            let points = next.partitions.entry(p).or_default();
            points.live.push_back((points.next_from, e.liveness));
            points.forget_dead(e.close_windows_before, e.expire_seen_before);
        }
        next
    }

    /// Records that the changelog of `partition` ends at `end` after the last commit.
    pub fn set_end(&mut self, partition: PartitionId, end: Offset) {
        let points = self.partitions.entry(partition).or_default();
        points.next_from = points.next_from.max(end);
    }

    /// The changelog offset at or after which the next epoch's records of `partition` start.
    pub fn next_from(&self, partition: PartitionId) -> Offset {
        self.partitions.get(&partition).map_or(0, |p| p.next_from)
    }

    /// Where a restore of `partition` starts.
    pub fn restore_from(&self, partition: PartitionId) -> Offset {
        self.partitions
            .get(&partition)
            .map_or(0, |p| p.live.front().map_or(p.next_from, |(from, _)| *from))
    }
}

/// Liveness of each partition's records in `records` (an epoch's, encoded), chunks merged.
pub fn liveness_of_records(
    records: &[(PartitionId, Vec<u8>)],
) -> Result<BTreeMap<PartitionId, EpochLiveness>, ChangelogError> {
    let mut out: BTreeMap<PartitionId, EpochLiveness> = BTreeMap::new();
    for (_, bytes) in records {
        let r = ChangelogRecord::decode(bytes)?;
        let e = out.entry(r.partition).or_insert(EpochLiveness {
            liveness: Liveness::default(),
            close_windows_before: r.close_windows_before,
            expire_seen_before: r.expire_seen_before,
        });
        e.liveness = e.liveness.merge(Liveness::of_record(&r));
    }
    Ok(out)
}

/// Liveness of each partition's changes in `cut`.
pub fn liveness_of_cut(cut: &EpochCut) -> BTreeMap<PartitionId, EpochLiveness> {
    cut.partitions
        .keys()
        .map(|&p| {
            let (close_windows_before, expire_seen_before) = cut.cutoffs_of(p);
            (
                p,
                EpochLiveness {
                    liveness: Liveness::of_cut(cut, p),
                    close_windows_before,
                    expire_seen_before,
                },
            )
        })
        .collect()
}

/// Checks, record by record, that what a restore reads of one partition is its whole history:
/// it starts at the partition's first epoch (nothing consumed before it) and every record
/// follows the previous one (the next chunk of the same epoch, or the next epoch starting at
/// the offset where the previous ended).
#[derive(Debug, Default)]
pub struct ChainCheck {
    last: Option<(Epoch, u32, u32, i64)>,
    /// Reading starts at a restore point: the first record need not be the partition's first
    /// (everything before it is dead), only the first of its epoch.
    from_restore_point: bool,
}

impl ChainCheck {
    /// A check for a read that starts at a restore point the job committed.
    pub fn from_restore_point() -> ChainCheck {
        ChainCheck {
            last: None,
            from_restore_point: true,
        }
    }

    /// A check that continues a partition's state at the end of `epoch`, whose input ended
    /// at `next_offset`: the next record must start the next epoch there.
    pub fn after(epoch: Epoch, next_offset: Offset) -> ChainCheck {
        ChainCheck {
            last: Some((epoch, 0, 1, next_offset)),
            from_restore_point: false,
        }
    }

    pub fn accept(&mut self, record: &ChangelogRecord) -> Result<(), ChangelogError> {
        let broken = |detail: String| ChangelogError::Broken {
            partition: record.partition,
            detail,
        };
        let r = record;
        let problem = match self.last {
            None if r.chunk != 0
                || (!self.from_restore_point && r.progress.totals != r.progress.epoch) =>
            {
                Some(format!(
                    "the first record read (epoch {}, chunk {}) is not the partition's first: the job consumed it before the changelog began (a job started by an earlier tally release), or the topic was truncated",
                    r.epoch, r.chunk
                ))
            }
            None => None,
            Some((epoch, chunk, chunks, _)) if r.epoch == epoch => (r.chunk != chunk + 1
                || r.chunks != chunks)
                .then(|| {
                    format!(
                        "epoch {epoch}: chunk {} of {} after chunk {chunk} of {chunks}",
                        r.chunk, r.chunks
                    )
                }),
            Some((epoch, chunk, chunks, _)) if chunk + 1 != chunks => {
                Some(format!("epoch {epoch} ends at chunk {chunk} of {chunks}"))
            }
            Some((epoch, _, _, next_offset)) => (r.epoch <= epoch
                || r.chunk != 0
                || r.progress.epoch_start_offset != next_offset)
                .then(|| {
                    format!(
                        "epoch {} (chunk {}, from offset {}) does not follow epoch {epoch} (up to offset {next_offset})",
                        r.epoch, r.chunk, r.progress.epoch_start_offset
                    )
                }),
        };
        if let Some(detail) = problem {
            return Err(broken(detail));
        }
        self.last = Some((r.epoch, r.chunk, r.chunks, r.progress.next_offset));
        Ok(())
    }

    /// The last epoch read, once it is complete.
    pub fn finish(&self, partition: PartitionId) -> Result<Option<Epoch>, ChangelogError> {
        match self.last {
            None => Ok(None),
            Some((epoch, chunk, chunks, _)) if chunk + 1 == chunks => Ok(Some(epoch)),
            Some((epoch, chunk, chunks, _)) => Err(ChangelogError::Broken {
                partition,
                detail: format!("the last epoch read, {epoch}, ends at chunk {chunk} of {chunks}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use tally_core::{
        CheckpointBarrier, FieldMapping, OperatorConfig, Record, RecordDecoder, RevenueOperator,
        WindowSpec,
    };

    use super::*;
    use crate::StateStore;

    fn rules() -> OperatorConfig {
        OperatorConfig {
            window: WindowSpec { size_ms: 10_000 },
            out_of_orderness_ms: 1_000,
            allowed_lateness_ms: 5_000,
            dedup_horizon_ms: 30_000,
        }
    }

    /// (partition, event id, customer, time step in ms, poison)
    type Event = (i32, u8, u8, i64, bool);

    fn event() -> impl Strategy<Value = Event> {
        (
            0..3i32,
            0..40u8,
            0..6u8,
            -3_000..9_000i64,
            prop::bool::weighted(0.05),
        )
    }

    /// One committed epoch: its records and their liveness.
    type Committed = (
        Vec<(PartitionId, Vec<u8>)>,
        BTreeMap<PartitionId, EpochLiveness>,
    );

    /// Runs `epochs` through an operator over `owner`, pre-committing and committing each with
    /// its changelog; returns every epoch's records, encoded with `chunk_bytes`.
    fn run_owner(owner: &StateStore, epochs: &[Vec<Event>], chunk_bytes: usize) -> Vec<Vec<u8>> {
        run_owner_epochs(owner, epochs, chunk_bytes)
            .into_iter()
            .flat_map(|(records, _)| records.into_iter().map(|(_, bytes)| bytes))
            .collect()
    }

    fn run_owner_epochs(
        owner: &StateStore,
        epochs: &[Vec<Event>],
        chunk_bytes: usize,
    ) -> Vec<Committed> {
        let decoder = RecordDecoder::new(FieldMapping::default(), 1 << 20);
        let mut op = RevenueOperator::restore(rules(), decoder, Epoch(0), &BTreeMap::new())
            .with_seen_filter_capacity(64);
        for p in 0..3 {
            op.add_partition(p, 0);
        }
        let mut clock = [1_790_000_000_000i64; 3];
        let mut offsets = [0i64; 3];
        let mut log = Vec::new();
        for events in epochs {
            for &(p, id, customer, step, poison) in events {
                let i = p as usize;
                clock[i] += step;
                let value = if poison {
                    b"{not json".to_vec()
                } else {
                    format!(
                        r#"{{"event_id":"e{id}","customer_id":"c{customer}","currency":"EUR","amount":"1.25","event_time":{},"source":"t"}}"#,
                        clock[i]
                    )
                    .into_bytes()
                };
                let record = Record {
                    partition: p,
                    offset: offsets[i],
                    timestamp_ms: Some(clock[i]),
                    key: None,
                    value: Some(&value),
                };
                offsets[i] += 1;
                op.process(owner, record).unwrap();
            }
            let epoch = op.current_epoch();
            let cut = op.cut(CheckpointBarrier {
                epoch,
                is_final: false,
            });
            let records = encode_in_chunks(&cut, chunk_bytes).unwrap();
            let checkpoint = cut.to_checkpoint_without_ids();
            owner
                .pre_commit_with_seen(&checkpoint, cut.seen_ids(), &records)
                .unwrap();
            // The sinks' batch comes back whole from the changelog records kept beside it.
            assert_eq!(
                owner.pending(epoch, rules().window.size_ms).unwrap().0,
                checkpoint
            );
            owner.mark_committed(epoch).unwrap();
            log.push((records, liveness_of_cut(&cut)));
        }
        log
    }

    /// The changelog as the broker would hold it (per partition, consecutive offsets with a
    /// commit marker after each epoch), and the restore points the owner committed.
    fn simulate(epochs: &[Committed]) -> (Vec<(PartitionId, Offset, Vec<u8>)>, RestorePoints) {
        let mut next: BTreeMap<PartitionId, Offset> = BTreeMap::new();
        let mut points = RestorePoints::default();
        let mut log = Vec::new();
        for (records, liveness) in epochs {
            points = points.with_epoch(liveness);
            for (p, bytes) in records {
                let offset = next.entry(*p).or_default();
                log.push((*p, *offset, bytes.clone()));
                *offset += 1;
            }
            for &p in liveness.keys() {
                let end = next.entry(p).or_default();
                *end += 1;
                points.set_end(p, *end);
            }
        }
        (log, points)
    }

    /// Replays the records of `log` at or after each partition's `from` into `store`.
    fn replay(
        store: &StateStore,
        log: &[(PartitionId, Offset, Vec<u8>)],
        from: impl Fn(PartitionId) -> Offset,
    ) -> BTreeMap<PartitionId, ChainCheck> {
        let mut chains: BTreeMap<PartitionId, ChainCheck> = BTreeMap::new();
        for (p, offset, bytes) in log {
            if *offset < from(*p) {
                continue;
            }
            let record = ChangelogRecord::decode(bytes).unwrap();
            let chain = chains.entry(*p).or_insert_with(|| {
                if from(*p) > 0 {
                    ChainCheck::from_restore_point()
                } else {
                    ChainCheck::default()
                }
            });
            chain.accept(&record).unwrap();
            store
                .apply_restored(&record.to_checkpoint(rules().window.size_ms))
                .unwrap();
        }
        chains
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// A store rebuilt from the changelog alone equals the store that wrote it: windows,
        /// dedup entries, progress and cutoffs, with records chunked small or not at all.
        #[test]
        fn replaying_the_changelog_rebuilds_the_owners_state(
            epochs in prop::collection::vec(prop::collection::vec(event(), 0..60), 1..8),
            chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
        ) {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let owner = StateStore::open(a.path(), "job").unwrap();
            let log = run_owner(&owner, &epochs, chunk_bytes);
            let restored = StateStore::open(b.path(), "job").unwrap();
            let mut chains: BTreeMap<PartitionId, ChainCheck> = BTreeMap::new();
            for bytes in &log {
                let record = ChangelogRecord::decode(bytes).unwrap();
                chains.entry(record.partition).or_default().accept(&record).unwrap();
                restored.apply_restored(&record.to_checkpoint(rules().window.size_ms)).unwrap();
            }
            let last = Epoch(epochs.len() as u64);
            for (p, chain) in &chains {
                prop_assert_eq!(chain.finish(*p).unwrap(), Some(last));
            }
            restored.finish_restore(last, None, ("owner", last)).unwrap();
            prop_assert_eq!(restored.windows().unwrap(), owner.windows().unwrap());
            prop_assert_eq!(restored.seen_entries().unwrap(), owner.seen_entries().unwrap());
            prop_assert_eq!(restored.meta(), owner.meta());
            prop_assert_eq!(restored.adopted_writer().unwrap(), Some(("owner".to_string(), last)));
        }

        /// Replaying only from the restore points (the changelog truncated below them) rebuilds
        /// the same state as replaying everything, and the points never go back.
        #[test]
        fn replaying_from_the_restore_points_rebuilds_the_same_state(
            epochs in prop::collection::vec(prop::collection::vec(event(), 0..60), 1..10),
            chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
        ) {
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let owner = StateStore::open(a.path(), "job").unwrap();
            let committed = run_owner_epochs(&owner, &epochs, chunk_bytes);
            let mut points = RestorePoints::default();
            for (_, liveness) in &committed {
                let next = points.with_epoch(liveness);
                for &p in liveness.keys() {
                    prop_assert!(next.restore_from(p) >= points.restore_from(p));
                }
                points = next;
            }
            let (log, points) = simulate(&committed);
            let restored = StateStore::open(b.path(), "job").unwrap();
            let chains = replay(&restored, &log, |p| points.restore_from(p));
            let last = Epoch(epochs.len() as u64);
            for (p, chain) in &chains {
                prop_assert_eq!(chain.finish(*p).unwrap(), Some(last));
            }
            prop_assert_eq!(restored.windows().unwrap(), owner.windows().unwrap());
            prop_assert_eq!(restored.seen_entries().unwrap(), owner.seen_entries().unwrap());
            let (restored_meta, owner_meta) = (restored.meta().unwrap(), owner.meta().unwrap());
            prop_assert_eq!(restored_meta.partitions, owner_meta.partitions);
        }
    }

    /// Feeds `replay` the records of `log` from its starts (or, `rewound`, from the start of
    /// the log: a start is a lower bound), as a read of the topic would.
    fn feed(
        replay: &mut crate::replay::Replay<'_>,
        log: &[(PartitionId, Offset, Vec<u8>)],
        rewound: bool,
    ) {
        let starts = replay.starts().clone();
        for (p, offset, bytes) in log {
            if rewound || starts.get(p).is_some_and(|from| offset >= from) {
                replay.apply(*p, *offset, bytes).unwrap();
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// A warm standby that applies the changelog in rounds, each up to the epoch committed
        /// then, ends with exactly the owner's state and the owner's restore points.
        #[test]
        fn catching_up_in_rounds_rebuilds_the_owners_state(
            epochs in prop::collection::vec(prop::collection::vec(event(), 0..50), 2..9),
            chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 1..4),
            rewound in any::<bool>(),
        ) {
            use crate::replay::Replay;
            let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
            let owner = StateStore::open(a.path(), "job").unwrap();
            let committed = run_owner_epochs(&owner, &epochs, chunk_bytes);
            let (log, points) = simulate(&committed);
            let last = epochs.len() as u64;
            let mut rounds: Vec<u64> = cuts.iter().map(|i| 1 + i.index(epochs.len()) as u64).collect();
            rounds.push(last);
            rounds.sort_unstable();
            rounds.dedup();
            let standby = StateStore::open(b.path(), "job").unwrap();
            let size = rules().window.size_ms;
            let partitions = [0, 1, 2];
            for (i, &up_to) in rounds.iter().enumerate() {
                let mut replay = if i == 0 {
                    Replay::whole(&standby, size, Epoch(up_to), partitions.iter().map(|&p| (p, 0)).collect())
                } else {
                    Replay::continuing(&standby, size, Epoch(up_to), &partitions).unwrap()
                };
                feed(&mut replay, &log, rewound && i > 0);
                replay.check_complete().unwrap();
                replay.finish("owner", None).unwrap();
                prop_assert_eq!(standby.meta().unwrap().epoch, Epoch(up_to));
            }
            prop_assert_eq!(standby.windows().unwrap(), owner.windows().unwrap());
            prop_assert_eq!(standby.seen_entries().unwrap(), owner.seen_entries().unwrap());
            prop_assert_eq!(standby.meta().unwrap().partitions, owner.meta().unwrap().partitions);
            prop_assert_eq!(standby.adopted_writer().unwrap(), Some(("owner".to_string(), Epoch(last))));
            let kept = standby.restore_points().unwrap();
            for p in partitions {
                prop_assert_eq!(kept.restore_from(p), points.restore_from(p));
            }
            // Nothing more committed: the next round reads nothing.
            let replay = Replay::continuing(&standby, size, Epoch(last), &partitions).unwrap();
            prop_assert!(replay.is_current());
        }
    }

    #[test]
    fn a_catch_up_refuses_a_gap_an_unfinished_replay_and_pending_epochs() {
        use crate::replay::{NotContinuable, Replay, ReplayError};
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let owner = StateStore::open(a.path(), "job").unwrap();
        let events: Vec<Event> = (0..30).map(|i| (0, i, i % 3, 1_000, false)).collect();
        let committed = run_owner_epochs(&owner, &vec![events; 4], usize::MAX);
        let (log, _) = simulate(&committed);
        let size = rules().window.size_ms;
        let partitions = [0, 1, 2];
        let standby = StateStore::open(b.path(), "job").unwrap();
        let mut replay = Replay::whole(
            &standby,
            size,
            Epoch(2),
            partitions.iter().map(|&p| (p, 0)).collect(),
        );
        feed(&mut replay, &log, false);
        replay.check_complete().unwrap();
        replay.finish("owner", None).unwrap();

        // Epoch 3 missing: epoch 4 does not start where the standby's state ends.
        let mut replay = Replay::continuing(&standby, size, Epoch(4), &partitions).unwrap();
        let epoch_4: Vec<_> = log
            .iter()
            .filter(|(_, _, bytes)| ChangelogRecord::decode(bytes).unwrap().epoch == Epoch(4))
            .collect();
        let (p, offset, bytes) = epoch_4[0];
        let err = replay.apply(*p, *offset, bytes).unwrap_err();
        assert!(err.to_string().contains("does not follow"), "{err}");
        // That replay began applying nothing; one that began and stopped leaves a mark.
        standby.begin_replay().unwrap();
        assert!(matches!(
            Replay::continuing(&standby, size, Epoch(4), &partitions),
            Err(ReplayError::NotContinuable(NotContinuable::Interrupted))
        ));
        // Another set of partitions than the job's.
        let (c, d) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let other = StateStore::open(c.path(), "job").unwrap();
        let mut replay = Replay::whole(
            &other,
            size,
            Epoch(2),
            partitions.iter().map(|&p| (p, 0)).collect(),
        );
        feed(&mut replay, &log, false);
        replay.finish("owner", None).unwrap();
        assert!(matches!(
            Replay::continuing(&other, size, Epoch(4), &[0, 1]),
            Err(ReplayError::NotContinuable(NotContinuable::Diverged(_)))
        ));
        // The owner's own directory with an epoch pre-committed and not committed.
        let fresh = StateStore::open(d.path(), "job").unwrap();
        fresh
            .pre_commit(&tally_core::Checkpoint {
                epoch: Epoch(1),
                ..tally_core::Checkpoint::default()
            })
            .unwrap();
        assert!(matches!(
            Replay::continuing(&fresh, size, Epoch(4), &[]),
            Err(ReplayError::NotContinuable(NotContinuable::Pending))
        ));
    }

    #[test]
    fn restore_points_advance_past_records_whose_windows_closed_and_ids_expired() {
        let dir = tempfile::tempdir().unwrap();
        let owner = StateStore::open(dir.path(), "job").unwrap();
        // Five minutes of event time per epoch: far past the 10 s windows and the 30 s horizon.
        let epochs: Vec<Vec<Event>> = (0..6)
            .map(|e| {
                (0..30)
                    .map(|i| (0, e * 30 + i, i % 3, 10_000, false))
                    .collect()
            })
            .collect();
        let committed = run_owner_epochs(&owner, &epochs, usize::MAX);
        let (_, points) = simulate(&committed);
        // Each epoch is one record and a marker: the restore point is the newest epoch's.
        assert_eq!(points.restore_from(0), 10);
    }

    #[test]
    fn a_gap_a_missing_start_or_another_format_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let owner = StateStore::open(dir.path(), "job").unwrap();
        let events: Vec<Event> = (0..30).map(|i| (0, i, i % 3, 1_000, false)).collect();
        let log = run_owner(
            &owner,
            &[events.clone(), events.clone(), events],
            usize::MAX,
        );
        let records: Vec<ChangelogRecord> = log
            .iter()
            .map(|b| ChangelogRecord::decode(b).unwrap())
            .filter(|r| r.partition == 0)
            .collect();
        // Small epochs: one record each.
        assert_eq!(records.len(), 3);
        // Epoch 2 missing.
        let mut chain = ChainCheck::default();
        chain.accept(&records[0]).unwrap();
        let err = chain.accept(&records[2]).unwrap_err();
        assert!(err.to_string().contains("does not follow"), "{err}");
        // Starting after the partition's first epoch.
        let err = ChainCheck::default().accept(&records[1]).unwrap_err();
        assert!(
            err.to_string().contains("not the partition's first"),
            "{err}"
        );
        let mut bytes = log[0].clone();
        bytes[0] = 9;
        assert!(matches!(
            ChangelogRecord::decode(&bytes),
            Err(ChangelogError::UnknownFormat { found: 9 })
        ));
        assert!(ChangelogRecord::decode(&[]).is_err());
    }

    /// Format 1, written by the releases before group keys, reads as the same record.
    #[test]
    fn records_of_the_releases_before_group_keys_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let owner = StateStore::open(dir.path(), "job").unwrap();
        let events: Vec<Event> = (0..12).map(|i| (0, i, i % 3, 1_000, false)).collect();
        let log = run_owner(&owner, &[events], usize::MAX);
        let record = ChangelogRecord::decode(&log[0]).unwrap();
        assert!(record.windows.len() >= 3 && !record.seen.is_empty());
        let keys: Vec<_> = record
            .windows
            .iter()
            .map(|(k, v)| {
                let key = crate::legacy::WindowKeyV1 {
                    window_start_ms: k.window_start_ms,
                    customer_id: k.customer_id().into(),
                    currency: k.currency().into(),
                };
                (key, *v)
            })
            .collect();
        let windows: Vec<_> = keys.iter().map(|(k, v)| (k, v)).collect();
        let seen: Vec<_> = record
            .seen
            .iter()
            .map(|(id, t)| (id.as_str(), *t))
            .collect();
        let v1 = RecordRef {
            format: CHANGELOG_FORMAT_V1,
            epoch: record.epoch,
            partition: record.partition,
            chunk: record.chunk,
            chunks: record.chunks,
            progress: &record.progress,
            close_windows_before: record.close_windows_before,
            expire_seen_before: record.expire_seen_before,
            windows: &windows,
            seen: &seen,
        };
        let bytes = bincode::serde::encode_to_vec(&v1, config()).unwrap();
        let read = ChangelogRecord::decode(&bytes).unwrap();
        assert_eq!(read.format, CHANGELOG_FORMAT_V1);
        assert_eq!(
            ChangelogRecord {
                format: CHANGELOG_FORMAT,
                ..read
            },
            record
        );
    }

    #[test]
    fn large_epochs_are_split_into_chunks_that_chain() {
        let dir = tempfile::tempdir().unwrap();
        let owner = StateStore::open(dir.path(), "job").unwrap();
        let events: Vec<Event> = (0..40).map(|i| (1, i, i % 6, 10, false)).collect();
        let log = run_owner(&owner, &[events], 200);
        let records: Vec<ChangelogRecord> = log
            .iter()
            .map(|b| ChangelogRecord::decode(b).unwrap())
            .filter(|r| r.partition == 1)
            .collect();
        assert!(records.len() > 2, "{} chunks", records.len());
        let mut chain = ChainCheck::default();
        for r in &records {
            assert_eq!(r.chunks as usize, records.len());
            chain.accept(r).unwrap();
        }
        assert_eq!(chain.finish(1).unwrap(), Some(Epoch(1)));
        let ids: usize = records.iter().map(|r| r.seen.len()).sum();
        assert_eq!(ids, 40);
        // Cut short, the epoch is incomplete.
        let mut chain = ChainCheck::default();
        chain.accept(&records[0]).unwrap();
        assert!(chain.finish(1).is_err());
    }
}
