//! `tally run`: the checkpoint loop and the commit protocol.
//!
//! Per epoch: process records → barrier → **pre-commit** (state, offsets and the epoch's outputs
//! in one synced RocksDB batch) → commit the dead letters and the group offsets in one Kafka
//! transaction → write the ClickHouse batch and its commit-log row → **mark committed**. Every
//! sink step is idempotent and checkable, so a process that dies anywhere restarts by finishing
//! the pre-committed epoch before it reads new input.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use tally_clickhouse::{Batch, ClickHouseSink, FoldStep, WriteOutcome, WriteStep};
use tally_core::{
    Checkpoint, CheckpointBarrier, Epoch, PartitionId, RecordDecoder, RevenueOperator,
};
use tally_kafka::{DeadLetterProducer, KafkaSettings, Source, StartFrom, epoch_from_metadata};
use tally_state::{EpochStatus, StateStore};
use tokio::runtime::Handle;

use crate::config::{self, Config};
use crate::events::{
    CheckpointCommitted, CommitPhases, EpochRecovered, Folded, LagMeasured, SinkRetry,
};
use crate::fault::{FaultPlan, FaultPoint};
use crate::health::Readiness;

/// Records, and dead-letter bytes, after which a checkpoint is taken even before the interval
/// ends, bounding the memory an epoch holds (changed windows, dead letters).
const MAX_EPOCH_RECORDS: u64 = 250_000;
const MAX_EPOCH_DEAD_LETTER_BYTES: usize = 64 << 20;
const POLL: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How long one attempt to reach the brokers may take before it is retried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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

/// The run was asked to stop while waiting on a sink.
#[derive(Debug, thiserror::Error)]
#[error("stopped while waiting for {0}")]
pub struct Interrupted(&'static str);

pub struct Worker {
    config: Config,
    rt: Handle,
    shutdown: Arc<AtomicBool>,
    fault: FaultPlan,
    store: StateStore,
    sink: ClickHouseSink,
    source: Source,
    dlq: Option<DeadLetterProducer>,
    kafka: KafkaSettings,
    partitions: Vec<PartitionId>,
    phases: CommitPhases,
    /// When the next fold step is due; `None` when folding is off.
    next_fold: Option<Instant>,
    /// When consumer lag was last measured.
    last_lag: Option<Instant>,
    readiness: Arc<Readiness>,
}

impl Worker {
    /// Opens state, connects to both services (waiting for them), validates the sink schema.
    pub fn start(
        config: Config,
        rt: Handle,
        shutdown: Arc<AtomicBool>,
        readiness: Arc<Readiness>,
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
        let store = StateStore::open(&config.job.state_dir, &config.state_identity())?;
        let kafka = config.kafka_settings();
        let settings = config.sink_settings();
        let sink = wait_for("clickhouse", &shutdown, || {
            match rt.block_on(ClickHouseSink::connect(&settings)) {
                Ok(sink) => Ok(Ok(sink)),
                // A bad certificate or password: retrying cannot help.
                Err(e @ tally_clickhouse::SinkError::Refused(_)) => Ok(Err(e)),
                Err(e) => Err(e.to_string()),
            }
        })??;
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
        let partitions = wait_for("kafka", &shutdown, || {
            match tally_kafka::check_connection(&kafka, CONNECT_TIMEOUT) {
                Err(e @ tally_kafka::Error::Refused(_)) => return Ok(Err(e)),
                Err(e) => return Err(e.to_string()),
                Ok(()) => {}
            }
            source.partitions().map(Ok).map_err(|e| e.to_string())
        })??;
        let dlq_topic = config.dlq_topic();
        let created = wait_for("kafka", &shutdown, || {
            match rt.block_on(tally_kafka::ensure_topic(
                &kafka,
                &dlq_topic,
                partitions.len() as i32,
                config.kafka.topic_replication_factor,
                &[("max.message.bytes", "16777216")],
            )) {
                Ok(created) => Ok(Ok(created)),
                // Retrying cannot help: stop and say what to change.
                Err(e @ tally_kafka::Error::Refused(_)) => Ok(Err(e)),
                Err(e) => Err(e.to_string()),
            }
        })??;
        if created {
            tracing::info!(topic = %dlq_topic, "created dead-letter topic");
        }
        tracing::info!(topic = %config.kafka.source_topic, partitions = partitions.len(), "source partitions");
        Ok(Worker {
            config,
            rt,
            shutdown,
            fault,
            store,
            sink,
            source,
            dlq: None,
            kafka,
            partitions,
            phases: CommitPhases::default(),
            next_fold: None,
            last_lag: None,
            readiness,
        })
    }

    fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// Runs until SIGTERM/SIGINT, then takes a final checkpoint.
    pub fn run(mut self) -> Result<()> {
        self.check_sink_matches_state()?;
        self.recover()?;
        if self.dlq.is_none() {
            // Fence any earlier instance now, not at the first checkpoint.
            let producer = wait_for("kafka", &self.shutdown, || {
                self.connect_dead_letters().map_err(|e| e.to_string())
            })?;
            self.dlq = Some(producer);
        }
        if self.config.clickhouse.fold_interval.0 > 0 {
            // Fold once at start: it also repairs a fold step that a crash interrupted.
            self.next_fold = Some(Instant::now());
            self.maybe_fold(self.store.meta().map_or(Epoch(0), |m| m.epoch));
        }
        let mut operator = self.restore_operator()?;
        self.source.assign(&operator.next_offsets())?;
        self.readiness.set_restored();
        let interval = self.config.job.checkpoint_interval.as_duration();
        let mut next_barrier = Instant::now() + interval;
        let mut consume_errors = 0u64;
        // Partitions that started from `start_from` have no checkpoint yet: take one even if idle,
        // so a restart resumes at the resolved offset instead of resolving `latest` again.
        let mut must_checkpoint = self.store.meta().is_none_or(|m| {
            self.partitions
                .iter()
                .any(|p| !m.partitions.contains_key(p))
        });
        loop {
            // An idle epoch changes nothing: skip it rather than commit empty batches.
            let idle = operator.pending_records() == 0 && !must_checkpoint;
            if self.stopping() && idle {
                tracing::info!("nothing consumed since the last checkpoint; stopping");
                return Ok(());
            }
            if idle && Instant::now() >= next_barrier {
                next_barrier = Instant::now() + interval;
                // Input has stopped, but the last epochs' versions still get folded and dropped.
                self.maybe_fold(operator.current_epoch());
                self.maybe_report_lag(&operator.next_offsets());
            }
            let stopping = self.stopping();
            let full = operator.pending_records() >= MAX_EPOCH_RECORDS
                || operator.pending_dead_letter_bytes() >= MAX_EPOCH_DEAD_LETTER_BYTES;
            if stopping || full || Instant::now() >= next_barrier {
                let epoch = operator.current_epoch();
                let barrier = CheckpointBarrier {
                    epoch,
                    is_final: stopping,
                };
                match self.checkpoint(&mut operator, barrier) {
                    Ok(()) if stopping => {
                        tracing::info!(%epoch, "final checkpoint committed; stopping");
                        return Ok(());
                    }
                    Ok(()) => {}
                    Err(e) if e.is::<Interrupted>() => {
                        tracing::warn!(%epoch, "stopping with epoch pre-committed; the next start completes it");
                        return Ok(());
                    }
                    Err(e) => return Err(e),
                }
                next_barrier = Instant::now() + interval;
                must_checkpoint = false;
                self.maybe_fold(epoch);
                self.maybe_report_lag(&operator.next_offsets());
                continue;
            }
            match self.source.poll(POLL) {
                Ok(None) => {}
                Ok(Some(record)) => {
                    operator
                        .process(&self.store, record.as_record())
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

    /// Runs a fold step when one is due. Folding only tidies what readers read (the view's
    /// result is the same before and after), so a failure is logged and retried next time.
    fn maybe_fold(&mut self, epoch: Epoch) {
        let Some(due) = self.next_fold else {
            return;
        };
        if Instant::now() < due {
            return;
        }
        let started = Instant::now();
        let fault = self.fault;
        let hook = move |step: FoldStep| {
            let point = match step {
                FoldStep::Inserted => FaultPoint::FoldAfterInsert,
                FoldStep::Logged => FaultPoint::FoldAfterLog,
                FoldStep::Installed => FaultPoint::FoldAfterInstall,
            };
            fault.hit(point, epoch);
        };
        let result = self
            .rt
            .block_on(self.sink.fold(self.config.fold_rules(), hook));
        Folded {
            result: &result,
            duration: started.elapsed(),
        }
        .emit();
        self.next_fold = Some(Instant::now() + self.config.clickhouse.fold_interval.as_duration());
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

    /// Refuses to run when ClickHouse already holds later epochs than the state directory:
    /// epochs would be reused and the view would mix two histories.
    fn check_sink_matches_state(&self) -> Result<()> {
        let sink_max = self.rt.block_on(self.sink.max_committed_epoch())?;
        let state_epoch = self.store.meta().map(|m| m.epoch);
        if let Some(sink_max) = sink_max
            && state_epoch.is_none_or(|e| e < sink_max)
        {
            bail!(
                "ClickHouse commit log {} has epochs up to {sink_max}, but the state directory {} is at {}. \
                 The state is missing or older than the sink (wiped or restored from a backup), so resuming would double count. \
                 Restore the matching state directory, or drop the job's tables ({}, {}, {}) to start over.",
                self.sink.names().commits_q(),
                self.store.path().display(),
                state_epoch.map_or("no checkpoint".to_string(), |e| format!("epoch {e}")),
                self.sink.names().view_q(),
                self.sink.names().data_q(),
                self.sink.names().commits_q()
            );
        }
        Ok(())
    }

    /// Completes a pre-committed epoch left by a previous run before any new input.
    fn recover(&mut self) -> Result<()> {
        let Some(meta) = self.store.meta().cloned() else {
            return Ok(());
        };
        if meta.status == EpochStatus::Committed {
            tracing::info!(epoch = %meta.epoch, "restored checkpoint");
            return Ok(());
        }
        self.fault.hit(FaultPoint::DuringRestore, meta.epoch);
        let checkpoint = self.store.pending(meta.epoch)?;
        let started = Instant::now();
        let clickhouse_already_committed = self.rt.block_on(self.sink.is_committed(meta.epoch))?;
        // Whether the dead-letter transaction committed is checked by the producer step itself,
        // after its init_transactions has fenced and settled any transaction of the dead process.
        EpochRecovered {
            epoch: meta.epoch,
            clickhouse_already_committed,
        }
        .emit();
        self.commit(&checkpoint, CommitStep::PreCommitted)?;
        self.store.mark_committed(checkpoint.epoch)?;
        CheckpointCommitted {
            checkpoint: &checkpoint,
            duration: started.elapsed(),
            phases: self.phases,
            recovered: true,
        }
        .emit();
        Ok(())
    }

    /// Whether the Kafka transaction of `epoch` committed: the group's offsets carry the epoch
    /// of the last transaction that committed them.
    fn dead_letters_committed(&self, epoch: Epoch) -> Result<bool> {
        let committed = wait_for("kafka", &self.shutdown, || {
            self.source
                .committed(&self.partitions)
                .map_err(|e| e.to_string())
        })?;
        let last = committed
            .values()
            .filter_map(|(_, metadata)| epoch_from_metadata(metadata))
            .max();
        Ok(last.is_some_and(|e| e >= epoch))
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
        for &p in &self.partitions {
            if !partitions.contains_key(&p) {
                let offset = wait_for("kafka", &self.shutdown, || {
                    self.source
                        .resolve_start(p, from)
                        .map_err(|e| e.to_string())
                })?;
                tracing::info!(
                    partition = p,
                    offset,
                    "partition has no checkpoint; starting at {from:?}"
                );
                operator.add_partition(p, offset);
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

    fn checkpoint(
        &mut self,
        operator: &mut RevenueOperator,
        barrier: CheckpointBarrier,
    ) -> Result<()> {
        let started = Instant::now();
        let checkpoint = operator.handle_checkpoint(barrier);
        self.store.pre_commit(&checkpoint)?;
        self.phases.pre_commit = started.elapsed();
        self.fault.hit(FaultPoint::AfterPreCommit, checkpoint.epoch);
        self.commit(&checkpoint, CommitStep::PreCommitted)?;
        self.store.mark_committed(checkpoint.epoch)?;
        CheckpointCommitted {
            checkpoint: &checkpoint,
            duration: started.elapsed(),
            phases: self.phases,
            recovered: false,
        }
        .emit();
        Ok(())
    }

    /// Drives one epoch from `step` to written, retrying each sink until it succeeds. Never
    /// skips: the only way out without success is a shutdown request.
    fn commit(&mut self, checkpoint: &Checkpoint, mut step: CommitStep) -> Result<()> {
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
                CommitStep::PreCommitted => {
                    self.commit_dead_letters(checkpoint, &offsets).map(|()| {
                        self.fault.hit(FaultPoint::AfterDeadLetterCommit, epoch);
                        CommitStep::DeadLettersCommitted
                    })
                }
                CommitStep::DeadLettersCommitted => self.write_clickhouse(checkpoint).map(|_| {
                    self.fault.hit(FaultPoint::AfterClickHouseInsert, epoch);
                    CommitStep::Written
                }),
                CommitStep::Written => return Ok(()),
            };
            match result {
                Ok(next) => {
                    match step {
                        CommitStep::PreCommitted => {
                            self.phases.dead_letters = step_started.elapsed()
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
                Err((sink, error)) => {
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
        offsets: &BTreeMap<PartitionId, i64>,
    ) -> Result<(), (&'static str, String)> {
        let kafka_err = |e: &dyn std::fmt::Display| ("kafka", e.to_string());
        if self.dlq.is_none() {
            // init_transactions fences an earlier producer of this id and settles its open
            // transaction; only after that does the group's offset metadata tell for certain
            // whether this epoch's transaction committed (after a crash or a failed commit).
            let producer = self.connect_dead_letters().map_err(|e| kafka_err(&e))?;
            self.dlq = Some(producer);
            if self
                .dead_letters_committed(checkpoint.epoch)
                .map_err(|e| kafka_err(&format!("{e:#}")))?
            {
                tracing::info!(epoch = %checkpoint.epoch, "dead-letter transaction of this epoch already committed");
                return Ok(());
            }
        }
        let group = tally_kafka_group(&self.source).map_err(|e| kafka_err(&e))?;
        let Some(dlq) = &self.dlq else {
            return Err(("kafka", "no producer".into()));
        };
        dlq.commit_epoch(checkpoint.epoch, &checkpoint.dead_letters, offsets, &group)
            .map_err(|e| kafka_err(&e))
    }

    fn connect_dead_letters(&self) -> Result<DeadLetterProducer, tally_kafka::Error> {
        DeadLetterProducer::connect(
            &self.kafka,
            &self.config.transactional_id(),
            &self.config.dlq_topic(),
            &self.config.kafka.source_topic,
        )
    }

    fn write_clickhouse(
        &self,
        checkpoint: &Checkpoint,
    ) -> Result<WriteOutcome, (&'static str, String)> {
        let acc = checkpoint.accounting();
        let batch = Batch {
            job: &self.config.job.name,
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
                        .current(self.config.window.out_of_orderness.0)
                        .unwrap_or(i64::MIN)
                })
                .collect(),
            rows: &checkpoint.rows,
            event_count: acc.aggregated,
            revenue_units: acc.revenue_units,
            dead_letters: checkpoint.dead_letters.len() as u64,
        };
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
fn wait_for<T>(
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
