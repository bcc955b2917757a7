//! `tally reconcile` for a declared job: the committed source ranges read again through the
//! job's declaration, in memory, and each window merged across source partitions as the view
//! merges them, against the view at the same cut. Counts, integers, decimals and times must
//! match exactly, floats within 1e-9 relative.

use std::sync::Arc;

use anyhow::Result;
use tally_clickhouse::ClickHouseSink;
use tally_core::declare::Job;
use tally_core::{OutputRow, WindowAgg};

use super::reconcile::{ReconcileFilter, Reconciliation, Replayed, SourceReplay, replay_committed};
use super::rounds::RoundRows;
use super::verify_declared::{RowKey, ViewTypes, WindowDiff, Windows, counted, shown_of};
use tally_runtime::config::Config;

fn declared_row(row: &OutputRow) -> (RowKey, WindowAgg) {
    (
        (
            row.key.window_start_ms,
            row.key.key.parts().iter().map(|p| p.to_string()).collect(),
        ),
        row.value.clone(),
    )
}

impl ReconcileFilter {
    /// `--customer` is the first group-by value of a declared job.
    pub(crate) fn keeps_row(&self, (start, keys): &RowKey) -> bool {
        self.from_ms.is_none_or(|f| *start >= f)
            && self.to_ms.is_none_or(|t| *start < t)
            && self
                .customer
                .as_ref()
                .is_none_or(|c| keys.first() == Some(c))
    }
}

/// A window's values of each source partition merged as the view merges them, and shown as
/// the view shows them; `None` for a group the view leaves out (a job of changes whose rows
/// were all retracted: a count of 0).
fn merged_shown(
    job: &Job,
    key: &RowKey,
    per_partition: &std::collections::BTreeMap<i32, WindowAgg>,
) -> Result<Option<Vec<crate::loadgen::Shown>>> {
    let mut merged = job.empty_value();
    for value in per_partition.values() {
        job.merge(&mut merged, value)
            .map_err(|o| anyhow::anyhow!("window {key:?}: {o:?} merging partitions"))?;
    }
    let emptied = job.changes.is_some()
        && job
            .aggregates
            .iter()
            .position(|a| a.function == tally_core::declare::Function::Count)
            .and_then(|i| shown_of(job, &merged).get(i).copied())
            == Some(crate::loadgen::Shown::Exact(0));
    Ok((!emptied).then(|| shown_of(job, &merged)))
}

/// A declared job's rows for `reconcile --every`: each window's partitions merged by the
/// declaration, every shown column compared.
pub(crate) struct DeclaredRows {
    job: Arc<Job>,
    types: ViewTypes,
}

impl DeclaredRows {
    pub(crate) fn of(config: &Config, job: &Arc<Job>) -> Result<DeclaredRows> {
        Ok(DeclaredRows {
            job: job.clone(),
            types: ViewTypes::of(config, job)?,
        })
    }
}

impl RoundRows for DeclaredRows {
    type Key = RowKey;
    type Value = WindowAgg;

    fn row(&self) -> fn(&OutputRow) -> (RowKey, WindowAgg) {
        declared_row
    }

    fn first_at(ms: i64) -> RowKey {
        (ms, Vec::new())
    }

    fn keeps(filter: &ReconcileFilter, key: &RowKey) -> bool {
        filter.keeps_row(key)
    }

    async fn compare(
        &self,
        sink: &ClickHouseSink,
        cut: &tally_clickhouse::Cut,
        changed: &std::collections::BTreeSet<RowKey>,
        replay: &SourceReplay<RowKey, WindowAgg>,
        result: &mut Reconciliation,
    ) -> Result<()> {
        let (Some(first), Some(last)) = (changed.first(), changed.last()) else {
            return Ok(());
        };
        let mut expected = Windows::new();
        for key in changed {
            if let Some(per_partition) = replay.values.get(key)
                && let Some(shown) = merged_shown(&self.job, key, per_partition)?
            {
                expected.insert(key.clone(), shown);
            }
        }
        let found: Windows = self
            .types
            .read(
                sink.read_view_at_cells(cut, Some((first.0, last.0)))
                    .await?,
            )?
            .into_iter()
            .filter(|(k, _)| changed.contains(k))
            .collect();
        result.mismatched += WindowDiff::compare(&expected, &found).len();
        result.source_orders += counted(&self.job, &expected).map_or(0, |c| c.0);
        result.sink_orders += counted(&self.job, &found).map_or(0, |c| c.0);
        Ok(())
    }
}

/// Recomputes a declared job's windows from the source up to the last committed epoch and
/// compares them with the view at that epoch.
pub async fn reconcile_declared(
    config: &Config,
    job: &Arc<Job>,
    filter: &ReconcileFilter,
    print: bool,
) -> Result<Reconciliation> {
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let Some(Replayed {
        epoch,
        cut,
        gaps,
        replay,
        duplicates: source_duplicates,
    }) = replay_committed(config, &sink, declared_row, print).await?
    else {
        return Ok(Reconciliation::default());
    };
    let mut source = Windows::new();
    for (key, per_partition) in &replay.values {
        if filter.keeps_row(key)
            && let Some(shown) = merged_shown(job, key, per_partition)?
        {
            source.insert(key.clone(), shown);
        }
    }
    let found: Windows = ViewTypes::of(config, job)?
        .read(sink.read_view_at_cells(&cut, None).await?)?
        .into_iter()
        .filter(|(k, _)| filter.keeps_row(k))
        .collect();
    let diff = WindowDiff::compare(&source, &found);
    let source_counted = counted(job, &source).map_or(0, |c| c.0);
    let sink_counted = counted(job, &found).map_or(0, |c| c.0);
    let keys: std::collections::BTreeSet<&RowKey> = source.keys().chain(found.keys()).collect();
    let result = Reconciliation {
        epoch: Some(epoch),
        keys: keys.len(),
        mismatched: diff.len() + gaps.len(),
        source_duplicates,
        source_orders: source_counted,
        sink_orders: sink_counted,
        ..Reconciliation::default()
    };
    if print {
        println!(
            "reconcile at committed epoch {epoch}: {} keys, {} differ",
            result.keys,
            diff.len()
        );
        for gap in gaps.iter().take(20) {
            println!("  commit log: {gap}");
        }
        println!(
            "{:<26} {:>16} {:>16} {:>10.6}",
            "records counted (windows)",
            source_counted,
            sink_counted,
            result.orders_ratio()
        );
        diff.print("windows", 20);
        println!(
            "reconcile: {}",
            if result.mismatched > 0 {
                "FAILED".to_owned()
            } else if result.keys == 0 {
                "NOTHING COMPARED: no window in range on either side".to_owned()
            } else {
                format!(
                    "{} ({} windows compared at the committed cut)",
                    "OK: every window matches the source", result.keys
                )
            }
        );
    }
    Ok(result)
}
