//! A job's settings, resolved once from its file at start: what each part of the runtime runs
//! with. The file is parsed and validated by [`crate::config`], naming the key of each mistake;
//! [`Config::resolve`] then derives every part's settings from it (topic names, ClickHouse
//! replicas, fold rules), so that no part re-derives them, and none holds the whole file.

use std::path::PathBuf;
use std::time::Duration;

use tally_clickhouse::{FoldRules, SinkSettings};
use tally_kafka::KafkaSettings;

use crate::config::Config;
use crate::identity::IdentitySettings;

/// Everything a job's parts run with, resolved by [`Config::resolve`].
#[derive(Debug, Clone)]
pub struct JobSettings {
    pub name: String,
    /// The source topic read in the job's consumer group.
    pub source: SourceGroup,
    /// The ClickHouse server each replica of `clickhouse.url` is, in its order.
    pub replicas: Vec<SinkSettings>,
    pub read_side: ReadSideSettings,
    pub identity: IdentitySettings,
}

/// The job's source topic and consumer group, and the Kafka clients' settings.
#[derive(Debug, Clone)]
pub struct SourceGroup {
    pub kafka: KafkaSettings,
    pub source_topic: String,
    pub consumer_group: String,
}

/// What the read side (publishes and folds, an agent per replica) runs with.
#[derive(Debug, Clone)]
pub struct ReadSideSettings {
    pub replicas: Vec<SinkSettings>,
    /// `clickhouse.cluster` is set: each agent makes its replica's tables.
    pub cluster: bool,
    /// How long a holder's read side lasts without a beat (`job.session_timeout`).
    pub lease_duration: Duration,
    /// `clickhouse.fold_interval`; zero: no folding.
    pub fold_interval: Duration,
    pub fold_rules: FoldRules,
    /// The job's state directory (not a task's): it names the holder.
    pub holder_dir: PathBuf,
    /// Asked for the source's partition count before each fold step.
    pub source: SourceGroup,
}

impl Config {
    /// The job's settings, derived once from the validated file.
    pub fn resolve(&self) -> JobSettings {
        let source = SourceGroup {
            kafka: self.kafka_settings(),
            source_topic: self.kafka.source_topic.clone(),
            consumer_group: self.kafka.consumer_group.clone(),
        };
        let replicas = self.replica_settings();
        JobSettings {
            name: self.job.name.clone(),
            read_side: ReadSideSettings {
                replicas: replicas.clone(),
                cluster: self.clickhouse.cluster.is_some(),
                lease_duration: self.job.session_timeout.as_duration(),
                // validate refuses a negative interval: 0 is the only one that is no folding.
                fold_interval: self.clickhouse.fold_interval.as_duration(),
                fold_rules: self.fold_rules(),
                holder_dir: self.job.state_dir.clone(),
                source: source.clone(),
            },
            identity: IdentitySettings {
                identity: crate::identity::JobIdentity::of(self),
                kafka: self.kafka_settings(),
                registry_topic: self.registry_topic(),
                replication_factor: self.kafka.topic_replication_factor,
                replicas: replicas.clone(),
            },
            source,
            replicas,
        }
    }
}

#[cfg(test)]
mod tests;
