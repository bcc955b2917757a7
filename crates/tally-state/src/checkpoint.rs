//! The last checkpoint as the store records it: its epoch, where it is in the commit protocol,
//! and every partition's progress.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tally_core::{Epoch, PartitionCheckpoint, PartitionId};

/// Where the last checkpoint is in the commit protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EpochStatus {
    /// State, offsets and outputs are durable here; the sinks may or may not have them.
    PreCommitted,
    /// Every sink has the epoch's outputs.
    Committed,
}

/// The last checkpoint: epoch, its status and the progress of every partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub job: String,
    pub epoch: Epoch,
    pub status: EpochStatus,
    pub partitions: BTreeMap<PartitionId, PartitionCheckpoint>,
    /// Per partition, dedup entries and windows before these cutoffs are already gone: the
    /// next expiry starts here instead of walking the tombstones of every earlier one.
    pub expired_seen_before: BTreeMap<PartitionId, i64>,
    pub closed_windows_before: BTreeMap<PartitionId, i64>,
}
