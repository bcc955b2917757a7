//! The changelog: each epoch's state changes, one record per source partition (split in chunks
//! when large), written to a Kafka topic in the epoch's transaction. Replaying a partition's
//! records in order through the store rebuilds exactly the state its worker committed, on a
//! machine that never held it.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use tally_core::{
    Checkpoint, Epoch, EpochCut, Offset, OutputRow, PartitionCheckpoint, PartitionId, SourceRow,
    WindowAgg, WindowKey,
};

/// Version of the record layout this build writes; a reader refuses any but this and
/// [`CHANGELOG_FORMAT_V4`] to [`CHANGELOG_FORMAT_V1`].
/// 5: a change job's rows (by primary key), and a partition's accounting counts stale changes
/// and tombstones and keeps its newest source position.
/// 4: a partition's accounting counts filtered records.
/// 3: a window's value is its tagged words (any shape), not (orders, revenue).
/// 2: a window's group key is its parts (any number), not (customer, currency).
pub const CHANGELOG_FORMAT: u8 = 5;
/// Written by the releases before change jobs: read without rows.
pub const CHANGELOG_FORMAT_V4: u8 = 4;
/// Written by the releases before filters: read with a filtered count of 0.
pub const CHANGELOG_FORMAT_V3: u8 = 3;
/// Written by the releases before values of any shape: read as revenue_agg's (orders, revenue).
pub const CHANGELOG_FORMAT_V2: u8 = 2;
/// Written by the releases before group keys: read as revenue_agg's (customer, currency) and
/// (orders, revenue).
pub const CHANGELOG_FORMAT_V1: u8 = 1;
/// Estimated bytes of windows and ids per record at most: records stay well below the
/// producer's and the topic's message limit (16 MiB), however large an epoch.
const CHUNK_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ChangelogError {
    #[error("changelog record: {0}")]
    Undecodable(String),
    #[error(
        "changelog record: format {found} is not supported (this build reads {CHANGELOG_FORMAT_V1} to {CHANGELOG_FORMAT}); a newer release wrote it: run that release"
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

/// A change job's rows in a record: by primary key.
pub type Rows = Vec<(String, SourceRow)>;

/// One partition's part of one epoch (or a chunk of it): what the store applies for the
/// partition at that checkpoint. `K`, `V`, `P` and `R`: the window key, value, progress and
/// rows of the record's format, a [`WindowKey`], [`WindowAgg`], [`PartitionCheckpoint`] and
/// [`Rows`] once read (earlier formats' are brought forward by [`ChangelogRecord::decode`];
/// formats before rows read `()`, which is no bytes).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ChangelogRecord<K = WindowKey, V = WindowAgg, P = PartitionCheckpoint, R = Rows> {
    format: u8,
    pub epoch: Epoch,
    pub partition: PartitionId,
    /// Chunk `chunk` of `chunks`; every chunk carries the progress and cutoffs.
    pub chunk: u32,
    pub chunks: u32,
    pub progress: P,
    pub close_windows_before: Option<i64>,
    pub expire_seen_before: Option<i64>,
    /// Full current values of the windows changed in this epoch.
    pub windows: Vec<(K, V)>,
    /// Event ids aggregated in this epoch, with their event times.
    pub seen: Vec<(String, i64)>,
    /// A change job's rows changed in this epoch.
    pub rows: R,
}

/// Rows as a format holds them: none before format 5.
pub trait FormatRows {
    fn into_rows(self) -> Rows;
}

impl FormatRows for Rows {
    fn into_rows(self) -> Rows {
        self
    }
}

impl FormatRows for () {
    fn into_rows(self) -> Rows {
        Vec::new()
    }
}

impl<K: Into<WindowKey>, V: Into<WindowAgg>, P: Into<PartitionCheckpoint>, R: FormatRows>
    ChangelogRecord<K, V, P, R>
{
    /// The record with its format's keys, values and progress brought forward (its `format`
    /// kept).
    fn brought_forward(self) -> ChangelogRecord {
        let r = self;
        ChangelogRecord {
            windows: r
                .windows
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            format: r.format,
            epoch: r.epoch,
            partition: r.partition,
            chunk: r.chunk,
            chunks: r.chunks,
            progress: r.progress.into(),
            close_windows_before: r.close_windows_before,
            expire_seen_before: r.expire_seen_before,
            seen: r.seen,
            rows: r.rows.into_rows(),
        }
    }
}

/// Encodes as [`ChangelogRecord`] decodes, borrowing from the cut (`K`, `V`, `P` and `R`: the
/// format's window key, value, progress and rows, the current ones but in tests).
#[derive(Serialize)]
struct RecordRef<
    'a,
    K = WindowKey,
    V = WindowAgg,
    P = PartitionCheckpoint,
    R = &'a [(&'a str, &'a SourceRow)],
> {
    format: u8,
    epoch: Epoch,
    partition: PartitionId,
    chunk: u32,
    chunks: u32,
    progress: &'a P,
    close_windows_before: Option<i64>,
    expire_seen_before: Option<i64>,
    windows: &'a [(&'a K, &'a V)],
    seen: &'a [(&'a str, i64)],
    rows: R,
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
        let rows: Vec<_> = cut.source_rows_of(partition).collect();
        let (close_windows_before, expire_seen_before) = cut.cutoffs_of(partition);
        let window_size =
            |(k, _): &(&WindowKey, &WindowAgg)| k.key.text_len() + 5 * k.key.parts().len() + 30;
        let id_size = |(id, _): &(&str, i64)| id.len() + 10;
        let row_size = |(key, row): &(&str, &SourceRow)| key.len() + row.bytes();
        // A chunk: windows, ids and rows, and its estimated bytes. Each kind's runs go into
        // the last chunk while it has none of that kind and they fit.
        let mut parts: Vec<(&[_], &[_], &[_], usize)> = chunks(&windows, chunk_bytes, window_size)
            .into_iter()
            .map(|w| (w, &[][..], &[][..], w.iter().map(window_size).sum()))
            .collect();
        for ids in chunks(&seen, chunk_bytes, id_size) {
            let bytes = ids.iter().map(id_size).sum::<usize>();
            match parts.last_mut() {
                Some((_, s, _, used)) if s.is_empty() && *used + bytes <= chunk_bytes => {
                    *s = ids;
                    *used += bytes;
                }
                _ => parts.push((&[][..], ids, &[][..], bytes)),
            }
        }
        for run in chunks(&rows, chunk_bytes, row_size) {
            let bytes = run.iter().map(row_size).sum::<usize>();
            match parts.last_mut() {
                Some((_, _, r, used)) if r.is_empty() && *used + bytes <= chunk_bytes => {
                    *r = run;
                    *used += bytes;
                }
                _ => parts.push((&[][..], &[][..], run, bytes)),
            }
        }
        // An epoch without changes still gets its one record: it carries the progress.
        if parts.is_empty() {
            parts.push((&[][..], &[][..], &[][..], 0));
        }
        let total = parts.len() as u32;
        for (chunk, (windows, seen, rows, _)) in parts.into_iter().enumerate() {
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
                rows,
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
        use crate::old_formats::{
            PartitionCheckpointV1, PartitionCheckpointV2, WindowAggV2, WindowKeyV1,
        };
        let decoded = match bytes.first() {
            Some(&CHANGELOG_FORMAT) => bincode::serde::decode_from_slice(bytes, config()),
            Some(&CHANGELOG_FORMAT_V4) => bincode::serde::decode_from_slice::<
                ChangelogRecord<WindowKey, WindowAgg, PartitionCheckpointV2, ()>,
                _,
            >(bytes, config())
            .map(|(record, read)| (record.brought_forward(), read)),
            Some(&CHANGELOG_FORMAT_V3) => bincode::serde::decode_from_slice::<
                ChangelogRecord<WindowKey, WindowAgg, PartitionCheckpointV1, ()>,
                _,
            >(bytes, config())
            .map(|(record, read)| (record.brought_forward(), read)),
            Some(&CHANGELOG_FORMAT_V2) => bincode::serde::decode_from_slice::<
                ChangelogRecord<WindowKey, WindowAggV2, PartitionCheckpointV1, ()>,
                _,
            >(bytes, config())
            .map(|(record, read)| (record.brought_forward(), read)),
            Some(&CHANGELOG_FORMAT_V1) => bincode::serde::decode_from_slice::<
                ChangelogRecord<WindowKeyV1, WindowAggV2, PartitionCheckpointV1, ()>,
                _,
            >(bytes, config())
            .map(|(record, read)| (record.brought_forward(), read)),
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
            value: value.clone(),
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
            source_rows: self
                .rows
                .iter()
                .map(|(key, row)| (p, key.clone(), row.clone()))
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
    /// A change job's rows: a row stays in the state however old, until a later change of it
    /// (which these records do not track), so records holding rows stay live.
    pub holds_rows: bool,
}

impl Liveness {
    pub fn of_cut(cut: &EpochCut, partition: PartitionId) -> Liveness {
        Liveness {
            max_window_start: cut
                .windows_of(partition)
                .map(|(k, _)| k.window_start_ms)
                .max(),
            max_seen_time: cut.seen_of(partition).map(|(_, t)| t).max(),
            holds_rows: cut.source_rows_of(partition).next().is_some(),
        }
    }

    pub fn of_record(record: &ChangelogRecord) -> Liveness {
        Liveness {
            max_window_start: record.windows.iter().map(|(k, _)| k.window_start_ms).max(),
            max_seen_time: record.seen.iter().map(|(_, t)| *t).max(),
            holds_rows: !record.rows.is_empty(),
        }
    }

    pub fn merge(self, other: Liveness) -> Liveness {
        Liveness {
            max_window_start: self.max_window_start.max(other.max_window_start),
            max_seen_time: self.max_seen_time.max(other.max_seen_time),
            holds_rows: self.holds_rows || other.holds_rows,
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
        !self.holds_rows && gone(self.max_window_start, close) && gone(self.max_seen_time, expire)
    }
}

/// The liveness of a changelog epoch as store formats up to 5 saved it in their restore
/// points: no rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LivenessV1 {
    pub max_window_start: Option<i64>,
    pub max_seen_time: Option<i64>,
}

impl From<LivenessV1> for Liveness {
    fn from(l: LivenessV1) -> Liveness {
        Liveness {
            max_window_start: l.max_window_start,
            max_seen_time: l.max_seen_time,
            holds_rows: false,
        }
    }
}

/// Per source partition, where a restore may start reading the changelog: the offset of the
/// oldest committed epoch whose records still hold live state (the newest epoch's always do:
/// they carry the partition's progress). Every record before it holds only closed windows and
/// expired ids, so a replay from there rebuilds the same state as one from the beginning, and
/// the changelog can be truncated below it. Offsets are lower bounds (an epoch's records start
/// at or after the changelog's end after the previous commit), so a restore point may lag but
/// never skips a live record.
/// `L`: the liveness of the store format that saved the points ([`Liveness`] once read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestorePoints<L = Liveness> {
    partitions: BTreeMap<PartitionId, PartitionPoints<L>>,
}

impl<L> Default for RestorePoints<L> {
    fn default() -> Self {
        RestorePoints {
            partitions: BTreeMap::new(),
        }
    }
}

impl<L: Into<Liveness>> RestorePoints<L> {
    /// The points of an earlier format, brought forward.
    pub(crate) fn brought_forward(self) -> RestorePoints {
        RestorePoints {
            partitions: self
                .partitions
                .into_iter()
                .map(|(p, points)| {
                    let live = points
                        .live
                        .into_iter()
                        .map(|(o, l)| (o, l.into()))
                        .collect();
                    (
                        p,
                        PartitionPoints {
                            next_from: points.next_from,
                            live,
                        },
                    )
                })
                .collect(),
        }
    }
}

impl RestorePoints {
    /// The points as store format 5 saved them (tests write stores of that format).
    #[cfg(test)]
    pub(crate) fn to_v1(&self) -> RestorePoints<LivenessV1> {
        RestorePoints {
            partitions: self
                .partitions
                .iter()
                .map(|(p, points)| {
                    let live = points
                        .live
                        .iter()
                        .map(|(o, l)| {
                            (
                                *o,
                                LivenessV1 {
                                    max_window_start: l.max_window_start,
                                    max_seen_time: l.max_seen_time,
                                },
                            )
                        })
                        .collect();
                    (
                        *p,
                        PartitionPoints {
                            next_from: points.next_from,
                            live,
                        },
                    )
                })
                .collect(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct PartitionPoints<L = Liveness> {
    /// Where the next epoch's records start, at the latest: the changelog's end after the last
    /// commit (0 when unknown: the start of the log).
    next_from: Offset,
    /// Committed epochs that may still hold live state, oldest first: (from offset, liveness).
    live: VecDeque<(Offset, L)>,
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
mod tests;
