//! Consuming: records into the operator, and epochs cut at barriers. The operator only cuts an
//! epoch at a barrier ([`EpochCut`], no copy) and goes on consuming, reading through the cuts
//! not yet pre-committed; at most `job.max_epochs_in_flight` epochs are between barrier and
//! committed, and at the limit a barrier is put off (the epoch grows) or waits (backpressure).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tally_core::seen_filter::{FilterBuilder, id_hash};
use tally_core::{
    CheckpointBarrier, Epoch, EpochCut, PartitionId, SeenIdFilter, WindowOperator, WithInFlight,
};
use tally_kafka::{SourceConsumer, StartFrom};
use tally_state::StateStore;

use crate::events::{BarrierPause, CheckpointCut, LagMeasured, PartitionsAdded};
use crate::health::Readiness;
use crate::partitions::AddedPartitions;
use crate::persist::Handoff;
use crate::read_side::CommitPressure;
use crate::retry::wait_for;
use crate::schemas::SchemaWaits;
use crate::settings::ConsumeSettings;

/// Records, and dead-letter bytes, after which a checkpoint is taken even before the interval
/// ends, bounding the memory an epoch holds (changed windows, dead letters).
const MAX_EPOCH_RECORDS: u64 = 250_000;
const MAX_EPOCH_DEAD_LETTER_BYTES: usize = 64 << 20;
/// Estimated heap of an epoch's changed windows and ids: with many distinct keys (a million
/// customers) an epoch reaches it long before `MAX_EPOCH_RECORDS`, and the epochs in flight
/// hold about twice it each.
const MAX_EPOCH_STATE_BYTES: usize = 8 << 20;
const POLL: Duration = Duration::from_millis(100);

/// What the current epoch holds, against the bounds that cut it.
#[derive(Debug, Clone, Copy)]
struct EpochFill {
    records: u64,
    dead_letter_bytes: usize,
    state_bytes: usize,
}

impl EpochFill {
    fn of(operator: &WindowOperator) -> EpochFill {
        EpochFill {
            records: operator.pending_records(),
            dead_letter_bytes: operator.pending_dead_letter_bytes(),
            state_bytes: operator.pending_state_bytes(),
        }
    }

    /// A bound is reached: the epoch is cut even before the interval ends.
    fn full(&self) -> bool {
        self.records >= MAX_EPOCH_RECORDS
            || self.dead_letter_bytes >= MAX_EPOCH_DEAD_LETTER_BYTES
            || self.state_bytes >= MAX_EPOCH_STATE_BYTES
    }

    /// Below twice the bounds (dead letters: below the bound, they are whole records).
    fn may_grow(&self) -> bool {
        self.records < 2 * MAX_EPOCH_RECORDS
            && self.dead_letter_bytes < MAX_EPOCH_DEAD_LETTER_BYTES
            && self.state_bytes < 2 * MAX_EPOCH_STATE_BYTES
    }
}

/// Why an epoch is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CutReason {
    Stop,
    /// A bound of [`EpochFill::full`]: the input arrives faster than one epoch per interval.
    Full,
    Interval,
    /// The input went quiet after the last epoch filled up: a drained backlog is cut at once,
    /// so its last records reach the sinks now rather than up to an interval later.
    CaughtUp,
}

impl CutReason {
    fn name(self) -> &'static str {
        match self {
            CutReason::Stop => "stop",
            CutReason::Full => "full",
            CutReason::Interval => "interval",
            CutReason::CaughtUp => "caught_up",
        }
    }
}

/// Why the current epoch is cut now, if it is. `quiet`: the last poll found no record;
/// `last_cut`: why the previous epoch was cut.
fn cut_reason(
    fill: EpochFill,
    idle: bool,
    stopping: bool,
    interval_over: bool,
    quiet: bool,
    last_cut: Option<CutReason>,
) -> Option<CutReason> {
    if idle {
        None
    } else if stopping {
        Some(CutReason::Stop)
    } else if fill.full() {
        Some(CutReason::Full)
    } else if interval_over {
        Some(CutReason::Interval)
    } else if quiet && last_cut == Some(CutReason::Full) {
        Some(CutReason::CaughtUp)
    } else {
        None
    }
}

/// Whether a barrier that is due is put off. With the committer `max_in_flight` epochs behind, a
/// barrier would only wait for it (backpressure, the operator not consuming): the operator goes
/// on filling the epoch instead, as Flink skips a checkpoint trigger while the previous ones run,
/// and a larger epoch spreads the commit's fixed cost over more records. Bounded: at twice what
/// cuts an epoch the barrier waits. A stop never waits.
fn defer_barrier(fill: EpochFill, in_flight: usize, max_in_flight: usize, stopping: bool) -> bool {
    !stopping && in_flight >= max_in_flight && fill.may_grow()
}

/// How the consume loop ended.
pub enum Stop {
    /// Nothing was consumed since the last committed checkpoint.
    Idle,
    /// The last epoch cut, committed by the time the threads are joined.
    Final(Epoch),
}

/// The epochs between their barrier and committed, and the cuts of those not yet pre-committed.
/// The operator reads through the cuts; the epochs count against `max_epochs_in_flight`. A
/// pre-committed cut is freed: the store answers for it, and the sinks still to come need only
/// the rows and changelog made from it (its maps are the largest part of an epoch in flight).
#[derive(Default)]
struct InFlight {
    /// Oldest first.
    epochs: VecDeque<Epoch>,
    /// Oldest first.
    unpersisted: VecDeque<Arc<EpochCut>>,
}

impl InFlight {
    fn push(&mut self, cut: Arc<EpochCut>) {
        self.epochs.push_back(cut.epoch);
        self.unpersisted.push_back(cut);
    }

    /// Epochs not yet committed.
    fn len(&self) -> usize {
        self.epochs.len()
    }

    /// The cuts the operator still reads through, oldest first.
    fn readable(&self) -> &VecDeque<Arc<EpochCut>> {
        &self.unpersisted
    }

    /// Takes out the cuts of `epoch` and older: the store answers for them now.
    fn precommitted(&mut self, epoch: Epoch) -> Vec<Arc<EpochCut>> {
        let mut done = Vec::new();
        while let Some(cut) = self.unpersisted.pop_front_if(|c| c.epoch <= epoch) {
            done.push(cut);
        }
        done
    }

    fn committed(&mut self, epoch: Epoch) {
        while self.epochs.pop_front_if(|e| *e <= epoch).is_some() {}
    }
}

/// The operator side: consumes, processes, cuts epochs.
/// The operator's thread: consumes the job's (or task's) partitions and cuts its epochs.
pub struct Consumer {
    settings: ConsumeSettings,
    shutdown: Arc<AtomicBool>,
    store: Arc<StateStore>,
    source: SourceConsumer,
    partitions: Vec<PartitionId>,
    /// Partitions added to the source topic after the job began (registered so).
    added: std::collections::BTreeSet<PartitionId>,
    /// Where an added partition without a checkpoint starts its watermark.
    joining: Option<i64>,
    /// When consumer lag was last measured.
    last_lag: Option<Instant>,
    /// A new version: its progress through the history it rebuilds (made at the first report).
    rebuild: Option<crate::rebuild::Progress>,
    readiness: Arc<Readiness>,
    pressure: Arc<CommitPressure>,
    /// A job of Avro or Protobuf records: partitions waiting for a writer schema.
    waits: Option<SchemaWaits>,
}

impl Consumer {
    #[allow(clippy::too_many_arguments)] // the worker's parts, each used here
    pub fn new(
        settings: ConsumeSettings,
        shutdown: Arc<AtomicBool>,
        store: Arc<StateStore>,
        source: SourceConsumer,
        partitions: Vec<PartitionId>,
        (added, joining): (std::collections::BTreeSet<PartitionId>, Option<i64>),
        readiness: Arc<Readiness>,
        pressure: Arc<CommitPressure>,
    ) -> Consumer {
        let waits = settings.schemas.clone().map(SchemaWaits::new);
        Consumer {
            waits,
            settings,
            shutdown,
            store,
            source,
            partitions,
            added,
            joining,
            last_lag: None,
            rebuild: None,
            readiness,
            pressure,
        }
    }

    pub fn store(&self) -> Arc<StateStore> {
        self.store.clone()
    }

    pub fn shutdown(&self) -> Arc<AtomicBool> {
        self.shutdown.clone()
    }

    /// The partitions this worker runs.
    pub fn partitions(&self) -> Vec<PartitionId> {
        self.partitions.clone()
    }

    /// Assigns the source at the operator's next offsets: the worker is restored.
    pub fn assign(&self, operator: &WindowOperator) -> Result<()> {
        self.source.assign(&operator.next_offsets())?;
        self.readiness.set_restored();
        Ok(())
    }

    fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Consumes and cuts epochs until a stop; hands every cut to the persister.
    pub fn consume(
        &mut self,
        operator: &mut WindowOperator,
        handoff: Sender<Handoff>,
        precommitted: &AtomicU64,
        committed: Receiver<Epoch>,
        mut filters: Option<Receiver<(PartitionId, SeenIdFilter)>>,
        added: Option<Receiver<AddedPartitions>>,
    ) -> Result<Stop> {
        let interval = self.settings.checkpoint_interval;
        let max_in_flight = self.settings.max_epochs_in_flight;
        let mut next_barrier = Instant::now() + interval;
        let mut consume_errors = 0u64;
        // When the barrier that is due was first put off because the committer was behind.
        let mut deferred_since: Option<Instant> = None;
        let mut in_flight = InFlight::default();
        let mut last_cut = None;
        let mut quiet = false;
        // Partitions that started from `start_from` have no checkpoint yet: take one even if idle,
        // so a restart resumes at the resolved offset instead of resolving `latest` again.
        let mut must_checkpoint = self.store.meta().is_none_or(|m| {
            self.partitions
                .iter()
                .any(|p| !m.partitions.contains_key(p))
        });
        // Freeing a pre-committed cut (every key and id of an epoch) costs as much as processing
        // thousands of records: it happens on a thread of its own, not on the consuming one.
        let (retired_tx, retired_rx) = mpsc::channel::<Arc<EpochCut>>();
        crate::job_scope::spawn(
            std::thread::Builder::new().name("tally-free".into()),
            move || retired_rx.into_iter().for_each(drop),
        )
        .context("starting the thread that frees pre-committed epochs")?;
        let retire_precommitted = |in_flight: &mut InFlight| {
            for cut in in_flight.precommitted(Epoch(precommitted.load(Ordering::Acquire))) {
                // A closed channel means the thread ended: the cut is freed here instead.
                let _ = retired_tx.send(cut);
            }
        };
        loop {
            if let Some(rx) = &filters {
                match rx.try_recv() {
                    Ok((partition, filter)) => operator.adopt_seen_filter(partition, filter),
                    Err(TryRecvError::Empty) => {}
                    // Done (or failed, which it logged): lookups go to the store meanwhile.
                    Err(TryRecvError::Disconnected) => filters = None,
                }
            }
            retire_precommitted(&mut in_flight);
            loop {
                match committed.try_recv() {
                    Ok(epoch) => in_flight.committed(epoch),
                    Err(TryRecvError::Empty) => break,
                    // The sink thread ended (a shutdown while a sink failed, or an error that
                    // joining it returns): nothing more can commit.
                    Err(TryRecvError::Disconnected) => return Ok(Stop::Idle),
                }
            }
            // An idle epoch changes nothing: skip it rather than commit empty batches.
            let idle = operator.pending_records() == 0 && !must_checkpoint;
            let stopping = self.stopping();
            if stopping && idle {
                return Ok(Stop::Idle);
            }
            if idle && Instant::now() >= next_barrier {
                next_barrier = Instant::now() + interval;
                self.maybe_report_lag(&operator.next_offsets());
                must_checkpoint |= self.adopt_added_partitions(operator, added.as_ref())?;
            }
            let fill = EpochFill::of(operator);
            let reason = cut_reason(
                fill,
                idle,
                stopping,
                Instant::now() >= next_barrier,
                quiet,
                last_cut,
            );
            let due = reason.is_some();
            let defer = due && defer_barrier(fill, in_flight.len(), max_in_flight, stopping);
            if defer && deferred_since.is_none() {
                deferred_since = Some(Instant::now());
                self.pressure.note();
            }
            if let Some(reason) = reason.filter(|_| !defer) {
                let barrier_at = Instant::now();
                // Backpressure: the committer is `max_in_flight` epochs behind. A shutdown
                // while a sink fails ends the sink thread, which closes the channel.
                if in_flight.len() >= max_in_flight {
                    self.pressure.note();
                }
                while in_flight.len() >= max_in_flight {
                    retire_precommitted(&mut in_flight);
                    match committed.recv_timeout(POLL) {
                        Ok(epoch) => in_flight.committed(epoch),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return Ok(Stop::Idle),
                    }
                }
                let backpressure = barrier_at.elapsed();
                let epoch = operator.current_epoch();
                let cut = Arc::new(operator.cut(CheckpointBarrier {
                    epoch,
                    is_final: stopping,
                }));
                let pause = BarrierPause {
                    total: barrier_at.elapsed(),
                    backpressure,
                };
                CheckpointCut {
                    epoch,
                    records: cut.consumed(),
                    reason: reason.name(),
                    state_bytes: fill.state_bytes,
                    seen_filter_bytes: operator.seen_filter_bytes(),
                    pause,
                    deferred: deferred_since
                        .take()
                        .map_or(Duration::ZERO, |since| barrier_at.duration_since(since)),
                }
                .emit();
                in_flight.push(cut.clone());
                if handoff
                    .send(Handoff {
                        cut,
                        barrier_at,
                        pause,
                    })
                    .is_err()
                {
                    return Ok(Stop::Idle);
                }
                next_barrier = Instant::now() + interval;
                last_cut = Some(reason);
                self.maybe_report_lag(&operator.next_offsets());
                must_checkpoint = self.adopt_added_partitions(operator, added.as_ref())?;
                if stopping {
                    return Ok(Stop::Final(epoch));
                }
                continue;
            }
            if let Some(waits) = &mut self.waits {
                waits.release(&self.source, || operator.next_offsets())?;
            }
            match self.source.poll(POLL) {
                Ok(None) => quiet = true,
                Ok(Some(record)) => {
                    quiet = false;
                    let record = record.as_record();
                    if let Some(waits) = &mut self.waits
                        && waits.holds(&self.source, &record)?
                    {
                        continue;
                    }
                    let state = WithInFlight {
                        cuts: in_flight.readable(),
                        store: &*self.store,
                    };
                    let (partition, offset) = (record.partition, record.offset);
                    let outcome = operator
                        .process(&state, record)
                        .context("processing a record")?;
                    if outcome == tally_core::Outcome::Truncated {
                        bail!(
                            "the source table was truncated: a TRUNCATE event is at partition {partition} offset {offset} of {}. Its rows are held across every partition, which tally cannot retract at one point, so the job stops before it and commits nothing past it. To go on, rebuild the job: stop its workers, give it a new job.name (new state and tables) and let the connector take a new snapshot of the table (docs/change-jobs.md: a TRUNCATE)",
                            self.settings.source_topic
                        );
                    }
                }
                Err(e) if e.is_offset_out_of_range() => {
                    bail!(
                        "{e}: the checkpointed offset is no longer on the broker (retention deleted it before tally read it); records were lost upstream of tally"
                    );
                }
                Err(e) => {
                    consume_errors += 1;
                    if consume_errors.is_power_of_two() {
                        tracing::warn!(error = %e, count = consume_errors, "consumer error; retrying");
                    }
                }
            }
        }
    }

    /// Takes over the partitions discovery found added to the topic, if any, at a barrier (off
    /// the per-record path). True when some were: their start offsets need a checkpoint even
    /// before they have records.
    fn adopt_added_partitions(
        &mut self,
        operator: &mut WindowOperator,
        added: Option<&Receiver<AddedPartitions>>,
    ) -> Result<bool> {
        let Some(new) = added.and_then(|rx| rx.try_recv().ok()) else {
            return Ok(false);
        };
        for &(partition, offset, joining) in &new {
            match joining {
                Some(watermark) => operator.add_joining_partition(partition, offset, watermark),
                None => operator.add_partition(partition, offset),
            }
            if !self.partitions.contains(&partition) {
                self.partitions.push(partition);
            }
        }
        // Every record polled so far is processed: the others resume where they are.
        self.source.assign(&operator.next_offsets())?;
        if let Some(waits) = &self.waits {
            waits.pause_waiting(&self.source)?;
        }
        PartitionsAdded {
            added: &new,
            partitions: self.partitions.len(),
        }
        .emit();
        Ok(true)
    }

    /// Exports the records each partition has on the broker beyond what tally consumed, at
    /// most every 10 s (it asks the broker).
    fn maybe_report_lag(&mut self, next_offsets: &BTreeMap<PartitionId, i64>) {
        if self
            .last_lag
            .is_some_and(|t| t.elapsed() < Duration::from_secs(10))
        {
            return;
        }
        self.last_lag = Some(Instant::now());
        let mut ends = Vec::with_capacity(next_offsets.len());
        for (&partition, &next) in next_offsets {
            match self.source.watermarks(partition) {
                Ok((_, high)) => {
                    LagMeasured {
                        partition,
                        lag: (high - next).max(0),
                    }
                    .emit();
                    ends.push((partition, next, high));
                }
                Err(e) => {
                    tracing::debug!(partition, error = %e, "could not read the high watermark")
                }
            }
        }
        if self.settings.rebuilds && ends.len() == next_offsets.len() {
            if self.rebuild.is_none() {
                // Where each partition's rebuild began: the same lookup as its first start.
                let starts: Result<BTreeMap<PartitionId, i64>, _> = next_offsets
                    .keys()
                    .map(|&p| {
                        self.source
                            .resolve_start(p, self.settings.start_from)
                            .map(|o| (p, o))
                    })
                    .collect();
                match starts {
                    Ok(starts) => self.rebuild = Some(crate::rebuild::Progress::new(starts)),
                    Err(e) => {
                        tracing::debug!(error = %e, "could not look up where the rebuild began")
                    }
                }
            }
            if let Some(progress) = &mut self.rebuild {
                progress.observe(Instant::now(), ends).emit();
            }
        }
    }

    pub fn restore_operator(&self) -> Result<WindowOperator> {
        let (epoch, partitions) = match self.store.meta() {
            Some(meta) => (meta.epoch, meta.partitions.clone()),
            None => (Epoch(0), BTreeMap::new()),
        };
        if let Some(missing) = partitions.keys().find(|p| !self.partitions.contains(p)) {
            bail!(
                "partition {missing} of {} is in the checkpoint but no longer in the topic; was the topic recreated?",
                self.settings.source_topic
            );
        }
        let mut operator = WindowOperator::restore(
            self.settings.operator,
            self.settings.program.clone(),
            epoch,
            &partitions,
        );
        let from = self.settings.start_from;
        // `start_from` places a new job in its topic. A partition added to the topic after the
        // job's first checkpoint holds only records that came after the job started: all of them.
        let from = if partitions.is_empty() {
            from
        } else {
            StartFrom::Earliest
        };
        for &p in &self.partitions {
            if !partitions.contains_key(&p) {
                let offset = wait_for("kafka", &self.shutdown, || {
                    Ok(self.source.resolve_start(p, from)?)
                })?;
                match self.joining.filter(|_| self.added.contains(&p)) {
                    Some(watermark) => {
                        tracing::info!(
                            partition = p,
                            offset,
                            joining_watermark = %tally_core::time::format_ms(watermark),
                            "partition was added to the topic while the job ran; starting at {from:?}, its events in windows already final for the job are late"
                        );
                        operator.add_joining_partition(p, offset, watermark);
                    }
                    None => {
                        tracing::info!(
                            partition = p,
                            offset,
                            "partition has no checkpoint; starting at {from:?}"
                        );
                        operator.add_partition(p, offset);
                    }
                }
            }
        }
        for (p, c) in &partitions {
            tracing::info!(
                partition = p,
                offset = c.next_offset,
                "resuming partition from checkpoint"
            );
        }
        Ok(operator)
    }
}

/// Rebuilds, on a thread of its own, the id filters of the partitions restored from the store,
/// so that consumption starts at once; until a partition's filter arrives its dedup lookups all
/// go to the store.
pub fn rebuild_seen_filters(
    store: Arc<StateStore>,
    partitions: Vec<PartitionId>,
    horizon_ms: i64,
) -> Result<Option<Receiver<(PartitionId, SeenIdFilter)>>> {
    if partitions.is_empty() {
        return Ok(None);
    }
    let (tx, rx) = mpsc::channel();
    crate::job_scope::spawn(
std::thread::Builder::new().name("tally-idscan".into()),
move || {
            for partition in partitions {
                let started = Instant::now();
                let mut builder = FilterBuilder::new(horizon_ms);
                let scanned = store
                    .scan_seen(partition, |_, t| builder.count(t))
                    .and_then(|_| {
                        let mut fill = builder.into_fill();
                        let ids = store.scan_seen(partition, |id, t| fill.insert(id_hash(id), t))?;
                        Ok((ids, fill.finish()))
                    });
                match scanned {
                    Ok((ids, filter)) => {
                        tracing::info!(
                            partition,
                            ids,
                            bytes = filter.bytes(),
                            millis = started.elapsed().as_millis() as u64,
                            "rebuilt the dedup id filter"
                        );
                        if tx.send((partition, filter)).is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(partition, error = %e, "could not rebuild the dedup id filter; every lookup goes to the store");
                        return;
                    }
                }
            }
        })
        .context("starting the id filter thread")?;
    Ok(Some(rx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(records: u64, dead_letter_bytes: usize, state_bytes: usize) -> EpochFill {
        EpochFill {
            records,
            dead_letter_bytes,
            state_bytes,
        }
    }

    #[test]
    fn a_cut_is_read_until_pre_committed_and_counted_until_committed() {
        let cut = |n: u64| {
            let mut cut = EpochCut::default();
            cut.epoch = Epoch(n);
            Arc::new(cut)
        };
        let epochs = |cuts: &[Arc<EpochCut>]| cuts.iter().map(|c| c.epoch.0).collect::<Vec<_>>();
        let readable = |f: &InFlight| epochs(&f.readable().iter().cloned().collect::<Vec<_>>());
        let mut flight = InFlight::default();
        flight.push(cut(1));
        flight.push(cut(2));
        assert_eq!(epochs(&flight.precommitted(Epoch(1))), [1]);
        assert_eq!(readable(&flight), [2]);
        assert_eq!(
            flight.len(),
            2,
            "a pre-committed epoch still counts until committed"
        );
        flight.committed(Epoch(1));
        assert_eq!(flight.len(), 1);
        // Reports of both kinds may cover several epochs at once, in either order.
        flight.push(cut(3));
        flight.committed(Epoch(3));
        assert_eq!(flight.len(), 0);
        assert_eq!(
            readable(&flight),
            [2, 3],
            "read until the store answers for them"
        );
        assert_eq!(epochs(&flight.precommitted(Epoch(3))), [2, 3]);
        assert!(flight.readable().is_empty());
    }

    #[test]
    fn a_barrier_is_put_off_only_while_the_committer_is_behind_and_the_epoch_may_grow() {
        let small = fill(10, 0, 0);
        assert!(!small.full());
        assert!(!defer_barrier(small, 1, 2, false), "a free slot: cut");
        assert!(defer_barrier(small, 2, 2, false), "committer behind: go on");
        assert!(!defer_barrier(small, 2, 2, true), "a stop never waits");

        let full = fill(MAX_EPOCH_RECORDS, 0, 0);
        assert!(full.full());
        assert!(defer_barrier(full, 2, 2, false));
        for overfull in [
            fill(2 * MAX_EPOCH_RECORDS, 0, 0),
            fill(0, MAX_EPOCH_DEAD_LETTER_BYTES, 0),
            fill(0, 0, 2 * MAX_EPOCH_STATE_BYTES),
        ] {
            assert!(overfull.full());
            assert!(
                !defer_barrier(overfull, 2, 2, false),
                "{overfull:?} waits for the committer"
            );
        }
        assert!(defer_barrier(
            fill(0, 0, 2 * MAX_EPOCH_STATE_BYTES - 1),
            2,
            2,
            false
        ));
    }

    #[test]
    fn a_quiet_input_cuts_the_epoch_only_after_a_full_one() {
        use CutReason::*;
        let (small, full) = (fill(10, 0, 0), fill(MAX_EPOCH_RECORDS, 0, 0));
        // A drained backlog: the last epoch filled up, then the input went quiet.
        assert_eq!(
            cut_reason(small, false, false, false, true, Some(Full)),
            Some(CaughtUp)
        );
        // Live input that goes quiet waits for the interval, as does a backlog still flowing.
        for last in [None, Some(Interval), Some(CaughtUp), Some(Stop)] {
            assert_eq!(
                cut_reason(small, false, false, false, true, last),
                None,
                "{last:?}"
            );
        }
        assert_eq!(
            cut_reason(small, false, false, false, false, Some(Full)),
            None
        );
        assert_eq!(
            cut_reason(small, false, false, true, true, None),
            Some(Interval)
        );
        // Nothing to cut, whatever else holds; a stop and a bound come first.
        assert_eq!(cut_reason(full, true, true, true, true, Some(Full)), None);
        assert_eq!(
            cut_reason(full, false, true, true, true, Some(Full)),
            Some(Stop)
        );
        assert_eq!(
            cut_reason(full, false, false, true, true, Some(Full)),
            Some(Full)
        );
    }
}
