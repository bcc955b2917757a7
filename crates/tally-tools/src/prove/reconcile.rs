//! `tally reconcile`: the committed source ranges read again through the job's declaration, in
//! memory, and each window merged across source partitions as the view merges them, against the
//! view at the same cut. Counts, integers, decimals and times must match exactly, floats within
//! 1e-9 relative.

use std::sync::Arc;

use anyhow::Result;
use tally_clickhouse::ClickHouseSink;
use tally_core::declare::Job;
use tally_core::{Epoch, OutputRow, WindowAgg};

use super::replay::{Replayed, SourceReplay, replay_committed};
use super::restated::RowKey;
use super::verify::{ColumnTotal, ViewTypes, WindowDiff, Windows, first_sum, shown_of, totals};
use crate::loadgen::Shown;
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

/// Which windows a reconciliation compares: by window start, and by the first group-by value
/// (`--customer`).
#[derive(Debug, Clone, Default)]
pub struct ReconcileFilter {
    pub from_ms: Option<i64>,
    pub to_ms: Option<i64>,
    pub customer: Option<String>,
}

/// Result of one reconciliation.
#[derive(Debug, Default, Clone)]
pub struct Reconciliation {
    pub epoch: Option<Epoch>,
    /// Records of the committed range whose event id was seen before: what the producers re-sent.
    pub source_duplicates: u64,
    pub keys: usize,
    pub mismatched: usize,
    /// Records counted: the total of the job's first `count` column (revenue_agg's orders).
    pub source_orders: u64,
    pub sink_orders: u64,
    /// The total of its first exact `sum` column (revenue_agg's revenue), in units.
    pub source_revenue: i128,
    pub sink_revenue: i128,
}

impl Reconciliation {
    pub fn orders_ratio(&self) -> f64 {
        ratio(self.sink_orders as f64, self.source_orders as f64)
    }

    pub fn revenue_ratio(&self) -> f64 {
        ratio(self.sink_revenue as f64, self.source_revenue as f64)
    }

    /// The ratios for a report: records counted, and the first exact sum's by its column.
    pub fn ratios(&self, job: &Job) -> String {
        let sum = first_sum(job);
        let mut text = format!("records counted ratio {:.6}", self.orders_ratio());
        if let Some(sum) = sum {
            text += &format!(", {} ratio {:.6}", sum.column, self.revenue_ratio());
        }
        text
    }
}

fn ratio(sink: f64, source: f64) -> f64 {
    if source == 0.0 {
        if sink == 0.0 { 1.0 } else { f64::INFINITY }
    } else {
        sink / source
    }
}

impl ReconcileFilter {
    /// The filter, for a new version restating from a time: only its windows from then on
    /// (its own view holds no other).
    pub(crate) fn of_version(&self, config: &Config) -> ReconcileFilter {
        ReconcileFilter {
            from_ms: self.from_ms.max(config.computes_from_ms()),
            ..self.clone()
        }
    }

    /// `--customer` is the job's first group-by value.
    pub(crate) fn keeps(&self, (start, keys): &RowKey) -> bool {
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
) -> Result<Option<Vec<Shown>>> {
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
            == Some(Shown::Exact(0));
    Ok((!emptied).then(|| shown_of(job, &merged)))
}

/// The job's rows for `reconcile --every`: each window's partitions merged by the declaration,
/// every shown column compared.
pub(crate) struct WindowRows {
    job: Arc<Job>,
    types: ViewTypes,
}

impl WindowRows {
    pub(crate) fn of(config: &Config, job: &Arc<Job>) -> Result<WindowRows> {
        Ok(WindowRows {
            job: job.clone(),
            types: ViewTypes::of(config, job)?,
        })
    }
}

impl WindowRows {
    pub(crate) fn row(&self) -> fn(&OutputRow) -> (RowKey, WindowAgg) {
        declared_row
    }

    /// Compares the recomputed `changed` windows with the view at `cut`, adding to `result`.
    pub(crate) async fn compare(
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
        let (source_orders, source_revenue) = totals(&self.job, &expected);
        let (sink_orders, sink_revenue) = totals(&self.job, &found);
        result.source_orders += source_orders;
        result.sink_orders += sink_orders;
        result.source_revenue += source_revenue;
        result.sink_revenue += sink_revenue;
        Ok(())
    }
}

/// Recomputes the job's windows from the source up to the last committed epoch, with the same
/// rules but none of the worker's state, and compares them with the view at that epoch; `print`
/// reports on stdout.
pub async fn reconcile(
    config: &Config,
    filter: &ReconcileFilter,
    print: bool,
) -> Result<Reconciliation> {
    let job = &config.declared;
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
        if filter.keeps(key)
            && let Some(shown) = merged_shown(job, key, per_partition)?
        {
            source.insert(key.clone(), shown);
        }
    }
    let found: Windows = ViewTypes::of(config, job)?
        .read(sink.read_view_at_cells(&cut, None).await?)?
        .into_iter()
        .filter(|(k, _)| filter.keeps(k))
        .collect();
    let diff = WindowDiff::compare(&source, &found);
    let (source_orders, source_revenue) = totals(job, &source);
    let (sink_orders, sink_revenue) = totals(job, &found);
    let keys: std::collections::BTreeSet<&RowKey> = source.keys().chain(found.keys()).collect();
    let result = Reconciliation {
        epoch: Some(epoch),
        keys: keys.len(),
        mismatched: diff.len() + gaps.len(),
        source_duplicates,
        source_orders,
        sink_orders,
        source_revenue,
        sink_revenue,
    };
    if print {
        if let (_, Some(line)) = super::restated::readers_read(config, &sink).await? {
            println!("{line}; reconcile compares its windows");
        }
        println!(
            "reconcile at committed epoch {epoch}: {} keys, {} differ",
            result.keys,
            diff.len()
        );
        for gap in gaps.iter().take(20) {
            println!("  commit log: {gap}");
        }
        print_ratios(job, &source, &found, &diff);
        println!(
            "reconcile: {}",
            if result.mismatched > 0 {
                "FAILED".to_owned()
            } else if result.keys == 0 {
                "NOTHING COMPARED: no window in range on either side".to_owned()
            } else {
                format!(
                    "{} ({} windows compared at the committed cut)",
                    "OK: every ratio is 1", result.keys
                )
            }
        );
    }
    Ok(result)
}

/// The totals of each count and exact sum column, source against sink, and the first windows
/// that differ with each such column's ratio.
fn print_ratios(job: &Job, source: &Windows, found: &Windows, diff: &WindowDiff) {
    let (source_orders, _) = totals(job, source);
    let (sink_orders, _) = totals(job, found);
    println!(
        "{:<26} {:>20} {:>20} {:>12}",
        "", "source", "sink", "sink/source"
    );
    println!(
        "{:<26} {:>20} {:>20} {:>12.6}",
        "records counted (windows)",
        source_orders,
        sink_orders,
        ratio(sink_orders as f64, source_orders as f64)
    );
    let sums = |w: &Windows| ColumnTotal::of(job, w).into_iter().filter(|c| !c.count);
    for (s, f) in sums(source).zip(sums(found)) {
        println!(
            "{:<26} {:>20} {:>20} {:>12.6}",
            s.column,
            s.shown(),
            f.shown(),
            ratio(f.total as f64, s.total as f64)
        );
    }
    let window = |(w, k): &RowKey| format!("{} {}", tally_core::time::format_ms(*w), k.join(" "));
    let columns: Vec<(usize, &str)> = job
        .aggregates
        .iter()
        .enumerate()
        .map(|(at, a)| (at, a.column.as_str()))
        .collect();
    for (k, e, f) in diff.different.iter().take(20) {
        let ratios: Vec<String> = columns
            .iter()
            .filter_map(|&(at, column)| match (e.get(at), f.get(at)) {
                (Some(Shown::Exact(e)), Some(Shown::Exact(f))) => {
                    Some(format!("{column} ratio {:.6}", ratio(*f as f64, *e as f64)))
                }
                (Some(Shown::Float(e)), Some(Shown::Float(f))) => {
                    Some(format!("{column} ratio {:.6}", ratio(*f, *e)))
                }
                _ => None,
            })
            .collect();
        println!("  {}: {}", window(k), ratios.join(", "));
    }
    for k in diff.missing.iter().take(20) {
        println!("  {}: missing in sink (ratio 0)", window(k));
    }
    for k in diff.extra.iter().take(20) {
        println!("  {}: not in source (ratio inf)", window(k));
    }
}
