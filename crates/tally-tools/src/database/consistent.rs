//! A point where the source table and the view stand at the same place, for `reconcile
//! --source`: the table read in one snapshot, and the view at a cut holding every change that
//! snapshot holds. Windows that changes after the snapshot touched (before it, in the view's
//! cut) are set apart; every other window must be equal, however young it is.
//!
//! Why it is exact: a change the snapshot holds committed before it, so its commit is before
//! the WAL position read right after the snapshot; once the connector's slot confirms that
//! position, the change is in the topic below the offsets read then; once the job's cut passes
//! those offsets, the view holds it. The changes the view holds but the snapshot does not are
//! in the topic between the cut the round started from and the cut it compares (each names its
//! transaction, which the snapshot holds or not). A window none of their rows was in, before
//! (as the snapshot has them) or after (as each change has them), has the same rows on both
//! sides.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tally_clickhouse::{BatchAccounting, ClickHouseSink, Cut};
use tally_core::declare::{Evaluation, Job, lsn_text};

use super::SourceDatabase;
use crate::prove::ViewTypes;
use tally_runtime::config::Config;

/// A PostgreSQL snapshot (`pg_current_snapshot()`): which transactions it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u64,
    xmax: u64,
    in_progress: BTreeSet<u64>,
}

impl Snapshot {
    /// Reads `xmin:xmax:xip,...` as `pg_snapshot`'s text shows it.
    pub fn parse(text: &str) -> Result<Snapshot> {
        let mut parts = text.split(':');
        let (Some(xmin), Some(xmax), Some(xip), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            bail!("{text:?} is not a snapshot (xmin:xmax:xip)");
        };
        let number = |s: &str| {
            s.parse::<u64>()
                .with_context(|| format!("{s:?} in snapshot {text:?}"))
        };
        Ok(Snapshot {
            xmin: number(xmin)?,
            xmax: number(xmax)?,
            in_progress: xip
                .split(',')
                .filter(|s| !s.is_empty())
                .map(number)
                .collect::<Result<_>>()?,
        })
    }

    /// Whether transaction `txid` (Debezium's `source.txId`: 32 bits, no epoch) committed
    /// before the snapshot was taken, so that the snapshot holds its changes.
    pub fn holds(&self, txid: u64) -> bool {
        // A 32-bit id is the one nearest xmax in modulo 2^32 (as PostgreSQL widens xids).
        let full = match u32::try_from(txid) {
            Err(_) => txid,
            Ok(short) => {
                let back = (self.xmax as u32).wrapping_sub(short);
                if back < 1 << 31 {
                    self.xmax.saturating_sub(u64::from(back))
                } else {
                    self.xmax + u64::from(short.wrapping_sub(self.xmax as u32))
                }
            }
        };
        full < self.xmin || (full < self.xmax && !self.in_progress.contains(&full))
    }
}

/// The job's cut once it holds every change the snapshot holds.
pub struct Reached {
    pub cut: Cut,
    pub batches: Vec<BatchAccounting>,
    /// The slot's confirmed position when the topic's ends were read.
    pub confirmed_lsn: u64,
}

/// Waits (up to `wait`) until the connector confirmed WAL position `lsn` and the job committed
/// the topic up to where it ended then. `Ok(Err(why))` when it did not within `wait`.
pub async fn reach(
    config: &Config,
    source: &SourceDatabase,
    sink: &ClickHouseSink,
    lsn: u64,
    wait: Duration,
) -> Result<std::result::Result<Reached, String>> {
    let until = Instant::now() + wait;
    let Some(slot_name) = &config.source.slot else {
        return Ok(Err("source.slot is not set: tally cannot tell when the connector has captured what the snapshot holds".into()));
    };
    // The connector confirms a position only once it has processed a change there: an idle
    // table on a server whose WAL moves on (other tables, other databases) never confirms the
    // position after the snapshot. A signal it reads (Debezium's `log` signal, through
    // `source.signal_table`) is such a change, after every change the snapshot holds.
    if let Some(signal_table) = &config.source.signal_table {
        mark(source, signal_table).await?;
    }
    let confirmed_lsn = loop {
        let confirmed = match super::capture::slot(source, slot_name).await? {
            Some(slot) => slot.confirmed_lsn,
            None => {
                return Ok(Err(format!(
                    "replication slot {slot_name} does not exist: nothing captures the table"
                )));
            }
        };
        if confirmed >= lsn {
            break confirmed;
        }
        if Instant::now() >= until {
            return Ok(Err(format!(
                "the connector's slot {slot_name} confirmed {} after {}s, not yet {} (the WAL position after the snapshot): is the connector running{}?",
                lsn_text(confirmed),
                wait.as_secs(),
                lsn_text(lsn),
                if config.source.signal_table.is_some() {
                    ", reading source.signal_table (its signal.data.collection)"
                } else {
                    "? Set source.signal_table (the connector's signal.data.collection) so that tally can mark the position"
                }
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let settings = config.kafka_settings();
    let topic = config.kafka.source_topic.clone();
    let extent = tokio::task::spawn_blocking(move || tally_kafka::topic_extent(&settings, &topic))
        .await
        .context("reading the topic's ends")??;
    loop {
        let batches = sink.batch_accounting().await?;
        let cut = Cut::of_ends(batches.iter().map(|b| (&b.partitions, &b.to_offsets)));
        let behind: Vec<String> = extent
            .iter()
            .filter_map(|(p, (low, high))| {
                let at = cut.0.get(p).copied().unwrap_or(*low);
                (high > low && at < *high).then(|| format!("partition {p} at {at} of {high}"))
            })
            .collect();
        if behind.is_empty() {
            return Ok(Ok(Reached {
                cut,
                batches,
                confirmed_lsn,
            }));
        }
        if Instant::now() >= until {
            return Ok(Err(format!(
                "the job has not committed what the topic held once the snapshot was captured, after {}s: {}",
                wait.as_secs(),
                behind.join(", ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writes a `log` signal into the connector's signal table (and takes the row out again, in
/// the same transaction): a change the connector reads, and confirms, after the snapshot.
async fn mark(source: &SourceDatabase, signal_table: &str) -> Result<()> {
    tally_runtime::capture::mark(
        &source.connect().await?,
        signal_table,
        "tally reconcile --source: the table was read before this point",
    )
    .await
}

/// The changes in the topic between two cuts that the snapshot does not hold.
#[derive(Debug, Default)]
pub struct After {
    /// Their rows' primary keys, each value as text.
    pub rows: BTreeSet<Vec<String>>,
    /// The windows (start, keys as the view shows them) their new images are in.
    pub windows: BTreeSet<(i64, Vec<String>)>,
    /// Change events read, and how many of them the snapshot does not hold.
    pub read: u64,
    pub after: u64,
    /// Where a truncate was read (the job stops at one).
    pub truncates: Vec<String>,
}

/// Reads the source topic from `from` to `to` (per partition; a partition `from` lacks starts
/// at the topic's start) and keeps the changes `snapshot` does not hold. A snapshot read (op
/// `r`) or a change without a transaction id counts as not held: its image may be older or
/// newer than the snapshot's.
pub(crate) fn changes_after(
    config: &Config,
    job: &Job,
    types: &ViewTypes,
    snapshot: &Snapshot,
    from: &Cut,
    to: &Cut,
) -> Result<After> {
    let settings = config.kafka_settings();
    let topic = &config.kafka.source_topic;
    let extent = tally_kafka::topic_extent(&settings, topic)?;
    let ranges: BTreeMap<i32, (i64, Option<i64>)> =
        to.0.iter()
            .map(|(p, end)| {
                let start = from
                    .0
                    .get(p)
                    .copied()
                    .or_else(|| extent.get(p).map(|(low, _)| *low))
                    .unwrap_or(0);
                (*p, (start.min(*end), Some(*end)))
            })
            .collect();
    let mut after = After::default();
    let mut problem = None;
    tally_kafka::read_committed_range(&settings, topic, &ranges, Duration::from_secs(60), |m| {
        if problem.is_some() {
            return;
        }
        if let Err(e) = after.add(job, types, snapshot, m) {
            problem = Some(e);
        }
    })?;
    match problem {
        Some(e) => Err(e),
        None => Ok(after),
    }
}

impl After {
    fn add(
        &mut self,
        job: &Job,
        types: &ViewTypes,
        snapshot: &Snapshot,
        m: &rdkafka::message::BorrowedMessage<'_>,
    ) -> Result<()> {
        use rdkafka::Message;
        let Some(value) = m.payload() else {
            return Ok(()); // a tombstone changes no row
        };
        self.read += 1;
        let Ok(document) = serde_json::from_slice::<serde_json::Value>(value) else {
            return Ok(()); // poison: the job dead-lettered it, it changed no row
        };
        let event = match document.get("payload") {
            Some(p) if p.get("op").is_some() => p,
            _ => &document,
        };
        let op = event.get("op").and_then(|o| o.as_str()).unwrap_or_default();
        if op == "t" {
            self.truncates
                .push(format!("partition {} offset {}", m.partition(), m.offset()));
            return Ok(());
        }
        let held = op != "r"
            && event
                .get("source")
                .and_then(|s| s.get("txId"))
                .and_then(serde_json::Value::as_u64)
                .is_some_and(|txid| snapshot.holds(txid));
        if held {
            return Ok(());
        }
        let Ok(change) = job.evaluate_change(Some(value), usize::MAX) else {
            return Ok(());
        };
        self.after += 1;
        self.rows
            .insert(change.key.split('\0').map(str::to_owned).collect());
        if let Ok(Some(Evaluation::Event(e))) = &change.row {
            let keys = job
                .keys
                .iter()
                .zip(&e.key)
                .enumerate()
                .map(|(i, (&field, value))| {
                    types.canonical_key(i, &value.key_text(job.fields[field].scale))
                })
                .collect::<Result<Vec<_>>>()?;
            for start in job.windows.starts_of(e.event_time_ms) {
                self.windows.insert((start, keys.clone()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_holds_what_committed_before_it() {
        let s = Snapshot::parse("100:105:101,103").unwrap();
        for (txid, held) in [
            (99, true),
            (100, true),
            (101, false),
            (102, true),
            (103, false),
            (104, true),
            (105, false),
            (900, false),
        ] {
            assert_eq!(s.holds(txid), held, "{txid}");
        }
        assert!(Snapshot::parse("7:9:").unwrap().holds(8));
        assert!(Snapshot::parse("7:9").is_err());
        // After a wraparound the snapshot's xids carry an epoch; Debezium's do not.
        let epoch = 1u64 << 32;
        let s = Snapshot::parse(&format!("{}:{}:", epoch + 10, epoch + 20)).unwrap();
        assert!(s.holds(15) && !s.holds(25) && s.holds(12));
        assert!(s.holds(u64::from(u32::MAX)), "the previous epoch's last");
    }
}
