//! The epoch's ClickHouse side, by the real sink: through one replica of a cluster, moving to
//! the next when it fails.

use std::collections::BTreeMap;

use tally_clickhouse::{Batch, BatchTotals, CommittedBatch, Replicas, WriteOutcome, WriteStep};
use tally_core::PartitionId;
use tokio::runtime::Handle;

use super::sinks::BatchSink;
use crate::events::SinkReplicaChanged;
use crate::retry::Failure;

/// [`BatchSink`] by the job's ClickHouse sink.
pub struct ClickHouseBatches {
    replicas: Replicas,
    rt: Handle,
    /// Part of every batch's id.
    source_topic: String,
}

impl ClickHouseBatches {
    pub fn new(replicas: Replicas, rt: Handle, source_topic: &str) -> ClickHouseBatches {
        ClickHouseBatches {
            replicas,
            rt,
            source_topic: source_topic.to_owned(),
        }
    }

    /// Runs `f` through the replicas, saying when writes moved to another one.
    fn through<T, F, Fut>(&self, f: F) -> Result<T, tally_clickhouse::SinkError>
    where
        F: Fn(std::sync::Arc<tally_clickhouse::ClickHouseSink>) -> Fut,
        Fut: std::future::Future<Output = Result<T, tally_clickhouse::SinkError>>,
    {
        let before = self.replicas.current_url().to_owned();
        let result = self.rt.block_on(self.replicas.through(f));
        let now = self.replicas.current_url();
        if now != before {
            SinkReplicaChanged {
                from: &before,
                to: now,
            }
            .emit();
        }
        result
    }
}

impl BatchSink for ClickHouseBatches {
    fn write(&self, batch: &Batch<'_>, fault: &dyn Fn(WriteStep)) -> Result<WriteOutcome, Failure> {
        // Any failed write (a timeout included) is retried whole: the batch is id-keyed, and
        // nothing may be skipped.
        self.through(|sink| async move { sink.write_batch(batch, &self.source_topic, fault).await })
            .map_err(Failure::transient)
    }

    fn is_committed(&self, batch: &Batch<'_>) -> Result<bool, Failure> {
        Ok(self.through(|sink| async move { sink.is_committed(batch).await })?)
    }

    // Read at a start: on a cluster, the replica first fetches every commit row another one took.
    fn committed_offsets(&self) -> Result<BTreeMap<PartitionId, i64>, Failure> {
        Ok(self.through(|sink| async move {
            sink.sync_commit_log().await?;
            sink.committed_offsets().await
        })?)
    }

    fn committed_batches(&self) -> Result<Vec<CommittedBatch>, Failure> {
        Ok(self.through(|sink| async move {
            sink.sync_commit_log().await?;
            sink.committed_batches().await
        })?)
    }

    fn batch_totals(
        &self,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> Result<Option<BatchTotals>, Failure> {
        Ok(self.through(|sink| async move { sink.batch_totals(partitions, to_offsets).await })?)
    }
}
