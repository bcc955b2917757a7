//! `tally restore`: rebuilds an empty state directory from the job's changelog, for a worker on
//! a machine that never held the job (the one that did is lost). The result is exactly the
//! state of the last epoch the group committed; the directory then continues the commits of
//! the writer it was restored from.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use rdkafka::Message;
use tally_clickhouse::ClickHouseSink;
use tally_core::{Checkpoint, Epoch, PartitionId};
use tally_kafka::{CommitMark, Source};
use tally_state::StateStore;
use tally_state::changelog::{ChainCheck, ChangelogRecord, Liveness, RestorePoints};

use crate::config::Config;

/// What a restore read and rebuilt.
#[derive(Debug)]
pub struct Restored {
    pub epoch: Epoch,
    pub writer: String,
    pub partitions: usize,
    pub records: u64,
    pub bytes: u64,
    pub windows: u64,
    pub ids: u64,
    /// The last epoch is not in ClickHouse yet: the next `tally run` writes it.
    pub pending: bool,
    pub duration: Duration,
}

/// Restores into `job.state_dir`, which must hold no checkpoint. The state is built in a
/// sibling directory and moved into place when complete, so a failed or interrupted restore
/// leaves nothing behind and can simply be run again.
pub fn restore(config: &Config, rt: &tokio::runtime::Handle) -> Result<Restored> {
    let dir = &config.job.state_dir;
    if dir.exists()
        && let Some(meta) = StateStore::open(dir, &config.state_identity())?.meta()
    {
        bail!(
            "state directory {} already holds a checkpoint (epoch {}): restore only into an empty directory; move this one away first",
            dir.display(),
            meta.epoch
        );
    }
    let staging = sibling(dir, "restoring");
    let clear = |path: &Path| -> Result<()> {
        if path.exists() {
            std::fs::remove_dir_all(path)
                .with_context(|| format!("removing {}", path.display()))?;
        }
        Ok(())
    };
    clear(&staging)?;
    let restored = restore_into(config, rt, &staging);
    if restored.is_err() {
        // Best effort: the next attempt clears it first anyway.
        let _ = clear(&staging);
    }
    let restored = restored?;
    clear(dir)?;
    std::fs::rename(&staging, dir).with_context(|| {
        format!(
            "moving the restored state from {} to {}",
            staging.display(),
            dir.display()
        )
    })?;
    Ok(restored)
}

/// `<dir>.<suffix>`, beside `dir`.
pub fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map_or_else(|| "state".into(), |n| n.to_string_lossy());
    dir.with_file_name(format!("{name}.{suffix}"))
}

fn restore_into(config: &Config, rt: &tokio::runtime::Handle, dir: &Path) -> Result<Restored> {
    let started = Instant::now();
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let store = StateStore::open(dir, &config.state_identity())?;
    let kafka = config.kafka_settings();
    let group = Source::connect(
        &kafka,
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
    )?;
    let marks: BTreeMap<PartitionId, CommitMark> = group
        .committed(&group.partitions()?)?
        .into_iter()
        .filter_map(|(p, (_, metadata))| Some((p, CommitMark::parse(&metadata)?)))
        .collect();
    let Some(last) = marks.values().max_by_key(|m| m.epoch).cloned() else {
        bail!(
            "consumer group {} has no commits of this job: there is nothing to restore; `tally run` starts the job",
            config.kafka.consumer_group
        );
    };
    let epoch = last.epoch;
    let Some(writer) = last.writer else {
        bail!(
            "the job's last commit (epoch {epoch}) was made by a tally release without a changelog: it cannot be restored; restore the state directory from a backup, or start the job over"
        );
    };
    if let Some((p, m)) = marks.iter().find(|(_, m)| m.epoch != epoch) {
        bail!(
            "partition {p} was last committed at epoch {}, the others at {epoch}: the commits are not one worker's; restore needs every partition at the same epoch",
            m.epoch
        );
    }

    let window_size_ms = config.operator().window.size_ms;
    let topic = config.changelog_topic();
    // From each partition's committed restore point: everything before it is dead.
    let starts: BTreeMap<PartitionId, i64> = marks
        .iter()
        .map(|(&p, m)| (p, m.restore_from.unwrap_or(0)))
        .collect();
    let ranges = starts.iter().map(|(&p, &from)| (p, (from, None))).collect();
    let mut chains: BTreeMap<PartitionId, ChainCheck> = starts
        .iter()
        .map(|(&p, &from)| {
            let check = if from > 0 {
                ChainCheck::from_restore_point()
            } else {
                ChainCheck::default()
            };
            (p, check)
        })
        .collect();
    // What the restored directory's own restore points are rebuilt from.
    let mut epochs: BTreeMap<PartitionId, Vec<(i64, Liveness)>> = BTreeMap::new();
    let mut cutoffs: BTreeMap<PartitionId, (Option<i64>, Option<i64>)> = BTreeMap::new();
    let mut ends: BTreeMap<PartitionId, i64> = BTreeMap::new();
    // The records of the last epoch: its batch, should ClickHouse lack it.
    let mut last_epoch: Vec<Checkpoint> = Vec::new();
    let mut done = Restored {
        epoch,
        writer: writer.clone(),
        partitions: marks.len(),
        records: 0,
        bytes: 0,
        windows: 0,
        ids: 0,
        pending: false,
        duration: Duration::ZERO,
    };
    let mut failure = None;
    tally_kafka::read_committed_range(&kafka, &topic, &ranges, Duration::from_secs(30), |m| {
        if failure.is_some() {
            return;
        }
        let applied = (|| -> Result<()> {
            let bytes = m.payload().unwrap_or_default();
            let record = ChangelogRecord::decode(bytes).with_context(|| {
                format!("{topic} partition {} offset {}", m.partition(), m.offset())
            })?;
            if record.partition != m.partition() {
                bail!(
                    "{topic} partition {} offset {} holds a record of partition {}",
                    m.partition(),
                    m.offset(),
                    record.partition
                );
            }
            // Committed after the group's offsets were read: not part of what is restored.
            if record.epoch > epoch {
                return Ok(());
            }
            chains
                .entry(record.partition)
                .or_default()
                .accept(&record)?;
            let p = record.partition;
            let liveness = Liveness::of_record(&record);
            let list = epochs.entry(p).or_default();
            match list.last_mut() {
                Some((_, merged)) if record.chunk > 0 => *merged = merged.merge(liveness),
                _ => list.push((m.offset(), liveness)),
            }
            cutoffs.insert(p, (record.close_windows_before, record.expire_seen_before));
            ends.insert(p, m.offset() + 1);
            let checkpoint = record.to_checkpoint(window_size_ms);
            store.apply_restored(&checkpoint)?;
            done.records += 1;
            done.bytes += bytes.len() as u64;
            done.windows += record.windows.len() as u64;
            done.ids += record.seen.len() as u64;
            if record.epoch == epoch {
                last_epoch.push(checkpoint);
            }
            Ok(())
        })();
        if let Err(e) = applied {
            failure = Some(e);
        }
    })
    .with_context(|| format!("reading changelog {topic}"))?;
    if let Some(e) = failure {
        return Err(e.context(format!("restoring from changelog {topic}")));
    }
    for &p in marks.keys() {
        let reached = chains.get(&p).map(|c| c.finish(p)).transpose()?.flatten();
        if reached != Some(epoch) {
            bail!(
                "changelog {topic} partition {p} ends at {}, but the group committed epoch {epoch}: the changelog is incomplete (deleted or written by another job)",
                reached.map_or("no record".to_string(), |e| format!("epoch {e}"))
            );
        }
    }

    let sink = rt.block_on(ClickHouseSink::connect(&config.sink_settings()))?;
    let in_clickhouse = rt.block_on(sink.is_committed(epoch))?;
    let pending = (!in_clickhouse).then(|| merge(epoch, last_epoch));
    done.pending = pending.is_some();
    store
        .finish_restore(epoch, pending.as_ref(), (&writer, epoch))
        .map_err(|e| anyhow!(e))?;
    store.save_restore_points(&RestorePoints::rebuilt(&epochs, &cutoffs, &ends))?;
    done.duration = started.elapsed();
    Ok(done)
}

/// One epoch's checkpoint from its per-partition records: what its ClickHouse batch needs.
fn merge(epoch: Epoch, parts: Vec<Checkpoint>) -> Checkpoint {
    let mut merged = Checkpoint {
        epoch,
        ..Checkpoint::default()
    };
    for part in parts {
        merged.partitions.extend(part.partitions);
        merged.rows.extend(part.rows);
        merged
            .close_windows_before
            .extend(part.close_windows_before);
        merged.expire_seen_before.extend(part.expire_seen_before);
    }
    // Chunks of one partition repeat its cutoffs.
    merged.close_windows_before.dedup();
    merged.expire_seen_before.dedup();
    merged
        .rows
        .sort_by(|a, b| (a.partition, &a.key).cmp(&(b.partition, &b.key)));
    merged
}

/// Whether a restore failed on a service (worth retrying) rather than on what it found.
pub fn is_transient(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<tally_kafka::Error>()
            .is_some_and(|e| !matches!(e, tally_kafka::Error::Refused(_)))
            || cause
                .downcast_ref::<tally_clickhouse::SinkError>()
                .is_some_and(|e| matches!(e, tally_clickhouse::SinkError::Server { .. }))
    })
}
