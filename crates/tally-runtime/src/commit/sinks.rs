//! The seam under the commit protocol: an epoch's two sinks as the protocol sees them. The real
//! clients implement them ([`super::kafka`], [`super::clickhouse`]); the unit tests use
//! in-memory fakes with the same guarantees (a transaction lands whole or not at all, a batch
//! written twice is written once).

use std::collections::BTreeMap;

use tally_clickhouse::{Batch, BatchTotals, CommittedBatch, WriteOutcome, WriteStep};
use tally_core::PartitionId;
use tally_kafka::{CommitMark, EpochCommit};

use crate::retry::Failure;

/// The epoch's Kafka side: one transaction per epoch with its dead letters, its changelog
/// records and the group's offsets with the commit mark; and what the group committed.
pub trait EpochTransactions {
    /// The group's committed offsets of the job's partitions, each with its commit mark.
    fn committed(&self) -> Result<BTreeMap<PartitionId, (i64, CommitMark)>, Failure>;
    /// Whether a producer is ready for the next transaction.
    fn has_producer(&self) -> bool;
    /// Takes the producer that fenced the job's previous worker when this one took the lease,
    /// if there is one; true when it did.
    fn adopt_fencing_producer(&mut self) -> bool;
    /// Makes a new producer, which fences every earlier producer of the job's transactional id
    /// and settles its open transaction.
    fn fence(&mut self) -> Result<(), Failure>;
    /// Forgets the producer after a failed transaction (it may be unusable).
    fn reset(&mut self);
    /// Commits `epoch`'s dead letters, changelog records and offsets as one transaction.
    fn commit(&mut self, epoch: &EpochCommit<'_>) -> Result<(), Failure>;
    /// Writes `epoch`'s transaction and aborts it: a committed transaction that Kafka undid
    /// afterwards (fault injection only).
    fn write_then_abort(&mut self, epoch: &EpochCommit<'_>) -> Result<(), Failure>;
    /// The changelog's end offsets of `partitions`.
    fn changelog_ends(
        &self,
        partitions: &[PartitionId],
    ) -> Result<BTreeMap<PartitionId, i64>, Failure>;
    /// Asks for the changelog to be truncated below `before`, off the commit path; a request
    /// may be dropped (a later one carries newer points).
    fn truncate_changelog(&mut self, before: BTreeMap<PartitionId, i64>);
}

/// The epoch's ClickHouse side: its batch and the commit log.
pub trait BatchSink {
    /// Writes `batch` unless the commit log holds it (data rows, then the commit-log row).
    fn write(&self, batch: &Batch<'_>, fault: &dyn Fn(WriteStep)) -> Result<WriteOutcome, Failure>;
    /// Whether the commit log holds `batch`, whoever wrote it.
    fn is_committed(&self, batch: &Batch<'_>) -> Result<bool, Failure>;
    /// Per source partition, the newest offset a committed batch ends at.
    fn committed_offsets(&self) -> Result<BTreeMap<PartitionId, i64>, Failure>;
    /// The commit log, one entry per batch.
    fn committed_batches(&self) -> Result<Vec<CommittedBatch>, Failure>;
    /// What the commit log recorded of the batch ending `partitions` at `to_offsets`.
    fn batch_totals(
        &self,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> Result<Option<BatchTotals>, Failure>;
}
