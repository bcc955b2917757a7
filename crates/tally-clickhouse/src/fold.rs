//! Folding: final windows move from the version table to one row each in the folded table.
//!
//! A window is final once its end + allowed lateness is at or below the committed watermark of
//! every source partition the job knows: no later record can change it. The fold frontier `F`
//! is the newest window start below which every window is final. One step, run by the read
//! side's holder under its [`ReadLease`] (every statement that changes what readers see names a
//! table of the lease's database, so none of an earlier holder's lands after this one's fence),
//! each part idempotent:
//! 1. drop rows at or after the logged frontier from the folded table (leftovers of a step that
//!    died before logging; readers never saw them, the view reads folded rows below `F` only);
//! 2. build the folded rows of `[F_old, F_new)` in a stage table of the step's own, computed by
//!    the server from committed versions. An insert the server finishes after its client died
//!    lands there and nowhere else. `F_new` is the frontier the watermarks allow, but no further
//!    than about [`FoldRules::step_rows`] versions (whole version partitions, or a share of one
//!    larger than that): however far behind folding is, a step groups a bounded number of rows
//!    (after a backlog, the whole range at once exceeded the server's memory limit, as did every
//!    retry), and the next step follows at once;
//! 3. attach the stage's day partitions to the folded table (rows at or after `F`: unread);
//! 4. log `F_new` in the fold log, with `INSERT … SELECT` from the lease's table and only if no
//!    source partition was registered since the step counted them (a partition added meanwhile
//!    holds the frontier back; the next step repairs);
//! 5. install the view with `F_new` as a literal (built in the lease's database, then swapped in
//!    atomically), so each SELECT reads folded rows below one frontier and the published answer
//!    from the same one: never both, never neither;
//! 6. drop version partitions entirely below a frontier that this process installed at least
//!    [`READER_MARGIN`] ago (so no reader still plans a query on an older view), and folded
//!    partitions past the retention.
//!
//! Only the commit log's watermarks drive it, so an uncommitted epoch never moves the frontier.

use serde::Deserialize;

use crate::calendar::day_end_seconds;
use crate::error::Result;
use crate::read_side::ReadLease;
use crate::schema::{self, DATA_PARTITION_SECONDS, Frontier};
use crate::sink::ClickHouseSink;

/// How long a view must have been installed before the versions below its frontier are dropped:
/// a SELECT that resolved an older view has long opened the parts it reads by then.
pub const READER_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// About the most versions one fold step reads by default: the server groups them in memory
/// (some hundreds of bytes each on 18.16).
pub const FOLD_STEP_ROWS: u64 = 1_000_000;

/// What folding needs of the job's window rules.
#[derive(Debug, Clone, Copy)]
pub struct FoldRules {
    pub window_size_ms: i64,
    /// The distance between window starts: the size for tumbling windows, less for hopping.
    pub window_slide_ms: i64,
    pub allowed_lateness_ms: i64,
    /// Folded windows older than this (before the frontier) are dropped; `None` keeps all.
    pub retention_ms: Option<i64>,
    /// About the most versions one step groups ([`FOLD_STEP_ROWS`] by default).
    pub step_rows: u64,
}

/// Where a fault-injection hook may stop a fold step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FoldStep {
    /// The server runs the step's insert into its stage table (reported only when asked for).
    Inserting,
    /// The folded rows are in the step's stage table; none is in the folded table.
    Staged,
    /// Folded rows are attached to the folded table; the fold log does not have the new frontier.
    Inserted,
    /// The new frontier is logged; the view still reads the old one.
    Logged,
    /// The view reads the new frontier; replaced versions are not dropped yet (reported only
    /// when the step moved the frontier).
    Installed,
}

/// What a fold step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FoldOutcome {
    /// The frontier in force after the step.
    pub frontier: Frontier,
    /// Rows added to the folded table.
    pub folded_rows: u64,
    /// Version partitions and folded partitions dropped.
    pub dropped_partitions: u64,
    /// Whether leftovers of an interrupted step were removed first.
    pub repaired: bool,
    /// Whether more windows are final than this step folded: the next step can follow at once.
    pub behind: bool,
}

#[derive(Debug, Deserialize)]
struct PartitionRow {
    partition: String,
}

/// An active partition of one of the job's tables: its name and its rows.
#[derive(Debug, Deserialize)]
struct ActivePartition {
    partition: String,
    rows: String,
}

impl FoldRules {
    /// The newest aligned window start below which every window is final for a watermark:
    /// a window `[s, s + size)` is final when `s + size + lateness <= watermark`. Hopping
    /// windows overlap, so the frontier trails the watermark by the size, not the slide.
    pub fn frontier_ms(&self, min_watermark_ms: i64) -> i64 {
        let last_final_end = min_watermark_ms.saturating_sub(self.allowed_lateness_ms);
        let slide = self.window_slide_ms.max(1);
        let last_final_start = last_final_end.saturating_sub(self.window_size_ms);
        last_final_start.div_euclid(slide) * slide + slide
    }
}

impl ClickHouseSink {
    /// The fold frontier most recently logged (zero before the first fold).
    pub async fn frontier(&self) -> Result<Frontier> {
        schema::latest_frontier(&self.client, &self.names, &self.url).await
    }

    pub(crate) async fn exec(&self, sql: &str) -> Result<()> {
        schema::execute(&self.client, sql, &self.url).await
    }

    pub(crate) async fn fetch<T>(&self, sql: &str, context: &str) -> Result<T>
    where
        T: clickhouse::Row + for<'b> clickhouse::RowRead<Value<'b> = T> + 'static,
    {
        self.client
            .query(sql)
            .fetch_one::<T>()
            .await
            .map_err(self.err(context))
    }

    /// The newest frontier this process installed at least [`READER_MARGIN`] ago (zero if
    /// none): no reader still plans a query on a view older than it.
    pub(crate) fn settled_frontier(&self) -> Frontier {
        let installed = self
            .installed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match *installed {
            Some((f, at)) if at.elapsed() >= READER_MARGIN => f,
            _ => Frontier::default(),
        }
    }

    /// Records that `frontier` is installed now; returns the newest frontier installed at
    /// least [`READER_MARGIN`] ago by this process (zero if none).
    fn note_installed(&self, frontier: Frontier) -> Frontier {
        let now = std::time::Instant::now();
        let mut installed = self
            .installed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let settled = match *installed {
            Some((f, at)) if now.duration_since(at) >= READER_MARGIN => f,
            _ => Frontier::default(),
        };
        if installed.is_none_or(|(f, _)| f != frontier) {
            *installed = Some((frontier, now));
        }
        settled
    }

    /// The lowest committed watermark over the job's `partitions` source partitions, once
    /// every one of them has committed a watermark past `from` (seconds).
    async fn committed_watermark(&self, from: u32, partitions: usize) -> Result<Option<i64>> {
        let (w, n): (i64, u64) = self
            .fetch(
                &self.names.committed_watermark_sql(from),
                "reading committed watermarks",
            )
            .await?;
        // A partition missing here (a writer behind, a partition just added) holds the
        // frontier back: windows are final only once every partition says so.
        let all = n > 0 && usize::try_from(n).is_ok_and(|n| n >= partitions);
        Ok((all && w != i64::MIN).then_some(w))
    }

    /// The frontier the committed watermarks of the job's `partitions` source partitions allow
    /// now, in seconds (`None` before every partition has one): how far folding could go;
    /// `frontier()` says how far it went.
    pub async fn foldable_frontier(
        &self,
        rules: FoldRules,
        partitions: usize,
    ) -> Result<Option<u32>> {
        let partitions = partitions.max(self.registered_partitions().await?);
        let logged = self.frontier().await?;
        Ok(self
            .committed_watermark(logged.seconds, partitions)
            .await?
            .and_then(|w| u32::try_from(rules.frontier_ms(w).div_euclid(1000)).ok())
            .map(|f| f.max(logged.seconds)))
    }

    /// The oldest window start among the versions not folded yet, if any.
    pub async fn oldest_unfolded_window(&self) -> Result<Option<u32>> {
        let frontier = self.frontier().await?;
        let (oldest, n): (u32, u64) = self
            .fetch(
                &format!(
                    "SELECT toUInt32(min(window_start)), count() FROM {} WHERE window_start >= toDateTime({})",
                    self.names.data, frontier.seconds
                ),
                "reading the versions",
            )
            .await?;
        Ok((n > 0).then_some(oldest))
    }

    /// Seconds since folding last had its chance: the newest fold step, or the newest claim of
    /// the read side (a holder that has just claimed it has not had a fold interval yet);
    /// `None` when neither happened.
    pub async fn fold_idle_seconds(&self) -> Result<Option<u32>> {
        let (now, stepped, steps): (u32, u32, u64) = self
            .fetch(
                &format!(
                    "SELECT toUInt32(now()), toUInt32(max(folded_at)), count() FROM {}",
                    self.names.folds
                ),
                "reading the fold log",
            )
            .await?;
        let (claimed, claims): (u32, u64) = self
            .fetch(
                &format!(
                    "SELECT toUInt32(max(at)), count() FROM {} WHERE event = 'claimed'",
                    self.names.read_side_log()
                ),
                "reading the read side's log",
            )
            .await?;
        let newest = [
            (steps > 0).then_some(stepped),
            (claims > 0).then_some(claimed),
        ]
        .into_iter()
        .flatten()
        .max();
        Ok(newest.map(|t| now.saturating_sub(t)))
    }

    /// Removes folded rows at or after `from`: they belong to a step that did not log its
    /// frontier, and no view reads them. The folded table is rebuilt without them in the
    /// lease's repair table (days without such rows linked as they are) and swapped in whole.
    async fn drop_unlogged_folds(&self, lease: &ReadLease, from: u32) -> Result<bool> {
        let leftovers: u64 = self
            .fetch(
                &self.names.count_final_sql(Some(from)),
                "checking the folded table",
            )
            .await?;
        if leftovers == 0 {
            return Ok(false);
        }
        let partition_names = |rows: Vec<PartitionRow>| -> Vec<String> {
            rows.into_iter().map(|row| row.partition).collect()
        };
        let cut_days = partition_names(
            schema::json_rows(
                &self.client,
                &self.names.unlogged_days_sql(from),
                &self.url,
                "listing folded partitions to repair",
            )
            .await?,
        );
        let whole_days: Vec<String> = partition_names(
            schema::json_rows(
                &self.client,
                &self.names.partitions_sql(&self.names.final_rows),
                &self.url,
                "listing folded partitions",
            )
            .await?,
        )
        .into_iter()
        .filter(|day| !cut_days.contains(day))
        .collect();
        let atomic = self.atomic_database().await?;
        for sql in self.names.rebuild_final_sql(
            &lease.repair_stage(),
            lease.database(),
            atomic,
            &whole_days,
            &cut_days,
            from,
        ) {
            self.exec_fenced(lease, &sql).await?;
        }
        Ok(true)
    }

    /// Swaps in the view for `frontier`, built in the lease's database.
    pub(crate) async fn install_view(&self, lease: &ReadLease, frontier: Frontier) -> Result<()> {
        let atomic = self.atomic_database().await?;
        for sql in self
            .names
            .install_view_sql(frontier, atomic, lease.database())
        {
            self.exec_fenced(lease, &sql).await?;
        }
        Ok(())
    }

    /// How many source partitions the job has registered (see
    /// [`register_partitions`](Self::register_partitions)).
    pub async fn registered_partitions(&self) -> Result<usize> {
        let n: u64 = self
            .fetch(
                &self.names.registered_count_sql(),
                "reading the registered partitions",
            )
            .await?;
        Ok(usize::try_from(n).unwrap_or(usize::MAX))
    }

    /// Registers the source topic's `partitions` before any of their records is consumed:
    /// from then on folding waits for a committed watermark from each, and a fold step that
    /// counted the partitions before logs no frontier. The first registration (a new job, or
    /// one started by a release before the registry) takes them as the job's own; any later
    /// one was added to the topic while the job ran. Returns the added ones (ever registered
    /// so), which start at [`joining_watermark`](Self::joining_watermark).
    pub async fn register_partitions(
        &self,
        partitions: &[tally_core::PartitionId],
    ) -> Result<std::collections::BTreeSet<tally_core::PartitionId>> {
        let known: Vec<(i32, u8)> = self
            .client
            .query(&self.names.registered_sql())
            .fetch_all()
            .await
            .map_err(self.err("reading the registered partitions"))?;
        let missing: Vec<i32> = partitions
            .iter()
            .copied()
            .filter(|p| !known.iter().any(|(k, _)| k == p))
            .collect();
        if !missing.is_empty() {
            self.exec(&self.names.register_sql(&missing, !known.is_empty()))
                .await?;
        }
        let mut added: std::collections::BTreeSet<i32> = known
            .iter()
            .filter(|(_, added)| *added > 0)
            .map(|(p, _)| *p)
            .collect();
        if !known.is_empty() {
            added.extend(missing);
        }
        Ok(added)
    }

    /// The watermark a source partition that joins the job now starts at (ms): no fold step
    /// can have logged, or can log without counting it, a frontier past the one this
    /// watermark closes. It is the newest committed watermark of any partition (every frontier
    /// follows the lowest), so the partition's events in windows already final for the job's
    /// most advanced partition are late; `None` before any watermark was committed. Call after
    /// [`register_partitions`](Self::register_partitions).
    pub async fn joining_watermark(&self) -> Result<Option<i64>> {
        let (w, n): (i64, u64) = self
            .fetch(
                &self.names.newest_watermark_sql(),
                "reading committed watermarks",
            )
            .await?;
        Ok((n > 0 && w != i64::MIN).then_some(w))
    }

    async fn partitions_of(&self, qualified: &str) -> Result<Vec<(String, u64)>> {
        let rows: Vec<ActivePartition> = schema::json_rows(
            &self.client,
            &self.names.partitions_sql(qualified),
            &self.url,
            "listing partitions",
        )
        .await?;
        rows.into_iter()
            .map(|r| {
                let count = r.rows.parse().map_err(|e| {
                    crate::error::SinkError::Schema(format!(
                        "listing partitions of {qualified}: rows {:?}: {e}",
                        r.rows
                    ))
                })?;
                Ok((r.partition.trim_matches('\'').to_owned(), count))
            })
            .collect()
    }

    /// Rows per active version partition, by partition index, in order.
    async fn version_rows(&self) -> Result<Vec<(i64, u64)>> {
        let mut out: Vec<(i64, u64)> = self
            .partitions_of(&self.names.data)
            .await?
            .into_iter()
            .filter_map(|(name, rows)| Some((name.parse().ok()?, rows)))
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// Drops version partitions whose windows all start before `below` (seconds).
    async fn drop_folded_versions(&self, below: u32) -> Result<u64> {
        let mut dropped = 0;
        for (index, _) in self.version_rows().await? {
            if (index + 1) * DATA_PARTITION_SECONDS <= i64::from(below) {
                // The partition's name is its index (`intDiv` of the window start).
                self.exec(
                    &self
                        .names
                        .drop_partition_sql(&self.names.data, &index.to_string()),
                )
                .await?;
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// Drops folded (and kept) day partitions that end at or before `below_seconds`.
    async fn drop_retained(&self, below_seconds: i64) -> Result<u64> {
        let mut dropped = 0;
        // The folded table's days, and the days of the windows this version kept from the one
        // it took over (none: no such table, no partition listed).
        let kept = format!("{}_kept", self.names.view_q());
        for table in [&self.names.final_rows, &kept] {
            for (day, _) in self.partitions_of(table).await? {
                if day_end_seconds(&day).is_some_and(|end| end <= below_seconds) {
                    self.exec(&self.names.drop_partition_sql(table, &day))
                        .await?;
                    dropped += 1;
                }
            }
        }
        Ok(dropped)
    }

    /// One fold step (see the module docs) for a job of `partitions` source partitions (or
    /// more, if more are registered), under `lease`. Safe to rerun after a crash at any point;
    /// an earlier holder's step cannot land after it. `watch_insert`: report
    /// [`FoldStep::Inserting`] once the server runs the step's insert (for crash tests).
    pub async fn fold(
        &self,
        lease: &ReadLease,
        rules: FoldRules,
        partitions: usize,
        fault: impl Fn(FoldStep),
        watch_insert: bool,
    ) -> Result<FoldOutcome> {
        self.settle_failed(lease).await?;
        // Counted before the watermarks are read: the log below is refused if it grew since.
        let registered = self.registered_partitions().await?;
        let logged = self.frontier().await?;
        let repaired = self.drop_unlogged_folds(lease, logged.seconds).await?;
        let mut outcome = FoldOutcome {
            frontier: logged,
            repaired,
            ..FoldOutcome::default()
        };
        let partitions = partitions.max(registered);
        if let Some(watermark) = self.committed_watermark(logged.seconds, partitions).await?
            && let Ok(allowed) = u32::try_from(rules.frontier_ms(watermark).div_euclid(1000))
            && allowed > logged.seconds
        {
            // The watermarks were read from this replica's commit log: its versions of those
            // batches are here once it synced.
            self.sync_versions().await?;
            let versions = self.version_rows().await?;
            let seconds = step_end(logged.seconds, allowed, &versions, rules.step_rows);
            outcome.behind = seconds < allowed;
            let next = Frontier { seconds };
            let stage = lease.fold_stage();
            self.exec_fenced(
                lease,
                &format!("CREATE TABLE {stage} AS {}", self.names.final_rows),
            )
            .await?;
            let insert = self.names.fold_insert_sql(&stage, logged, seconds);
            self.exec_fenced_watched(lease, &insert, watch_insert, || fault(FoldStep::Inserting))
                .await?;
            fault(FoldStep::Staged);
            let rows: u64 = self
                .fetch_fenced(lease, &format!("SELECT count() FROM {stage}"))
                .await?;
            let days: Vec<u32> = self
                .fetch_all_fenced(
                    lease,
                    &format!("SELECT DISTINCT toUInt32(toYYYYMMDD(window_start)) FROM {stage}"),
                )
                .await?;
            // The repair above left no rows at or after the logged frontier: these are all new.
            for day in days {
                self.exec_fenced(lease, &self.names.attach_day_sql(day, &stage))
                    .await?;
            }
            fault(FoldStep::Inserted);
            self.exec_fenced(
                lease,
                &self
                    .names
                    .fold_log_sql(next, rows, &lease.lease_table(), registered),
            )
            .await?;
            self.exec_fenced(lease, &format!("DROP TABLE IF EXISTS {stage}"))
                .await?;
            if self.frontier().await? == next {
                outcome.frontier = next;
                outcome.folded_rows = rows;
                fault(FoldStep::Logged);
            } else {
                // A partition was registered since the count: the folded rows stay unlogged
                // (the next step removes them) and the frontier waits for its watermark.
                outcome.behind = true;
            }
        }
        // Another folder got further meanwhile (an earlier holder's step that landed before
        // this lease's fence): its view stays, and this step stops here.
        let newest = self.frontier().await?;
        if newest.seconds > outcome.frontier.seconds {
            outcome.frontier = newest;
            return Ok(outcome);
        }
        // Install unconditionally: the logged frontier may not be installed yet (a step that
        // died after logging), and reinstalling the same one is harmless.
        self.install_view(lease, outcome.frontier).await?;
        if outcome.frontier != logged {
            fault(FoldStep::Installed);
        }
        let settled = self.droppable_below(self.note_installed(outcome.frontier));
        outcome.dropped_partitions = self.drop_folded_versions(settled.seconds).await?;
        if let Some(retention) = rules.retention_ms {
            let below = i64::from(outcome.frontier.seconds) - retention.div_euclid(1000);
            outcome.dropped_partitions += self.drop_retained(below).await?;
        }
        Ok(outcome)
    }

    /// Installs the view of the logged frontier under `lease` (a new holder's first act, also
    /// replacing a view of an earlier layout).
    pub async fn install_logged_view(&self, lease: &ReadLease) -> Result<Frontier> {
        let frontier = self.frontier().await?;
        self.install_view(lease, frontier).await?;
        self.note_installed(frontier);
        Ok(frontier)
    }
}

/// Where a step from the `logged` frontier ends: at the frontier the watermarks allow, or
/// earlier, once it holds about `step_rows` versions: whole version partitions (of
/// `partitions`, (index, rows) in order), or, when the first is larger than that, a share of
/// its span at its mean rate. Every window before either end is final, so the view is exact
/// wherever a step ends; and it ends past `logged`.
fn step_end(logged: u32, allowed: u32, partitions: &[(i64, u64)], step_rows: u64) -> u32 {
    let clamp = |seconds: i64| u32::try_from(seconds).map_or(allowed, |s| s.min(allowed));
    let mut rows = 0u64;
    for &(index, n) in partitions {
        let start = index.saturating_mul(DATA_PARTITION_SECONDS);
        let end = start.saturating_add(DATA_PARTITION_SECONDS);
        if end <= i64::from(logged) {
            continue; // folded already, its versions not dropped yet
        }
        if start >= i64::from(allowed) {
            break;
        }
        if rows > 0 && rows.saturating_add(n) > step_rows {
            // Past `logged`: an earlier partition ended after it, where this one starts.
            return clamp(start);
        }
        if rows == 0 && n > step_rows {
            let from = start.max(i64::from(logged));
            let share = i128::from(DATA_PARTITION_SECONDS) * i128::from(step_rows) / i128::from(n);
            let span = i64::try_from(share)
                .unwrap_or(DATA_PARTITION_SECONDS)
                .max(1);
            return clamp(from.saturating_add(span).min(end));
        }
        rows = rows.saturating_add(n);
    }
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frontier_is_the_end_of_the_last_final_window() {
        let rules = FoldRules {
            window_size_ms: 60_000,
            window_slide_ms: 60_000,
            allowed_lateness_ms: 60_000,
            retention_ms: None,
            step_rows: FOLD_STEP_ROWS,
        };
        // Watermark 10:03:30 with 1 min lateness: windows ending by 10:02:30 are final, i.e.
        // every window starting before 10:02 (the one ending 10:02 is the last).
        let wm = 10 * 3_600_000 + 3 * 60_000 + 30_000;
        assert_eq!(rules.frontier_ms(wm), 10 * 3_600_000 + 2 * 60_000);
        // Exactly on the boundary: end + lateness == watermark is final (same rule as `late`).
        let wm = 10 * 3_600_000 + 3 * 60_000;
        assert_eq!(rules.frontier_ms(wm), 10 * 3_600_000 + 2 * 60_000);
        assert_eq!(rules.frontier_ms(wm - 1), 10 * 3_600_000 + 60_000);
    }

    /// A 5-minute window sliding by a minute is final only when its end is: the window
    /// starting at 09:58 ends at 10:03 and is still open at a watermark of 10:03:59 with a
    /// minute's lateness, so the frontier is 09:58 (every window starting before it ends by
    /// 10:02), not the 10:02 a tumbling minute would give.
    #[test]
    fn the_frontier_of_hopping_windows_trails_by_the_size() {
        let rules = FoldRules {
            window_size_ms: 300_000,
            window_slide_ms: 60_000,
            allowed_lateness_ms: 60_000,
            retention_ms: None,
            step_rows: FOLD_STEP_ROWS,
        };
        let h = 10 * 3_600_000;
        assert_eq!(rules.frontier_ms(h + 3 * 60_000 + 59_999), h - 2 * 60_000);
        // At 10:04 the 09:58 window's end plus lateness is reached: it is final too.
        assert_eq!(rules.frontier_ms(h + 4 * 60_000), h - 60_000);
        // Whatever the watermark, no window at or after the frontier is final, and the one
        // before it is.
        for wm in (h..h + 600_000).step_by(7_919) {
            let f = rules.frontier_ms(wm);
            let is_final = |s: i64| s + 300_000 + 60_000 <= wm;
            assert!(
                !is_final(f) && is_final(f - 60_000),
                "watermark {wm}: frontier {f}"
            );
        }
    }

    #[test]
    fn a_step_folds_a_bounded_number_of_versions() {
        let p = DATA_PARTITION_SECONDS;
        let end = |i: i64| u32::try_from(i * p).unwrap();
        let half = FOLD_STEP_ROWS / 2;
        // Far behind: whole partitions up to the bound, from the one holding the frontier.
        let parts = [(3, half), (4, half), (5, half), (6, 10)];
        assert_eq!(
            step_end(end(3) + 60, end(100), &parts, FOLD_STEP_ROWS),
            end(5)
        );
        // Partitions wholly below the frontier (folded, not dropped yet) do not count.
        assert_eq!(step_end(end(4), end(100), &parts, FOLD_STEP_ROWS), end(6));
        // A partition over the bound is folded a share at a time, each step moving on.
        let big = [(3, 3 * FOLD_STEP_ROWS), (4, 1)];
        assert_eq!(
            step_end(end(3), end(100), &big, FOLD_STEP_ROWS),
            end(3) + 200
        );
        assert_eq!(
            step_end(end(3) + 200, end(100), &big, FOLD_STEP_ROWS),
            end(3) + 400
        );
        assert_eq!(
            step_end(end(3) + 500, end(100), &big, FOLD_STEP_ROWS),
            end(4)
        );
        let huge = [(3, u64::MAX)];
        assert_eq!(step_end(end(3), end(100), &huge, 1), end(3) + 1);
        // Caught up: the allowed frontier, inside a partition or past every version.
        assert_eq!(
            step_end(end(3), end(3) + 60, &parts, FOLD_STEP_ROWS),
            end(3) + 60
        );
        assert_eq!(step_end(end(7), end(9), &parts, FOLD_STEP_ROWS), end(9));
        assert_eq!(step_end(0, end(9), &[], FOLD_STEP_ROWS), end(9));
        // Partitions at or after the allowed frontier do not hold the step back.
        let late = [(3, 10), (8, 5 * FOLD_STEP_ROWS)];
        assert_eq!(step_end(end(3), end(8), &late, FOLD_STEP_ROWS), end(8));
    }
}
