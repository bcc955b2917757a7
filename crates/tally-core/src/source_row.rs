//! What a change job holds per row of its source table: the position of the newest change
//! applied to the row, and what the row adds to its windows now (its contribution), so that
//! the next change can take exactly that back out.

use serde::{Deserialize, Serialize};

use crate::declare::Position;
use crate::group_key::GroupKey;
use crate::window_agg::WindowAgg;

/// A row's current contribution: the windows of its event time, its group key, and the words
/// it adds to each of those windows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Contribution {
    pub event_time_ms: i64,
    pub key: GroupKey,
    pub value: WindowAgg,
}

/// One row as the job holds it. A deleted row (or one its filter leaves out) keeps its
/// position and no contribution: a replayed older change of it is still recognised.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRow {
    pub position: Position,
    pub contribution: Option<Contribution>,
}

impl SourceRow {
    /// Estimated bytes of the row held in memory and written, besides its key.
    pub fn bytes(&self) -> usize {
        48 + self
            .contribution
            .as_ref()
            .map_or(0, |c| c.key.text_len() + 8 * c.value.words().len() + 24)
    }
}
