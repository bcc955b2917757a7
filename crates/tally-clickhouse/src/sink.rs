//! The sink's write path: one checkpoint's batch into the data table, then its commit-log
//! row, each skipped when the commit log already has the batch.

use std::time::Duration;

use clickhouse::Client;
use serde::Serialize;
use tally_core::{Epoch, OutputRow, PartitionId};

use crate::error::{Result, SinkError};
use crate::schema::{Frontier, Shape, TableNames};
use crate::settings::SinkSettings;
use crate::{rows, schema, tls};

/// One checkpoint's output, identified by what it commits: its source partitions and the
/// offsets it ends at. The epoch is the writer's own numbering, for logs.
#[derive(Debug, Clone)]
pub struct Batch<'a> {
    pub job: &'a str,
    pub epoch: Epoch,
    /// (partition, first offset, next offset) of the epoch.
    pub offsets: Vec<(PartitionId, i64, i64)>,
    /// Per partition, in the order of `offsets`: the watermark after the epoch (ms; `i64::MIN`
    /// before the first valid event). Folding reads it from the commit log.
    pub watermarks: Vec<i64>,
    pub rows: &'a [OutputRow],
    pub event_count: u64,
    pub revenue_units: i128,
    pub dead_letters: u64,
    /// Valid records the declaration's filter left out.
    pub filtered_count: u64,
    pub duplicate_count: u64,
    /// Changes older than the one applied to their row.
    pub stale_count: u64,
    pub tombstone_count: u64,
    /// A change job's newest source LSN read up to this batch, of any of its partitions.
    pub source_lsn: u64,
}

impl<'a> Batch<'a> {
    /// The batch of a checkpoint of job `job`: a function of the checkpoint alone, so whoever
    /// writes it (the worker that made it, a later one from the changelog) writes the same
    /// batch. Watermarks are the partitions' after the epoch, with `out_of_orderness_ms`.
    pub fn of(
        job: &'a str,
        checkpoint: &'a tally_core::Checkpoint,
        out_of_orderness_ms: i64,
    ) -> Batch<'a> {
        let acc = checkpoint.accounting();
        Batch {
            job,
            epoch: checkpoint.epoch,
            offsets: checkpoint
                .partitions
                .iter()
                .map(|(p, c)| (*p, c.epoch_start_offset, c.next_offset))
                .collect(),
            watermarks: checkpoint
                .partitions
                .values()
                .map(|c| c.watermark.current(out_of_orderness_ms).unwrap_or(i64::MIN))
                .collect(),
            rows: &checkpoint.rows,
            event_count: acc.aggregated,
            revenue_units: acc.revenue_units,
            // Every dead letter is counted as late or dead-lettered: so also for an epoch
            // restored from the changelog, whose dead letters are only in their topic.
            dead_letters: acc.late + acc.dead_lettered,
            filtered_count: acc.filtered,
            duplicate_count: acc.duplicates,
            stale_count: acc.stale,
            tombstone_count: acc.tombstones,
            source_lsn: checkpoint
                .partitions
                .values()
                .filter_map(|c| c.newest_change)
                .map(|p| p.lsn)
                .max()
                .unwrap_or(0),
        }
    }
}

impl Batch<'_> {
    /// Stable id of the batch whoever writes it, e.g. `revenue_agg/orders[0:1200,1:1188]`.
    pub fn id(&self, source_topic: &str) -> String {
        let parts: Vec<String> = self
            .offsets
            .iter()
            .map(|(p, _, to)| format!("{p}:{to}"))
            .collect();
        format!("{}/{}[{}]", self.job, source_topic, parts.join(","))
    }

    pub(crate) fn max_window_start(&self) -> Result<u32> {
        match self.rows.iter().map(|r| r.key.window_start_ms).max() {
            Some(ms) => seconds(ms),
            None => Ok(0),
        }
    }

    pub(crate) fn partitions(&self) -> Vec<PartitionId> {
        self.offsets.iter().map(|o| o.0).collect()
    }

    pub(crate) fn to_offsets(&self) -> Vec<i64> {
        self.offsets.iter().map(|o| o.2).collect()
    }
}

#[derive(Debug, Serialize, clickhouse::Row)]
struct CommitRow {
    batch_id: String,
    job: String,
    epoch: u64,
    partitions: Vec<i32>,
    from_offsets: Vec<i64>,
    to_offsets: Vec<i64>,
    watermarks: Vec<i64>,
    max_window_start: u32,
    row_count: u64,
    event_count: u64,
    revenue_sum: i128,
    dead_letters: u64,
    committed_at: u32,
    // Last, where `ADD COLUMN` puts them in a commit log of an earlier release.
    filtered_count: u64,
    duplicate_count: u64,
    stale_count: u64,
    tombstone_count: u64,
    source_lsn: u64,
}

/// What writing a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written,
    /// The commit log already had the batch: nothing was written.
    AlreadyCommitted,
}

/// Where a fault-injection hook may stop the write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteStep {
    /// Half the rows are in the data table as a complete insert; the rest and the commit are not.
    HalfInserted,
    /// All rows are in the data table; the commit-log row is not.
    Inserted,
}

pub struct ClickHouseSink {
    pub(crate) client: Client,
    pub(crate) url: String,
    pub(crate) names: TableNames,
    /// Writes data rows of `names.shape`.
    pub(crate) encoder: rows::RowEncoder,
    pub(crate) version: String,
    pub(crate) request_timeout: Duration,
    /// The newest fold frontier this process installed in the view, and when it first did.
    pub(crate) installed: std::sync::Mutex<Option<(Frontier, std::time::Instant)>>,
    /// On a cluster: the oldest window another replica still reads versions of (`None`: not
    /// known, so none is dropped). Versions are replicated, a drop too.
    pub(crate) versions_floor: std::sync::Mutex<Option<Frontier>>,
    /// Whether the job's database is Atomic, once asked: a database keeps its engine, and each
    /// publish and repair swaps tables by it.
    pub(crate) atomic: std::sync::OnceLock<bool>,
}

pub(crate) fn seconds(ms: i64) -> Result<u32> {
    u32::try_from(ms.div_euclid(1000))
        .map_err(|_| SinkError::Refused(format!("time {ms} ms does not fit DateTime")))
}

impl ClickHouseSink {
    /// Whether the job's database is Atomic (current servers) rather than Ordinary (18.16),
    /// asked of the server once.
    pub(crate) async fn atomic_database(&self) -> Result<bool> {
        if let Some(&atomic) = self.atomic.get() {
            return Ok(atomic);
        }
        let atomic = schema::atomic_database(&self.client, &self.names, &self.url).await?;
        Ok(*self.atomic.get_or_init(|| atomic))
    }

    /// Connects and detects the server version.
    pub async fn connect(settings: &SinkSettings) -> Result<ClickHouseSink> {
        let client = tls::client(settings.ca_file.as_deref())?
            .with_url(&settings.url)
            .with_user(&settings.user)
            .with_password(settings.password.expose())
            // Without it an error in the middle of a SELECT is lost on old servers.
            .with_setting("wait_end_of_query", "1")
            .with_validation(false);
        let names = TableNames::new(&settings.database, &settings.table)?
            .with_shape(settings.shape.clone())
            .replicated(settings.cluster.is_some());
        let mut sink = ClickHouseSink {
            client,
            url: settings.url.clone(),
            encoder: rows::RowEncoder::new(&names.shape)?,
            names,
            version: String::new(),
            request_timeout: settings.request_timeout,
            installed: std::sync::Mutex::new(None),
            versions_floor: std::sync::Mutex::new(None),
            atomic: std::sync::OnceLock::new(),
        };
        // The first request: a failure no retry can cure becomes `Refused`, naming the cause.
        sink.version = sink.fetch_version().await.map_err(|e| match &e {
            SinkError::Server { source, .. } => match tls::permanent_cause(source) {
                Some(cause) => SinkError::Refused(format!(
                    "{} as user {}: {cause}",
                    settings.url, settings.user
                )),
                None => e,
            },
            _ => e,
        })?;
        // A batch of a catch-up can span days of event time, and so many partitions; current
        // servers refuse an insert into more than 100 partitions unless told otherwise.
        let limit: u64 = sink
            .client
            .query("SELECT count() FROM system.settings WHERE name = 'max_partitions_per_insert_block'")
            .fetch_one()
            .await
            .map_err(sink.err("reading settings"))?;
        if limit > 0 {
            sink.client = sink
                .client
                .clone()
                .with_setting("max_partitions_per_insert_block", "0");
        }
        Ok(sink)
    }

    pub(crate) fn err(
        &self,
        context: impl Into<String>,
    ) -> impl FnOnce(clickhouse::error::Error) -> SinkError + '_ {
        let context = context.into();
        move |source| SinkError::Server {
            url: self.url.clone(),
            context,
            source,
        }
    }

    pub(crate) async fn fetch_version(&self) -> Result<String> {
        self.client
            .query("SELECT version()")
            .fetch_one::<String>()
            .await
            .map_err(self.err("reading server version"))
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    /// The server this sink talks to.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn names(&self) -> &TableNames {
        &self.names
    }

    /// The same sink for a job of another shape (revenue_agg's by default): its tables'
    /// columns and the rows it writes.
    pub fn with_shape(self, shape: Shape) -> Result<ClickHouseSink> {
        Ok(ClickHouseSink {
            encoder: rows::RowEncoder::new(&shape)?,
            names: self.names.with_shape(shape),
            ..self
        })
    }

    /// Creates the database, tables and view when absent and validates what exists. A view of
    /// an earlier layout stays until the read side's next holder has published and installs
    /// the current one (it showed the right answer, only read more to get it).
    pub async fn ensure_schema(&self) -> Result<()> {
        let ensured = schema::ensure(&self.client, &self.names, &self.url).await?;
        if ensured.install_view {
            tracing::info!(
                view = %self.names.view_q(),
                "the view is of an earlier layout (it reads the versions itself): the read side replaces it once it has published"
            );
        }
        Ok(())
    }

    /// Whether the server pushes a WHERE clause on the view down to its tables (on by default
    /// since 19.x; 18.16 needs `enable_optimize_predicate_expression=1` in the readers'
    /// profile). Without it every query on the view reads the whole history.
    pub async fn pushes_predicates_into_views(&self) -> Result<bool> {
        let value: String = self
            .client
            .query("SELECT value FROM system.settings WHERE name = 'enable_optimize_predicate_expression'")
            .fetch_one()
            .await
            .map_err(self.err("reading settings"))?;
        Ok(value != "0")
    }

    /// The columns of the job's view as the server has them, by name and type (as
    /// [`crate::normalise_type`] writes it); `None`: no view.
    pub async fn found_view_columns(&self) -> Result<Option<Vec<(String, String)>>> {
        #[derive(serde::Deserialize)]
        struct Column {
            name: String,
            #[serde(rename = "type")]
            type_: String,
        }
        let sql = format!(
            "SELECT name, type FROM system.columns WHERE database = '{}' AND table = '{}'",
            self.names.database, self.names.view
        );
        let found: Vec<Column> =
            crate::schema::json_rows(&self.client, &sql, &self.url, "reading the view's columns")
                .await?;
        Ok((!found.is_empty()).then(|| {
            found
                .into_iter()
                .map(|c| (c.name, crate::normalise_type(&c.type_)))
                .collect()
        }))
    }

    /// Whether the commit log holds `batch` (written by this worker or any other).
    pub async fn is_committed(&self, batch: &Batch<'_>) -> Result<bool> {
        let sql = self.names.is_committed_sql(
            batch.max_window_start()?,
            &batch.partitions(),
            &batch.to_offsets(),
        );
        let n = self
            .client
            .query(&sql)
            .fetch_one::<u64>()
            .await
            .map_err(self.err("reading the commit log"))?;
        Ok(n > 0)
    }

    /// Per source partition, the newest offset a committed batch ends at.
    pub async fn committed_offsets(&self) -> Result<std::collections::BTreeMap<PartitionId, i64>> {
        let rows: Vec<(i32, i64)> = self
            .client
            .query(&self.names.committed_offsets_sql())
            .fetch_all()
            .await
            .map_err(self.err("reading the commit log"))?;
        Ok(rows.into_iter().collect())
    }

    /// Writes a batch idempotently: skip if committed, else data rows then the commit-log row.
    /// A write that takes longer than `request_timeout` fails and is retried whole; a late
    /// completion of the abandoned one is harmless (same epoch, same rows).
    pub async fn write_batch(
        &self,
        batch: &Batch<'_>,
        source_topic: &str,
        fault: impl Fn(WriteStep),
    ) -> Result<WriteOutcome> {
        let timeout = self.request_timeout;
        tokio::time::timeout(
            timeout,
            self.write_batch_untimed(batch, source_topic, fault),
        )
        .await
        .unwrap_or_else(|_| {
            Err(SinkError::Refused(format!(
                "writing epoch {} timed out after {timeout:?}",
                batch.epoch
            )))
        })
    }

    pub(crate) async fn write_batch_untimed(
        &self,
        batch: &Batch<'_>,
        source_topic: &str,
        fault: impl Fn(WriteStep),
    ) -> Result<WriteOutcome> {
        if self.is_committed(batch).await? {
            return Ok(WriteOutcome::AlreadyCommitted);
        }
        let half = batch.rows.len() / 2;
        if !batch.rows.is_empty() {
            self.insert_rows(batch, &batch.rows[..half]).await?;
            fault(WriteStep::HalfInserted);
            self.insert_rows(batch, &batch.rows[half..]).await?;
        }
        let max_window_start = batch.max_window_start()?;
        fault(WriteStep::Inserted);
        let commit = CommitRow {
            batch_id: batch.id(source_topic),
            job: batch.job.to_owned(),
            epoch: batch.epoch.0,
            partitions: batch.partitions(),
            from_offsets: batch.offsets.iter().map(|o| o.1).collect(),
            to_offsets: batch.to_offsets(),
            watermarks: batch.watermarks.clone(),
            max_window_start,
            row_count: batch.rows.len() as u64,
            event_count: batch.event_count,
            revenue_sum: batch.revenue_units,
            dead_letters: batch.dead_letters,
            committed_at: u32::try_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
            )
            .unwrap_or(u32::MAX),
            filtered_count: batch.filtered_count,
            duplicate_count: batch.duplicate_count,
            stale_count: batch.stale_count,
            tombstone_count: batch.tombstone_count,
            source_lsn: batch.source_lsn,
        };
        let mut insert = self
            .client
            .insert_unescaped::<CommitRow>(&self.names.commits)
            .await
            .map_err(self.err("starting commit-log insert"))?;
        insert
            .write(&commit)
            .await
            .map_err(self.err("writing commit-log row"))?;
        insert
            .end()
            .await
            .map_err(self.err(format!("committing batch {}", commit.batch_id)))?;
        Ok(WriteOutcome::Written)
    }

    pub(crate) async fn insert_rows(&self, batch: &Batch<'_>, rows: &[OutputRow]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let epoch = batch.epoch;
        let version_of = |partition: PartitionId| {
            batch
                .offsets
                .iter()
                .find(|o| o.0 == partition)
                .map(|o| o.2)
                .ok_or_else(|| {
                    SinkError::Refused(format!(
                        "epoch {epoch} has a row of partition {partition} but no offsets for it"
                    ))
                })
        };
        // Encoded before the request starts: a row that does not fit the shape sends nothing.
        let mut data = Vec::with_capacity(rows.len() * 64);
        for row in rows {
            self.encoder
                .encode(&mut data, version_of(row.partition)?, row)?;
        }
        let sql = format!(
            "INSERT INTO {} ({}) FORMAT RowBinary",
            self.names.data,
            self.encoder.column_list()
        );
        // One block for the whole insert: on 18.16 that is what makes it land whole or not at all.
        let mut insert = self
            .client
            .insert_formatted_with(sql)
            .with_setting("max_insert_block_size", (rows.len() + 1).to_string());
        insert
            .send(data.into())
            .await
            .map_err(self.err(format!("writing rows of epoch {epoch}")))?;
        insert
            .end()
            .await
            .map_err(self.err(format!("inserting {} rows of epoch {epoch}", rows.len())))
    }
}
