//! The commit marks: each epoch's transaction commits the group's offsets with a mark naming its
//! epoch and writer (`tally:epoch=N;writer=W`), so the group's offsets say which epoch Kafka
//! last committed, and whose. This module reads them and checks them against a state directory.

use std::collections::BTreeMap;

use anyhow::Result;
use tally_core::{Epoch, PartitionId};
use tally_kafka::{CommitMark, SourceConsumer};
use tally_state::{StateError, StateStore};

use crate::settings::{JobSettings, TaskSettings};

/// Another state directory's worker commits this job. Two workers of one job would each count
/// every record (and fence each other's transactions back and forth), so this one stops.
#[derive(Debug, thiserror::Error)]
#[error(
    "another worker commits job {job}: partition {partition} of {topic} was last committed (epoch {epoch}) by writer {other}, \
     and this worker's state directory {state_dir} is writer {ours}, not restored from it. That worker ran the job outside this one's lease \
     (all workers of a job must share its consumer group {group} and transactional id), so this one stops rather than count twice. \
     If that worker is gone for good: move its state directory here (it carries its writer id), \
     or rebuild the job's state from the changelog with `tally restore` into an empty state directory"
)]
pub struct AnotherWriter {
    job: String,
    topic: String,
    partition: PartitionId,
    epoch: Epoch,
    other: String,
    ours: String,
    state_dir: String,
    group: String,
}

/// The first partition whose offsets were last committed by a writer that is neither this
/// directory's nor the one it was restored from (up to the epoch it restored).
pub fn foreign_mark(
    marks: &BTreeMap<PartitionId, CommitMark>,
    store: &StateStore,
) -> Result<Option<(PartitionId, CommitMark)>, StateError> {
    let ours = store.writer_id();
    let adopted = store.adopted_writer()?;
    Ok(marks
        .iter()
        .find(|(_, mark)| {
            mark.writer.as_deref().is_some_and(|w| {
                w != ours
                    && adopted
                        .as_ref()
                        .is_none_or(|(a, epoch)| a != w || mark.epoch > *epoch)
            })
        })
        .map(|(p, m)| (*p, m.clone())))
}

/// `Err` when any partition's offsets were last committed by another writer than `store`'s
/// lineage: another worker commits the job.
pub fn refuse_another_writer(
    marks: &BTreeMap<PartitionId, CommitMark>,
    store: &StateStore,
    job: &JobSettings,
) -> Result<()> {
    match foreign_mark(marks, store)? {
        None => Ok(()),
        Some((partition, mark)) => Err(AnotherWriter {
            job: job.name.clone(),
            topic: job.source.source_topic.clone(),
            partition,
            epoch: mark.epoch,
            other: mark.writer.unwrap_or_default(),
            ours: store.writer_id().to_owned(),
            state_dir: store.path().display().to_string(),
            group: job.source.consumer_group.clone(),
        }
        .into()),
    }
}

/// The newest epoch the group's offsets say Kafka committed.
pub fn newest_epoch(marks: &BTreeMap<PartitionId, CommitMark>) -> Option<Epoch> {
    marks.values().map(|m| m.epoch).max()
}

/// [`commit_marks`] through a client of its own.
pub fn job_commit_marks(
    job: &JobSettings,
    task: &TaskSettings,
) -> Result<BTreeMap<PartitionId, CommitMark>> {
    let source = &job.source;
    let reader =
        SourceConsumer::connect(&source.kafka, &source.source_topic, &source.consumer_group)?;
    commit_marks(&reader, job, task)
}

/// The group's committed offsets of the source partitions `task` runs, each with the mark of
/// its transaction.
pub fn commit_marks(
    member: &SourceConsumer,
    job: &JobSettings,
    task: &TaskSettings,
) -> Result<BTreeMap<PartitionId, CommitMark>> {
    Ok(marks_of(committed_offsets(member, job, task)?))
}

/// The marks of [`committed_offsets`].
pub fn marks_of(
    committed: BTreeMap<PartitionId, (i64, CommitMark)>,
) -> BTreeMap<PartitionId, CommitMark> {
    committed
        .into_iter()
        .map(|(p, (_, mark))| (p, mark))
        .collect()
}

/// [`commit_marks`] with each partition's committed offset.
pub fn committed_offsets(
    member: &SourceConsumer,
    job: &JobSettings,
    task: &TaskSettings,
) -> Result<BTreeMap<PartitionId, (i64, CommitMark)>, tally_kafka::Error> {
    let partitions: Vec<PartitionId> = member
        .partitions()?
        .into_iter()
        .filter(|p| task.owns(*p))
        .collect();
    let committed = member.committed(&partitions).inspect_err(|error| {
        if matches!(error, tally_kafka::Error::UnstableOffsets { .. }) {
            crate::events::OffsetsHeldByOpenTransaction {
                error,
                brokers: &job.source.kafka.brokers,
                transactional_id: &task.transactional_id,
                task: task.task,
            }
            .emit();
        }
    })?;
    Ok(committed
        .into_iter()
        .filter_map(|(p, (offset, metadata))| Some((p, (offset?, CommitMark::parse(&metadata)?))))
        .collect())
}
