//! The registry of jobs: one compacted topic of one partition where each job records what it
//! is (its rules) and what it owns (consumer group, changelog topic, tables), keyed by its name.
//! The partition's order decides between two jobs that claim one resource: the earlier record
//! wins, whichever worker reads it and in whatever order they start.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::error::{Result, kafka};
use crate::reader::read_committed_range;
use crate::settings::KafkaSettings;

/// Records are kept per job for ever: compaction keeps the newest of each key.
pub const REGISTRY_TOPIC_CONFIG: &[(&str, &str)] =
    &[("cleanup.policy", "compact"), ("retention.ms", "-1")];

/// One record of the registry: a job's name and what it recorded (`None`: retired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    pub offset: i64,
    pub job: String,
    pub value: Option<Vec<u8>>,
}

/// Creates the registry topic unless it exists.
pub async fn ensure_job_registry(
    settings: &KafkaSettings,
    topic: &str,
    replication: Option<i32>,
) -> Result<()> {
    crate::ensure_topic(settings, topic, 1, replication, REGISTRY_TOPIC_CONFIG).await?;
    Ok(())
}

/// Every record of the registry, oldest first.
pub fn registrations(settings: &KafkaSettings, topic: &str) -> Result<Vec<Registration>> {
    let mut out = Vec::new();
    read_committed_range(
        settings,
        topic,
        &BTreeMap::from([(0, (0, None))]),
        Duration::from_secs(30),
        |m| {
            if let Some(key) = m.key() {
                out.push(Registration {
                    offset: m.offset(),
                    job: String::from_utf8_lossy(key).into_owned(),
                    value: m.payload().map(<[u8]>::to_vec),
                });
            }
        },
    )?;
    Ok(out)
}

/// Appends `job`'s record (`None`: a tombstone, the job retired) and returns its offset once
/// the broker has it.
pub async fn record(
    settings: &KafkaSettings,
    topic: &str,
    job: &str,
    value: Option<&[u8]>,
) -> Result<i64> {
    let mut config = settings.client_config();
    config.set("enable.idempotence", "true").set("acks", "all");
    let producer: FutureProducer = config
        .create()
        .map_err(kafka("creating the registry's producer"))?;
    let mut record = FutureRecord::<str, [u8]>::to(topic).key(job).partition(0);
    if let Some(value) = value {
        record = record.payload(value);
    }
    let delivery = producer
        .send(record, Duration::from_secs(30))
        .await
        .map_err(|(e, _)| kafka(format!("recording job {job} in {topic}"))(e))?;
    Ok(delivery.offset)
}
