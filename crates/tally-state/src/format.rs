//! The on-disk layout's names and versions: column families, the meta keys, the encoding, and
//! the format version with what each earlier one differed in (`upgrade.rs` rewrites them).

/// Version of the on-disk layout. Bump on any change to keys or encodings.
/// 6: a change job's rows (their own column family), and the accounting counts stale changes
/// and tombstones and keeps the newest source position; version 5 had neither, and an open
/// rewrites the checkpoint, the pending outputs and the restore points that hold it.
/// 5: the accounting counts filtered records; version 4 had no such count, and an open rewrites
/// the checkpoint and pending outputs that hold it (everything else is the same).
/// 4: a pending epoch's rows carry values of any shape (tagged words); version 3 encoded them as
/// (orders, revenue), which an open rewrites (the windows' values keep their bytes: `values.rs`).
/// 3: a pending epoch's rows carry group keys of any number of parts; version 2 encoded them as
/// (customer, currency), which an open rewrites (window keys and everything else are the same).
/// 2: dedup ids expire in compaction; version 1 also kept them in a time index, which an open
/// drops (the id entries are the same).
pub const FORMAT_VERSION: u32 = 6;
pub(crate) const FORMAT_FILTERED: u32 = 5;
pub(crate) const FORMAT_ANY_VALUES: u32 = 4;
pub(crate) const FORMAT_ORDER_VALUES: u32 = 3;
pub(crate) const FORMAT_ORDER_KEYS: u32 = 2;
pub(crate) const FORMAT_WITH_TIME_INDEX: u32 = 1;

pub(crate) const CF_META: &str = "meta";
pub(crate) const CF_WINDOWS: &str = "windows";
pub(crate) const CF_SEEN_ID: &str = "seen_by_id";
/// A change job's rows by primary key: the position and contribution of each (format 6 on).
pub(crate) const CF_SOURCE_ROWS: &str = "source_rows";
/// Format 1's dedup time index, dropped when such a store is opened.
pub(crate) const CF_SEEN_TIME_V1: &str = "seen_by_time";
pub(crate) const CF_PENDING: &str = "pending";
/// The changelog records of each pre-committed epoch, until its transaction carried them.
pub(crate) const CF_PENDING_CHANGELOG: &str = "pending_changelog";
pub(crate) const KEY_ADOPTED: &[u8] = b"adopted_writer";
/// Present while changelog records are being applied: a replay that did not finish leaves
/// partitions at different epochs, which only a whole restore repairs.
pub(crate) const KEY_REPLAYING: &[u8] = b"replaying";
pub(crate) const KEY_RESTORE_POINTS: &[u8] = b"restore_points";
pub(crate) const KEY_FORMAT: &[u8] = b"format_version";
pub(crate) const KEY_CHECKPOINT: &[u8] = b"checkpoint";
pub(crate) const KEY_WRITER: &[u8] = b"writer_id";
/// The last epoch marked committed. Its outputs and changelog records stay until the next epoch
/// is: if Kafka undoes its transaction afterwards (a hanging transaction aborted by hand), they
/// are what a restart sends again.
pub(crate) const KEY_LAST_COMMITTED: &[u8] = b"last_committed";

pub(crate) fn bincode_config() -> bincode::config::Configuration {
    bincode::config::standard()
}

pub(crate) const ALL_CFS: [&str; 6] = [
    CF_META,
    CF_WINDOWS,
    CF_SEEN_ID,
    CF_SOURCE_ROWS,
    CF_PENDING,
    CF_PENDING_CHANGELOG,
];
