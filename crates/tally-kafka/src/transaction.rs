//! The job's transactional producer. One Kafka transaction per epoch carries the epoch's dead
//! letters, its changelog records and the source offsets for the consumer group, tagged with the
//! epoch and the writer in the offset metadata ([`CommitMark`]), so after a crash the group's
//! committed metadata says whether that transaction committed, and who commits the job.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rdkafka::consumer::ConsumerGroupMetadata;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset as KOffset, TopicPartitionList};
use tally_core::{DeadLetter, Epoch, Offset, PartitionId};

use crate::deadline::with_deadline;
use crate::error::{Error, Result, kafka};
use crate::settings::{KafkaSettings, set_default};

pub const HEADER_REASON: &str = "tally.reason";
pub const HEADER_ERROR: &str = "tally.error";
pub const HEADER_SOURCE_TOPIC: &str = "tally.source.topic";
pub const HEADER_SOURCE_PARTITION: &str = "tally.source.partition";
pub const HEADER_SOURCE_OFFSET: &str = "tally.source.offset";
pub const HEADER_SOURCE_TIMESTAMP: &str = "tally.source.timestamp";

const METADATA_PREFIX: &str = "tally:epoch=";
const WRITER_FIELD: &str = ";writer=";
const FROM_FIELD: &str = ";from=";
const TIMEOUT: Duration = Duration::from_secs(60);
/// How long tally waits for `send_offsets_to_transaction`, which does not keep to its own
/// timeout while the group's coordinator is away (librdkafka 5456 and 5511).
const OFFSETS_DEADLINE: Duration = Duration::from_secs(65);

/// What tally writes in the metadata of every offset it commits: the epoch whose transaction
/// committed it and the writer (state directory) that ran that transaction. After a crash the
/// epoch says whether a pre-committed epoch's transaction committed; the writer says whether
/// another worker commits this job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitMark {
    pub epoch: Epoch,
    /// `None` for offsets committed before writers were recorded.
    pub writer: Option<String>,
    /// The partition's restore point in the changelog (`None`: its start).
    pub restore_from: Option<Offset>,
}

impl CommitMark {
    pub fn parse(metadata: &str) -> Option<CommitMark> {
        let rest = metadata.strip_prefix(METADATA_PREFIX)?;
        let (rest, restore_from) = match rest.split_once(FROM_FIELD) {
            Some((rest, from)) => (rest, Some(from.parse().ok()?)),
            None => (rest, None),
        };
        let (epoch, writer) = match rest.split_once(WRITER_FIELD) {
            Some((epoch, writer)) => (epoch, Some(writer.to_owned())),
            None => (rest, None),
        };
        Some(CommitMark {
            epoch: Epoch(epoch.parse().ok()?),
            writer,
            restore_from,
        })
    }

    pub fn render(&self) -> String {
        let mut text = format!("{METADATA_PREFIX}{}", self.epoch);
        if let Some(writer) = &self.writer {
            text.push_str(WRITER_FIELD);
            text.push_str(writer);
        }
        if let Some(from) = self.restore_from {
            text.push_str(FROM_FIELD);
            text.push_str(&from.to_string());
        }
        text
    }
}

/// The job's transactional producer: one transaction per epoch carries its dead letters, its
/// changelog records and the group's offsets.
pub struct EpochProducer {
    /// Shared with a call past its deadline, which is left blocked on it ([`crate::deadline`]).
    producer: Arc<ThreadedProducer<DefaultProducerContext>>,
    topic: String,
    changelog_topic: String,
    source_topic: String,
    /// Partitions of the changelog topic this producer's metadata is known to have: a partition
    /// added since (the source topic grew) is looked up before its first record, which
    /// librdkafka would otherwise fail for a partition its cached metadata lacks.
    changelog_partitions: AtomicUsize,
}

/// What one epoch's transaction carries.
pub struct EpochCommit<'a> {
    /// Epoch and writer; each partition's mark adds its restore point from `restore_from`.
    pub mark: &'a CommitMark,
    pub dead_letters: &'a [DeadLetter],
    pub changelog: &'a [(PartitionId, Vec<u8>)],
    pub offsets: &'a BTreeMap<PartitionId, Offset>,
    pub restore_from: &'a BTreeMap<PartitionId, Offset>,
}

/// The topics an epoch's transaction writes besides the group's offsets.
pub struct EpochTopics<'a> {
    pub dead_letters: &'a str,
    pub changelog: &'a str,
    pub source: &'a str,
}

/// A transactional producer created but not yet initialised, so it has fenced nothing (librdkafka
/// asks for a producer id only in `init_transactions`). Created while the worker waits for its
/// lease, it has found the transaction coordinator by the time it fences: `init_transactions`
/// then takes one round trip, where a new producer's took 50–500 ms.
pub struct UnfencedProducer {
    unfenced: EpochProducer,
    transactional_id: String,
}

impl UnfencedProducer {
    pub fn create(
        settings: &KafkaSettings,
        transactional_id: &str,
        topics: &EpochTopics<'_>,
    ) -> Result<UnfencedProducer> {
        let mut config = settings.client_config();
        config
            .set("transactional.id", transactional_id)
            .set("enable.idempotence", "true")
            // What idempotence implies, said: a record is acknowledged once every in-sync
            // replica has it (min.insync.replicas of them at least).
            .set("acks", "all");
        set_default(&mut config, "transaction.timeout.ms", "120000");
        // Dead letters carry whole source records plus headers.
        set_default(&mut config, "message.max.bytes", "16777216");
        set_default(&mut config, "linger.ms", "5");
        let producer: ThreadedProducer<DefaultProducerContext> = config
            .create()
            .map_err(kafka("creating the transactional producer"))?;
        Ok(UnfencedProducer {
            unfenced: EpochProducer {
                producer: Arc::new(producer),
                topic: topics.dead_letters.to_owned(),
                changelog_topic: topics.changelog.to_owned(),
                source_topic: topics.source.to_owned(),
                changelog_partitions: AtomicUsize::new(0),
            },
            transactional_id: transactional_id.to_owned(),
        })
    }

    /// Fences any earlier instance with the same transactional id; an open transaction of a
    /// crashed process is aborted here.
    pub fn fence(self) -> Result<EpochProducer> {
        self.unfenced
            .producer
            .init_transactions(TIMEOUT)
            .map_err(kafka(format!(
                "initialising transactions for {}",
                self.transactional_id
            )))?;
        Ok(self.unfenced)
    }
}

impl EpochProducer {
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Produces the epoch's dead letters and changelog records (each to the changelog partition
    /// of its source partition) and commits its offsets for the group, marked, atomically. On
    /// error the transaction is aborted; the caller retries with a fresh producer.
    pub fn commit_epoch(
        &self,
        epoch: &EpochCommit<'_>,
        group: ConsumerGroupMetadata,
    ) -> Result<()> {
        self.end_epoch(epoch, group, true)
    }

    /// Writes the epoch's transaction as [`EpochProducer::commit_epoch`] does, then aborts it
    /// and returns Ok: fault injection, for a committed transaction that Kafka undid afterwards
    /// (a hanging transaction aborted by hand drops what it held).
    pub fn write_then_abort_epoch(
        &self,
        epoch: &EpochCommit<'_>,
        group: ConsumerGroupMetadata,
    ) -> Result<()> {
        self.end_epoch(epoch, group, false)
    }

    fn end_epoch(
        &self,
        epoch: &EpochCommit<'_>,
        group: ConsumerGroupMetadata,
        commit: bool,
    ) -> Result<()> {
        let result = self.try_commit_epoch(epoch, group, commit);
        if result.is_err() {
            // Best effort: a fresh producer's init_transactions aborts it too.
            let _ = self.producer.abort_transaction(Duration::from_secs(10));
        }
        result
    }

    fn try_commit_epoch(
        &self,
        &EpochCommit {
            mark,
            dead_letters,
            changelog,
            offsets,
            restore_from,
        }: &EpochCommit<'_>,
        group: ConsumerGroupMetadata,
        commit: bool,
    ) -> Result<()> {
        if let Some(needed) = changelog.iter().map(|(p, _)| *p).max() {
            self.know_changelog_partition(needed)?;
        }
        self.producer
            .begin_transaction()
            .map_err(kafka("beginning transaction"))?;
        for dl in dead_letters {
            self.send(dl)?;
        }
        for (partition, bytes) in changelog {
            let key = partition.to_be_bytes();
            let record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(&self.changelog_topic)
                .partition(*partition)
                .key(&key[..])
                .payload(bytes.as_slice());
            self.send_record(record, || {
                format!("producing the changelog record of partition {partition}")
            })?;
        }
        let mut tpl = TopicPartitionList::new();
        let epoch = mark.epoch;
        for (&p, &o) in offsets {
            let mut element = tpl.add_partition(&self.source_topic, p);
            element
                .set_offset(KOffset::Offset(o))
                .map_err(kafka("building offsets"))?;
            let metadata = CommitMark {
                restore_from: restore_from.get(&p).copied(),
                ..mark.clone()
            }
            .render();
            element.set_metadata(metadata.as_str());
        }
        self.send_offsets(tpl, group, epoch)?;
        if !commit {
            return self
                .producer
                .abort_transaction(TIMEOUT)
                .map_err(kafka(format!("aborting the transaction of epoch {epoch}")));
        }
        self.await_deliveries(epoch)?;
        self.producer
            .commit_transaction(TIMEOUT)
            .map_err(kafka(format!(
                "committing dead-letter transaction of epoch {epoch}"
            )))
    }

    /// Sends the epoch's offsets to its transaction, giving up after [`OFFSETS_DEADLINE`]: with
    /// the group's coordinator killed, the call once blocked a worker for good, past the
    /// brokers' return (librdkafka 5456: the coordinator request's timeout is never checked).
    /// A call given up on stays blocked on this producer, which the next one fences; the epoch
    /// fails as on any transaction error, and the commit path retries with a fresh producer.
    fn send_offsets(
        &self,
        offsets: TopicPartitionList,
        group: ConsumerGroupMetadata,
        epoch: Epoch,
    ) -> Result<()> {
        let producer = Arc::clone(&self.producer);
        let context = format!("sending offsets of epoch {epoch} to the transaction");
        match with_deadline("tally-txn-offsets", OFFSETS_DEADLINE, move || {
            producer.send_offsets_to_transaction(&offsets, &group, TIMEOUT)
        }) {
            Ok(result) => result.map_err(kafka(context)),
            Err(why) => Err(Error::Other(format!("{context}: {why}"))),
        }
    }

    /// Waits until the broker has acknowledged every record of the transaction. rust-rdkafka's
    /// `commit_transaction` flushes first by polling the delivery queue in 100 ms slices, but
    /// this producer's own thread takes the delivery reports, so a slice with records still in
    /// flight always ran out in full: 100 ms of every epoch's commit (measured: 102 of 122 ms).
    fn await_deliveries(&self, epoch: Epoch) -> Result<()> {
        let deadline = std::time::Instant::now() + TIMEOUT;
        while self.producer.in_flight_count() > 0 {
            if std::time::Instant::now() >= deadline {
                return Err(Error::Other(format!(
                    "records of the transaction of epoch {epoch} not acknowledged after {TIMEOUT:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Makes sure the producer's metadata has changelog partition `partition`, refreshing it
    /// (which updates librdkafka's cache) when it was not known to.
    fn know_changelog_partition(&self, partition: PartitionId) -> Result<()> {
        let needed = usize::try_from(partition).unwrap_or(0) + 1;
        if self.changelog_partitions.load(Ordering::Relaxed) >= needed {
            return Ok(());
        }
        let metadata = self
            .producer
            .client()
            .fetch_metadata(Some(&self.changelog_topic), TIMEOUT)
            .map_err(kafka(format!(
                "fetching metadata of {}",
                self.changelog_topic
            )))?;
        let has = metadata
            .topics()
            .iter()
            .find(|t| t.name() == self.changelog_topic)
            .map_or(0, |t| t.partitions().len());
        self.changelog_partitions.store(has, Ordering::Relaxed);
        if has < needed {
            return Err(Error::Other(format!(
                "changelog topic {} has {has} partitions and source partition {partition} has none; tally adds them when it discovers the source partition",
                self.changelog_topic
            )));
        }
        Ok(())
    }

    fn send(&self, dl: &DeadLetter) -> Result<()> {
        let partition = dl.partition.to_string();
        let offset = dl.offset.to_string();
        let timestamp = dl.timestamp_ms.map(|t| t.to_string()).unwrap_or_default();
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: HEADER_REASON,
                value: Some(dl.reason.as_str()),
            })
            .insert(Header {
                key: HEADER_ERROR,
                value: Some(dl.error.as_str()),
            })
            .insert(Header {
                key: HEADER_SOURCE_TOPIC,
                value: Some(self.source_topic.as_str()),
            })
            .insert(Header {
                key: HEADER_SOURCE_PARTITION,
                value: Some(partition.as_str()),
            })
            .insert(Header {
                key: HEADER_SOURCE_OFFSET,
                value: Some(offset.as_str()),
            })
            .insert(Header {
                key: HEADER_SOURCE_TIMESTAMP,
                value: Some(timestamp.as_str()),
            });
        let mut record: BaseRecord<'_, [u8], [u8]> = BaseRecord::to(&self.topic).headers(headers);
        if let Some(key) = &dl.key {
            record = record.key(key.as_slice());
        }
        if let Some(value) = &dl.value {
            record = record.payload(value.as_slice());
        }
        self.send_record(record, || {
            format!("producing dead letter {}/{}", dl.partition, dl.offset)
        })
    }

    /// Sends, waiting while librdkafka's queue is full.
    fn send_record(
        &self,
        mut record: BaseRecord<'_, [u8], [u8]>,
        what: impl Fn() -> String,
    ) -> Result<()> {
        loop {
            match self.producer.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                    record = returned;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err((e, _)) => return Err(kafka(what())(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_marks_round_trip_and_read_the_older_form() {
        let mark = CommitMark {
            epoch: Epoch(42),
            writer: Some("1764500000-00ff00ff00ff00ff".into()),
            restore_from: None,
        };
        assert_eq!(CommitMark::parse(&mark.render()), Some(mark.clone()));
        let with_point = CommitMark {
            restore_from: Some(1234),
            ..mark
        };
        assert_eq!(CommitMark::parse(&with_point.render()), Some(with_point));
        assert_eq!(
            CommitMark::parse("tally:epoch=42"),
            Some(CommitMark {
                epoch: Epoch(42),
                writer: None,
                restore_from: None,
            })
        );
        assert_eq!(CommitMark::parse("tally:epoch=4;writer=w;from=x"), None);
        assert_eq!(CommitMark::parse(""), None);
        assert_eq!(CommitMark::parse("tally:epoch=x"), None);
        assert_eq!(CommitMark::parse("tally:epoch=x;writer=w"), None);
    }
}
