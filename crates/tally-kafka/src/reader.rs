//! Bounded read_committed reads, for verification and reconciliation.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use rdkafka::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Message, Offset as KOffset, TopicPartitionList};
use tally_core::{Offset, PartitionId};

use crate::error::{Error, Result, kafka};
use crate::settings::KafkaSettings;

/// Logs client errors except end-of-partition, which readers ask for and expect.
struct ReaderContext;

impl ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let eof = matches!(
            error,
            KafkaError::PartitionEOF(_) | KafkaError::Global(RDKafkaErrorCode::PartitionEOF)
        );
        if !eof {
            tracing::warn!(error = %error, reason, "kafka reader");
        }
    }
}

impl ConsumerContext for ReaderContext {}

/// Reads each partition of `topic` from `start` up to `end` (exclusive; `None` = the current end),
/// with read_committed, calling `f` per record in partition order. Gives up after `idle` without progress.
pub fn read_committed_range(
    settings: &KafkaSettings,
    topic: &str,
    ranges: &BTreeMap<PartitionId, (Offset, Option<Offset>)>,
    idle: Duration,
    mut f: impl FnMut(&BorrowedMessage<'_>),
) -> Result<()> {
    let mut config = settings.client_config();
    let group = format!(
        "tally-reader-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    );
    config
        .set("group.id", &group)
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer<ReaderContext> = config
        .create_with_context(ReaderContext)
        .map_err(kafka("creating reader"))?;
    let mut tpl = TopicPartitionList::new();
    let mut done = BTreeSet::new();
    for (&p, &(start, end)) in ranges {
        if end.is_some_and(|e| e <= start) {
            done.insert(p);
            continue;
        }
        tpl.add_partition_offset(topic, p, KOffset::Offset(start))
            .map_err(kafka("building assignment"))?;
    }
    if done.len() == ranges.len() {
        return Ok(());
    }
    consumer
        .assign(&tpl)
        .map_err(kafka(format!("assigning {topic}")))?;
    let mut last_progress = Instant::now();
    while done.len() < ranges.len() {
        if last_progress.elapsed() > idle {
            let pending: Vec<_> = ranges.keys().filter(|p| !done.contains(*p)).collect();
            return Err(Error::Other(format!(
                "reading {topic}: no progress for {idle:?} on partitions {pending:?}"
            )));
        }
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(m)) => {
                last_progress = Instant::now();
                let p = m.partition();
                let Some(&(_, end)) = ranges.get(&p) else {
                    continue;
                };
                if done.contains(&p) {
                    continue;
                }
                if end.is_some_and(|e| m.offset() >= e) {
                    done.insert(p);
                    continue;
                }
                f(&m);
                if end.is_some_and(|e| m.offset() + 1 >= e) {
                    done.insert(p);
                }
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                let Some(&(_, end)) = ranges.get(&p) else {
                    continue;
                };
                let reached = match end {
                    None => true,
                    Some(e) => consumer
                        .position()
                        .ok()
                        .and_then(|pos| {
                            pos.find_partition(topic, p)
                                .and_then(|el| el.offset().to_raw())
                        })
                        .is_some_and(|o| o >= e),
                };
                if reached {
                    done.insert(p);
                }
            }
            // librdkafka reconnects by itself: a broker away or a leader moving is waited out
            // up to `idle` (CI once lost a doctor run to a moment with every connection down).
            Some(Err(e)) if is_passing(&e) => {
                tracing::warn!(topic, error = %e, "kafka reader waits for the brokers");
            }
            Some(Err(e)) => {
                return Err(Error::Kafka {
                    context: format!("reading {topic}"),
                    source: e,
                });
            }
        }
    }
    Ok(())
}

/// Whether a read error passes once librdkafka reconnects or finds the new leader.
fn is_passing(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::Resolve
                | RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::NetworkException
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::NotLeaderForPartition
        )
    )
}

/// A client for metadata and watermarks, and the metadata of `topic`, which must exist.
pub(crate) fn topic_metadata(
    settings: &KafkaSettings,
    topic: &str,
) -> Result<(BaseConsumer, rdkafka::metadata::Metadata)> {
    let mut config = settings.client_config();
    config.set("group.id", "tally-metadata");
    let consumer: BaseConsumer = config.create().map_err(kafka("creating reader"))?;
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(30))
        .map_err(kafka(format!("metadata of {topic}")))?;
    if !metadata
        .topics()
        .iter()
        .any(|t| t.name() == topic && t.error().is_none())
    {
        return Err(Error::Other(format!("topic {topic} not found")));
    }
    Ok((consumer, metadata))
}

/// Partition ids and (low, high) watermarks of a topic.
pub fn topic_extent(
    settings: &KafkaSettings,
    topic: &str,
) -> Result<BTreeMap<PartitionId, (Offset, Offset)>> {
    let (consumer, metadata) = topic_metadata(settings, topic)?;
    extent_of(&consumer, &metadata, topic)
}

fn extent_of<C: Consumer<X>, X: ConsumerContext>(
    consumer: &C,
    metadata: &rdkafka::metadata::Metadata,
    topic: &str,
) -> Result<BTreeMap<PartitionId, (Offset, Offset)>> {
    let mut out = BTreeMap::new();
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(out);
    };
    for p in t.partitions() {
        let wm = consumer
            .fetch_watermarks(topic, p.id(), Duration::from_secs(30))
            .map_err(kafka(format!("watermarks of {topic}/{}", p.id())))?;
        out.insert(p.id(), wm);
    }
    Ok(out)
}

/// Where each partition of `topic` starts for a job that starts `from` (see
/// [`crate::SourceConsumer::resolve_start`]).
pub fn topic_starts(
    settings: &KafkaSettings,
    topic: &str,
    from: crate::StartFrom,
) -> Result<BTreeMap<PartitionId, Offset>> {
    let (consumer, metadata) = topic_metadata(settings, topic)?;
    extent_of(&consumer, &metadata, topic)?
        .into_iter()
        .map(|(p, bounds)| {
            crate::consumer::start_within(&consumer, topic, p, from, bounds).map(|o| (p, o))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_away_is_waited_out_and_a_missing_topic_or_refusal_is_not() {
        let consumption = KafkaError::MessageConsumption;
        assert!(is_passing(&consumption(RDKafkaErrorCode::AllBrokersDown)));
        assert!(is_passing(&consumption(
            RDKafkaErrorCode::NotLeaderForPartition
        )));
        assert!(is_passing(&KafkaError::Global(
            RDKafkaErrorCode::BrokerTransportFailure
        )));
        assert!(!is_passing(&consumption(
            RDKafkaErrorCode::UnknownTopicOrPartition
        )));
        assert!(!is_passing(&consumption(
            RDKafkaErrorCode::TopicAuthorizationFailed
        )));
        assert!(!is_passing(&consumption(
            RDKafkaErrorCode::OffsetOutOfRange
        )));
    }
}
