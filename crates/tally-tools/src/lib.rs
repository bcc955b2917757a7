//! The tools that check and feed a tally job, above its runtime: [`prove`] (verify, reconcile,
//! probe: each hop's invariant recomputed from the source), [`doctor`] (the chain's hops, one
//! row each), [`loadgen`] (records and their manifest) and [`database`] (a change job's source
//! database: its workload, its capture and the consistent reads reconciliation compares with),
//! and [`version_change`] (what a new version of a job changes against the running one).

pub mod database;
pub mod doctor;
pub mod events;
pub mod loadgen;
pub mod prove;
pub mod version_change;
