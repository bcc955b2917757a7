//! Tables and view of a job: created when absent, validated when present.

use clickhouse::Client;
use serde::Deserialize;

use tally_core::PartitionId;

use crate::{Result, SinkError};

const DATA_COLUMNS: &[(&str, &str)] = &[
    ("version", "Int64"),
    ("source_partition", "Int32"),
    ("window_start", "DateTime"),
    ("window_end", "DateTime"),
    ("customer_id", "String"),
    ("currency", "String"),
    ("orders", "UInt64"),
    ("revenue", "Decimal(18, 4)"),
];
const DATA_SORTING_KEY: &str = "window_start, customer_id, currency, source_partition, version";
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
];
/// Sorted by the newest window a batch holds: the view reads only batches that can hold a row at
/// or after the fold frontier, a range of this key whoever wrote them. Epochs are numbered per
/// writer, so they cannot bound that set once several workers write a job.
const COMMIT_SORTING_KEY: &str = "max_window_start, batch_id";
/// The key of commit logs created before the view pruned by window.
const LEGACY_COMMIT_SORTING_KEY: &str = "epoch";

const VIEW_COLUMNS: &[(&str, &str)] = &[
    ("window_start", "DateTime"),
    ("window_end", "DateTime"),
    ("customer_id", "String"),
    ("currency", "String"),
    ("orders", "UInt64"),
    ("revenue", "Decimal(18, 4)"),
];
/// Folded rows have exactly the view's shape. Sorted by time first: every dashboard query has a
/// time range, and within it a customer's rows are found by the second key column.
const FINAL_SORTING_KEY: &str = "window_start, customer_id, currency";

/// The published answer for the windows folding has not reached has the view's columns, then
/// these: the point of the commit log it was computed at (the same in every row of a snapshot).
const PUBLISHED_AT_COLUMNS: &[(&str, &str)] = &[
    ("published_from", "DateTime"),
    ("cut_partitions", "Array(Int32)"),
    ("cut_offsets", "Array(Int64)"),
];

fn live_columns() -> Vec<(&'static str, &'static str)> {
    VIEW_COLUMNS
        .iter()
        .chain(PUBLISHED_AT_COLUMNS)
        .copied()
        .collect()
}
/// Each publish replaces the table's one partition; its old part is of no use after that.
const LIVE_SETTINGS: &str = "old_parts_lifetime = 60";

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
        })
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
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree PARTITION BY intDiv(toUInt32(window_start), {DATA_PARTITION_SECONDS}) ORDER BY ({DATA_SORTING_KEY})",
            self.data,
            columns_sql(DATA_COLUMNS)
        )
    }

    fn create_commits(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY ({COMMIT_SORTING_KEY})",
            self.commits,
            columns_sql(COMMIT_COLUMNS)
        )
    }

    fn create_final_like(&self, name: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {name} ({}) ENGINE = MergeTree PARTITION BY toYYYYMMDD(window_start) ORDER BY ({FINAL_SORTING_KEY})",
            columns_sql(VIEW_COLUMNS)
        )
    }

    fn create_live(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY ({FINAL_SORTING_KEY}) SETTINGS {LIVE_SETTINGS}",
            self.live,
            columns_sql(&live_columns())
        )
    }

    fn create_partitions(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY partition",
            self.partitions,
            columns_sql(PARTITION_COLUMNS)
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

    /// Per (source partition, window, customer, currency) the value of the newest committed
    /// version (of batches at or below the per-partition offsets `cut`, if given), summed over
    /// source partitions, for windows from `from` (and before `to_seconds`, if given). Only
    /// batches whose newest window is at or after `from` can hold such rows, which bounds the
    /// commit set however old the job is and whoever wrote the batches.
    pub(crate) fn versions_sql(
        &self,
        from: Frontier,
        to_seconds: Option<u32>,
        cut: Option<&Cut>,
    ) -> String {
        let upper = to_seconds.map_or(String::new(), |t| {
            format!(" AND window_start < toDateTime({t})")
        });
        let pairs = "arrayMap((cp, cv) -> (cp, cv), partitions, arrayResize(to_offsets, length(partitions)))";
        // A cut keeps, per partition, the versions up to its offset; a partition it does not
        // name finds index 0, whose element is 0, below every version.
        let pairs = match cut {
            None => pairs.to_owned(),
            Some(cut) if cut.0.is_empty() => format!("arrayFilter(pv -> 0, {pairs})"),
            Some(cut) => format!(
                "arrayFilter(pv -> tupleElement(pv, 2) <= arrayElement([{offsets}], indexOf([{partitions}], tupleElement(pv, 1))), {pairs})",
                partitions = cut.partitions_sql(),
                offsets = cut.offsets_sql(),
            ),
        };
        // `+ 0` keeps the IN off the sorting key: 18.16 otherwise builds the set for index
        // analysis on every analysis pass of the query, which costs more than it prunes.
        // The commit set is unnested with `arrayJoin` into one tuple column rather than with an
        // ARRAY JOIN clause: the same set, but 18.16 analyzes this subquery on every pass over
        // the nested query, and the clause costs it about 2 ms more per reader SELECT.
        // window_end follows from window_start, so it is carried, not grouped by; the source
        // partition is grouped by, not selected. sum(UInt64) is UInt64 on every server.
        format!(
            "SELECT window_start, any(p_window_end) AS window_end, customer_id, currency, sum(p_orders) AS orders, toDecimal64(sum(p_revenue), 4) AS revenue \
             FROM (SELECT window_start, any(window_end) AS p_window_end, customer_id, currency, \
                          argMax(orders, version) AS p_orders, argMax(revenue, version) AS p_revenue \
                   FROM {data} \
                   WHERE window_start >= toDateTime({f}){upper} \
                     AND (toInt32(source_partition + 0), version + 0) IN \
                         (SELECT arrayJoin({pairs}) FROM {commits} WHERE max_window_start >= toDateTime({f})) \
                   GROUP BY source_partition, window_start, customer_id, currency) \
             GROUP BY window_start, customer_id, currency",
            data = self.data,
            commits = self.commits,
            f = from.seconds,
        )
    }

    /// The reader view for a fold frontier: folded rows below it, the published answer from it
    /// on. Both tables change only by whole parts added or replaced at once, so a SELECT sees
    /// every batch whole or not at all. The frontier is a literal, so both halves of one SELECT
    /// agree on it; a fold step installs a new view with one atomic RENAME.
    pub fn create_view(&self, name: &str, frontier: Frontier) -> String {
        format!(
            "CREATE VIEW IF NOT EXISTS {name} AS \
             SELECT window_start, window_end, customer_id, currency, orders, revenue FROM {final_rows} WHERE window_start < toDateTime({f}) \
             UNION ALL \
             SELECT window_start, window_end, customer_id, currency, orders, revenue FROM {live} WHERE window_start >= toDateTime({f})",
            final_rows = self.final_rows,
            live = self.live,
            f = frontier.seconds,
        )
    }

    /// Per source partition, the newest offset of the batches that can hold windows at or
    /// after `from` (those a snapshot from `from` is built from).
    pub(crate) fn open_cut_sql(&self, from: Frontier) -> String {
        format!(
            "SELECT p, max(o) FROM {} ARRAY JOIN partitions AS p, arrayResize(to_offsets, length(partitions)) AS o \
             WHERE max_window_start >= toDateTime({}) GROUP BY p ORDER BY p",
            self.commits, from.seconds
        )
    }

    /// Where the published snapshot was computed: (from, partitions, offsets); no row when
    /// it is empty.
    pub(crate) fn published_sql(&self) -> String {
        format!(
            "SELECT toUInt32(published_from), cut_partitions, cut_offsets FROM {} LIMIT 1",
            self.live
        )
    }

    /// Builds in `stage` the answer for windows from `from` as of the batches up to `cut`.
    pub(crate) fn stage_snapshot_sql(&self, stage: &str, from: Frontier, cut: &Cut) -> Vec<String> {
        vec![
            format!("CREATE TABLE IF NOT EXISTS {stage} AS {}", self.live),
            format!("TRUNCATE TABLE {stage}"),
            format!(
                "INSERT INTO {stage} SELECT window_start, window_end, customer_id, currency, orders, revenue, \
                 toDateTime({f}), CAST([{partitions}], 'Array(Int32)'), CAST([{offsets}], 'Array(Int64)') FROM ({versions})",
                f = from.seconds,
                partitions = cut.partitions_sql(),
                offsets = cut.offsets_sql(),
                versions = self.versions_sql(from, None, Some(cut)),
            ),
        ]
    }

    /// Installs a staged snapshot: the live table's one partition replaced at once.
    pub(crate) fn replace_live_sql(&self, stage: &str) -> [String; 2] {
        [
            format!(
                "ALTER TABLE {} REPLACE PARTITION tuple() FROM {stage}",
                self.live
            ),
            format!("TRUNCATE TABLE {stage}"),
        ]
    }

    /// Totals of the batches the published snapshot and the folded rows hold: those wholly
    /// below the snapshot's `from` (folded) and those up to its cut; and how many batches
    /// committed over [`UNPUBLISHED_AFTER_SECONDS`] ago are not published yet (a publish
    /// follows a commit within a second while the job's read side runs). (events, revenue as
    /// a decimal string, batches.)
    pub(crate) fn published_totals_sql(
        &self,
        from: Frontier,
        cut: &Cut,
        unpublished_after_seconds: u32,
    ) -> String {
        let within = format!(
            "(max_window_start < toDateTime({f}) OR arrayAll((p, o) -> o <= arrayElement([{offsets}], indexOf([{partitions}], p)), partitions, arrayResize(to_offsets, length(partitions))))",
            f = from.seconds,
            partitions = cut.partitions_sql(),
            offsets = cut.offsets_sql(),
        );
        let within = if cut.0.is_empty() {
            format!("max_window_start < toDateTime({})", from.seconds)
        } else {
            within
        };
        format!(
            "SELECT toUInt64(sumIf(e, w)), toString(sumIf(r, w)), toUInt64(countIf(NOT w AND t < now() - {unpublished_after_seconds})) FROM \
             (SELECT any(event_count) AS e, any(revenue_sum) AS r, any({within}) AS w, min(committed_at) AS t FROM {} GROUP BY partitions, to_offsets)",
            self.commits
        )
    }

    /// (rows, distinct snapshot points) of the live table: a publish writes every row of a
    /// snapshot with its one point, so two points mean a row no publish wrote.
    pub(crate) fn live_points_sql(&self) -> String {
        format!(
            "SELECT count(), uniqExact(published_from, cut_partitions, cut_offsets) FROM {}",
            self.live
        )
    }

    /// The `n` newest logged frontiers, newest first.
    pub(crate) fn logged_frontiers_sql(&self, n: u32) -> String {
        format!(
            "SELECT toUInt32(frontier) AS seconds FROM {} ORDER BY frontier DESC LIMIT {n}",
            self.folds
        )
    }

    /// The lowest committed watermark over the partitions of the batches that can hold windows
    /// at or after `from` (each partition's newest watermark among them), and how many
    /// partitions. Watermarks only grow, and a partition whose watermark passed `from` had an
    /// event, not late, in a window at or after it, so its newest batch of that kind is here;
    /// a partition missing from the answer has not got that far. A malformed commit-log row
    /// (arrays of other lengths) reads as "no watermark", never as an error that would stop
    /// readers or folding.
    pub(crate) fn committed_watermark_sql(&self, from: u32) -> String {
        format!(
            "SELECT toInt64(min(wm)) AS w, count() AS n FROM \
             (SELECT p, max(w) AS wm FROM {} ARRAY JOIN partitions AS p, arrayResize(watermarks, length(partitions), toInt64(-9223372036854775808)) AS w \
              WHERE max_window_start >= toDateTime({from}) GROUP BY p)",
            self.commits
        )
    }

    pub(crate) fn count_final_sql(&self, from_seconds: Option<u32>) -> String {
        let filter = from_seconds.map_or(String::new(), |f| {
            format!(" WHERE window_start >= toDateTime({f})")
        });
        format!("SELECT count() FROM {}{filter}", self.final_rows)
    }

    /// Day partitions of the folded table holding rows at or after `from`.
    pub(crate) fn unlogged_days_sql(&self, from: u32) -> String {
        format!(
            "SELECT DISTINCT toString(toYYYYMMDD(window_start)) AS partition FROM {} WHERE window_start >= toDateTime({from})",
            self.final_rows
        )
    }

    /// Rebuilds day partition `day` of the folded table with only its rows before `from`, in
    /// `stage` (a table of the read side's lease).
    pub(crate) fn rebuild_day_sql(&self, stage: &str, day: &str, from: u32) -> Vec<String> {
        let final_rows = &self.final_rows;
        vec![
            format!("CREATE TABLE IF NOT EXISTS {stage} AS {final_rows}"),
            format!("TRUNCATE TABLE {stage}"),
            format!(
                "INSERT INTO {stage} SELECT * FROM {final_rows} WHERE toYYYYMMDD(window_start) = {day} AND window_start < toDateTime({from})"
            ),
            // An empty staging partition empties the target partition, as it should.
            format!("ALTER TABLE {final_rows} REPLACE PARTITION {day} FROM {stage}"),
            format!("TRUNCATE TABLE {stage}"),
        ]
    }

    /// Folds the windows in `[from, to)` into `stage` (shaped as the folded table).
    pub(crate) fn fold_insert_sql(&self, stage: &str, from: Frontier, to_seconds: u32) -> String {
        format!(
            "INSERT INTO {stage} {}",
            self.versions_sql(from, Some(to_seconds), None)
        )
    }

    /// Moves day `day` of a fold step's stage table into the folded table.
    pub(crate) fn attach_day_sql(&self, day: u32, stage: &str) -> String {
        format!(
            "ALTER TABLE {} ATTACH PARTITION {day} FROM {stage}",
            self.final_rows
        )
    }

    /// Logs `frontier`: one row selected from the read side's `lease_table` (fenced with it),
    /// and only while the job has at most `registered` partitions registered.
    pub(crate) fn fold_log_sql(
        &self,
        frontier: Frontier,
        folded_rows: u64,
        lease_table: &str,
        registered: usize,
    ) -> String {
        format!(
            "INSERT INTO {} (frontier, first_epoch, folded_rows, folded_at) SELECT toDateTime({}), 0, {folded_rows}, now() FROM {lease_table} \
             WHERE (SELECT uniqExact(partition) FROM {}) <= {registered}",
            self.folds, frontier.seconds, self.partitions
        )
    }

    /// Swaps in the view for `frontier`, built in the read side's `lease_database`, so that a
    /// reader sees either the old view or the new one and never no view: EXCHANGE on Atomic
    /// databases (current servers), where a multi-table RENAME is not atomic; a two-table
    /// RENAME on Ordinary ones (18.16), where it is. Leftovers of an interrupted swap are
    /// dropped first.
    pub(crate) fn install_view_sql(
        &self,
        frontier: Frontier,
        atomic_database: bool,
        lease_database: &str,
    ) -> Vec<String> {
        let view = self.view_q();
        let (next, old) = (
            format!("{lease_database}.next_view"),
            format!("{lease_database}.old_view"),
        );
        let mut sql = vec![
            format!("DROP TABLE IF EXISTS {old}"),
            format!("DROP TABLE IF EXISTS {next}"),
            self.create_view(&next, frontier),
        ];
        if atomic_database {
            sql.push(format!("EXCHANGE TABLES {view} AND {next}"));
            sql.push(format!("DROP TABLE IF EXISTS {next}"));
        } else {
            sql.push(format!("RENAME TABLE {view} TO {old}, {next} TO {view}"));
            sql.push(format!("DROP TABLE IF EXISTS {old}"));
        }
        sql
    }

    pub(crate) fn database_engine_sql(&self) -> String {
        format!(
            "SELECT engine FROM system.databases WHERE name = '{}'",
            self.database
        )
    }

    /// Active partitions of one of the job's tables (`data` or `final_rows`), with their rows.
    pub(crate) fn partitions_sql(&self, qualified: &str) -> String {
        let table = qualified.rsplit('.').next().unwrap_or(qualified);
        format!(
            "SELECT partition, toString(sum(rows)) AS rows FROM system.parts WHERE database = '{}' AND table = '{table}' AND active GROUP BY partition ORDER BY partition",
            self.database
        )
    }

    pub(crate) fn drop_partition_sql(&self, qualified: &str, partition: &str) -> String {
        format!("ALTER TABLE {qualified} DROP PARTITION {partition}")
    }

    /// Every row of the reader view, as a plain SELECT sees it.
    pub fn read_view_sql(&self) -> String {
        format!(
            "SELECT toUInt32(window_start) AS ws, customer_id, currency, orders, revenue FROM {}",
            self.view_q()
        )
    }

    /// The view's rows as readers saw them once the batches up to `cut` were committed, for
    /// the logged `frontier`, for windows starting in `[from_seconds, to_seconds]` when given.
    pub fn read_view_at_sql(
        &self,
        frontier: Frontier,
        cut: &Cut,
        window_range: Option<(u32, u32)>,
    ) -> String {
        self.read_answer_sql(frontier, Some(cut), window_range)
    }

    /// The answer's rows as read back (see [`answer_sql`](Self::answer_sql)), for windows
    /// starting in `[from_seconds, to_seconds]` when given.
    pub(crate) fn read_answer_sql(
        &self,
        frontier: Frontier,
        cut: Option<&Cut>,
        window_range: Option<(u32, u32)>,
    ) -> String {
        let range = window_range.map_or(String::new(), |(from, to)| {
            format!(
                " WHERE window_start >= toDateTime({from}) AND window_start <= toDateTime({to})"
            )
        });
        format!(
            "SELECT toUInt32(window_start) AS ws, customer_id, currency, orders, revenue FROM ({}){range}",
            self.answer_sql(frontier, cut)
        )
    }

    /// The answer as the commit log has it (up to `cut`, if given): folded rows below the
    /// frontier, committed versions from it on. What a publish would show.
    pub(crate) fn answer_sql(&self, frontier: Frontier, cut: Option<&Cut>) -> String {
        format!(
            "SELECT window_start, window_end, customer_id, currency, orders, revenue FROM {final_rows} WHERE window_start < toDateTime({f}) \
             UNION ALL {versions}",
            final_rows = self.final_rows,
            f = frontier.seconds,
            versions = self.versions_sql(frontier, None, cut),
        )
    }

    /// (orders, revenue as a decimal string, keys shown more than once) of rows read from
    /// `source` (a table, a view, or a parenthesised SELECT).
    pub(crate) fn totals_sql(&self, source: &str) -> String {
        format!(
            "SELECT toUInt64(sum(o)), toString(sum(r)), toUInt64(countIf(n > 1)) FROM \
             (SELECT sum(orders) AS o, sum(revenue) AS r, count() AS n FROM {source} GROUP BY window_start, customer_id, currency)"
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
        let (commits, next, old) = (
            &self.commits,
            format!("{}__next", self.commits),
            format!("{}__old", self.commits),
        );
        let mut sql = vec![
            format!("DROP TABLE IF EXISTS {next}"),
            format!(
                "CREATE TABLE {next} ({}) ENGINE = MergeTree ORDER BY ({COMMIT_SORTING_KEY})",
                columns_sql(COMMIT_COLUMNS)
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
        if atomic_database {
            sql.push(format!("EXCHANGE TABLES {commits} AND {next}"));
            sql.push(format!("DROP TABLE {next}"));
        } else {
            sql.push(format!("DROP TABLE IF EXISTS {old}"));
            sql.push(format!(
                "RENAME TABLE {commits} TO {old}, {next} TO {commits}"
            ));
            sql.push(format!("DROP TABLE {old}"));
        }
        sql
    }

    /// Every statement tally issues, named: the read side's claim of generation 1, one fold
    /// step from `from` to `to` (repair of day `day`, fold, log, install, drop of version
    /// partition `data_partition`), a publish of the answer from `from` as of `as_of`, the
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
            .chain(self.replace_live_sql(&stage));
        for (i, sql) in publish.enumerate() {
            out.push((format!("publish.{i}"), sql));
        }
        for (i, sql) in self
            .rebuild_day_sql(&format!("{lease_db}.repair"), day, to.seconds)
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
        for (i, sql) in self.release_sql(1).into_iter().enumerate() {
            out.push((format!("release.{i}"), sql));
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

pub(crate) fn columns_sql(columns: &[(&str, &str)]) -> String {
    columns
        .iter()
        .map(|(n, t)| format!("{n} {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Debug, Deserialize)]
struct TableInfo {
    engine: String,
    #[serde(default)]
    sorting_key: Option<String>,
    #[serde(default)]
    create_table_query: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ColumnInfo {
    name: String,
    #[serde(rename = "type")]
    type_: String,
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

/// Checks one object against what tally needs; `None` when it does not exist.
async fn inspect(
    client: &Client,
    url: &str,
    database: &str,
    name: &str,
) -> Result<Option<(TableInfo, Vec<ColumnInfo>)>> {
    // sorting_key is absent on some old servers: select * and let serde pick.
    let tables: Vec<TableInfo> = json_rows(
        client,
        &format!("SELECT * FROM system.tables WHERE database = '{database}' AND name = '{name}'"),
        url,
        "reading system.tables",
    )
    .await?;
    let Some(table) = tables.into_iter().next() else {
        return Ok(None);
    };
    let columns = json_rows(
        client,
        &format!("SELECT name, type FROM system.columns WHERE database = '{database}' AND table = '{name}'"),
        url,
        "reading system.columns",
    )
    .await?;
    Ok(Some((table, columns)))
}

fn check(
    full_name: &str,
    info: &(TableInfo, Vec<ColumnInfo>),
    engine: &str,
    sorting_key: Option<&str>,
    expected: &[(&str, &str)],
) -> Vec<String> {
    let (table, columns) = info;
    let mut problems = Vec::new();
    if table.engine != engine {
        problems.push(format!(
            "{full_name} has engine {}, expected {engine}",
            table.engine
        ));
    }
    if let (Some(want), Some(have)) = (sorting_key, table.sorting_key.as_deref())
        && !have.is_empty()
        && have != want
    {
        problems.push(format!(
            "{full_name} is ordered by ({have}), expected ({want})"
        ));
    }
    for (name, ty) in expected {
        match columns.iter().find(|c| c.name == *name) {
            None => problems.push(format!("{full_name} lacks column {name} {ty}")),
            Some(c) if normalise(&c.type_) != normalise(ty) => {
                problems.push(format!(
                    "{full_name}.{name} has type {}, expected {ty}",
                    c.type_
                ));
            }
            Some(_) => {}
        }
    }
    for c in columns {
        if !expected.iter().any(|(n, _)| *n == c.name) {
            problems.push(format!(
                "{full_name} has unexpected column {} {}",
                c.name, c.type_
            ));
        }
    }
    problems
}

fn normalise(ty: &str) -> String {
    let ty: String = ty.chars().filter(|c| !c.is_whitespace()).collect();
    // A current server may print DateTime with its zone.
    if ty.starts_with("DateTime(") {
        "DateTime".into()
    } else {
        ty
    }
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
    Ok(engines.first().is_some_and(|e| e.engine != "Ordinary"))
}

/// What [`ensure`] left to its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ensured {
    /// The view is of an earlier layout: publish a snapshot, then install the current view.
    pub install_view: bool,
}

pub(crate) async fn ensure(client: &Client, names: &TableNames, url: &str) -> Result<Ensured> {
    execute(
        client,
        &format!("CREATE DATABASE IF NOT EXISTS {}", names.database),
        url,
    )
    .await?;
    let short = |suffix: &str| format!("{}{suffix}", names.view);
    let live = live_columns();
    let tables = [
        (
            names.data.clone(),
            short("_data"),
            Some(DATA_SORTING_KEY),
            DATA_COLUMNS,
            names.create_data(),
        ),
        (
            names.commits.clone(),
            short("_commits"),
            Some(COMMIT_SORTING_KEY),
            COMMIT_COLUMNS,
            names.create_commits(),
        ),
        (
            names.final_rows.clone(),
            short("_final"),
            Some(FINAL_SORTING_KEY),
            VIEW_COLUMNS,
            names.create_final_like(&names.final_rows),
        ),
        (
            names.partitions.clone(),
            short("_partitions"),
            Some("partition"),
            PARTITION_COLUMNS,
            names.create_partitions(),
        ),
        (
            names.read_side_log(),
            short("_read_side"),
            Some("generation, at"),
            READ_SIDE_COLUMNS,
            names.create_read_side_log(),
        ),
        (
            names.folds.clone(),
            short("_folds"),
            Some(FOLD_SORTING_KEY),
            FOLD_COLUMNS,
            names.create_folds(),
        ),
        (
            names.live.clone(),
            short("_live"),
            Some(FINAL_SORTING_KEY),
            &live[..],
            names.create_live(),
        ),
    ];
    let mut problems = Vec::new();
    let mut old_layout = false;
    let mut migrated = false;
    for (full, name, key, columns, create) in tables {
        match inspect(client, url, &names.database, &name).await? {
            None => execute(client, &create, url).await?,
            Some(info) => {
                old_layout |= name == short("_data") && info.1.iter().any(|c| c.name == "epoch");
                let legacy_commits = name == short("_commits")
                    && info.0.sorting_key.as_deref() == Some(LEGACY_COMMIT_SORTING_KEY);
                let found = check(&full, &info, "MergeTree", key, columns);
                // Only the key differs: same rows, sorted for the view's pruning by window.
                if legacy_commits && found.len() == 1 {
                    for sql in names.migrate_commits_sql(atomic_database(client, names, url).await?)
                    {
                        execute(client, &sql, url).await?;
                    }
                    tracing::info!(table = %full, "rebuilt the commit log sorted by window (it was sorted by epoch)");
                    migrated = true;
                } else {
                    problems.extend(found);
                }
            }
        }
    }
    let mut install_view = false;
    if problems.is_empty() {
        // Created last: it reads the tables, and its frontier is the fold log's newest.
        let frontier = latest_frontier(client, names, url).await?;
        match inspect(client, url, &names.database, &names.view).await? {
            None => execute(client, &names.create_view(&names.view_q(), frontier), url).await?,
            Some(info) => {
                problems.extend(check(&names.view_q(), &info, "View", None, VIEW_COLUMNS));
                // A view of an earlier layout: it read the versions itself (which let a reader
                // see half a batch), or pruned the commit log by epoch.
                let reads_live = info
                    .0
                    .create_table_query
                    .as_deref()
                    .is_none_or(|q| q.contains(&format!("{}_live", names.view)));
                install_view = migrated || !reads_live;
            }
        }
    }
    if problems.is_empty() {
        return Ok(Ensured { install_view });
    }
    let drop_all = format!(
        "DROP TABLE {v}; DROP TABLE {d}; DROP TABLE {c}; DROP TABLE IF EXISTS {f}; DROP TABLE IF EXISTS {l}; DROP TABLE IF EXISTS {p}; DROP TABLE IF EXISTS {r}; DROP TABLE IF EXISTS {g}; DROP TABLE IF EXISTS {j}",
        v = names.view_q(),
        d = names.data,
        c = names.commits,
        f = names.final_rows,
        l = names.folds,
        p = names.live,
        r = names.partitions,
        g = names.read_side_log(),
        j = names.identity(),
    );
    if old_layout {
        return Err(SinkError::Schema(format!(
            "{}. {} was written by an earlier tally whose rows are versioned by a per-process epoch; \
             this version keys them by the source partition's offset so that any worker can continue a partition. \
             The old rows cannot be re-versioned without their offsets. Either keep running the earlier tally for this table, \
             or start over: {drop_all}; and delete the state directory, then tally recomputes everything from the topic \
             (only if the topic still holds it), or point clickhouse.table at a new name",
            problems.join("; "),
            names.data
        )));
    }
    Err(SinkError::Schema(format!(
        "{}. tally owns these objects and cannot write exactly once into a different shape: \
         rename or drop them ({drop_all}) and tally recreates them, \
         or point clickhouse.table at another name",
        problems.join("; "),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(TableNames::new("tally", "revenue_agg").is_ok());
        assert!(TableNames::new("tally", "x; DROP TABLE y").is_err());
        assert!(TableNames::new("1db", "t").is_err());
    }

    #[test]
    fn a_wrong_engine_and_column_are_named() {
        let info = (
            TableInfo {
                engine: "ReplacingMergeTree".into(),
                sorting_key: Some("epoch".into()),
                create_table_query: None,
            },
            vec![ColumnInfo {
                name: "version".into(),
                type_: "UInt32".into(),
            }],
        );
        let problems = check(
            "tally.x_data",
            &info,
            "MergeTree",
            Some(DATA_SORTING_KEY),
            DATA_COLUMNS,
        );
        let text = problems.join("\n");
        assert!(
            text.contains("engine ReplacingMergeTree, expected MergeTree"),
            "{text}"
        );
        assert!(text.contains("ordered by (epoch)"), "{text}");
        assert!(
            text.contains("tally.x_data.version has type UInt32, expected Int64"),
            "{text}"
        );
        assert!(
            text.contains("lacks column revenue Decimal(18, 4)"),
            "{text}"
        );
    }

    #[test]
    fn the_view_reads_each_window_from_one_side_of_one_frontier() {
        let names = TableNames::new("tally", "r").unwrap_or_else(|e| unreachable!("{e}"));
        let frontier = Frontier {
            seconds: 1_790_000_400,
        };
        let sql = names.create_view("tally.r__next", frontier);
        assert!(sql.contains("FROM tally.r_final WHERE window_start < toDateTime(1790000400)"));
        assert!(sql.contains("FROM tally.r_live WHERE window_start >= toDateTime(1790000400)"));
        // Readers read published rows only: no versions, no commit log in their SELECT.
        assert!(
            !sql.contains("r_data") && !sql.contains("r_commits"),
            "{sql}"
        );
        assert_eq!(sql.matches("toDateTime(1790000400)").count(), 2);
        // The view is built in the read side's generation database: a fenced holder cannot.
        let swap = names.install_view_sql(frontier, true, "tally__r__read4");
        assert_eq!(
            swap[2],
            names.create_view("tally__r__read4.next_view", frontier)
        );
        assert_eq!(
            swap[3],
            "EXCHANGE TABLES tally.r AND tally__r__read4.next_view"
        );
        let swap = names.install_view_sql(frontier, false, "tally__r__read4");
        assert_eq!(
            swap[3],
            "RENAME TABLE tally.r TO tally__r__read4.old_view, tally__r__read4.next_view TO tally.r"
        );
    }

    #[test]
    fn a_publish_reads_committed_versions_as_of_its_cut_from_its_frontier() {
        let names = TableNames::new("tally", "r").unwrap_or_else(|e| unreachable!("{e}"));
        let from = Frontier {
            seconds: 1_790_000_400,
        };
        let cut = Cut([(0, 20), (1, 8)].into_iter().collect());
        let stage = "tally__r__read3.live_0".to_string();
        let sql = names.stage_snapshot_sql(&stage, from, &cut).join("; ");
        // Batches are pruned by the newest window they hold, not by a writer's epoch, and the
        // cut is a literal: the versions are read after it was fixed.
        assert!(
            sql.contains("WHERE max_window_start >= toDateTime(1790000400))"),
            "{sql}"
        );
        assert!(sql.contains("indexOf([0, 1]"), "{sql}");
        assert!(sql.contains("arrayElement([20, 8]"), "{sql}");
        assert!(!sql.contains("epoch"), "{sql}");
        let [replace, _] = names.replace_live_sql(&stage);
        assert_eq!(
            replace,
            "ALTER TABLE tally.r_live REPLACE PARTITION tuple() FROM tally__r__read3.live_0"
        );
    }

    #[test]
    fn datetime_with_zone_is_accepted() {
        assert_eq!(normalise("DateTime('UTC')"), "DateTime");
        assert_eq!(normalise("Decimal(18,4)"), normalise("Decimal(18, 4)"));
    }
}
