//! `tally run`: the checkpoint loop and the commit protocol.
//!
//! Per epoch: process records → barrier → **pre-commit** (state, offsets and the epoch's outputs
//! in one synced RocksDB batch) → commit the dead letters, the changelog records and the group
//! offsets in one Kafka transaction → write the ClickHouse batch and its commit-log row → **mark committed**. Every
//! sink step is idempotent and checkable, so a process that dies anywhere restarts by finishing
//! the pre-committed epochs, oldest first, before it reads new input.
//!
//! The worker runs only while it holds the job's lease ([`crate::lease`]); every commit names its
//! writer, and a commit by another writer outside the lease stops it ([`AnotherWriter`]).
//!
//! Pipelined: at a barrier the operator only cuts the epoch ([`EpochCut`], no copy) and goes on
//! consuming, reading through the cuts not yet pre-committed. Two threads commit behind it, in
//! epoch order: the persister pre-commits each cut, the sink thread commits it to Kafka and
//! ClickHouse and marks it committed. At most `job.max_epochs_in_flight` epochs are between
//! barrier and committed; at the limit the operator waits (backpressure). Pre-committed cuts are
//! freed off the consuming thread. Publishing and folding are the read side's
//! ([`crate::read_side`]), which every commit notifies.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tally_clickhouse::{Batch, ClickHouseSink, WriteOutcome, WriteStep};
use tally_core::seen_filter::{FilterBuilder, id_hash};
use tally_core::{
    Checkpoint, CheckpointBarrier, Epoch, EpochCut, PartitionId, RecordDecoder, RevenueOperator,
    SeenIdFilter, WithInFlight,
};
use tally_kafka::{
    CommitMark, EpochCommit, EpochProducer, KafkaSettings, RecordDeleter, Source, StartFrom,
    UnfencedProducer,
};
use tally_state::changelog::{EpochLiveness, RestorePoints};
use tally_state::{EncodedRecord, StateStore};
use tokio::runtime::Handle;

use crate::background::Background;
use crate::config::{self, Config};
use crate::events::{
    BarrierPause, ChangelogTruncated, CheckpointCommitted, CheckpointCut, CommitPhases, EpochBytes,
    EpochRecovered, LagMeasured, PartitionsAdded, SinkRetry,
};
use crate::fault::{FaultPlan, FaultPoint};
use crate::health::Readiness;
use crate::read_side::{CommitPressure, CommitSignals};

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
    fn of(operator: &RevenueOperator) -> EpochFill {
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

/// How often the changelog is truncated below the committed restore points.
const TRUNCATE_EVERY: Duration = Duration::from_secs(30);
/// The changelog is the job's state: nothing expires by time or size (tally truncates it
/// below the restore points it commits), and records may be as large as the producer allows.
pub const CHANGELOG_TOPIC_CONFIG: &[(&str, &str)] = &[
    ("cleanup.policy", "delete"),
    ("retention.ms", "-1"),
    ("retention.bytes", "-1"),
    ("max.message.bytes", "16777216"),
];
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Where an epoch is in the commit protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommitStep {
    /// Durable in RocksDB; no sink is known to have it.
    PreCommitted,
    /// The dead-letter transaction (with the group offsets) is committed.
    DeadLettersCommitted,
    /// The ClickHouse batch and its commit-log row are written.
    Written,
}

/// Why a commit step failed: retried until it succeeds, or fatal (the worker stops).
enum SinkFailure {
    Retry { sink: &'static str, error: String },
    Fatal(anyhow::Error),
}

impl SinkFailure {
    /// For [`wait_for`]: a retryable failure is waited out, a fatal one returned.
    fn settle<T>(result: Result<T, SinkFailure>) -> Result<Result<T>, String> {
        match result {
            Ok(value) => Ok(Ok(value)),
            Err(SinkFailure::Fatal(e)) => Ok(Err(e)),
            Err(SinkFailure::Retry { error, .. }) => Err(error),
        }
    }
}

impl From<(&'static str, String)> for SinkFailure {
    fn from((sink, error): (&'static str, String)) -> SinkFailure {
        SinkFailure::Retry { sink, error }
    }
}

/// Another state directory's worker commits this job. Two workers of one job would each count
/// every record (and fence each other's transactions back and forth), so this one stops.
#[derive(Debug, thiserror::Error)]
#[error(
    "another worker commits job {job}: partition {partition} of {topic} was last committed (epoch {epoch}) by writer {other}, \
     and this worker's state directory {state_dir} is writer {ours}, not restored from it. That worker ran the job outside this one's lease \
     (all workers of a job must share its consumer group {group} and transactional id), so this one stops rather than count twice. \
     If that worker is gone for good: move its state directory here (it carries its writer id), \
     or rebuild the job's state from the changelog with `tally restore` into an empty state directory"
)]
pub struct AnotherWriter {
    job: String,
    topic: String,
    partition: PartitionId,
    epoch: Epoch,
    other: String,
    ours: String,
    state_dir: String,
    group: String,
}

/// The run was asked to stop while waiting on a sink.
#[derive(Debug, thiserror::Error)]
#[error("stopped while waiting for {0}")]
pub struct Interrupted(pub &'static str);

/// A job's worker: the operator thread's part and the committing part.
pub struct Worker {
    consumer: Consumer,
    sinks: Sinks,
}

/// The commit side: completes epochs in both sinks and marks them committed; folds.
struct Sinks {
    config: Config,
    rt: Handle,
    shutdown: Arc<AtomicBool>,
    fault: FaultPlan,
    store: Arc<StateStore>,
    sink: ClickHouseSink,
    dlq: Option<EpochProducer>,
    /// The producer that fenced the job's previous worker when this one took the lease: the
    /// first transaction's, instead of initialising another.
    fenced: Option<EpochProducer>,
    /// The producer is new and no epoch has checked yet whether its transaction committed
    /// before (by a previous process or a failed attempt).
    unverified: bool,
    /// This worker's member of the job's group (it holds the job's lease): it reads the
    /// group's committed offsets and gives the group metadata for the transactions.
    group: Arc<Source>,
    /// A client of the group that fetches nothing, for committed offsets and the changelog's
    /// end: a request on the member's connection waits behind its long-polling fetch (up to
    /// 500 ms each).
    offsets: Source,
    phases: CommitPhases,
    readiness: Arc<Readiness>,
    /// Where a restore of each partition may start reading the changelog.
    restore_points: RestorePoints,
    truncator: ChangelogTruncator,
    /// Told of every epoch committed: the read side publishes it.
    committed: Arc<tokio::sync::Notify>,
}

/// Truncates the changelog below the committed restore points, at most every
/// [`TRUNCATE_EVERY`], on a thread of its own with one admin client: on the commit path, a
/// `DeleteRecords` through a new client now and then took over a second (`changelog_ms` in the
/// commit line), and every commit behind it waited. Failures cost only a longer restore; a stop
/// waits for the request in progress.
struct ChangelogTruncator {
    /// Declared before the thread: dropped first, it ends the thread's loop, then the join.
    requests: mpsc::SyncSender<BTreeMap<PartitionId, i64>>,
    _thread: Background,
    /// When a truncation was last asked for.
    asked_at: Option<Instant>,
}

impl ChangelogTruncator {
    fn start(rt: Handle, kafka: KafkaSettings, topic: String) -> Result<ChangelogTruncator> {
        let (requests, pending) = mpsc::sync_channel::<BTreeMap<PartitionId, i64>>(1);
        // The thread ends when `requests` closes; the flag is not needed.
        let thread = Background::spawn("tally-truncate", Arc::default(), move || {
            let mut deleter: Option<RecordDeleter> = None;
            for before in pending {
                let started = Instant::now();
                let deleted = match deleter
                    .take()
                    .map_or_else(|| RecordDeleter::connect(&kafka), Ok)
                {
                    Ok(d) => rt.block_on(d.delete_before(&topic, &before)).map(|()| d),
                    Err(e) => Err(e),
                };
                match deleted {
                    Ok(d) => {
                        deleter = Some(d);
                        ChangelogTruncated {
                            before: &before,
                            took: started.elapsed(),
                        }
                        .emit();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not truncate the changelog; retrying later")
                    }
                }
            }
        })?;
        Ok(ChangelogTruncator {
            requests,
            _thread: thread,
            asked_at: None,
        })
    }

    /// Asks for the records below `before` to be deleted, unless a truncation was asked for
    /// within [`TRUNCATE_EVERY`] or is still in progress: a later one carries newer points.
    fn request(&mut self, before: BTreeMap<PartitionId, i64>) {
        if before.is_empty() || self.asked_at.is_some_and(|t| t.elapsed() < TRUNCATE_EVERY) {
            return;
        }
        if self.requests.try_send(before).is_ok() {
            self.asked_at = Some(Instant::now());
        }
    }
}

/// An epoch on its way from the barrier to committed.
struct Handoff {
    cut: Arc<EpochCut>,
    barrier_at: Instant,
    pause: BarrierPause,
}

/// An epoch cut outside the consume loop and pre-committed (see [`crate::undone`]).
pub(crate) struct Remade {
    pub checkpoint: Checkpoint,
    pub changelog: Vec<EncodedRecord>,
    pub liveness: BTreeMap<PartitionId, EpochLiveness>,
}

impl Remade {
    pub(crate) fn pre_commit(store: &StateStore, cut: EpochCut) -> Result<Remade> {
        let checkpoint = cut.to_checkpoint_without_ids();
        let changelog = tally_state::changelog::encode_epoch(&cut)?;
        store.pre_commit_with_seen(&checkpoint, cut.seen_ids(), &changelog)?;
        let liveness = tally_state::changelog::liveness_of_cut(&cut);
        Ok(Remade {
            checkpoint,
            changelog,
            liveness,
        })
    }
}

/// A pre-committed epoch on its way to the sinks.
struct Persisted {
    checkpoint: Checkpoint,
    changelog: Vec<EncodedRecord>,
    liveness: BTreeMap<PartitionId, EpochLiveness>,
    bytes: EpochBytes,
    barrier_at: Instant,
    pause: BarrierPause,
    pre_commit: Duration,
}

impl Worker {
    /// Opens state, connects to both services (waiting for them), validates the sink schema.
    pub fn start(
        config: Config,
        rt: Handle,
        shutdown: Arc<AtomicBool>,
        readiness: Arc<Readiness>,
        member: Arc<Source>,
        fenced: Option<EpochProducer>,
        signals: CommitSignals,
    ) -> Result<Worker> {
        let fault = FaultPlan::from_env().map_err(|e| anyhow!(e))?;
        if fault.is_armed() {
            tracing::warn!("fault injection is armed (TALLY_FAULT)");
        }
        std::fs::create_dir_all(&config.job.state_dir).with_context(|| {
            format!(
                "creating state directory {}",
                config.job.state_dir.display()
            )
        })?;
        let opening = Instant::now();
        let store = Arc::new(StateStore::open(
            &config.job.state_dir,
            &config.state_identity(),
        )?);
        tracing::info!(
            millis = opening.elapsed().as_millis() as u64,
            path = %config.job.state_dir.display(),
            "opened state store"
        );
        let kafka = config.kafka_settings();
        let sink = connect_clickhouse(&config, &rt, &shutdown)?;
        tracing::info!(version = sink.version(), url = %config.clickhouse.url, "connected to clickhouse");
        rt.block_on(sink.ensure_schema())?;
        if !rt.block_on(sink.pushes_predicates_into_views())? {
            tracing::warn!(
                view = %sink.names().view_q(),
                "this server does not push WHERE clauses into views (enable_optimize_predicate_expression=0): \
                 every query on the view reads all of it; set enable_optimize_predicate_expression=1 in the readers' profile"
            );
        }
        let source = Source::connect(
            &kafka,
            &config.kafka.source_topic,
            &config.kafka.consumer_group,
        )?;
        // The lease proved the settings; the source's client, not yet assigned, has no fetch
        // for these requests to wait behind, and one connection serves them all (a new client's
        // first request costs about 0.1 s of connecting).
        let partitions = wait_for("kafka", &shutdown, || {
            source.partitions().map_err(|e| e.to_string())
        })?;
        let own_topics = [config.dlq_topic(), config.changelog_topic()];
        let in_place = |counts: &BTreeMap<String, usize>| {
            own_topics
                .iter()
                .all(|t| counts.get(t).is_some_and(|&n| n >= partitions.len()))
        };
        wait_for("kafka", &shutdown, || {
            match source.partition_counts() {
                Ok(counts) if in_place(&counts) => return Ok(Ok(())),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
            match ensure_own_topics(&config, &kafka, &rt, partitions.len()) {
                Ok(()) => Ok(Ok(())),
                // Retrying cannot help: stop and say what to change.
                Err(e @ tally_kafka::Error::Refused(_)) => Ok(Err(e)),
                Err(e) => Err(e.to_string()),
            }
        })??;
        tracing::info!(topic = %config.kafka.source_topic, partitions = partitions.len(), "source partitions");
        // Registered before any record is consumed: folding waits for each partition's
        // watermark, and one added to the topic since the job began joins at the job's.
        let added = rt.block_on(sink.register_partitions(&partitions))?;
        let joining = {
            let meta = store.meta();
            let fresh_added = partitions.iter().any(|p| {
                config.owns(*p)
                    && added.contains(p)
                    && meta.as_ref().is_none_or(|m| !m.partitions.contains_key(p))
            });
            if fresh_added {
                rt.block_on(sink.joining_watermark())?
            } else {
                None
            }
        };
        // One task of several runs its own partitions only.
        let partitions: Vec<PartitionId> =
            partitions.into_iter().filter(|p| config.owns(*p)).collect();
        if let Some(task) = config.job.task {
            tracing::info!(task, partitions = ?partitions, "running task {task} of {}", config.tasks());
        }
        let truncator =
            ChangelogTruncator::start(rt.clone(), kafka.clone(), config.changelog_topic())?;
        let sinks = Sinks {
            config: config.clone(),
            rt,
            shutdown: shutdown.clone(),
            fault,
            store: store.clone(),
            sink,
            dlq: None,
            fenced,
            unverified: false,
            group: member,
            offsets: Source::connect(
                &kafka,
                &config.kafka.source_topic,
                &config.kafka.consumer_group,
            )?,
            phases: CommitPhases::default(),
            readiness: readiness.clone(),
            restore_points: store.restore_points()?,
            truncator,
            committed: signals.committed,
        };
        Ok(Worker {
            consumer: Consumer {
                config,
                shutdown,
                store,
                source,
                partitions,
                added,
                joining,
                last_lag: None,
                readiness,
                pressure: signals.pressure,
            },
            sinks,
        })
    }

    /// Runs until SIGTERM/SIGINT, then takes a final checkpoint.
    pub fn run(self) -> Result<()> {
        let Worker {
            mut consumer,
            mut sinks,
        } = self;
        // First, since it says best what is wrong when a second worker of the job starts.
        wait_for("kafka", &sinks.shutdown, || {
            SinkFailure::settle(sinks.refuse_another_writer())
        })??;
        let undone = sinks.undone_batches()?;
        sinks.recover()?;
        // Fence any earlier instance now, not at the first checkpoint.
        sinks.ensure_producer()?;
        let mut operator = consumer.restore_operator()?;
        sinks.remake_undone(&mut operator, &undone)?;
        let filters = rebuild_seen_filters(
            consumer.store.clone(),
            operator.partitions_awaiting_seen_filter(),
            consumer.config.operator().dedup_horizon_ms,
        )?;
        consumer.source.assign(&operator.next_offsets())?;
        consumer.readiness.set_restored();
        let (_discovery, added) = match start_partition_discovery(
            &consumer.config,
            &sinks.rt,
            consumer.partitions.clone(),
        )? {
            Some((thread, added)) => (Some(thread), Some(added)),
            None => (None, None),
        };

        let (handoff_tx, handoff_rx) = mpsc::channel::<Handoff>();
        let (persisted_tx, persisted_rx) = mpsc::channel::<Persisted>();
        // Epochs committed in every sink, from the sink thread only: when it ends, for whatever
        // reason, the operator sees the channel close.
        let (committed_tx, committed_rx) = mpsc::channel::<Epoch>();
        // The newest epoch pre-committed, from the persister: the store answers for it and every
        // older one (those before the operator's first epoch were in the store at its start).
        let precommitted = Arc::new(AtomicU64::new(operator.current_epoch().0.saturating_sub(1)));
        let persister = Persister {
            store: consumer.store.clone(),
            fault: sinks.fault,
            precommitted: precommitted.clone(),
        };
        let persister = std::thread::Builder::new()
            .name("tally-persist".into())
            .spawn(move || persister.run(handoff_rx, persisted_tx))
            .context("starting the persister thread")?;
        let sink_thread = std::thread::Builder::new()
            .name("tally-sinks".into())
            .spawn(move || sinks.run(persisted_rx, committed_tx))
            .context("starting the sink thread")?;

        let consumed = consumer.consume(
            &mut operator,
            handoff_tx,
            &precommitted,
            committed_rx,
            filters,
            added,
        );
        // The committing threads finish what was handed to them (or stop at a shutdown).
        let persisted = persister
            .join()
            .map_err(|_| anyhow!("the persister thread panicked"))?;
        let committed = sink_thread
            .join()
            .map_err(|_| anyhow!("the sink thread panicked"))?;
        let outcome = match (consumed, persisted.and(committed)) {
            (Ok(stop), Ok(())) => Ok(stop),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        };
        if outcome.is_ok()
            && let Err(e) = consumer.store.flush()
        {
            // Only the next start's speed depends on it.
            tracing::warn!(error = %e, "could not flush the state store at stop");
        }
        match outcome {
            Err(e) if e.is::<Interrupted>() => {
                tracing::warn!(
                    "stopping with epochs pre-committed or not yet cut; the next start completes them"
                );
                Ok(())
            }
            Err(e) => Err(e),
            Ok(Stop::Idle) => {
                tracing::info!("nothing consumed since the last checkpoint; stopping");
                Ok(())
            }
            Ok(Stop::Final(epoch)) => {
                tracing::info!(%epoch, "final checkpoint committed; stopping");
                Ok(())
            }
        }
    }
}

/// How the consume loop ended.
enum Stop {
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
struct Consumer {
    config: Config,
    shutdown: Arc<AtomicBool>,
    store: Arc<StateStore>,
    source: Source,
    partitions: Vec<PartitionId>,
    /// Partitions added to the source topic after the job began (registered so).
    added: std::collections::BTreeSet<PartitionId>,
    /// Where an added partition without a checkpoint starts its watermark.
    joining: Option<i64>,
    /// When consumer lag was last measured.
    last_lag: Option<Instant>,
    readiness: Arc<Readiness>,
    pressure: Arc<CommitPressure>,
}

impl Consumer {
    fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Consumes and cuts epochs until a stop; hands every cut to the persister.
    fn consume(
        &mut self,
        operator: &mut RevenueOperator,
        handoff: Sender<Handoff>,
        precommitted: &AtomicU64,
        committed: Receiver<Epoch>,
        mut filters: Option<Receiver<(PartitionId, SeenIdFilter)>>,
        added: Option<Receiver<AddedPartitions>>,
    ) -> Result<Stop> {
        let interval = self.config.job.checkpoint_interval.as_duration();
        let max_in_flight = usize::try_from(self.config.job.max_epochs_in_flight).unwrap_or(1);
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
        std::thread::Builder::new()
            .name("tally-free".into())
            .spawn(move || retired_rx.into_iter().for_each(drop))
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
            match self.source.poll(POLL) {
                Ok(None) => quiet = true,
                Ok(Some(record)) => {
                    quiet = false;
                    let state = WithInFlight {
                        cuts: in_flight.readable(),
                        store: &*self.store,
                    };
                    operator
                        .process(&state, record.as_record())
                        .context("processing a record")?;
                }
                Err(e) => {
                    let text = e.to_string();
                    if text.contains("Offset out of range") || text.contains("AutoOffsetReset") {
                        bail!(
                            "{text}: the checkpointed offset is no longer on the broker (retention deleted it before tally read it); records were lost upstream of tally"
                        );
                    }
                    consume_errors += 1;
                    if consume_errors.is_power_of_two() {
                        tracing::warn!(error = %text, count = consume_errors, "consumer error; retrying");
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
        operator: &mut RevenueOperator,
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
        for (&partition, &next) in next_offsets {
            match self.source.watermarks(partition) {
                Ok((_, high)) => LagMeasured {
                    partition,
                    lag: (high - next).max(0),
                }
                .emit(),
                Err(e) => {
                    tracing::debug!(partition, error = %e, "could not read the high watermark")
                }
            }
        }
    }

    fn restore_operator(&self) -> Result<RevenueOperator> {
        let decoder = RecordDecoder::new(
            self.config.field_mapping(),
            usize::try_from(self.config.job.max_record_bytes).unwrap_or(usize::MAX),
        );
        let (epoch, partitions) = match self.store.meta() {
            Some(meta) => (meta.epoch, meta.partitions.clone()),
            None => (Epoch(0), BTreeMap::new()),
        };
        if let Some(missing) = partitions.keys().find(|p| !self.partitions.contains(p)) {
            bail!(
                "partition {missing} of {} is in the checkpoint but no longer in the topic; was the topic recreated?",
                self.config.kafka.source_topic
            );
        }
        let mut operator =
            RevenueOperator::restore(self.config.operator(), decoder, epoch, &partitions);
        let from = match self.config.job.start_from {
            config::StartFrom::Earliest => StartFrom::Earliest,
            config::StartFrom::Latest => StartFrom::Latest,
        };
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
                    self.source
                        .resolve_start(p, from)
                        .map_err(|e| e.to_string())
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

/// Connects to ClickHouse, waiting while it is unreachable.
pub(crate) fn connect_clickhouse(
    config: &Config,
    rt: &Handle,
    shutdown: &Arc<AtomicBool>,
) -> Result<ClickHouseSink> {
    let settings = config.sink_settings();
    Ok(wait_for("clickhouse", shutdown, || {
        match rt.block_on(ClickHouseSink::connect(&settings)) {
            Ok(sink) => Ok(Ok(sink)),
            // A bad certificate or password: retrying cannot help.
            Err(e @ tally_clickhouse::SinkError::Refused(_)) => Ok(Err(e)),
            Err(e) => Err(e.to_string()),
        }
    })??)
}

/// Creates tally's own topics, one partition per source partition (the dead-letter topic and
/// the changelog), or grows them to `partitions` when the source topic grew. One attempt.
fn ensure_own_topics(
    config: &Config,
    kafka: &KafkaSettings,
    rt: &Handle,
    partitions: usize,
) -> Result<(), tally_kafka::Error> {
    let (dlq, changelog) = (config.dlq_topic(), config.changelog_topic());
    let spec = |name, configs| tally_kafka::TopicSpec {
        name,
        partitions,
        replication: config.kafka.topic_replication_factor,
        configs,
    };
    let specs = [
        spec(&dlq, &[("max.message.bytes", "16777216")][..]),
        spec(&changelog, CHANGELOG_TOPIC_CONFIG),
    ];
    let changes = rt.block_on(tally_kafka::ensure_topics(kafka, &specs))?;
    for ((spec, change), what) in specs.iter().zip(changes).zip(["dead-letter", "changelog"]) {
        match change {
            tally_kafka::TopicChange::Existed => {}
            tally_kafka::TopicChange::Created => {
                tracing::info!(topic = spec.name, "created {what} topic")
            }
            tally_kafka::TopicChange::Grew { from } => {
                tracing::info!(
                    topic = spec.name,
                    from,
                    partitions,
                    "grew the {what} topic to the source topic's partitions"
                )
            }
        }
    }
    Ok(())
}

/// Looks for partitions added to the source topic every `kafka.partition_discovery_interval`,
/// on a thread with a client of its own (a metadata request on the consuming client waits
/// behind its fetches). tally's own topics grow first; then each new partition goes to the
/// operator with its earliest offset. Dropping the guard stops the thread.
fn start_partition_discovery(
    config: &Config,
    rt: &Handle,
    mut known: Vec<PartitionId>,
) -> Result<Option<(Background, Receiver<AddedPartitions>)>> {
    let every = config.kafka.partition_discovery_interval.as_duration();
    if every.is_zero() {
        return Ok(None);
    }
    let client = Source::connect(
        &config.kafka_settings(),
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
    )?;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let thread = {
        let (config, rt) = (config.clone(), rt.clone());
        Background::spawn("tally-discover", stop.clone(), move || {
            let kafka = config.kafka_settings();
            let mut sink: Option<ClickHouseSink> = None;
            while sleep_unless_stopped(&stop, every).is_ok() {
                let current = match client.partitions() {
                    Ok(current) => current,
                    Err(e) => {
                        tracing::debug!(error = %e, "could not read the source topic's partitions; trying again later");
                        continue;
                    }
                };
                let new: Vec<PartitionId> = current
                    .iter()
                    .copied()
                    .filter(|p| !known.contains(p) && config.owns(*p))
                    .collect();
                if new.is_empty() {
                    continue;
                }
                // Registered before any of their records is consumed, whichever task runs
                // them: folding waits for them from now on, and they join at the job's
                // watermark.
                let grown = ensure_own_topics(&config, &kafka, &rt, current.len())
                    .map_err(|e| e.to_string())
                    .and_then(|()| register_added(&rt, &config, &mut sink, &current))
                    .and_then(|joining| {
                        new.iter()
                            .map(|&p| {
                                client
                                    .resolve_start(p, StartFrom::Earliest)
                                    .map(|offset| (p, offset, joining))
                                    .map_err(|e| e.to_string())
                            })
                            .collect::<Result<AddedPartitions, String>>()
                    });
                match grown {
                    Ok(added) => {
                        if tx.send(added).is_err() {
                            return;
                        }
                        known.extend(new);
                    }
                    Err(e) => {
                        tracing::warn!(partitions = ?new, error = %e, "partitions were added to the source topic, but tally could not prepare them yet; trying again later")
                    }
                }
            }
        })?
    };
    Ok(Some((thread, rx)))
}

/// Registers the source topic's `current` partitions in ClickHouse through `sink` (connected
/// first if need be) and returns the watermark added ones join the job at.
fn register_added(
    rt: &Handle,
    config: &Config,
    sink: &mut Option<ClickHouseSink>,
    current: &[PartitionId],
) -> Result<Option<i64>, String> {
    let client = match sink.take() {
        Some(client) => client,
        None => rt
            .block_on(ClickHouseSink::connect(&config.sink_settings()))
            .map_err(|e| e.to_string())?,
    };
    let joining = rt.block_on(async {
        client.register_partitions(current).await?;
        client.joining_watermark().await
    });
    // A failed connection is made again next time.
    if joining.is_ok() {
        *sink = Some(client);
    }
    joining.map_err(|e| e.to_string())
}

/// Partitions added to the source topic, each with the offset it starts at and the watermark
/// it joins the job at (`None`: no watermark committed yet).
type AddedPartitions = Vec<(PartitionId, i64, Option<i64>)>;

impl Sinks {
    /// The batches ClickHouse holds past the state directory's offsets that Kafka undid (the
    /// group's offsets agree with the state): they are made again from the source before any
    /// new input ([`crate::undone`]). Refuses to run when ClickHouse is ahead in any other way:
    /// the view would mix two histories, and resuming would count their records twice.
    fn undone_batches(&self) -> Result<Vec<tally_clickhouse::CommittedBatch>> {
        let mut sink_offsets = self.rt.block_on(self.sink.committed_offsets())?;
        // Other tasks' partitions are other directories' business.
        sink_offsets.retain(|p, _| self.config.owns(*p));
        let state: BTreeMap<PartitionId, i64> = self
            .store
            .meta()
            .map(|m| {
                m.partitions
                    .iter()
                    .map(|(p, c)| (*p, c.next_offset))
                    .collect()
            })
            .unwrap_or_default();
        let Some((&partition, &offset)) = sink_offsets
            .iter()
            .find(|(p, offset)| state.get(p).is_none_or(|o| o < *offset))
        else {
            return Ok(Vec::new());
        };
        let owned: Vec<PartitionId> = sink_offsets.keys().copied().collect();
        let kafka = wait_for("kafka", &self.shutdown, || {
            self.offsets.committed(&owned).map_err(|e| e.to_string())
        })?;
        let kafka_agrees = owned
            .iter()
            .all(|p| kafka.get(p).and_then(|(o, _)| *o) == state.get(p).copied());
        let batches = self.rt.block_on(self.sink.committed_batches())?;
        let past = if kafka_agrees {
            crate::undone::batches_past(&batches, &state, |p| self.config.owns(p))
        } else {
            Err("the group's committed offsets do not match the state either".to_owned())
        };
        match past {
            Ok(past) if !past.is_empty() => Ok(past),
            past => {
                let why = past.err().unwrap_or_default();
                let state_offset = state.get(&partition);
                bail!(
                    "ClickHouse commit log {} has partition {partition} up to offset {offset}, but the state directory {} has it {} ({why}). \
                     The state is missing or older than the sink (wiped or restored from a backup), so resuming would double count. \
                     Restore the matching state directory, or rebuild it with `tally restore` (into an empty directory), or drop the job's tables ({}, {}, {}) to start over.",
                    self.sink.names().commits_q(),
                    self.store.path().display(),
                    state_offset.map_or("not at all".to_string(), |o| format!("up to offset {o}")),
                    self.sink.names().view_q(),
                    self.sink.names().data_q(),
                    self.sink.names().commits_q()
                );
            }
        }
    }

    /// Makes the batches Kafka undid again from the source (see [`crate::undone`]) and commits
    /// their Kafka transactions, before any new input.
    fn remake_undone(
        &mut self,
        operator: &mut RevenueOperator,
        batches: &[tally_clickhouse::CommittedBatch],
    ) -> Result<()> {
        for batch in batches {
            let started = Instant::now();
            let remade = crate::undone::remake(
                &self.config,
                &self.rt,
                &self.sink,
                &self.store,
                operator,
                batch,
            )
            .with_context(|| {
                format!(
                    "ClickHouse holds epoch {} of writer-numbered batches (partitions {:?}, offsets {:?}..{:?}) that Kafka no longer holds \
                     (its transaction was undone: its dead letters, changelog records and group offsets are gone), and this state directory \
                     was restored without it. It could not be made again from the source. What is lost: that epoch's dead letters and its \
                     changelog records. Run the worker whose state directory committed it (it sends it again from its store), or drop the \
                     job's tables and start over",
                    batch.epoch, batch.partitions, batch.from_offsets, batch.to_offsets
                )
            })?;
            crate::events::EpochRemade {
                epoch: remade.checkpoint.epoch,
                partitions: &batch.partitions,
                dead_letters: remade.checkpoint.dead_letters.len(),
            }
            .emit();
            self.complete_stored_epoch(
                &remade.checkpoint,
                &remade.changelog,
                &remade.liveness,
                started,
            )?;
        }
        Ok(())
    }

    /// Completes the pre-committed epochs a previous run left, oldest first, before any new
    /// input. With pipelined checkpoints there can be several.
    fn recover(&mut self) -> Result<()> {
        self.resend_lost_commit()?;
        let pending = self.store.pending_epochs()?;
        if pending.is_empty() {
            if let Some(meta) = self.store.meta() {
                tracing::info!(epoch = %meta.epoch, "restored checkpoint");
            }
            return Ok(());
        }
        for epoch in pending {
            self.fault.hit(FaultPoint::DuringRestore, epoch);
            let (checkpoint, changelog) = self.store.pending(epoch, self.config.window.size.0)?;
            let liveness = tally_state::changelog::liveness_of_records(&changelog)?;
            let started = Instant::now();
            let clickhouse_already_committed = self
                .rt
                .block_on(self.sink.is_committed(&batch_of(&self.config, &checkpoint)))?;
            // Whether the dead-letter transaction committed is checked by the producer step
            // itself, after its init_transactions has fenced and settled any transaction of the
            // dead process.
            EpochRecovered {
                epoch,
                clickhouse_already_committed,
            }
            .emit();
            self.complete_stored_epoch(&checkpoint, &changelog, &liveness, started)?;
        }
        Ok(())
    }

    /// The job's transactional producer, created (which fences any earlier instance and ends
    /// its open transaction) unless there is one.
    fn ensure_producer(&mut self) -> Result<()> {
        if self.dlq.is_none() {
            let producer = match self.fenced.take() {
                Some(producer) => producer,
                None => wait_for("kafka", &self.shutdown, || {
                    SinkFailure::settle(self.connect_dead_letters())
                })??,
            };
            self.install_producer(producer);
        }
        Ok(())
    }

    /// A new producer: its first epoch checks whether its transaction committed already.
    fn install_producer(&mut self, producer: EpochProducer) {
        self.dlq = Some(producer);
        self.unverified = true;
    }

    /// Sends the last committed epoch's Kafka transaction again when the group's offsets show
    /// that Kafka no longer has it. A transaction can be left hanging (still open on its
    /// partitions after its coordinator finished it, as a broker restart mid-commit can leave
    /// it for a client without KIP-890's per-transaction epochs); an abort by hand then drops
    /// the epoch's dead letters, changelog records and offsets. The store holds that epoch's
    /// outputs until the next one commits, for this. Offsets that show nothing at all (expired
    /// with an idle group) prove nothing and send nothing.
    fn resend_lost_commit(&mut self) -> Result<()> {
        let Some(epoch) = self.store.retained_commit()? else {
            return Ok(());
        };
        // After init_transactions: every transaction of ours the coordinator knows is settled,
        // so the offsets read next are final.
        self.ensure_producer()?;
        let marks = wait_for("kafka", &self.shutdown, || {
            crate::lease::commit_marks(&self.offsets, &self.config).map_err(|e| format!("{e:#}"))
        })?;
        if crate::lease::foreign_mark(&marks, &self.store)?.is_some() {
            // Another writer committed after it; its epochs supersede this one.
            return Ok(());
        }
        let Some(kafka_epoch) = marks.values().map(|m| m.epoch).max() else {
            return Ok(());
        };
        if kafka_epoch >= epoch {
            return Ok(());
        }
        let (checkpoint, changelog) = self.store.pending(epoch, self.config.window.size.0)?;
        let liveness = tally_state::changelog::liveness_of_records(&changelog)?;
        crate::events::KafkaCommitLost {
            epoch,
            kafka_epoch,
            dead_letters: checkpoint.dead_letters.len(),
            task: self.config.job.task,
        }
        .emit();
        let started = Instant::now();
        self.complete_stored_epoch(&checkpoint, &changelog, &liveness, started)
    }

    /// Commits an epoch read back from the store (pending, or held after its commit) and marks
    /// it committed.
    fn complete_stored_epoch(
        &mut self,
        checkpoint: &Checkpoint,
        changelog: &[EncodedRecord],
        liveness: &BTreeMap<PartitionId, EpochLiveness>,
        started: Instant,
    ) -> Result<()> {
        self.commit(checkpoint, changelog, liveness, CommitStep::PreCommitted)?;
        self.mark_committed(checkpoint.epoch)?;
        CheckpointCommitted {
            checkpoint,
            latency: started.elapsed(),
            pause: BarrierPause::default(),
            phases: self.phases,
            bytes: EpochBytes::default(),
            recovered: true,
            task: self.config.job.task,
        }
        .emit();
        Ok(())
    }

    /// Commits each pre-committed epoch the persister hands over, in order, then marks it
    /// committed. Returns when the persister is done, or with [`Interrupted`] when a shutdown
    /// comes while a sink is failing.
    fn run(mut self, persisted: Receiver<Persisted>, committed: Sender<Epoch>) -> Result<()> {
        for next in persisted {
            let checkpoint = &next.checkpoint;
            self.phases.pre_commit = next.pre_commit;
            self.commit(
                checkpoint,
                &next.changelog,
                &next.liveness,
                CommitStep::PreCommitted,
            )?;
            self.mark_committed(checkpoint.epoch)?;
            self.fault
                .hit(FaultPoint::KafkaCommitLost, checkpoint.epoch);
            CheckpointCommitted {
                checkpoint,
                latency: next.barrier_at.elapsed(),
                pause: next.pause,
                phases: self.phases,
                bytes: next.bytes,
                recovered: false,
                task: self.config.job.task,
            }
            .emit();
            // The operator may have stopped already; the epoch is committed either way.
            let _ = committed.send(checkpoint.epoch);
        }
        Ok(())
    }

    fn mark_committed(&mut self, epoch: Epoch) -> Result<()> {
        let started = Instant::now();
        self.store.mark_committed(epoch)?;
        self.phases.mark_committed = started.elapsed();
        self.committed.notify_one();
        Ok(())
    }

    /// Fails when any partition's offsets were last committed by another writer: another
    /// worker commits this job.
    fn refuse_another_writer(&self) -> Result<(), SinkFailure> {
        let marks = crate::lease::commit_marks(&self.offsets, &self.config)
            .map_err(|e| SinkFailure::from(("kafka", format!("{e:#}"))))?;
        let ours = self.store.writer_id();
        let foreign = crate::lease::foreign_mark(&marks, &self.store)
            .map_err(|e| SinkFailure::Fatal(e.into()))?;
        match foreign {
            None => Ok(()),
            Some((partition, mark)) => Err(SinkFailure::Fatal(anyhow!(AnotherWriter {
                job: self.config.job.name.clone(),
                topic: self.config.kafka.source_topic.clone(),
                partition,
                epoch: mark.epoch,
                other: mark.writer.unwrap_or_default(),
                ours: ours.to_owned(),
                state_dir: self.store.path().display().to_string(),
                group: self.config.kafka.consumer_group.clone(),
            }))),
        }
    }

    /// Whether the Kafka transaction of `epoch` committed: the group's offsets carry the epoch
    /// of the last transaction that committed them (by this writer: the caller has checked
    /// that no other writer committed).
    fn dead_letters_committed(&self, epoch: Epoch) -> Result<bool> {
        let marks = wait_for("kafka", &self.shutdown, || {
            crate::lease::commit_marks(&self.offsets, &self.config).map_err(|e| format!("{e:#}"))
        })?;
        let last = marks.values().map(|m| m.epoch).max();
        Ok(last.is_some_and(|e| e >= epoch))
    }

    /// Drives one epoch from `step` to written, retrying each sink until it succeeds. Never
    /// skips: the only way out without success is a shutdown request.
    fn commit(
        &mut self,
        checkpoint: &Checkpoint,
        changelog: &[EncodedRecord],
        liveness: &BTreeMap<PartitionId, EpochLiveness>,
        mut step: CommitStep,
    ) -> Result<()> {
        // The restore points once this epoch is committed: they go into its marks.
        let points = self.restore_points.with_epoch(liveness);
        let epoch = checkpoint.epoch;
        let offsets: BTreeMap<PartitionId, i64> = checkpoint
            .partitions
            .iter()
            .map(|(p, c)| (*p, c.next_offset))
            .collect();
        let mut attempt = 0u32;
        let mut backoff = Duration::from_millis(100);
        loop {
            let step_started = Instant::now();
            let result = match step {
                CommitStep::PreCommitted => self
                    .commit_dead_letters(checkpoint, changelog, &points, &offsets)
                    .map(|()| {
                        self.fault.hit(FaultPoint::AfterDeadLetterCommit, epoch);
                        CommitStep::DeadLettersCommitted
                    }),
                CommitStep::DeadLettersCommitted => self
                    .write_clickhouse(checkpoint)
                    .map(|_| {
                        self.fault.hit(FaultPoint::AfterClickHouseInsert, epoch);
                        CommitStep::Written
                    })
                    .map_err(SinkFailure::from),
                CommitStep::Written => return Ok(()),
            };
            match result {
                Ok(next) => {
                    match step {
                        CommitStep::PreCommitted => {
                            self.phases.dead_letters = step_started.elapsed();
                            let started = Instant::now();
                            self.advance_restore_points(points.clone(), offsets.keys());
                            self.phases.changelog = started.elapsed();
                        }
                        CommitStep::DeadLettersCommitted => {
                            self.phases.clickhouse = step_started.elapsed()
                        }
                        CommitStep::Written => {}
                    }
                    step = next;
                    attempt = 0;
                    backoff = Duration::from_millis(100);
                    self.readiness.set_sinks_failing(false);
                }
                Err(SinkFailure::Fatal(error)) => return Err(error),
                Err(SinkFailure::Retry { sink, error }) => {
                    attempt += 1;
                    self.readiness.set_sinks_failing(true);
                    SinkRetry {
                        sink,
                        epoch,
                        attempt,
                        backoff,
                        error: &error,
                    }
                    .emit();
                    if sink == "kafka" {
                        // A failed transaction may leave the producer unusable; a new one fences it.
                        self.dlq = None;
                    }
                    sleep_unless_stopped(&self.shutdown, backoff)?;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    fn commit_dead_letters(
        &mut self,
        checkpoint: &Checkpoint,
        changelog: &[EncodedRecord],
        points: &RestorePoints,
        offsets: &BTreeMap<PartitionId, i64>,
    ) -> Result<(), SinkFailure> {
        let kafka_err = |e: &dyn std::fmt::Display| SinkFailure::from(("kafka", e.to_string()));
        if self.dlq.is_none() {
            let producer = match self.fenced.take() {
                Some(producer) => producer,
                None => self.connect_dead_letters()?,
            };
            self.install_producer(producer);
        }
        if self.unverified {
            // init_transactions fenced an earlier producer of this id and settled its open
            // transaction; only after that does the group's offset metadata tell for certain
            // whether this epoch's transaction committed (after a crash or a failed commit).
            // Only the first epoch after it can have: the next one's transaction had not begun.
            let committed = self
                .dead_letters_committed(checkpoint.epoch)
                .map_err(|e| kafka_err(&format!("{e:#}")))?;
            self.unverified = false;
            if committed {
                tracing::info!(epoch = %checkpoint.epoch, "dead-letter transaction of this epoch already committed");
                return Ok(());
            }
        }
        let group = tally_kafka_group(&self.group).map_err(|e| kafka_err(&e))?;
        let Some(dlq) = &self.dlq else {
            return Err(kafka_err(&"no producer"));
        };
        let mark = CommitMark {
            epoch: checkpoint.epoch,
            writer: Some(self.store.writer_id().to_owned()),
            restore_from: None,
        };
        if changelog.is_empty() && !checkpoint.partitions.is_empty() {
            tracing::warn!(epoch = %checkpoint.epoch, "this epoch was pre-committed by a tally release without a changelog: the changelog misses it, and a restore from it will refuse until the job starts over");
        }
        let restore_from = offsets
            .keys()
            .map(|&p| (p, points.restore_from(p)))
            .collect();
        let epoch = EpochCommit {
            mark: &mark,
            dead_letters: &checkpoint.dead_letters,
            changelog,
            offsets,
            restore_from: &restore_from,
        };
        if self
            .fault
            .targets(FaultPoint::KafkaCommitLost, checkpoint.epoch)
        {
            tracing::warn!(point = FaultPoint::KafkaCommitLost.name(), epoch = %checkpoint.epoch, "fault injection: the transaction is aborted and the epoch goes on as committed");
            return dlq
                .write_then_abort_epoch(&epoch, &group)
                .map_err(|e| kafka_err(&e));
        }
        dlq.commit_epoch(&epoch, &group).map_err(|e| kafka_err(&e))
    }

    /// A new transactional producer for the job, unless another writer commits the job.
    /// Checked before `init_transactions`, so that a second worker does not fence the one
    /// that owns the job, and again after it: init settled every earlier producer's
    /// transaction, so a commit by another writer that raced the first check shows now, and
    /// from here on only this producer can commit until another one initialises and fences it.
    /// After an epoch's transaction committed: its restore points are the job's, the next
    /// epoch's records start after the changelog's end, and now and then the truncator thread is
    /// asked to delete the changelog below the committed points. Failures here cost only a
    /// longer restore.
    fn advance_restore_points<'a>(
        &mut self,
        mut points: RestorePoints,
        partitions: impl Iterator<Item = &'a PartitionId>,
    ) {
        // The epoch's own partitions: those its transaction wrote changelog records for.
        let partitions: Vec<PartitionId> = partitions.copied().collect();
        match self
            .offsets
            .end_offsets(&self.config.changelog_topic(), partitions.iter().copied())
        {
            Ok(ends) => {
                for (p, end) in ends {
                    points.set_end(p, end);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read the changelog's end; the next restore point may lag")
            }
        }
        if let Err(e) = self.store.save_restore_points(&points) {
            tracing::warn!(error = %e, "could not save the changelog's restore points");
        }
        // Below the points of the epoch before, which no restore needs any more: the marks of
        // this epoch, just committed, point at or after them.
        let before: BTreeMap<PartitionId, i64> = partitions
            .iter()
            .map(|&p| (p, self.restore_points.restore_from(p)))
            .filter(|(_, from)| *from > 0)
            .collect();
        self.restore_points = points;
        self.truncator.request(before);
    }

    fn connect_dead_letters(&self) -> Result<EpochProducer, SinkFailure> {
        self.refuse_another_writer()?;
        let producer = crate::lease::unfenced_producer(&self.config)
            .and_then(UnfencedProducer::fence)
            .map_err(|e| SinkFailure::from(("kafka", e.to_string())))?;
        self.refuse_another_writer()?;
        Ok(producer)
    }

    fn write_clickhouse(
        &self,
        checkpoint: &Checkpoint,
    ) -> Result<WriteOutcome, (&'static str, String)> {
        let batch = batch_of(&self.config, checkpoint);
        let fault = self.fault;
        let epoch = checkpoint.epoch;
        let hook = move |step: WriteStep| {
            if step == WriteStep::HalfInserted {
                fault.hit(FaultPoint::MidClickHouseInsert, epoch);
            }
        };
        self.rt
            .block_on(
                self.sink
                    .write_batch(&batch, &self.config.kafka.source_topic, hook),
            )
            .map_err(|e| ("clickhouse", e.to_string()))
    }
}

/// The ClickHouse batch of a checkpoint: a function of the checkpoint alone, so whoever
/// writes it (this worker, a later one from the changelog) writes the same batch.
pub(crate) fn batch_of<'a>(config: &'a Config, checkpoint: &'a Checkpoint) -> Batch<'a> {
    let acc = checkpoint.accounting();
    Batch {
        job: &config.job.name,
        epoch: checkpoint.epoch,
        offsets: checkpoint
            .partitions
            .iter()
            .map(|(p, c)| (*p, c.epoch_start_offset, c.next_offset))
            .collect(),
        watermarks: checkpoint
            .partitions
            .values()
            .map(|c| {
                c.watermark
                    .current(config.window.out_of_orderness.0)
                    .unwrap_or(i64::MIN)
            })
            .collect(),
        rows: &checkpoint.rows,
        event_count: acc.aggregated,
        revenue_units: acc.revenue_units,
        // Every dead letter is counted as late or dead-lettered: so also for an epoch
        // restored from the changelog, whose dead letters are only in their topic.
        dead_letters: acc.late + acc.dead_lettered,
    }
}

/// Rebuilds, on a thread of its own, the id filters of the partitions restored from the store,
/// so that consumption starts at once; until a partition's filter arrives its dedup lookups all
/// go to the store.
fn rebuild_seen_filters(
    store: Arc<StateStore>,
    partitions: Vec<PartitionId>,
    horizon_ms: i64,
) -> Result<Option<Receiver<(PartitionId, SeenIdFilter)>>> {
    if partitions.is_empty() {
        return Ok(None);
    }
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("tally-idscan".into())
        .spawn(move || {
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

/// Pre-commits each cut in order, as soon as it is handed over: a crash from then on resumes
/// after it.
struct Persister {
    store: Arc<StateStore>,
    fault: FaultPlan,
    /// The newest epoch pre-committed, for the operator.
    precommitted: Arc<AtomicU64>,
}

impl Persister {
    fn run(self, handoffs: Receiver<Handoff>, persisted: Sender<Persisted>) -> Result<()> {
        for handoff in handoffs {
            let started = Instant::now();
            // The sinks do not need the ids (the largest part of an epoch): they go from the
            // cut to the store without a copy.
            let checkpoint = handoff.cut.to_checkpoint_without_ids();
            let changelog = tally_state::changelog::encode_epoch(&handoff.cut)?;
            let state =
                self.store
                    .pre_commit_with_seen(&checkpoint, handoff.cut.seen_ids(), &changelog)?;
            let bytes = EpochBytes {
                state,
                changelog: changelog.iter().map(|(_, b)| b.len()).sum(),
            };
            let liveness = tally_state::changelog::liveness_of_cut(&handoff.cut);
            let epoch = checkpoint.epoch;
            // The operator's reference is then the last: it frees the cut off this thread.
            let Handoff {
                cut,
                barrier_at,
                pause,
            } = handoff;
            drop(cut);
            self.precommitted.store(epoch.0, Ordering::Release);
            self.fault.hit(FaultPoint::AfterPreCommit, epoch);
            if self.fault.is_armed() {
                // Under the store's lock: the sink thread must not commit the older epoch
                // between the count and the kill.
                self.store.with_pending_epochs(|pending| {
                    if pending.len() >= 2 {
                        self.fault.hit(FaultPoint::TwoInFlight, epoch);
                    }
                })?;
            }
            let next = Persisted {
                checkpoint,
                changelog,
                liveness,
                bytes,
                barrier_at,
                pause,
                pre_commit: started.elapsed(),
            };
            if persisted.send(next).is_err() {
                // The sink thread stopped (shutdown or error); the epoch stays pre-committed.
                break;
            }
        }
        Ok(())
    }
}

fn tally_kafka_group(source: &Source) -> Result<rdkafka::consumer::ConsumerGroupMetadata, String> {
    use rdkafka::consumer::Consumer;
    source
        .consumer()
        .group_metadata()
        .ok_or_else(|| "consumer has no group metadata; is kafka.consumer_group set?".to_string())
}

fn sleep_unless_stopped(shutdown: &AtomicBool, duration: Duration) -> Result<(), Interrupted> {
    let until = Instant::now() + duration;
    while Instant::now() < until {
        if shutdown.load(Ordering::SeqCst) {
            return Err(Interrupted("a sink"));
        }
        std::thread::sleep(
            Duration::from_millis(50).min(until.saturating_duration_since(Instant::now())),
        );
    }
    Ok(())
}

/// Retries a connection step with backoff until it succeeds or a shutdown is requested.
pub(crate) fn wait_for<T>(
    service: &'static str,
    shutdown: &AtomicBool,
    mut f: impl FnMut() -> Result<T, String>,
) -> Result<T> {
    let mut backoff = Duration::from_millis(200);
    let mut attempt = 0u32;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(error) => {
                attempt += 1;
                tracing::warn!(service, attempt, error = %error, "waiting for {service}");
                sleep_unless_stopped(shutdown, backoff)
                    .map_err(|_| anyhow!(Interrupted(service)).context(error))?;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
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
