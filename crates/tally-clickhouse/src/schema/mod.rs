//! Tables and view of a job: created when absent, validated when present.

use clickhouse::Client;
use serde::Deserialize;

use tally_core::PartitionId;

use crate::error::{Result, SinkError};

// Statements that build and read the answer (publish, fold, view), beside the tables' own here.
mod answer;
mod cluster;
mod ensure;
mod shape;

pub(crate) use cluster::{REPLICA_MACRO_SQL, cluster_members_sql, member_macro_sql};
pub(crate) use ensure::ensure;
pub use ensure::normalise as normalise_type;
#[cfg(test)]
use ensure::*;
pub use shape::Shape;

/// Versions live in 10-minute partitions, so the versions of folded windows are dropped whole
/// and soon after they are folded.
pub(crate) const DATA_PARTITION_SECONDS: i64 = 600;

const COMMIT_COLUMNS: &[(&str, &str)] = &[
    ("batch_id", "String"),
    ("job", "String"),
    ("epoch", "UInt64"),
    ("partitions", "Array(Int32)"),
    ("from_offsets", "Array(Int64)"),
    ("to_offsets", "Array(Int64)"),
    ("watermarks", "Array(Int64)"),
    ("max_window_start", "DateTime"),
    ("row_count", "UInt64"),
    ("event_count", "UInt64"),
    ("revenue_sum", "Decimal(38, 4)"),
    ("dead_letters", "UInt64"),
    ("committed_at", "DateTime"),
    ("filtered_count", "UInt64"),
    ("duplicate_count", "UInt64"),
    ("stale_count", "UInt64"),
    ("tombstone_count", "UInt64"),
    ("source_lsn", "UInt64"),
];
/// Commit-log columns added since its first release, with their defaults: a commit log of an
/// earlier release gets them by `ALTER` (`ensure`), and its rows, and the rows an earlier
/// release still writes, read the default. `source_lsn`: a change job's newest source
/// position read up to the batch (the largest of its partitions'), 0 for events.
const ADDED_COMMIT_COLUMNS: &[(&str, &str)] = &[
    ("filtered_count", "0"),
    ("duplicate_count", "0"),
    ("stale_count", "0"),
    ("tombstone_count", "0"),
    ("source_lsn", "0"),
];

/// The commit log's columns for its CREATE, each added column with its default.
fn commit_columns_sql() -> String {
    COMMIT_COLUMNS
        .iter()
        .map(
            |(n, t)| match ADDED_COMMIT_COLUMNS.iter().find(|(a, _)| a == n) {
                Some((_, default)) => format!("{n} {t} DEFAULT {default}"),
                None => format!("{n} {t}"),
            },
        )
        .collect::<Vec<_>>()
        .join(", ")
}
/// Sorted by the newest window a batch holds: the view reads only batches that can hold a row at
/// or after the fold frontier, a range of this key whoever wrote them. Epochs are numbered per
/// writer, so they cannot bound that set once several workers write a job.
const COMMIT_SORTING_KEY: &str = "max_window_start, batch_id";
/// The key of commit logs created before the view pruned by window.
const LEGACY_COMMIT_SORTING_KEY: &str = "epoch";

/// The published answer for the windows folding has not reached has the folded table's columns,
/// then these: the point of the commit log it was computed at (the same in every row of a snapshot).
const PUBLISHED_AT_COLUMNS: &[(&str, &str)] = &[
    ("published_from", "DateTime"),
    ("cut_partitions", "Array(Int32)"),
    ("cut_offsets", "Array(Int64)"),
];

const FOLD_COLUMNS: &[(&str, &str)] = &[
    ("frontier", "DateTime"),
    // Unused since the view prunes batches by window (written as 0); kept so that fold logs
    // of earlier versions validate.
    ("first_epoch", "UInt64"),
    ("folded_rows", "UInt64"),
    ("folded_at", "DateTime"),
];
const FOLD_SORTING_KEY: &str = "frontier";

/// The read side's generations: one row per claim and release (`read_side`).
pub(crate) const READ_SIDE_COLUMNS: &[(&str, &str)] = &[
    ("generation", "UInt64"),
    ("holder", "String"),
    ("event", "String"),
    ("at", "DateTime"),
];

/// The registry of the job's source partitions: those of the topic when the job first ran
/// (`added` 0), and those added to it since (1).
const PARTITION_COLUMNS: &[(&str, &str)] = &[
    ("partition", "Int32"),
    ("added", "UInt8"),
    ("registered_at", "DateTime"),
];

/// Names of a job's objects, derived from the view name. Identifiers are validated so they
/// can be spliced into SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableNames {
    pub database: String,
    pub view: String,
    pub data: String,
    pub commits: String,
    /// Folded (final) windows, one row per view row.
    pub final_rows: String,
    /// One row per fold step: the frontier below which windows are read from `final_rows`.
    pub folds: String,
    /// The published answer from the fold frontier on: what the view reads there.
    pub live: String,
    /// The source partitions the job knows: folding waits for a watermark from each.
    pub partitions: String,
    /// The job's keys and aggregates as columns.
    pub shape: Shape,
    /// Whether the job writes a replicated cluster: its truth (the versions, the commit log,
    /// the partitions' registry) is then in `ReplicatedMergeTree` tables, the rest per replica.
    pub replicated: bool,
}

fn valid_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl TableNames {
    pub fn new(database: &str, view: &str) -> Result<TableNames> {
        for (what, name) in [("database", database), ("table", view)] {
            if !valid_identifier(name) {
                return Err(SinkError::Schema(format!(
                    "{what} name {name:?} must match [A-Za-z_][A-Za-z0-9_]*"
                )));
            }
        }
        Ok(TableNames {
            database: database.to_owned(),
            view: view.to_owned(),
            data: format!("{database}.{view}_data"),
            commits: format!("{database}.{view}_commits"),
            final_rows: format!("{database}.{view}_final"),
            folds: format!("{database}.{view}_folds"),
            live: format!("{database}.{view}_live"),
            partitions: format!("{database}.{view}_partitions"),
            shape: Shape::revenue_agg(),
            replicated: false,
        })
    }

    /// The same names for a job writing a replicated cluster (see [`replicated`](Self::replicated)).
    pub fn replicated(self, replicated: bool) -> TableNames {
        TableNames { replicated, ..self }
    }

    /// The engine of a table of the job's truth: replicated on a cluster, its path in the
    /// coordinator named after the table (`{shard}` and `{replica}` are each server's macros).
    pub(crate) fn truth_engine(&self, qualified: &str) -> String {
        if !self.replicated {
            return "MergeTree".into();
        }
        let path = qualified.replace('.', "/");
        format!("ReplicatedMergeTree('/clickhouse/tables/{{shard}}/{path}', '{{replica}}')")
    }

    /// The engine name `system.tables` shows for a table of the job's truth.
    pub(crate) fn truth_engine_name(&self) -> &'static str {
        if self.replicated {
            "ReplicatedMergeTree"
        } else {
            "MergeTree"
        }
    }

    /// The same names for a job of another shape.
    pub fn with_shape(self, shape: Shape) -> TableNames {
        TableNames { shape, ..self }
    }

    /// The live table's columns: the folded table's, then where its snapshot was computed.
    fn live_columns(&self) -> Vec<(String, String)> {
        let mut columns = self.shape.answer_columns();
        columns.extend(
            PUBLISHED_AT_COLUMNS
                .iter()
                .map(|(n, t)| ((*n).to_owned(), (*t).to_owned())),
        );
        columns
    }

    pub fn view_q(&self) -> String {
        format!("{}.{}", self.database, self.view)
    }

    pub fn data_q(&self) -> &str {
        &self.data
    }

    pub fn commits_q(&self) -> &str {
        &self.commits
    }

    fn create_data(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = {} PARTITION BY intDiv(toUInt32(window_start), {DATA_PARTITION_SECONDS}) ORDER BY ({})",
            self.data,
            columns_sql(&borrowed(&self.shape.data_columns())),
            self.truth_engine(&self.data),
            self.shape.data_sorting_key(),
        )
    }

    fn create_commits(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = {} ORDER BY ({COMMIT_SORTING_KEY})",
            self.commits,
            commit_columns_sql(),
            self.truth_engine(&self.commits),
        )
    }

    /// Adds commit-log column `column` (one of `ADDED_COMMIT_COLUMNS`) to a commit log of an
    /// earlier release. Not `IF NOT EXISTS`: 18.16 does not parse it, so `ensure` looks first.
    pub(crate) fn add_commit_column_sql(&self, column: &str) -> Option<String> {
        let (_, ty) = COMMIT_COLUMNS.iter().find(|(n, _)| *n == column)?;
        let (_, default) = ADDED_COMMIT_COLUMNS.iter().find(|(n, _)| *n == column)?;
        Some(format!(
            "ALTER TABLE {} ADD COLUMN {column} {ty} DEFAULT {default}",
            self.commits
        ))
    }

    fn create_final_like(&self, name: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {name} ({}) ENGINE = MergeTree PARTITION BY toYYYYMMDD(window_start) ORDER BY ({})",
            columns_sql(&borrowed(&self.shape.answer_columns())),
            self.shape.answer_sorting_key(),
        )
    }

    fn create_live(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY ({})",
            self.live,
            columns_sql(&borrowed(&self.live_columns())),
            self.shape.answer_sorting_key(),
        )
    }

    fn create_partitions(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = {} ORDER BY partition",
            self.partitions,
            columns_sql(PARTITION_COLUMNS),
            self.truth_engine(&self.partitions),
        )
    }

    pub(crate) fn registered_count_sql(&self) -> String {
        format!("SELECT uniqExact(partition) FROM {}", self.partitions)
    }

    /// (partition, added) of every registered partition.
    pub(crate) fn registered_sql(&self) -> String {
        format!(
            "SELECT partition, max(added) FROM {} GROUP BY partition ORDER BY partition",
            self.partitions
        )
    }

    pub(crate) fn register_sql(&self, partitions: &[PartitionId], added: bool) -> String {
        let rows: Vec<String> = partitions
            .iter()
            .map(|p| format!("({p}, {}, now())", u8::from(added)))
            .collect();
        format!(
            "INSERT INTO {} (partition, added, registered_at) VALUES {}",
            self.partitions,
            rows.join(", ")
        )
    }

    /// The newest watermark any partition committed, and how many partitions committed one.
    pub(crate) fn newest_watermark_sql(&self) -> String {
        format!(
            "SELECT toInt64(max(pw)) AS newest, uniqExact(p) AS n FROM {} ARRAY JOIN partitions AS p, arrayResize(watermarks, length(partitions), toInt64(-9223372036854775808)) AS pw WHERE pw != toInt64(-9223372036854775808)",
            self.commits
        )
    }

    fn create_folds(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY {FOLD_SORTING_KEY}",
            self.folds,
            columns_sql(FOLD_COLUMNS)
        )
    }

    /// The commit log, one entry per batch (a batch whose commit row was written twice once),
    /// oldest first per writer. A batch is identified by what it commits, its partitions and
    /// their offsets: writers number their epochs independently.
    pub fn committed_batches_sql(&self) -> String {
        format!(
            "SELECT min(epoch) AS e, partitions, any(from_offsets) AS fs, to_offsets FROM {} GROUP BY partitions, to_offsets ORDER BY min(committed_at), e",
            self.commits
        )
    }

    /// Whether a batch is in the commit log: found by its newest window (the sorting key) and
    /// what it commits, so that a copy written by another worker counts as the same batch.
    pub(crate) fn is_committed_sql(
        &self,
        max_window_start: u32,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> String {
        format!(
            "SELECT count() FROM {} WHERE max_window_start = toDateTime({max_window_start}) AND partitions = [{}] AND to_offsets = [{}]",
            self.commits,
            join(partitions),
            join(to_offsets),
        )
    }

    /// (rows, events, revenue as a decimal string, dead letters) the commit log recorded of the
    /// batch ending `partitions` at `to_offsets`.
    pub(crate) fn batch_totals_sql(
        &self,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> String {
        format!(
            "SELECT any(row_count), any(event_count), toString(any(revenue_sum)), any(dead_letters) FROM {} \
             WHERE partitions = [{}] AND to_offsets = [{}] GROUP BY partitions, to_offsets",
            self.commits,
            join(partitions),
            join(to_offsets),
        )
    }

    /// Per source partition, the newest offset the commit log holds.
    pub(crate) fn committed_offsets_sql(&self) -> String {
        format!(
            "SELECT p, max(o) FROM {} ARRAY JOIN partitions AS p, arrayResize(to_offsets, length(partitions)) AS o GROUP BY p ORDER BY p",
            self.commits
        )
    }

    /// A commit log of the earlier layout (sorted by epoch) rebuilt with the current key: built
    /// aside, swapped in atomically, the old one dropped. Every step can be rerun.
    pub(crate) fn migrate_commits_sql(&self, atomic_database: bool) -> Vec<String> {
        let (commits, next) = (&self.commits, format!("{}__next", self.commits));
        let mut sql = vec![
            format!("DROP TABLE IF EXISTS {next}"),
            format!(
                "CREATE TABLE {next} ({}) ENGINE = MergeTree ORDER BY ({COMMIT_SORTING_KEY})",
                commit_columns_sql()
            ),
            format!(
                "INSERT INTO {next} SELECT {} FROM {commits}",
                COMMIT_COLUMNS
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ];
        sql.extend(swap_tables_sql(
            commits,
            &next,
            &format!("{commits}__old"),
            atomic_database,
        ));
        sql
    }

    /// Every statement tally issues, named: the read side's claim of generation 1, one fold
    /// step from `from` to `to` (repair of day `day`, the day before it kept whole, fold, log,
    /// install, drop of version partition `data_partition`), a publish of the answer from `from` as of `as_of`, the
    /// reads that verify, reconcile, publishing and folding make, and the release. For
    /// checking the SQL on other server versions: `tally schema --print-sql`.
    pub fn statement_catalog(
        &self,
        from: Frontier,
        to: Frontier,
        as_of: &Cut,
        day: &str,
        data_partition: &str,
        atomic_database: bool,
    ) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (i, sql) in self.create_statements().into_iter().enumerate() {
            out.push((format!("create.{i}"), sql));
        }
        let lease_db = self.generation_database(1);
        let claim = std::iter::once(format!("CREATE DATABASE {lease_db}"))
            .chain(self.claim_sql(1, "sqlcheck"))
            .chain([
                self.kill_others_sql(1),
                self.register_sql(&[0, 1], false),
                self.beat_sql(1),
            ]);
        for (i, sql) in claim.enumerate() {
            out.push((format!("claim.{i}"), sql));
        }
        let reads = [
            ("read.view", self.read_view_sql()),
            ("read.view_at", self.read_view_at_sql(from, as_of, None)),
            ("read.committed_batches", self.committed_batches_sql()),
            ("read.committed_offsets", self.committed_offsets_sql()),
            (
                "read.committed_watermark",
                self.committed_watermark_sql(from.seconds),
            ),
            ("read.logged_frontiers", self.logged_frontiers_sql(2)),
            ("read.count_final", self.count_final_sql(None)),
            ("read.unlogged_days", self.unlogged_days_sql(to.seconds)),
            ("read.partitions", self.partitions_sql(&self.data)),
            ("read.database_engine", self.database_engine_sql()),
            ("read.open_cut", self.open_cut_sql(from)),
            ("read.published", self.published_sql()),
            (
                "read.published_totals",
                self.published_totals_sql(from, as_of, 30),
            ),
            ("read.generations", self.generations_sql()),
            ("read.beat_age", self.beat_age_sql(1)),
            ("read.holder", self.holder_sql(1)),
            ("read.others_running", self.others_running_sql(1)),
            ("read.legacy_read_tables", self.legacy_read_tables_sql()),
            ("read.registered_count", self.registered_count_sql()),
            ("read.registered", self.registered_sql()),
            ("read.newest_watermark", self.newest_watermark_sql()),
            (
                "read.batch_totals",
                self.batch_totals_sql(&[0, 1], &[10, 8]),
            ),
            ("read.live_points", self.live_points_sql()),
        ];
        out.extend(reads.into_iter().map(|(n, s)| (n.to_owned(), s)));
        // A publish of the answer from `from` as of `as_of`.
        let stage = format!("{lease_db}.live_0");
        let publish = self
            .stage_snapshot_sql(&stage, from, as_of)
            .into_iter()
            .chain(self.swap_live_sql(&stage, &lease_db, atomic_database));
        for (i, sql) in publish.enumerate() {
            out.push((format!("publish.{i}"), sql));
        }
        for (i, sql) in self
            .rebuild_final_sql(
                &format!("{lease_db}.repair"),
                &lease_db,
                atomic_database,
                &crate::calendar::previous_day(day)
                    .into_iter()
                    .collect::<Vec<_>>(),
                &[day.to_owned()],
                to.seconds,
            )
            .into_iter()
            .enumerate()
        {
            out.push((format!("repair.{i}"), sql));
        }
        for (i, sql) in self
            .migrate_commits_sql(atomic_database)
            .into_iter()
            .enumerate()
        {
            out.push((format!("migrate.{i}"), sql));
        }
        // Of a commit log of an earlier release only (the created one has the columns).
        for (i, sql) in ADDED_COMMIT_COLUMNS
            .iter()
            .filter_map(|(n, _)| self.add_commit_column_sql(n))
            .enumerate()
        {
            out.push((format!("upgrade.{i}"), sql));
        }
        let fold_stage = format!("{lease_db}.fold_0");
        let day_number: u32 = day.parse().unwrap_or(0);
        let fold = [
            (
                "fold.stage",
                format!("CREATE TABLE {fold_stage} AS {}", self.final_rows),
            ),
            (
                "fold.insert",
                self.fold_insert_sql(&fold_stage, from, to.seconds),
            ),
            ("fold.attach", self.attach_day_sql(day_number, &fold_stage)),
            (
                "fold.log",
                self.fold_log_sql(to, 0, &format!("{lease_db}.lease"), 2),
            ),
            (
                "fold.drop_stage",
                format!("DROP TABLE IF EXISTS {fold_stage}"),
            ),
        ];
        out.extend(fold.into_iter().map(|(n, s)| (n.to_owned(), s)));
        for (i, sql) in self
            .install_view_sql(to, atomic_database, &lease_db)
            .into_iter()
            .enumerate()
        {
            out.push((format!("install.{i}"), sql));
        }
        out.push((
            "drop.versions".into(),
            self.drop_partition_sql(&self.data, data_partition),
        ));
        out.push((
            "drop.retained".into(),
            self.drop_partition_sql(&self.final_rows, day),
        ));
        // A new version's takeover of the job's view `<view>_taken`: the windows before `to`
        // kept from the view, the job's view over the view and those, the takeover logged.
        let columns: Vec<String> = self
            .shape
            .view_columns()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        let (taken, kept) = (
            format!("{}_taken", self.view),
            format!("{}_kept", self.view),
        );
        let takeover = self
            .keep_windows_sql(
                &format!("{lease_db}.kept"),
                &self.view,
                &self.view,
                &kept,
                &columns,
                to.seconds,
            )
            .into_iter()
            .chain(self.install_job_view_sql(
                &taken,
                &columns,
                &self.view,
                Some((&kept, to.seconds)),
                atomic_database,
                &lease_db,
            ))
            .chain([self.log_took_over_sql("version 2 sqlcheck", &format!("{lease_db}.lease"))]);
        for (i, sql) in takeover.enumerate() {
            out.push((format!("takeover.{i}"), sql));
        }
        out.push(("read.taken_over_by".into(), self.taken_over_by_sql()));
        for (i, sql) in self.release_sql(1).into_iter().enumerate() {
            out.push((format!("release.{i}"), sql));
        }
        if self.replicated {
            out.extend([
                ("cluster.members".to_owned(), cluster_members_sql("tally")),
                ("cluster.macro".to_owned(), REPLICA_MACRO_SQL.to_owned()),
                (
                    "cluster.member_macro".to_owned(),
                    member_macro_sql("127.0.0.1:9000", "default", ""),
                ),
                ("cluster.sync".to_owned(), self.sync_versions_sql()),
                ("cluster.sync_commits".to_owned(), self.sync_commits_sql()),
            ]);
        }
        out
    }

    /// Every statement that creates the job's objects, in order, for a fresh deployment.
    pub fn create_statements(&self) -> Vec<String> {
        vec![
            format!("CREATE DATABASE IF NOT EXISTS {}", self.database),
            self.create_data(),
            self.create_commits(),
            self.create_final_like(&self.final_rows),
            self.create_folds(),
            self.create_live(),
            self.create_partitions(),
            self.create_read_side_log(),
            self.create_view(&self.view_q(), Frontier::default()),
        ]
    }
}

/// Windows starting before `seconds` are final and read from the folded table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Frontier {
    pub seconds: u32,
}

/// A point of the commit log: per source partition, the offset up to which batches count.
/// With several writers there is no job-wide epoch; each partition's offsets are its order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Cut(pub std::collections::BTreeMap<PartitionId, i64>);

impl Cut {
    fn partitions_sql(&self) -> String {
        join(self.0.keys())
    }
    fn offsets_sql(&self) -> String {
        join(self.0.values())
    }
}

/// A string literal for SQL.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

fn join<T: std::fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    items
        .into_iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Borrowed (name, type) pairs of owned ones.
fn borrowed(columns: &[(String, String)]) -> Vec<(&str, &str)> {
    columns
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect()
}

pub(crate) fn columns_sql(columns: &[(&str, &str)]) -> String {
    columns
        .iter()
        .map(|(n, t)| format!("{n} {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(crate) async fn json_rows<T: serde::de::DeserializeOwned>(
    client: &Client,
    sql: &str,
    url: &str,
    context: &str,
) -> Result<Vec<T>> {
    let mut cursor = client
        .query(sql)
        .fetch_bytes("JSONEachRow")
        .map_err(|source| SinkError::Server {
            url: url.to_owned(),
            context: context.to_owned(),
            source,
        })?;
    let bytes = cursor.collect().await.map_err(|source| SinkError::Server {
        url: url.to_owned(),
        context: context.to_owned(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| SinkError::Schema(format!("{context}: unexpected answer {l:?}: {e}")))
        })
        .collect()
}

pub(crate) async fn execute(client: &Client, sql: &str, url: &str) -> Result<()> {
    client
        .query(sql)
        .execute()
        .await
        .map_err(|source| SinkError::Server {
            url: url.to_owned(),
            context: format!("executing {sql}"),
            source,
        })
}

/// Makes `stage` (shaped as `target`) the table `target` in one swap (EXCHANGE on Atomic
/// databases, a two-table RENAME on Ordinary ones) and drops the table it replaced, which the
/// RENAME parks as `parked`; the last statement is that drop. Not `REPLACE PARTITION`: on 18.16
/// the parts it replaces come back as active when the server restarts within
/// `old_parts_lifetime` (docs/design/read-side.md, "Found on 18.16"); a dropped table stays dropped. A crash before
/// the drop leaves the replaced table parked, where the next swap drops it first.
pub(crate) fn swap_tables_sql(
    target: &str,
    stage: &str,
    parked: &str,
    atomic_database: bool,
) -> Vec<String> {
    if atomic_database {
        vec![
            format!("EXCHANGE TABLES {target} AND {stage}"),
            format!("DROP TABLE {stage}"),
        ]
    } else {
        vec![
            format!("DROP TABLE IF EXISTS {parked}"),
            format!("RENAME TABLE {target} TO {parked}, {stage} TO {target}"),
            format!("DROP TABLE {parked}"),
        ]
    }
}

/// Where the read side parks a table its swap replaced: in the lease's database, which fences
/// the swap (a holder whose lease was taken finds its database gone).
pub(crate) fn replaced_in(lease_database: &str) -> String {
    format!("{lease_database}.replaced")
}

/// The newest frontier in the fold log (the zero frontier before the first fold).
pub(crate) async fn latest_frontier(
    client: &Client,
    names: &TableNames,
    url: &str,
) -> Result<Frontier> {
    let rows: Vec<u32> = client
        .query(&names.logged_frontiers_sql(1))
        .fetch_all()
        .await
        .map_err(|source| SinkError::Server {
            url: url.to_owned(),
            context: "reading the fold log".into(),
            source,
        })?;
    Ok(rows
        .into_iter()
        .next()
        .map(|seconds| Frontier { seconds })
        .unwrap_or_default())
}

/// Whether the job's database is Atomic (current servers) rather than Ordinary (18.16): they
/// swap tables atomically with different statements.
pub(crate) async fn atomic_database(
    client: &Client,
    names: &TableNames,
    url: &str,
) -> Result<bool> {
    #[derive(Debug, Deserialize)]
    struct EngineRow {
        engine: String,
    }
    let engines: Vec<EngineRow> = json_rows(
        client,
        &names.database_engine_sql(),
        url,
        "reading the database engine",
    )
    .await?;
    // A Replicated database runs every DDL on all its replicas in its own order: the
    // per-replica swaps of the read side would then race each other.
    if engines.first().is_some_and(|e| e.engine == "Replicated") {
        return Err(SinkError::Schema(format!(
            "clickhouse.database: {} is a Replicated database; tally builds what readers see on each replica itself and needs an Atomic (or Ordinary) database: give the job one, with clickhouse.cluster naming the cluster (docs/clickhouse-versions.md, \"Replicated clusters\")",
            names.database
        )));
    }
    Ok(engines.first().is_some_and(|e| e.engine != "Ordinary"))
}

#[cfg(test)]
mod tests;
