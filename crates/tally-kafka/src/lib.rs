//! Kafka at tally's edges: the source consumer (positions come from tally's checkpoints, never
//! from the group), the transactional producer that writes each epoch's dead letters and changelog
//! records and commits the group's offsets, the changelog reader, and topic administration.

mod consumer;
pub mod job_registry;
mod reader;
mod transaction;

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

pub use consumer::{
    GroupMember, GroupMembers, SourceConsumer, SourceRecord, StartFrom, assigned_partitions,
    record_of,
};
pub use reader::{read_committed_range, topic_extent};
pub use transaction::{
    CommitMark, EpochCommit, EpochProducer, EpochTopics, HEADER_ERROR, HEADER_REASON,
    HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, HEADER_SOURCE_TIMESTAMP, HEADER_SOURCE_TOPIC,
    UnfencedProducer,
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {context}: {source}")]
    Kafka { context: String, source: KafkaError },
    #[error("kafka: {0}")]
    Other(String),
    /// A request the cluster refuses whatever the retries: a configuration to fix.
    #[error("kafka: {0}")]
    Refused(String),
    /// A read_committed fetch of the group's offsets keeps answering "unstable" while a
    /// read_uncommitted one answers: a transaction that committed offsets for the group is
    /// open. `last_committed` is what the group has without it.
    #[error(
        "kafka: the committed offsets of {topic} for group {group} are held by an open transaction \
         (an unstable offset commit in __consumer_offsets partition {}); the group's offsets without it: {}",
        offsets_partition.map_or("?".to_owned(), |p| p.to_string()),
        describe_offsets(last_committed)
    )]
    UnstableOffsets {
        topic: String,
        group: String,
        offsets_partition: Option<i32>,
        last_committed: BTreeMap<tally_core::PartitionId, (Option<tally_core::Offset>, String)>,
    },
}

fn describe_offsets(
    offsets: &BTreeMap<tally_core::PartitionId, (Option<tally_core::Offset>, String)>,
) -> String {
    let parts: Vec<String> = offsets
        .iter()
        .map(|(p, (o, meta))| match o {
            Some(o) => format!("{p}@{o} ({meta})"),
            None => format!("{p}: none"),
        })
        .collect();
    parts.join(", ")
}

impl Error {
    /// The consumer's position is no longer on the broker (retention deleted the records
    /// before they were read): with `auto.offset.reset=error` librdkafka says so rather than
    /// skip them.
    pub fn is_offset_out_of_range(&self) -> bool {
        matches!(
            self,
            Error::Kafka { source, .. } if matches!(
                source.rdkafka_error_code(),
                Some(RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset)
            )
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn kafka(context: impl Into<String>) -> impl FnOnce(KafkaError) -> Error {
    let context = context.into();
    move |source| Error::Kafka { context, source }
}

/// Sets `key` unless the user's pass-through settings already did.
pub(crate) fn set_default(config: &mut ClientConfig, key: &str, value: &str) {
    if config.get(key).is_none() {
        config.set(key, value);
    }
}

/// Connection settings shared by every Kafka client of a job.
#[derive(Debug, Clone, Default)]
pub struct KafkaSettings {
    pub brokers: String,
    /// librdkafka properties passed through as they are (TLS, SASL, tuning).
    pub client: BTreeMap<String, String>,
}

impl KafkaSettings {
    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        // A broker killed on a cluster: a consumer fetching from it found the partitions'
        // new leaders only at its next metadata refresh, 5 minutes by default, and read
        // nothing meanwhile (bench.sh --cluster-faults: no epoch for 300 s; 5.8 s with 10 s).
        config.set("topic.metadata.refresh.interval.ms", "10000");
        for (k, v) in &self.client {
            config.set(k, v);
        }
        config
    }
}

/// Collects what librdkafka reports in the background (handshake and authentication
/// failures only show up there).
#[derive(Default)]
struct ErrorCapture {
    last: std::sync::Mutex<Option<(KafkaError, String)>>,
}

impl rdkafka::ClientContext for ErrorCapture {
    fn error(&self, error: KafkaError, reason: &str) {
        if let Ok(mut last) = self.last.lock() {
            *last = Some((error, reason.to_owned()));
        }
    }
}

impl rdkafka::consumer::ConsumerContext for ErrorCapture {}

/// Whether a background error means the configuration can never connect.
fn is_permanent(error: &KafkaError, reason: &str) -> bool {
    let code = error.rdkafka_error_code();
    matches!(
        code,
        Some(
            RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SaslAuthenticationFailed
                | RDKafkaErrorCode::SSL
        )
    ) || [
        "SSL handshake failed",
        "certificate verify failed",
        "Authentication failed",
        "SASL authentication error",
    ]
    .iter()
    .any(|needle| reason.contains(needle))
}

impl KafkaSettings {
    /// How this job connects, for error messages: brokers, protocol and SASL user, never secrets.
    pub fn describe(&self) -> String {
        let protocol = self
            .client
            .get("security.protocol")
            .map(String::as_str)
            .unwrap_or("plaintext");
        match self.client.get("sasl.username") {
            Some(user) => format!("{} ({protocol}, user {user})", self.brokers),
            None => format!("{} ({protocol})", self.brokers),
        }
    }
}

/// Connects and reads the cluster's metadata: the partition count of every topic. A failure no
/// retry can cure (TLS handshake, authentication) is `Refused`, naming the connection and
/// librdkafka's reason; a broker that is only down or slow gives a retryable error.
pub fn check_connection(
    settings: &KafkaSettings,
    timeout: Duration,
) -> Result<BTreeMap<String, usize>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let mut config = settings.client_config();
    config.set("group.id", "tally-connection-check");
    let consumer: BaseConsumer<ErrorCapture> = config
        .create_with_context(ErrorCapture::default())
        .map_err(kafka(format!(
            "configuring a client for {}",
            settings.describe()
        )))?;
    let result = consumer.fetch_metadata(None, timeout);
    let mut background = None;
    if result.is_err() {
        // Background errors reach the context only while the client is polled.
        for _ in 0..20 {
            let _ = consumer.poll(Duration::from_millis(100));
            background = consumer
                .context()
                .last
                .lock()
                .ok()
                .and_then(|mut l| l.take());
            if background.is_some() {
                break;
            }
        }
    }
    match (result, background) {
        (Ok(metadata), _) => Ok(partition_counts(&metadata)),
        (Err(_), Some((error, reason))) if is_permanent(&error, &reason) => {
            Err(Error::Refused(format!(
                "{}: cannot connect: {reason} ({error}); check kafka.client's ssl.* and sasl.* settings",
                settings.describe()
            )))
        }
        (Err(error), Some((_, reason))) => Err(Error::Other(format!(
            "{}: {error}: {reason}",
            settings.describe()
        ))),
        (Err(error), None) => Err(Error::Kafka {
            context: format!("connecting to {}", settings.describe()),
            source: error,
        }),
    }
}

/// The partition count of every topic in `metadata` that the broker described without error.
fn partition_counts(metadata: &rdkafka::metadata::Metadata) -> BTreeMap<String, usize> {
    metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| (t.name().to_owned(), t.partitions().len()))
        .collect()
}

/// A topic tally needs: created with these settings when missing, grown when it has fewer
/// partitions (tally's per-source-partition topics follow the source topic).
pub struct TopicSpec<'a> {
    pub name: &'a str,
    pub partitions: usize,
    /// `None`: the broker's default (Kafka >= 2.4).
    pub replication: Option<i32>,
    pub configs: &'a [(&'a str, &'a str)],
}

/// What [`ensure_topics`] did to a topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicChange {
    Existed,
    Created,
    Grew { from: usize },
}

/// Creates the missing topics and grows those with fewer partitions than asked, through one
/// admin client: one CreateTopics and one metadata request per existing topic when nothing is
/// to do (each new client costs a connection, the start waits for it).
pub async fn ensure_topics(
    settings: &KafkaSettings,
    specs: &[TopicSpec<'_>],
) -> Result<Vec<TopicChange>> {
    let admin: AdminClient<DefaultClientContext> = settings
        .client_config()
        .create()
        .map_err(kafka("creating admin client"))?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let new_topics: Vec<NewTopic<'_>> = specs
        .iter()
        .map(|spec| {
            let mut topic = NewTopic::new(
                spec.name,
                i32::try_from(spec.partitions).unwrap_or(i32::MAX),
                TopicReplication::Fixed(spec.replication.unwrap_or(-1)),
            );
            for (k, v) in spec.configs {
                topic = topic.set(k, v);
            }
            topic
        })
        .collect();
    let created = admin
        .create_topics(&new_topics, &opts)
        .await
        .map_err(kafka("creating topics"))?;
    let mut changes = Vec::with_capacity(specs.len());
    let mut grow = Vec::new();
    for (spec, result) in specs.iter().zip(created) {
        match result {
            Ok(_) => changes.push(TopicChange::Created),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {
                // Asked by name only once it exists: a metadata request for a missing topic
                // may auto-create it with the broker's defaults.
                let metadata = admin
                    .inner()
                    .fetch_metadata(Some(spec.name), Duration::from_secs(10))
                    .map_err(kafka(format!("fetching metadata of {}", spec.name)))?;
                let has = metadata
                    .topics()
                    .iter()
                    .find(|t| t.name() == spec.name)
                    .map_or(0, |t| t.partitions().len());
                if has < spec.partitions {
                    grow.push(NewPartitions::new(spec.name, spec.partitions));
                    changes.push(TopicChange::Grew { from: has });
                } else {
                    changes.push(TopicChange::Existed);
                }
            }
            Err((name, code @ RDKafkaErrorCode::InvalidReplicationFactor)) => {
                // Also the answer of a broker that has just started and is not yet registered
                // with its controller: only a factor above the brokers it lists is a refusal.
                let brokers = admin
                    .inner()
                    .fetch_metadata(None, Duration::from_secs(10))
                    .map_or(0, |m| m.brokers().len());
                let wanted = spec.replication.and_then(|r| usize::try_from(r).ok());
                if brokers > 0 && wanted.is_some_and(|w| w > brokers) {
                    return Err(Error::Refused(format!(
                        "creating topic {name}: {code}: the cluster has {brokers} broker(s), fewer than the replication factor asked for (kafka.topic_replication_factor)"
                    )));
                }
                return Err(Error::Other(format!(
                    "creating topic {name}: {code}: no broker can hold it yet (one starting), or the broker's default.replication.factor exceeds its {brokers} broker(s) (then set kafka.topic_replication_factor)"
                )));
            }
            Err((name, code)) => {
                return Err(Error::Kafka {
                    context: format!("creating topic {name}"),
                    source: KafkaError::AdminOp(code),
                });
            }
        }
    }
    if !grow.is_empty() {
        let grown = admin
            .create_partitions(&grow, &opts)
            .await
            .map_err(kafka("adding partitions"))?;
        for result in grown {
            match result {
                // Grown by another worker meanwhile.
                Ok(_) | Err((_, RDKafkaErrorCode::InvalidPartitions)) => {}
                Err((name, code)) => {
                    return Err(Error::Kafka {
                        context: format!("adding partitions to {name}"),
                        source: KafkaError::AdminOp(code),
                    });
                }
            }
        }
    }
    Ok(changes)
}

/// [`ensure_topics`] for one topic. True when it was created.
pub async fn ensure_topic(
    settings: &KafkaSettings,
    topic: &str,
    partitions: i32,
    replication: Option<i32>,
    configs: &[(&str, &str)],
) -> Result<bool> {
    let spec = TopicSpec {
        name: topic,
        partitions: usize::try_from(partitions).unwrap_or(0),
        replication,
        configs,
    };
    let changes = ensure_topics(settings, &[spec]).await?;
    Ok(changes.first() == Some(&TopicChange::Created))
}

/// Deletes records below given offsets (`DeleteRecords`) through one admin client, kept for
/// every call instead of connecting anew each time.
pub struct RecordDeleter {
    admin: AdminClient<DefaultClientContext>,
}

impl RecordDeleter {
    pub fn connect(settings: &KafkaSettings) -> Result<RecordDeleter> {
        let admin = settings
            .client_config()
            .create()
            .map_err(kafka("creating admin client"))?;
        Ok(RecordDeleter { admin })
    }

    /// Deletes the records of `topic` before the given offset of each partition.
    pub async fn delete_before(&self, topic: &str, before: &BTreeMap<i32, i64>) -> Result<()> {
        use rdkafka::{Offset, TopicPartitionList};
        let mut tpl = TopicPartitionList::new();
        for (&p, &o) in before {
            tpl.add_partition_offset(topic, p, Offset::Offset(o))
                .map_err(kafka("building offsets"))?;
        }
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let result = self
            .admin
            .delete_records(&tpl, &opts)
            .await
            .map_err(kafka(format!("deleting records of {topic}")))?;
        for element in result.elements() {
            if let Err(e) = element.error() {
                return Err(Error::Kafka {
                    context: format!("deleting records of {topic}/{}", element.partition()),
                    source: e,
                });
            }
        }
        Ok(())
    }
}

/// How durable a topic is on its cluster: what `tally doctor` checks for the hops up to
/// Persisted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDurability {
    pub brokers: usize,
    /// The smallest replica count over the topic's partitions.
    pub replication_factor: usize,
    pub min_insync_replicas: Option<i64>,
    /// `retention.ms` (-1: unlimited).
    pub retention_ms: Option<i64>,
    /// Per partition: its replicas and those in sync (ISR), as the cluster's metadata has them.
    pub partitions: Vec<PartitionReplicas>,
}

/// One partition's replicas and the replicas in sync with its leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionReplicas {
    pub partition: i32,
    pub replicas: usize,
    pub in_sync: usize,
}

pub async fn topic_durability(settings: &KafkaSettings, topic: &str) -> Result<TopicDurability> {
    use rdkafka::admin::{AdminOptions, ResourceSpecifier};
    let (_, metadata) = reader::topic_metadata(settings, topic)?;
    let replication_factor = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions())
        .map(|p| p.replicas().len())
        .min()
        .unwrap_or(0);
    let partitions = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic)
        .flat_map(|t| t.partitions())
        .map(|p| PartitionReplicas {
            partition: p.id(),
            replicas: p.replicas().len(),
            in_sync: p.isr().len(),
        })
        .collect();
    let brokers = metadata.brokers().len();
    let admin: AdminClient<DefaultClientContext> = settings
        .client_config()
        .create()
        .map_err(kafka("creating admin client"))?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let described = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
        .map_err(kafka(format!("describing {topic}")))?;
    let (mut min_insync_replicas, mut retention_ms) = (None, None);
    for resource in described.into_iter().flatten() {
        for entry in resource.entries {
            let value = entry.value.as_deref().and_then(|v| v.parse::<i64>().ok());
            match entry.name.as_str() {
                "min.insync.replicas" => min_insync_replicas = value,
                "retention.ms" => retention_ms = value,
                _ => {}
            }
        }
    }
    Ok(TopicDurability {
        brokers,
        replication_factor,
        min_insync_replicas,
        retention_ms,
        partitions,
    })
}
