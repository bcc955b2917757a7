//! `tally probe`: the view read like a dashboard reads it, checked for what a reader must never
//! see.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Result;
use tally_clickhouse::ClickHouseSink;
use tally_core::declare::Function;

use tally_runtime::config::Config;

/// One read of the view as the probe checks it: (window start ms, group-by values) → records
/// counted there (the job's first `count` column, revenue_agg's orders; else 0).
pub type Counted = BTreeMap<(i64, Vec<String>), u64>;

/// What a reader polling the view saw: for an input that only adds records, a window once
/// visible never disappears, no key appears twice, and no count goes down. A job of changes
/// retracts (an order deleted or moved takes its window's count down, and may empty it): its
/// view must show no key twice and no group counting 0 rows.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ProbeReport {
    /// The job retracts: windows may shrink and vanish.
    pub retracts: bool,
    pub reads: u64,
    /// Reads that failed (a service restarting): not a violation, but counted.
    pub errors: u64,
    /// Reads in which some key appeared twice.
    pub duplicated: u64,
    /// Windows seen once and missing from a later read.
    pub vanished: u64,
    /// Windows, or first group-by values (customers) summed over windows, whose count went
    /// down between reads.
    pub decreased: u64,
    /// Groups shown with a count of 0 (a job of changes leaves them out).
    pub empty: u64,
    /// First few violations, for the report.
    pub examples: Vec<String>,
}

impl ProbeReport {
    pub fn violations(&self) -> u64 {
        self.duplicated + self.vanished + self.decreased + self.empty
    }

    /// Compares one read with the previous one.
    pub fn observe(&mut self, previous: &Counted, current: &Counted) {
        self.reads += 1;
        let note = |report: &mut ProbeReport, text: String| {
            if report.examples.len() < 10 {
                report.examples.push(text);
            }
        };
        if self.retracts {
            for (key, counted) in current {
                if *counted == 0 {
                    self.empty += 1;
                    note(self, format!("window {key:?} shows a count of 0"));
                }
            }
            return;
        }
        for (key, counted) in previous {
            match current.get(key) {
                None => {
                    self.vanished += 1;
                    note(self, format!("window {key:?} vanished"));
                }
                Some(now) if now < counted => {
                    self.decreased += 1;
                    note(self, format!("window {key:?}: counted {counted} -> {now}"));
                }
                Some(_) => {}
            }
        }
        let (before, after) = (per_first_key(previous), per_first_key(current));
        for (first, counted) in &before {
            let now = after.get(first).copied().unwrap_or(0);
            if now < *counted {
                self.decreased += 1;
                note(self, format!("key {first}: counted {counted} -> {now}"));
            }
        }
    }
}

fn per_first_key(view: &Counted) -> BTreeMap<&str, u64> {
    let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
    for ((_, keys), counted) in view {
        let first = keys.first().map_or("", String::as_str);
        *totals.entry(first).or_default() += counted;
    }
    totals
}

/// The view's rows as the probe counts them.
async fn read_counted(sink: &ClickHouseSink, config: &Config) -> tally_clickhouse::Result<Counted> {
    let job = &config.declared;
    let count = job
        .aggregates
        .iter()
        .position(|a| a.function == Function::Count);
    let cells = sink.read_view_cells().await?;
    Ok(cells
        .into_iter()
        .map(|(key, values)| {
            let counted = count
                .and_then(|at| values.get(at))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            (key, counted)
        })
        .collect())
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
    let mut report = ProbeReport {
        retracts: config.declared.changes.is_some(),
        ..ProbeReport::default()
    };
    let mut previous = BTreeMap::new();
    while !stop.load(std::sync::atomic::Ordering::SeqCst)
        && until.is_none_or(|u| Instant::now() < u)
    {
        match read_counted(&sink, config).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn view(rows: &[(i64, &str, u64)]) -> Counted {
        rows.iter()
            .map(|(w, c, o)| ((*w, vec![(*c).to_owned(), "EUR".to_owned()]), *o))
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
        // A job of changes: shrinking and vanishing windows are retractions; an empty group is not.
        let mut changes = ProbeReport {
            retracts: true,
            ..ProbeReport::default()
        };
        changes.observe(&grown, &gone);
        assert_eq!(changes.violations(), 0);
        changes.observe(&gone, &view(&[(60_000, "x", 0)]));
        assert_eq!((changes.empty, changes.violations()), (1, 1));
    }
}
