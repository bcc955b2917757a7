//! What earlier releases wrote, and how opening a store brings it forward: the on-disk format
//! versions, the window keys of the releases before group keys, (window start, customer,
//! currency), and the window values of the releases before values of any shape, (orders,
//! revenue), read so that a state directory and changelog they left carry on after an upgrade.

use std::collections::BTreeMap;

use crate::{CF_META, CF_PENDING, CF_SEEN_TIME_V1, KEY_FORMAT, StateError, StateStore};
use compact_str::CompactString;
use rocksdb::{IteratorMode, WriteBatch, WriteOptions};
use serde::{Deserialize, Serialize};
use tally_core::{
    Amount, Checkpoint, DeadLetter, Epoch, OutputRow, PartitionCheckpoint, PartitionId, WindowAgg,
    WindowKey,
};

/// revenue_agg's window key as changelog format 1 and store format 2 encode it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowKeyV1 {
    pub window_start_ms: i64,
    pub customer_id: CompactString,
    pub currency: CompactString,
}

impl From<WindowKeyV1> for WindowKey {
    fn from(k: WindowKeyV1) -> WindowKey {
        WindowKey::of_orders(k.window_start_ms, k.customer_id, k.currency)
    }
}

/// revenue_agg's window value as changelog formats 1 and 2 and store formats 1 to 3 encode it
/// (the store's windows still hold these bytes: `values.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowAggV2 {
    pub orders: u64,
    pub revenue: Amount,
}

impl From<WindowAggV2> for WindowAgg {
    fn from(v: WindowAggV2) -> WindowAgg {
        WindowAgg::of_orders(v.orders, v.revenue)
    }
}

/// An output row as store formats 2 (`K`: [`WindowKeyV1`]) and 3 (`K`: [`WindowKey`]) keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputRowV1<K = WindowKeyV1> {
    pub partition: PartitionId,
    pub key: K,
    pub window_end_ms: i64,
    pub value: WindowAggV2,
}

/// A [`Checkpoint`] as store formats 2 and 3 keep an epoch's pending outputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointV1<K = WindowKeyV1> {
    pub epoch: Epoch,
    pub partitions: BTreeMap<PartitionId, PartitionCheckpoint>,
    pub rows: Vec<OutputRowV1<K>>,
    pub seen: Vec<(PartitionId, String, i64)>,
    pub dead_letters: Vec<DeadLetter>,
    pub close_windows_before: Vec<(PartitionId, i64)>,
    pub expire_seen_before: Vec<(PartitionId, i64)>,
}

impl<K: Into<WindowKey>> From<CheckpointV1<K>> for Checkpoint {
    fn from(c: CheckpointV1<K>) -> Checkpoint {
        Checkpoint {
            epoch: c.epoch,
            partitions: c.partitions,
            rows: c
                .rows
                .into_iter()
                .map(|r| OutputRow {
                    partition: r.partition,
                    key: r.key.into(),
                    window_end_ms: r.window_end_ms,
                    value: r.value.into(),
                })
                .collect(),
            seen: c.seen,
            dead_letters: c.dead_letters,
            close_windows_before: c.close_windows_before,
            expire_seen_before: c.expire_seen_before,
        }
    }
}

/// Version of the on-disk layout. Bump on any change to keys or encodings.
/// 4: a pending epoch's rows carry values of any shape (tagged words); version 3 encoded them as
/// (orders, revenue), which an open rewrites (the windows' values keep their bytes: `values.rs`).
/// 3: a pending epoch's rows carry group keys of any number of parts; version 2 encoded them as
/// (customer, currency), which an open rewrites (window keys and everything else are the same).
/// 2: dedup ids expire in compaction; version 1 also kept them in a time index, which an open
/// drops (the id entries are the same).
pub const FORMAT_VERSION: u32 = 4;
pub(crate) const FORMAT_ORDER_VALUES: u32 = 3;
pub(crate) const FORMAT_ORDER_KEYS: u32 = 2;
pub(crate) const FORMAT_WITH_TIME_INDEX: u32 = 1;

impl StateStore {
    pub(crate) fn check_format(&mut self) -> Result<(), StateError> {
        let cf = self.cf(CF_META)?;
        match self.db.get_cf(cf, KEY_FORMAT).map_err(|e| self.rocks(e))? {
            None => {
                let mut opts = WriteOptions::default();
                opts.set_sync(true);
                self.db
                    .put_cf_opt(cf, KEY_FORMAT, FORMAT_VERSION.to_be_bytes(), &opts)
                    .map_err(|e| self.rocks(e))
            }
            Some(bytes) => {
                let found = <[u8; 4]>::try_from(bytes.as_slice())
                    .map(u32::from_be_bytes)
                    .map_err(|_| StateError::Corrupt {
                        path: self.path.clone(),
                        what: "format version",
                        detail: format!("{} bytes", bytes.len()),
                    })?;
                if found == FORMAT_VERSION {
                    Ok(())
                } else if found == FORMAT_WITH_TIME_INDEX || found == FORMAT_ORDER_KEYS {
                    if found == FORMAT_WITH_TIME_INDEX {
                        self.drop_time_index()?;
                    }
                    self.rewrite_pending_outputs::<WindowKeyV1>()
                } else if found == FORMAT_ORDER_VALUES {
                    self.rewrite_pending_outputs::<WindowKey>()
                } else {
                    Err(StateError::UnknownFormat {
                        path: self.path.clone(),
                        found,
                    })
                }
            }
        }
    }

    /// Format 1 to 2: the time index goes (dropped first, so a crash before the new version is
    /// written leaves a format 1 store without it, which this repeats harmlessly).
    fn drop_time_index(&mut self) -> Result<(), StateError> {
        if self.db.cf_handle(CF_SEEN_TIME_V1).is_some() {
            self.db
                .drop_cf(CF_SEEN_TIME_V1)
                .map_err(|e| self.rocks(e))?;
        }
        Ok(())
    }

    /// Formats 2 and 3 to 4: the pending outputs of pre-committed epochs (and of the last
    /// committed one) are rewritten with group keys and tagged values, in one synced batch with
    /// the new version. `K`: the window key of the format found.
    fn rewrite_pending_outputs<K>(&mut self) -> Result<(), StateError>
    where
        K: Into<WindowKey> + serde::de::DeserializeOwned,
    {
        let cf = self.cf(CF_PENDING)?;
        let mut batch = WriteBatch::default();
        for item in self.db.iterator_cf(cf, IteratorMode::Start) {
            let (key, bytes) = item.map_err(|e| self.rocks(e))?;
            let old: CheckpointV1<K> = self.decode(&bytes, "pending outputs (formats 2 and 3)")?;
            let outputs = Checkpoint::from(old);
            batch.put_cf(cf, key, self.encode(&outputs, "pending outputs")?);
        }
        batch.put_cf(self.cf(CF_META)?, KEY_FORMAT, FORMAT_VERSION.to_be_bytes());
        self.write(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bincode_config;
    use tally_core::{Amount, OutputRow};

    /// A store written by the releases before group keys (format 2) or before values of any
    /// shape (format 3): its pending epoch reads back with group keys and values after the
    /// upgrade, and the rewrite is done once.
    fn a_store_upgrades_with_its_pending_epoch<K>(format: u32, key_of: impl Fn(&str) -> K)
    where
        K: Into<WindowKey> + Serialize + serde::de::DeserializeOwned + Clone,
    {
        let dir = tempfile::tempdir().unwrap();
        let row = |customer: &str, orders: u64| OutputRowV1 {
            partition: 3,
            key: key_of(customer),
            window_end_ms: 120_000,
            value: WindowAggV2 {
                orders,
                revenue: Amount::parse("12.5").unwrap(),
            },
        };
        let old = CheckpointV1 {
            epoch: Epoch(7),
            partitions: [(3, PartitionCheckpoint::default())].into(),
            rows: vec![row("a\0b", 1), row("cust-1", 4)],
            seen: Vec::new(),
            dead_letters: Vec::new(),
            close_windows_before: vec![(3, 0)],
            expire_seen_before: Vec::new(),
        };
        {
            let store = StateStore::open(dir.path(), "job").unwrap();
            let mut batch = WriteBatch::default();
            let bytes = bincode::serde::encode_to_vec(&old, bincode_config()).unwrap();
            batch.put_cf(store.cf(CF_PENDING).unwrap(), 7u64.to_be_bytes(), bytes);
            batch.put_cf(store.cf(CF_META).unwrap(), KEY_FORMAT, format.to_be_bytes());
            store.write(batch).unwrap();
        }
        let expected = Checkpoint::from(old);
        assert_eq!(
            expected.rows[1],
            OutputRow {
                partition: 3,
                key: WindowKey::of_orders(60_000, "cust-1", "EUR"),
                window_end_ms: 120_000,
                value: WindowAgg::of_orders(4, Amount::parse("12.5").unwrap()),
            }
        );
        for _ in 0..2 {
            let store = StateStore::open(dir.path(), "job").unwrap();
            let (pending, _) = store.pending(Epoch(7), 60_000).unwrap();
            assert_eq!(pending, expected);
            let format = store
                .db
                .get_cf(store.cf(CF_META).unwrap(), KEY_FORMAT)
                .unwrap();
            assert_eq!(format.as_deref(), Some(&FORMAT_VERSION.to_be_bytes()[..]));
        }
    }

    #[test]
    fn a_format_2_store_upgrades_with_its_pending_epoch() {
        a_store_upgrades_with_its_pending_epoch(FORMAT_ORDER_KEYS, |customer| WindowKeyV1 {
            window_start_ms: 60_000,
            customer_id: customer.into(),
            currency: "EUR".into(),
        });
    }

    #[test]
    fn a_format_3_store_upgrades_with_its_pending_epoch() {
        a_store_upgrades_with_its_pending_epoch(FORMAT_ORDER_VALUES, |customer| {
            WindowKey::of_orders(60_000, customer, "EUR")
        });
    }
}
