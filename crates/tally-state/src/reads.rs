//! Reading what the store holds: the operator's lookups of windows and dedup ids, and scans of
//! every entry (restores, tests, `doctor`).

use rocksdb::{Direction, IteratorMode};
use tally_core::{PartitionId, SourceRow, StateReader, WindowAgg, WindowKey};

use crate::format::{CF_SEEN_ID, CF_SOURCE_ROWS, CF_WINDOWS};
use crate::keys;
use crate::store::{StateError, StateStore};

impl StateStore {
    /// Calls `f(id, event_time)` for every dedup entry of `partition` not yet expired, in id
    /// order, from a consistent snapshot (the operator rebuilds its id filter from it).
    pub fn scan_seen(
        &self,
        partition: PartitionId,
        mut f: impl FnMut(&[u8], i64),
    ) -> Result<u64, StateError> {
        let id_cf = self.cf(CF_SEEN_ID)?;
        let start = keys::seen_id(partition, b"");
        let mut opts = rocksdb::ReadOptions::default();
        if let Some(next) = partition.checked_add(1) {
            opts.set_iterate_upper_bound(keys::seen_id(next, b""));
        }
        // A one-off walk: leave the cache to the lookups.
        opts.fill_cache(false);
        let iter =
            self.db
                .iterator_cf_opt(id_cf, opts, IteratorMode::From(&start, Direction::Forward));
        let mut count = 0;
        for item in iter {
            let (key, value) = item.map_err(|e| self.rocks(e))?;
            let (p, id) = keys::decode_seen_id(&key).ok_or_else(|| self.corrupt_key("dedup id"))?;
            if p != partition {
                break;
            }
            let t = self.seen_time(&value)?;
            if !self.expiry.is_expired(partition, t) {
                f(id, t);
                count += 1;
            }
        }
        Ok(count)
    }

    /// Every stored window, in key order (tests, `doctor`).
    pub fn windows(&self) -> Result<Vec<(PartitionId, WindowKey, WindowAgg)>, StateError> {
        let cf = self.cf(CF_WINDOWS)?;
        let mut out = Vec::new();
        for item in self.db.iterator_cf(cf, IteratorMode::Start) {
            let (key, value) = item.map_err(|e| self.rocks(e))?;
            let (p, k) = keys::decode_window(&key, self.shape.key_parts)
                .ok_or_else(|| self.corrupt_key("window key"))?;
            out.push((p, k, self.decode_window_value(&value)?));
        }
        Ok(out)
    }

    /// Every row of a change job as (partition, primary key, row), in key order (tests,
    /// restores, the size of the state per row).
    pub fn source_rows(&self) -> Result<Vec<(PartitionId, String, SourceRow)>, StateError> {
        let cf = self.cf(CF_SOURCE_ROWS)?;
        let mut out = Vec::new();
        for item in self.db.iterator_cf(cf, IteratorMode::Start) {
            let (key, value) = item.map_err(|e| self.rocks(e))?;
            let (p, row_key) =
                keys::decode_source_row(&key).ok_or_else(|| self.corrupt_key("source row key"))?;
            out.push((p, row_key.to_owned(), self.decode(&value, "source row")?));
        }
        Ok(out)
    }

    /// Every live dedup entry as (partition, event id, event time), sorted.
    pub fn seen_entries(&self) -> Result<Vec<(PartitionId, String, i64)>, StateError> {
        let id_cf = self.cf(CF_SEEN_ID)?;
        let mut out = Vec::new();
        for item in self.db.iterator_cf(id_cf, IteratorMode::Start) {
            let (key, value) = item.map_err(|e| self.rocks(e))?;
            let (p, id) = keys::decode_seen_id(&key).ok_or_else(|| self.corrupt_key("dedup id"))?;
            let t = self.seen_time(&value)?;
            if !self.expiry.is_expired(p, t) {
                out.push((p, String::from_utf8_lossy(id).into_owned(), t));
            }
        }
        out.sort();
        Ok(out)
    }
}

impl StateReader for StateStore {
    type Error = StateError;

    fn window(
        &self,
        partition: PartitionId,
        key: &WindowKey,
    ) -> Result<Option<WindowAgg>, StateError> {
        let cf = self.cf(CF_WINDOWS)?;
        match self
            .db
            .get_pinned_cf(cf, keys::window(partition, key))
            .map_err(|e| self.rocks(e))?
        {
            Some(bytes) => self.decode_window_value(&bytes).map(Some),
            None => Ok(None),
        }
    }

    fn seen_event_time(
        &self,
        partition: PartitionId,
        event_id: &str,
    ) -> Result<Option<i64>, StateError> {
        let key = keys::seen_id(partition, event_id.as_bytes());
        match self
            .db
            .get_pinned_cf(self.cf(CF_SEEN_ID)?, key)
            .map_err(|e| self.rocks(e))?
        {
            None => Ok(None),
            Some(v) => {
                let t = self.seen_time(&v)?;
                Ok((!self.expiry.is_expired(partition, t)).then_some(t))
            }
        }
    }

    fn source_row(
        &self,
        partition: PartitionId,
        key: &str,
    ) -> Result<Option<SourceRow>, StateError> {
        let mut k = Vec::with_capacity(4 + key.len());
        keys::source_row_into(&mut k, partition, key);
        self.db
            .get_pinned_cf(self.cf(CF_SOURCE_ROWS)?, k)
            .map_err(|e| self.rocks(e))?
            .map(|bytes| self.decode(&bytes, "source row"))
            .transpose()
    }
}
