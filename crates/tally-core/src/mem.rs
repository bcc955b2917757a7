//! An in-memory state store: the model the RocksDB store is tested against, and the state of
//! independent recomputation (`tally reconcile`).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;

use crate::operator::{Checkpoint, PartitionCheckpoint, StateReader};
use crate::source_row::SourceRow;
use crate::types::{Epoch, PartitionId, WindowKey};
use crate::window_agg::WindowAgg;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemStore {
    pub epoch: Epoch,
    pub partitions: BTreeMap<PartitionId, PartitionCheckpoint>,
    pub windows: BTreeMap<(PartitionId, WindowKey), WindowAgg>,
    pub seen: HashMap<(PartitionId, String), i64>,
    pub source_rows: HashMap<(PartitionId, String), SourceRow>,
}

impl MemStore {
    /// Applies a checkpoint with the same semantics as the durable store.
    pub fn apply(&mut self, checkpoint: &Checkpoint) {
        self.epoch = checkpoint.epoch;
        for (&p, c) in &checkpoint.partitions {
            self.partitions.insert(p, *c);
        }
        for row in &checkpoint.rows {
            self.windows
                .insert((row.partition, row.key.clone()), row.value.clone());
        }
        for (p, id, t) in &checkpoint.seen {
            self.seen.insert((*p, id.clone()), *t);
        }
        for (p, key, row) in &checkpoint.source_rows {
            self.source_rows.insert((*p, key.clone()), row.clone());
        }
        for &(p, cutoff) in &checkpoint.close_windows_before {
            self.windows
                .retain(|(wp, k), _| *wp != p || k.window_start_ms >= cutoff);
        }
        for &(p, cutoff) in &checkpoint.expire_seen_before {
            self.seen.retain(|(sp, _), t| *sp != p || *t >= cutoff);
        }
    }
}

impl StateReader for MemStore {
    type Error = Infallible;

    fn window(
        &self,
        partition: PartitionId,
        key: &WindowKey,
    ) -> Result<Option<WindowAgg>, Infallible> {
        Ok(self.windows.get(&(partition, key.clone())).cloned())
    }

    fn seen_event_time(
        &self,
        partition: PartitionId,
        event_id: &str,
    ) -> Result<Option<i64>, Infallible> {
        Ok(self.seen.get(&(partition, event_id.to_owned())).copied())
    }

    fn source_row(
        &self,
        partition: PartitionId,
        key: &str,
    ) -> Result<Option<SourceRow>, Infallible> {
        Ok(self.source_rows.get(&(partition, key.to_owned())).cloned())
    }
}
