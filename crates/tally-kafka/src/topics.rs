//! The topics tally creates and grows, their durability (replication and in-sync replicas),
//! and deleting records below a point.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::error::{Error, Result, kafka};
use crate::settings::KafkaSettings;

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

/// Deletes `topics` and the consumer group `group` (a retired version's); a topic or group
/// already gone is no error. Each one's failure is named. `false`: the group still has
/// members (one that stopped a moment ago, until the group drops it), and is kept.
pub async fn delete_topics_and_group(
    settings: &KafkaSettings,
    topics: &[&str],
    group: &str,
) -> Result<bool> {
    let admin: AdminClient<DefaultClientContext> = settings
        .client_config()
        .create()
        .map_err(kafka("creating admin client"))?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let deleted = admin
        .delete_topics(topics, &opts)
        .await
        .map_err(kafka(format!("deleting topics {topics:?}")))?;
    for result in deleted {
        if let Err((topic, code)) = result
            && code != RDKafkaErrorCode::UnknownTopicOrPartition
        {
            return Err(Error::Kafka {
                context: format!("deleting topic {topic}"),
                source: KafkaError::AdminOp(code),
            });
        }
    }
    let groups = admin
        .delete_groups(&[group], &opts)
        .await
        .map_err(kafka(format!("deleting consumer group {group}")))?;
    for result in groups {
        if let Err((_, RDKafkaErrorCode::NonEmptyGroup)) = result {
            return Ok(false);
        }
        if let Err((group, code)) = result
            && code != RDKafkaErrorCode::GroupIdNotFound
        {
            return Err(Error::Kafka {
                context: format!("deleting consumer group {group}"),
                source: KafkaError::AdminOp(code),
            });
        }
    }
    Ok(true)
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
    let (_, metadata) = crate::reader::topic_metadata(settings, topic)?;
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
