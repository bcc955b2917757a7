//! `tally reconcile --source`: the check a data engineer writes by hand, independent of tally's
//! decoder and state. The declaration's aggregation runs as SQL on the source table (in one
//! snapshot) and every window and column is compared with the view where both stand at the
//! same place ([`super::consistent`]): the view at a cut holding every change the snapshot
//! holds, the windows that later changes touched set apart for the next round. Every other
//! window must match, however young: a divergence in the last hour fails now, not once the
//! window is settled. When that point cannot be reached (no slot named, the connector or the
//! job not catching up in time) only windows final at the job's cut are compared, and it says so.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use tally_clickhouse::{ClickHouseSink, Cut};
use tally_core::WindowAgg;
use tally_core::declare::{Job, lsn_text};

use super::SourceDatabase;
use super::consistent::{self, Snapshot};
use super::sql::{self, Aggregation, Column};
use crate::prove::{
    ReconcileFilter, Reconciliation, ViewTypes, WindowDiff, Windows, shown_of, totals,
};
use tally_runtime::config::Config;

/// What one reconciliation against the source table found.
#[derive(Debug, Default)]
pub struct SourceReconciliation {
    /// Window start below which every window is final at the cut (ms); `None` before every
    /// partition has a watermark.
    pub frontier_ms: Option<i64>,
    pub settled: Reconciliation,
    /// Windows still open at the cut, compared where nothing after the snapshot touched them.
    pub open: Reconciliation,
    /// Windows changes after the snapshot touched: compared in the next round (or, with
    /// `--strict`, now).
    pub touched: usize,
    /// Why open windows were not compared, when they were not.
    pub open_not_compared: Option<String>,
    /// `pg_current_wal_lsn()` right after the snapshot, and the newest LSN the job committed.
    pub source_lsn: u64,
    pub committed_lsn: u64,
    /// Truncates read in the topic (the job stops at one).
    pub truncates: Vec<String>,
}

impl SourceReconciliation {
    /// Whether it fails: a compared window differs (or, `strict`, any window, and a round
    /// that could not compare open windows).
    pub fn fails(&self, strict: bool) -> bool {
        self.settled.mismatched > 0
            || self.open.mismatched > 0
            || (strict && self.open_not_compared.is_some())
    }

    /// Windows compared, settled and open.
    pub fn compared(&self) -> usize {
        self.settled.keys + self.open.keys
    }
}

/// The source table's rows in one snapshot, kept open until the windows that changes after it
/// touched have been read in it too.
struct TableSnapshot {
    client: tokio_postgres::Client,
    columns: Vec<Column>,
    snapshot: Snapshot,
    /// The WAL position read right after the snapshot was taken.
    lsn: u64,
}

impl TableSnapshot {
    async fn open(source: &SourceDatabase) -> Result<TableSnapshot> {
        let client = source.connect().await?;
        let columns = source.columns(&client).await?;
        client
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .context("source: starting a read-only transaction")?;
        // The first statement takes the snapshot; the WAL position is read after it.
        let row = client
            .query_one("SELECT pg_current_snapshot()::text", &[])
            .await
            .context("source: taking a snapshot")?;
        let snapshot = Snapshot::parse(&row.get::<_, String>(0))?;
        let row = client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .context("source: reading the current WAL position")?;
        let lsn = super::lsn(&row.get::<_, String>(0))?;
        Ok(TableSnapshot {
            client,
            columns,
            snapshot,
            lsn,
        })
    }

    /// Runs `aggregation` in the snapshot: per window start and keys (canonical text, as the
    /// view's cells are read), the words tally would keep.
    async fn windows(
        &self,
        aggregation: &Aggregation,
        types: &ViewTypes,
    ) -> Result<BTreeMap<(i64, Vec<String>), WindowAgg>> {
        let Aggregation { sql, keys, words } = aggregation;
        let rows = self
            .client
            .query(sql.as_str(), &[])
            .await
            .with_context(|| format!("source: running {sql}"))?;
        let mut out = BTreeMap::new();
        for row in rows {
            let start: i64 = row.try_get(0).context("source: window start")?;
            let mut key = Vec::with_capacity(*keys);
            for i in 0..*keys {
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
            out.insert((start, key), value);
        }
        Ok(out)
    }

    async fn close(self) -> Result<()> {
        self.client
            .batch_execute("COMMIT")
            .await
            .context("source: ending the read")
    }
}

fn fit(source: &SourceDatabase, result: Result<Aggregation, Vec<String>>) -> Result<Aggregation> {
    result.map_err(|problems| {
        anyhow::anyhow!(
            "source table {} does not fit the declaration: {}",
            source.table,
            problems.join("; ")
        )
    })
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

/// Reconciles the view with the source table `url` (or `source.postgres`), waiting up to
/// `wait` for the connector and the job to reach the table's snapshot.
pub async fn reconcile_source(
    config: &Config,
    url: Option<&str>,
    filter: &ReconcileFilter,
    wait: Duration,
    print: bool,
) -> Result<SourceReconciliation> {
    let job = config.declared.clone();
    let source = SourceDatabase::of(config, url)?;
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    // A new version's own view: its windows from restate_from on.
    let filter = &filter.of_version(config);
    if print && let (_, Some(line)) = crate::prove::readers_read(config, &sink).await? {
        println!("{line}; reconcile --source compares its windows with the table");
    }
    let types = ViewTypes::of(config, &job)?;
    // The job's cut first, then the source: every change the cut holds, the snapshot holds.
    let start_batches = sink.batch_accounting().await?;
    let start = Cut::of_ends(start_batches.iter().map(|b| (&b.partitions, &b.to_offsets)));
    let table = TableSnapshot::open(&source).await?;
    let all = fit(
        &source,
        sql::aggregation(
            &job,
            &source.table,
            &table.columns,
            filter.from_ms,
            filter.to_ms,
        ),
    )?;
    let keeps = |k: &(i64, Vec<String>)| {
        filter
            .customer
            .as_ref()
            .is_none_or(|c| k.1.first() == Some(c))
    };
    let source_windows: BTreeMap<_, _> = table
        .windows(&all, &types)
        .await?
        .into_iter()
        .filter(|(k, _)| keeps(k))
        .collect();
    let reached = consistent::reach(config, &source, &sink, table.lsn, wait).await?;
    let (batches, cut, touched, open_not_compared, truncates) = match reached {
        Ok(reached) => {
            let (job2, types2, snapshot, from, to) = (
                std::sync::Arc::clone(&job),
                types.clone(),
                table.snapshot.clone(),
                start.clone(),
                reached.cut.clone(),
            );
            let config2 = config.clone();
            let after = tokio::task::spawn_blocking(move || {
                consistent::changes_after(&config2, &job2, &types2, &snapshot, &from, &to)
            })
            .await
            .context("reading the changes after the snapshot")??;
            // Where the rows those changes touched were in the snapshot.
            let rows: Vec<Vec<String>> = after.rows.iter().cloned().collect();
            let mut touched: BTreeSet<(i64, Vec<String>)> = after.windows.clone();
            for chunk in rows.chunks(1_000) {
                let before = fit(
                    &source,
                    sql::aggregation_of_rows(&job, &source.table, &table.columns, chunk),
                )?;
                touched.extend(table.windows(&before, &types).await?.into_keys());
            }
            tracing::debug!(
                read = after.read,
                after = after.after,
                touched = touched.len(),
                confirmed = %lsn_text(reached.confirmed_lsn),
                "changes after the snapshot"
            );
            (reached.batches, reached.cut, touched, None, after.truncates)
        }
        Err(why) => (start_batches, start, BTreeSet::new(), Some(why), Vec::new()),
    };
    let snapshot_lsn = table.lsn;
    table.close().await?;
    let frontier_ms = settled_frontier(config, &batches);
    let committed_lsn = batches.iter().map(|b| b.source_lsn).max().unwrap_or(0);
    let found: Windows = if batches.is_empty() {
        Windows::new()
    } else {
        types
            .read(sink.read_view_at_cells(&cut, None).await?)?
            .into_iter()
            .filter(|(k, _)| filter.keeps(k))
            .collect()
    };
    let expected: Windows = source_windows
        .iter()
        .map(|(k, v)| (k.clone(), shown_of(&job, v)))
        .collect();
    let settled = |k: &(i64, Vec<String>)| frontier_ms.is_some_and(|f| k.0 < f);
    // A window a change after the snapshot touched is compared in the next round (it may have
    // closed since); open windows only when the point was reached.
    let compared = |k: &(i64, Vec<String>), want_settled: bool| {
        settled(k) == want_settled
            && !touched.contains(k)
            && (want_settled || open_not_compared.is_none())
    };
    let split = |w: &Windows, want_settled: bool| -> Windows {
        w.iter()
            .filter(|(k, _)| compared(k, want_settled))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let (expected_settled, found_settled) = (split(&expected, true), split(&found, true));
    let (expected_open, found_open) = (split(&expected, false), split(&found, false));
    let settled_diff = WindowDiff::compare(&expected_settled, &found_settled);
    let open_diff = WindowDiff::compare(&expected_open, &found_open);
    let touched_shown = expected
        .keys()
        .chain(found.keys())
        .filter(|k| touched.contains(*k))
        .collect::<BTreeSet<_>>()
        .len();
    let result = SourceReconciliation {
        frontier_ms,
        settled: reconciliation(&job, &expected_settled, &found_settled, settled_diff.len()),
        open: reconciliation(&job, &expected_open, &found_open, open_diff.len()),
        touched: touched_shown,
        open_not_compared,
        source_lsn: snapshot_lsn,
        committed_lsn,
        truncates,
    };
    if print {
        print_report(&source, &result, &settled_diff, &open_diff);
    }
    Ok(result)
}

fn print_report(
    source: &SourceDatabase,
    result: &SourceReconciliation,
    settled_diff: &WindowDiff,
    open_diff: &WindowDiff,
) {
    let frontier = result
        .frontier_ms
        .map_or("no window yet".to_owned(), tally_core::time::format_ms);
    println!(
        "reconcile --source {} at {}: the table read in one snapshot (WAL {} right after it); the view at a cut holding changes up to LSN {}",
        source.table,
        source.url(),
        lsn_text(result.source_lsn),
        lsn_text(result.committed_lsn)
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
    match &result.open_not_compared {
        None => {
            row("windows open (at the same point)", &result.open);
            println!(
                "windows changed after the snapshot           {:>6} (compared in the next round)",
                result.touched
            );
        }
        Some(why) => println!("windows open: NOT COMPARED: {why}"),
    }
    settled_diff.print("settled windows", 20);
    open_diff.print("open windows", 20);
    for t in &result.truncates {
        println!(
            "  a TRUNCATE of the table is in the topic at {t}: the job stops there (docs/change-jobs.md)"
        );
    }
    let compared = result.compared();
    println!(
        "reconcile --source: {}",
        if result.settled.mismatched + result.open.mismatched > 0 {
            "FAILED: windows differ from the source table with no change on its way to explain it"
                .to_owned()
        } else if compared == 0 {
            "NOTHING COMPARED: no window of the table or the view in range".to_owned()
        } else if result.open_not_compared.is_some() {
            format!("OK for the {compared} settled windows; open windows NOT compared")
        } else if result.touched == 0 {
            format!("OK: every window matches the source table ({compared} compared at one point)")
        } else {
            format!(
                "OK: every window compared matches the source table ({compared} at one point; {} changed after the snapshot, compared in the next round)",
                result.touched
            )
        }
    );
}

/// `reconcile --source --every`: a reconciliation against the table every `every`, each
/// exported as the gauges `reconcile --every` sets (windows compared, and those that differ,
/// open ones included).
pub async fn reconcile_source_every(
    config: &Config,
    url: Option<&str>,
    filter: &ReconcileFilter,
    every: Duration,
    wait: Duration,
) -> Result<()> {
    let readiness = std::sync::Arc::new(tally_runtime::health::Readiness::default());
    readiness.set_restored();
    tally_runtime::health::serve(
        &config.metrics.address,
        vec![(config.job.name.clone(), readiness)],
    )
    .await?;
    loop {
        let round = reconcile_source(config, url, filter, wait, true)
            .await
            .map(|r| {
                let (mut both, keys) = (r.settled.clone(), r.compared());
                both.keys = keys;
                both.mismatched = r.settled.mismatched + r.open.mismatched;
                both.source_orders += r.open.source_orders;
                both.sink_orders += r.open.sink_orders;
                both.source_revenue += r.open.source_revenue;
                both.sink_revenue += r.open.sink_revenue;
                crate::events::ReconcileRound {
                    full: true,
                    epoch: None,
                    records_read: both.source_orders,
                    keys: both.keys,
                    mismatched: both.mismatched,
                    orders_ratio: both.orders_ratio(),
                    revenue_ratio: both.revenue_ratio(),
                }
            });
        crate::events::Reconciled { round: &round }.emit();
        tokio::time::sleep(every).await;
    }
}
