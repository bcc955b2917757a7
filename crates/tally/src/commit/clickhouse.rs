//! The epoch's ClickHouse side, by the real sink.

use std::collections::BTreeMap;

use tally_clickhouse::{
    Batch, BatchTotals, ClickHouseSink, CommittedBatch, WriteOutcome, WriteStep,
};
use tally_core::PartitionId;
use tokio::runtime::Handle;

use super::sinks::BatchSink;
use crate::retry::Failure;

/// [`BatchSink`] by the job's ClickHouse sink.
pub struct ClickHouseBatches {
    sink: ClickHouseSink,
    rt: Handle,
    /// Part of every batch's id.
    source_topic: String,
}

impl ClickHouseBatches {
    pub fn new(sink: ClickHouseSink, rt: Handle, source_topic: &str) -> ClickHouseBatches {
        ClickHouseBatches {
            sink,
            rt,
            source_topic: source_topic.to_owned(),
        }
    }
}

impl BatchSink for ClickHouseBatches {
    fn write(&self, batch: &Batch<'_>, fault: &dyn Fn(WriteStep)) -> Result<WriteOutcome, Failure> {
        // Any failed write (a timeout included) is retried whole: the batch is id-keyed, and
        // nothing may be skipped.
        self.rt
            .block_on(self.sink.write_batch(batch, &self.source_topic, fault))
            .map_err(Failure::transient)
    }

    fn is_committed(&self, batch: &Batch<'_>) -> Result<bool, Failure> {
        Ok(self.rt.block_on(self.sink.is_committed(batch))?)
    }

    fn committed_offsets(&self) -> Result<BTreeMap<PartitionId, i64>, Failure> {
        Ok(self.rt.block_on(self.sink.committed_offsets())?)
    }

    fn committed_batches(&self) -> Result<Vec<CommittedBatch>, Failure> {
        Ok(self.rt.block_on(self.sink.committed_batches())?)
    }

    fn batch_totals(
        &self,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> Result<Option<BatchTotals>, Failure> {
        Ok(self
            .rt
            .block_on(self.sink.batch_totals(partitions, to_offsets))?)
    }
}
