//! `tally loadgen` for a change job: changes made through SQL on the real source table, for
//! Debezium to capture. Rows are inserted, updated (the value summed, the filtered field, the
//! group key, the event time moved across a window), deleted, given a new primary key, and the
//! whole table is read again (an incremental snapshot asked for through Debezium's signal
//! table); several changes share a transaction now and then. Only rows whose windows are still
//! open for the job (by its allowed lateness) are changed, so no change is late, and the table
//! itself is the ground truth: `tally reconcile --source` compares the view with it. The
//! manifest counts the changes made, which the topic must hold once each (`verify`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tally_core::declare::{FieldKind, Job, TimeUnit, Value, format_decimal};
use tally_core::time::format_ms;
use tokio_postgres::Client;

use super::SourceDatabase;
use crate::loadgen::{filtered_value, key_value, random_value};
use tally_runtime::config::Config;

/// What to do to the table.
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    pub seed: u64,
    /// Rows inserted before the changes (with `changes = 0`: a table for the initial snapshot).
    pub initial_rows: u64,
    /// Statements after them (each changes one row; a key change is a delete and an insert).
    pub changes: u64,
    /// Statements per second; `None` as fast as the database takes them.
    pub rate: Option<f64>,
    /// Values of the first group-by key.
    pub keys: u32,
    /// Event time between consecutive inserts (ms): the table's clock.
    pub step_ms: i64,
    /// New snapshots asked for, spread over the changes.
    pub snapshots: u32,
    /// `REPLICA IDENTITY FULL` (Debezium sends the old row too) rather than the default (the
    /// key only).
    pub full_identity: bool,
}

/// The changes made, added up over every run that wrote the manifest.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkloadManifest {
    pub inserts: u64,
    pub updates: u64,
    pub deletes: u64,
    /// Primary keys changed: Debezium sends a delete and a create for each.
    pub key_changes: u64,
    pub snapshots: u64,
    pub transactions: u64,
    /// Rows in the table after the last run.
    pub rows: u64,
    /// `pg_current_wal_lsn()` after the last run.
    pub last_lsn: String,
}

impl WorkloadManifest {
    /// The change events the runs made Debezium send, snapshot reads and tombstones apart.
    pub fn change_events(&self) -> u64 {
        self.inserts + self.updates + self.deletes + 2 * self.key_changes
    }

    pub fn load(path: &Path) -> Result<WorkloadManifest> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

/// A row the workload may change: its key and event time.
#[derive(Debug, Clone, Copy)]
struct Live {
    time_ms: i64,
}

struct Workload<'a> {
    job: &'a Job,
    table: String,
    /// The one integer primary key column.
    pk: String,
    rng: ChaCha8Rng,
    spec: &'a WorkloadSpec,
    live: BTreeMap<i64, Live>,
    next_pk: i64,
    /// The newest event time in the table: the job's watermark is at most this.
    clock_ms: i64,
    /// Rows whose windows end (with the allowed lateness) after this are open for the job.
    horizon_ms: i64,
    allowed_lateness_ms: i64,
    manifest: WorkloadManifest,
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn quote_text(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The primary key column, if the declaration has the one integer key the workload numbers.
fn integer_key(job: &Job) -> Result<usize> {
    let Some(changes) = &job.changes else {
        bail!("loadgen makes changes for a job of change events only");
    };
    match changes.primary_key.as_slice() {
        [k] if job.fields[*k].kind == FieldKind::Integer => Ok(*k),
        _ => bail!(
            "loadgen numbers rows by one integer primary key; this declaration's key is {:?}",
            changes
                .primary_key
                .iter()
                .map(|&k| job.fields[k].name.as_str())
                .collect::<Vec<_>>()
        ),
    }
}

/// The column a field is (a change job's fields are columns).
fn column(job: &Job, i: usize) -> Result<String> {
    match job.fields[i].path.as_slice() {
        [name] => Ok(name.clone()),
        path => bail!(
            "field {:?} is at path {}: loadgen makes tables of flat rows",
            job.fields[i].name,
            path.join(".")
        ),
    }
}

/// The table's DDL from the declaration: a column per field by its type (timestamps as
/// `timestamptz`, or `timestamp` for microseconds), the primary key.
pub fn create_table_sql(job: &Job, table: &str) -> Result<String> {
    let pk = integer_key(job)?;
    let mut columns = Vec::new();
    for (i, f) in job.fields.iter().enumerate() {
        let ty = match f.kind {
            FieldKind::String => "text".to_owned(),
            FieldKind::Integer => "bigint".to_owned(),
            FieldKind::Decimal => format!("numeric(18, {})", f.scale),
            FieldKind::Float => "double precision".to_owned(),
            FieldKind::Boolean => "boolean".to_owned(),
            FieldKind::Timestamp if f.unit == TimeUnit::Micros => "timestamp".to_owned(),
            FieldKind::Timestamp => "timestamptz".to_owned(),
        };
        let key = if i == pk { " PRIMARY KEY" } else { " NOT NULL" };
        columns.push(format!("{} {ty}{key}", quote_ident(&column(job, i)?)));
    }
    Ok(format!(
        "CREATE TABLE IF NOT EXISTS {table} ({})",
        columns.join(", ")
    ))
}

impl Workload<'_> {
    fn open_until(&self, time_ms: i64) -> bool {
        let w = self.job.windows;
        let start = time_ms - time_ms.rem_euclid(w.slide_ms) - (w.size_ms - w.slide_ms);
        start + w.size_ms > self.horizon_ms
    }

    /// A value of field `i` for a row at `time_ms`, passing its filter test unless `miss`.
    fn value(&mut self, i: usize, time_ms: i64, miss: bool) -> Value {
        let job = self.job;
        let field = &job.fields[i];
        let any = if i == job.event_time {
            return Value::Time(time_ms);
        } else if let Some(k) = job.keys.iter().position(|&key| key == i) {
            let index = if k == 0 {
                self.rng.random_range(0..self.spec.keys.max(1))
            } else {
                self.rng.random_range(0..3)
            };
            key_value(field.kind, &field.name, field.scale, index)
        } else {
            random_value(field.kind, field.scale, time_ms, &mut self.rng)
        };
        match job.filter.iter().find(|c| c.field == i).map(|c| &c.test) {
            // Every column is NOT NULL: a test met by absence is met by a value instead.
            Some(test) => filtered_value(test, !miss, any.clone(), &mut self.rng).unwrap_or(any),
            None => any,
        }
    }

    fn literal(&self, i: usize, value: &Value) -> String {
        let field = &self.job.fields[i];
        match (value, field.unit) {
            (Value::Str(s), _) => quote_text(s),
            (Value::Int(n), _) => n.to_string(),
            (Value::Decimal(units), _) => format_decimal(i128::from(*units), field.scale),
            (Value::Float(x), _) => format!("{x:?}"),
            (Value::Bool(b), _) => b.to_string(),
            (Value::Time(ms), TimeUnit::Micros) => {
                format!(
                    "{}::timestamp",
                    quote_text(&format_ms(*ms).replace('Z', ""))
                )
            }
            (Value::Time(ms), _) => format!("{}::timestamptz", quote_text(&format_ms(*ms))),
        }
    }

    /// A new row's values, each field filtered or not as chance has it (one in ten misses).
    fn row(&mut self, pk: i64, time_ms: i64) -> Vec<String> {
        let miss = self.rng.random_bool(0.1);
        let tested: Vec<usize> = self.job.filter.iter().map(|c| c.field).collect();
        let victim = (!tested.is_empty()).then(|| tested[self.rng.random_range(0..tested.len())]);
        (0..self.job.fields.len())
            .map(|i| {
                if i == self.pk_index() {
                    pk.to_string()
                } else {
                    let v = self.value(i, time_ms, miss && victim == Some(i));
                    self.literal(i, &v)
                }
            })
            .collect()
    }

    fn pk_index(&self) -> usize {
        self.job
            .changes
            .as_ref()
            .and_then(|c| c.primary_key.first().copied())
            .unwrap_or(usize::MAX)
    }

    fn insert(&mut self) -> Result<String> {
        let pk = self.next_pk;
        self.next_pk += 1;
        self.clock_ms += self.spec.step_ms;
        let t = self.clock_ms;
        self.horizon_ms = self.horizon_ms.max(self.horizon_at(t));
        let values = self.row(pk, t);
        let columns: Vec<String> = (0..self.job.fields.len())
            .map(|i| column(self.job, i).map(|c| quote_ident(&c)))
            .collect::<Result<_>>()?;
        self.live.insert(pk, Live { time_ms: t });
        self.manifest.inserts += 1;
        Ok(format!(
            "INSERT INTO {} ({}) VALUES ({})",
            self.table,
            columns.join(", "),
            values.join(", ")
        ))
    }

    /// The oldest event time still open for the job once the table's newest is `clock_ms`: the
    /// watermark can reach `clock_ms`; a window is closed once its end plus the lateness is at
    /// or below it. A margin of one window keeps the workload clear of the edge.
    fn horizon_at(&self, clock_ms: i64) -> i64 {
        clock_ms - self.allowed_lateness_ms + self.job.windows.size_ms
    }

    /// A row still open for the job, at random.
    fn open_row(&mut self) -> Option<(i64, Live)> {
        for _ in 0..16 {
            let n = self.live.len();
            if n == 0 {
                return None;
            }
            // Recent rows are likelier: pick among the newest quarter most of the time.
            let from = if self.rng.random_bool(0.8) {
                n - n.div_ceil(4)
            } else {
                0
            };
            let at = self.rng.random_range(from..n);
            let (&pk, &live) = self.live.iter().nth(at)?;
            if self.open_until(live.time_ms) {
                return Some((pk, live));
            }
        }
        None
    }

    fn update(&mut self) -> Result<Option<String>> {
        let Some((pk, live)) = self.open_row() else {
            return Ok(None);
        };
        let job = self.job;
        // What changes: the summed value, the filtered field, the key, or the time moved a
        // window on (or back, while it stays open and not past the clock).
        let choices: Vec<usize> = (0..job.fields.len())
            .filter(|&i| i != self.pk_index())
            .collect();
        let i = choices[self.rng.random_range(0..choices.len())];
        let (value, time_ms) = if i == job.event_time {
            let size = job.windows.size_ms;
            let later = live.time_ms + size;
            let earlier = live.time_ms - size;
            let t = if later <= self.clock_ms
                && (self.rng.random_bool(0.5) || !self.open_until(earlier))
            {
                later
            } else if self.open_until(earlier) {
                earlier
            } else {
                live.time_ms
            };
            (Value::Time(t), t)
        } else {
            let miss = self.rng.random_bool(0.15);
            (self.value(i, live.time_ms, miss), live.time_ms)
        };
        let literal = self.literal(i, &value);
        self.live.insert(pk, Live { time_ms });
        self.manifest.updates += 1;
        Ok(Some(format!(
            "UPDATE {} SET {} = {literal} WHERE {} = {pk}",
            self.table,
            quote_ident(&column(job, i)?),
            quote_ident(&self.pk)
        )))
    }

    fn delete(&mut self) -> Option<String> {
        let (pk, _) = self.open_row()?;
        self.live.remove(&pk);
        self.manifest.deletes += 1;
        Some(format!(
            "DELETE FROM {} WHERE {} = {pk}",
            self.table,
            quote_ident(&self.pk)
        ))
    }

    fn change_key(&mut self) -> Option<String> {
        let (pk, live) = self.open_row()?;
        let new = self.next_pk;
        self.next_pk += 1;
        self.live.remove(&pk);
        self.live.insert(new, live);
        self.manifest.key_changes += 1;
        Some(format!(
            "UPDATE {} SET {k} = {new} WHERE {k} = {pk}",
            self.table,
            k = quote_ident(&self.pk)
        ))
    }

    /// One statement of the mix; an update, delete or key change of a table with no open row
    /// is an insert instead.
    fn statement(&mut self) -> Result<String> {
        let roll: u32 = self.rng.random_range(0..100);
        let made = match roll {
            0..40 => None,
            40..82 => self.update()?,
            82..97 => self.delete(),
            _ => self.change_key(),
        };
        match made {
            Some(sql) => Ok(sql),
            None => self.insert(),
        }
    }
}

/// A connection that outlives a restart of the database: a transaction cut off by it is made
/// again unless PostgreSQL says it committed (`txid_status`), so that each is made once.
struct Writer<'a> {
    source: &'a SourceDatabase,
    client: Client,
}

/// Whether `e` lost the connection (the server restarting, shutting down, unreachable) rather
/// than refused the statement.
fn connection_lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        None => true,
        Some(code) => {
            let class = &code.code()[..2];
            class == "57" || class == "08"
        }
    }
}

impl Writer<'_> {
    /// Commits `statements` as one transaction, exactly once.
    async fn commit(&mut self, statements: &[String]) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let mut txid = None;
            let outcome = self.try_commit(statements, &mut txid).await;
            let e = match outcome {
                Ok(()) => return Ok(()),
                Err(e) if connection_lost(&e) && Instant::now() < deadline => e,
                Err(e) => {
                    return Err(e).with_context(|| format!("source: {}", statements.join("; ")));
                }
            };
            tracing::warn!(error = %e, "source connection lost; reconnecting");
            self.reconnect(deadline).await?;
            if let Some(txid) = txid {
                let status: Option<String> = self
                    .client
                    .query_one("SELECT txid_status($1)::text", &[&txid])
                    .await
                    .context("source: asking whether a transaction committed")?
                    .get(0);
                if status.as_deref() == Some("committed") {
                    return Ok(());
                }
            }
        }
    }

    async fn try_commit(
        &self,
        statements: &[String],
        txid: &mut Option<i64>,
    ) -> Result<(), tokio_postgres::Error> {
        self.client.batch_execute("BEGIN").await?;
        *txid = Some(
            self.client
                .query_one("SELECT txid_current()", &[])
                .await?
                .get(0),
        );
        for statement in statements {
            self.client.batch_execute(statement).await?;
        }
        self.client.batch_execute("COMMIT").await
    }

    async fn reconnect(&mut self, deadline: Instant) -> Result<()> {
        loop {
            match self.source.connect().await {
                Ok(client) => {
                    self.client = client;
                    return Ok(());
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %format!("{e:#}"), "source not back yet");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Makes `spec`'s changes to the source table of `config` and adds them to the manifest at
/// `manifest_path`.
pub async fn run(
    config: &Config,
    spec: &WorkloadSpec,
    manifest_path: &Path,
) -> Result<WorkloadManifest> {
    let job = config.declared.as_ref();
    let pk_index = integer_key(job)?;
    let source = SourceDatabase::of(config, None)?;
    let client = source.connect().await?;
    prepare(&client, config, job, &source.table, spec).await?;
    let pk = column(job, pk_index)?;
    let time_column = column(job, job.event_time)?;
    // Both timestamp types read as UTC, as Debezium sends them.
    let time_expr = format!(
        "floor(extract(epoch from {}) * 1000)::bigint",
        quote_ident(&time_column)
    );
    // Carry on from what the table holds: its rows, its newest key and time.
    let rows = client
        .query(
            &format!(
                "SELECT {}::bigint, {time_expr} FROM {}",
                quote_ident(&pk),
                source.table
            ),
            &[],
        )
        .await
        .with_context(|| format!("source: reading the rows of {}", source.table))?;
    let mut live = BTreeMap::new();
    for row in rows {
        live.insert(
            row.get::<_, i64>(0),
            Live {
                time_ms: row.get::<_, i64>(1),
            },
        );
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let span = i64::try_from(spec.initial_rows + spec.changes).unwrap_or(i64::MAX / 2);
    let clock_ms = live
        .values()
        .map(|l| l.time_ms)
        .max()
        .unwrap_or(now - span.saturating_mul(spec.step_ms));
    let lateness = config.window.allowed_lateness.0;
    let mut workload = Workload {
        job,
        table: source.table.clone(),
        pk,
        rng: ChaCha8Rng::seed_from_u64(spec.seed ^ (live.len() as u64).rotate_left(17)),
        spec,
        next_pk: live.keys().next_back().map_or(1, |k| k + 1),
        live,
        clock_ms,
        horizon_ms: i64::MIN,
        allowed_lateness_ms: lateness,
        manifest: WorkloadManifest::default(),
    };
    workload.horizon_ms = workload.horizon_at(clock_ms);
    let mut writer = Writer {
        source: &source,
        client,
    };
    for _ in 0..spec.initial_rows {
        let sql = workload.insert()?;
        writer.commit(&[sql]).await?;
    }
    let started = Instant::now();
    let snapshot_every =
        (spec.snapshots > 0).then(|| (spec.changes / (u64::from(spec.snapshots) + 1)).max(1));
    let mut made = 0u64;
    while made < spec.changes {
        // Now and then several changes in one transaction.
        let n = if workload.rng.random_bool(0.15) {
            workload.rng.random_range(2..6)
        } else {
            1
        };
        let n = n.min(spec.changes - made);
        let mut statements = Vec::with_capacity(n as usize);
        for _ in 0..n {
            statements.push(workload.statement()?);
        }
        writer.commit(&statements).await?;
        workload.manifest.transactions += 1;
        let before = made;
        made += n;
        if let Some(every) = snapshot_every
            && before / every != made / every
            && workload.manifest.snapshots < u64::from(spec.snapshots)
        {
            writer
                .commit(&[snapshot_signal(config, &source.table, spec.seed, made)?])
                .await?;
            workload.manifest.snapshots += 1;
        }
        if let Some(rate) = spec.rate.filter(|r| *r > 0.0) {
            let due = Duration::from_secs_f64(made as f64 / rate);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    let lsn: String = writer
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .context("source: reading the WAL position")?
        .get(0);
    let mut manifest = workload.manifest;
    manifest.rows = workload.live.len() as u64;
    manifest.last_lsn = lsn;
    let total = match WorkloadManifest::load(manifest_path) {
        Ok(before) => WorkloadManifest {
            inserts: before.inserts + manifest.inserts,
            updates: before.updates + manifest.updates,
            deletes: before.deletes + manifest.deletes,
            key_changes: before.key_changes + manifest.key_changes,
            snapshots: before.snapshots + manifest.snapshots,
            transactions: before.transactions + manifest.transactions,
            rows: manifest.rows,
            last_lsn: manifest.last_lsn.clone(),
        },
        Err(_) => manifest.clone(),
    };
    std::fs::write(manifest_path, serde_json::to_string_pretty(&total)?)
        .with_context(|| format!("writing {}", manifest_path.display()))?;
    println!(
        "loadgen: {} inserts, {} updates, {} deletes, {} key changes, {} snapshots asked for, in {} transactions; {} rows; WAL at {}",
        manifest.inserts,
        manifest.updates,
        manifest.deletes,
        manifest.key_changes,
        manifest.snapshots,
        manifest.transactions,
        manifest.rows,
        manifest.last_lsn
    );
    Ok(total)
}

/// The table (and Debezium's signal table, when set) made if missing, with its replica identity.
async fn prepare(
    client: &Client,
    config: &Config,
    job: &Job,
    table: &str,
    spec: &WorkloadSpec,
) -> Result<()> {
    let mut sql = vec![create_table_sql(job, table)?];
    sql.push(format!(
        "ALTER TABLE {table} REPLICA IDENTITY {}",
        if spec.full_identity {
            "FULL"
        } else {
            "DEFAULT"
        }
    ));
    if let Some(signal) = &config.source.signal_table {
        sql.push(format!(
            "CREATE TABLE IF NOT EXISTS {signal} (id varchar(64) PRIMARY KEY, type varchar(32) NOT NULL, data varchar(2048))"
        ));
    }
    for statement in sql {
        client
            .batch_execute(&statement)
            .await
            .with_context(|| format!("source: {statement}"))?;
    }
    Ok(())
}

/// The statement asking Debezium for an incremental snapshot of the table through its signal
/// table.
fn snapshot_signal(config: &Config, table: &str, seed: u64, at: u64) -> Result<String> {
    let Some(signal) = &config.source.signal_table else {
        bail!(
            "source.signal_table: not set; a new snapshot is asked for through Debezium's signal table (signal.data.collection)"
        );
    };
    let data = serde_json::json!({"data-collections": [table], "type": "incremental"}).to_string();
    Ok(format!(
        "INSERT INTO {signal} (id, type, data) VALUES ({}, 'execute-snapshot', {})",
        quote_text(&format!("tally-{seed}-{at}-{}", std::process::id())),
        quote_text(&data)
    ))
}
