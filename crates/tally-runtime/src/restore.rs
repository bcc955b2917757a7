//! `tally restore`: rebuilds an empty state directory from the job's changelog, for a worker on
//! a machine that never held the job (the one that did is lost). The result is exactly the
//! state of the last epoch the group committed; the directory then continues the commits of
//! the writer it was restored from. [`catch_up`] brings a directory that holds an earlier
//! committed state of the job (a standby's) to the last epoch, reading only what came since.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use rdkafka::Message;
use tally_clickhouse::ClickHouseSink;
use tally_core::{Epoch, PartitionId};
use tally_kafka::{CommitMark, SourceConsumer};
use tally_state::StateStore;
use tally_state::replay::{Replay, ReplayError};
use tokio::runtime::Handle;

use crate::retry::{Failure, wait_for};
use crate::settings::{JobSettings, TaskSettings};

pub use crate::events::Restored;

/// Restores into `task`'s state directory, which must hold no checkpoint, the epoch the group's `marks`
/// (`crate::marks::commit_marks`) name. The state is built in a
/// sibling directory and moved into place when complete, so a failed or interrupted restore
/// leaves nothing behind and can simply be run again.
///
/// `check_sink`: whether the last epoch must be complete in ClickHouse or be kept pending (for a
/// directory that runs the job next); a standby's round passes false and leaves that to its
/// takeover, since the running worker may be writing that batch just now.
pub fn restore(
    settings: &JobSettings,
    task: &TaskSettings,
    rt: &tokio::runtime::Handle,
    marks: &BTreeMap<PartitionId, CommitMark>,
    stop: Option<&AtomicBool>,
    check_sink: bool,
) -> Result<Restored> {
    let dir = &task.state_dir;
    if dir.exists()
        && let Some(meta) = StateStore::open(dir, &task.state_identity)?.meta()
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
    let restored = restore_into(settings, task, rt, &staging, marks, stop, check_sink);
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

/// The group's committed state of the job: the epoch of its last commit, the writer that made
/// it, and each partition's mark.
struct Committed {
    epoch: Epoch,
    writer: String,
    marks: BTreeMap<PartitionId, CommitMark>,
}

/// The job's committed state from the group's commit marks (`crate::marks::commit_marks`).
fn committed(marks: &BTreeMap<PartitionId, CommitMark>) -> Result<Option<Committed>> {
    let marks = marks.clone();
    let Some(last) = marks.values().max_by_key(|m| m.epoch).cloned() else {
        return Ok(None);
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
    Ok(Some(Committed {
        epoch,
        writer,
        marks,
    }))
}

fn restore_into(
    settings: &JobSettings,
    task: &TaskSettings,
    rt: &tokio::runtime::Handle,
    dir: &Path,
    marks: &BTreeMap<PartitionId, CommitMark>,
    stop: Option<&AtomicBool>,
    check_sink: bool,
) -> Result<Restored> {
    let started = Instant::now();
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let store = StateStore::open_for(dir, &task.state_identity, &settings.commit.row_shape)?;
    let Some(job) = committed(marks)? else {
        bail!(
            "consumer group {} has no commits of this job: there is nothing to restore; `tally run` starts the job",
            settings.source.consumer_group
        );
    };
    // From each partition's committed restore point: everything before it is dead.
    let starts = job
        .marks
        .iter()
        .map(|(&p, m)| (p, m.restore_from.unwrap_or(0)))
        .collect();
    let replay = Replay::whole(&store, settings.commit.window_size_ms, job.epoch, starts);
    replay_and_finish(settings, rt, &job, replay, started, stop, check_sink)?
        .ok_or_else(|| anyhow!("a whole restore reads the last epoch"))
}

/// Brings `task`'s state directory, which holds an earlier committed state of the job, up to the
/// group's last commit by replaying only the changelog records committed since. `Ok(None)`:
/// the directory cannot be caught up (it is empty, holds pre-committed epochs, or diverged)
/// and needs a whole [`restore`]. `taking_over`: this worker fenced the previous one and runs
/// the job next, so the last epoch must be complete in ClickHouse or left pending. A catch-up
/// is not interruptible (it reads what was committed since the last one); one that fails or
/// dies half-way leaves the directory marked, and the next needs a whole restore.
pub fn catch_up(
    settings: &JobSettings,
    task: &TaskSettings,
    rt: &tokio::runtime::Handle,
    marks: &BTreeMap<PartitionId, CommitMark>,
    taking_over: bool,
) -> Result<Option<Restored>> {
    let started = Instant::now();
    let Some(job) = committed(marks)? else {
        return Ok(None);
    };
    let dir = &task.state_dir;
    if !dir.exists() {
        return Ok(None);
    }
    let store = StateStore::open_for(dir, &task.state_identity, &settings.commit.row_shape)?;
    let partitions: Vec<PartitionId> = job.marks.keys().copied().collect();
    let replay = match Replay::continuing(
        &store,
        settings.commit.window_size_ms,
        job.epoch,
        &partitions,
    ) {
        Ok(replay) => replay,
        Err(ReplayError::NotContinuable(why)) => {
            tracing::debug!(reason = %why, "the state directory needs a whole restore");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    replay_and_finish(settings, rt, &job, replay, started, None, taking_over)
}

/// Reads the changelog from the replay's starts, applies it, checks every partition reached
/// the committed epoch, keeps that epoch pending if ClickHouse lacks its batch, and finishes.
fn replay_and_finish(
    settings: &JobSettings,
    rt: &tokio::runtime::Handle,
    job: &Committed,
    mut replay: Replay<'_>,
    started: Instant,
    stop: Option<&AtomicBool>,
    check_sink: bool,
) -> Result<Option<Restored>> {
    let topic = &settings.topics.changelog;
    let kafka = &settings.source.kafka;
    if !replay.is_current() {
        let ranges = replay
            .starts()
            .iter()
            .map(|(&p, &from)| (p, (from, None)))
            .collect();
        let mut failure = None;
        tally_kafka::read_committed_range(kafka, topic, &ranges, Duration::from_secs(30), |m| {
            if failure.is_some() {
                return;
            }
            if stop.is_some_and(|s| s.load(Ordering::SeqCst)) {
                failure = Some(anyhow!(crate::retry::Interrupted("the changelog")));
                return;
            }
            let bytes = m.payload().unwrap_or_default();
            if let Err(e) = replay.apply(m.partition(), m.offset(), bytes) {
                failure = Some(anyhow!(e).context(format!(
                    "{topic} partition {} offset {}",
                    m.partition(),
                    m.offset()
                )));
            }
        })
        .with_context(|| format!("reading changelog {topic}"))?;
        if let Some(e) = failure {
            return Err(e.context(format!("restoring from changelog {topic}")));
        }
    }
    replay
        .check_complete()
        .with_context(|| format!("restoring from changelog {topic}"))?;
    // A takeover (and a whole restore) must leave the last epoch pending if ClickHouse lacks
    // its batch; a standby's catch-up leaves that to its takeover.
    let pending = if check_sink {
        let sink = rt.block_on(ClickHouseSink::connect(&settings.sink))?;
        match replay.last_epoch() {
            Some(last) => {
                let batch = settings.commit.batch_of(&last);
                if rt.block_on(sink.is_committed(&batch))? {
                    None
                } else {
                    Some(last)
                }
            }
            // Applied by an earlier catch-up: its records are not at hand here, but the
            // directory's offsets say whether ClickHouse has its batch.
            None => {
                let have = rt.block_on(sink.committed_offsets())?;
                let lacking = replay.store().meta().is_some_and(|m| {
                    m.partitions
                        .iter()
                        .any(|(p, c)| have.get(p).is_none_or(|o| *o < c.next_offset))
                });
                if lacking {
                    tracing::info!(epoch = %job.epoch, "the last epoch's batch is not in ClickHouse and a standby round applied it: restoring whole, which keeps it to write first");
                    return Ok(None);
                }
                None
            }
        }
    } else {
        None
    };
    let stats = replay.finish(&job.writer, pending.as_ref())?;
    Ok(Some(Restored {
        epoch: job.epoch,
        writer: job.writer.clone(),
        partitions: job.marks.len(),
        records: stats.records,
        bytes: stats.bytes,
        windows: stats.windows,
        ids: stats.ids,
        pending: pending.is_some(),
        duration: started.elapsed(),
    }))
}

/// Keeps the state directory if it holds the job's state (the commits are its own, or those of
/// the writer it was restored from, up to the last); catches it up with the changelog if it
/// holds an earlier committed state; otherwise moves it aside and restores the job's state from
/// the changelog. `taking_over`: this worker fenced the previous one and runs the job next; a
/// standby's rounds pass false. `stop` interrupts a whole restore (nothing is left behind).
pub fn make_state_current(
    settings: &JobSettings,
    task: &TaskSettings,
    rt: &Handle,
    reader: &SourceConsumer,
    stop: &AtomicBool,
    taking_over: bool,
) -> Result<()> {
    let marks = wait_for("kafka", stop, || {
        crate::marks::commit_marks(reader, settings, task).map_err(Failure::Transient)
    })?;
    if marks.is_empty() {
        // A new job (or one started over): nothing to restore.
        return Ok(());
    }
    let dir = &task.state_dir;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let (local, foreign, replica) = {
        let store = StateStore::open_for(dir, &task.state_identity, &settings.commit.row_shape)?;
        let ours = store.writer_id().to_owned();
        // The last commit is the writer's this directory was restored from: the batch of
        // that epoch may still be missing in ClickHouse, which a catch-up checks.
        let replica = marks
            .values()
            .any(|m| m.writer.as_deref().is_some_and(|w| w != ours));
        (
            store.meta().map(|m| m.epoch),
            crate::marks::foreign_mark(&marks, &store)?,
            replica,
        )
    };
    match (local, foreign) {
        (Some(_), None) if !(taking_over && replica) => return Ok(()),
        (None, _) => {}
        (Some(epoch), foreign) => {
            if let Some(done) = try_catch_up(settings, task, rt, &marks, stop, taking_over)? {
                crate::events::StateRestored {
                    restored: &done,
                    whole: false,
                    taking_over,
                    task: task.task,
                }
                .emit();
                return Ok(());
            }
            let aside = sibling(dir, &format!("stale-epoch-{epoch}"));
            let (partition, mark) = foreign.unzip();
            tracing::warn!(
                partition,
                committed_epoch = %mark.as_ref().map_or(epoch, |m| m.epoch),
                writer = mark.as_ref().and_then(|m| m.writer.as_deref()).unwrap_or(""),
                moved_to = %aside.display(),
                "the state directory cannot be caught up with the job's changelog: moving it aside and restoring the job's state whole"
            );
            if aside.exists() {
                std::fs::remove_dir_all(&aside)
                    .with_context(|| format!("removing {}", aside.display()))?;
            }
            std::fs::rename(dir, &aside).with_context(|| {
                format!("moving {} aside to {}", dir.display(), aside.display())
            })?;
        }
    }
    // A service failing mid-restore is waited out (a failed attempt leaves nothing behind);
    // a changelog that cannot give the job's state stops the worker with the reason.
    let done = wait_for("the changelog restore", stop, || {
        match restore(settings, task, rt, &marks, Some(stop), taking_over) {
            Ok(done) => Ok(done),
            Err(e) if is_transient(&e) => Err(Failure::Transient(e)),
            Err(e) => Err(Failure::Permanent(e.context(
                "restoring the job's state from the changelog on taking its lease",
            ))),
        }
    })?;
    crate::events::StateRestored {
        restored: &done,
        whole: true,
        taking_over,
        task: task.task,
    }
    .emit();
    Ok(())
}

/// A catch-up, with a failing service waited out. `None`: the directory needs a whole restore
/// (it cannot be caught up, or the changelog does not continue its state).
fn try_catch_up(
    settings: &JobSettings,
    task: &TaskSettings,
    rt: &Handle,
    marks: &BTreeMap<PartitionId, CommitMark>,
    stop: &AtomicBool,
    taking_over: bool,
) -> Result<Option<Restored>> {
    wait_for("the changelog catch-up", stop, || {
        match catch_up(settings, task, rt, marks, taking_over) {
            Ok(done) => Ok(done),
            Err(e) if is_transient(&e) => Err(Failure::Transient(e)),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the state directory cannot be caught up with the changelog");
                Ok(None)
            }
        }
    })
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
