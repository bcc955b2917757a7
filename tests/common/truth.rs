//! revenue_agg's ground truth for the records a test produces: its view and dead letters
//! summed here from what the generator says each record is and adds, by arithmetic of its
//! own (not tally's), and written as the manifest `tally verify` reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use tally_core::PoisonReason;
use tally_core::declare::{FieldMapping, Job, WindowRules};
use tally_tools::loadgen::{GeneratedRecord, Input, Kind, Running};

/// (window start ms, customer, currency) → (orders, revenue units)
pub type Rows = BTreeMap<(i64, String, String), (u64, i64)>;

/// revenue_agg's declaration, resolved with the tests' [`super::rules`].
pub fn revenue_agg() -> Arc<Job> {
    let rules = super::rules();
    let job = tally_core::declare::revenue_agg(&FieldMapping::default())
        .resolve(WindowRules {
            size_ms: rules.window.size_ms,
            slide_ms: Some(rules.window.slide_ms),
            allowed_lateness_ms: rules.allowed_lateness_ms,
            dedup_horizon_ms: rules.dedup_horizon_ms,
        })
        .expect("revenue_agg's declaration resolves");
    Arc::new(job)
}

/// What the view and the dead-letter topic must hold once the records produced so far are
/// processed.
#[derive(Debug, Clone, Default)]
pub struct Manifest {
    pub source_topic: String,
    pub produced: u64,
    pub valid: u64,
    pub duplicates: u64,
    pub late: u64,
    pub poison: u64,
    pub rows: Rows,
    /// (partition, offset) → reason
    pub dead_letters: BTreeMap<(i32, i64), PoisonReason>,
}

impl Manifest {
    /// Adds a record produced at `offset`.
    pub fn record(&mut self, record: &GeneratedRecord, offset: i64) {
        self.produced += 1;
        match record.kind {
            Kind::Valid => {
                self.valid += 1;
                let Some(c) = &record.contributes else {
                    return;
                };
                let units = match c.inputs.get(1) {
                    Some(Input::Exact(units)) => *units,
                    other => panic!("revenue_agg's amount is exact, not {other:?}"),
                };
                let start = super::rules().window.start_of(c.time_ms);
                let row = self
                    .rows
                    .entry((start, c.keys[0].clone(), c.keys[1].clone()))
                    .or_default();
                row.0 += 1;
                row.1 += units;
            }
            Kind::Duplicate => self.duplicates += 1,
            Kind::Filtered => panic!("revenue_agg has no filter"),
            Kind::Late => {
                self.late += 1;
                self.dead_letters
                    .insert((record.partition, offset), PoisonReason::Late);
            }
            Kind::Poison(reason) => {
                self.poison += 1;
                self.dead_letters.insert((record.partition, offset), reason);
            }
        }
    }

    pub fn orders(&self) -> u64 {
        self.rows.values().map(|r| r.0).sum()
    }

    /// Writes the manifest `tally verify --manifest` reads.
    pub fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        tally_tools::loadgen::Manifest {
            spec: None,
            source_topic: self.source_topic.clone(),
            produced: self.produced,
            valid: self.valid,
            filtered: 0,
            duplicates: self.duplicates,
            late: self.late,
            poison: self.poison,
            windows: self
                .rows
                .iter()
                .map(|((w, customer, currency), (orders, units))| {
                    (
                        *w,
                        vec![customer.clone(), currency.clone()],
                        vec![Running::Count(*orders), Running::Exact(i128::from(*units))],
                    )
                })
                .collect(),
            dead_letters: self
                .dead_letters
                .iter()
                .map(|((p, o), r)| (*p, *o, *r))
                .collect(),
            // Read only by verify of a later version (the tests' manifests are version 1's).
            late_times: Vec::new(),
        }
        .save(path)
    }
}
