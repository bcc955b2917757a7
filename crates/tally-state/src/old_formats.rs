//! The encodings earlier releases wrote, each with its conversion to today's: the window keys
//! of the releases before group keys, (window start, customer, currency), the window values of
//! the releases before values of any shape, (orders, revenue), the accounting of the releases
//! before filters (no `filtered` count) and before change jobs (no `stale` or `tombstones`
//! count, no newest source position). The store's upgrade and the changelog's decoder read
//! them.

use std::collections::BTreeMap;

use crate::checkpoint::{CheckpointMeta, EpochStatus};
use compact_str::CompactString;
use serde::{Deserialize, Serialize};
use tally_core::{
    Accounting, Amount, Checkpoint, DeadLetter, Epoch, Offset, OutputRow, PartitionCheckpoint,
    PartitionId, Watermark, WindowAgg, WindowKey,
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

/// revenue_agg's window value as changelog formats 1 and 2 and store formats 1 to 3 encode it
/// (the store's windows still hold these bytes: `values.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowAggV2 {
    pub orders: u64,
    pub revenue: Amount,
}

impl From<WindowAggV2> for WindowAgg {
    fn from(v: WindowAggV2) -> WindowAgg {
        WindowAgg::of_orders(v.orders, v.revenue)
    }
}

/// An output row as store formats 2 (`K`: [`WindowKeyV1`]) and 3 (`K`: [`WindowKey`]) keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRowV1<K = WindowKeyV1> {
    pub partition: PartitionId,
    pub key: K,
    pub window_end_ms: i64,
    pub value: WindowAggV2,
}

impl<K: Into<WindowKey>> From<OutputRowV1<K>> for OutputRow {
    fn from(r: OutputRowV1<K>) -> OutputRow {
        OutputRow {
            partition: r.partition,
            key: r.key.into(),
            window_end_ms: r.window_end_ms,
            value: r.value.into(),
        }
    }
}

/// [`Accounting`] as the releases before filters encode it (store formats 1 to 4, changelog
/// formats 1 to 3): no `filtered` count, which is 0 for every job they ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AccountingV1 {
    pub consumed: u64,
    pub aggregated: u64,
    pub duplicates: u64,
    pub late: u64,
    pub dead_lettered: u64,
    pub revenue_units: i128,
}

impl From<AccountingV1> for Accounting {
    fn from(a: AccountingV1) -> Accounting {
        Accounting {
            consumed: a.consumed,
            aggregated: a.aggregated,
            duplicates: a.duplicates,
            late: a.late,
            dead_lettered: a.dead_lettered,
            revenue_units: a.revenue_units,
            ..Accounting::default()
        }
    }
}

/// [`Accounting`] as the releases before change jobs encode it (store format 5, changelog
/// format 4): no `stale` or `tombstones` count, which are 0 for every job they ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AccountingV2 {
    pub consumed: u64,
    pub aggregated: u64,
    pub duplicates: u64,
    pub late: u64,
    pub dead_lettered: u64,
    pub revenue_units: i128,
    pub filtered: u64,
}

impl From<AccountingV2> for Accounting {
    fn from(a: AccountingV2) -> Accounting {
        Accounting {
            filtered: a.filtered,
            ..AccountingV1 {
                consumed: a.consumed,
                aggregated: a.aggregated,
                duplicates: a.duplicates,
                late: a.late,
                dead_lettered: a.dead_lettered,
                revenue_units: a.revenue_units,
            }
            .into()
        }
    }
}

/// What format 5 wrote of an accounting (tests write records of its format).
#[cfg(test)]
impl From<Accounting> for AccountingV2 {
    fn from(a: Accounting) -> AccountingV2 {
        assert_eq!((a.stale, a.tombstones), (0, 0), "format 5 had no changes");
        AccountingV2 {
            consumed: a.consumed,
            aggregated: a.aggregated,
            duplicates: a.duplicates,
            late: a.late,
            dead_lettered: a.dead_lettered,
            revenue_units: a.revenue_units,
            filtered: a.filtered,
        }
    }
}

/// What an earlier release wrote of an accounting (tests write records of its formats).
#[cfg(test)]
impl From<Accounting> for AccountingV1 {
    fn from(a: Accounting) -> AccountingV1 {
        assert_eq!(a.filtered, 0, "earlier formats had no filtered count");
        AccountingV1 {
            consumed: a.consumed,
            aggregated: a.aggregated,
            duplicates: a.duplicates,
            late: a.late,
            dead_lettered: a.dead_lettered,
            revenue_units: a.revenue_units,
        }
    }
}

/// A [`PartitionCheckpoint`] of an earlier format, without a newest source position: `A` its
/// accounting, [`AccountingV1`] (store formats 1 to 4, changelog formats 1 to 3) or
/// [`AccountingV2`] (store format 5, changelog format 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PartitionCheckpointV1<A = AccountingV1> {
    pub epoch_start_offset: Offset,
    pub next_offset: Offset,
    pub watermark: Watermark,
    pub epoch: A,
    pub totals: A,
}

/// A partition's progress as store format 5 and changelog format 4 encode it.
pub type PartitionCheckpointV2 = PartitionCheckpointV1<AccountingV2>;

impl<A: Into<Accounting>> From<PartitionCheckpointV1<A>> for PartitionCheckpoint {
    fn from(c: PartitionCheckpointV1<A>) -> PartitionCheckpoint {
        PartitionCheckpoint {
            epoch_start_offset: c.epoch_start_offset,
            next_offset: c.next_offset,
            watermark: c.watermark,
            epoch: c.epoch.into(),
            totals: c.totals.into(),
            newest_change: None,
        }
    }
}

/// A [`CheckpointMeta`] as store formats 1 to 5 keep it (`P`: the format's progress).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMetaV1<P = PartitionCheckpointV1> {
    pub job: String,
    pub epoch: Epoch,
    pub status: EpochStatus,
    pub partitions: BTreeMap<PartitionId, P>,
    pub expired_seen_before: BTreeMap<PartitionId, i64>,
    pub closed_windows_before: BTreeMap<PartitionId, i64>,
}

impl<P: Into<PartitionCheckpoint>> From<CheckpointMetaV1<P>> for CheckpointMeta {
    fn from(m: CheckpointMetaV1<P>) -> CheckpointMeta {
        CheckpointMeta {
            job: m.job,
            epoch: m.epoch,
            status: m.status,
            partitions: brought_forward(m.partitions),
            expired_seen_before: m.expired_seen_before,
            closed_windows_before: m.closed_windows_before,
        }
    }
}

/// Partitions' progress of an earlier format, brought forward.
pub(crate) fn brought_forward<P: Into<PartitionCheckpoint>>(
    partitions: BTreeMap<PartitionId, P>,
) -> BTreeMap<PartitionId, PartitionCheckpoint> {
    partitions.into_iter().map(|(p, c)| (p, c.into())).collect()
}

/// A [`Checkpoint`] as earlier store formats keep an epoch's pending outputs: `R` the row
/// ([`OutputRowV1`] in formats 2 and 3, [`OutputRow`] in 4), `P` the partitions' progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointV1<R = OutputRowV1, P = PartitionCheckpointV1> {
    pub epoch: Epoch,
    pub partitions: BTreeMap<PartitionId, P>,
    pub rows: Vec<R>,
    pub seen: Vec<(PartitionId, String, i64)>,
    pub dead_letters: Vec<DeadLetter>,
    pub close_windows_before: Vec<(PartitionId, i64)>,
    pub expire_seen_before: Vec<(PartitionId, i64)>,
}

impl<R: Into<OutputRow>, P: Into<PartitionCheckpoint>> From<CheckpointV1<R, P>> for Checkpoint {
    fn from(c: CheckpointV1<R, P>) -> Checkpoint {
        Checkpoint {
            epoch: c.epoch,
            partitions: brought_forward(c.partitions),
            rows: c.rows.into_iter().map(Into::into).collect(),
            seen: c.seen,
            dead_letters: c.dead_letters,
            close_windows_before: c.close_windows_before,
            expire_seen_before: c.expire_seen_before,
            source_rows: Vec::new(),
        }
    }
}
