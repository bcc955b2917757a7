//! Publishing: the answer for the windows folding has not reached, computed once per change of
//! the commit log instead of on every SELECT.
//!
//! A view that filtered versions by the commit log in the reader's own SELECT could show half a
//! batch: the server takes its snapshot of the version table's parts before it reads the commit
//! log, so a batch whose rows were inserted as two parts (two version partitions) could be read
//! with one part, then counted as committed (`tests/several_writers.rs`,
//! `a_reader_never_sees_half_a_batch`). A publish fixes the cut first, from the commit log, and
//! only then reads versions: every batch up to the cut has all its rows by then (its commit row
//! is written after them). One step, each part repeatable:
//! 1. read the cut: per source partition, the newest committed offset of the batches that can
//!    hold windows at or after `from` (or the snapshot's before, if that is newer);
//! 2. build the answer from `from` as of that cut in a stage table of the read side's
//!    [`ReadLease`] (an insert the server finishes after its client died, or after a later
//!    holder took over, lands there and nowhere else);
//! 3. unless the live table already holds a later cut, swap the stage table in as the live
//!    table (a RENAME or EXCHANGE naming the lease's table, refused once a later holder fenced
//!    this one) and drop the one it replaced: readers see the old snapshot or the new one,
//!    whole, also after the server restarts.
//!
//! `from` is never above the frontier of a view a reader may still use: the frontier of the
//! snapshot before (safe then, and views only move forward), or one this process installed at
//! least [`READER_MARGIN`](crate::READER_MARGIN) ago.

use serde::Deserialize;

use crate::error::Result;
use crate::read_side::ReadLease;
use crate::schema::{Cut, Frontier};
use crate::sink::ClickHouseSink;

/// Where a fault-injection hook may stop a publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishStep {
    /// The server runs the publish's insert into its stage table (reported only when asked).
    Inserting,
    /// The snapshot is built in the stage table; the live table still holds the one before.
    Staged,
    /// The live table holds the new snapshot; the one it replaced is not dropped yet.
    Replaced,
}

/// What a publish did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PublishOutcome {
    /// The cut readers see from now on (the one before, if nothing was published).
    pub cut: Cut,
    /// The oldest window the snapshot holds.
    pub from: Frontier,
    /// Rows of the new snapshot; `None` when nothing was published.
    pub rows: Option<u64>,
}

/// Where the live table's snapshot was computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub from: Frontier,
    pub cut: Cut,
}

#[derive(Debug, Deserialize, clickhouse::Row)]
struct PublishedRow {
    from: u32,
    partitions: Vec<i32>,
    offsets: Vec<i64>,
}

/// Whether `newer` is at least as far as `older` on every partition both name: a publish of
/// `newer` over `older` can only add batches.
fn not_behind(newer: &Cut, older: &Cut) -> bool {
    older
        .0
        .iter()
        .all(|(p, o)| newer.0.get(p).is_none_or(|n| n >= o))
}

impl Cut {
    /// Whether this cut is at least as far as `other` on every partition both name.
    pub fn reaches(&self, other: &Cut) -> bool {
        not_behind(self, other)
    }
}

impl ClickHouseSink {
    /// Where the published snapshot was computed; `None` while it is empty.
    pub async fn published(&self) -> Result<Option<Published>> {
        let rows: Vec<PublishedRow> = self
            .client
            .query(&self.names.published_sql())
            .fetch_all()
            .await
            .map_err(self.err("reading the published snapshot"))?;
        Ok(rows.into_iter().next().map(|r| Published {
            from: Frontier { seconds: r.from },
            cut: Cut(r.partitions.into_iter().zip(r.offsets).collect()),
        }))
    }

    async fn open_cut(&self, from: Frontier) -> Result<Cut> {
        let rows: Vec<(i32, i64)> = self
            .client
            .query(&self.names.open_cut_sql(from))
            .fetch_all()
            .await
            .map_err(self.err("reading the commit log"))?;
        Ok(Cut(rows.into_iter().collect()))
    }

    /// Publishes the answer as of the commit log's newest batches, if they changed (see the
    /// module docs), under `lease`. Safe to rerun after a crash at any point. `watch_insert`:
    /// report [`PublishStep::Inserting`] once the server runs the insert (for crash tests).
    pub async fn publish(
        &self,
        lease: &ReadLease,
        fault: impl Fn(PublishStep),
        watch_insert: bool,
    ) -> Result<PublishOutcome> {
        self.settle_failed(lease).await?;
        let before = self.published().await?;
        let from = Frontier {
            seconds: before
                .as_ref()
                .map_or(0, |b| b.from.seconds)
                .max(self.settled_frontier().seconds),
        };
        let mut cut = self.open_cut(from).await?;
        if let Some(before) = &before {
            // A partition whose newest batches hold only windows below `from` reads an older
            // offset here; those batches change nothing from `from` on, so the snapshot holds
            // them too.
            for (p, o) in &before.cut.0 {
                let entry = cut.0.entry(*p).or_insert(*o);
                *entry = (*entry).max(*o);
            }
        }
        // Also when only `from` moved on (a fold step): the windows below it leave the table.
        let unchanged = before.as_ref().map_or(cut.0.is_empty(), |b| {
            b.cut == cut && b.from.seconds >= from.seconds
        });
        if unchanged {
            return Ok(PublishOutcome {
                cut,
                from: before.map_or(from, |b| b.from),
                rows: None,
            });
        }
        // The cut was read from this replica's commit log: its versions of those batches are
        // here once it synced (on a cluster).
        self.sync_versions().await?;
        let stage = lease.publish_stage();
        let [create, truncate, insert] =
            <[String; 3]>::try_from(self.names.stage_snapshot_sql(&stage, from, &cut))
                .map_err(|_| crate::error::SinkError::Schema("publish statements".into()))?;
        self.exec_fenced(lease, &create).await?;
        self.exec_fenced(lease, &truncate).await?;
        self.exec_fenced_watched(lease, &insert, watch_insert, || {
            fault(PublishStep::Inserting)
        })
        .await?;
        fault(PublishStep::Staged);
        // Just before the replace, the window in which a paused publisher could put an older
        // snapshot back is as short as it gets.
        if let Some(now) = self.published().await?
            && !not_behind(&cut, &now.cut)
        {
            return Ok(PublishOutcome {
                cut: now.cut,
                from: now.from,
                rows: None,
            });
        }
        let rows: u64 = self
            .fetch_fenced(lease, &format!("SELECT count() FROM {stage}"))
            .await?;
        let atomic = self.atomic_database().await?;
        let swap = self.names.swap_live_sql(&stage, lease.database(), atomic);
        let Some((drop_replaced, swap)) = swap.split_last() else {
            return Err(crate::error::SinkError::Schema("publish statements".into()));
        };
        for sql in swap {
            self.exec_fenced(lease, sql).await?;
        }
        fault(PublishStep::Replaced);
        self.exec_fenced(lease, drop_replaced).await?;
        Ok(PublishOutcome {
            cut,
            from,
            rows: Some(rows),
        })
    }

    /// Totals of what the snapshot `published` (from [`published`](Self::published)) shows by
    /// the commit log (events, revenue as a decimal string), and how many batches committed
    /// `unpublished_after` ago or earlier it does not hold yet.
    pub async fn published_totals(
        &self,
        published: Option<&Published>,
        unpublished_after: std::time::Duration,
    ) -> Result<(u64, String, u64)> {
        let (from, cut) = published.map_or((Frontier::default(), Cut::default()), |p| {
            (p.from, p.cut.clone())
        });
        self.client
            .query(&self.names.published_totals_sql(
                from,
                &cut,
                u32::try_from(unpublished_after.as_secs()).unwrap_or(u32::MAX),
            ))
            .fetch_one()
            .await
            .map_err(self.err("summing the published batches"))
    }
}

impl ClickHouseSink {
    /// (rows, distinct snapshot points) of the live table: more than one point means a row
    /// that no publish wrote.
    pub async fn live_points(&self) -> Result<(u64, u64)> {
        self.client
            .query(&self.names.live_points_sql())
            .fetch_one()
            .await
            .map_err(self.err("reading the published snapshot"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(pairs: &[(i32, i64)]) -> Cut {
        Cut(pairs.iter().copied().collect())
    }

    #[test]
    fn a_publish_never_puts_an_older_cut_back() {
        let installed = cut(&[(0, 10), (1, 8)]);
        assert!(not_behind(&cut(&[(0, 12), (1, 8)]), &installed));
        // A paused publisher's older snapshot.
        assert!(!not_behind(&cut(&[(0, 9), (1, 20)]), &installed));
        // A partition whose batches all fell below the frontier drops out of the cut; one
        // that is new appears.
        assert!(not_behind(&cut(&[(1, 8), (2, 3)]), &installed));
        assert!(not_behind(&cut(&[]), &installed));
    }
}
