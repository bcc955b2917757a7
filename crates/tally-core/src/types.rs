//! Named concepts shared by every crate: partitions, offsets, epochs, barriers, window keys,
//! dead letters and accounting.

use compact_str::CompactString;
use serde::{Deserialize, Serialize};

use crate::decode::PoisonReason;
use crate::group_key::GroupKey;
use crate::window_agg::WindowAgg;

/// A source partition of the job's topic.
pub type PartitionId = i32;
/// A Kafka offset; checkpoints store the *next* offset to consume.
pub type Offset = i64;

/// A checkpoint number. Epoch `n` covers the input consumed after checkpoint `n-1` up to
/// checkpoint `n`; epochs are never reused, so an epoch names one immutable batch of output.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Epoch(pub u64);

impl Epoch {
    pub fn next(self) -> Epoch {
        Epoch(self.0 + 1)
    }
}

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The signal that stops processing at a consistent point: every record before it belongs to
/// `epoch`, every record after it to the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointBarrier {
    pub epoch: Epoch,
    /// Set on graceful shutdown: the last checkpoint of this process.
    pub is_final: bool,
}

/// Identity of one aggregate within a partition: its window and its group-by values. Ordered by
/// window, then key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WindowKey {
    pub window_start_ms: i64,
    pub key: GroupKey,
}

impl WindowKey {
    /// revenue_agg's window of a customer's orders in a currency.
    pub fn of_orders(
        window_start_ms: i64,
        customer_id: impl Into<CompactString>,
        currency: impl Into<CompactString>,
    ) -> WindowKey {
        WindowKey {
            window_start_ms,
            key: GroupKey::new([customer_id.into(), currency.into()]),
        }
    }

    /// revenue_agg's customer: the key's first part.
    pub fn customer_id(&self) -> &str {
        self.key.part(0)
    }

    /// revenue_agg's currency: the key's second part.
    pub fn currency(&self) -> &str {
        self.key.part(1)
    }
}

/// One row of a checkpoint's output batch: a window's full value in one source partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRow {
    pub partition: PartitionId,
    pub key: WindowKey,
    pub window_end_ms: i64,
    pub value: WindowAgg,
}

impl OutputRow {
    /// Puts a batch's rows in their one order (partition, then window), so that a batch is the
    /// same whoever builds it: the operator's cut, a restart, a restore.
    pub fn sort_batch(rows: &mut [OutputRow]) {
        rows.sort_by(|a, b| (a.partition, &a.key).cmp(&(b.partition, &b.key)));
    }
}

/// A record that could not be aggregated, kept byte for byte with its origin and reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub partition: PartitionId,
    pub offset: Offset,
    pub timestamp_ms: Option<i64>,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub reason: PoisonReason,
    pub error: String,
}

/// Where every consumed record went. Invariant:
/// `consumed == aggregated + duplicates + late + dead_lettered + filtered + stale + tombstones`.
/// For a job of changes, `aggregated` counts the changes applied, `duplicates` the changes
/// repeated at the position already applied to their row, `stale` those older than it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Accounting {
    pub consumed: u64,
    pub aggregated: u64,
    pub duplicates: u64,
    pub late: u64,
    /// Poison records (every reason except `late`).
    pub dead_lettered: u64,
    /// Sum of the amounts aggregated, in 10^-4 units; i128 because totals outgrow a window.
    pub revenue_units: i128,
    /// Valid records the declaration's filter leaves out.
    pub filtered: u64,
    /// Changes older than the one already applied to their row (a source's replay).
    pub stale: u64,
    /// Records without a value (a change source's tombstone after a delete).
    pub tombstones: u64,
}

impl Accounting {
    /// What became of the records: (aggregated, filtered, duplicates, late, dead-lettered).
    pub fn fates(&self) -> [u64; 5] {
        [
            self.aggregated,
            self.filtered,
            self.duplicates,
            self.late,
            self.dead_lettered,
        ]
    }

    pub fn balances(&self) -> bool {
        self.consumed
            == self.aggregated
                + self.duplicates
                + self.late
                + self.dead_lettered
                + self.filtered
                + self.stale
                + self.tombstones
    }

    pub fn add(&mut self, other: &Accounting) {
        self.consumed += other.consumed;
        self.aggregated += other.aggregated;
        self.duplicates += other.duplicates;
        self.late += other.late;
        self.dead_lettered += other.dead_lettered;
        self.revenue_units += other.revenue_units;
        self.filtered += other.filtered;
        self.stale += other.stale;
        self.tombstones += other.tombstones;
    }
}
