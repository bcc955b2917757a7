//! `tally verify`: the view's declared columns, the committed versions and
//! the dead-letter topic against a loadgen manifest. Counts, integers, decimals and times must
//! match exactly, floats within 1e-9 relative.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use tally_clickhouse::{Cells, ClickHouseSink, ColumnType};
use tally_core::declare::{FieldKind, Function, Job, parse_decimal};
use tally_core::{WindowAgg, Word};

use super::dead_letters::{DeadLetterDiff, read_dead_letters};
use super::restated;
use crate::loadgen::{Manifest, Shown};
use tally_runtime::config::Config;

pub(crate) use super::restated::{RowKey, Windows};

/// A key as loadgen writes it: decimals in units, floats as Rust prints them.
fn canonical_key(text: &str, kind: ColumnType) -> Result<String> {
    Ok(match kind {
        ColumnType::Decimal(scale) => parse_decimal(text, scale)
            .map_err(anyhow::Error::msg)?
            .to_string(),
        ColumnType::Float64 => text.parse::<f64>().context("a float key")?.to_string(),
        _ => text.to_owned(),
    })
}

fn shown_value(text: &str, kind: ColumnType) -> Result<Shown> {
    Ok(match kind {
        ColumnType::Decimal(scale) => Shown::Exact(i128::from(
            parse_decimal(text, scale).map_err(anyhow::Error::msg)?,
        )),
        ColumnType::Float64 => Shown::Float(text.parse()?),
        _ => Shown::Exact(text.parse()?),
    })
}

/// A window's value (its aggregates' words) as the view shows it.
pub(crate) fn shown_of(job: &Job, value: &WindowAgg) -> Vec<Shown> {
    let mut words = value.words().iter().copied();
    job.aggregates
        .iter()
        .map(|a| {
            let time = a.input.is_some_and(|t| t.kind == FieldKind::Timestamp);
            let decimal = a.input.is_some_and(|t| t.kind == FieldKind::Decimal);
            let first = words.next();
            let count = |w: Option<Word>| match w {
                Some(Word::Count(n)) => n,
                _ => 0,
            };
            match (a.function, first) {
                // ClickHouse's decimal division truncates towards zero, as i128's does.
                (Function::Avg, Some(Word::Exact(s))) if decimal => {
                    Shown::Exact(i128::from(s) / i128::from(count(words.next()).max(1)))
                }
                (Function::Avg, Some(Word::Exact(s))) => {
                    Shown::Float(s as f64 / count(words.next()) as f64)
                }
                (Function::Avg, Some(Word::Float(s))) => {
                    Shown::Float(s / count(words.next()) as f64)
                }
                (_, Some(Word::Count(n))) => Shown::Exact(i128::from(n)),
                (_, Some(Word::Exact(x))) if time => Shown::Exact(i128::from(x).div_euclid(1000)),
                (_, Some(Word::Exact(x))) => Shown::Exact(i128::from(x)),
                (_, Some(Word::Float(x))) => Shown::Float(x),
                (_, None) => Shown::Exact(0),
            }
        })
        .collect()
}

/// The ClickHouse types of the job's view columns: its keys', then its aggregates'.
#[derive(Debug, Clone)]
pub(crate) struct ViewTypes {
    keys: Vec<ColumnType>,
    pub(crate) values: Vec<ColumnType>,
}

impl ViewTypes {
    pub(crate) fn of(config: &Config, job: &Job) -> Result<ViewTypes> {
        // The view's columns are window_start, window_end, the keys, the aggregates.
        let mut types = config
            .sink_shape()
            .view_columns()
            .into_iter()
            .skip(2)
            .map(|(c, t)| {
                ColumnType::parse(&t).with_context(|| format!("view column {c} of type {t}"))
            })
            .collect::<Result<Vec<_>>>()?;
        let values = types.split_off(job.keys.len().min(types.len()));
        Ok(ViewTypes {
            keys: types,
            values,
        })
    }

    /// Key `i` of a window, given as text, as [`ViewTypes::read`] reads the view's.
    pub(crate) fn canonical_key(&self, i: usize, text: &str) -> Result<String> {
        let kind = self
            .keys
            .get(i)
            .with_context(|| format!("the view has no key column {i}"))?;
        canonical_key(text, *kind)
    }

    /// Cells read back as the manifest holds them, by the view's column types.
    pub(crate) fn read(&self, cells: Cells) -> Result<Windows> {
        let mut out = Windows::new();
        for ((start, keys), values) in cells {
            if keys.len() != self.keys.len() || values.len() != self.values.len() {
                bail!("the view has other columns than the job declares: run `tally doctor`");
            }
            let keys = keys
                .iter()
                .zip(&self.keys)
                .map(|(k, t)| canonical_key(k, *t))
                .collect::<Result<Vec<_>>>()?;
            let values = values
                .iter()
                .zip(&self.values)
                .map(|(v, t)| shown_value(v, *t).with_context(|| format!("{v:?} as {t}")))
                .collect::<Result<Vec<_>>>()?;
            out.insert((start, keys), values);
        }
        Ok(out)
    }
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

/// The job's windows, every shown column compared (floats within 1e-9 relative).
pub(crate) type WindowDiff = KeyedDiff<RowKey, Vec<Shown>>;

impl WindowDiff {
    pub(crate) fn compare(expected: &Windows, found: &Windows) -> WindowDiff {
        KeyedDiff::compare_by(expected, found, |e, f| {
            e.len() == f.len() && e.iter().zip(f).all(|(e, f)| e.matches(f))
        })
    }

    /// One line for a report: the counts and the first row that differs.
    pub(crate) fn summary(&self) -> String {
        let key = |(w, k): &RowKey| format!("{} {}", tally_core::time::format_ms(*w), k.join(" "));
        let first = self
            .missing
            .first()
            .map(|k| format!("missing {}", key(k)))
            .or_else(|| self.extra.first().map(|k| format!("extra {}", key(k))))
            .or_else(|| {
                self.different.first().map(|(k, e, f)| {
                    let list =
                        |v: &[Shown]| v.iter().map(Shown::to_string).collect::<Vec<_>>().join(" ");
                    format!("{}: {} against {}", key(k), list(e), list(f))
                })
            })
            .unwrap_or_default();
        format!(
            "missing {}, extra {}, different {} (first: {first})",
            self.missing.len(),
            self.extra.len(),
            self.different.len()
        )
    }

    pub(crate) fn print(&self, what: &str, limit: usize) {
        println!(
            "{what}: missing {}, extra {}, different {}",
            self.missing.len(),
            self.extra.len(),
            self.different.len()
        );
        let key = |(w, k): &RowKey| format!("{} {}", tally_core::time::format_ms(*w), k.join(" "));
        for k in self.missing.iter().take(limit) {
            println!("  missing   {}", key(k));
        }
        for k in self.extra.iter().take(limit) {
            println!("  extra     {}", key(k));
        }
        for (k, e, f) in self.different.iter().take(limit) {
            let list = |v: &[Shown]| v.iter().map(Shown::to_string).collect::<Vec<_>>().join(" ");
            println!(
                "  different {}: expected {}, found {}",
                key(k),
                list(e),
                list(f)
            );
        }
    }
}

/// Records counted by the first `count` column, summed over windows.
pub(crate) fn counted<'w>(
    job: &Job,
    windows: &'w Windows,
) -> Option<(u64, BTreeMap<&'w RowKey, u64>)> {
    let at = job
        .aggregates
        .iter()
        .position(|a| a.function == Function::Count)?;
    let per_key: BTreeMap<_, u64> = windows
        .iter()
        .map(|(k, v)| match v.get(at) {
            Some(Shown::Exact(n)) => (k, u64::try_from(*n).unwrap_or(0)),
            _ => (k, 0),
        })
        .collect();
    Some((per_key.values().sum(), per_key))
}

/// A `count` column's or an exact `sum` column's (integers, decimals) total over windows: what
/// verify and reconcile print beside the windows (revenue_agg's orders and revenue).
pub(crate) struct ColumnTotal {
    pub(crate) column: String,
    /// A `count` column's (the records counted), not a sum's.
    pub(crate) count: bool,
    pub(crate) total: i128,
    /// A decimal sum's scale.
    scale: Option<u32>,
}

impl ColumnTotal {
    /// Each count and exact sum column of `job`, totalled over `windows`.
    pub(crate) fn of(job: &Job, windows: &Windows) -> Vec<ColumnTotal> {
        job.aggregates
            .iter()
            .enumerate()
            .filter_map(|(at, a)| {
                let scale = match (a.function, a.input.map(|t| (t.kind, t.scale))) {
                    (Function::Count, _) | (Function::Sum, Some((FieldKind::Integer, _))) => None,
                    (Function::Sum, Some((FieldKind::Decimal, scale))) => Some(scale),
                    _ => return None,
                };
                let total = windows
                    .values()
                    .map(|v| match v.get(at) {
                        Some(Shown::Exact(n)) => *n,
                        _ => 0,
                    })
                    .sum();
                Some(ColumnTotal {
                    column: a.column.clone(),
                    count: a.function == Function::Count,
                    total,
                    scale,
                })
            })
            .collect()
    }

    /// The total as the view shows it (a decimal with its places).
    pub(crate) fn shown(&self) -> String {
        match self.scale {
            Some(scale) => tally_core::declare::format_decimal(self.total, scale),
            None => self.total.to_string(),
        }
    }
}

/// The job's first exact `sum` column (of integers or decimals): a [`super::Reconciliation`]'s
/// revenue.
pub(crate) fn first_sum(job: &Job) -> Option<&tally_core::declare::Aggregate> {
    job.aggregates.iter().find(|a| {
        a.function == Function::Sum
            && a.input
                .is_some_and(|t| matches!(t.kind, FieldKind::Integer | FieldKind::Decimal))
    })
}

/// The first `count` column's and the first exact `sum` column's totals over `windows`: what a
/// [`super::Reconciliation`] compares as orders and revenue.
pub(crate) fn totals(job: &Job, windows: &Windows) -> (u64, i128) {
    let columns = ColumnTotal::of(job, windows);
    let first = |count: bool| columns.iter().find(|c| c.count == count);
    (
        first(true).map_or(0, |c| u64::try_from(c.total).unwrap_or(0)),
        first(false).map_or(0, |c| c.total),
    )
}

/// Adds of records counted more than once and missing, by the first `count` column.
fn miscounted(job: &Job, expected: &Windows, found: &Windows) -> (u64, u64) {
    let (Some((_, e)), Some((_, f))) = (counted(job, expected), counted(job, found)) else {
        return (0, 0);
    };
    let (mut over, mut lost) = (0, 0);
    for (k, n) in &e {
        let got = f.get(k).copied().unwrap_or(0);
        over += got.saturating_sub(*n);
        lost += n.saturating_sub(got);
    }
    over += f
        .iter()
        .filter(|(k, _)| !e.contains_key(*k))
        .map(|(_, n)| n)
        .sum::<u64>();
    (over, lost)
}

/// Compares the view, the committed versions (what the next publish shows) and the dead-letter
/// topic with a manifest. Returns whether they all match.
///
/// A new version's own view holds the windows from its `restate_from` on. Once it holds the
/// job's view, that view is checked too: those windows, and the earlier ones as the takeover
/// kept the earlier version's answer, computed from the manifest by `earlier`'s columns (the
/// earlier version's file; without it they are counted, not checked).
pub async fn verify(
    config: &Config,
    manifest_path: &Path,
    earlier: Option<&Config>,
) -> Result<bool> {
    let job = &config.declared;
    let manifest = Manifest::load(manifest_path)
        .with_context(|| format!("reading {}", manifest_path.display()))?;
    let types = ViewTypes::of(config, job)?;
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let restate_from = config.computes_from_ms();
    let (expected, before) = restated::split_at(manifest.shown(job), restate_from);
    let found = types.read(sink.read_view_cells().await?)?;
    // What the next publish will show: a writer that broke the protocol shows here first.
    let committed = types.read(sink.read_committed_cells().await?)?;
    let diff = WindowDiff::compare(&expected, &found);
    let committed_diff = WindowDiff::compare(&expected, &committed);
    // What readers of the job read, once this version holds its view.
    let job_view = &config.clickhouse.table;
    let (holds, whose) = restated::readers_read(config, &sink).await?;
    let readers = if holds {
        let mut shown = types.read(sink.read_view_cells_of(job_view).await?)?;
        let mut expected = expected.clone();
        match earlier {
            Some(e) => {
                expected.extend(restated::earlier_answer(e, config, &before, &types.values)?)
            }
            None => {
                let (mine, kept) = restated::split_at(shown, restate_from);
                println!(
                    "the job's view {job_view}: {} rows before restate_from not checked (give --earlier with the earlier version's file)",
                    kept.len()
                );
                shown = mine;
            }
        }
        Some((expected, shown))
    } else {
        None
    };
    let (read_expected, read_found) = readers
        .as_ref()
        .map_or((&expected, &found), |(e, f)| (e, f));
    let version = config.job.version.max(1);
    let starts = match version {
        1 => None,
        _ => Some(tally_kafka::topic_starts(
            &config.kafka_settings(),
            &config.kafka.source_topic,
            config.start_from(),
        )?),
    };
    let expected_dead = restated::dead_letters_from(
        &manifest,
        starts.as_ref(),
        restate_from,
        config.operator().window,
    );
    let dead = DeadLetterDiff::compare(&expected_dead, &read_dead_letters(config)?);
    let counted_expected = counted(job, read_expected).map_or(0, |c| c.0);
    let counted_found = counted(job, read_found).map_or(0, |c| c.0);
    if let Some(line) = whose {
        println!("{line}; the rows below are the job's view's when it holds it");
    }
    println!("{:<28} {:>16} {:>16}", "", "expected", "found");
    println!(
        "{:<28} {:>16} {:>16}",
        "rows",
        read_expected.len(),
        read_found.len()
    );
    println!(
        "{:<28} {:>16} {:>16}",
        "records counted (windows)", counted_expected, counted_found
    );
    let sums = |w: &Windows| ColumnTotal::of(job, w).into_iter().filter(|c| !c.count);
    for (e, f) in sums(read_expected).zip(sums(read_found)) {
        println!("{:<28} {:>16} {:>16}", e.column, e.shown(), f.shown());
    }
    println!(
        "{:<28} {:>16} {:>16}",
        "dead letters",
        expected_dead.len(),
        dead.found()
    );
    println!(
        "records produced {}: {} valid, {} filtered, {} duplicates, {} late, {} poison",
        manifest.produced,
        manifest.valid,
        manifest.filtered,
        manifest.duplicates,
        manifest.late,
        manifest.poison
    );
    let readers_diff = readers.as_ref().map(|(e, f)| WindowDiff::compare(e, f));
    match &readers_diff {
        Some(d) => {
            d.print("rows of the job's view", 10);
            diff.print(&format!("rows of version {version}'s own view"), 10);
        }
        None => diff.print("rows", 10),
    }
    if !committed_diff.is_empty() {
        committed_diff.print("committed versions (what the next publish shows)", 10);
    }
    dead.print_summary();
    dead.print_first(10);
    let (seen_over, seen_lost) = miscounted(job, read_expected, read_found);
    let (next_over, next_lost) = miscounted(job, &expected, &committed);
    println!(
        "verify-summary rows_expected={} rows_found={} orders_expected={counted_expected} orders_found={counted_found} over_counted={} lost={} {}",
        read_expected.len(),
        read_found.len(),
        seen_over.max(next_over),
        seen_lost.max(next_lost),
        dead.summary_fields(expected_dead.len())
    );
    let ok = diff.is_empty()
        && committed_diff.is_empty()
        && readers_diff.is_none_or(|d| d.is_empty())
        && dead.is_empty();
    println!("verify: {}", if ok { "OK: exact match" } else { "FAILED" });
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_read_back_by_their_column_types() {
        let t = |ty: &str| ColumnType::parse(ty).unwrap();
        assert_eq!(canonical_key("12.5", t("Decimal(18, 2)")).unwrap(), "1250");
        assert_eq!(canonical_key("3", t("Float64")).unwrap(), "3");
        assert_eq!(canonical_key("/home", t("String")).unwrap(), "/home");
        assert_eq!(
            shown_value("-0.01", t("Decimal(18, 4)")).unwrap(),
            Shown::Exact(-100)
        );
        assert_eq!(
            shown_value("1790000000", t("DateTime")).unwrap(),
            Shown::Exact(1_790_000_000)
        );
        assert_eq!(shown_value("2.5", t("Float64")).unwrap(), Shown::Float(2.5));
        assert!(shown_value("x", t("UInt64")).is_err());
        assert!(Shown::Float(1.0).matches(&Shown::Float(1.0 + 1e-12)));
        assert!(!Shown::Float(1.0).matches(&Shown::Float(1.0001)));
        assert!(!Shown::Exact(1).matches(&Shown::Float(1.0)));
    }
}
