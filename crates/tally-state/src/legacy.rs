//! What the releases before group keys wrote: a window key as (window start, customer,
//! currency). A state directory and changelog they left are read, so that a deployment upgrades
//! in place.

use std::collections::BTreeMap;

use compact_str::CompactString;
use serde::{Deserialize, Serialize};
use tally_core::{
    Checkpoint, DeadLetter, Epoch, OutputRow, PartitionCheckpoint, PartitionId, WindowAgg,
    WindowKey,
};

/// revenue_agg's window key as changelog format 1 and store format 2 encode it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowKeyV1 {
    pub window_start_ms: i64,
    pub customer_id: CompactString,
    pub currency: CompactString,
}

impl From<WindowKeyV1> for WindowKey {
    fn from(k: WindowKeyV1) -> WindowKey {
        WindowKey::of_orders(k.window_start_ms, k.customer_id, k.currency)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRowV1 {
    pub partition: PartitionId,
    pub key: WindowKeyV1,
    pub window_end_ms: i64,
    pub value: WindowAgg,
}

/// A [`Checkpoint`] as store format 2 keeps an epoch's pending outputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointV1 {
    pub epoch: Epoch,
    pub partitions: BTreeMap<PartitionId, PartitionCheckpoint>,
    pub rows: Vec<OutputRowV1>,
    pub seen: Vec<(PartitionId, String, i64)>,
    pub dead_letters: Vec<DeadLetter>,
    pub close_windows_before: Vec<(PartitionId, i64)>,
    pub expire_seen_before: Vec<(PartitionId, i64)>,
}

impl From<CheckpointV1> for Checkpoint {
    fn from(c: CheckpointV1) -> Checkpoint {
        Checkpoint {
            epoch: c.epoch,
            partitions: c.partitions,
            rows: c
                .rows
                .into_iter()
                .map(|r| OutputRow {
                    partition: r.partition,
                    key: r.key.into(),
                    window_end_ms: r.window_end_ms,
                    value: r.value,
                })
                .collect(),
            seen: c.seen,
            dead_letters: c.dead_letters,
            close_windows_before: c.close_windows_before,
            expire_seen_before: c.expire_seen_before,
        }
    }
}
