//! `tally verify`: the view and the dead-letter topic against a loadgen manifest, exactly.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use rdkafka::Message;
use rdkafka::message::Headers;
use tally_clickhouse::{ClickHouseSink, ViewKey, ViewTotals};
use tally_core::PoisonReason;
use tally_core::amount::format_units_i128;
use tally_kafka::{HEADER_REASON, HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION};

use crate::loadgen::Manifest;
use tally_runtime::config::Config;

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

/// Rows missing, extra and different between what a sink should hold and what it holds,
/// by key.
#[derive(Debug)]
pub struct KeyedDiff<K, V> {
    pub missing: Vec<K>,
    pub extra: Vec<K>,
    pub different: Vec<(K, V, V)>,
}

impl<K: Ord + Clone, V: Clone> KeyedDiff<K, V> {
    /// `expected` against `found`, values compared by `same`.
    pub fn compare_by(
        expected: &BTreeMap<K, V>,
        found: &BTreeMap<K, V>,
        same: impl Fn(&V, &V) -> bool,
    ) -> KeyedDiff<K, V> {
        let mut diff = KeyedDiff {
            missing: Vec::new(),
            extra: Vec::new(),
            different: Vec::new(),
        };
        for (k, e) in expected {
            match found.get(k) {
                None => diff.missing.push(k.clone()),
                Some(f) if !same(e, f) => diff.different.push((k.clone(), e.clone(), f.clone())),
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

    pub fn len(&self) -> usize {
        self.missing.len() + self.extra.len() + self.different.len()
    }
}

/// revenue_agg's rows: (orders, revenue) compared exactly.
pub type RowDiff = KeyedDiff<ViewKey, ViewTotals>;

impl RowDiff {
    pub fn compare(
        expected: &BTreeMap<ViewKey, ViewTotals>,
        found: &BTreeMap<ViewKey, ViewTotals>,
    ) -> RowDiff {
        KeyedDiff::compare_by(expected, found, |e, f| e == f)
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

/// The dead-letter topic against the dead letters expected.
pub(crate) struct DeadLetterDiff {
    missing: Vec<(i32, i64)>,
    repeated: Vec<(i32, i64)>,
    extra: Vec<(i32, i64)>,
    wrong_reason: Vec<(i32, i64)>,
    /// Dead letters in the topic, repeats included.
    found: usize,
}

impl DeadLetterDiff {
    pub(crate) fn compare(
        expected: &BTreeMap<(i32, i64), PoisonReason>,
        found: &BTreeMap<(i32, i64), Vec<String>>,
    ) -> DeadLetterDiff {
        let mut diff = DeadLetterDiff {
            missing: Vec::new(),
            repeated: Vec::new(),
            extra: Vec::new(),
            wrong_reason: Vec::new(),
            found: found.values().map(Vec::len).sum(),
        };
        for (k, reason) in expected {
            match found.get(k) {
                None => diff.missing.push(*k),
                Some(reasons) if reasons.iter().any(|r| r != reason.as_str()) => {
                    diff.wrong_reason.push(*k)
                }
                Some(_) => {}
            }
        }
        for (k, reasons) in found {
            if reasons.len() > 1 {
                diff.repeated.push(*k);
            }
            if !expected.contains_key(k) {
                diff.extra.push(*k);
            }
        }
        diff
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.missing.is_empty()
            && self.repeated.is_empty()
            && self.extra.is_empty()
            && self.wrong_reason.is_empty()
    }

    pub(crate) fn print_summary(&self) {
        println!(
            "dead letters missing {}, repeated {}, extra {}, wrong reason {}",
            self.missing.len(),
            self.repeated.len(),
            self.extra.len(),
            self.wrong_reason.len()
        );
    }

    pub(crate) fn print_first(&self, limit: usize) {
        for (p, o) in self.missing.iter().take(limit) {
            println!("  dead letter missing  {p}/{o}");
        }
        for (p, o) in self.repeated.iter().take(limit) {
            println!("  dead letter repeated {p}/{o}");
        }
    }

    pub(crate) fn found(&self) -> usize {
        self.found
    }

    /// The `verify-summary` fields of the dead letters.
    pub(crate) fn summary_fields(&self, expected: usize) -> String {
        format!(
            "dl_expected={expected} dl_found={} dl_repeated={} dl_missing={}",
            self.found,
            self.repeated.len(),
            self.missing.len()
        )
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
    let dead = DeadLetterDiff::compare(&manifest.dead_letters, &read_dead_letters(config)?);
    let found_orders: u64 = found.values().map(|v| v.0).sum();
    let found_revenue: i128 = found.values().map(|v| i128::from(v.1)).sum();
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
        dead.found
    );
    println!(
        "rows missing {}, extra {}, different {}",
        diff.missing.len(),
        diff.extra.len(),
        diff.different.len()
    );
    dead.print_summary();
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
    dead.print_first(10);
    // Orders counted more than once, and orders missing: in the view, or in what the next
    // publish shows it, whichever is worse.
    let (seen_over, seen_lost) = miscounted(&manifest.rows, &found);
    let (next_over, next_lost) = miscounted(&manifest.rows, &committed);
    let (over_counted, lost) = (seen_over.max(next_over), seen_lost.max(next_lost));
    println!(
        "verify-summary rows_expected={} rows_found={} orders_expected={} orders_found={found_orders} over_counted={over_counted} lost={lost} {}",
        manifest.rows.len(),
        found.len(),
        manifest.orders(),
        dead.summary_fields(manifest.dead_letters.len())
    );
    let ok = diff.is_empty() && committed_diff.is_empty() && dead.is_empty();
    println!("verify: {}", if ok { "OK: exact match" } else { "FAILED" });
    Ok(ok)
}
