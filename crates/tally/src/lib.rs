//! The tally job runtime and its tools, as a library so integration tests can drive them.

mod background;
pub mod config;
pub mod doctor;
pub mod events;
pub mod fault;
pub mod health;
pub mod identity;
pub mod lease;
pub mod loadgen;
pub mod memory;
pub mod prove;
pub mod read_side;
pub mod restore;
mod undone;
pub mod worker;
