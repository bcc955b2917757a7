//! How opening a store brings forward the state an earlier release left: the on-disk format
//! versions, and the rewrite of what each changed (the encodings: `old_formats.rs`), so that a
//! state directory and changelog carry on after an upgrade.

use crate::changelog::{LivenessV1, RestorePoints};
use crate::checkpoint::CheckpointMeta;
use crate::format::*;
use crate::old_formats::*;
use crate::store::{StateError, StateStore};
use rocksdb::{IteratorMode, WriteBatch, WriteOptions};
use tally_core::{Checkpoint, OutputRow, PartitionCheckpoint, WindowKey};

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
                    self.rewrite_pending_outputs::<OutputRowV1<WindowKeyV1>, PartitionCheckpointV1>(
                    )
                } else if found == FORMAT_ORDER_VALUES {
                    self.rewrite_pending_outputs::<OutputRowV1<WindowKey>, PartitionCheckpointV1>()
                } else if found == FORMAT_ANY_VALUES {
                    self.rewrite_pending_outputs::<OutputRow, PartitionCheckpointV1>()
                } else if found == FORMAT_FILTERED {
                    self.rewrite_pending_outputs::<OutputRow, PartitionCheckpointV2>()
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

    /// Formats 2 to 5 to 6: the checkpoint, the pending outputs of pre-committed epochs (and
    /// of the last committed one) and the restore points are rewritten with group keys, tagged
    /// values and the accounting of this format, in one synced batch with the new version.
    /// `R` and `P`: the row and the partition progress of the format found.
    fn rewrite_pending_outputs<R, P>(&mut self) -> Result<(), StateError>
    where
        R: Into<OutputRow> + serde::de::DeserializeOwned,
        P: Into<PartitionCheckpoint> + serde::de::DeserializeOwned,
    {
        let cf = self.cf(CF_PENDING)?;
        let mut batch = WriteBatch::default();
        for item in self.db.iterator_cf(cf, IteratorMode::Start) {
            let (key, bytes) = item.map_err(|e| self.rocks(e))?;
            let old: CheckpointV1<R, P> =
                self.decode(&bytes, "pending outputs (formats 2 to 5)")?;
            let outputs = Checkpoint::from(old);
            batch.put_cf(cf, key, self.encode(&outputs, "pending outputs")?);
        }
        let meta_cf = self.cf(CF_META)?;
        if let Some(bytes) = self
            .db
            .get_cf(meta_cf, KEY_CHECKPOINT)
            .map_err(|e| self.rocks(e))?
        {
            let old: CheckpointMetaV1<P> =
                self.decode(&bytes, "checkpoint metadata (formats 1 to 5)")?;
            let meta = CheckpointMeta::from(old);
            batch.put_cf(
                meta_cf,
                KEY_CHECKPOINT,
                self.encode(&meta, "checkpoint metadata")?,
            );
        }
        if let Some(bytes) = self
            .db
            .get_cf(meta_cf, KEY_RESTORE_POINTS)
            .map_err(|e| self.rocks(e))?
        {
            let old: RestorePoints<LivenessV1> =
                self.decode(&bytes, "restore points (formats 1 to 5)")?;
            batch.put_cf(
                meta_cf,
                KEY_RESTORE_POINTS,
                self.encode(&old.brought_forward(), "restore points")?,
            );
        }
        batch.put_cf(meta_cf, KEY_FORMAT, FORMAT_VERSION.to_be_bytes());
        self.write(batch)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::changelog::Liveness;
    use crate::checkpoint::EpochStatus;
    use crate::format::bincode_config;
    use serde::Serialize;
    use tally_core::{Amount, Epoch, Watermark, WindowAgg};

    /// A store written by the releases before group keys (format 2), before values of any
    /// shape (format 3) or before filters (format 4): its checkpoint and pending epoch read
    /// back with group keys, values and a filtered count of 0 after the upgrade, and the
    /// rewrite is done once.
    fn a_store_upgrades_with_its_pending_epoch<R>(format: u32, row_of: impl Fn(&str, u64) -> R)
    where
        R: Into<OutputRow> + Serialize + serde::de::DeserializeOwned + Clone,
    {
        let dir = tempfile::tempdir().unwrap();
        let progress = PartitionCheckpointV1 {
            epoch_start_offset: 10,
            next_offset: 25,
            watermark: Watermark::default(),
            epoch: AccountingV1 {
                consumed: 15,
                aggregated: 12,
                duplicates: 1,
                late: 1,
                dead_lettered: 1,
                revenue_units: 1_250_000,
            },
            totals: AccountingV1 {
                consumed: 25,
                aggregated: 20,
                duplicates: 2,
                late: 1,
                dead_lettered: 2,
                revenue_units: -7,
            },
        };
        let old = CheckpointV1 {
            epoch: Epoch(7),
            partitions: [(3, progress)].into(),
            rows: vec![row_of("a\0b", 1), row_of("cust-1", 4)],
            seen: Vec::new(),
            dead_letters: Vec::new(),
            close_windows_before: vec![(3, 0)],
            expire_seen_before: Vec::new(),
        };
        let old_meta = CheckpointMetaV1 {
            job: "job".into(),
            epoch: Epoch(7),
            status: EpochStatus::PreCommitted,
            partitions: [(3, progress)].into(),
            expired_seen_before: [(3, 5)].into(),
            closed_windows_before: BTreeMap::new(),
        };
        {
            let store = StateStore::open(dir.path(), "job").unwrap();
            let mut batch = WriteBatch::default();
            let bytes = bincode::serde::encode_to_vec(&old, bincode_config()).unwrap();
            batch.put_cf(store.cf(CF_PENDING).unwrap(), 7u64.to_be_bytes(), bytes);
            let meta = bincode::serde::encode_to_vec(&old_meta, bincode_config()).unwrap();
            batch.put_cf(store.cf(CF_META).unwrap(), KEY_CHECKPOINT, meta);
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
        let totals = expected.partitions[&3].totals;
        assert_eq!(
            (totals.consumed, totals.filtered, totals.revenue_units),
            (25, 0, -7)
        );
        assert!(totals.balances() && expected.partitions[&3].epoch.balances());
        for _ in 0..2 {
            let store = StateStore::open(dir.path(), "job").unwrap();
            let (pending, _) = store.pending(Epoch(7), 60_000).unwrap();
            assert_eq!(pending, expected);
            let meta = store.meta().unwrap();
            assert_eq!(meta, CheckpointMeta::from(old_meta.clone()));
            assert_eq!(meta.partitions, expected.partitions);
            let format = store
                .db
                .get_cf(store.cf(CF_META).unwrap(), KEY_FORMAT)
                .unwrap();
            assert_eq!(format.as_deref(), Some(&FORMAT_VERSION.to_be_bytes()[..]));
        }
    }

    fn value() -> WindowAggV2 {
        WindowAggV2 {
            orders: 0,
            revenue: Amount::parse("12.5").unwrap(),
        }
    }

    #[test]
    fn a_format_2_store_upgrades_with_its_pending_epoch() {
        a_store_upgrades_with_its_pending_epoch(FORMAT_ORDER_KEYS, |customer, orders| {
            OutputRowV1 {
                partition: 3,
                key: WindowKeyV1 {
                    window_start_ms: 60_000,
                    customer_id: customer.into(),
                    currency: "EUR".into(),
                },
                window_end_ms: 120_000,
                value: WindowAggV2 { orders, ..value() },
            }
        });
    }

    #[test]
    fn a_format_3_store_upgrades_with_its_pending_epoch() {
        a_store_upgrades_with_its_pending_epoch(FORMAT_ORDER_VALUES, |customer, orders| {
            OutputRowV1 {
                partition: 3,
                key: WindowKey::of_orders(60_000, customer, "EUR"),
                window_end_ms: 120_000,
                value: WindowAggV2 { orders, ..value() },
            }
        });
    }

    #[test]
    fn a_format_4_store_upgrades_with_its_pending_epoch() {
        a_store_upgrades_with_its_pending_epoch(FORMAT_ANY_VALUES, |customer, orders| OutputRow {
            partition: 3,
            key: WindowKey::of_orders(60_000, customer, "EUR"),
            window_end_ms: 120_000,
            value: WindowAgg::of_orders(orders, value().revenue),
        });
    }

    /// A store written by the release before change jobs (format 5: a filtered count, no
    /// stale or tombstone count, no newest position, restore points without rows): its
    /// checkpoint, pending epoch and restore points read back after the upgrade, once.
    #[test]
    fn a_format_5_store_upgrades_with_its_pending_epoch_and_restore_points() {
        let dir = tempfile::tempdir().unwrap();
        let accounting = AccountingV2 {
            consumed: 20,
            aggregated: 12,
            duplicates: 2,
            late: 1,
            dead_lettered: 1,
            revenue_units: 9,
            filtered: 4,
        };
        let progress = PartitionCheckpointV2 {
            epoch_start_offset: 10,
            next_offset: 30,
            watermark: Watermark::default(),
            epoch: accounting,
            totals: accounting,
        };
        let old = CheckpointV1::<OutputRow, PartitionCheckpointV2> {
            epoch: Epoch(7),
            partitions: [(3, progress)].into(),
            rows: vec![OutputRow {
                partition: 3,
                key: WindowKey::of_orders(60_000, "c", "EUR"),
                window_end_ms: 120_000,
                value: WindowAgg::of_orders(2, value().revenue),
            }],
            seen: Vec::new(),
            dead_letters: Vec::new(),
            close_windows_before: vec![(3, 0)],
            expire_seen_before: Vec::new(),
        };
        let old_meta = CheckpointMetaV1::<PartitionCheckpointV2> {
            job: "job".into(),
            epoch: Epoch(7),
            status: EpochStatus::PreCommitted,
            partitions: [(3, progress)].into(),
            expired_seen_before: BTreeMap::new(),
            closed_windows_before: BTreeMap::new(),
        };
        let liveness = Liveness {
            max_window_start: Some(60_000),
            max_seen_time: Some(5),
            holds_rows: false,
        };
        let mut points = RestorePoints::default().with_epoch(
            &[(
                3,
                crate::changelog::EpochLiveness {
                    liveness,
                    close_windows_before: None,
                    expire_seen_before: None,
                },
            )]
            .into(),
        );
        points.set_end(3, 12);
        {
            let store = StateStore::open(dir.path(), "job").unwrap();
            let mut batch = WriteBatch::default();
            batch.put_cf(
                store.cf(CF_PENDING).unwrap(),
                7u64.to_be_bytes(),
                encode(&old),
            );
            batch.put_cf(
                store.cf(CF_META).unwrap(),
                KEY_CHECKPOINT,
                encode(&old_meta),
            );
            batch.put_cf(
                store.cf(CF_META).unwrap(),
                KEY_RESTORE_POINTS,
                encode(&points.to_v1()),
            );
            batch.put_cf(
                store.cf(CF_META).unwrap(),
                KEY_FORMAT,
                FORMAT_FILTERED.to_be_bytes(),
            );
            store.write(batch).unwrap();
        }
        let expected = Checkpoint::from(old);
        let totals = expected.partitions[&3].totals;
        assert_eq!(
            (totals.filtered, totals.stale, totals.tombstones),
            (4, 0, 0)
        );
        assert!(totals.balances());
        for _ in 0..2 {
            let store = StateStore::open(dir.path(), "job").unwrap();
            assert_eq!(store.pending(Epoch(7), 60_000).unwrap().0, expected);
            assert_eq!(
                store.meta().unwrap(),
                CheckpointMeta::from(old_meta.clone())
            );
            assert_eq!(store.restore_points().unwrap(), points);
        }
    }

    fn encode<T: Serialize>(value: &T) -> Vec<u8> {
        bincode::serde::encode_to_vec(value, bincode_config()).unwrap()
    }
}
