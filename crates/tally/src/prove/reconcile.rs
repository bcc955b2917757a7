//! `tally reconcile`: the sink against a recomputation from the source, once or every round.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tally_clickhouse::{ClickHouseSink, ViewKey, ViewTotals};
use tally_core::amount::format_units_i128;
use tally_core::{CheckpointBarrier, Epoch, MemStore, OutputRow, WindowOperator};

use super::verify::RowDiff;
use crate::config::Config;

/// The job's operator run again, in memory, over committed offset ranges of the source topic:
/// what the sink should hold, per window key and source partition. `tally reconcile` reads the
/// whole committed ranges once; `--every` keeps one between rounds and reads what is new. `K`
/// and `V` are a view row's key and value as the reconciliation compares them.
pub(crate) struct SourceReplay<K, V> {
    op: WindowOperator,
    store: MemStore,
    /// Per window key and source partition, the value the replay computed.
    pub(crate) values: BTreeMap<K, BTreeMap<i32, V>>,
    /// Per partition, where the replay's reading ended.
    read_to: BTreeMap<i32, i64>,
    /// A row of a checkpoint as a key and value.
    row: fn(&OutputRow) -> (K, V),
}

/// What one [`SourceReplay::read`] did.
pub(crate) struct ReadBack<K> {
    records: u64,
    pub(crate) duplicates: u64,
    /// The window keys whose value changed.
    changed: BTreeSet<K>,
}

/// revenue_agg's rows as the view shows them.
fn revenue_row(row: &OutputRow) -> (ViewKey, ViewTotals) {
    (
        (
            row.key.window_start_ms,
            row.key.customer_id().into(),
            row.key.currency().into(),
        ),
        (row.value.orders(), row.value.revenue().units()),
    )
}

impl<K: Ord + Clone, V> SourceReplay<K, V> {
    pub(crate) fn new(config: &Config, row: fn(&OutputRow) -> (K, V)) -> Self {
        SourceReplay {
            op: WindowOperator::restore(
                config.operator(),
                config.program(),
                Epoch(0),
                &BTreeMap::new(),
            ),
            store: MemStore::default(),
            values: BTreeMap::new(),
            read_to: BTreeMap::new(),
            row,
        }
    }

    /// Reads `ranges` of the source (per partition `[from, to)`; a partition new to the replay
    /// starts at its `from`), checkpointing every `flush_every` records to bound memory.
    pub(crate) fn read(
        &mut self,
        config: &Config,
        ranges: &BTreeMap<i32, (i64, Option<i64>)>,
        flush_every: u64,
    ) -> Result<ReadBack<K>> {
        for (p, (from, _)) in ranges {
            if !self.read_to.contains_key(p) {
                self.op.add_partition(*p, *from);
            }
        }
        let mut back = ReadBack {
            records: 0,
            duplicates: 0,
            changed: BTreeSet::new(),
        };
        let settings = config.kafka_settings();
        let topic = &config.kafka.source_topic;
        tally_kafka::read_committed_range(
            &settings,
            topic,
            ranges,
            Duration::from_secs(120),
            |m| {
                let Ok(_) = self.op.process(&self.store, tally_kafka::record_of(m));
                back.records += 1;
                if back.records.is_multiple_of(flush_every) {
                    self.flush(&mut back);
                }
            },
        )?;
        self.flush(&mut back);
        for (p, (_, end)) in ranges {
            if let Some(end) = end {
                self.read_to.insert(*p, *end);
            }
        }
        Ok(back)
    }

    fn flush(&mut self, back: &mut ReadBack<K>) {
        let cp = self.op.handle_checkpoint(CheckpointBarrier {
            epoch: self.op.current_epoch(),
            is_final: false,
        });
        self.store.apply(&cp);
        back.duplicates += cp.accounting().duplicates;
        for row in &cp.rows {
            let (key, value) = (self.row)(row);
            self.values
                .entry(key.clone())
                .or_default()
                .insert(row.partition, value);
            back.changed.insert(key);
        }
    }
}

impl SourceReplay<ViewKey, ViewTotals> {
    /// The recomputed value of `key`, summed over source partitions.
    fn value(&self, key: &ViewKey) -> ViewTotals {
        self.values.get(key).map_or((0, 0), |per_partition| {
            per_partition
                .values()
                .fold((0, 0), |(o, r), v| (o + v.0, r + v.1))
        })
    }
}

pub struct ReconcileFilter {
    pub from_ms: Option<i64>,
    pub to_ms: Option<i64>,
    pub customer: Option<String>,
}

impl ReconcileFilter {
    fn keeps(&self, k: &ViewKey) -> bool {
        self.from_ms.is_none_or(|f| k.0 >= f)
            && self.to_ms.is_none_or(|t| k.0 < t)
            && self.customer.as_ref().is_none_or(|c| *c == k.1)
    }
}

/// Result of one reconciliation.
#[derive(Debug, Default)]
pub struct Reconciliation {
    pub epoch: Option<Epoch>,
    /// Records of the committed range whose event id was seen before: what the producers re-sent.
    pub source_duplicates: u64,
    pub keys: usize,
    pub mismatched: usize,
    pub source_orders: u64,
    pub sink_orders: u64,
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
}

fn ratio(sink: f64, source: f64) -> f64 {
    if source == 0.0 {
        if sink == 0.0 { 1.0 } else { f64::INFINITY }
    } else {
        sink / source
    }
}

/// What the commit log says was committed: the last epoch, the cut after every batch, the
/// source ranges the batches hold (per partition `[from, to)`, within the topic), and the
/// breaks found in the log.
pub(crate) struct Committed {
    pub(crate) epoch: Epoch,
    pub(crate) cut: tally_clickhouse::Cut,
    pub(crate) ranges: BTreeMap<i32, (i64, Option<i64>)>,
    pub(crate) gaps: Vec<String>,
}

/// The commit log read for a reconciliation; `None` before the first commit.
pub(crate) async fn committed(config: &Config, sink: &ClickHouseSink) -> Result<Option<Committed>> {
    let batches = sink.committed_batches().await?;
    let Some(last) = batches.last() else {
        return Ok(None);
    };
    let epoch = Epoch(last.epoch);
    let cut = tally_clickhouse::Cut::after(&batches);
    let mut gaps = commit_log_gaps(&batches);
    let mut ranges: BTreeMap<i32, (i64, Option<i64>)> = BTreeMap::new();
    for b in &batches {
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            let e = ranges.entry(*p).or_insert((*from, Some(*to)));
            e.0 = e.0.min(*from);
            e.1 = Some(e.1.unwrap_or(*to).max(*to));
        }
    }
    let settings = config.kafka_settings();
    // A commit log that claims offsets the topic never had is corrupt: say so, and read only
    // what exists rather than wait for records that will never come.
    let extent = tally_kafka::topic_extent(&settings, &config.kafka.source_topic)?;
    if matches!(config.job.start_from, crate::config::StartFrom::Earliest) {
        let starts: BTreeMap<i32, i64> = ranges.iter().map(|(p, (s, _))| (*p, *s)).collect();
        let lows: BTreeMap<i32, i64> = extent.iter().map(|(p, (low, _))| (*p, *low)).collect();
        gaps.extend(missing_first_batches(&starts, &lows));
    }
    for (p, (_, end)) in ranges.iter_mut() {
        let high = extent.get(p).map_or(0, |(_, high)| *high);
        if let Some(to) = end
            && *to > high
        {
            gaps.push(format!(
                "the commit log claims partition {p} up to offset {to}, but the topic ends at {high}"
            ));
            *end = Some(high);
        }
    }
    Ok(Some(Committed {
        epoch,
        cut,
        ranges,
        gaps,
    }))
}

/// Recomputes the aggregates from the source topic up to the last committed epoch, with the
/// same rules but none of the worker's state, and compares them with the sink at that epoch.
pub async fn reconcile(
    config: &Config,
    filter: &ReconcileFilter,
    print: bool,
) -> Result<Reconciliation> {
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let Some(Committed {
        epoch,
        cut,
        ranges,
        gaps,
    }) = committed(config, &sink).await?
    else {
        if print {
            println!("reconcile: nothing committed yet");
        }
        return Ok(Reconciliation::default());
    };
    let replay_config = config.clone();
    let (replay, back) =
        tokio::task::spawn_blocking(move || -> Result<(SourceReplay<_, _>, ReadBack<_>)> {
            let mut replay = SourceReplay::new(&replay_config, revenue_row);
            let back = replay.read(&replay_config, &ranges, 100_000)?;
            Ok((replay, back))
        })
        .await
        .context("reconcile thread")??;
    let source_duplicates = back.duplicates;
    let source_view: BTreeMap<ViewKey, ViewTotals> = replay
        .values
        .keys()
        .map(|k| (k.clone(), replay.value(k)))
        .collect();
    let sink_view = sink.read_view_at(&cut).await?;
    let source: BTreeMap<_, _> = source_view
        .into_iter()
        .filter(|(k, _)| filter.keeps(k))
        .collect();
    let found: BTreeMap<_, _> = sink_view
        .into_iter()
        .filter(|(k, _)| filter.keeps(k))
        .collect();
    let diff = RowDiff::compare(&source, &found);
    let keys: BTreeSet<&ViewKey> = source.keys().chain(found.keys()).collect();
    let result = Reconciliation {
        epoch: Some(epoch),
        keys: keys.len(),
        mismatched: diff.missing.len() + diff.extra.len() + diff.different.len() + gaps.len(),
        source_orders: source.values().map(|v| v.0).sum(),
        source_duplicates,
        sink_orders: found.values().map(|v| v.0).sum(),
        source_revenue: source.values().map(|v| i128::from(v.1)).sum(),
        sink_revenue: found.values().map(|v| i128::from(v.1)).sum(),
    };
    if print {
        println!(
            "reconcile at committed epoch {epoch}: {} keys, {} differ",
            result.keys,
            result.mismatched - gaps.len()
        );
        for gap in gaps.iter().take(20) {
            println!("  commit log: {gap}");
        }
        println!(
            "{:<10} {:>20} {:>20} {:>10}",
            "", "source", "sink", "sink/source"
        );
        println!(
            "{:<10} {:>20} {:>20} {:>10.6}",
            "orders",
            result.source_orders,
            result.sink_orders,
            result.orders_ratio()
        );
        println!(
            "{:<10} {:>20} {:>20} {:>10.6}",
            "revenue",
            format_units_i128(result.source_revenue),
            format_units_i128(result.sink_revenue),
            result.revenue_ratio()
        );
        let window = |k: &(i64, String, String)| {
            format!("{} {} {}", tally_core::time::format_ms(k.0), k.1, k.2)
        };
        for (k, e, f) in diff.different.iter().take(20) {
            println!(
                "  {}: orders ratio {:.6}, revenue ratio {:.6}",
                window(k),
                ratio(f.0 as f64, e.0 as f64),
                ratio(f.1 as f64, e.1 as f64)
            );
        }
        for k in diff.missing.iter().take(20) {
            println!("  {}: missing in sink (ratio 0)", window(k));
        }
        for k in diff.extra.iter().take(20) {
            println!("  {}: not in source (ratio inf)", window(k));
        }
        println!(
            "reconcile: {}",
            if result.mismatched == 0 {
                "OK: every ratio is 1"
            } else {
                "FAILED"
            }
        );
    }
    Ok(result)
}

/// Breaks in the commit log's chains: per source partition, the batches holding it start at
/// its first offset in the log and each starts where another ended, and no two batches start
/// at the same offset with different ends (two histories). Writers number their epochs
/// independently, so the chains are per partition, not per epoch. A missing or foreign batch
/// shows as a break.
pub fn commit_log_gaps(batches: &[tally_clickhouse::CommittedBatch]) -> Vec<String> {
    chain_gaps(&BTreeMap::new(), batches)
}

/// [`commit_log_gaps`] for `batches` that continue the chains ending at `ends` (checked before).
fn chain_gaps(
    ends: &BTreeMap<i32, i64>,
    batches: &[tally_clickhouse::CommittedBatch],
) -> Vec<String> {
    let mut gaps = Vec::new();
    // Per partition: from offset -> (to offset, epoch of the batch).
    let mut links: BTreeMap<i32, BTreeMap<i64, (i64, u64)>> = BTreeMap::new();
    // Per partition, the batches that had nothing new for it: (offset, epoch).
    let mut idle: BTreeMap<i32, Vec<(i64, u64)>> = BTreeMap::new();
    for b in batches {
        if b.partitions.len() != b.from_offsets.len()
            || b.partitions.len() != b.to_offsets.len()
            || b.partitions.is_empty()
        {
            gaps.push(format!("epoch {} has no valid offset ranges", b.epoch));
            continue;
        }
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            let chain = links.entry(*p).or_default();
            // A partition with nothing new in the batch: no link of the chain, but it must
            // sit on one (checked below).
            if from == to {
                idle.entry(*p).or_default().push((*from, b.epoch));
                continue;
            }
            match chain.get(from) {
                Some((other, _)) if other != to => gaps.push(format!(
                    "two batches start partition {p} at offset {from}: one ends at {other}, epoch {}'s at {to} (two histories)",
                    b.epoch
                )),
                _ => {
                    chain.insert(*from, (*to, b.epoch));
                }
            }
        }
    }
    // Where each partition's history starts, when no earlier round says: the lowest offset a
    // batch of it starts at, idle or not.
    let start_of = |p: &i32| -> Option<i64> {
        ends.get(p).copied().or_else(|| {
            let first_link = links.get(p).and_then(|c| c.keys().next().copied());
            let first_idle = idle.get(p).and_then(|b| b.iter().map(|(o, _)| *o).min());
            first_link.into_iter().chain(first_idle).min()
        })
    };
    for (p, chain) in &links {
        let mut end = start_of(p);
        for (from, (to, epoch)) in chain {
            if let Some(e) = end
                && *from != e
            {
                if *to <= e {
                    // Within what was checked already (an incremental round's earlier batches).
                    continue;
                }
                gaps.push(format!(
                    "epoch {epoch} starts partition {p} at offset {from}, but the previous batch ended at {e}"
                ));
            }
            end = Some(end.map_or(*to, |e| e.max(*to)));
        }
    }
    for (p, batches) in &idle {
        let chain = links.get(p);
        let start = start_of(p);
        for (offset, epoch) in batches {
            let on_chain = Some(*offset) == start
                || chain.is_some_and(|c| c.values().any(|(to, _)| to == offset));
            if !on_chain {
                gaps.push(format!(
                    "epoch {epoch} leaves partition {p} at offset {offset}, where no batch of it ended"
                ));
            }
        }
    }
    gaps
}

/// For a job that read its partitions from their earliest offsets: a partition whose first
/// committed batch starts after the topic's first offset lacks the batches before it (epochs
/// are numbered per writer, so only the offsets can tell that the first one is gone).
fn missing_first_batches(starts: &BTreeMap<i32, i64>, lows: &BTreeMap<i32, i64>) -> Vec<String> {
    starts
        .iter()
        .filter_map(|(p, from)| {
            let low = lows.get(p).copied().unwrap_or(0);
            (*from > low).then(|| {
                format!(
                    "partition {p}'s first committed batch starts at offset {from}, but the topic holds it from {low}: the batches before it are missing"
                )
            })
        })
        .collect()
}

/// One round of [`IncrementalReconciler`].
pub struct Round {
    pub result: Reconciliation,
    /// Whether this round started over from the beginning of the committed ranges.
    pub full: bool,
    /// Source records read in this round.
    pub records_read: u64,
}

/// How `reconcile --every` keys, recomputes and compares the rows of one kind of job:
/// revenue_agg's, or a declared job's.
pub(crate) trait RoundRows {
    type Key: Ord + Clone + Send;
    type Value: Send;
    /// A checkpoint's row as the replay keeps it.
    fn row(&self) -> fn(&OutputRow) -> (Self::Key, Self::Value);
    /// The first key of windows starting at `ms`.
    fn first_at(ms: i64) -> Self::Key;
    fn window_start(key: &Self::Key) -> i64;
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

/// revenue_agg's rows: orders and revenue summed over source partitions.
pub(crate) struct RevenueRows;

impl RoundRows for RevenueRows {
    type Key = ViewKey;
    type Value = ViewTotals;

    fn row(&self) -> fn(&OutputRow) -> (ViewKey, ViewTotals) {
        revenue_row
    }

    fn first_at(ms: i64) -> ViewKey {
        (ms, String::new(), String::new())
    }

    fn window_start(key: &ViewKey) -> i64 {
        key.0
    }

    fn keeps(filter: &ReconcileFilter, key: &ViewKey) -> bool {
        filter.keeps(key)
    }

    async fn compare(
        &self,
        sink: &ClickHouseSink,
        cut: &tally_clickhouse::Cut,
        changed: &BTreeSet<ViewKey>,
        replay: &SourceReplay<ViewKey, ViewTotals>,
        result: &mut Reconciliation,
    ) -> Result<()> {
        let (Some(first), Some(last)) = (changed.first(), changed.last()) else {
            return Ok(());
        };
        let found = sink.read_view_at_windows(cut, first.0, last.0).await?;
        for key in changed {
            let expected = replay.value(key);
            let seen = found.get(key).copied().unwrap_or((0, 0));
            result.source_orders += expected.0;
            result.source_revenue += i128::from(expected.1);
            result.sink_orders += seen.0;
            result.sink_revenue += i128::from(seen.1);
            if seen != expected {
                result.mismatched += 1;
            }
        }
        Ok(())
    }
}

/// `reconcile --every`: each round reads from the source only what was committed since the
/// previous round, recomputes the windows that input changed, and compares just those with the
/// sink, so a round costs what the new input costs, not what the topic holds. Every
/// `full_every` rounds it starts over from the beginning, which also checks windows that no new
/// input touched.
pub(crate) struct IncrementalReconciler<R: RoundRows> {
    config: Config,
    full_every: u64,
    rounds: u64,
    rows: R,
    /// Final windows are let go between rounds.
    replay: SourceReplay<R::Key, R::Value>,
}

impl<R: RoundRows> IncrementalReconciler<R> {
    pub(crate) fn new(config: &Config, full_every: u64, rows: R) -> IncrementalReconciler<R> {
        IncrementalReconciler {
            config: config.clone(),
            full_every: full_every.max(1),
            rounds: 0,
            replay: SourceReplay::new(config, rows.row()),
            rows,
        }
    }

    pub(crate) async fn round(&mut self, filter: &ReconcileFilter) -> Result<Round> {
        let full = self.rounds.is_multiple_of(self.full_every);
        if full {
            self.replay = SourceReplay::new(&self.config, self.rows.row());
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
        let changed: BTreeSet<R::Key> = back
            .changed
            .into_iter()
            .filter(|k| R::keeps(filter, k))
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
        self.replay.values = self.replay.values.split_off(&R::first_at(frontier_ms));
        debug_assert!(
            self.replay
                .values
                .keys()
                .all(|k| R::window_start(k) >= frontier_ms)
        );
        Ok(Round {
            result,
            full,
            records_read: back.records,
        })
    }
}

/// `tally reconcile --every`: a round every `every` (a full one every `full_every`), each
/// reported in the log and the `tally_reconcile_*` metrics, served on the metrics address.
/// A declared job's orders ratio is that of its first `count` column.
pub async fn reconcile_every(
    config: &Config,
    filter: &ReconcileFilter,
    every: Duration,
    full_every: u64,
) -> Result<()> {
    let readiness = Arc::new(crate::health::Readiness::default());
    readiness.set_restored();
    crate::health::serve(
        &config.metrics.address,
        vec![(config.job.name.clone(), readiness)],
    )
    .await?;
    match &config.declared {
        Some(job) => {
            let rows = super::reconcile_declared::DeclaredRows::of(config, job)?;
            every_round(
                IncrementalReconciler::new(config, full_every, rows),
                filter,
                every,
            )
            .await
        }
        None => {
            every_round(
                IncrementalReconciler::new(config, full_every, RevenueRows),
                filter,
                every,
            )
            .await
        }
    }
}

async fn every_round<R: RoundRows>(
    mut reconciler: IncrementalReconciler<R>,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(epoch: u64, ranges: &[(i32, i64, i64)]) -> tally_clickhouse::CommittedBatch {
        tally_clickhouse::CommittedBatch {
            epoch,
            partitions: ranges.iter().map(|r| r.0).collect(),
            from_offsets: ranges.iter().map(|r| r.1).collect(),
            to_offsets: ranges.iter().map(|r| r.2).collect(),
        }
    }

    #[test]
    fn chains_are_per_partition_whoever_numbered_the_epochs() {
        // Writer A: partitions 0 and 1; writer B takes partition 1 over, its epochs from 1.
        let batches = [
            batch(1, &[(0, 0, 10), (1, 0, 5)]),
            batch(2, &[(0, 10, 10), (1, 5, 9)]),
            batch(1, &[(1, 9, 12)]),
            batch(3, &[(0, 10, 14)]),
        ];
        assert!(commit_log_gaps(&batches).is_empty());
        // Listed in any order.
        let mut shuffled = batches.to_vec();
        shuffled.reverse();
        assert!(commit_log_gaps(&shuffled).is_empty());
    }

    #[test]
    fn a_missing_batch_and_two_histories_are_breaks() {
        let gaps = commit_log_gaps(&[batch(1, &[(0, 0, 10)]), batch(3, &[(0, 12, 20)])]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(
            gaps[0].contains("starts partition 0 at offset 12, but the previous batch ended at 10")
        );
        let gaps = commit_log_gaps(&[
            batch(1, &[(0, 0, 10)]),
            batch(7, &[(0, 0, 8)]),
            batch(2, &[(0, 10, 11)]),
        ]);
        assert!(
            gaps.iter()
                .any(|g| g.contains("two batches start partition 0 at offset 0")),
            "{gaps:?}"
        );
    }

    #[test]
    fn a_missing_batch_after_an_idle_first_one_is_named_where_it_is_missing() {
        // Epoch 1 had nothing for partition 0; epoch 2 (0 -> 700) is gone.
        let gaps = commit_log_gaps(&[batch(1, &[(0, 0, 0)]), batch(3, &[(0, 700, 1400)])]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(
            gaps[0].contains(
                "epoch 3 starts partition 0 at offset 700, but the previous batch ended at 0"
            ),
            "{gaps:?}"
        );
    }

    #[test]
    fn a_missing_first_batch_shows_against_the_topic_start() {
        let starts = BTreeMap::from([(0, 0), (1, 40)]);
        let lows = BTreeMap::from([(0, 0), (1, 0)]);
        let gaps = missing_first_batches(&starts, &lows);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(gaps[0].contains("partition 1's first committed batch starts at offset 40"));
        // Retention deleted what the job read long ago: nothing is missing.
        assert!(missing_first_batches(&starts, &BTreeMap::from([(1, 90)])).is_empty());
    }

    #[test]
    fn an_incremental_round_continues_the_chains_it_checked() {
        let ends = BTreeMap::from([(0, 10), (1, 5)]);
        assert!(chain_gaps(&ends, &[batch(4, &[(0, 10, 12), (1, 5, 5)])]).is_empty());
        // An idle partition must sit where its chain is.
        let gaps = chain_gaps(&ends, &[batch(4, &[(0, 10, 12), (1, 7, 7)])]);
        assert!(
            gaps[0].contains("leaves partition 1 at offset 7"),
            "{gaps:?}"
        );
        let gaps = chain_gaps(&ends, &[batch(4, &[(0, 11, 12)])]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
    }
}
