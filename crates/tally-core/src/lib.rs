//! Pure processing logic for tally: jobs by declaration, event-time windows, watermarks, deduplication and
//! per-partition accounting. Nothing in this crate performs I/O; state is read through
//! [`StateReader`] and every change is handed out as a [`Checkpoint`] at a barrier.

pub mod amount;
pub mod declare;
pub mod decode;
pub mod group_key;
pub mod mem;
pub mod operator;
pub mod seen_filter;
pub mod source_row;
pub mod time;
pub mod types;
pub mod window;
pub mod window_agg;

pub use amount::{Amount, AmountError};
pub use declare::FieldMapping;
pub use decode::{Poison, PoisonReason};
pub use group_key::GroupKey;
pub use mem::MemStore;
pub use operator::{
    Checkpoint, EpochCut, OperatorConfig, Outcome, PartitionCheckpoint, Program, Record,
    StateReader, WindowOperator, WithInFlight,
};
pub use seen_filter::SeenIdFilter;
pub use source_row::{Contribution, SourceRow};
pub use types::{
    Accounting, CheckpointBarrier, DeadLetter, Epoch, Offset, OutputRow, PartitionId, WindowKey,
};
pub use window::{Watermark, WindowSpec};
pub use window_agg::{ORDERS_WORDS, RowShape, WindowAgg, Word, WordKind};
