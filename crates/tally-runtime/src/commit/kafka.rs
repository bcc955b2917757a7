//! The epoch's Kafka side, by the real clients: the job's transactional producer, the group's
//! committed offsets, and the changelog's truncation.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Result;
use tally_core::PartitionId;
use tally_kafka::{
    CommitMark, EpochCommit, EpochProducer, KafkaSettings, RecordDeleter, SourceConsumer,
    UnfencedProducer,
};
use tokio::runtime::Handle;

use super::sinks::EpochTransactions;
use crate::background::Background;
use crate::events::ChangelogTruncated;
use crate::retry::Failure;
use crate::settings::{JobSettings, TaskSettings};

/// How often the changelog is truncated below the committed restore points.
const TRUNCATE_EVERY: Duration = Duration::from_secs(30);

/// [`EpochTransactions`] by the job's transactional producer and a client of its group.
pub struct KafkaTransactions {
    job: Arc<JobSettings>,
    task: TaskSettings,
    producer: Option<EpochProducer>,
    /// The producer that fenced the job's previous worker when this one took the lease.
    fencing: Option<EpochProducer>,
    /// This worker's member of the job's group (it holds the job's lease): it gives the group
    /// metadata for the transactions.
    group: Arc<SourceConsumer>,
    /// A client of the group that fetches nothing, for committed offsets and the changelog's
    /// end: a request on the member's connection waits behind its long-polling fetch (up to
    /// 500 ms each).
    offsets: SourceConsumer,
    truncator: ChangelogTruncator,
}

impl KafkaTransactions {
    pub fn new(
        job: &Arc<JobSettings>,
        task: &TaskSettings,
        rt: Handle,
        group: Arc<SourceConsumer>,
        fencing: Option<EpochProducer>,
    ) -> Result<KafkaTransactions> {
        let source = &job.source;
        Ok(KafkaTransactions {
            job: job.clone(),
            task: task.clone(),
            producer: None,
            fencing,
            group,
            offsets: SourceConsumer::connect(
                &source.kafka,
                &source.source_topic,
                &source.consumer_group,
            )?,
            truncator: ChangelogTruncator::start(
                rt,
                source.kafka.clone(),
                job.topics.changelog.clone(),
            )?,
        })
    }

    fn group_metadata(&self) -> Result<rdkafka::consumer::ConsumerGroupMetadata, Failure> {
        use rdkafka::consumer::Consumer;
        self.group.consumer().group_metadata().ok_or_else(|| {
            Failure::permanent(anyhow::anyhow!(
                "consumer has no group metadata; is kafka.consumer_group set?"
            ))
        })
    }

    fn producer(&self) -> Result<&EpochProducer, Failure> {
        self.producer
            .as_ref()
            .ok_or_else(|| Failure::transient(anyhow::anyhow!("no transactional producer")))
    }
}

impl EpochTransactions for KafkaTransactions {
    fn committed(&self) -> Result<BTreeMap<PartitionId, (i64, CommitMark)>, Failure> {
        Ok(crate::marks::committed_offsets(
            &self.offsets,
            &self.job,
            &self.task,
        )?)
    }

    fn has_producer(&self) -> bool {
        self.producer.is_some()
    }

    fn adopt_fencing_producer(&mut self) -> bool {
        match self.fencing.take() {
            Some(producer) => {
                self.producer = Some(producer);
                true
            }
            None => false,
        }
    }

    fn fence(&mut self) -> Result<(), Failure> {
        let producer = crate::lease::unfenced_producer(&self.job, &self.task)
            .and_then(UnfencedProducer::fence)?;
        self.producer = Some(producer);
        Ok(())
    }

    fn reset(&mut self) {
        self.producer = None;
    }

    fn commit(&mut self, epoch: &EpochCommit<'_>) -> Result<(), Failure> {
        let group = self.group_metadata()?;
        Ok(self.producer()?.commit_epoch(epoch, group)?)
    }

    fn write_then_abort(&mut self, epoch: &EpochCommit<'_>) -> Result<(), Failure> {
        let group = self.group_metadata()?;
        Ok(self.producer()?.write_then_abort_epoch(epoch, group)?)
    }

    fn changelog_ends(
        &self,
        partitions: &[PartitionId],
    ) -> Result<BTreeMap<PartitionId, i64>, Failure> {
        Ok(self
            .offsets
            .end_offsets(&self.job.topics.changelog, partitions.iter().copied())?)
    }

    fn truncate_changelog(&mut self, before: BTreeMap<PartitionId, i64>) {
        self.truncator.request(before);
    }
}

/// Truncates the changelog below the committed restore points, at most every
/// [`TRUNCATE_EVERY`], on a thread of its own with one admin client: on the commit path, a
/// `DeleteRecords` through a new client now and then took over a second (`changelog_ms` in the
/// commit line), and every commit behind it waited. Failures cost only a longer restore; a stop
/// waits for the request in progress.
pub struct ChangelogTruncator {
    /// Declared before the thread: dropped first, it ends the thread's loop, then the join.
    requests: mpsc::SyncSender<BTreeMap<PartitionId, i64>>,
    _thread: Background,
    /// When a truncation was last asked for.
    asked_at: Option<Instant>,
}

impl ChangelogTruncator {
    fn start(rt: Handle, kafka: KafkaSettings, topic: String) -> Result<ChangelogTruncator> {
        let (requests, pending) = mpsc::sync_channel::<BTreeMap<PartitionId, i64>>(1);
        // The thread ends when `requests` closes; the flag is not needed.
        let thread = Background::spawn("tally-truncate", Arc::default(), move || {
            let mut deleter: Option<RecordDeleter> = None;
            for before in pending {
                let started = Instant::now();
                let deleted = match deleter
                    .take()
                    .map_or_else(|| RecordDeleter::connect(&kafka), Ok)
                {
                    Ok(d) => rt.block_on(d.delete_before(&topic, &before)).map(|()| d),
                    Err(e) => Err(e),
                };
                match deleted {
                    Ok(d) => {
                        deleter = Some(d);
                        ChangelogTruncated {
                            before: &before,
                            took: started.elapsed(),
                        }
                        .emit();
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not truncate the changelog; retrying later")
                    }
                }
            }
        })?;
        Ok(ChangelogTruncator {
            requests,
            _thread: thread,
            asked_at: None,
        })
    }

    /// Asks for the records below `before` to be deleted, unless a truncation was asked for
    /// within [`TRUNCATE_EVERY`] or is still in progress: a later one carries newer points.
    fn request(&mut self, before: BTreeMap<PartitionId, i64>) {
        if before.is_empty() || self.asked_at.is_some_and(|t| t.elapsed() < TRUNCATE_EVERY) {
            return;
        }
        if self.requests.try_send(before).is_ok() {
            self.asked_at = Some(Instant::now());
        }
    }
}
