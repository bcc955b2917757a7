//! The commit protocol: every pre-committed epoch, in order, through its Kafka transaction (dead
//! letters, changelog records, the group's offsets with the commit mark) and its ClickHouse
//! batch, then marked committed. Every step is idempotent and checkable, so a process that dies
//! anywhere restarts by finishing the pre-committed epochs, oldest first, before it reads new
//! input. Written against the two sinks' seam ([`sinks`]): the real clients in production, the
//! in-memory fakes in this module's unit tests.

pub mod clickhouse;
pub mod kafka;
pub mod sinks;
pub mod undone;

#[cfg(test)]
mod fakes;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tally_clickhouse::{CommittedBatch, WriteStep};
use tally_core::{Checkpoint, Epoch, PartitionId, WindowOperator};
use tally_kafka::{CommitMark, EpochCommit};
use tally_state::StateStore;
use tally_state::changelog::RestorePoints;

use crate::events::{
    BarrierPause, CheckpointCommitted, CommitPhases, EpochBytes, EpochRecovered, SinkRetry,
};
use crate::fault::{FaultPlan, FaultPoint};
use crate::health::Readiness;
use crate::persist::{Persisted, PreCommitted};
use crate::retry::{Failure, MAX_BACKOFF, sleep_unless_stopped, wait_for};
use crate::settings::{JobSettings, TaskSettings};
use sinks::{BatchSink, EpochTransactions};

/// Where an epoch is in the commit protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CommitStep {
    /// Durable in RocksDB; no sink is known to have it.
    PreCommitted,
    /// The Kafka transaction (dead letters, changelog, the group's offsets) is committed.
    DeadLettersCommitted,
    /// The ClickHouse batch and its commit-log row are written.
    Written,
}

/// What the committer shares with the rest of the worker.
pub struct CommitterParts {
    pub job: Arc<JobSettings>,
    pub task: TaskSettings,
    pub shutdown: Arc<AtomicBool>,
    pub fault: FaultPlan,
    pub store: Arc<StateStore>,
    pub readiness: Arc<Readiness>,
    /// Told of every epoch committed: the read side publishes it.
    pub committed: Arc<tokio::sync::Notify>,
}

/// The commit side of a worker: completes epochs in both sinks and marks them committed.
pub struct Committer<K, C> {
    job: Arc<JobSettings>,
    task: TaskSettings,
    shutdown: Arc<AtomicBool>,
    fault: FaultPlan,
    store: Arc<StateStore>,
    kafka: K,
    clickhouse: C,
    /// The producer is new and no epoch has checked yet whether its transaction committed
    /// before (by a previous process or a failed attempt).
    unverified: bool,
    phases: CommitPhases,
    readiness: Arc<Readiness>,
    /// Where a restore of each partition may start reading the changelog.
    restore_points: RestorePoints,
    committed: Arc<tokio::sync::Notify>,
    /// The first wait after a failed step; doubles up to [`MAX_BACKOFF`].
    first_backoff: Duration,
}

impl<K: EpochTransactions, C: BatchSink> Committer<K, C> {
    pub fn new(parts: CommitterParts, kafka: K, clickhouse: C) -> Result<Committer<K, C>> {
        Ok(Committer {
            restore_points: parts.store.restore_points()?,
            job: parts.job,
            task: parts.task,
            shutdown: parts.shutdown,
            fault: parts.fault,
            store: parts.store,
            kafka,
            clickhouse,
            unverified: false,
            phases: CommitPhases::default(),
            readiness: parts.readiness,
            committed: parts.committed,
            first_backoff: Duration::from_millis(100),
        })
    }

    /// The job's ClickHouse side.
    pub fn clickhouse(&self) -> &C {
        &self.clickhouse
    }

    /// Fails when any partition's offsets were last committed by another writer: another
    /// worker commits this job.
    pub fn refuse_another_writer(&self) -> Result<(), Failure> {
        let marks = crate::marks::marks_of(self.kafka.committed()?);
        crate::marks::refuse_another_writer(&marks, &self.store, &self.job)
            .map_err(Failure::Permanent)
    }

    /// The batches ClickHouse holds past the state directory's offsets that Kafka undid (the
    /// group's offsets agree with the state): they are made again from the source before any
    /// new input ([`undone`]). Refuses to run when ClickHouse is ahead in any other way:
    /// the view would mix two histories, and resuming would count their records twice.
    pub fn undone_batches(&self) -> Result<Vec<CommittedBatch>> {
        let mut sink_offsets = self.sink_wait(|c| c.committed_offsets())?;
        // Other tasks' partitions are other directories' business.
        sink_offsets.retain(|p, _| self.task.owns(*p));
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
        let kafka = wait_for("kafka", &self.shutdown, || self.kafka.committed())?;
        let kafka_agrees = sink_offsets
            .keys()
            .all(|p| kafka.get(p).map(|(o, _)| *o) == state.get(p).copied());
        let batches = self.sink_wait(|c| c.committed_batches())?;
        let past = if kafka_agrees {
            undone::batches_past(&batches, &state, |p| self.task.owns(p))
        } else {
            Err("the group's committed offsets do not match the state either".to_owned())
        };
        match past {
            Ok(past) if !past.is_empty() => Ok(past),
            past => {
                let why = past.err().unwrap_or_default();
                let state_offset = state.get(&partition);
                let names = tally_clickhouse::TableNames::new(
                    &self.job.commit.database,
                    &self.job.commit.table,
                )?;
                bail!(
                    "ClickHouse commit log {} has partition {partition} up to offset {offset}, but the state directory {} has it {} ({why}). \
                     The state is missing or older than the sink (wiped or restored from a backup), so resuming would double count. \
                     Restore the matching state directory, or rebuild it with `tally restore` (into an empty directory), or drop the job's tables ({}, {}, {}) to start over.",
                    names.commits_q(),
                    self.store.path().display(),
                    state_offset.map_or("not at all".to_string(), |o| format!("up to offset {o}")),
                    names.view_q(),
                    names.data_q(),
                    names.commits_q()
                );
            }
        }
    }

    /// Makes the batches Kafka undid again from the source (see [`undone`]) and commits
    /// their Kafka transactions, before any new input.
    pub fn remake_undone(
        &mut self,
        operator: &mut WindowOperator,
        batches: &[CommittedBatch],
    ) -> Result<()> {
        for batch in batches {
            let started = Instant::now();
            let remade = undone::remake(
                &self.job,
                &self.clickhouse,
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
            self.complete_stored_epoch(&remade, started)?;
        }
        Ok(())
    }

    /// Completes the pre-committed epochs a previous run left, oldest first, before any new
    /// input. With pipelined checkpoints there can be several.
    pub fn recover(&mut self) -> Result<()> {
        self.resend_lost_commit()?;
        let pending = self.store.pending_epochs()?;
        if pending.is_empty() {
            if let Some(meta) = self.store.meta() {
                tracing::info!(epoch = %meta.epoch, "restored checkpoint");
            }
            return Ok(());
        }
        for epoch in pending {
            self.fault.check(FaultPoint::DuringRestore, epoch)?;
            let stored = self.stored(epoch)?;
            let started = Instant::now();
            let clickhouse_already_committed =
                self.sink_wait(|c| c.is_committed(&self.job.commit.batch_of(&stored.checkpoint)))?;
            // Whether the Kafka transaction committed is checked by the producer step itself,
            // after its init_transactions has fenced and settled any transaction of the dead
            // process.
            EpochRecovered {
                epoch,
                clickhouse_already_committed,
            }
            .emit();
            self.complete_stored_epoch(&stored, started)?;
        }
        Ok(())
    }

    /// An epoch read back from the store (pending, or held after its commit).
    fn stored(&self, epoch: Epoch) -> Result<PreCommitted> {
        let (checkpoint, changelog) = self.store.pending(epoch, self.job.commit.window_size_ms)?;
        let liveness = tally_state::changelog::liveness_of_records(&changelog)?;
        Ok(PreCommitted {
            checkpoint,
            changelog,
            liveness,
            bytes: EpochBytes::default(),
            took: Duration::ZERO,
        })
    }

    /// The job's transactional producer, created (which fences any earlier instance and ends
    /// its open transaction) unless there is one.
    pub fn ensure_producer(&mut self) -> Result<()> {
        if !self.kafka.has_producer() {
            wait_for("kafka", &self.shutdown.clone(), || self.make_producer())?;
        }
        Ok(())
    }

    /// A new producer, unless another writer commits the job. Checked before
    /// `init_transactions`, so that a second worker does not fence the one that owns the job,
    /// and again after it: init settled every earlier producer's transaction, so a commit by
    /// another writer that raced the first check shows now, and from here on only this
    /// producer can commit until another one initialises and fences it. The producer that
    /// fenced at the lease is used first. Its first epoch checks whether its transaction
    /// committed already.
    fn make_producer(&mut self) -> Result<(), Failure> {
        if !self.kafka.adopt_fencing_producer() {
            self.refuse_another_writer()?;
            self.kafka.fence()?;
            self.refuse_another_writer()?;
        }
        self.unverified = true;
        Ok(())
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
        let marks = crate::marks::marks_of(wait_for("kafka", &self.shutdown, || {
            self.kafka.committed()
        })?);
        if crate::marks::foreign_mark(&marks, &self.store)?.is_some() {
            // Another writer committed after it; its epochs supersede this one.
            return Ok(());
        }
        let Some(kafka_epoch) = crate::marks::newest_epoch(&marks) else {
            return Ok(());
        };
        if kafka_epoch >= epoch {
            return Ok(());
        }
        let stored = self.stored(epoch)?;
        crate::events::KafkaCommitLost {
            epoch,
            kafka_epoch,
            dead_letters: stored.checkpoint.dead_letters.len(),
            task: self.task.task,
        }
        .emit();
        self.complete_stored_epoch(&stored, Instant::now())
    }

    /// Commits an epoch read back from the store (pending, held after its commit, or made
    /// again) and marks it committed.
    pub fn complete_stored_epoch(&mut self, stored: &PreCommitted, started: Instant) -> Result<()> {
        self.commit(stored)?;
        self.mark_committed(stored.checkpoint.epoch)?;
        CheckpointCommitted {
            checkpoint: &stored.checkpoint,
            latency: started.elapsed(),
            pause: BarrierPause::default(),
            phases: self.phases,
            bytes: EpochBytes::default(),
            recovered: true,
            task: self.task.task,
        }
        .emit();
        Ok(())
    }

    /// Commits each pre-committed epoch the persister hands over, in order, then marks it
    /// committed. Returns when the persister is done, or with
    /// [`Interrupted`](crate::retry::Interrupted) when a shutdown comes while a sink is failing.
    pub fn run(mut self, persisted: Receiver<Persisted>, committed: Sender<Epoch>) -> Result<()> {
        for next in persisted {
            let checkpoint = &next.epoch.checkpoint;
            self.phases.pre_commit = next.epoch.took;
            self.commit(&next.epoch)?;
            self.mark_committed(checkpoint.epoch)?;
            self.fault
                .check(FaultPoint::KafkaCommitLost, checkpoint.epoch)?;
            CheckpointCommitted {
                checkpoint,
                latency: next.barrier_at.elapsed(),
                pause: next.pause,
                phases: self.phases,
                bytes: next.epoch.bytes,
                recovered: false,
                task: self.task.task,
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

    /// Whether the Kafka transaction of `epoch` committed: the group's offsets carry the epoch
    /// of the last transaction that committed them (by this writer: the caller has checked
    /// that no other writer committed).
    fn dead_letters_committed(&self, epoch: Epoch) -> Result<bool> {
        let marks = crate::marks::marks_of(wait_for("kafka", &self.shutdown, || {
            self.kafka.committed()
        })?);
        Ok(crate::marks::newest_epoch(&marks).is_some_and(|e| e >= epoch))
    }

    /// A ClickHouse read, waited for while ClickHouse is unreachable.
    fn sink_wait<T>(&self, read: impl Fn(&C) -> Result<T, Failure>) -> Result<T> {
        wait_for("clickhouse", &self.shutdown, || read(&self.clickhouse))
    }

    /// Drives one epoch from pre-committed to written, retrying each sink until it succeeds.
    /// Never skips: the only ways out without success are a permanent failure and a shutdown.
    fn commit(&mut self, epoch: &PreCommitted) -> Result<()> {
        let checkpoint = &epoch.checkpoint;
        // The restore points once this epoch is committed: they go into its marks.
        let points = self.restore_points.with_epoch(&epoch.liveness);
        let number = checkpoint.epoch;
        let offsets: BTreeMap<PartitionId, i64> = checkpoint
            .partitions
            .iter()
            .map(|(p, c)| (*p, c.next_offset))
            .collect();
        let mut step = CommitStep::PreCommitted;
        let mut attempt = 0u32;
        let mut backoff = self.first_backoff;
        loop {
            let step_started = Instant::now();
            let (sink, result) = match step {
                CommitStep::PreCommitted => (
                    "kafka",
                    self.commit_transaction(epoch, &points, &offsets)
                        .map(|()| CommitStep::DeadLettersCommitted),
                ),
                CommitStep::DeadLettersCommitted => (
                    "clickhouse",
                    self.write_clickhouse(checkpoint)
                        .map(|()| CommitStep::Written),
                ),
                CommitStep::Written => return Ok(()),
            };
            match result {
                Ok(next) => {
                    match step {
                        CommitStep::PreCommitted => {
                            self.fault
                                .check(FaultPoint::AfterDeadLetterCommit, number)?;
                            self.phases.dead_letters = step_started.elapsed();
                            let started = Instant::now();
                            self.advance_restore_points(points.clone(), offsets.keys());
                            self.phases.changelog = started.elapsed();
                        }
                        CommitStep::DeadLettersCommitted => {
                            self.fault
                                .check(FaultPoint::AfterClickHouseInsert, number)?;
                            self.phases.clickhouse = step_started.elapsed();
                        }
                        CommitStep::Written => {}
                    }
                    step = next;
                    attempt = 0;
                    backoff = self.first_backoff;
                    self.readiness.set_sinks_failing(false);
                }
                Err(Failure::Permanent(error)) => return Err(error),
                Err(Failure::Transient(error)) => {
                    attempt += 1;
                    self.readiness.set_sinks_failing(true);
                    SinkRetry {
                        sink,
                        epoch: number,
                        attempt,
                        backoff,
                        error: &format!("{error:#}"),
                    }
                    .emit();
                    if sink == "kafka" {
                        // A failed transaction may leave the producer unusable; a new one fences it.
                        self.kafka.reset();
                    }
                    sleep_unless_stopped(&self.shutdown, backoff, "a sink")?;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// The epoch's Kafka transaction, unless it committed before (a restart, a failed attempt).
    fn commit_transaction(
        &mut self,
        epoch: &PreCommitted,
        points: &RestorePoints,
        offsets: &BTreeMap<PartitionId, i64>,
    ) -> Result<(), Failure> {
        let checkpoint = &epoch.checkpoint;
        if !self.kafka.has_producer() {
            self.make_producer()?;
        }
        if self.unverified {
            // init_transactions fenced an earlier producer of this id and settled its open
            // transaction; only after that does the group's offset metadata tell for certain
            // whether this epoch's transaction committed (after a crash or a failed commit).
            // Only the first epoch after it can have: the next one's transaction had not begun.
            let committed = self
                .dead_letters_committed(checkpoint.epoch)
                .map_err(Failure::Transient)?;
            self.unverified = false;
            if committed {
                tracing::info!(epoch = %checkpoint.epoch, "dead-letter transaction of this epoch already committed");
                return Ok(());
            }
        }
        let mark = CommitMark {
            epoch: checkpoint.epoch,
            writer: Some(self.store.writer_id().to_owned()),
            restore_from: None,
        };
        if epoch.changelog.is_empty() && !checkpoint.partitions.is_empty() {
            tracing::warn!(epoch = %checkpoint.epoch, "this epoch was pre-committed by a tally release without a changelog: the changelog misses it, and a restore from it will refuse until the job starts over");
        }
        let restore_from = offsets
            .keys()
            .map(|&p| (p, points.restore_from(p)))
            .collect();
        let transaction = EpochCommit {
            mark: &mark,
            dead_letters: &checkpoint.dead_letters,
            changelog: &epoch.changelog,
            offsets,
            restore_from: &restore_from,
        };
        if self
            .fault
            .targets(FaultPoint::KafkaCommitLost, checkpoint.epoch)
        {
            tracing::warn!(point = FaultPoint::KafkaCommitLost.name(), epoch = %checkpoint.epoch, "fault injection: the transaction is aborted and the epoch goes on as committed");
            return self.kafka.write_then_abort(&transaction);
        }
        self.kafka.commit(&transaction)
    }

    /// After an epoch's transaction committed: its restore points are the job's, the next
    /// epoch's records start after the changelog's end, and now and then the changelog is
    /// truncated below the points of the epoch before. Failures here cost only a longer
    /// restore.
    fn advance_restore_points<'a>(
        &mut self,
        mut points: RestorePoints,
        partitions: impl Iterator<Item = &'a PartitionId>,
    ) {
        // The epoch's own partitions: those its transaction wrote changelog records for.
        let partitions: Vec<PartitionId> = partitions.copied().collect();
        match self.kafka.changelog_ends(&partitions) {
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
        self.kafka.truncate_changelog(before);
    }

    fn write_clickhouse(&self, checkpoint: &Checkpoint) -> Result<(), Failure> {
        let batch = self.job.commit.batch_of(checkpoint);
        let fault = self.fault;
        let epoch = checkpoint.epoch;
        let hook = move |step: WriteStep| {
            if step == WriteStep::HalfInserted {
                fault.hit(FaultPoint::MidClickHouseInsert, epoch);
            }
        };
        self.clickhouse.write(&batch, &hook).map(|_| ())
    }
}
