//! In-memory sinks with the real ones' guarantees, for the commit protocol's unit tests: a Kafka
//! transaction lands whole or not at all and a new producer fences the older ones; a batch
//! written twice is written once. Their state outlives a committer, as the services outlive a
//! process: a "restart" builds a new committer over the same state.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tally_clickhouse::{Batch, BatchTotals, CommittedBatch, WriteOutcome, WriteStep};
use tally_core::{Epoch, PartitionId};
use tally_kafka::{CommitMark, EpochCommit};

use super::sinks::{BatchSink, EpochTransactions};
use crate::retry::Failure;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the fake cluster holds.
#[derive(Debug, Default)]
pub struct KafkaState {
    /// The group's committed offsets with their marks.
    pub committed: BTreeMap<PartitionId, (i64, CommitMark)>,
    /// Committed transactions, in order: (epoch, dead letters).
    pub transactions: Vec<(Epoch, usize)>,
    /// The changelog's end offset per partition.
    pub changelog_ends: BTreeMap<PartitionId, i64>,
    /// The newest producer's epoch: an older producer is fenced.
    pub producer_epoch: u64,
    /// Transactions to fail (transiently) before the next one commits.
    pub fail_commits: u32,
    pub truncations: Vec<BTreeMap<PartitionId, i64>>,
}

/// One process's client of the fake cluster.
#[derive(Debug, Clone, Default)]
pub struct FakeKafka {
    pub state: Arc<Mutex<KafkaState>>,
    producer: Option<u64>,
}

impl FakeKafka {
    /// Another process's client of the same cluster (a restart).
    pub fn restarted(&self) -> FakeKafka {
        FakeKafka {
            state: self.state.clone(),
            producer: None,
        }
    }

    pub fn state(&self) -> MutexGuard<'_, KafkaState> {
        lock(&self.state)
    }
}

impl EpochTransactions for FakeKafka {
    fn committed(&self) -> Result<BTreeMap<PartitionId, (i64, CommitMark)>, Failure> {
        Ok(self.state().committed.clone())
    }

    fn has_producer(&self) -> bool {
        self.producer.is_some()
    }

    fn adopt_fencing_producer(&mut self) -> bool {
        false
    }

    fn fence(&mut self) -> Result<(), Failure> {
        let epoch = {
            let mut state = self.state();
            state.producer_epoch += 1;
            state.producer_epoch
        };
        self.producer = Some(epoch);
        Ok(())
    }

    fn reset(&mut self) {
        self.producer = None;
    }

    fn commit(&mut self, epoch: &EpochCommit<'_>) -> Result<(), Failure> {
        let producer = self.producer;
        let mut state = self.state();
        if state.fail_commits > 0 {
            state.fail_commits -= 1;
            return Err(Failure::transient(anyhow::anyhow!(
                "fake kafka: transaction failed"
            )));
        }
        if producer != Some(state.producer_epoch) {
            return Err(Failure::transient(anyhow::anyhow!(
                "fake kafka: producer fenced"
            )));
        }
        for (&p, &offset) in epoch.offsets {
            let mark = CommitMark {
                restore_from: epoch.restore_from.get(&p).copied(),
                ..epoch.mark.clone()
            };
            state.committed.insert(p, (offset, mark));
        }
        for (p, _) in epoch.changelog {
            *state.changelog_ends.entry(*p).or_default() += 1;
        }
        state
            .transactions
            .push((epoch.mark.epoch, epoch.dead_letters.len()));
        Ok(())
    }

    fn write_then_abort(&mut self, _epoch: &EpochCommit<'_>) -> Result<(), Failure> {
        Ok(())
    }

    fn changelog_ends(
        &self,
        partitions: &[PartitionId],
    ) -> Result<BTreeMap<PartitionId, i64>, Failure> {
        let state = self.state();
        Ok(partitions
            .iter()
            .map(|p| (*p, state.changelog_ends.get(p).copied().unwrap_or(0)))
            .collect())
    }

    fn truncate_changelog(&mut self, before: BTreeMap<PartitionId, i64>) {
        if !before.is_empty() {
            self.state().truncations.push(before);
        }
    }
}

/// A batch as the fake commit log holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBatch {
    pub epoch: Epoch,
    pub from_offsets: Vec<i64>,
    pub totals: BatchTotals,
}

#[derive(Debug, Default)]
pub struct ClickHouseState {
    /// The commit log, by what a batch commits: (partitions, end offsets).
    pub batches: BTreeMap<(Vec<PartitionId>, Vec<i64>), StoredBatch>,
    /// Writes that found the batch committed already.
    pub already_committed: u32,
    /// Writes to fail (transiently) before the next one lands.
    pub fail_writes: u32,
}

#[derive(Debug, Clone, Default)]
pub struct FakeClickHouse {
    pub state: Arc<Mutex<ClickHouseState>>,
}

impl FakeClickHouse {
    pub fn state(&self) -> MutexGuard<'_, ClickHouseState> {
        lock(&self.state)
    }
}

fn key_of(batch: &Batch<'_>) -> (Vec<PartitionId>, Vec<i64>) {
    (
        batch.offsets.iter().map(|o| o.0).collect(),
        batch.offsets.iter().map(|o| o.2).collect(),
    )
}

impl BatchSink for FakeClickHouse {
    fn write(&self, batch: &Batch<'_>, fault: &dyn Fn(WriteStep)) -> Result<WriteOutcome, Failure> {
        let mut state = self.state();
        if state.fail_writes > 0 {
            state.fail_writes -= 1;
            return Err(Failure::transient(anyhow::anyhow!(
                "fake clickhouse: connection refused"
            )));
        }
        let key = key_of(batch);
        if state.batches.contains_key(&key) {
            state.already_committed += 1;
            return Ok(WriteOutcome::AlreadyCommitted);
        }
        fault(WriteStep::HalfInserted);
        fault(WriteStep::Inserted);
        state.batches.insert(
            key,
            StoredBatch {
                epoch: batch.epoch,
                from_offsets: batch.offsets.iter().map(|o| o.1).collect(),
                totals: BatchTotals {
                    rows: batch.rows.len() as u64,
                    events: batch.event_count,
                    revenue_units: batch.revenue_units,
                    dead_letters: batch.dead_letters,
                },
            },
        );
        Ok(WriteOutcome::Written)
    }

    fn is_committed(&self, batch: &Batch<'_>) -> Result<bool, Failure> {
        Ok(self.state().batches.contains_key(&key_of(batch)))
    }

    fn committed_offsets(&self) -> Result<BTreeMap<PartitionId, i64>, Failure> {
        let mut out = BTreeMap::new();
        for (partitions, ends) in self.state().batches.keys() {
            for (p, end) in partitions.iter().zip(ends) {
                let e = out.entry(*p).or_insert(*end);
                *e = (*e).max(*end);
            }
        }
        Ok(out)
    }

    fn committed_batches(&self) -> Result<Vec<CommittedBatch>, Failure> {
        Ok(self
            .state()
            .batches
            .iter()
            .map(|((partitions, ends), b)| CommittedBatch {
                epoch: b.epoch.0,
                partitions: partitions.clone(),
                from_offsets: b.from_offsets.clone(),
                to_offsets: ends.clone(),
            })
            .collect())
    }

    fn batch_totals(
        &self,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> Result<Option<BatchTotals>, Failure> {
        Ok(self
            .state()
            .batches
            .get(&(partitions.to_vec(), to_offsets.to_vec()))
            .map(|b| b.totals))
    }
}
