//! The read side's lease and fence: one holder at a time publishes and folds, and ClickHouse
//! itself refuses the statements of any earlier holder.
//!
//! A holder is a *generation*: a database of its own, `<database>__<table>__read<G>`, created
//! with a plain `CREATE DATABASE` (the server's compare-and-set: of two claimants of `G` one
//! fails). Every statement that changes what readers see names a table of that database: folds
//! and publishes build their rows in its stage tables and move them with `ATTACH PARTITION … FROM`
//! or swap the tables in whole, the fold log is appended with `INSERT … SELECT … FROM` its lease table,
//! and the view is built in it and swapped in. A new generation drops every older one's database
//! (after killing their statements still running on the server, found by query id), so from then
//! on an earlier holder (a process killed mid-step whose `INSERT` the server finishes, a worker
//! paused past its lease, a step retried after a timeout) can neither create, fill nor move
//! anything: its statements fail with an unknown database, and it steps down.
//!
//! Liveness: the holder beats into its database; a watcher that sees no beat for the lease
//! duration claims the next generation. Generations are logged in `<table>_read_side`, so their
//! numbers only grow even after every database is dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Result, SinkError};
use crate::schema::{self, TableNames};
use crate::sink::ClickHouseSink;

/// How long the fence waits for the statements of earlier generations to end once killed.
const FENCE_WAIT: Duration = Duration::from_secs(30);

/// A generation of the job's read side, held by this process.
#[derive(Debug)]
pub struct ReadLease {
    pub generation: u64,
    pub holder: String,
    /// The generation's database, qualified names of its tables are `<database>.<name>`.
    database: String,
    /// `tally-read/<db>.<table>/`: every read-side statement of the job has a query id under it.
    job_prefix: String,
    statements: AtomicU64,
    /// The stage table of publishes: a new one after a failure, so that an insert still running
    /// on the server for the failed publish cannot mix into the next one.
    publish_stage: AtomicU64,
    /// A statement failed: one may still run on the server; the next step kills it first.
    dirty: AtomicBool,
}

/// Who holds the read side, as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReadSideHolder {
    /// No generation's database exists: the read side is free.
    Vacant,
    /// Generation `generation` exists; `beat_age` is the seconds since its last beat by the
    /// server's clock (`None`: it has not beaten yet, being claimed just now).
    Held {
        generation: u64,
        holder: Option<String>,
        beat_age: Option<u32>,
    },
}

#[derive(Debug, Deserialize)]
struct NameRow {
    name: String,
}

impl ReadLease {
    /// A table of this generation's database.
    pub fn table(&self, name: &str) -> String {
        format!("{}.{name}", self.database)
    }

    pub fn database(&self) -> &str {
        &self.database
    }

    fn query_id(&self) -> String {
        let n = self.statements.fetch_add(1, Ordering::Relaxed);
        format!("{}g{}/{n}", self.job_prefix, self.generation)
    }

    fn own_prefix(&self) -> String {
        format!("{}g{}/", self.job_prefix, self.generation)
    }

    /// The stage table of the next publish.
    pub(crate) fn publish_stage(&self) -> String {
        self.table(&format!(
            "live_{}",
            self.publish_stage.load(Ordering::Relaxed)
        ))
    }

    /// A fresh stage table for a fold step.
    pub(crate) fn fold_stage(&self) -> String {
        self.table(&format!(
            "fold_{}",
            self.statements.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Where repairs rebuild a day of the folded table.
    pub(crate) fn repair_stage(&self) -> String {
        self.table("repair")
    }

    /// The lease table: one row, the generation's; `INSERT … SELECT … FROM` it is fenced.
    pub(crate) fn lease_table(&self) -> String {
        self.table("lease")
    }
}

impl TableNames {
    /// The job's identity: who writes these tables, by which rules.
    pub fn identity(&self) -> String {
        format!("{}.{}_job", self.database, self.view)
    }

    /// The generations' log: one row per claim and release.
    pub fn read_side_log(&self) -> String {
        format!("{}.{}_read_side", self.database, self.view)
    }

    /// Prefix of the generations' databases.
    pub(crate) fn generation_prefix(&self) -> String {
        format!("{}__{}__read", self.database, self.view)
    }

    pub fn generation_database(&self, generation: u64) -> String {
        format!("{}{generation}", self.generation_prefix())
    }

    /// Prefix of every read-side statement's query id of this job.
    pub fn read_query_prefix(&self) -> String {
        format!("tally-read/{}.{}/", self.database, self.view)
    }

    pub(crate) fn create_read_side_log(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY (generation, at)",
            self.read_side_log(),
            schema::columns_sql(schema::READ_SIDE_COLUMNS)
        )
    }

    /// Existing generations' databases.
    pub(crate) fn generations_sql(&self) -> String {
        format!(
            "SELECT name FROM system.databases WHERE startsWith(name, '{}')",
            self.generation_prefix()
        )
    }

    /// The statements that claim generation `g` once its database exists.
    pub(crate) fn claim_sql(&self, generation: u64, holder: &str) -> Vec<String> {
        let db = self.generation_database(generation);
        let holder = quote(holder);
        vec![
            format!(
                "CREATE TABLE {db}.lease (generation UInt64, holder String, claimed_at DateTime) ENGINE = MergeTree ORDER BY generation"
            ),
            format!("INSERT INTO {db}.lease SELECT {generation}, {holder}, now()"),
            // One row per key once merged: the newest beat.
            format!(
                "CREATE TABLE {db}.beats (key UInt8, at DateTime) ENGINE = ReplacingMergeTree(at) ORDER BY key"
            ),
            self.beat_sql(generation),
            format!(
                "INSERT INTO {} SELECT generation, holder, 'claimed', now() FROM {db}.lease",
                self.read_side_log()
            ),
        ]
    }

    pub(crate) fn beat_sql(&self, generation: u64) -> String {
        format!(
            "INSERT INTO {}.beats SELECT 0, now()",
            self.generation_database(generation)
        )
    }

    /// (seconds since the last beat by the server's clock, beats) of generation `g`.
    pub(crate) fn beat_age_sql(&self, generation: u64) -> String {
        format!(
            "SELECT toUInt32(now()) - toUInt32(max(at)), count() FROM {}.beats",
            self.generation_database(generation)
        )
    }

    pub(crate) fn holder_sql(&self, generation: u64) -> String {
        format!(
            "SELECT holder FROM {}.lease LIMIT 1",
            self.generation_database(generation)
        )
    }

    /// Kills the read-side statements of every generation but `keep`, waiting for them.
    pub(crate) fn kill_others_sql(&self, keep: u64) -> String {
        format!("KILL QUERY WHERE {} SYNC", self.others_running_filter(keep))
    }

    fn others_running_filter(&self, keep: u64) -> String {
        let job = self.read_query_prefix();
        format!("startsWith(query_id, '{job}') AND NOT startsWith(query_id, '{job}g{keep}/')")
    }

    pub(crate) fn others_running_sql(&self, keep: u64) -> String {
        format!(
            "SELECT count() FROM system.processes WHERE {}",
            self.others_running_filter(keep)
        )
    }

    /// Leftovers of the layout before generations: its shared stage tables and view swap names.
    pub(crate) fn legacy_read_tables_sql(&self) -> String {
        format!(
            "SELECT name FROM system.tables WHERE database = '{db}' AND (startsWith(name, '{v}_live_stage_') OR name IN ('{v}_fold_stage', '{v}__next', '{v}__old'))",
            db = self.database,
            v = self.view
        )
    }

    pub(crate) fn release_sql(&self, generation: u64) -> Vec<String> {
        let db = self.generation_database(generation);
        vec![
            format!(
                "INSERT INTO {} SELECT generation, holder, 'released', now() FROM {db}.lease",
                self.read_side_log()
            ),
            format!("DROP DATABASE IF EXISTS {db}"),
        ]
    }
}

use crate::schema::quote;

impl ClickHouseSink {
    /// The job identity recorded beside the tables (see `tally::identity`), recording
    /// `identity` if none is: the first worker's `CREATE TABLE … AS SELECT` wins. `None`: the
    /// table exists but its row is not written yet.
    pub async fn recorded_identity(&self, identity: &str) -> Result<Option<String>> {
        let table = self.names.identity();
        // On a cluster replicated, so that every replica holds the first worker's row.
        let create = format!(
            "CREATE TABLE {table} ENGINE = {} ORDER BY at AS SELECT {} AS identity, now() AS at",
            self.names.truth_engine(&table),
            quote(identity)
        );
        if let Err(e) = self.exec(&create).await {
            // 57: the table exists already (another worker's, or an earlier start's).
            if !e.to_string().contains("Code: 57") {
                return Err(e);
            }
        }
        self.client
            .query(&format!("SELECT identity FROM {table} ORDER BY at LIMIT 1"))
            .fetch_optional()
            .await
            .map_err(self.err("reading the job's identity"))
    }

    /// Drops the identity recorded beside the tables (`tally retire`).
    pub async fn forget_identity(&self) -> Result<()> {
        // On a current server a replicated table's coordinator path outlives a plain DROP by
        // minutes, and the next job's identity could not be recorded under it meanwhile.
        let sync = if self.names.replicated && self.atomic_database().await? {
            " SYNC"
        } else {
            ""
        };
        self.exec(&format!(
            "DROP TABLE IF EXISTS {}{sync}",
            self.names.identity()
        ))
        .await
    }

    /// Runs one read-side statement under `lease`: tagged with its query id (so that a later
    /// generation can kill it), and failing with [`SinkError::Fenced`] once a later generation
    /// has dropped the lease's database.
    pub(crate) async fn exec_fenced(&self, lease: &ReadLease, sql: &str) -> Result<()> {
        let result = self
            .client
            .query(sql)
            .with_setting("query_id", lease.query_id())
            .execute()
            .await;
        result.map_err(|source| self.fenced_error(lease, format!("executing {sql}"), source))
    }

    /// [`exec_fenced`](Self::exec_fenced), calling `running` once the server runs the statement
    /// if `watch` (polled in `system.processes` by its query id): crash tests kill the process
    /// there, as a crash in the middle of a long insert would.
    pub(crate) async fn exec_fenced_watched(
        &self,
        lease: &ReadLease,
        sql: &str,
        watch: bool,
        running: impl Fn(),
    ) -> Result<()> {
        if !watch {
            return self.exec_fenced(lease, sql).await;
        }
        let id = lease.query_id();
        let statement = self
            .client
            .query(sql)
            .with_setting("query_id", id.clone())
            .execute();
        tokio::pin!(statement);
        let poll = format!("SELECT count() FROM system.processes WHERE query_id = '{id}'");
        let mut ticks = tokio::time::interval(Duration::from_millis(10));
        loop {
            tokio::select! {
                result = &mut statement => {
                    return result.map_err(|source| self.fenced_error(lease, format!("executing {sql}"), source));
                }
                _ = ticks.tick() => {
                    let seen: u64 = self.fetch(&poll, "reading running statements").await?;
                    if seen > 0 {
                        running();
                    }
                }
            }
        }
    }

    /// Rows of a read under `lease` (see [`exec_fenced`](Self::exec_fenced)).
    pub(crate) async fn fetch_all_fenced<T>(&self, lease: &ReadLease, sql: &str) -> Result<Vec<T>>
    where
        T: clickhouse::Row + for<'b> clickhouse::RowRead<Value<'b> = T> + 'static,
    {
        let result = self
            .client
            .query(sql)
            .with_setting("query_id", lease.query_id())
            .fetch_all::<T>()
            .await;
        result.map_err(|source| self.fenced_error(lease, format!("reading {sql}"), source))
    }

    /// A one-row read under `lease` (see [`exec_fenced`](Self::exec_fenced)).
    pub(crate) async fn fetch_fenced<T>(&self, lease: &ReadLease, sql: &str) -> Result<T>
    where
        T: clickhouse::Row + for<'b> clickhouse::RowRead<Value<'b> = T> + 'static,
    {
        self.fetch_all_fenced(lease, sql)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| SinkError::Schema(format!("{sql}: no row")))
    }

    fn fenced_error(
        &self,
        lease: &ReadLease,
        context: String,
        source: clickhouse::error::Error,
    ) -> SinkError {
        lease.dirty.store(true, Ordering::Relaxed);
        let text = source.to_string();
        // 81: unknown database, 60: unknown table (a server that drops tables first).
        let gone = text.contains(&lease.database)
            && (text.contains("Code: 81") || text.contains("Code: 60"));
        if gone {
            return SinkError::Fenced {
                generation: lease.generation,
                detail: format!("{context}: {text}"),
            };
        }
        SinkError::Server {
            url: self.url.clone(),
            context,
            source,
        }
    }

    /// Before a step under `lease`: after a failure, kills this generation's statements still
    /// running on the server (a timed-out insert goes on there) and starts publishes in a new
    /// stage table, so nothing of the failed attempt lands in the next.
    pub(crate) async fn settle_failed(&self, lease: &ReadLease) -> Result<()> {
        if !lease.dirty.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        let own = lease.own_prefix();
        self.exec(&format!(
            "KILL QUERY WHERE startsWith(query_id, '{own}') SYNC"
        ))
        .await?;
        let old = lease.publish_stage();
        lease.publish_stage.fetch_add(1, Ordering::Relaxed);
        self.exec_fenced(lease, &format!("DROP TABLE IF EXISTS {old}"))
            .await
    }

    /// Who holds the job's read side now.
    pub async fn read_side_holder(&self) -> Result<ReadSideHolder> {
        let Some(generation) = self.generations().await?.into_iter().max() else {
            return Ok(ReadSideHolder::Vacant);
        };
        // Tables missing: the generation is being claimed, or was just dropped.
        let beat: Option<(u32, u64)> = self
            .client
            .query(&self.names.beat_age_sql(generation))
            .fetch_one()
            .await
            .ok();
        let holder: Option<String> = self
            .client
            .query(&self.names.holder_sql(generation))
            .fetch_optional()
            .await
            .ok()
            .flatten();
        Ok(ReadSideHolder::Held {
            generation,
            holder,
            beat_age: beat.and_then(|(age, n)| (n > 0).then_some(age)),
        })
    }

    async fn generations(&self) -> Result<Vec<u64>> {
        let prefix = self.names.generation_prefix();
        let rows: Vec<NameRow> = schema::json_rows(
            &self.client,
            &self.names.generations_sql(),
            &self.url,
            "listing the read side's generations",
        )
        .await?;
        Ok(rows
            .iter()
            .filter_map(|r| r.name.strip_prefix(&prefix)?.parse().ok())
            .collect())
    }

    /// Claims the next generation of the read side for `holder` and fences every earlier one.
    /// `None`: another claimant got that generation first.
    pub async fn claim_read_side(&self, holder: &str) -> Result<Option<ReadLease>> {
        let existing = self.generations().await?;
        let logged: u64 = self
            .client
            .query(&format!(
                "SELECT max(generation) FROM {}",
                self.names.read_side_log()
            ))
            .fetch_one()
            .await
            .map_err(self.err("reading the read side's generations"))?;
        let generation = existing.iter().copied().max().unwrap_or(0).max(logged) + 1;
        let database = self.names.generation_database(generation);
        if let Err(e) = self.exec(&format!("CREATE DATABASE {database}")).await {
            if e.to_string().contains("Code: 82") {
                return Ok(None); // already exists: another claimant's
            }
            return Err(e);
        }
        for sql in self.names.claim_sql(generation, holder) {
            self.exec(&sql).await?;
        }
        let lease = ReadLease {
            generation,
            holder: holder.to_owned(),
            database,
            job_prefix: self.names.read_query_prefix(),
            statements: AtomicU64::new(0),
            publish_stage: AtomicU64::new(0),
            dirty: AtomicBool::new(false),
        };
        self.fence_earlier(&lease, &existing).await?;
        Ok(Some(lease))
    }

    /// Drops every earlier generation's database and waits until none of their statements
    /// runs; removes the stage tables of the layout before generations.
    async fn fence_earlier(&self, lease: &ReadLease, existing: &[u64]) -> Result<()> {
        let keep = lease.generation;
        // Killed first, so that a long insert does not hold up the drop (which waits for it).
        self.exec(&self.names.kill_others_sql(keep)).await?;
        for &g in existing.iter().filter(|&&g| g < keep) {
            self.exec(&format!(
                "DROP DATABASE IF EXISTS {}",
                self.names.generation_database(g)
            ))
            .await?;
        }
        // A statement that resolved its tables before the drop may still finish (servers with
        // Atomic databases drop tables lazily): none may run when this generation starts.
        let started = std::time::Instant::now();
        loop {
            self.exec(&self.names.kill_others_sql(keep)).await?;
            let running: u64 = self
                .fetch(
                    &self.names.others_running_sql(keep),
                    "reading running statements",
                )
                .await?;
            if running == 0 {
                break;
            }
            if started.elapsed() > FENCE_WAIT {
                return Err(SinkError::Refused(format!(
                    "{running} statements of an earlier read side still run on the server after {FENCE_WAIT:?} and KILL QUERY: see system.processes, query ids starting {}",
                    self.names.read_query_prefix()
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let legacy: Vec<NameRow> = schema::json_rows(
            &self.client,
            &self.names.legacy_read_tables_sql(),
            &self.url,
            "listing stage tables of the earlier layout",
        )
        .await?;
        for t in legacy {
            self.exec(&format!(
                "DROP TABLE IF EXISTS {}.{}",
                self.names.database, t.name
            ))
            .await?;
        }
        Ok(())
    }

    /// One beat of `lease`: the read side's holder is alive.
    pub async fn beat(&self, lease: &ReadLease) -> Result<()> {
        self.exec_fenced(lease, &self.names.beat_sql(lease.generation))
            .await
    }

    /// Gives the read side up: the next watcher claims it at once.
    pub async fn release_read_side(&self, lease: &ReadLease) -> Result<()> {
        let [log, drop] = <[String; 2]>::try_from(self.names.release_sql(lease.generation))
            .map_err(|_| SinkError::Schema("release statements".into()))?;
        self.exec_fenced(lease, &log).await?;
        self.exec(&drop).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_generation_has_its_own_database_and_query_ids() {
        let names = TableNames::new("tally", "r").unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(names.generation_database(7), "tally__r__read7");
        let claim = names.claim_sql(7, "host:1:/var/lib/it's").join("; ");
        assert!(
            claim.contains("CREATE TABLE tally__r__read7.lease"),
            "{claim}"
        );
        assert!(claim.contains("'host:1:/var/lib/it\\'s'"), "{claim}");
        // The log row comes from the generation's own table: a fenced claimant logs nothing.
        assert!(
            claim.contains("INSERT INTO tally.r_read_side SELECT generation, holder, 'claimed', now() FROM tally__r__read7.lease"),
            "{claim}"
        );
        let kill = names.kill_others_sql(7);
        assert_eq!(
            kill,
            "KILL QUERY WHERE startsWith(query_id, 'tally-read/tally.r/') AND NOT startsWith(query_id, 'tally-read/tally.r/g7/') SYNC"
        );
    }
}
