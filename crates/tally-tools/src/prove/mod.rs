//! The tools that make the "Written → Queryable → Reported" hops checkable by anyone, against
//! any deployment: `tally verify` (against a loadgen manifest), `tally reconcile` (against the
//! source) and `tally probe` (as a dashboard reads the view).

mod probe;
mod reconcile;
mod reconcile_declared;
mod reconcile_every;
mod rounds;
mod verify;
mod verify_declared;

pub use probe::{ProbeReport, probe};
pub use reconcile::{ReconcileFilter, Reconciliation, commit_log_gaps};
pub use reconcile_every::{Round, reconcile_every};
pub use verify::{KeyedDiff, RowDiff, read_dead_letters, verify};
pub(crate) use verify_declared::shown_of;
pub use verify_declared::verify_declared;
pub(crate) use verify_declared::{ViewTypes, WindowDiff, Windows, counted};

/// Recomputes the job's windows from the source up to its last committed epoch and compares
/// them with the view at that epoch, by revenue_agg's columns or by its declaration; `print`
/// reports on stdout.
pub async fn reconcile(
    config: &tally_runtime::config::Config,
    filter: &ReconcileFilter,
    print: bool,
) -> anyhow::Result<Reconciliation> {
    match config.tools_declaration() {
        Some(job) => reconcile_declared::reconcile_declared(config, job, filter, print).await,
        None => reconcile::reconcile(config, filter, print).await,
    }
}
