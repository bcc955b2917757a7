//! The source's partitions: tally's own topics grown to match them, partitions added to the
//! source found while the worker runs, each registered in ClickHouse before any of its records
//! is consumed (folding waits for its watermark) and joined at the job's watermark.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, Receiver};

use anyhow::Result;
use tally_clickhouse::{ClickHouseSink, SinkSettings};
use tally_core::PartitionId;
use tally_kafka::{KafkaSettings, SourceConsumer, StartFrom};
use tokio::runtime::Handle;

use crate::background::Background;
use crate::retry::sleep_unless_stopped;
use crate::settings::{JobSettings, JobTopics, TaskSettings};

/// The changelog is the job's state: nothing expires by time or size (tally truncates it
/// below the restore points it commits), and records may be as large as the producer allows.
pub const CHANGELOG_TOPIC_CONFIG: &[(&str, &str)] = &[
    ("cleanup.policy", "delete"),
    ("retention.ms", "-1"),
    ("retention.bytes", "-1"),
    ("max.message.bytes", "16777216"),
];

/// Creates tally's own topics, one partition per source partition (the dead-letter topic and
/// the changelog), or grows them to `partitions` when the source topic grew. One attempt.
pub fn ensure_own_topics(
    topics: &JobTopics,
    kafka: &KafkaSettings,
    rt: &Handle,
    partitions: usize,
) -> Result<(), tally_kafka::Error> {
    let spec = |name, configs| tally_kafka::TopicSpec {
        name,
        partitions,
        replication: topics.replication_factor,
        configs,
    };
    let specs = [
        spec(
            &topics.dead_letters,
            &[("max.message.bytes", "16777216")][..],
        ),
        spec(&topics.changelog, CHANGELOG_TOPIC_CONFIG),
    ];
    let changes = rt.block_on(tally_kafka::ensure_topics(kafka, &specs))?;
    for ((spec, change), what) in specs.iter().zip(changes).zip(["dead-letter", "changelog"]) {
        match change {
            tally_kafka::TopicChange::Existed => {}
            tally_kafka::TopicChange::Created => {
                tracing::info!(topic = spec.name, "created {what} topic")
            }
            tally_kafka::TopicChange::Grew { from } => {
                tracing::info!(
                    topic = spec.name,
                    from,
                    partitions,
                    "grew the {what} topic to the source topic's partitions"
                )
            }
        }
    }
    Ok(())
}

/// Looks for partitions added to the source topic every `kafka.partition_discovery_interval`,
/// on a thread with a client of its own (a metadata request on the consuming client waits
/// behind its fetches). tally's own topics grow first; then each new partition goes to the
/// operator with its earliest offset. Dropping the guard stops the thread.
pub(crate) fn start_partition_discovery(
    job: &Arc<JobSettings>,
    task: &TaskSettings,
    rt: &Handle,
    mut known: Vec<PartitionId>,
) -> Result<Option<(Background, Receiver<AddedPartitions>)>> {
    let every = job.partition_discovery_interval;
    if every.is_zero() {
        return Ok(None);
    }
    let source = &job.source;
    let client =
        SourceConsumer::connect(&source.kafka, &source.source_topic, &source.consumer_group)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel();
    let thread = {
        let (job, task, rt) = (job.clone(), task.clone(), rt.clone());
        Background::spawn("tally-discover", stop.clone(), move || {
            let mut sink: Option<ClickHouseSink> = None;
            while sleep_unless_stopped(&stop, every, "partitions").is_ok() {
                let current = match client.partitions() {
                    Ok(current) => current,
                    Err(e) => {
                        tracing::debug!(error = %e, "could not read the source topic's partitions; trying again later");
                        continue;
                    }
                };
                let new: Vec<PartitionId> = current
                    .iter()
                    .copied()
                    .filter(|p| !known.contains(p) && task.owns(*p))
                    .collect();
                if new.is_empty() {
                    continue;
                }
                // Registered before any of their records is consumed, whichever task runs
                // them: folding waits for them from now on, and they join at the job's
                // watermark.
                let grown = ensure_own_topics(&job.topics, &job.source.kafka, &rt, current.len())
                    .map_err(anyhow::Error::from)
                    .and_then(|()| register_added(&rt, &job.sink, &mut sink, &current))
                    .and_then(|joining| {
                        new.iter()
                            .map(|&p| {
                                Ok((p, client.resolve_start(p, StartFrom::Earliest)?, joining))
                            })
                            .collect::<Result<AddedPartitions>>()
                    });
                match grown {
                    Ok(added) => {
                        if tx.send(added).is_err() {
                            return;
                        }
                        known.extend(new);
                    }
                    Err(e) => {
                        tracing::warn!(partitions = ?new, error = %format!("{e:#}"), "partitions were added to the source topic, but tally could not prepare them yet; trying again later")
                    }
                }
            }
        })?
    };
    Ok(Some((thread, rx)))
}

/// Registers the source topic's `current` partitions in ClickHouse through `sink` (connected
/// first if need be) and returns the watermark added ones join the job at.
fn register_added(
    rt: &Handle,
    settings: &SinkSettings,
    sink: &mut Option<ClickHouseSink>,
    current: &[PartitionId],
) -> Result<Option<i64>> {
    let client = match sink.take() {
        Some(client) => client,
        None => rt.block_on(ClickHouseSink::connect(settings))?,
    };
    let joining = rt.block_on(async {
        client.register_partitions(current).await?;
        client.joining_watermark().await
    });
    // A failed connection is made again next time.
    if joining.is_ok() {
        *sink = Some(client);
    }
    Ok(joining?)
}

/// Partitions added to the source topic, each with the offset it starts at and the watermark
/// it joins the job at (`None`: no watermark committed yet).
pub type AddedPartitions = Vec<(PartitionId, i64, Option<i64>)>;
