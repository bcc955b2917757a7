//! What is read back: the reader view (as revenue_agg's keys or any shape's cells), and the
//! commit log's batches, their accounting and totals, for the commit path's restart and the tools.

use serde::Deserialize;
use tally_core::PartitionId;

use crate::error::{Result, SinkError};
use crate::schema::Cut;
use crate::sink::{ClickHouseSink, seconds};

/// One reader-visible row: (window_start_ms, customer, currency) with (orders, revenue units).
pub type ViewKey = (i64, String, String);
/// (orders, revenue in 10^-4 units) of one view row.
pub type ViewTotals = (u64, i64);
/// A job of any shape's rows as text: (window start ms, group-by values) → value columns.
pub type Cells = std::collections::BTreeMap<(i64, Vec<String>), Vec<String>>;

// Rows are read as RowBinary by position (validation off for 18.16), so query aliases need not
// match field names; they differ from column names to avoid alias/column ambiguity.
#[derive(Debug, Deserialize, clickhouse::Row)]
struct ViewRow {
    window_start: u32,
    customer_id: String,
    currency: String,
    orders: u64,
    revenue: i64,
}

#[derive(Debug, Deserialize, clickhouse::Row)]
struct CellsRow {
    window_start: u32,
    keys: Vec<String>,
    values: Vec<String>,
}

/// Offsets of one committed batch, from the commit log.
#[derive(Debug, Clone, Deserialize, clickhouse::Row)]
pub struct CommittedBatch {
    /// The writer's epoch (the lowest, if copies were written under several).
    pub epoch: u64,
    pub partitions: Vec<i32>,
    pub from_offsets: Vec<i64>,
    pub to_offsets: Vec<i64>,
}

/// What the commit log records of one batch's input: its ranges, the partitions' watermarks
/// after it and where its records went (the counts of earlier releases' batches read 0 where
/// they had no column).
#[derive(Debug, Clone, Deserialize, clickhouse::Row)]
pub struct BatchAccounting {
    pub partitions: Vec<i32>,
    pub from_offsets: Vec<i64>,
    pub to_offsets: Vec<i64>,
    pub watermarks: Vec<i64>,
    pub event_count: u64,
    /// Late and other dead letters.
    pub dead_letters: u64,
    pub filtered_count: u64,
    pub duplicate_count: u64,
    pub stale_count: u64,
    pub tombstone_count: u64,
    pub source_lsn: u64,
}

impl BatchAccounting {
    /// Records the batch consumed: the lengths of its ranges.
    pub fn consumed(&self) -> u64 {
        self.from_offsets
            .iter()
            .zip(&self.to_offsets)
            .map(|(from, to)| u64::try_from(to - from).unwrap_or(0))
            .sum()
    }

    /// Records it accounts for, each once.
    pub fn accounted(&self) -> u64 {
        self.event_count
            + self.dead_letters
            + self.filtered_count
            + self.duplicate_count
            + self.stale_count
            + self.tombstone_count
    }
}

/// What the commit log recorded of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchTotals {
    pub rows: u64,
    pub events: u64,
    /// Revenue in 10^-4 units.
    pub revenue_units: i128,
    pub dead_letters: u64,
}

/// A decimal as ClickHouse prints it, in 10^-4 units.
fn decimal_units(text: &str) -> Option<i128> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if fraction.len() > 4 {
        return None;
    }
    let units = whole.parse::<i128>().ok()?.checked_mul(10_000)?
        + format!("{fraction:0<4}").parse::<i128>().ok()?;
    Some(if negative { -units } else { units })
}

impl ClickHouseSink {
    /// What the commit log recorded of the batch that ends `partitions` at `to_offsets`.
    pub async fn batch_totals(
        &self,
        partitions: &[PartitionId],
        to_offsets: &[i64],
    ) -> Result<Option<BatchTotals>> {
        let rows: Vec<(u64, u64, String, u64)> = self
            .client
            .query(&self.names.batch_totals_sql(partitions, to_offsets))
            .fetch_all()
            .await
            .map_err(self.err("reading the commit log"))?;
        rows.into_iter()
            .next()
            .map(|(rows, events, revenue, dead_letters)| {
                let revenue_units = decimal_units(&revenue).ok_or_else(|| {
                    SinkError::Schema(format!("commit log revenue {revenue:?} is not a decimal"))
                })?;
                Ok(BatchTotals {
                    rows,
                    events,
                    revenue_units,
                    dead_letters,
                })
            })
            .transpose()
    }

    /// Every row of the reader view, exactly as a plain `SELECT` sees it.
    pub async fn read_view(&self) -> Result<std::collections::BTreeMap<ViewKey, ViewTotals>> {
        self.collect_rows(&self.names.read_view_sql(), "reading the view")
            .await
    }

    /// The answer the commit log's versions give now, published or not: what the next
    /// publish shows readers.
    pub async fn read_committed_answer(
        &self,
    ) -> Result<std::collections::BTreeMap<ViewKey, ViewTotals>> {
        let frontier = self.frontier().await?;
        self.collect_rows(
            &self.names.read_answer_sql(frontier, None, None),
            "reading the committed versions",
        )
        .await
    }

    /// The view's rows as readers saw them once the batches up to `cut` were committed.
    /// Folded windows are final, so they read the same at any later cut.
    pub async fn read_view_at(
        &self,
        cut: &Cut,
    ) -> Result<std::collections::BTreeMap<ViewKey, ViewTotals>> {
        let frontier = self.frontier().await?;
        self.collect_rows(
            &self.names.read_view_at_sql(frontier, cut, None),
            "reading the view at a cut",
        )
        .await
    }

    /// [`read_view_at`](Self::read_view_at) for windows starting in `[from_ms, to_ms]` only.
    pub async fn read_view_at_windows(
        &self,
        cut: &Cut,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<std::collections::BTreeMap<ViewKey, ViewTotals>> {
        let frontier = self.frontier().await?;
        let range = (seconds(from_ms)?, seconds(to_ms)?);
        self.collect_rows(
            &self.names.read_view_at_sql(frontier, cut, Some(range)),
            "reading the view at a cut",
        )
        .await
    }

    /// Every row of the reader view of a job of any shape: (window start ms, keys as text) →
    /// the view's value columns as text (times in epoch seconds).
    pub async fn read_view_cells(&self) -> Result<Cells> {
        let sql = self.names.cells_sql(&self.names.read_view_sql());
        self.collect_cells(&sql, "reading the view").await
    }

    /// [`read_view_cells`](Self::read_view_cells) of the view `view` of the database, read
    /// with this job's columns: the job's view once a new version holds it.
    pub async fn read_view_cells_of(&self, view: &str) -> Result<Cells> {
        let sql = self.names.cells_sql(&self.names.read_view_named_sql(view));
        self.collect_cells(&sql, "reading the job's view").await
    }

    /// [`read_committed_answer`](Self::read_committed_answer) for a job of any shape.
    pub async fn read_committed_cells(&self) -> Result<Cells> {
        let frontier = self.frontier().await?;
        let sql = self
            .names
            .cells_sql(&self.names.read_answer_sql(frontier, None, None));
        self.collect_cells(&sql, "reading the committed versions")
            .await
    }

    /// [`read_view_at`](Self::read_view_at) for a job of any shape; with `windows`, only the
    /// windows starting in `[from_ms, to_ms]`.
    pub async fn read_view_at_cells(
        &self,
        cut: &Cut,
        windows: Option<(i64, i64)>,
    ) -> Result<Cells> {
        let frontier = self.frontier().await?;
        let range = windows
            .map(|(from_ms, to_ms)| Ok::<_, SinkError>((seconds(from_ms)?, seconds(to_ms)?)))
            .transpose()?;
        let sql = self
            .names
            .cells_sql(&self.names.read_view_at_sql(frontier, cut, range));
        self.collect_cells(&sql, "reading the view at a cut").await
    }

    async fn collect_cells(&self, sql: &str, context: &str) -> Result<Cells> {
        let rows: Vec<CellsRow> = self
            .client
            .query(sql)
            .fetch_all()
            .await
            .map_err(self.err(context))?;
        let mut map = Cells::new();
        for CellsRow {
            window_start,
            keys,
            values,
        } in rows
        {
            let key = (i64::from(window_start) * 1000, keys);
            if map.contains_key(&key) {
                return Err(SinkError::Refused(format!(
                    "{context}: key {key:?} appears twice"
                )));
            }
            map.insert(key, values);
        }
        Ok(map)
    }

    async fn collect_rows(
        &self,
        sql: &str,
        context: &str,
    ) -> Result<std::collections::BTreeMap<ViewKey, ViewTotals>> {
        let rows: Vec<ViewRow> = self
            .client
            .query(sql)
            .fetch_all()
            .await
            .map_err(self.err(context))?;
        let mut map = std::collections::BTreeMap::new();
        for r in rows {
            let key = (i64::from(r.window_start) * 1000, r.customer_id, r.currency);
            if map.insert(key.clone(), (r.orders, r.revenue)).is_some() {
                return Err(SinkError::Refused(format!(
                    "{context}: key {key:?} appears twice"
                )));
            }
        }
        Ok(map)
    }

    /// The commit log, one entry per batch.
    pub async fn committed_batches(&self) -> Result<Vec<CommittedBatch>> {
        self.client
            .query(&self.names.committed_batches_sql())
            .fetch_all()
            .await
            .map_err(self.err("reading the commit log"))
    }

    /// Every batch's accounting, once per batch however many copies were written.
    pub async fn batch_accounting(&self) -> Result<Vec<BatchAccounting>> {
        let sql = format!(
            "SELECT partitions, any(from_offsets), to_offsets, any(watermarks), any(event_count), any(dead_letters), \
             any(filtered_count), any(duplicate_count), any(stale_count), any(tombstone_count), any(source_lsn) \
             FROM {} GROUP BY partitions, to_offsets",
            self.names.commits
        );
        self.client
            .query(&sql)
            .fetch_all()
            .await
            .map_err(self.err("reading the commit log's accounting"))
    }

    /// Totals the commit log records, once per batch: (events aggregated, revenue as a
    /// decimal string, dead letters).
    pub async fn commit_totals(&self) -> Result<(u64, String, u64)> {
        let sql = format!(
            "SELECT toUInt64(sum(e)), toString(sum(r)), toUInt64(sum(d)) FROM \
             (SELECT any(event_count) AS e, any(revenue_sum) AS r, any(dead_letters) AS d FROM {} GROUP BY partitions, to_offsets)",
            self.names.commits
        );
        self.client
            .query(&sql)
            .fetch_one()
            .await
            .map_err(self.err("summing the commit log"))
    }

    /// Keys the view shows more than once.
    pub async fn view_doubled_keys(&self) -> Result<u64> {
        self.client
            .query(&self.names.doubled_keys_sql(&self.names.view_q()))
            .fetch_one()
            .await
            .map_err(self.err("counting the view's keys"))
    }

    /// Keys more than once in what the commit log's versions give, published or not: a writer
    /// that broke the protocol shows here before any publish shows it to readers.
    pub async fn answer_doubled_keys(&self) -> Result<u64> {
        let frontier = self.frontier().await?;
        let answer = format!("({})", self.names.answer_sql(frontier, None));
        self.client
            .query(&self.names.doubled_keys_sql(&answer))
            .fetch_one()
            .await
            .map_err(self.err("counting the committed versions' keys"))
    }
}

impl Cut {
    /// The point after every batch of `batches`: per partition, the newest offset.
    pub fn after(batches: &[CommittedBatch]) -> Cut {
        Cut::of_ends(batches.iter().map(|b| (&b.partitions, &b.to_offsets)))
    }

    /// The point after batches given by (partitions, end offsets).
    pub fn of_ends<'a>(batches: impl Iterator<Item = (&'a Vec<i32>, &'a Vec<i64>)>) -> Cut {
        let mut cut = std::collections::BTreeMap::new();
        for (partitions, ends) in batches {
            for (p, to) in partitions.iter().zip(ends) {
                let end = cut.entry(*p).or_insert(*to);
                *end = (*end).max(*to);
            }
        }
        Cut(cut)
    }
}

#[cfg(test)]
mod tests {
    use super::decimal_units;

    #[test]
    fn decimals_read_back_in_units() {
        assert_eq!(decimal_units("12.5"), Some(125_000));
        assert_eq!(decimal_units("-0.0001"), Some(-1));
        assert_eq!(decimal_units("7"), Some(70_000));
        assert_eq!(decimal_units("1.23456"), None);
        assert_eq!(decimal_units("x"), None);
    }
}
