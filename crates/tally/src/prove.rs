//! `tally loadgen`, `tally verify` and `tally reconcile`: the tools that make the
//! "Written → Queryable → Reported" hops checkable by anyone, against any deployment.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rdkafka::Message;
use rdkafka::message::Headers;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use tally_clickhouse::{ClickHouseSink, ViewKey, ViewTotals};
use tally_core::amount::format_units_i128;
use tally_core::{CheckpointBarrier, Epoch, MemStore, RecordDecoder, RevenueOperator};
use tally_kafka::{HEADER_REASON, HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION};

use crate::config::Config;
use crate::loadgen::{Generator, LoadSpec, Manifest};

pub struct LoadOptions {
    pub events: u64,
    pub rate: Option<u64>,
    pub partitions: i32,
    pub spec: LoadSpec,
    pub manifest: std::path::PathBuf,
}

/// Produces the stream and writes the manifest. Returns the manifest.
pub async fn loadgen(config: &Config, opts: LoadOptions) -> Result<Manifest> {
    let settings = config.kafka_settings();
    let topic = &config.kafka.source_topic;
    if tally_kafka::ensure_topic(&settings, topic, opts.partitions, None, &[]).await? {
        eprintln!("created topic {topic} with {} partitions", opts.partitions);
    }
    // A topic just created can be missing from the metadata for a moment: wait for it.
    let until = Instant::now() + Duration::from_secs(15);
    let extent = loop {
        match tally_kafka::topic_extent(&settings, topic) {
            Ok(extent) if !extent.is_empty() || Instant::now() > until => break extent,
            Err(e) if Instant::now() > until => return Err(e.into()),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let partitions = i32::try_from(extent.len()).context("partition count")?;
    let mut spec = opts.spec;
    spec.partitions = partitions;
    let mut generator =
        Generator::new(spec.clone(), config.operator()).map_err(anyhow::Error::msg)?;
    let mut client = settings.client_config();
    client
        .set("enable.idempotence", "true")
        // A message whose delivery is unknown cannot go into the manifest or be sent again
        // (the ground truth would be wrong): wait through broker restarts instead of timing out.
        .set("message.timeout.ms", "0")
        .set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4");
    let producer: FutureProducer = client.create().context("creating producer")?;
    let mut manifest = Manifest {
        spec: Some(spec),
        source_topic: topic.clone(),
        ..Manifest::default()
    };
    let started = Instant::now();
    let chunk = 5_000u64;
    let mut sent = 0u64;
    while sent < opts.events {
        let n = chunk.min(opts.events - sent);
        let records: Vec<_> = (0..n).map(|_| generator.next_record()).collect();
        let mut deliveries = Vec::with_capacity(records.len());
        for r in &records {
            let mut record = FutureRecord::to(topic)
                .partition(r.partition)
                .key(r.key.as_slice())
                .payload(r.value.as_slice());
            loop {
                match producer.send_result(record) {
                    Ok(f) => {
                        deliveries.push(f);
                        break;
                    }
                    Err((
                        rdkafka::error::KafkaError::MessageProduction(
                            rdkafka::types::RDKafkaErrorCode::QueueFull,
                        ),
                        back,
                    )) => {
                        record = back;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    Err((e, _)) => return Err(e).context("producing"),
                }
            }
        }
        for (r, f) in records.iter().zip(deliveries) {
            let delivery = f
                .await
                .context("delivery cancelled")?
                .map_err(|(e, _)| e)
                .context("delivery failed")?;
            manifest.record(r, delivery.offset);
        }
        sent += n;
        if let Some(rate) = opts.rate.filter(|r| *r > 0) {
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    producer
        .flush(Duration::from_secs(30))
        .context("flushing")?;
    manifest
        .save(&opts.manifest)
        .with_context(|| format!("writing {}", opts.manifest.display()))?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "produced {} records in {secs:.1}s ({:.0}/s): {} valid, {} duplicates, {} late, {} poison; expected {} rows, {} orders, revenue {}; manifest {}",
        manifest.produced,
        manifest.produced as f64 / secs.max(1e-9),
        manifest.valid,
        manifest.duplicates,
        manifest.late,
        manifest.poison,
        manifest.rows.len(),
        manifest.orders(),
        format_units_i128(manifest.revenue_units()),
        opts.manifest.display()
    );
    Ok(manifest)
}

/// Orders counted more than once, and orders missing, summed over keys.
fn miscounted(
    expected: &BTreeMap<ViewKey, ViewTotals>,
    found: &BTreeMap<ViewKey, ViewTotals>,
) -> (u64, u64) {
    let (mut over, mut lost) = (0u64, 0u64);
    for (k, e) in expected {
        let f = found.get(k).map_or(0, |f| f.0);
        over += f.saturating_sub(e.0);
        lost += e.0.saturating_sub(f);
    }
    over += found
        .iter()
        .filter(|(k, _)| !expected.contains_key(*k))
        .map(|(_, f)| f.0)
        .sum::<u64>();
    (over, lost)
}

/// Differences between what a sink should hold and what it holds.
#[derive(Debug, Default)]
pub struct RowDiff {
    pub missing: Vec<ViewKey>,
    pub extra: Vec<ViewKey>,
    pub different: Vec<(ViewKey, ViewTotals, ViewTotals)>,
}

impl RowDiff {
    pub fn compare(
        expected: &BTreeMap<ViewKey, ViewTotals>,
        found: &BTreeMap<ViewKey, ViewTotals>,
    ) -> RowDiff {
        let mut diff = RowDiff::default();
        for (k, e) in expected {
            match found.get(k) {
                None => diff.missing.push(k.clone()),
                Some(f) if f != e => diff.different.push((k.clone(), *e, *f)),
                Some(_) => {}
            }
        }
        diff.extra = found
            .keys()
            .filter(|k| !expected.contains_key(*k))
            .cloned()
            .collect();
        diff
    }

    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.extra.is_empty() && self.different.is_empty()
    }

    fn print_first(&self, limit: usize) {
        let key = |k: &ViewKey| format!("{} {} {}", tally_core::time::format_ms(k.0), k.1, k.2);
        for k in self.missing.iter().take(limit) {
            println!("  missing   {}", key(k));
        }
        for k in self.extra.iter().take(limit) {
            println!("  extra     {}", key(k));
        }
        for (k, e, f) in self.different.iter().take(limit) {
            println!(
                "  different {}: expected orders={} revenue={}, found orders={} revenue={}",
                key(k),
                e.0,
                format_units_i128(i128::from(e.1)),
                f.0,
                format_units_i128(i128::from(f.1))
            );
        }
    }
}

/// Dead letters as (source partition, source offset) → reasons found (more than one = repeated).
pub fn read_dead_letters(config: &Config) -> Result<BTreeMap<(i32, i64), Vec<String>>> {
    let settings = config.kafka_settings();
    let topic = config.dlq_topic();
    let extent = tally_kafka::topic_extent(&settings, &topic)?;
    let ranges = extent
        .iter()
        .map(|(p, (low, _))| (*p, (*low, None)))
        .collect();
    let mut out: BTreeMap<(i32, i64), Vec<String>> = BTreeMap::new();
    let mut malformed = 0u64;
    tally_kafka::read_committed_range(&settings, &topic, &ranges, Duration::from_secs(60), |m| {
        let get = |name: &str| {
            m.headers().and_then(|h| {
                h.iter()
                    .find(|x| x.key == name)
                    .and_then(|x| x.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        let p = get(HEADER_SOURCE_PARTITION).and_then(|v| v.parse().ok());
        let o = get(HEADER_SOURCE_OFFSET).and_then(|v| v.parse().ok());
        match (p, o) {
            (Some(p), Some(o)) => out
                .entry((p, o))
                .or_default()
                .push(get(HEADER_REASON).unwrap_or_default()),
            _ => malformed += 1,
        }
    })?;
    if malformed > 0 {
        bail!("{malformed} records in {topic} lack tally.source.partition/offset headers");
    }
    Ok(out)
}

/// Compares the view, the committed versions (what the next publish shows) and the dead-letter
/// topic with a manifest. Returns whether they all match.
pub async fn verify(config: &Config, manifest_path: &Path) -> Result<bool> {
    let manifest = Manifest::load(manifest_path)
        .with_context(|| format!("reading {}", manifest_path.display()))?;
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let found = sink.read_view().await?;
    let diff = RowDiff::compare(&manifest.rows, &found);
    // What the next publish will show: a writer that broke the protocol shows here first.
    let committed = sink.read_committed_answer().await?;
    let unpublished = RowDiff::compare(&found, &committed);
    let committed_diff = RowDiff::compare(&manifest.rows, &committed);
    let dead = read_dead_letters(config)?;
    let mut dl_missing = Vec::new();
    let mut dl_wrong_reason = Vec::new();
    for (k, reason) in &manifest.dead_letters {
        match dead.get(k) {
            None => dl_missing.push(*k),
            Some(reasons) if reasons.iter().any(|r| r != reason.as_str()) => {
                dl_wrong_reason.push(*k)
            }
            Some(_) => {}
        }
    }
    let dl_repeated: Vec<_> = dead
        .iter()
        .filter(|(_, r)| r.len() > 1)
        .map(|(k, _)| *k)
        .collect();
    let dl_extra: Vec<_> = dead
        .keys()
        .filter(|k| !manifest.dead_letters.contains_key(*k))
        .copied()
        .collect();
    let found_orders: u64 = found.values().map(|v| v.0).sum();
    let found_revenue: i128 = found.values().map(|v| i128::from(v.1)).sum();
    let dead_total: usize = dead.values().map(Vec::len).sum();
    println!("{:<28} {:>16} {:>16}", "", "expected", "found");
    println!(
        "{:<28} {:>16} {:>16}",
        "rows",
        manifest.rows.len(),
        found.len()
    );
    println!(
        "{:<28} {:>16} {:>16}",
        "orders",
        manifest.orders(),
        found_orders
    );
    println!(
        "{:<28} {:>16} {:>16}",
        "revenue",
        format_units_i128(manifest.revenue_units()),
        format_units_i128(found_revenue)
    );
    println!(
        "{:<28} {:>16} {:>16}",
        "dead letters",
        manifest.dead_letters.len(),
        dead_total
    );
    println!(
        "rows missing {}, extra {}, different {}",
        diff.missing.len(),
        diff.extra.len(),
        diff.different.len()
    );
    println!(
        "dead letters missing {}, repeated {}, extra {}, wrong reason {}",
        dl_missing.len(),
        dl_repeated.len(),
        dl_extra.len(),
        dl_wrong_reason.len()
    );
    diff.print_first(10);
    if !unpublished.is_empty() {
        println!(
            "the committed versions differ from the view in {} rows (not published yet, or written outside the protocol); against the manifest they have missing {}, extra {}, different {}",
            unpublished.missing.len() + unpublished.extra.len() + unpublished.different.len(),
            committed_diff.missing.len(),
            committed_diff.extra.len(),
            committed_diff.different.len()
        );
        committed_diff.print_first(10);
    }
    for (p, o) in dl_missing.iter().take(10) {
        println!("  dead letter missing  {p}/{o}");
    }
    for (p, o) in dl_repeated.iter().take(10) {
        println!("  dead letter repeated {p}/{o}");
    }
    // Orders counted more than once, and orders missing: in the view, or in what the next
    // publish shows it, whichever is worse.
    let (seen_over, seen_lost) = miscounted(&manifest.rows, &found);
    let (next_over, next_lost) = miscounted(&manifest.rows, &committed);
    let (over_counted, lost) = (seen_over.max(next_over), seen_lost.max(next_lost));
    println!(
        "verify-summary rows_expected={} rows_found={} orders_expected={} orders_found={found_orders} over_counted={over_counted} lost={lost} dl_expected={} dl_found={dead_total} dl_repeated={} dl_missing={}",
        manifest.rows.len(),
        found.len(),
        manifest.orders(),
        manifest.dead_letters.len(),
        dl_repeated.len(),
        dl_missing.len()
    );
    let ok = diff.is_empty()
        && committed_diff.is_empty()
        && dl_missing.is_empty()
        && dl_repeated.is_empty()
        && dl_extra.is_empty()
        && dl_wrong_reason.is_empty();
    println!("verify: {}", if ok { "OK: exact match" } else { "FAILED" });
    Ok(ok)
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

/// Recomputes the aggregates from the source topic up to the last committed epoch, with the
/// same rules but none of the worker's state, and compares them with the sink at that epoch.
pub async fn reconcile(
    config: &Config,
    filter: &ReconcileFilter,
    print: bool,
) -> Result<Reconciliation> {
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let batches = sink.committed_batches().await?;
    let Some(last) = batches.last() else {
        if print {
            println!("reconcile: nothing committed yet");
        }
        return Ok(Reconciliation::default());
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
    let topic = config.kafka.source_topic.clone();
    // A commit log that claims offsets the topic never had is corrupt: say so, and read only
    // what exists rather than wait for records that will never come.
    let extent = tally_kafka::topic_extent(&settings, &topic)?;
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
    let rules = config.operator();
    let decoder = RecordDecoder::new(
        config.field_mapping(),
        usize::try_from(config.job.max_record_bytes).unwrap_or(usize::MAX),
    );
    let starts: BTreeMap<_, _> = ranges.iter().map(|(p, (s, _))| (*p, *s)).collect();
    let (source_view, source_duplicates) =
        tokio::task::spawn_blocking(move || -> Result<(BTreeMap<ViewKey, ViewTotals>, u64)> {
            let mut op = RevenueOperator::restore(rules, decoder, Epoch(0), &BTreeMap::new());
            for (p, s) in &starts {
                op.add_partition(*p, *s);
            }
            let mut store = MemStore::default();
            let mut view: BTreeMap<(i32, ViewKey), ViewTotals> = BTreeMap::new();
            let flush = |op: &mut RevenueOperator,
                         store: &mut MemStore,
                         view: &mut BTreeMap<(i32, ViewKey), ViewTotals>|
             -> u64 {
                let cp = op.handle_checkpoint(CheckpointBarrier {
                    epoch: op.current_epoch(),
                    is_final: false,
                });
                store.apply(&cp);
                let duplicates = cp.accounting().duplicates;
                for row in cp.rows {
                    view.insert(
                        (
                            row.partition,
                            (
                                row.key.window_start_ms,
                                row.key.customer_id.into(),
                                row.key.currency.into(),
                            ),
                        ),
                        (row.value.orders, row.value.revenue.units()),
                    );
                }
                duplicates
            };
            let mut n = 0u64;
            let mut duplicates = 0u64;
            tally_kafka::read_committed_range(
                &settings,
                &topic,
                &ranges,
                Duration::from_secs(120),
                |m| {
                    let Ok(_) = op.process(&store, tally_kafka::record_of(m));
                    n += 1;
                    if n.is_multiple_of(100_000) {
                        duplicates += flush(&mut op, &mut store, &mut view);
                    }
                },
            )?;
            duplicates += flush(&mut op, &mut store, &mut view);
            let mut summed: BTreeMap<ViewKey, ViewTotals> = BTreeMap::new();
            for ((_, k), (o, r)) in view {
                let e = summed.entry(k).or_default();
                e.0 += o;
                e.1 += r;
            }
            Ok((summed, duplicates))
        })
        .await
        .context("reconcile thread")??;
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
        for (k, e, f) in diff.different.iter().take(20) {
            println!(
                "  {} {} {}: orders ratio {:.6}, revenue ratio {:.6}",
                tally_core::time::format_ms(k.0),
                k.1,
                k.2,
                ratio(f.0 as f64, e.0 as f64),
                ratio(f.1 as f64, e.1 as f64)
            );
        }
        for k in diff.missing.iter().take(20) {
            println!(
                "  {} {} {}: missing in sink (ratio 0)",
                tally_core::time::format_ms(k.0),
                k.1,
                k.2
            );
        }
        for k in diff.extra.iter().take(20) {
            println!(
                "  {} {} {}: not in source (ratio inf)",
                tally_core::time::format_ms(k.0),
                k.1,
                k.2
            );
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

/// What a reader polling the view saw: for an input that only adds orders, a window once
/// visible never disappears, no key appears twice, and no count goes down.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    pub reads: u64,
    /// Reads that failed (a service restarting): not a violation, but counted.
    pub errors: u64,
    /// Reads in which some key appeared twice.
    pub duplicated: u64,
    /// Windows seen once and missing from a later read.
    pub vanished: u64,
    /// Windows, customers or the total whose order count went down between reads.
    pub decreased: u64,
    /// First few violations, for the report.
    pub examples: Vec<String>,
}

impl ProbeReport {
    pub fn violations(&self) -> u64 {
        self.duplicated + self.vanished + self.decreased
    }

    /// Compares one read with the previous one.
    pub fn observe(
        &mut self,
        previous: &BTreeMap<ViewKey, ViewTotals>,
        current: &BTreeMap<ViewKey, ViewTotals>,
    ) {
        self.reads += 1;
        let note = |report: &mut ProbeReport, text: String| {
            if report.examples.len() < 10 {
                report.examples.push(text);
            }
        };
        for (key, (orders, _)) in previous {
            match current.get(key) {
                None => {
                    self.vanished += 1;
                    note(self, format!("window {key:?} vanished"));
                }
                Some((now, _)) if now < orders => {
                    self.decreased += 1;
                    note(self, format!("window {key:?}: orders {orders} -> {now}"));
                }
                Some(_) => {}
            }
        }
        let (before, after) = (orders_per_customer(previous), orders_per_customer(current));
        for (customer, orders) in &before {
            let now = after.get(customer).copied().unwrap_or(0);
            if now < *orders {
                self.decreased += 1;
                note(
                    self,
                    format!("customer {customer}: orders {orders} -> {now}"),
                );
            }
        }
    }
}

fn orders_per_customer(view: &BTreeMap<ViewKey, ViewTotals>) -> BTreeMap<&str, u64> {
    let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
    for ((_, customer, _), (orders, _)) in view {
        *totals.entry(customer.as_str()).or_default() += orders;
    }
    totals
}

/// Polls the view every `interval` until `stop` is set or `duration` passes, and reports what
/// a dashboard would have seen (see [`ProbeReport`]).
pub async fn probe(
    config: &Config,
    interval: Duration,
    duration: Option<Duration>,
    stop: &std::sync::atomic::AtomicBool,
) -> Result<ProbeReport> {
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let until = duration.map(|d| Instant::now() + d);
    let mut report = ProbeReport::default();
    let mut previous = BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::SeqCst)
        && until.is_none_or(|u| Instant::now() < u)
    {
        match sink.read_view().await {
            Ok(current) => {
                report.observe(&previous, &current);
                previous = current;
            }
            Err(e) if e.to_string().contains("appears twice") => {
                report.reads += 1;
                report.duplicated += 1;
                if report.examples.len() < 10 {
                    report.examples.push(e.to_string());
                }
            }
            Err(_) => report.errors += 1,
        }
        tokio::time::sleep(interval).await;
    }
    Ok(report)
}

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
pub struct IncrementalReconciler {
    config: Config,
    full_every: u64,
    rounds: u64,
    op: RevenueOperator,
    store: MemStore,
    /// Recomputed value per window key and source partition; final windows are let go.
    source: BTreeMap<ViewKey, BTreeMap<i32, ViewTotals>>,
    read_to: BTreeMap<i32, i64>,
}

impl IncrementalReconciler {
    pub fn new(config: &Config, full_every: u64) -> IncrementalReconciler {
        IncrementalReconciler {
            config: config.clone(),
            full_every: full_every.max(1),
            rounds: 0,
            op: Self::operator(config),
            store: MemStore::default(),
            source: BTreeMap::new(),
            read_to: BTreeMap::new(),
        }
    }

    fn operator(config: &Config) -> RevenueOperator {
        let decoder = RecordDecoder::new(
            config.field_mapping(),
            usize::try_from(config.job.max_record_bytes).unwrap_or(usize::MAX),
        );
        RevenueOperator::restore(config.operator(), decoder, Epoch(0), &BTreeMap::new())
    }

    pub async fn round(&mut self, filter: &ReconcileFilter) -> Result<Round> {
        let full = self.rounds.is_multiple_of(self.full_every);
        if full {
            let rounds = self.rounds;
            *self = IncrementalReconciler::new(&self.config.clone(), self.full_every);
            self.rounds = rounds;
        }
        self.rounds += 1;
        let sink = ClickHouseSink::connect(&self.config.sink_settings()).await?;
        // The batches that reach past what earlier rounds read, in any partition.
        let batches: Vec<_> = sink
            .committed_batches()
            .await?
            .into_iter()
            .filter(|b| {
                b.partitions
                    .iter()
                    .zip(&b.to_offsets)
                    .any(|(p, to)| self.read_to.get(p).is_none_or(|r| to > r))
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
        let gaps = chain_gaps(&self.read_to, &batches);
        let cut = {
            let mut cut = self.read_to.clone();
            cut.extend(tally_clickhouse::Cut::after(&batches).0);
            tally_clickhouse::Cut(cut)
        };
        let mut ranges: BTreeMap<i32, (i64, Option<i64>)> = BTreeMap::new();
        for b in &batches {
            for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
                let start = self.read_to.get(p).copied().unwrap_or(*from);
                if *to <= start {
                    continue;
                }
                let e = ranges.entry(*p).or_insert((start, Some(*to)));
                e.1 = Some(e.1.unwrap_or(*to).max(*to));
            }
        }
        for p in ranges.keys() {
            if !self.read_to.contains_key(p) {
                self.op.add_partition(*p, ranges[p].0);
            }
        }
        let settings = self.config.kafka_settings();
        let topic = self.config.kafka.source_topic.clone();
        let (op, store) = (&mut self.op, &mut self.store);
        let mut read = 0u64;
        tokio::task::block_in_place(|| {
            tally_kafka::read_committed_range(
                &settings,
                &topic,
                &ranges,
                Duration::from_secs(120),
                |m| {
                    let Ok(_) = op.process(store, tally_kafka::record_of(m));
                    read += 1;
                },
            )
        })?;
        let cp = op.handle_checkpoint(CheckpointBarrier {
            epoch: op.current_epoch(),
            is_final: false,
        });
        store.apply(&cp);
        result.source_duplicates = cp.accounting().duplicates;
        let mut changed = BTreeSet::new();
        for row in cp.rows {
            let key: (i64, String, String) = (
                row.key.window_start_ms,
                row.key.customer_id.into(),
                row.key.currency.into(),
            );
            self.source
                .entry(key.clone())
                .or_default()
                .insert(row.partition, (row.value.orders, row.value.revenue.units()));
            if filter.keeps(&key) {
                changed.insert(key);
            }
        }
        for (p, (_, end)) in &ranges {
            if let Some(end) = end {
                self.read_to.insert(*p, *end);
            }
        }
        let epoch = Epoch(newest.epoch);
        result.epoch = Some(epoch);
        result.keys = changed.len();
        result.mismatched = gaps.len();
        if let (Some(first), Some(last)) = (changed.first(), changed.last()) {
            let found = sink.read_view_at_windows(&cut, first.0, last.0).await?;
            for key in &changed {
                let expected = self.source.get(key).map_or((0, 0), |per_partition| {
                    per_partition
                        .values()
                        .fold((0, 0), |(o, r), v| (o + v.0, r + v.1))
                });
                let seen = found.get(key).copied().unwrap_or((0, 0));
                result.source_orders += expected.0;
                result.source_revenue += i128::from(expected.1);
                result.sink_orders += seen.0;
                result.sink_revenue += i128::from(seen.1);
                if seen != expected {
                    result.mismatched += 1;
                }
            }
        }
        // Final windows cannot change any more: let them go, so memory stays bounded.
        let frontier_ms = i64::from(sink.frontier().await?.seconds) * 1000;
        self.source = self
            .source
            .split_off(&(frontier_ms, String::new(), String::new()));
        Ok(Round {
            result,
            full,
            records_read: read,
        })
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    fn view(rows: &[(i64, &str, u64)]) -> BTreeMap<ViewKey, ViewTotals> {
        rows.iter()
            .map(|(w, c, o)| ((*w, (*c).to_owned(), "EUR".to_owned()), (*o, 0)))
            .collect()
    }

    #[test]
    fn growth_is_fine_and_every_regression_is_counted() {
        let mut report = ProbeReport::default();
        let a = view(&[(0, "x", 1), (60_000, "x", 2)]);
        let grown = view(&[(0, "x", 1), (60_000, "x", 3), (120_000, "y", 1)]);
        report.observe(&a, &grown);
        assert_eq!(report.violations(), 0);
        // A window missing for one read (a fold seen half-done) and a count going down.
        let gone = view(&[(60_000, "x", 2), (120_000, "y", 1)]);
        report.observe(&grown, &gone);
        assert_eq!(report.vanished, 1);
        // Window (60s, x) went 3 -> 2, and customer x went 4 -> 2.
        assert_eq!(report.decreased, 2);
        assert_eq!(report.reads, 2);
    }
}

#[cfg(test)]
mod chain_tests {
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
