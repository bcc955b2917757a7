//! `tally verify` for a job of change events, against a change workload's manifest: every
//! change the workload made reached the topic (Produced → Persisted), every one the topic holds
//! was applied once and each repeat counted as a duplicate or stale (Processed), the commit log
//! balances batch by batch and matches the dead-letter topic (Written), and the view equals the
//! same aggregation run on the source table (Queryable → Reported: `reconcile --source`,
//! strict).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tally_clickhouse::ClickHouseSink;
use tally_core::declare::{Job, Op, Position};

use super::workload::WorkloadManifest;
use crate::prove::{ReconcileFilter, read_dead_letters};
use tally_runtime::config::Config;

/// What the topic holds up to the job's committed cut, read with the job's declaration.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TopicChanges {
    pub records: u64,
    pub tombstones: u64,
    /// First occurrences of a (row, position), by op: create, update, delete, snapshot read
    /// (of the connector's first snapshot, at the start of the log; of a later one).
    pub created: u64,
    pub updated: u64,
    pub deleted: u64,
    pub read_first: u64,
    pub read: u64,
    /// Records repeating a (row, position) read before: the connector's replays.
    pub repeats: u64,
    /// Records the declaration cannot read as a change (dead-lettered by the job).
    pub unreadable: u64,
}

impl TopicChanges {
    pub fn firsts(&self) -> u64 {
        self.created + self.updated + self.deleted + self.read_first + self.read
    }

    /// Adds one record: `None` for a tombstone.
    pub fn add(
        &mut self,
        seen: &mut HashSet<(i32, String, Position)>,
        job: &Job,
        partition: i32,
        value: Option<&[u8]>,
        max_record_bytes: usize,
    ) {
        self.records += 1;
        if value.is_none() {
            self.tombstones += 1;
            return;
        }
        match job.evaluate_change(value, max_record_bytes) {
            Err(_) => self.unreadable += 1,
            Ok(change) => {
                if !seen.insert((partition, change.key.to_string(), change.position)) {
                    self.repeats += 1;
                    return;
                }
                match change.op {
                    Op::Create => self.created += 1,
                    Op::Update => self.updated += 1,
                    Op::Delete => self.deleted += 1,
                    // The first snapshot's reads come before any commit position.
                    Op::Read if change.position.commit_lsn == 0 => self.read_first += 1,
                    Op::Read => self.read += 1,
                    Op::Truncate => self.unreadable += 1,
                }
            }
        }
    }
}

/// The commit log's accounting summed over batches, and the batches that do not balance.
#[derive(Debug, Default)]
struct Committed {
    consumed: u64,
    applied: u64,
    duplicates: u64,
    stale: u64,
    tombstones: u64,
    filtered: u64,
    dead_letters: u64,
    unbalanced: Vec<String>,
    ranges: BTreeMap<i32, (i64, Option<i64>)>,
}

async fn committed(sink: &ClickHouseSink) -> Result<Committed> {
    let mut c = Committed::default();
    for b in sink.batch_accounting().await? {
        if b.consumed() != b.accounted() {
            c.unbalanced.push(format!(
                "batch {:?} up to {:?}: consumed {} but accounts for {}",
                b.partitions,
                b.to_offsets,
                b.consumed(),
                b.accounted()
            ));
        }
        c.consumed += b.consumed();
        c.applied += b.event_count;
        c.duplicates += b.duplicate_count;
        c.stale += b.stale_count;
        c.tombstones += b.tombstone_count;
        c.filtered += b.filtered_count;
        c.dead_letters += b.dead_letters;
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            let e = c.ranges.entry(*p).or_insert((*from, Some(*to)));
            e.0 = e.0.min(*from);
            e.1 = Some(e.1.unwrap_or(*to).max(*to));
        }
    }
    Ok(c)
}

/// Checks a change job against `manifest_path`; prints what it found, `true` when exact.
pub async fn verify_changes(config: &Config, manifest_path: &Path) -> Result<bool> {
    let job = &config.declared;
    let manifest = WorkloadManifest::load(manifest_path)?;
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let c = committed(&sink).await?;
    if c.ranges.is_empty() {
        bail!("verify: job {} has committed nothing yet", config.job.name);
    }
    let settings = config.kafka_settings();
    let topic = &config.kafka.source_topic;
    let extent = tally_kafka::topic_extent(&settings, topic)?;
    let behind: Vec<String> = extent
        .iter()
        .filter_map(|(p, (_, high))| {
            let at = c.ranges.get(p).and_then(|r| r.1).unwrap_or(0);
            (at < *high).then(|| format!("partition {p} at offset {at} of {high}"))
        })
        .collect();
    let read_config = config.clone();
    let job_read = job.clone();
    let ranges = c.ranges.clone();
    let max_record_bytes = usize::try_from(config.job.max_record_bytes).unwrap_or(usize::MAX);
    let topic_changes = tokio::task::spawn_blocking(move || -> Result<TopicChanges> {
        let mut out = TopicChanges::default();
        let mut seen = HashSet::new();
        tally_kafka::read_committed_range(
            &read_config.kafka_settings(),
            &read_config.kafka.source_topic,
            &ranges,
            Duration::from_secs(120),
            |m| {
                let r = tally_kafka::record_of(m);
                out.add(&mut seen, &job_read, r.partition, r.value, max_record_bytes)
            },
        )?;
        Ok(out)
    })
    .await
    .context("verify: reading the topic")??;
    let dead = read_dead_letters(config)?;
    let in_dlq: u64 = dead.values().map(|v| v.len() as u64).sum();
    let t = &topic_changes;
    let changes_in_topic = t.created + t.updated + t.deleted;
    // Rows inserted before the connector existed reach the topic as its first snapshot's reads.
    let inserted = t.created + t.read_first;
    let mut problems = Vec::new();
    if !behind.is_empty() {
        problems.push(format!(
            "the job has not caught up with the topic: {}",
            behind.join(", ")
        ));
    }
    problems.extend(c.unbalanced.iter().take(5).cloned());
    if c.consumed != t.records {
        problems.push(format!(
            "the commit log's batches hold {} records, the topic {} in their ranges",
            c.consumed, t.records
        ));
    }
    for (what, made, found) in [
        (
            "inserts (and key changes)",
            manifest.inserts + manifest.key_changes,
            inserted,
        ),
        ("updates", manifest.updates, t.updated),
        (
            "deletes (and key changes)",
            manifest.deletes + manifest.key_changes,
            t.deleted,
        ),
    ] {
        if made != found {
            problems.push(format!(
                "the workload made {made} {what}, the topic holds {found} distinct ones"
            ));
        }
    }
    if c.duplicates + c.stale != t.repeats {
        problems.push(format!(
            "the topic repeats {} changes, the job counted {} duplicates and {} stale",
            t.repeats, c.duplicates, c.stale
        ));
    }
    if c.applied + c.filtered + c.dead_letters != t.firsts() + t.unreadable {
        problems.push(format!(
            "the topic holds {} distinct changes, the job applied {}, filtered {} and dead-lettered {}",
            t.firsts() + t.unreadable,
            c.applied,
            c.filtered,
            c.dead_letters
        ));
    }
    if c.tombstones != t.tombstones {
        problems.push(format!(
            "the topic holds {} tombstones, the job counted {}",
            t.tombstones, c.tombstones
        ));
    }
    if in_dlq != c.dead_letters {
        problems.push(format!(
            "the dead-letter topic holds {in_dlq} records, the commit log counts {}",
            c.dead_letters
        ));
    }
    println!(
        "changes made by the workload {}: {} inserts, {} updates, {} deletes, {} key changes (a delete and a create each); {} snapshots asked for",
        manifest.change_events(),
        manifest.inserts,
        manifest.updates,
        manifest.deletes,
        manifest.key_changes,
        manifest.snapshots
    );
    println!(
        "in the topic up to the job's cut: {} records: {} creates, {} updates, {} deletes, {} reads of the first snapshot, {} of later ones, {} repeated, {} tombstones, {} unreadable",
        t.records,
        t.created,
        t.updated,
        t.deleted,
        t.read_first,
        t.read,
        t.repeats,
        t.tombstones,
        t.unreadable
    );
    println!(
        "the job: {} consumed: {} applied, {} filtered, {} duplicates, {} stale, {} tombstones, {} dead-lettered (late included)",
        c.consumed, c.applied, c.filtered, c.duplicates, c.stale, c.tombstones, c.dead_letters
    );
    let reconciled = super::reconcile::reconcile_source(
        config,
        None,
        &ReconcileFilter {
            from_ms: None,
            to_ms: None,
            customer: None,
        },
        std::time::Duration::from_secs(60),
        true,
    )
    .await?;
    if reconciled.fails(true) {
        problems.push(format!(
            "the view differs from the source table in {} windows",
            reconciled.settled.mismatched + reconciled.open.mismatched
        ));
    }
    println!(
        "verify-summary changes_made={} changes_in_topic={} snapshot_reads={} repeated={} applied={} filtered={} duplicates={} stale={} tombstones={} dead_lettered={} dl_found={in_dlq} windows={} windows_differ={}",
        manifest.change_events(),
        changes_in_topic + t.read_first,
        t.read + t.read_first,
        t.repeats,
        c.applied,
        c.filtered,
        c.duplicates,
        c.stale,
        c.tombstones,
        c.dead_letters,
        reconciled.compared(),
        reconciled.settled.mismatched + reconciled.open.mismatched
    );
    for p in &problems {
        println!("  {p}");
    }
    let ok = problems.is_empty();
    println!(
        "verify: {}",
        if ok {
            "OK: every change applied once, the view equals the source table"
        } else {
            "FAILED"
        }
    );
    Ok(ok)
}
