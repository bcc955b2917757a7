//! The tools that make the "Written → Queryable → Reported" hops checkable by anyone, against
//! any deployment: `tally verify` (against a loadgen manifest), `tally reconcile` (against the
//! source) and `tally probe` (as a dashboard reads the view).

mod probe;
mod reconcile;
mod reconcile_declared;
mod verify;
mod verify_declared;

pub use probe::{ProbeReport, probe};
pub use reconcile::{
    ReconcileFilter, Reconciliation, Round, commit_log_gaps, reconcile, reconcile_every,
};
pub use reconcile_declared::reconcile_declared;
pub use verify::{RowDiff, read_dead_letters, verify};
#[cfg(test)]
pub(crate) use verify_declared::shown_of;
pub use verify_declared::verify_declared;
pub(crate) use verify_declared::{ViewTypes, WindowDiff, Windows, counted};
