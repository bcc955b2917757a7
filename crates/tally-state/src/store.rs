//! The store: its column families and keys, the checkpoint's metadata, and `StateStore`'s
//! opening, pre-commit, commit and the reads a restart needs (`reads.rs` and `values.rs` add
//! the per-record reads and the value codecs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use crate::checkpoint::{CheckpointMeta, EpochStatus};
use crate::expiry::ExpiryCutoffs;
use crate::format::*;
use crate::memory::{MEMTABLE_BYTES, process_memory};
use crate::{changelog, keys};
use rocksdb::{
    BlockBasedOptions, ColumnFamilyDescriptor, DB, IteratorMode, Options, WriteBatch, WriteOptions,
};
use serde::Serialize;
use tally_core::{Checkpoint, Epoch, PartitionCheckpoint, PartitionId, RowShape, SourceRow};

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state store {path}: {source}")]
    Rocks {
        path: PathBuf,
        source: rocksdb::Error,
    },
    #[error(
        "state store {path}: on-disk format version {found} is not supported (this build reads version {FORMAT_VERSION}); use the tally release that wrote it, or move the directory away to start from scratch"
    )]
    UnknownFormat { path: PathBuf, found: u32 },
    #[error(
        "state store {path} belongs to job {found:?}, not {expected:?}; point state_dir at this job's own directory"
    )]
    JobMismatch {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error(
        "state store {path} holds rows with {found}, but this job's declaration makes rows with {expected}: the directory was written by another declaration of the job. A job's declaration is fixed for its life: run the new one as a new job (another job.name, job.state_dir, clickhouse.table and kafka.consumer_group)"
    )]
    ShapeMismatch {
        path: PathBuf,
        found: RowShape,
        expected: RowShape,
    },
    #[error("state store {path}: corrupt {what}: {detail}")]
    Corrupt {
        path: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("state store {path}: cannot encode {what}: {detail}")]
    Encode {
        path: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("state store {path}: no pending outputs for pre-committed epoch {epoch}")]
    MissingPending { path: PathBuf, epoch: Epoch },
}

/// What a restart needs of a pre-committed epoch to complete it in the sinks: the checkpoint
/// without its dedup ids, which are in their own column families already (they were a third
/// of the bytes), and without its rows when the epoch's changelog records are kept beside it:
/// they hold every changed window too ([`StateStore::pending`] takes the rows from them).
/// Encoded as a [`Checkpoint`] is, so it decodes as one.
#[derive(Serialize)]
struct PendingOutputs<'a> {
    epoch: Epoch,
    partitions: &'a BTreeMap<PartitionId, PartitionCheckpoint>,
    rows: &'a [tally_core::OutputRow],
    seen: &'a [(PartitionId, String, i64)],
    dead_letters: &'a [tally_core::DeadLetter],
    close_windows_before: &'a [(PartitionId, i64)],
    expire_seen_before: &'a [(PartitionId, i64)],
    source_rows: &'a [(PartitionId, String, SourceRow)],
}

impl<'a> PendingOutputs<'a> {
    fn of(c: &'a Checkpoint, with_rows: bool) -> PendingOutputs<'a> {
        PendingOutputs {
            epoch: c.epoch,
            partitions: &c.partitions,
            rows: if with_rows { &c.rows } else { &[] },
            seen: &[],
            dead_letters: &c.dead_letters,
            close_windows_before: &c.close_windows_before,
            expire_seen_before: &c.expire_seen_before,
            source_rows: &[],
        }
    }
}

/// Shared by the operator, which reads, and the committer, which writes: RocksDB is safe to use
/// from several threads, and the metadata of the last checkpoint sits behind a lock.
pub struct StateStore {
    pub(crate) db: DB,
    pub(crate) path: PathBuf,
    job: String,
    meta: Mutex<Option<CheckpointMeta>>,
    writer: String,
    /// The metadata's expiry cutoffs, for lookups (without the metadata's lock, which a
    /// pre-commit holds through its sync) and for compaction, which drops the ids before them.
    pub(crate) expiry: ExpiryCutoffs,
    /// The size of the last pre-commit's write batch: the next one is allocated at about its
    /// size at once, rather than doubled up to it (each doubling held the old and the new
    /// buffer, tens of MiB at 1M live keys).
    last_batch_bytes: AtomicUsize,
    /// The shape of the rows it holds, as recorded (or implied, before format 4).
    pub(crate) shape: RowShape,
}

/// A changelog record, encoded, for the changelog partition of its source partition.
pub type EncodedRecord = (PartitionId, Vec<u8>);

fn seen_of(checkpoint: &Checkpoint) -> impl Iterator<Item = (PartitionId, &str, i64)> {
    checkpoint
        .seen
        .iter()
        .map(|(p, id, t)| (*p, id.as_str(), *t))
}

fn source_rows_of(
    checkpoint: &Checkpoint,
) -> impl Iterator<Item = (PartitionId, &str, &SourceRow)> {
    checkpoint
        .source_rows
        .iter()
        .map(|(p, key, row)| (*p, key.as_str(), row))
}

/// 64 random bits (the standard library's hasher keys come from the OS), with the creation
/// time for a reader's benefit: `<unix seconds>-<16 hex digits>`.
fn new_writer_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(now.as_nanos());
    hasher.write_u32(std::process::id());
    format!("{}-{:016x}", now.as_secs(), hasher.finish())
}

impl StateStore {
    /// Opens (or creates) the store for `job`, refusing another job's or another format's data.
    pub fn open(path: &Path, job: &str) -> Result<StateStore, StateError> {
        StateStore::open_with(path, job, None)
    }

    /// [`StateStore::open`], and with `want`, [`StateStore::open_for`].
    pub(crate) fn open_with(
        path: &Path,
        job: &str,
        want: Option<&RowShape>,
    ) -> Result<StateStore, StateError> {
        let path = path.to_path_buf();
        let rocks = |source| StateError::Rocks {
            path: path.clone(),
            source,
        };
        let (cache, memtables) = process_memory();
        let mut table = BlockBasedOptions::default();
        table.set_block_cache(cache);
        // Memory stays bounded by the cache as the dedup set grows: index and filters live in it,
        // partitioned into small blocks. (A whole-file index or filter of a large SST is bigger
        // than a cache shard, would never stay cached, and was re-read on every lookup.)
        table.set_cache_index_and_filter_blocks(true);
        table.set_index_type(rocksdb::BlockBasedIndexType::TwoLevelIndexSearch);
        table.set_partition_filters(true);
        table.set_metadata_block_size(4096);
        table.set_pin_top_level_index_and_filter(true);
        table.set_pin_l0_filter_and_index_blocks_in_cache(true);
        // Column families only ever scanned (pending epochs) get no bloom
        // filters: building them cost flush and compaction time, and holding them cost memory
        // that grew with the dedup set, for lookups that never come.
        let mut scan_cf_opts = Options::default();
        scan_cf_opts.set_block_based_table_factory(&table);
        // Levels 0 and 1 uncompressed: they hold the newest, soon rewritten (or, for pending
        // epochs, deleted) data, and compressing it at every flush cost about a tenth of the
        // flush thread (BENCHMARKS.md, "Backpressure, sorted writes, one allocator, the fetch queue"). Deeper levels, where a large dedup set
        // lives, stay LZ4.
        let lz4 = rocksdb::DBCompressionType::Lz4;
        let none = rocksdb::DBCompressionType::None;
        scan_cf_opts.set_compression_per_level(&[none, none, lz4, lz4, lz4, lz4, lz4]);
        scan_cf_opts.set_write_buffer_size(MEMTABLE_BYTES);
        table.set_bloom_filter(10.0, false);
        let mut cf_opts = scan_cf_opts.clone();
        cf_opts.set_block_based_table_factory(&table);
        // Most dedup lookups are for ids never seen: a bloom filter per memtable answers them
        // without searching the memtable's skip list.
        cf_opts.set_memtable_prefix_bloom_ratio(0.05);
        cf_opts.set_memtable_whole_key_filtering(true);
        let mut db_opts = Options::default();
        // One budget for the memtables of every column family and store, whatever the mix.
        db_opts.set_write_buffer_manager(memtables);
        db_opts.create_if_missing(true);
        db_opts.create_missing_column_families(true);
        db_opts.set_max_background_jobs(2);
        db_opts.set_keep_log_file_num(4);
        let expiry = ExpiryCutoffs::default();
        let mut id_cf_opts = cf_opts.clone();
        id_cf_opts.set_compaction_filter_factory(expiry.clone());
        // Tiered (universal) compaction: ids arrive in random key order and are looked up
        // rarely (the operator's in-memory filter answers most), so leveled compaction's
        // rewrites bought nothing. At 20M ids it rewrote each id about seven times, a fifth of
        // the worker's CPU; tiered, about three (BENCHMARKS.md, "Fold steps, tiered ids").
        id_cf_opts.set_compaction_style(rocksdb::DBCompactionStyle::Universal);
        let has_time_index = DB::list_cf(&db_opts, &path)
            .is_ok_and(|names| names.iter().any(|n| n == CF_SEEN_TIME_V1));
        let cfs = ALL_CFS
            .into_iter()
            .chain(has_time_index.then_some(CF_SEEN_TIME_V1))
            .map(|name| {
                let opts = match name {
                    CF_SEEN_ID => id_cf_opts.clone(),
                    CF_SEEN_TIME_V1 | CF_PENDING | CF_PENDING_CHANGELOG => scan_cf_opts.clone(),
                    _ => cf_opts.clone(),
                };
                ColumnFamilyDescriptor::new(name, opts)
            });
        let db = DB::open_cf_descriptors(&db_opts, &path, cfs).map_err(rocks)?;
        let mut store = StateStore {
            db,
            path,
            job: job.to_owned(),
            meta: Mutex::new(None),
            writer: String::new(),
            expiry,
            last_batch_bytes: AtomicUsize::new(0),
            shape: RowShape::orders(),
        };
        store.check_format()?;
        let recorded = store.recorded_shape()?;
        if let Some(shape) = &recorded {
            store.shape = shape.clone();
        }
        store.writer = store.read_or_create_writer()?;
        let meta = store.read_meta()?;
        if let Some(meta) = &meta {
            store.expiry.publish(&meta.expired_seen_before, true);
        }
        *store.meta_lock() = meta.clone();
        if let Some(meta) = &meta
            && meta.job != job
        {
            return Err(StateError::JobMismatch {
                path: store.path.clone(),
                found: meta.job.clone(),
                expected: job.to_owned(),
            });
        }
        if let Some(want) = want {
            store.take_shape(want, recorded.is_some())?;
        }
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// This directory's identity as a writer of the job: made once, when the directory is
    /// created, and carried with it (a copy of the directory is the same writer). Every commit
    /// of the job names its writer, so a worker can tell that another directory's worker
    /// commits the job and refuse to run beside it.
    pub fn writer_id(&self) -> &str {
        &self.writer
    }

    fn read_or_create_writer(&self) -> Result<String, StateError> {
        let cf = self.cf(CF_META)?;
        if let Some(bytes) = self.db.get_cf(cf, KEY_WRITER).map_err(|e| self.rocks(e))? {
            return String::from_utf8(bytes).map_err(|e| StateError::Corrupt {
                path: self.path.clone(),
                what: "writer id",
                detail: e.to_string(),
            });
        }
        let writer = new_writer_id();
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db
            .put_cf_opt(cf, KEY_WRITER, writer.as_bytes(), &opts)
            .map_err(|e| self.rocks(e))?;
        Ok(writer)
    }

    /// The last checkpoint, or `None` for a new store.
    pub fn meta(&self) -> Option<CheckpointMeta> {
        self.meta_lock().clone()
    }

    fn meta_lock(&self) -> MutexGuard<'_, Option<CheckpointMeta>> {
        // The guarded value is replaced whole, never left half-updated: a poisoned lock still
        // holds a consistent value.
        self.meta
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn rocks(&self, source: rocksdb::Error) -> StateError {
        StateError::Rocks {
            path: self.path.clone(),
            source,
        }
    }

    pub(crate) fn cf(&self, name: &'static str) -> Result<&rocksdb::ColumnFamily, StateError> {
        self.db.cf_handle(name).ok_or_else(|| StateError::Corrupt {
            path: self.path.clone(),
            what: "column family",
            detail: format!("{name} is missing"),
        })
    }

    fn read_meta(&self) -> Result<Option<CheckpointMeta>, StateError> {
        let bytes = self
            .db
            .get_cf(self.cf(CF_META)?, KEY_CHECKPOINT)
            .map_err(|e| self.rocks(e))?;
        bytes
            .map(|b| self.decode::<CheckpointMeta>(&b, "checkpoint metadata"))
            .transpose()
    }

    pub(crate) fn decode<T: serde::de::DeserializeOwned>(
        &self,
        bytes: &[u8],
        what: &'static str,
    ) -> Result<T, StateError> {
        bincode::serde::decode_from_slice(bytes, bincode_config())
            .map(|(v, _)| v)
            .map_err(|e| StateError::Corrupt {
                path: self.path.clone(),
                what,
                detail: e.to_string(),
            })
    }

    pub(crate) fn encode<T: Serialize>(
        &self,
        value: &T,
        what: &'static str,
    ) -> Result<Vec<u8>, StateError> {
        bincode::serde::encode_to_vec(value, bincode_config()).map_err(|e| StateError::Encode {
            path: self.path.clone(),
            what,
            detail: e.to_string(),
        })
    }

    /// Makes a checkpoint durable: state changes, offsets, accounting and the epoch's pending
    /// outputs in one synced write batch. After this returns, a crash resumes from here.
    ///
    /// Checkpoints are written by one thread, in epoch order. Only writes, no reads per entry
    /// (a read per dedup id was half of this call's time and grew with the store): it relies on
    /// the operator's dedup rule, under which an id already stored is recorded again only once
    /// its stored time is past the horizon, i.e. below this checkpoint's expiry cutoff, so the
    /// expiry below has removed (or removes first) its old entries.
    pub fn pre_commit(&self, checkpoint: &Checkpoint) -> Result<(), StateError> {
        self.pre_commit_with_seen(
            checkpoint,
            seen_of(checkpoint),
            source_rows_of(checkpoint),
            &[],
        )
        .map(|_| ())
    }

    /// [`StateStore::pre_commit`] with the epoch's ids and source rows given apart from
    /// `checkpoint` (whose own `seen` and `source_rows` are ignored), in any order: the worker
    /// passes them straight from the epoch's cut rather than copying and sorting them.
    /// `changelog` (the epoch's changelog records) is kept with the pending outputs, for the
    /// transaction to carry after a restart. Returns the bytes of the state changes written
    /// (without the pending outputs).
    pub fn pre_commit_with_seen<'a>(
        &self,
        checkpoint: &Checkpoint,
        seen: impl Iterator<Item = (PartitionId, &'a str, i64)>,
        source_rows: impl Iterator<Item = (PartitionId, &'a str, &'a SourceRow)>,
        changelog: &[EncodedRecord],
    ) -> Result<usize, StateError> {
        let mut batch = WriteBatch::with_capacity_bytes(self.last_batch_bytes.load(Relaxed));
        let base = self.meta();
        let (expired_seen_before, closed_windows_before) =
            self.stage_changes(&mut batch, checkpoint, seen, base.as_ref())?;
        self.stage_source_rows(&mut batch, source_rows)?;
        let state_bytes = batch.size_in_bytes();
        let meta = CheckpointMeta {
            job: self.job.clone(),
            epoch: checkpoint.epoch,
            status: EpochStatus::PreCommitted,
            partitions: checkpoint.partitions.clone(),
            expired_seen_before,
            closed_windows_before,
        };
        let key = checkpoint.epoch.0.to_be_bytes();
        batch.put_cf(
            self.cf(CF_PENDING)?,
            key,
            self.encode(
                &PendingOutputs::of(checkpoint, changelog.is_empty()),
                "pending outputs",
            )?,
        );
        if !changelog.is_empty() {
            batch.put_cf(
                self.cf(CF_PENDING_CHANGELOG)?,
                key,
                self.encode(&changelog, "pending changelog records")?,
            );
        }
        batch.put_cf(
            self.cf(CF_META)?,
            KEY_CHECKPOINT,
            self.encode(&meta, "checkpoint metadata")?,
        );
        self.last_batch_bytes.store(batch.size_in_bytes(), Relaxed);
        // Under the lock: a concurrent `mark_committed` of the previous epoch must not write
        // its metadata over this one's.
        let mut current = self.meta_lock();
        self.write(batch)?;
        self.expiry.publish(&meta.expired_seen_before, true);
        *current = Some(meta);
        Ok(state_bytes)
    }

    /// Applies one changelog record during a restore: the changes a pre-commit of it would
    /// make, without pending outputs and without a sync (the restore syncs once, at the end).
    /// Records of different partitions may come in any order; each partition's in its order.
    pub fn apply_restored(&self, checkpoint: &Checkpoint) -> Result<(), StateError> {
        let mut batch = WriteBatch::default();
        let base = self.meta();
        let (expired_seen_before, closed_windows_before) =
            self.stage_changes(&mut batch, checkpoint, seen_of(checkpoint), base.as_ref())?;
        self.stage_source_rows(&mut batch, source_rows_of(checkpoint))?;
        let (mut partitions, epoch) = match base {
            Some(m) => (m.partitions, m.epoch.max(checkpoint.epoch)),
            None => (BTreeMap::new(), checkpoint.epoch),
        };
        self.forget_retained(&mut batch)?;
        partitions.extend(checkpoint.partitions.iter().map(|(p, c)| (*p, *c)));
        let meta = CheckpointMeta {
            job: self.job.clone(),
            epoch,
            status: EpochStatus::Committed,
            partitions,
            expired_seen_before,
            closed_windows_before,
        };
        batch.put_cf(
            self.cf(CF_META)?,
            KEY_CHECKPOINT,
            self.encode(&meta, "checkpoint metadata")?,
        );
        // Not synced, so compaction keeps the ids its cutoffs expire until the restore's synced
        // end.
        let mut current = self.meta_lock();
        self.db.write(batch).map_err(|e| self.rocks(e))?;
        self.expiry.publish(&meta.expired_seen_before, false);
        *current = Some(meta);
        Ok(())
    }

    /// Ends a restore at the last committed epoch, `epoch`. `pending`: that epoch's outputs when
    /// a sink may lack them (the restart completes it as any pre-committed epoch). `adopted`:
    /// the writer whose commits this directory continues, and its last epoch.
    pub fn finish_restore(
        &self,
        epoch: Epoch,
        pending: Option<&Checkpoint>,
        adopted: (&str, Epoch),
    ) -> Result<(), StateError> {
        let mut current = self.meta_lock();
        let Some(mut meta) = current.clone() else {
            return Err(StateError::Corrupt {
                path: self.path.clone(),
                what: "restore",
                detail: "nothing was restored".into(),
            });
        };
        meta.epoch = epoch;
        let mut batch = WriteBatch::default();
        self.forget_retained(&mut batch)?;
        if let Some(outputs) = pending {
            meta.status = EpochStatus::PreCommitted;
            batch.put_cf(
                self.cf(CF_PENDING)?,
                epoch.0.to_be_bytes(),
                self.encode(&PendingOutputs::of(outputs, true), "pending outputs")?,
            );
        }
        batch.put_cf(
            self.cf(CF_META)?,
            KEY_ADOPTED,
            self.encode(&(adopted.0, adopted.1), "adopted writer")?,
        );
        batch.delete_cf(self.cf(CF_META)?, KEY_REPLAYING);
        batch.put_cf(
            self.cf(CF_META)?,
            KEY_CHECKPOINT,
            self.encode(&meta, "checkpoint metadata")?,
        );
        self.write(batch)?;
        self.expiry.publish(&meta.expired_seen_before, true);
        *current = Some(meta);
        Ok(())
    }

    /// Marks the store as being replayed into, before the first changelog record is applied;
    /// [`StateStore::finish_restore`] clears the mark.
    pub fn begin_replay(&self) -> Result<(), StateError> {
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db
            .put_cf_opt(self.cf(CF_META)?, KEY_REPLAYING, [], &opts)
            .map_err(|e| self.rocks(e))
    }

    /// Whether a replay into this store began and did not finish.
    pub fn is_replaying(&self) -> Result<bool, StateError> {
        Ok(self
            .db
            .get_pinned_cf(self.cf(CF_META)?, KEY_REPLAYING)
            .map_err(|e| self.rocks(e))?
            .is_some())
    }

    /// The writer this directory's state was restored from, and the last epoch it committed:
    /// its commits up to that epoch are this directory's history too.
    pub fn adopted_writer(&self) -> Result<Option<(String, Epoch)>, StateError> {
        self.db
            .get_cf(self.cf(CF_META)?, KEY_ADOPTED)
            .map_err(|e| self.rocks(e))?
            .map(|bytes| self.decode(&bytes, "adopted writer"))
            .transpose()
    }

    /// The changelog's restore points as last saved (empty for a store that never saved any: a
    /// restore then reads from the start, which is always correct).
    pub fn restore_points(&self) -> Result<changelog::RestorePoints, StateError> {
        self.db
            .get_cf(self.cf(CF_META)?, KEY_RESTORE_POINTS)
            .map_err(|e| self.rocks(e))?
            .map(|bytes| self.decode(&bytes, "restore points"))
            .transpose()
            .map(Option::unwrap_or_default)
    }

    /// Saves the restore points, without a sync: points older than the committed ones are only
    /// conservative (a restore reads more), never wrong.
    pub fn save_restore_points(&self, points: &changelog::RestorePoints) -> Result<(), StateError> {
        let bytes = self.encode(points, "restore points")?;
        self.db
            .put_cf(self.cf(CF_META)?, KEY_RESTORE_POINTS, bytes)
            .map_err(|e| self.rocks(e))
    }

    /// The changelog records kept with pre-committed `epoch`; empty when it was pre-committed
    /// by a release without a changelog.
    fn pending_changelog(&self, epoch: Epoch) -> Result<Vec<EncodedRecord>, StateError> {
        self.db
            .get_cf(self.cf(CF_PENDING_CHANGELOG)?, epoch.0.to_be_bytes())
            .map_err(|e| self.rocks(e))?
            .map(|bytes| self.decode(&bytes, "pending changelog records"))
            .transpose()
            .map(Option::unwrap_or_default)
    }

    /// Adds to `batch` the state changes of `checkpoint` over `base`: expiry, ids, windows,
    /// closes. Returns the cutoffs reached.
    #[allow(clippy::type_complexity)]
    fn stage_changes<'a>(
        &self,
        batch: &mut WriteBatch,
        checkpoint: &Checkpoint,
        seen: impl Iterator<Item = (PartitionId, &'a str, i64)>,
        base: Option<&CheckpointMeta>,
    ) -> Result<(BTreeMap<PartitionId, i64>, BTreeMap<PartitionId, i64>), StateError> {
        let (windows_cf, id_cf) = (self.cf(CF_WINDOWS)?, self.cf(CF_SEEN_ID)?);
        let (mut expired_seen_before, mut closed_windows_before) = match base {
            Some(m) => (
                m.expired_seen_before.clone(),
                m.closed_windows_before.clone(),
            ),
            None => (BTreeMap::new(), BTreeMap::new()),
        };
        // Expiry only moves the cutoff: compaction drops the ids before it, and lookups ignore
        // those it has not reached yet.
        for &(p, cutoff) in &checkpoint.expire_seen_before {
            let done = expired_seen_before.entry(p).or_insert(cutoff);
            *done = (*done).max(cutoff);
        }
        let cutoffs = &expired_seen_before;
        // Already past the horizon at this checkpoint. Any older entry of the id is past it too
        // (else the operator would have found it a duplicate): nothing to write.
        let mut seen: Vec<(PartitionId, &str, i64)> = seen
            .filter(|(p, _, t)| cutoffs.get(p).is_none_or(|cutoff| t >= cutoff))
            .collect();
        // In key order: the memtable's skip list takes keys in order for about a third of the
        // CPU of keys in random order (BENCHMARKS.md, "Backpressure, sorted writes, one allocator, the fetch queue").
        seen.sort_unstable_by(|a, b| {
            keys::seen_id_order(a.0, a.1.as_bytes()).cmp(&keys::seen_id_order(b.0, b.1.as_bytes()))
        });
        let (mut key, mut value) = (Vec::new(), Vec::new());
        for (p, id, t) in seen {
            keys::seen_id_into(&mut key, p, id.as_bytes());
            batch.put_cf(id_cf, &key, t.to_be_bytes());
        }
        let mut close_at = closed_windows_before.clone();
        for &(p, cutoff) in &checkpoint.close_windows_before {
            let c = close_at.entry(p).or_insert(cutoff);
            *c = (*c).max(cutoff);
        }
        // A window that closed in this epoch was emitted (pending outputs) and leaves the state.
        let mut rows: Vec<&tally_core::OutputRow> = checkpoint
            .rows
            .iter()
            .filter(|row| {
                close_at
                    .get(&row.partition)
                    .is_none_or(|c| row.key.window_start_ms >= *c)
            })
            .collect();
        rows.sort_unstable_by(|a, b| {
            keys::window_order(a.partition, &a.key).cmp(&keys::window_order(b.partition, &b.key))
        });
        for row in rows {
            value.clear();
            self.encode_window_value(&row.value, &mut value)?;
            keys::window_into(&mut key, row.partition, &row.key);
            batch.put_cf(windows_cf, &key, &value);
        }
        for &(p, cutoff) in &checkpoint.close_windows_before {
            let done = closed_windows_before.get(&p).copied().unwrap_or(i64::MIN);
            if cutoff > done {
                batch.delete_range_cf(
                    windows_cf,
                    keys::window_prefix(p, done),
                    keys::window_prefix(p, cutoff),
                );
                closed_windows_before.insert(p, cutoff);
            }
        }
        Ok((expired_seen_before, closed_windows_before))
    }

    /// Adds to `batch` a change job's rows changed in an epoch, in key order (as ids are).
    fn stage_source_rows<'a>(
        &self,
        batch: &mut WriteBatch,
        rows: impl Iterator<Item = (PartitionId, &'a str, &'a SourceRow)>,
    ) -> Result<(), StateError> {
        let mut rows: Vec<_> = rows.collect();
        if rows.is_empty() {
            return Ok(());
        }
        rows.sort_unstable_by(|a, b| {
            keys::source_row_order(a.0, a.1).cmp(&keys::source_row_order(b.0, b.1))
        });
        let cf = self.cf(CF_SOURCE_ROWS)?;
        let mut key = Vec::new();
        for (p, row_key, row) in rows {
            keys::source_row_into(&mut key, p, row_key);
            batch.put_cf(cf, &key, self.encode(row, "source row")?);
        }
        Ok(())
    }

    /// Records that every sink has `epoch`'s outputs and drops them from the store. With
    /// checkpoints pipelined, a later epoch may be pre-committed already: the last checkpoint's
    /// status changes only when `epoch` is that checkpoint.
    pub fn mark_committed(&self, epoch: Epoch) -> Result<(), StateError> {
        let mut current = self.meta_lock();
        let Some(mut meta) = current.clone() else {
            return Err(StateError::MissingPending {
                path: self.path.clone(),
                epoch,
            });
        };
        let mut batch = WriteBatch::default();
        if let Some(older) = self.last_committed()?.filter(|e| *e != epoch) {
            batch.delete_cf(self.cf(CF_PENDING)?, older.0.to_be_bytes());
            batch.delete_cf(self.cf(CF_PENDING_CHANGELOG)?, older.0.to_be_bytes());
        }
        batch.put_cf(self.cf(CF_META)?, KEY_LAST_COMMITTED, epoch.0.to_be_bytes());
        if meta.epoch == epoch {
            meta.status = EpochStatus::Committed;
            batch.put_cf(
                self.cf(CF_META)?,
                KEY_CHECKPOINT,
                self.encode(&meta, "checkpoint metadata")?,
            );
        }
        self.write(batch)?;
        if meta.epoch == epoch {
            *current = Some(meta);
        }
        Ok(())
    }

    /// Writes the memtables to files, so that the next open does not replay the write-ahead
    /// log: a clean stop then restores in the time it takes to open the files.
    pub fn flush(&self) -> Result<(), StateError> {
        for name in ALL_CFS {
            self.db
                .flush_cf(self.cf(name)?)
                .map_err(|e| self.rocks(e))?;
        }
        Ok(())
    }

    /// Compacts the dedup ids whole, which drops every expired one now instead of when
    /// compaction reaches it (tests; a store whose dedup set shrank).
    pub fn compact_dedup_ids(&self) -> Result<(), StateError> {
        let cf = self.cf(CF_SEEN_ID)?;
        let mut opts = rocksdb::CompactOptions::default();
        opts.set_bottommost_level_compaction(rocksdb::BottommostLevelCompaction::Force);
        self.db
            .compact_range_cf_opt(cf, None::<&[u8]>, None::<&[u8]>, &opts);
        Ok(())
    }

    /// Dedup entries stored, expired or not (tests: what compaction has dropped).
    pub fn stored_dedup_entries(&self) -> Result<usize, StateError> {
        let mut n = 0;
        for item in self
            .db
            .iterator_cf(self.cf(CF_SEEN_ID)?, IteratorMode::Start)
        {
            item.map_err(|e| self.rocks(e))?;
            n += 1;
        }
        Ok(n)
    }

    /// Epochs pre-committed and not yet marked committed, oldest first: what a restart must
    /// complete before reading new input.
    pub fn pending_epochs(&self) -> Result<Vec<Epoch>, StateError> {
        let retained = self.last_committed()?;
        Ok(self
            .stored_outputs()?
            .into_iter()
            .filter(|e| Some(*e) != retained)
            .collect())
    }

    /// Epochs whose outputs are stored: the pending ones and the last committed one.
    fn stored_outputs(&self) -> Result<Vec<Epoch>, StateError> {
        let cf = self.cf(CF_PENDING)?;
        let mut epochs = Vec::new();
        for item in self.db.iterator_cf(cf, IteratorMode::Start) {
            let (key, _) = item.map_err(|e| self.rocks(e))?;
            let bytes =
                <[u8; 8]>::try_from(key.as_ref()).map_err(|_| self.corrupt_key("pending epoch"))?;
            epochs.push(Epoch(u64::from_be_bytes(bytes)));
        }
        Ok(epochs)
    }

    fn last_committed(&self) -> Result<Option<Epoch>, StateError> {
        self.db
            .get_cf(self.cf(CF_META)?, KEY_LAST_COMMITTED)
            .map_err(|e| self.rocks(e))?
            .map(|bytes| {
                <[u8; 8]>::try_from(bytes.as_slice())
                    .map(|b| Epoch(u64::from_be_bytes(b)))
                    .map_err(|_| self.corrupt_key("last committed epoch"))
            })
            .transpose()
    }

    /// The last committed epoch while its outputs are still held (until the next epoch is
    /// committed): [`StateStore::pending`] reads them.
    pub fn retained_commit(&self) -> Result<Option<Epoch>, StateError> {
        let Some(epoch) = self.last_committed()? else {
            return Ok(None);
        };
        let held = self
            .db
            .get_cf(self.cf(CF_PENDING)?, epoch.0.to_be_bytes())
            .map_err(|e| self.rocks(e))?
            .is_some();
        Ok(held.then_some(epoch))
    }

    /// Forgets the retained outputs of the last committed epoch: changes applied from the
    /// changelog supersede them.
    fn forget_retained(&self, batch: &mut WriteBatch) -> Result<(), StateError> {
        if let Some(epoch) = self.last_committed()? {
            batch.delete_cf(self.cf(CF_PENDING)?, epoch.0.to_be_bytes());
            batch.delete_cf(self.cf(CF_PENDING_CHANGELOG)?, epoch.0.to_be_bytes());
            batch.delete_cf(self.cf(CF_META)?, KEY_LAST_COMMITTED);
        }
        Ok(())
    }

    /// Calls `f` with the pending epochs while no epoch can be marked committed: what `f`
    /// sees stays true until it returns (a fault point kills the process inside it).
    pub fn with_pending_epochs<R>(&self, f: impl FnOnce(&[Epoch]) -> R) -> Result<R, StateError> {
        let _no_commit = self.meta_lock();
        Ok(f(&self.pending_epochs()?))
    }

    /// A pre-committed epoch, as written by [`StateStore::pre_commit_with_seen`]: its outputs
    /// (the checkpoint without its dedup ids) and its changelog records (empty when a release
    /// without a changelog pre-committed it). Rows kept only in the records are read from them,
    /// each window ending `window_size_ms` after its start.
    pub fn pending(
        &self,
        epoch: Epoch,
        window_size_ms: i64,
    ) -> Result<(Checkpoint, Vec<EncodedRecord>), StateError> {
        let mut checkpoint: Checkpoint = match self
            .db
            .get_cf(self.cf(CF_PENDING)?, epoch.0.to_be_bytes())
            .map_err(|e| self.rocks(e))?
        {
            Some(bytes) => self.decode(&bytes, "pending outputs")?,
            None => {
                return Err(StateError::MissingPending {
                    path: self.path.clone(),
                    epoch,
                });
            }
        };
        let changelog = self.pending_changelog(epoch)?;
        if checkpoint.rows.is_empty() {
            for (_, bytes) in &changelog {
                let record =
                    changelog::ChangelogRecord::decode(bytes).map_err(|e| StateError::Corrupt {
                        path: self.path.clone(),
                        what: "pending changelog record",
                        detail: e.to_string(),
                    })?;
                checkpoint.rows.extend(record.output_rows(window_size_ms));
            }
            tally_core::OutputRow::sort_batch(&mut checkpoint.rows);
        }
        Ok((checkpoint, changelog))
    }

    pub(crate) fn write(&self, batch: WriteBatch) -> Result<(), StateError> {
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db.write_opt(batch, &opts).map_err(|e| self.rocks(e))
    }

    pub(crate) fn seen_time(&self, value: &[u8]) -> Result<i64, StateError> {
        <[u8; 8]>::try_from(value)
            .map(i64::from_be_bytes)
            .map_err(|_| self.corrupt_key("dedup entry"))
    }

    pub(crate) fn corrupt_key(&self, what: &'static str) -> StateError {
        StateError::Corrupt {
            path: self.path.clone(),
            what,
            detail: "undecodable key or value".into(),
        }
    }
}
