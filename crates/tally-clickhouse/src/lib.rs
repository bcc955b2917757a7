//! The exactly-once ClickHouse sink.
//!
//! Every checkpoint's output is one batch: the full current values of the windows it changed,
//! each row tagged with its version, the source partition's offset after the batch, written to a
//! data table, then one row in the commit log. The answer is computed from the versions present
//! in the commit log, taking per window and source partition the value of the highest version,
//! and published (`publish`): readers query a view of the published answer and the folded
//! windows (`fold`), tables that change only by whole parts at once. Hence:
//! - writing a batch twice equals writing it once (same version, same values; `argMax` picks one);
//! - versions grow with the partition's offset whoever writes it, so a later writer of a
//!   partition continues its versions;
//! - a batch is invisible until its single-row commit-log insert lands and a publish after it,
//!   which reads the commit log before the versions, so a reader never sees half a batch,
//!   however the data insert was split into parts or interrupted;
//! - no dedup tokens, transactions or `FINAL` are needed, so it holds on ClickHouse 18.16 and on
//!   a current server alike.

mod calendar;
mod error;
mod fold;
mod publish;
mod read_side;
mod reads;
mod replicas;
mod rows;
mod schema;
mod settings;
mod sink;
mod takeover;
mod tls;

pub use error::{Result, SinkError};
pub use fold::{FOLD_STEP_ROWS, FoldOutcome, FoldRules, FoldStep, READER_MARGIN};
pub use publish::{PublishOutcome, PublishStep, Published};
pub use read_side::{ReadLease, ReadSideHolder};
pub use reads::{BatchAccounting, BatchTotals, Cells, CommittedBatch, ViewKey, ViewTotals};
pub use replicas::{ClusterMember, Replicas, SYNC_WAIT, check_cluster};
pub use rows::ColumnType;
pub use schema::{Cut, Frontier, Shape, TableNames, normalise_type};
pub use settings::{Secret, SinkSettings};
pub use sink::{Batch, ClickHouseSink, WriteOutcome, WriteStep};
pub use tls::https_connector;
