//! Internal events: each logs and counts in one place. Metric names follow
//! `tally_<name>_<unit>_total`.

use std::time::Duration;

use metrics::{counter, gauge, histogram};
use tally_core::{Accounting, Checkpoint, Epoch, PoisonReason};

/// What an epoch wrote: its state changes in the store and its changelog records (0 for an
/// epoch completed after a restart).
#[derive(Debug, Clone, Copy, Default)]
pub struct EpochBytes {
    pub state: usize,
    pub changelog: usize,
}

/// The changelog was truncated below the committed restore points.
pub struct ChangelogTruncated<'a> {
    pub before: &'a std::collections::BTreeMap<i32, i64>,
    pub took: Duration,
}

impl ChangelogTruncated<'_> {
    pub fn emit(&self) {
        tracing::debug!(before = ?self.before, millis = self.took.as_millis() as u64, "truncated the changelog");
        counter!("tally_changelog_truncations_total").increment(1);
        for (p, offset) in self.before {
            gauge!("tally_changelog_restore_point_offset", "partition" => p.to_string())
                .set(*offset as f64);
        }
    }
}

/// Time spent in each step of the last commit.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitPhases {
    pub pre_commit: Duration,
    pub dead_letters: Duration,
    /// After the Kafka transaction: the changelog's new restore points (its end offsets read,
    /// the points saved) and, now and then, its truncation below the old ones.
    pub changelog: Duration,
    pub clickhouse: Duration,
    pub mark_committed: Duration,
}

/// How long the operator stopped consuming at a barrier, and how much of that it waited for the
/// committer (backpressure: `job.max_epochs_in_flight` epochs not yet committed) rather than
/// cutting the epoch.
#[derive(Debug, Clone, Copy, Default)]
pub struct BarrierPause {
    pub total: Duration,
    pub backpressure: Duration,
}

/// An epoch whose outputs every sink now has.
pub struct CheckpointCommitted<'a> {
    pub checkpoint: &'a Checkpoint,
    /// From the barrier to committed in every sink.
    pub latency: Duration,
    pub pause: BarrierPause,
    pub phases: CommitPhases,
    pub bytes: EpochBytes,
    pub recovered: bool,
    /// The task of a job of several (`TaskSettings::task`): labels its series `task`.
    pub task: Option<u32>,
}

/// The `task` label of a job of several tasks; none for a job of one, whose series stay as
/// they were.
fn task_labels(task: Option<u32>) -> Vec<(&'static str, String)> {
    task.map(|t| vec![("task", t.to_string())])
        .unwrap_or_default()
}

impl CheckpointCommitted<'_> {
    pub fn emit(&self) {
        let cp = self.checkpoint;
        let acc: Accounting = cp.accounting();
        tracing::info!(
            epoch = %cp.epoch,
            consumed = acc.consumed,
            aggregated = acc.aggregated,
            duplicates = acc.duplicates,
            late = acc.late,
            dead_lettered = acc.dead_lettered,
            filtered = acc.filtered,
            stale = acc.stale,
            tombstones = acc.tombstones,
            rows = cp.rows.len(),
            millis = self.latency.as_millis() as u64,
            pause_us = self.pause.total.as_micros() as u64,
            backpressure_us = self.pause.backpressure.as_micros() as u64,
            pre_commit_ms = self.phases.pre_commit.as_millis() as u64,
            dead_letters_ms = self.phases.dead_letters.as_millis() as u64,
            changelog_ms = self.phases.changelog.as_millis() as u64,
            clickhouse_ms = self.phases.clickhouse.as_millis() as u64,
            mark_committed_ms = self.phases.mark_committed.as_millis() as u64,
            state_bytes = self.bytes.state,
            changelog_bytes = self.bytes.changelog,
            recovered = self.recovered,
            "checkpoint committed"
        );
        counter!("tally_records_consumed_total").increment(acc.consumed);
        counter!("tally_records_aggregated_total").increment(acc.aggregated);
        counter!("tally_records_duplicate_total").increment(acc.duplicates);
        counter!("tally_records_late_total").increment(acc.late);
        counter!("tally_records_filtered_total").increment(acc.filtered);
        counter!("tally_records_stale_total").increment(acc.stale);
        counter!("tally_records_tombstone_total").increment(acc.tombstones);
        for reason in PoisonReason::ALL {
            let n = cp
                .dead_letters
                .iter()
                .filter(|d| d.reason == reason)
                .count() as u64;
            if n > 0 {
                counter!("tally_records_dead_lettered_total", "reason" => reason.as_str())
                    .increment(n);
            }
        }
        counter!("tally_sink_rows_written_total").increment(cp.rows.len() as u64);
        let task = task_labels(self.task);
        counter!("tally_checkpoints_committed_total", &task).increment(1);
        counter!("tally_changelog_bytes_total").increment(self.bytes.changelog as u64);
        histogram!("tally_checkpoint_duration_seconds", &task).record(self.latency.as_secs_f64());
        for (phase, d) in [
            ("pre_commit", self.phases.pre_commit),
            ("dead_letters", self.phases.dead_letters),
            ("changelog", self.phases.changelog),
            ("clickhouse", self.phases.clickhouse),
            ("mark_committed", self.phases.mark_committed),
        ] {
            histogram!("tally_checkpoint_phase_seconds", "phase" => phase).record(d.as_secs_f64());
        }
        gauge!("tally_epoch", &task).set(cp.epoch.0 as f64);
        for (p, pc) in &cp.partitions {
            if let Some(max) = pc.watermark.max_event_time_ms {
                gauge!("tally_partition_max_event_time_seconds", "partition" => p.to_string())
                    .set(max as f64 / 1000.0);
            }
            gauge!("tally_partition_next_offset", "partition" => p.to_string())
                .set(pc.next_offset as f64);
        }
    }
}

/// A sink could not take an epoch's outputs; tally retries and does not consume meanwhile.
pub struct SinkRetry<'a> {
    pub sink: &'static str,
    pub epoch: Epoch,
    pub attempt: u32,
    pub backoff: Duration,
    pub error: &'a str,
}

impl SinkRetry<'_> {
    pub fn emit(&self) {
        tracing::warn!(sink = self.sink, epoch = %self.epoch, attempt = self.attempt, backoff_ms = self.backoff.as_millis() as u64, error = self.error, "sink write failed; retrying");
        counter!("tally_sink_retries_total", "sink" => self.sink).increment(1);
    }
}

/// The worker writes through another ClickHouse replica: the one before failed.
pub struct SinkReplicaChanged<'a> {
    pub from: &'a str,
    pub to: &'a str,
}

impl SinkReplicaChanged<'_> {
    pub fn emit(&self) {
        tracing::warn!(
            from = self.from,
            to = self.to,
            "writing through another clickhouse replica"
        );
        counter!("tally_clickhouse_replica_switches_total").increment(1);
    }
}

/// An epoch cut at a barrier and handed to the committer; the operator goes on consuming.
pub struct CheckpointCut {
    pub epoch: Epoch,
    pub records: u64,
    /// Why the epoch was cut: stop, full, interval or caught_up.
    pub reason: &'static str,
    /// The estimated heap of the epoch's changed windows and ids, which it holds until committed.
    pub state_bytes: usize,
    /// The in-memory dedup filters of the operator's partitions.
    pub seen_filter_bytes: usize,
    pub pause: BarrierPause,
    /// How long the barrier was put off, consuming on, while the committer was behind.
    pub deferred: Duration,
}

impl CheckpointCut {
    pub fn emit(&self) {
        tracing::debug!(
            epoch = %self.epoch,
            records = self.records,
            reason = self.reason,
            estimated_state_bytes = self.state_bytes,
            seen_filter_bytes = self.seen_filter_bytes,
            pause_us = self.pause.total.as_micros() as u64,
            backpressure_us = self.pause.backpressure.as_micros() as u64,
            deferred_us = self.deferred.as_micros() as u64,
            "epoch cut"
        );
        histogram!("tally_checkpoint_pause_seconds").record(self.pause.total.as_secs_f64());
        histogram!("tally_checkpoint_backpressure_seconds")
            .record(self.pause.backpressure.as_secs_f64());
        histogram!("tally_checkpoint_deferred_seconds").record(self.deferred.as_secs_f64());
        gauge!("tally_memory_bytes", "part" => "seen_filters").set(self.seen_filter_bytes as f64);
    }
}

/// A pre-committed epoch found at start and completed before new input.
pub struct EpochRecovered {
    pub epoch: Epoch,
    pub clickhouse_already_committed: bool,
}

impl EpochRecovered {
    pub fn emit(&self) {
        tracing::warn!(
            epoch = %self.epoch,
            clickhouse_already_committed = self.clickhouse_already_committed,
            "completed the commit of a pre-committed epoch left by a previous run"
        );
        counter!("tally_epochs_recovered_total").increment(1);
    }
}

/// At start, the group's offsets show that Kafka no longer has the transaction of the last
/// committed epoch (its marks are older): the transaction was undone after it committed, as an
/// abort by hand of a hanging transaction does. Its dead letters, changelog records and offsets
/// are sent again from the outputs the store held.
pub struct KafkaCommitLost {
    pub epoch: Epoch,
    /// The newest epoch the group's offsets carry.
    pub kafka_epoch: Epoch,
    pub dead_letters: usize,
    pub task: Option<u32>,
}

impl KafkaCommitLost {
    pub fn emit(&self) {
        let lost_before = Epoch(self.epoch.0.saturating_sub(1));
        if self.kafka_epoch < lost_before {
            tracing::error!(
                epoch = %self.epoch,
                kafka_epoch = %self.kafka_epoch,
                "Kafka lost the transactions of epochs {} to {} too, which this state directory no longer holds: \
                 their dead letters are missing from the topic and the changelog has a gap (a restore from it refuses)",
                Epoch(self.kafka_epoch.0 + 1),
                lost_before
            );
        }
        tracing::warn!(
            epoch = %self.epoch,
            kafka_epoch = %self.kafka_epoch,
            dead_letters = self.dead_letters,
            "the Kafka transaction of the last committed epoch is gone (aborted after it committed, e.g. a hanging transaction aborted by hand): sending its dead letters, changelog records and offsets again"
        );
        counter!(
            "tally_kafka_transactions_resent_total",
            &task_labels(self.task)
        )
        .increment(1);
    }
}

/// The group's committed offsets could not be read because a transaction that committed
/// offsets for the group is open. This worker's producer was initialised first, which ends
/// every transaction of its transactional id that the coordinator knows of; so if it lasts
/// past the transaction timeout, it is a hanging transaction, one the coordinator has
/// forgotten, and only an abort by hand ends it.
pub struct OffsetsHeldByOpenTransaction<'a> {
    pub error: &'a tally_kafka::Error,
    pub brokers: &'a str,
    pub transactional_id: &'a str,
    pub task: Option<u32>,
}

impl OffsetsHeldByOpenTransaction<'_> {
    pub fn emit(&self) {
        let partition = match self.error {
            tally_kafka::Error::UnstableOffsets {
                offsets_partition: Some(p),
                ..
            } => p.to_string(),
            _ => "<partition>".to_owned(),
        };
        tracing::warn!(
            error = %self.error,
            transactional_id = self.transactional_id,
            "waiting for an open transaction on the group's offsets (for a moment after a broker restart or a fencing, that is normal). If it lasts longer than the transaction timeout, it is a hanging transaction \
             (open on its partitions after its coordinator finished it): list it with `kafka-transactions.sh --bootstrap-server {} find-hanging --topic __consumer_offsets --partition {partition}` \
             (and with --broker-id for the dead-letter and changelog partitions it holds too), then abort it with `kafka-transactions.sh --bootstrap-server {} abort --topic T --partition P --start-offset O` for each. \
             An abort drops what it holds; if that was this job's last committed epoch, the worker holding that epoch's state directory sends it again (see docs/scale-out.md)",
            self.brokers,
            self.brokers
        );
        counter!(
            "tally_kafka_offsets_unstable_total",
            &task_labels(self.task)
        )
        .increment(1);
    }
}

/// A fold step ran: final windows moved to one row each, replaced versions dropped.
pub struct Folded<'a> {
    pub result: &'a Result<tally_clickhouse::FoldOutcome, tally_clickhouse::SinkError>,
    pub duration: Duration,
}

impl Folded<'_> {
    pub fn emit(&self) {
        match self.result {
            Ok(outcome) => {
                tracing::info!(
                    frontier = %tally_core::time::format_ms(i64::from(outcome.frontier.seconds) * 1000),
                    folded_rows = outcome.folded_rows,
                    dropped_partitions = outcome.dropped_partitions,
                    repaired = outcome.repaired,
                    millis = self.duration.as_millis() as u64,
                    "fold step"
                );
                counter!("tally_fold_rows_total").increment(outcome.folded_rows);
                counter!("tally_fold_steps_total").increment(1);
                gauge!("tally_fold_frontier_seconds").set(f64::from(outcome.frontier.seconds));
                histogram!("tally_fold_duration_seconds").record(self.duration.as_secs_f64());
            }
            Err(error) => {
                tracing::warn!(error = %error, "fold step failed; retrying at the next interval");
                counter!("tally_fold_failures_total").increment(1);
            }
        }
    }
}

/// A publish of the answer the view reads from the fold frontier on.
pub struct Published<'a> {
    pub result: &'a Result<tally_clickhouse::PublishOutcome, tally_clickhouse::SinkError>,
    pub duration: Duration,
    /// The publish before failed too: a failure is logged once, then quietly until one works.
    pub failed_before: bool,
}

impl Published<'_> {
    pub fn emit(&self) {
        match self.result {
            Ok(outcome) => {
                if let Some(rows) = outcome.rows {
                    tracing::debug!(
                        rows,
                        from = %tally_core::time::format_ms(i64::from(outcome.from.seconds) * 1000),
                        cut = ?outcome.cut.0,
                        millis = self.duration.as_millis() as u64,
                        "published"
                    );
                    counter!("tally_publishes_total").increment(1);
                    gauge!("tally_published_rows").set(rows as f64);
                    histogram!("tally_publish_duration_seconds")
                        .record(self.duration.as_secs_f64());
                }
            }
            Err(error) if self.failed_before => {
                tracing::debug!(error = %error, "publishing the answer failed again");
                counter!("tally_publish_failures_total").increment(1);
            }
            Err(error) => {
                tracing::warn!(error = %error, "publishing the answer failed; the view shows the one before until a retry succeeds");
                counter!("tally_publish_failures_total").increment(1);
            }
        }
    }
}

/// Records on the broker that tally has not consumed yet, per partition.
pub struct LagMeasured {
    pub partition: tally_core::PartitionId,
    pub lag: i64,
}

impl LagMeasured {
    pub fn emit(&self) {
        gauge!("tally_partition_lag_records", "partition" => self.partition.to_string())
            .set(self.lag as f64);
    }
}

/// A new version's rebuild: how far it is through the history it reads (`crate::rebuild`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RebuildProgress {
    pub read: u64,
    pub to_read: u64,
    /// Records read per second over the last minute; `None` before a second sample.
    pub per_second: Option<f64>,
    pub time_left: Option<Duration>,
}

impl RebuildProgress {
    pub fn emit(&self) {
        let lag = self.to_read.saturating_sub(self.read);
        tracing::info!(
            read = self.read,
            to_read = self.to_read,
            per_second = self.per_second.map_or(-1, |r| r.round() as i64),
            time_left_s = self.time_left.map_or(-1, |t| t.as_secs() as i64),
            "rebuild progress: {} of {} records read",
            self.read,
            self.to_read
        );
        gauge!("tally_restate_records_read").set(self.read as f64);
        gauge!("tally_restate_records_to_read").set(self.to_read as f64);
        gauge!("tally_restate_lag_records").set(lag as f64);
    }
}

/// Where the process's memory is, sampled once a second (`crate::memory`).
#[derive(Debug, Clone, Copy)]
pub struct MemoryMeasured {
    pub rss: usize,
    pub peak_rss: usize,
    /// Bytes the allocator has handed out (RocksDB and librdkafka allocate from it too).
    pub allocated: usize,
    /// Pages the allocator holds resident: `allocated` plus its free lists and metadata.
    pub allocator_resident: usize,
    pub allocator_metadata: usize,
    /// RocksDB's memory shared by every store of the process, part of `allocated`.
    pub memtables: usize,
    pub block_cache: usize,
}

impl MemoryMeasured {
    /// Logged (debug) when the peak grew since the last log, with what held the memory then.
    pub fn emit(&self, new_peak: bool) {
        for (part, bytes) in [
            ("rss", self.rss),
            ("peak_rss", self.peak_rss),
            ("allocated", self.allocated),
            ("allocator_resident", self.allocator_resident),
            ("allocator_metadata", self.allocator_metadata),
            ("rocksdb_memtables", self.memtables),
            ("rocksdb_block_cache", self.block_cache),
        ] {
            gauge!("tally_memory_bytes", "part" => part).set(bytes as f64);
        }
        if new_peak {
            let mib = |b: usize| b >> 20;
            tracing::debug!(
                peak_rss_mib = mib(self.peak_rss),
                rss_mib = mib(self.rss),
                allocated_mib = mib(self.allocated),
                allocator_resident_mib = mib(self.allocator_resident),
                allocator_metadata_mib = mib(self.allocator_metadata),
                memtables_mib = mib(self.memtables),
                block_cache_mib = mib(self.block_cache),
                "memory peak"
            );
        }
    }
}

/// Partitions added to the source topic while the worker ran: consumed from their earliest
/// offsets, since every record in them arrived after the job started.
pub struct PartitionsAdded<'a> {
    /// Each new partition with the offset it starts at and the watermark it joins at.
    pub added: &'a [(tally_core::PartitionId, i64, Option<i64>)],
    pub partitions: usize,
}

impl PartitionsAdded<'_> {
    pub fn emit(&self) {
        tracing::info!(added = ?self.added, partitions = self.partitions, "partitions added to the source topic; consuming them from their earliest offsets (their events in windows already final for the job are late)");
        counter!("tally_source_partitions_added_total").increment(self.added.len() as u64);
        gauge!("tally_source_partitions").set(self.partitions as f64);
    }
}

/// What a restore from the changelog read and rebuilt (`crate::restore`).
#[derive(Debug)]
pub struct Restored {
    pub epoch: Epoch,
    pub writer: String,
    pub partitions: usize,
    pub records: u64,
    pub bytes: u64,
    pub windows: u64,
    pub ids: u64,
    /// The last epoch is not in ClickHouse yet: the next `tally run` writes it.
    pub pending: bool,
    pub duration: Duration,
}

/// The state directory was brought to the job's committed state from the changelog: `whole`,
/// a restore into an empty directory; otherwise a catch-up of what was committed since its
/// state (a warm standby's round, or the rest at a takeover).
pub struct StateRestored<'a> {
    pub restored: &'a Restored,
    pub whole: bool,
    pub taking_over: bool,
    pub task: Option<u32>,
}

impl StateRestored<'_> {
    pub fn emit(&self) {
        let r = self.restored;
        let kind = if self.whole { "whole" } else { "catch_up" };
        let millis = r.duration.as_millis() as u64;
        match (self.whole, self.taking_over) {
            (true, _) => {
                tracing::info!(epoch = %r.epoch, from_writer = %r.writer, partitions = r.partitions, records = r.records, bytes = r.bytes, windows = r.windows, ids = r.ids, millis, pending = r.pending, "restored the job's state from the changelog")
            }
            (false, true) => {
                tracing::info!(epoch = %r.epoch, from_writer = %r.writer, records = r.records, bytes = r.bytes, windows = r.windows, ids = r.ids, millis, pending = r.pending, "caught the state up with the changelog on taking the lease")
            }
            (false, false) if r.records > 0 => {
                tracing::debug!(epoch = %r.epoch, records = r.records, bytes = r.bytes, millis, "standby: caught the state up with the changelog")
            }
            (false, false) => {}
        }
        counter!("tally_state_restores_total", "kind" => kind).increment(1);
        counter!("tally_state_restored_records_total", "kind" => kind).increment(r.records);
        histogram!("tally_state_restore_seconds", "kind" => kind).record(r.duration.as_secs_f64());
        gauge!("tally_state_epoch", &task_labels(self.task)).set(r.epoch.0 as f64);
    }
}

/// Which of a shared job's tasks this worker runs and keeps warm standbys of, as the group
/// last placed them: per task, 1 or 0. Summed over the workers, `tally_task_running` is 1 for
/// every task of a healthy job; 0 is a task no one runs, 2 a task a paused worker still
/// believes it runs (until its new holder fences it).
pub struct TasksPlaced<'a> {
    pub tasks: u32,
    pub running: &'a [u32],
    pub standbys: &'a [u32],
}

impl TasksPlaced<'_> {
    pub fn emit(&self) {
        for task in 0..self.tasks {
            let label = [("task", task.to_string())];
            let running = self.running.contains(&task);
            gauge!("tally_task_running", &label).set(if running { 1.0 } else { 0.0 });
            let standby = self.standbys.contains(&task);
            gauge!("tally_task_standby", &label).set(if standby { 1.0 } else { 0.0 });
        }
    }
}

/// A committed epoch that Kafka undid, made again from the source (`crate::undone`).
pub struct EpochRemade<'a> {
    pub epoch: Epoch,
    pub partitions: &'a [tally_core::PartitionId],
    pub dead_letters: usize,
}

impl EpochRemade<'_> {
    pub fn emit(&self) {
        tracing::warn!(
            epoch = %self.epoch,
            partitions = ?self.partitions,
            dead_letters = self.dead_letters,
            "ClickHouse holds an epoch whose Kafka transaction was undone, and this state directory was restored without it: made it again from the source, matching ClickHouse's record of it, and sending its transaction again"
        );
        counter!("tally_epochs_remade_total").increment(1);
    }
}

/// This process's read side claimed, lost or released the job's read side.
pub enum ReadSideChanged<'a> {
    /// The agent started, not holding the read side.
    Watching,
    Claimed {
        generation: u64,
        holder: &'a str,
    },
    /// A later generation fenced this one.
    Lost {
        generation: u64,
        error: &'a tally_clickhouse::SinkError,
    },
    Released {
        generation: u64,
    },
}

impl ReadSideChanged<'_> {
    pub fn emit(&self) {
        match self {
            ReadSideChanged::Watching => {
                tracing::debug!("watching the read side");
                gauge!("tally_read_side_held").set(0.0);
            }
            ReadSideChanged::Claimed { generation, holder } => {
                tracing::info!(
                    generation,
                    holder,
                    "holding the read side: publishing and folding"
                );
                counter!("tally_read_side_claims_total").increment(1);
                gauge!("tally_read_side_held").set(1.0);
                gauge!("tally_read_side_generation").set(*generation as f64);
            }
            ReadSideChanged::Lost { generation, error } => {
                tracing::warn!(generation, error = %error, "lost the read side to a later generation (this process was silent past job.session_timeout, or `tally fold` took it): standing by");
                counter!("tally_read_side_losses_total").increment(1);
                gauge!("tally_read_side_held").set(0.0);
            }
            ReadSideChanged::Released { generation } => {
                tracing::info!(generation, "released the read side");
                gauge!("tally_read_side_held").set(0.0);
            }
        }
    }
}

/// A writer schema the registry answered for, after `attempts` requests (more than one while
/// it could not be reached).
pub struct SchemaFetched {
    pub id: u32,
    pub attempts: u32,
    /// Whether the registry knew the id and its schema compiled for the job.
    pub known: bool,
}

impl SchemaFetched {
    pub fn emit(&self) {
        tracing::info!(
            schema_id = self.id,
            attempts = self.attempts,
            known = self.known,
            "fetched a writer schema from the schema registry"
        );
        counter!("tally_registry_schemas_fetched_total").increment(1);
        counter!("tally_registry_requests_failed_total")
            .increment(u64::from(self.attempts.saturating_sub(1)));
    }
}

/// A partition waits for the writer schema of its next record: the registry has not answered
/// for the id yet. Its records stay on the broker; other partitions go on.
pub struct SchemaAwaited {
    pub partition: tally_core::PartitionId,
    pub offset: i64,
    pub id: u32,
    /// Partitions waiting now.
    pub waiting: usize,
}

impl SchemaAwaited {
    pub fn emit(&self) {
        tracing::warn!(
            partition = self.partition,
            offset = self.offset,
            schema_id = self.id,
            "a partition waits for a writer schema the registry has not served yet; its records are consumed once it does, none is dead-lettered"
        );
        counter!("tally_partition_schema_waits_total").increment(1);
        gauge!("tally_partitions_awaiting_schema").set(self.waiting as f64);
    }
}
