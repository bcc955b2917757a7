//! The tally job runtime: what `tally run` does, and nothing of the tools that check it.
//!
//! The pipeline, in the order a record goes: [`consume`] (records into the operator, epochs cut
//! at barriers) → [`persist`] (the pre-commit) → [`commit`] (the Kafka transaction and the
//! ClickHouse batch) → [`read_side`] (publish and fold), wired by [`worker`] and run, one task or
//! several, by [`tasks`] under the job's [`lease`]; a new version of a job takes its view over
//! from the read side (`takeover`). A job's [`settings`] are resolved once from its [`config`].

mod background;
pub mod capture;
pub mod commit;
pub mod config;
pub mod consume;
pub mod declaration;
pub mod events;
pub mod fault;
pub mod health;
pub mod identity;
pub mod job_scope;
pub mod lease;
pub mod marks;
pub mod memory;
pub mod partitions;
pub mod persist;
pub mod process;
pub mod read_side;
mod rebuild;
pub mod restore;
pub mod retry;
pub mod schemas;
pub mod settings;
mod standby;
mod takeover;
pub mod tasks;
pub mod worker;
