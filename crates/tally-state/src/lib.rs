//! The durable state store: RocksDB holding window aggregates, the dedup set, per-partition
//! progress and the pending outputs of a pre-committed epoch.
//!
//! RocksDB only ever holds checkpointed state: the operator keeps an epoch's changes in memory and
//! [`StateStore::pre_commit`] writes all of them, the next offsets and the epoch's outputs in one
//! synced `WriteBatch`. Restoring is opening the database.

pub mod changelog;
mod checkpoint;
mod expiry;
mod format;
mod keys;
mod memory;
mod old_formats;
mod reads;
pub mod replay;
mod store;
mod upgrade;
mod values;

pub use checkpoint::{CheckpointMeta, EpochStatus};
pub use format::FORMAT_VERSION;
pub use memory::{
    DEFAULT_SHARED_MEMORY_MIB, SharedMemoryUsage, set_shared_memory_mib, shared_memory_usage,
};
pub use store::{EncodedRecord, StateError, StateStore};
