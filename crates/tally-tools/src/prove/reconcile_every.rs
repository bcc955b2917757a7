//! `tally reconcile --every`: rounds that read only what was committed since the previous one
//! and compare the windows it changed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tally_clickhouse::ClickHouseSink;
use tally_core::{Epoch, Program, WindowAgg};

use super::reconcile::{ReconcileFilter, Reconciliation, WindowRows};
use super::replay::{SourceReplay, chain_gaps};
use super::restated::RowKey;
use tally_runtime::config::Config;

/// One round of [`IncrementalReconciler`].
pub struct Round {
    pub result: Reconciliation,
    /// Whether this round started over from the beginning of the committed ranges.
    pub full: bool,
    /// Source records read in this round.
    pub records_read: u64,
}

/// `reconcile --every`: each round reads from the source only what was committed since the
/// previous round, recomputes the windows that input changed, and compares just those with the
/// sink, so a round costs what the new input costs, not what the topic holds. Every
/// `full_every` rounds it starts over from the beginning, which also checks windows that no new
/// input touched.
pub(crate) struct IncrementalReconciler {
    config: Config,
    full_every: u64,
    rounds: u64,
    rows: WindowRows,
    /// What the replays read records as.
    program: Program,
    /// Final windows are let go between rounds.
    replay: SourceReplay<RowKey, WindowAgg>,
}

impl IncrementalReconciler {
    pub(crate) fn new(
        config: &Config,
        full_every: u64,
        rows: WindowRows,
    ) -> Result<IncrementalReconciler> {
        // One client of the schema registry for every round: its cache outlives a full round.
        let program = config.program()?;
        Ok(IncrementalReconciler {
            config: config.clone(),
            full_every: full_every.max(1),
            rounds: 0,
            replay: SourceReplay::new(config, program.clone(), rows.row()),
            program,
            rows,
        })
    }

    pub(crate) async fn round(&mut self, filter: &ReconcileFilter) -> Result<Round> {
        let full = self.rounds.is_multiple_of(self.full_every);
        if full {
            self.replay = SourceReplay::new(&self.config, self.program.clone(), self.rows.row());
        }
        self.rounds += 1;
        let sink = ClickHouseSink::connect(&self.config.sink_settings()).await?;
        let read_to = self.replay.read_to.clone();
        // The batches that reach past what earlier rounds read, in any partition.
        let batches: Vec<_> = sink
            .committed_batches()
            .await?
            .into_iter()
            .filter(|b| {
                b.partitions
                    .iter()
                    .zip(&b.to_offsets)
                    .any(|(p, to)| read_to.get(p).is_none_or(|r| to > r))
            })
            .collect();
        let mut result = Reconciliation {
            epoch: None,
            ..Reconciliation::default()
        };
        let Some(newest) = batches.iter().max_by_key(|b| b.epoch).cloned() else {
            return Ok(Round {
                result,
                full,
                records_read: 0,
            });
        };
        let gaps = chain_gaps(&read_to, &batches);
        let cut = {
            let mut cut = read_to.clone();
            cut.extend(tally_clickhouse::Cut::after(&batches).0);
            tally_clickhouse::Cut(cut)
        };
        let mut ranges: BTreeMap<i32, (i64, Option<i64>)> = BTreeMap::new();
        for b in &batches {
            for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
                let start = read_to.get(p).copied().unwrap_or(*from);
                if *to <= start {
                    continue;
                }
                let e = ranges.entry(*p).or_insert((start, Some(*to)));
                e.1 = Some(e.1.unwrap_or(*to).max(*to));
            }
        }
        let (replay, config) = (&mut self.replay, &self.config);
        let back = tokio::task::block_in_place(|| replay.read(config, &ranges, u64::MAX))?;
        result.source_duplicates = back.duplicates;
        let changed: BTreeSet<RowKey> = back
            .changed
            .into_iter()
            .filter(|k| filter.keeps(k))
            .collect();
        let epoch = Epoch(newest.epoch);
        result.epoch = Some(epoch);
        result.keys = changed.len();
        result.mismatched = gaps.len();
        self.rows
            .compare(&sink, &cut, &changed, &self.replay, &mut result)
            .await?;
        // Final windows cannot change any more: let them go, so memory stays bounded. (A
        // hopping window is final once the frontier passes its start too.)
        let frontier_ms = i64::from(sink.frontier().await?.seconds) * 1000;
        self.replay.values = self.replay.values.split_off(&(frontier_ms, Vec::new()));
        Ok(Round {
            result,
            full,
            records_read: back.records,
        })
    }
}

/// `tally reconcile --every`: a round every `every` (a full one every `full_every`), each
/// reported in the log and the `tally_reconcile_*` metrics, served on the metrics address.
/// The orders ratio is that of the job's first `count` column.
pub async fn reconcile_every(
    config: &Config,
    filter: &ReconcileFilter,
    every: Duration,
    full_every: u64,
) -> Result<()> {
    let readiness = Arc::new(tally_runtime::health::Readiness::default());
    readiness.set_restored();
    tally_runtime::health::serve(
        &config.metrics.address,
        vec![(config.job.name.clone(), readiness)],
    )
    .await?;
    let rows = WindowRows::of(config, &config.declared)?;
    every_round(
        IncrementalReconciler::new(config, full_every, rows)?,
        filter,
        every,
    )
    .await
}

async fn every_round(
    mut reconciler: IncrementalReconciler,
    filter: &ReconcileFilter,
    every: Duration,
) -> Result<()> {
    loop {
        let round = reconciler.round(filter).await.map(|round| {
            let r = round.result;
            crate::events::ReconcileRound {
                full: round.full,
                epoch: r.epoch,
                records_read: round.records_read,
                keys: r.keys,
                mismatched: r.mismatched,
                orders_ratio: r.orders_ratio(),
                revenue_ratio: r.revenue_ratio(),
            }
        });
        crate::events::Reconciled { round: &round }.emit();
        tokio::time::sleep(every).await;
    }
}
