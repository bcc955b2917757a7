//! The tools that make the "Written → Queryable → Reported" hops checkable by anyone, against
//! any deployment: `tally verify` (against a loadgen manifest), `tally reconcile` (against the
//! source) and `tally probe` (as a dashboard reads the view).

mod dead_letters;
mod probe;
mod reconcile;
mod reconcile_every;
mod replay;
mod restated;
mod verify;

pub use dead_letters::read_dead_letters;
pub use probe::{ProbeReport, probe};
pub use reconcile::{ReconcileFilter, Reconciliation, reconcile};
pub use reconcile_every::{Round, reconcile_every};
pub use replay::commit_log_gaps;
pub(crate) use restated::readers_read;
pub use verify::{KeyedDiff, verify};
pub(crate) use verify::{ViewTypes, WindowDiff, Windows, counted, first_sum, shown_of, totals};
