//! The tools' internal events, as the runtime's are: each logs and counts in one place.

use metrics::{counter, gauge};
use tally_core::Epoch;

/// What one round of `tally reconcile --every` found.
pub struct ReconcileRound {
    pub full: bool,
    pub epoch: Option<Epoch>,
    pub records_read: u64,
    pub keys: usize,
    pub mismatched: usize,
    pub orders_ratio: f64,
    pub revenue_ratio: f64,
}

/// A round of `tally reconcile --every`, or its failure.
pub struct Reconciled<'a> {
    pub round: &'a anyhow::Result<ReconcileRound>,
}

impl Reconciled<'_> {
    pub fn emit(&self) {
        match self.round {
            Ok(r) => {
                println!(
                    "reconcile round ({}): up to epoch {}, {} records read, {} keys checked, {} differ; orders ratio {:.6}, revenue ratio {:.6}",
                    if r.full { "full" } else { "incremental" },
                    r.epoch.map_or(0, |e| e.0),
                    r.records_read,
                    r.keys,
                    r.mismatched,
                    r.orders_ratio,
                    r.revenue_ratio
                );
                gauge!("tally_reconcile_keys_mismatched").set(r.mismatched as f64);
                gauge!("tally_reconcile_orders_ratio").set(r.orders_ratio);
                gauge!("tally_reconcile_revenue_ratio").set(r.revenue_ratio);
                gauge!("tally_reconcile_epoch").set(r.epoch.map_or(0.0, |e| e.0 as f64));
                counter!("tally_reconcile_runs_total").increment(1);
            }
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "reconcile failed");
                counter!("tally_reconcile_errors_total").increment(1);
            }
        }
    }
}
