//! The statements that build and read the job's answer: versions as of a cut, the published
//! snapshot, fold steps, the view at a frontier, and reads of it.

use super::*;

impl TableNames {
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
            "SELECT window_start, any(p_window_end) AS window_end, {keys}, {merged} \
             FROM (SELECT window_start, any(window_end) AS p_window_end, {keys}, \
                          {newest} \
                   FROM {data} \
                   WHERE window_start >= toDateTime({f}){upper} \
                     AND (toInt32(source_partition + 0), version + 0) IN \
                         (SELECT arrayJoin({pairs}) FROM {commits} WHERE max_window_start >= toDateTime({f})) \
                   GROUP BY source_partition, window_start, {keys}) \
             GROUP BY window_start, {keys}{having}",
            keys = self.shape.key_list(),
            having = self.shape.having(),
            merged = self.shape.merged(),
            newest = self.shape.newest_per_partition(),
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
             SELECT window_start, window_end, {keys}, {shown} FROM {final_rows} WHERE window_start < toDateTime({f}) \
             UNION ALL \
             SELECT window_start, window_end, {keys}, {shown} FROM {live} WHERE window_start >= toDateTime({f})",
            keys = self.shape.key_list(),
            shown = self.shape.shown_list(),
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
                "INSERT INTO {stage} SELECT window_start, window_end, {keys}, {kept}, \
                 toDateTime({f}), CAST([{partitions}], 'Array(Int32)'), CAST([{offsets}], 'Array(Int64)') FROM ({versions})",
                keys = self.shape.key_list(),
                kept = self.shape.kept_list(),
                f = from.seconds,
                partitions = cut.partitions_sql(),
                offsets = cut.offsets_sql(),
                versions = self.versions_sql(from, None, Some(cut)),
            ),
        ]
    }

    /// Installs a staged snapshot: the stage table (in `lease_database`) becomes the live
    /// table (see [`swap_tables_sql`]).
    pub(crate) fn swap_live_sql(
        &self,
        stage: &str,
        lease_database: &str,
        atomic_database: bool,
    ) -> Vec<String> {
        swap_tables_sql(
            &self.live,
            stage,
            &replaced_in(lease_database),
            atomic_database,
        )
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

    /// Rebuilds the folded table with only its rows before `from` in `stage` (a table of the
    /// read side's `lease_database`) and swaps it in: the days in `whole_days` are linked from
    /// the folded table as they are, those in `cut_days` (the days holding rows at or after
    /// `from`) are copied without those rows. Every active day must be in one of the two.
    pub(crate) fn rebuild_final_sql(
        &self,
        stage: &str,
        lease_database: &str,
        atomic_database: bool,
        whole_days: &[String],
        cut_days: &[String],
        from: u32,
    ) -> Vec<String> {
        let final_rows = &self.final_rows;
        let mut sql = vec![
            format!("DROP TABLE IF EXISTS {stage}"),
            format!("CREATE TABLE {stage} AS {final_rows}"),
        ];
        sql.extend(
            whole_days
                .iter()
                .map(|day| format!("ALTER TABLE {stage} ATTACH PARTITION {day} FROM {final_rows}")),
        );
        sql.extend(cut_days.iter().map(|day| {
            format!(
                "INSERT INTO {stage} SELECT * FROM {final_rows} WHERE toYYYYMMDD(window_start) = {day} AND window_start < toDateTime({from})"
            )
        }));
        sql.extend(swap_tables_sql(
            final_rows,
            stage,
            &replaced_in(lease_database),
            atomic_database,
        ));
        sql
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
        TableNames::replace_view_sql(
            &self.view_q(),
            |next| self.create_view(next, frontier),
            atomic_database,
            lease_database,
        )
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
        self.read_view_named_sql(&self.view)
    }

    /// [`read_view_sql`](Self::read_view_sql) of another view of the database with this job's
    /// columns: the job's view once a new version holds it.
    pub fn read_view_named_sql(&self, view: &str) -> String {
        format!(
            "SELECT toUInt32(window_start) AS ws, {}, {} FROM {}.{view}",
            self.shape.key_list(),
            self.shape.value_list(),
            self.database
        )
    }

    /// Rows of `rows` (a read of [`read_view_sql`](Self::read_view_sql)'s columns) as the
    /// window start in seconds, the keys as text and the values as text.
    pub(crate) fn cells_sql(&self, rows: &str) -> String {
        let (keys, values) = self.shape.cells_lists();
        format!("SELECT ws, {keys}, {values} FROM ({rows})")
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
            "SELECT toUInt32(window_start) AS ws, {}, {} FROM ({}){range}",
            self.shape.key_list(),
            self.shape.shown_list(),
            self.answer_sql(frontier, cut)
        )
    }

    /// The answer as the commit log has it (up to `cut`, if given): folded rows below the
    /// frontier, committed versions from it on. What a publish would show.
    pub(crate) fn answer_sql(&self, frontier: Frontier, cut: Option<&Cut>) -> String {
        format!(
            "SELECT window_start, window_end, {keys}, {kept} FROM {final_rows} WHERE window_start < toDateTime({f}) \
             UNION ALL {versions}",
            keys = self.shape.key_list(),
            kept = self.shape.kept_list(),
            final_rows = self.final_rows,
            f = frontier.seconds,
            versions = self.versions_sql(frontier, None, cut),
        )
    }

    /// Keys shown more than once among rows read from `source` (a table, a view, or a
    /// parenthesised SELECT).
    pub(crate) fn doubled_keys_sql(&self, source: &str) -> String {
        let keys = self.shape.key_list();
        let by = if keys.is_empty() {
            "window_start".to_owned()
        } else {
            format!("window_start, {keys}")
        };
        format!(
            "SELECT toUInt64(countIf(n > 1)) FROM (SELECT count() AS n FROM {source} GROUP BY {by})"
        )
    }
}
