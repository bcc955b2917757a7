//! The window operator: decode (revenue_agg's built-in decoder, or a declared job's evaluate,
//! which may filter the record out) → watermark → dedup → lateness → window aggregate.
//!
//! The operator keeps only the current epoch's changes in memory and reads everything older
//! through [`StateReader`]. At a [`CheckpointBarrier`] it hands out one [`Checkpoint`]: the state
//! changes, the next offset of every partition, the accounting and the epoch's outputs, to be
//! made durable in one atomic write. Every decision is a function of each partition's record
//! sequence alone, so where barriers fall never changes the final results.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use compact_str::CompactString;
use serde::{Deserialize, Serialize};

use crate::declare::{
    DeclarationError, DeclaredEvent, Evaluation, FieldMapping, Job, Position, Schemas, WindowRules,
};
use crate::decode::{Poison, PoisonReason};
use crate::seen_filter::{self, SeenIdFilter};
use crate::source_row::SourceRow;
use crate::types::{
    Accounting, CheckpointBarrier, DeadLetter, Epoch, Offset, OutputRow, PartitionId, WindowKey,
};
use crate::window::{Watermark, WindowSpec};
use crate::window_agg::WindowAgg;

/// The maps every record touches: a fast hash, seeded per process.
type FastMap<K, V> = HashMap<K, V, foldhash::quality::RandomState>;

/// Heap bytes of a changed id or window besides its strings: the map entry, its share of the
/// table and the allocator's overhead (an estimate: peak RSS in BENCHMARKS.md is the check).
/// The strings' lengths are added although short ones live inline: they are bytes again in
/// the epoch's rows, changelog and write batch.
const SEEN_ENTRY_BYTES: usize = 72;
/// A window's value is 24 bytes more than the two plain numbers it was (`window_agg.rs`), its
/// key 8 bytes less (smallvec's `union`).
const WINDOW_ENTRY_BYTES: usize = 160;

/// Estimated heap bytes of a changed window: its entry, its key's text and the words that do
/// not fit inline.
fn window_bytes(key: &WindowKey, value: &WindowAgg) -> usize {
    let spilled = if value.words().len() > 2 {
        std::mem::size_of_val(value.words())
    } else {
        0
    };
    key.key.text_len() + WINDOW_ENTRY_BYTES + spilled
}

/// Event-time rules of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OperatorConfig {
    pub window: WindowSpec,
    pub out_of_orderness_ms: i64,
    pub allowed_lateness_ms: i64,
    pub dedup_horizon_ms: i64,
    /// A new version's `restate_from`: only windows starting then or later are computed (the
    /// earlier ones stay the running version's), and a record of none of them is filtered out.
    pub windows_from_ms: Option<i64>,
}

impl OperatorConfig {
    /// Whether the version computes the window starting at `window_start_ms`.
    fn computes(&self, window_start_ms: i64) -> bool {
        self.windows_from_ms
            .is_none_or(|from| window_start_ms >= from)
    }

    /// Why an event at `event_time_ms` is late at `watermark`, if it is: the newest window
    /// holding it is closed (with hopping windows the older ones close first, and a record still
    /// adds to those that are open).
    fn late(&self, event_time_ms: i64, watermark: i64) -> Option<Poison> {
        let window_end = self.window.end_of(event_time_ms);
        if window_end.saturating_add(self.allowed_lateness_ms) > watermark {
            return None;
        }
        Some(Poison {
            reason: PoisonReason::Late,
            message: format!(
                "event time {} is in window ending {}, closed at watermark {} (allowed lateness {} ms)",
                crate::time::format_ms(event_time_ms),
                crate::time::format_ms(window_end),
                crate::time::format_ms(watermark),
                self.allowed_lateness_ms
            ),
        })
    }

    /// A window is closed once its end plus the allowed lateness is at or below the watermark:
    /// its records are late, and the next checkpoint takes it out of the state.
    fn window_closed(&self, window_start_ms: i64, watermark: i64) -> bool {
        window_start_ms
            .saturating_add(self.window.size_ms)
            .saturating_add(self.allowed_lateness_ms)
            <= watermark
    }
}

/// One consumed Kafka record, borrowed from the consumer.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    pub partition: PartitionId,
    pub offset: Offset,
    pub timestamp_ms: Option<i64>,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
}

/// What the operator reads records as: a declared job (revenue_agg's is
/// [`crate::declare::revenue_agg`]).
#[derive(Debug, Clone)]
pub struct Program {
    pub job: Arc<Job>,
    pub max_record_bytes: usize,
    /// A job reading Avro or Protobuf takes its writer schemas from here.
    pub schemas: Option<Arc<dyn Schemas>>,
}

impl Program {
    /// A declared job of JSON events or changes (no schema registry).
    pub fn declared(job: Arc<Job>, max_record_bytes: usize) -> Program {
        Program {
            job,
            max_record_bytes,
            schemas: None,
        }
    }

    /// revenue_agg, its fields read from the keys `fields` names, in windows of `rules`.
    pub fn revenue_agg(
        fields: &FieldMapping,
        rules: &OperatorConfig,
        max_record_bytes: usize,
    ) -> Result<Program, DeclarationError> {
        let w = rules.window;
        let job = crate::declare::revenue_agg(fields).resolve(WindowRules {
            size_ms: w.size_ms,
            slide_ms: (w.slide_ms != w.size_ms).then_some(w.slide_ms),
            allowed_lateness_ms: rules.allowed_lateness_ms,
            dedup_horizon_ms: rules.dedup_horizon_ms,
        })?;
        Ok(Program::declared(Arc::new(job), max_record_bytes))
    }
}

/// What happened to a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Aggregated,
    Duplicate,
    /// Valid, and left out by the declaration's filter.
    Filtered,
    DeadLettered(PoisonReason),
    /// Below the partition's next offset: already processed before the last checkpoint.
    AlreadyProcessed,
    /// A change older than the one applied to its row.
    Stale,
    /// A record without a value.
    Tombstone,
    /// A change job's table was truncated: the record is not processed (its offset stays the
    /// partition's next), and the job must stop (its rows are held in every partition).
    Truncated,
}

/// Durable, checkpointed state the operator reads but never writes directly.
pub trait StateReader {
    type Error: std::error::Error + Send + Sync + 'static;
    fn window(
        &self,
        partition: PartitionId,
        key: &WindowKey,
    ) -> Result<Option<WindowAgg>, Self::Error>;
    /// Event time recorded for an event id already aggregated in this partition, if any.
    fn seen_event_time(
        &self,
        partition: PartitionId,
        event_id: &str,
    ) -> Result<Option<i64>, Self::Error>;
    /// A change job's row of this partition by primary key, if it has one.
    fn source_row(
        &self,
        partition: PartitionId,
        key: &str,
    ) -> Result<Option<SourceRow>, Self::Error>;
}

/// Progress of one partition as recorded in a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PartitionCheckpoint {
    /// First offset of the epoch: the next offset at the previous checkpoint.
    pub epoch_start_offset: Offset,
    /// Next offset to consume after this checkpoint.
    pub next_offset: Offset,
    pub watermark: Watermark,
    /// Accounting of this epoch only.
    pub epoch: Accounting,
    /// Accounting since the job started.
    pub totals: Accounting,
    /// A change job's newest source position read in this partition (any change, applied or
    /// not): how far into the source's log the partition's checkpoint reaches.
    pub newest_change: Option<Position>,
}

/// Everything one barrier produces: state changes, offsets, accounting and outputs.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Checkpoint {
    pub epoch: Epoch,
    pub partitions: BTreeMap<PartitionId, PartitionCheckpoint>,
    /// Full current values of the windows changed in this epoch; also the sink batch.
    pub rows: Vec<OutputRow>,
    /// Event ids aggregated in this epoch with their event times.
    pub seen: Vec<(PartitionId, String, i64)>,
    pub dead_letters: Vec<DeadLetter>,
    /// Windows starting before the cutoff can no longer change and leave the state.
    pub close_windows_before: Vec<(PartitionId, i64)>,
    /// Dedup entries with event time before the cutoff are past the horizon.
    pub expire_seen_before: Vec<(PartitionId, i64)>,
    /// A change job's rows changed in this epoch, by primary key (like `seen`, state only:
    /// sinks never need them).
    pub source_rows: Vec<(PartitionId, String, SourceRow)>,
}

impl Checkpoint {
    pub fn accounting(&self) -> Accounting {
        let mut sum = Accounting::default();
        for p in self.partitions.values() {
            sum.add(&p.epoch);
        }
        sum
    }
}

#[derive(Debug, Clone, Copy)]
struct PartitionState {
    epoch_start_offset: Offset,
    next_offset: Offset,
    watermark: Watermark,
    epoch: Accounting,
    totals: Accounting,
    newest_change: Option<Position>,
}

pub struct WindowOperator {
    config: OperatorConfig,
    program: Program,
    epoch: Epoch,
    partitions: BTreeMap<PartitionId, PartitionState>,
    /// Per partition, so that a lookup by `&WindowKey` needs no owned key.
    dirty_windows: FastMap<PartitionId, FastMap<WindowKey, WindowAgg>>,
    dirty_seen: FastMap<PartitionId, FastMap<CompactString, i64>>,
    dirty_rows: FastMap<PartitionId, FastMap<CompactString, SourceRow>>,
    dead_letters: Vec<DeadLetter>,
    dead_letter_bytes: usize,
    /// Estimated heap bytes of the epoch's changed windows and ids.
    state_bytes: usize,
    /// Per partition, the ids of its dedup set: a new id skips the store lookup.
    seen_filters: FastMap<PartitionId, PartitionFilter>,
    seen_filter_capacity: usize,
}

/// A partition's id filter. Until it is `complete` (it holds every id the store holds, which
/// for a restored partition takes a scan of the store) every lookup still goes to the store.
#[derive(Debug)]
struct PartitionFilter {
    ids: SeenIdFilter,
    complete: bool,
}

impl WindowOperator {
    /// Resumes after checkpoint `last_epoch` with its partition progress.
    pub fn restore(
        config: OperatorConfig,
        program: impl Into<Program>,
        last_epoch: Epoch,
        partitions: &BTreeMap<PartitionId, PartitionCheckpoint>,
    ) -> WindowOperator {
        let partitions: BTreeMap<PartitionId, PartitionState> = partitions
            .iter()
            .map(|(&p, c)| {
                (
                    p,
                    PartitionState {
                        epoch_start_offset: c.next_offset,
                        next_offset: c.next_offset,
                        watermark: c.watermark,
                        epoch: Accounting::default(),
                        totals: c.totals,
                        newest_change: c.newest_change,
                    },
                )
            })
            .collect();
        let capacity = seen_filter::DEFAULT_FIRST_CAPACITY;
        let seen_filters = partitions
            .keys()
            .map(|&p| {
                let ids = SeenIdFilter::new(config.dedup_horizon_ms, capacity);
                (
                    p,
                    PartitionFilter {
                        ids,
                        complete: false,
                    },
                )
            })
            .collect();
        WindowOperator {
            config,
            program: program.into(),
            epoch: last_epoch.next(),
            partitions,
            dirty_windows: FastMap::default(),
            dirty_seen: FastMap::default(),
            dirty_rows: FastMap::default(),
            dead_letters: Vec::new(),
            dead_letter_bytes: 0,
            state_bytes: 0,
            seen_filters,
            seen_filter_capacity: capacity,
        }
    }

    /// Sizes the first id-filter generation of the partitions that have no ids yet (tests use
    /// tiny filters, which give many false positives).
    pub fn with_seen_filter_capacity(mut self, ids: usize) -> WindowOperator {
        self.seen_filter_capacity = ids;
        for filter in self.seen_filters.values_mut() {
            if filter.ids.is_empty() {
                filter.ids = SeenIdFilter::new(self.config.dedup_horizon_ms, ids);
            }
        }
        self
    }

    /// Adds a partition that has no checkpoint yet, starting at `offset`.
    pub fn add_partition(&mut self, partition: PartitionId, offset: Offset) {
        self.partitions.entry(partition).or_insert(PartitionState {
            epoch_start_offset: offset,
            next_offset: offset,
            watermark: Watermark::default(),
            epoch: Accounting::default(),
            totals: Accounting::default(),
            newest_change: None,
        });
        self.new_filter(partition);
    }

    /// Adds a partition that joins a running job (added to its topic), starting at `offset`
    /// with its watermark at `watermark_ms`: its events in windows that close at that watermark
    /// are late, as they would be on the job's other partitions, which may have folded them.
    pub fn add_joining_partition(
        &mut self,
        partition: PartitionId,
        offset: Offset,
        watermark_ms: i64,
    ) {
        self.add_partition(partition, offset);
        if let Some(state) = self.partitions.get_mut(&partition)
            && state.watermark.max_event_time_ms.is_none()
        {
            state
                .watermark
                .observe(watermark_ms.saturating_add(self.config.out_of_orderness_ms));
        }
    }

    /// A partition with no checkpoint has nothing in the store: its filter is complete at once.
    fn new_filter(&mut self, partition: PartitionId) {
        let ids = SeenIdFilter::new(self.config.dedup_horizon_ms, self.seen_filter_capacity);
        self.seen_filters
            .entry(partition)
            .or_insert(PartitionFilter {
                ids,
                complete: true,
            });
    }

    /// Partitions whose id filter still waits for the ids the store held at restore.
    pub fn partitions_awaiting_seen_filter(&self) -> Vec<PartitionId> {
        let mut waiting: Vec<PartitionId> = self
            .seen_filters
            .iter()
            .filter(|(_, f)| !f.complete)
            .map(|(&p, _)| p)
            .collect();
        waiting.sort_unstable();
        waiting
    }

    /// Takes over a filter built from every id the store held for `partition` (at or after
    /// restore): from now on an id the filter does not know skips the store.
    pub fn adopt_seen_filter(&mut self, partition: PartitionId, restored: SeenIdFilter) {
        match self.seen_filters.get_mut(&partition) {
            Some(filter) => {
                filter.ids.absorb(restored);
                filter.complete = true;
            }
            None => {
                self.seen_filters.insert(
                    partition,
                    PartitionFilter {
                        ids: restored,
                        complete: true,
                    },
                );
            }
        }
    }

    /// Bytes held by the id filters.
    pub fn seen_filter_bytes(&self) -> usize {
        self.seen_filters.values().map(|f| f.ids.bytes()).sum()
    }

    /// The epoch the records being processed now belong to.
    pub fn current_epoch(&self) -> Epoch {
        self.epoch
    }

    pub fn next_offsets(&self) -> BTreeMap<PartitionId, Offset> {
        self.partitions
            .iter()
            .map(|(&p, s)| (p, s.next_offset))
            .collect()
    }

    /// Records processed since the last barrier (for size-triggered checkpoints).
    pub fn pending_records(&self) -> u64 {
        self.partitions.values().map(|s| s.epoch.consumed).sum()
    }

    /// Bytes of dead letters held since the last barrier: poison records can be large.
    pub fn pending_dead_letter_bytes(&self) -> usize {
        self.dead_letter_bytes
    }

    /// Estimated heap bytes of the windows and ids changed since the last barrier: each epoch
    /// in flight holds about twice this until it is committed.
    pub fn pending_state_bytes(&self) -> usize {
        self.state_bytes
    }

    pub fn process<S: StateReader>(
        &mut self,
        store: &S,
        record: Record<'_>,
    ) -> Result<Outcome, S::Error> {
        let cfg = self.config;
        if !self.partitions.contains_key(&record.partition) {
            self.add_partition(record.partition, record.offset);
        }
        let Some(state) = self.partitions.get_mut(&record.partition) else {
            return Ok(Outcome::AlreadyProcessed);
        };
        if record.offset < state.next_offset {
            return Ok(Outcome::AlreadyProcessed);
        }
        state.next_offset = record.offset + 1;
        state.epoch.consumed += 1;
        state.totals.consumed += 1;

        let program = &self.program;
        if program.job.changes.is_some() {
            let job = Arc::clone(&program.job);
            let max_record_bytes = program.max_record_bytes;
            return self.process_change(store, record, &job, max_record_bytes);
        }
        // The job is borrowed, not cloned, on this path: an Arc's two atomic operations per
        // record showed in the profile.
        let read = program.job.read(
            record.value,
            program.max_record_bytes,
            program.schemas.as_deref(),
        );
        let event = match read {
            Ok(Evaluation::Event(event)) => event,
            Ok(Evaluation::Filtered) => {
                state.epoch.filtered += 1;
                state.totals.filtered += 1;
                return Ok(Outcome::Filtered);
            }
            // Late before a missing field; a record it names does not move the watermark.
            Ok(Evaluation::Incomplete {
                event_time_ms,
                poison,
            }) => {
                let watermark = state
                    .watermark
                    .current(cfg.out_of_orderness_ms)
                    .unwrap_or(i64::MIN);
                let poison = cfg.late(event_time_ms, watermark).unwrap_or(poison);
                return Ok(self.dead_letter(record, poison));
            }
            Err(poison) => return Ok(self.dead_letter(record, poison)),
        };
        state.watermark.observe(event.event_time_ms);
        let watermark = state
            .watermark
            .current(cfg.out_of_orderness_ms)
            .unwrap_or(i64::MIN);
        // Its newest window is before the restatement: so is every other.
        if !cfg.computes(cfg.window.start_of(event.event_time_ms)) {
            state.epoch.filtered += 1;
            state.totals.filtered += 1;
            return Ok(Outcome::Filtered);
        }

        let id_hash = seen_filter::id_hash(event.event_id.as_bytes());
        if let Some(seen_at) =
            self.seen_event_time(store, record.partition, &event.event_id, id_hash)?
            && seen_at.saturating_add(cfg.dedup_horizon_ms) > watermark
        {
            self.count(record.partition, |a| a.duplicates += 1);
            return Ok(Outcome::Duplicate);
        }

        if let Some(late) = cfg.late(event.event_time_ms, watermark) {
            return Ok(self.dead_letter(record, late));
        }
        self.aggregate(store, record, event, id_hash, watermark)
    }

    /// Adds an event to each of its windows the watermark has not closed (all or none: an
    /// overflow in one leaves every window as it was and dead-letters the record).
    fn aggregate<S: StateReader>(
        &mut self,
        store: &S,
        record: Record<'_>,
        event: DeclaredEvent,
        id_hash: u64,
        watermark: i64,
    ) -> Result<Outcome, S::Error> {
        let cfg = self.config;
        let DeclaredEvent {
            event_id,
            event_time_ms,
            key,
            inputs,
        } = event;
        let job = &self.program.job;
        let group = group_key(job, key);
        let units = job.counted_units(&inputs);
        let windows = self.dirty_windows.entry(record.partition).or_default();
        let added = if cfg.window.slide_ms == cfg.window.size_ms {
            // One window, open (the record is not late): looked up once and added to in place.
            let key = WindowKey {
                window_start_ms: cfg.window.start_of(event_time_ms),
                key: group,
            };
            add_to_window(windows, store, record.partition, key, job, &inputs)?
        } else {
            // Closed windows left the state at a checkpoint (and may be folded).
            let open = cfg
                .window
                .starts_of(event_time_ms)
                .filter(|&start| cfg.computes(start) && !cfg.window_closed(start, watermark));
            add_to_windows(
                windows,
                store,
                record.partition,
                (group, open),
                job,
                &inputs,
            )?
        };
        let added_bytes = match added {
            Ok(bytes) => bytes,
            Err((start, overflow)) => {
                let message = format!(
                    "adding the record to the window starting {} would leave the range of column {}",
                    crate::time::format_ms(start),
                    overflow.column
                );
                return Ok(self.dead_letter(
                    record,
                    Poison {
                        reason: PoisonReason::TooLarge,
                        message,
                    },
                ));
            }
        };
        self.state_bytes += added_bytes;
        self.remember(record.partition, event_id, event_time_ms, id_hash);
        self.count(record.partition, |a| {
            a.aggregated += 1;
            a.revenue_units += units;
        });
        Ok(Outcome::Aggregated)
    }

    /// Records an aggregated event's id for dedup.
    fn remember(
        &mut self,
        partition: PartitionId,
        event_id: CompactString,
        event_time_ms: i64,
        id_hash: u64,
    ) {
        if let Some(filter) = self.seen_filters.get_mut(&partition) {
            filter.ids.insert(id_hash, event_time_ms);
        }
        let id_bytes = event_id.len() + SEEN_ENTRY_BYTES;
        if self
            .dirty_seen
            .entry(partition)
            .or_default()
            .insert(event_id, event_time_ms)
            .is_none()
        {
            self.state_bytes += id_bytes;
        }
    }

    fn seen_event_time<S: StateReader>(
        &self,
        store: &S,
        partition: PartitionId,
        event_id: &str,
        id_hash: u64,
    ) -> Result<Option<i64>, S::Error> {
        if let Some(t) = self
            .dirty_seen
            .get(&partition)
            .and_then(|ids| ids.get(event_id))
        {
            return Ok(Some(*t));
        }
        // Every id in the cuts in flight and the store went through the filter (or the scan
        // that completed it).
        if self
            .seen_filters
            .get(&partition)
            .is_some_and(|f| f.complete && !f.ids.maybe_contains(id_hash))
        {
            return Ok(None);
        }
        store.seen_event_time(partition, event_id)
    }

    fn count(&mut self, partition: PartitionId, f: impl Fn(&mut Accounting)) {
        if let Some(state) = self.partitions.get_mut(&partition) {
            f(&mut state.epoch);
            f(&mut state.totals);
        }
    }

    fn dead_letter(&mut self, record: Record<'_>, poison: Poison) -> Outcome {
        let reason = poison.reason;
        self.count(record.partition, |a| {
            if reason == PoisonReason::Late {
                a.late += 1;
            } else {
                a.dead_lettered += 1;
            }
        });
        self.dead_letter_bytes += record.key.map_or(0, <[u8]>::len)
            + record.value.map_or(0, <[u8]>::len)
            + poison.message.len();
        self.dead_letters.push(DeadLetter {
            partition: record.partition,
            offset: record.offset,
            timestamp_ms: record.timestamp_ms,
            key: record.key.map(<[u8]>::to_vec),
            value: record.value.map(<[u8]>::to_vec),
            reason,
            error: poison.message,
        });
        Outcome::DeadLettered(reason)
    }

    /// Ends the current epoch: drains its changes into a [`Checkpoint`] and starts the next one.
    pub fn handle_checkpoint(&mut self, barrier: CheckpointBarrier) -> Checkpoint {
        self.cut(barrier).to_checkpoint()
    }

    /// Ends the current epoch without sorting or copying anything: the changes move into an
    /// [`EpochCut`] as they are, so the barrier costs the same however large the epoch. Until
    /// the cut is durable the operator reads through it ([`WithInFlight`]).
    pub fn cut(&mut self, barrier: CheckpointBarrier) -> EpochCut {
        debug_assert_eq!(barrier.epoch, self.epoch);
        let cfg = self.config;
        let mut cut = EpochCut {
            epoch: self.epoch,
            window_size_ms: cfg.window.size_ms,
            windows: std::mem::take(&mut self.dirty_windows),
            seen: std::mem::take(&mut self.dirty_seen),
            rows: std::mem::take(&mut self.dirty_rows),
            dead_letters: std::mem::take(&mut self.dead_letters),
            partitions: BTreeMap::new(),
            close_windows_before: Vec::new(),
            expire_seen_before: Vec::new(),
        };
        self.dead_letter_bytes = 0;
        self.state_bytes = 0;
        // The next epoch of a partition usually changes as many keys as this one: sized so,
        // its maps do not rehash on the hot path as they grow.
        for (&p, windows) in &cut.windows {
            self.dirty_windows.insert(
                p,
                FastMap::with_capacity_and_hasher(windows.len(), Default::default()),
            );
        }
        for (&p, ids) in &cut.seen {
            self.dirty_seen.insert(
                p,
                FastMap::with_capacity_and_hasher(ids.len(), Default::default()),
            );
        }
        for (&p, rows) in &cut.rows {
            self.dirty_rows.insert(
                p,
                FastMap::with_capacity_and_hasher(rows.len(), Default::default()),
            );
        }
        for (&p, state) in &mut self.partitions {
            cut.partitions.insert(
                p,
                PartitionCheckpoint {
                    epoch_start_offset: state.epoch_start_offset,
                    next_offset: state.next_offset,
                    watermark: state.watermark,
                    epoch: state.epoch,
                    totals: state.totals,
                    newest_change: state.newest_change,
                },
            );
            if let Some(wm) = state.watermark.current(cfg.out_of_orderness_ms) {
                // A window is closed once end + lateness <= watermark; same predicate as `late`.
                let close = wm
                    .saturating_sub(cfg.window.size_ms + cfg.allowed_lateness_ms)
                    .saturating_add(1);
                cut.close_windows_before.push((p, close));
                let expire = wm.saturating_sub(cfg.dedup_horizon_ms).saturating_add(1);
                cut.expire_seen_before.push((p, expire));
                if let Some(filter) = self.seen_filters.get_mut(&p) {
                    filter.ids.expire(wm);
                }
            }
            state.epoch_start_offset = state.next_offset;
            state.epoch = Accounting::default();
        }
        self.epoch = self.epoch.next();
        cut
    }
}

mod change;
mod cut;
mod windows;

use windows::{add_to_window, add_to_windows, group_key};

pub use cut::{EpochCut, WithInFlight};

#[cfg(test)]
mod change_tests;
#[cfg(test)]
mod declared_tests;
#[cfg(test)]
mod tests;
