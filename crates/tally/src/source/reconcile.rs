//! `tally reconcile --source`: the check a data engineer writes by hand, independent of tally's
//! decoder and state. The declaration's aggregation runs as SQL on the source table (in one
//! snapshot) and every window and column is compared with the view at the job's committed cut.
//! Windows final for every partition at that cut (before the fold frontier its watermarks
//! allow) must match: nothing can change them in the view any more. Windows still open may
//! differ because changes after the cut are not in the view yet: they are reported apart, and
//! fail only with `--strict` (a test that stopped the source and let the job catch up).

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, bail};
use tally_clickhouse::{ClickHouseSink, Cut};
use tally_core::WindowAgg;
use tally_core::declare::{Function, Job, lsn_text};

use super::Source;
use super::sql::{self, Aggregation};
use crate::config::Config;
use crate::prove::{ReconcileFilter, Reconciliation, ViewTypes, WindowDiff, Windows, shown_of};

/// What one reconciliation against the source table found.
#[derive(Debug, Default)]
pub struct SourceReconciliation {
    /// Window start below which every window is final at the cut (ms); `None` before every
    /// partition has a watermark.
    pub frontier_ms: Option<i64>,
    pub settled: Reconciliation,
    pub moving: Reconciliation,
    /// `pg_current_wal_lsn()` when the source was read, and the newest LSN the job committed.
    pub source_lsn: u64,
    pub committed_lsn: u64,
}

impl SourceReconciliation {
    /// Whether it fails: a settled window differs (or, `strict`, any window).
    pub fn fails(&self, strict: bool) -> bool {
        self.settled.mismatched > 0 || (strict && self.moving.mismatched > 0)
    }
}

/// The source table's windows, as the view shows them: per window start and keys (canonical
/// text, as the view's cells are read), the words tally would keep.
async fn source_windows(
    source: &Source,
    job: &Job,
    filter: &ReconcileFilter,
    types: &ViewTypes,
) -> Result<(BTreeMap<(i64, Vec<String>), WindowAgg>, u64)> {
    let mut client = source.connect().await?;
    let columns = source.columns(&client).await?;
    let Aggregation { sql, keys, words } =
        sql::aggregation(job, &source.table, &columns, filter.from_ms, filter.to_ms).map_err(
            |problems| {
                anyhow::anyhow!(
                    "source table {} does not fit the declaration: {}",
                    source.table,
                    problems.join("; ")
                )
            },
        )?;
    let aggregation = Aggregation {
        sql: sql.clone(),
        keys,
        words: words.clone(),
    };
    // One snapshot for the LSN and the rows.
    let transaction = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .context("source: starting a read-only transaction")?;
    let lsn_row = transaction
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .context("source: reading the current WAL position")?;
    let lsn = super::lsn(&lsn_row.get::<_, String>(0))?;
    let rows = transaction
        .query(sql.as_str(), &[])
        .await
        .with_context(|| format!("source: running {sql}"))?;
    transaction
        .commit()
        .await
        .context("source: ending the read")?;
    let mut out = BTreeMap::new();
    for row in rows {
        let start: i64 = row.try_get(0).context("source: window start")?;
        let mut key = Vec::with_capacity(keys);
        for i in 0..keys {
            let text: Option<String> = row.try_get(1 + i).context("source: key")?;
            key.push(types.canonical_key(i, &text.unwrap_or_default())?);
        }
        let texts: Vec<String> = (0..words.len())
            .map(|i| {
                let at = 1 + keys + i;
                match words[i] {
                    None => row.try_get::<_, i64>(at).map(|n| n.to_string()),
                    Some(_) => row
                        .try_get::<_, Option<String>>(at)
                        .map(|t| t.unwrap_or_else(|| "0".into())),
                }
            })
            .collect::<Result<_, _>>()
            .context("source: aggregate")?;
        let value = aggregation.window(&texts).map_err(anyhow::Error::msg)?;
        if filter
            .customer
            .as_ref()
            .is_none_or(|c| key.first() == Some(c))
        {
            out.insert((start, key), value);
        }
    }
    Ok((out, lsn))
}

/// The windows final for every partition at the batches read: before the frontier their
/// lowest watermark allows.
fn settled_frontier(config: &Config, batches: &[tally_clickhouse::BatchAccounting]) -> Option<i64> {
    let mut watermarks: BTreeMap<i32, i64> = BTreeMap::new();
    for b in batches {
        for (p, w) in b.partitions.iter().zip(&b.watermarks) {
            let e = watermarks.entry(*p).or_insert(*w);
            *e = (*e).max(*w);
        }
    }
    let lowest = watermarks.values().copied().min()?;
    (lowest != i64::MIN).then(|| config.fold_rules().frontier_ms(lowest))
}

/// Sums of a window map's first count column and first sum column (the ratios' terms).
fn totals(job: &Job, windows: &Windows) -> (u64, i128) {
    let count_at = job
        .aggregates
        .iter()
        .position(|a| a.function == Function::Count);
    let sum_at = job
        .aggregates
        .iter()
        .position(|a| a.function == Function::Sum);
    let mut out = (0u64, 0i128);
    for shown in windows.values() {
        if let Some(crate::loadgen::Shown::Exact(n)) = count_at.and_then(|i| shown.get(i)) {
            out.0 += u64::try_from(*n).unwrap_or(0);
        }
        if let Some(crate::loadgen::Shown::Exact(s)) = sum_at.and_then(|i| shown.get(i)) {
            out.1 += s;
        }
    }
    out
}

fn reconciliation(job: &Job, expected: &Windows, found: &Windows, diff: usize) -> Reconciliation {
    let keys: BTreeSet<_> = expected.keys().chain(found.keys()).collect();
    let (source_orders, source_revenue) = totals(job, expected);
    let (sink_orders, sink_revenue) = totals(job, found);
    Reconciliation {
        keys: keys.len(),
        mismatched: diff,
        source_orders,
        sink_orders,
        source_revenue,
        sink_revenue,
        ..Reconciliation::default()
    }
}

/// Reconciles the view with the source table `url` (or `source.postgres`).
pub async fn reconcile_source(
    config: &Config,
    url: Option<&str>,
    filter: &ReconcileFilter,
    print: bool,
) -> Result<SourceReconciliation> {
    let Some(job) = config.declared.clone() else {
        bail!(
            "reconcile --source: job {} is not declared",
            config.job.name
        );
    };
    let source = Source::of(config, url)?;
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let types = ViewTypes::of(config, &job)?;
    // The job's cut first, then the source: the source holds at least what the cut applied.
    let batches = sink.batch_accounting().await?;
    let cut = Cut::of_ends(batches.iter().map(|b| (&b.partitions, &b.to_offsets)));
    let frontier_ms = settled_frontier(config, &batches);
    let committed_lsn = batches.iter().map(|b| b.source_lsn).max().unwrap_or(0);
    let found: Windows = if batches.is_empty() {
        Windows::new()
    } else {
        types
            .read(sink.read_view_at_cells(&cut, None).await?)?
            .into_iter()
            .filter(|(k, _)| filter.keeps_row(k))
            .collect()
    };
    let (windows, source_lsn) = source_windows(&source, &job, filter, &types).await?;
    let expected: Windows = windows
        .iter()
        .map(|(k, v)| (k.clone(), shown_of(&job, v)))
        .collect();
    let settled = |k: &(i64, Vec<String>)| frontier_ms.is_some_and(|f| k.0 < f);
    let split = |w: &Windows, want: bool| -> Windows {
        w.iter()
            .filter(|(k, _)| settled(k) == want)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let (expected_settled, found_settled) = (split(&expected, true), split(&found, true));
    let (expected_moving, found_moving) = (split(&expected, false), split(&found, false));
    let settled_diff = WindowDiff::compare(&expected_settled, &found_settled);
    let moving_diff = WindowDiff::compare(&expected_moving, &found_moving);
    let result = SourceReconciliation {
        frontier_ms,
        settled: reconciliation(&job, &expected_settled, &found_settled, settled_diff.len()),
        moving: reconciliation(&job, &expected_moving, &found_moving, moving_diff.len()),
        source_lsn,
        committed_lsn,
    };
    if print {
        let frontier = frontier_ms.map_or("no window yet".to_owned(), tally_core::time::format_ms);
        println!(
            "reconcile --source {} at {}: source read at LSN {}; the job committed changes up to LSN {}",
            source.table,
            source.url(),
            lsn_text(source_lsn),
            lsn_text(committed_lsn)
        );
        let row = |label: &str, r: &Reconciliation| {
            println!(
                "{label:<44} {:>6} keys {:>5} differ; records counted {:>10} / {:<10} ratio {:.6}; sum ratio {:.6}",
                r.keys,
                r.mismatched,
                r.sink_orders,
                r.source_orders,
                r.orders_ratio(),
                r.revenue_ratio()
            );
        };
        row(
            &format!("windows settled (before {frontier})"),
            &result.settled,
        );
        row(
            "windows still moving (open at the job's cut)",
            &result.moving,
        );
        settled_diff.print("settled windows", 20);
        if !moving_diff.is_empty() {
            println!(
                "  still moving (not a failure: changes after the job's cut, or a window within window.allowed_lateness):"
            );
            moving_diff.print("moving windows", 10);
        }
        println!(
            "reconcile --source: {}",
            if result.settled.mismatched > 0 {
                "FAILED: settled windows differ from the source table"
            } else if result.moving.mismatched > 0 {
                "OK for every settled window; some windows still moving differ"
            } else {
                "OK: every window matches the source table"
            }
        );
    }
    Ok(result)
}

/// `reconcile --source --every`: a reconciliation against the table every `every`, each
/// exported as the gauges `reconcile --every` sets (its ratios and mismatches those of the
/// settled windows).
pub async fn reconcile_source_every(
    config: &Config,
    url: Option<&str>,
    filter: &ReconcileFilter,
    every: std::time::Duration,
) -> Result<()> {
    let readiness = std::sync::Arc::new(crate::health::Readiness::default());
    readiness.set_restored();
    crate::health::serve(
        &config.metrics.address,
        vec![(config.job.name.clone(), readiness)],
    )
    .await?;
    loop {
        let round = reconcile_source(config, url, filter, true).await.map(|r| {
            crate::events::ReconcileRound {
                full: true,
                epoch: None,
                records_read: r.settled.source_orders + r.moving.source_orders,
                keys: r.settled.keys,
                mismatched: r.settled.mismatched,
                orders_ratio: r.settled.orders_ratio(),
                revenue_ratio: r.settled.revenue_ratio(),
            }
        });
        crate::events::Reconciled { round: &round }.emit();
        tokio::time::sleep(every).await;
    }
}
