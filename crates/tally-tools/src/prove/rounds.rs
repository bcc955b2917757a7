//! What `reconcile --every` needs of one kind of job's rows: kept apart so that the rounds
//! (`reconcile_every`) and each kind's rows (there, and `reconcile_declared`) import it, not
//! each other.

use std::collections::BTreeSet;

use anyhow::Result;
use tally_clickhouse::ClickHouseSink;
use tally_core::OutputRow;

use super::reconcile::{ReconcileFilter, Reconciliation, SourceReplay};

/// How `reconcile --every` keys, recomputes and compares the rows of one kind of job:
/// revenue_agg's, or a declared job's.
pub(crate) trait RoundRows {
    type Key: Ord + Clone + Send;
    type Value: Send;
    /// A checkpoint's row as the replay keeps it.
    fn row(&self) -> fn(&OutputRow) -> (Self::Key, Self::Value);
    /// The first key of windows starting at `ms`.
    fn first_at(ms: i64) -> Self::Key;
    fn keeps(filter: &ReconcileFilter, key: &Self::Key) -> bool;
    /// Compares the recomputed `changed` windows with the view at `cut`, adding to `result`.
    async fn compare(
        &self,
        sink: &ClickHouseSink,
        cut: &tally_clickhouse::Cut,
        changed: &BTreeSet<Self::Key>,
        replay: &SourceReplay<Self::Key, Self::Value>,
        result: &mut Reconciliation,
    ) -> Result<()>;
}
