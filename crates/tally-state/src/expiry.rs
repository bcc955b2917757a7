//! When dedup ids expire: per partition, the cutoff below which an id's event time is past the
//! horizon, for reads and for compaction, which drops those ids.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use rocksdb::compaction_filter::{CompactionFilter, Decision};
use rocksdb::compaction_filter_factory::{CompactionFilterContext, CompactionFilterFactory};
use tally_core::PartitionId;

use crate::keys;

/// Per partition, dedup entries with event time before the cutoff are expired.
#[derive(Debug, Clone, Default)]
pub(crate) struct ExpiryCutoffs(Arc<RwLock<Cutoffs>>);

#[derive(Debug, Default)]
struct Cutoffs {
    /// Of the metadata as it is now: what reads see.
    current: BTreeMap<PartitionId, i64>,
    /// Of synced metadata only, for compaction: dropping ids by a cutoff that a crash then
    /// lost would leave the reopened store without ids it still needs.
    durable: BTreeMap<PartitionId, i64>,
}

impl ExpiryCutoffs {
    pub(crate) fn publish(&self, cutoffs: &BTreeMap<PartitionId, i64>, synced: bool) {
        let mut c = self.0.write().unwrap_or_else(PoisonError::into_inner);
        if c.current != *cutoffs {
            c.current.clone_from(cutoffs);
        }
        if synced && c.durable != *cutoffs {
            c.durable.clone_from(cutoffs);
        }
    }

    pub(crate) fn durable(&self) -> BTreeMap<PartitionId, i64> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .durable
            .clone()
    }

    pub(crate) fn is_expired(&self, partition: PartitionId, event_time_ms: i64) -> bool {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .current
            .get(&partition)
            .is_some_and(|cutoff| event_time_ms < *cutoff)
    }
}

/// Compaction of the id column family drops expired ids: an id is written once and never
/// deleted (no time index to walk, no tombstones).
impl CompactionFilterFactory for ExpiryCutoffs {
    type Filter = ExpiredIds;

    fn create(&mut self, _: CompactionFilterContext) -> ExpiredIds {
        ExpiredIds(self.durable())
    }

    fn name(&self) -> &std::ffi::CStr {
        c"tally-expired-ids"
    }
}

pub(crate) struct ExpiredIds(BTreeMap<PartitionId, i64>);

impl CompactionFilter for ExpiredIds {
    fn filter(&mut self, _level: u32, key: &[u8], value: &[u8]) -> Decision {
        let expired = keys::decode_seen_id(key)
            .map(|(p, _)| p)
            .zip(<[u8; 8]>::try_from(value).ok().map(i64::from_be_bytes))
            .is_some_and(|(p, t)| self.0.get(&p).is_some_and(|cutoff| t < *cutoff));
        if expired {
            Decision::Remove
        } else {
            Decision::Keep
        }
    }

    fn name(&self) -> &std::ffi::CStr {
        c"tally-expired-ids"
    }
}
