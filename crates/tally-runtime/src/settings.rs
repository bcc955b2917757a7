//! A job's settings, resolved once from its file at start: what each part of the runtime runs
//! with. The file is parsed and validated by [`crate::config`], naming the key of each mistake;
//! [`Config::resolve`] then derives every part's settings from it (topic names, ClickHouse
//! replicas, fold rules, each task's directory and transactional id, the schema registry's
//! client), so that no part re-derives them, and none holds the whole file.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tally_clickhouse::{Batch, FoldRules, SinkSettings};
use tally_core::{Checkpoint, OperatorConfig, PartitionId, Program, RowShape};
use tally_kafka::{KafkaSettings, StartFrom};

use crate::config::{Config, ConfigError};
use crate::identity::IdentitySettings;
use crate::schemas::SchemaCache;

/// Everything a job's parts run with, resolved by [`Config::resolve`]. A task's own
/// settings come from [`JobSettings::whole`] or [`JobSettings::task`].
#[derive(Debug, Clone)]
pub struct JobSettings {
    pub name: String,
    /// `clickhouse.table`: the job's view, which the version that holds the job installs (a
    /// new version's tables and its own view are `<table>__v<N>…`).
    pub view: String,
    /// The source topic read in the job's consumer group.
    pub source: SourceGroup,
    /// tally's own topics of the job.
    pub topics: JobTopics,
    /// The ClickHouse server each replica of `clickhouse.url` is, in its order.
    pub replicas: Vec<SinkSettings>,
    /// The first server of `clickhouse.url`: where a part that needs one server connects.
    pub sink: SinkSettings,
    pub read_side: ReadSideSettings,
    pub identity: IdentitySettings,
    pub consume: ConsumeSettings,
    pub commit: CommitSettings,
    /// `job.tasks`, at least 1.
    pub tasks: u32,
    /// `job.standby_replicas`: the workers after a task's holder that keep a standby of it.
    pub standby_replicas: usize,
    /// `job.standby_refresh`; zero: cold standbys.
    pub standby_refresh: Duration,
    /// `job.session_timeout`: how long the group waits for a silent worker.
    pub session_timeout: Duration,
    /// `kafka.partition_discovery_interval`; zero: no discovery.
    pub partition_discovery_interval: Duration,
    /// The version's state directory (not a task's): it names this worker in the group.
    pub state_dir: PathBuf,
    /// `job.version`: a version above 1 runs in resources of its own.
    pub version: u64,
    /// `kafka.transactional_id`, or its default: a task's adds `-task-K`.
    transactional_id: String,
}

/// The job's source topic and consumer group, and the Kafka clients' settings.
#[derive(Debug, Clone)]
pub struct SourceGroup {
    pub kafka: KafkaSettings,
    pub source_topic: String,
    pub consumer_group: String,
}

/// The topics tally keeps for the job, one partition per source partition but the lease's.
#[derive(Debug, Clone)]
pub struct JobTopics {
    pub dead_letters: String,
    pub changelog: String,
    /// One partition per task: who holds it runs the task.
    pub lease: String,
    /// `kafka.topic_replication_factor`; none: the brokers' default.
    pub replication_factor: Option<i32>,
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
    /// A new version (`job.version` above 1) takes the job's view over once it has caught up.
    pub takeover: Option<TakeoverSettings>,
}

/// What a new version takes the job's view over with (docs/design/restatement.md).
#[derive(Debug, Clone)]
pub struct TakeoverSettings {
    /// The job's view (`clickhouse.table`): whichever version holds the job serves it.
    pub view: String,
    /// This version's own view (`<table>__v<N>`).
    pub own_view: String,
    /// `job.restate_from`: windows before it are kept as the version that holds the job
    /// published them; `None`: every window is rebuilt.
    pub restate_from_ms: Option<i64>,
    /// Where the rebuild starts on each partition (a partition it has committed nothing on
    /// yet has read nothing).
    pub start_from: tally_kafka::StartFrom,
    /// The resources of each version below this one: the holder's are retired.
    pub earlier: std::collections::BTreeMap<u64, VersionResources>,
    /// The registry's records of the takeover.
    pub identity: IdentitySettings,
    /// A job of changes: its connector's slot, for a version reading its own snapshot's topic.
    pub capture: Option<crate::capture::CaptureSettings>,
}

/// What one version of a job owns (docs/design/restatement.md, "each version has its own").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionResources {
    pub consumer_group: String,
    pub changelog_topic: String,
    pub lease_topic: String,
    pub dead_letters: String,
    /// Its tables' prefix and its own view (the job's view for version 1).
    pub table: String,
    /// Its transactional id; a task of several adds `-task-K`.
    pub transactional_id: String,
}

impl VersionResources {
    /// Its workers' transactional ids when the version runs `tasks` tasks.
    pub fn transactional_ids(&self, tasks: u32) -> Vec<String> {
        if tasks <= 1 {
            return vec![self.transactional_id.clone()];
        }
        (0..tasks)
            .map(|k| format!("{}-task-{k}", self.transactional_id))
            .collect()
    }
}

/// What the operator's thread runs with.
#[derive(Debug, Clone)]
pub struct ConsumeSettings {
    pub source_topic: String,
    pub operator: OperatorConfig,
    /// What records are read as.
    pub program: Program,
    /// Where a partition without a checkpoint starts: `job.start_from`, or where a new
    /// version's restatement reads from ([`Config::start_from`]).
    pub start_from: StartFrom,
    /// A new version (`job.version` above 1): it reports its progress through the history.
    pub rebuilds: bool,
    pub checkpoint_interval: Duration,
    pub max_epochs_in_flight: usize,
    /// A job of Avro or Protobuf records: its writer schemas, from the registry.
    pub schemas: Option<Arc<SchemaCache>>,
}

/// What the commit protocol and the state directory run with.
#[derive(Debug, Clone)]
pub struct CommitSettings {
    pub job: String,
    /// `clickhouse.database` and `clickhouse.table`, for messages.
    pub database: String,
    pub table: String,
    pub window_size_ms: i64,
    pub out_of_orderness_ms: i64,
    /// The shape of the job's rows in the state directory.
    pub row_shape: RowShape,
}

impl CommitSettings {
    /// The ClickHouse batch of `checkpoint` (see [`tally_clickhouse::Batch::of`]).
    pub fn batch_of<'a>(&'a self, checkpoint: &'a Checkpoint) -> Batch<'a> {
        Batch::of(&self.job, checkpoint, self.out_of_orderness_ms)
    }
}

/// What one task runs as: the whole job (a job of one task), or task `K` of several with its
/// own partitions, state directory and transactional id.
#[derive(Debug, Clone)]
pub struct TaskSettings {
    /// `None`: the job is one task.
    pub task: Option<u32>,
    pub tasks: u32,
    pub state_dir: PathBuf,
    pub transactional_id: String,
    /// Recorded in the state directory: the job, its topic and the task. Not derived from the
    /// directory, which a restore may point elsewhere.
    pub state_identity: String,
}

impl TaskSettings {
    /// Whether this task runs source partition `partition`.
    pub fn owns(&self, partition: PartitionId) -> bool {
        match self.task {
            Some(task) => u32::try_from(partition).is_ok_and(|p| p % self.tasks == task),
            None => true,
        }
    }
}

impl JobSettings {
    /// What a version above 1 adds to its state's identity: another version's directory is
    /// not its.
    fn of_version(&self) -> String {
        match self.version {
            0 | 1 => String::new(),
            n => format!("/v{n}"),
        }
    }

    /// The job run whole, by one worker (`job.tasks = 1`).
    pub fn whole(&self) -> TaskSettings {
        TaskSettings {
            task: None,
            tasks: self.tasks,
            state_dir: self.state_dir.clone(),
            transactional_id: self.transactional_id.clone(),
            state_identity: format!(
                "{}@{}{}",
                self.name,
                self.source.source_topic,
                self.of_version()
            ),
        }
    }

    /// Task `task` of a job of several: its partitions are those `p` with `p % tasks == task`.
    pub fn task(&self, task: u32) -> TaskSettings {
        TaskSettings {
            task: Some(task),
            tasks: self.tasks,
            state_dir: self.state_dir.join(format!("task-{task}")),
            transactional_id: format!("{}-task-{task}", self.transactional_id),
            state_identity: format!(
                "{}@{}{}#task-{task}",
                self.name,
                self.source.source_topic,
                self.of_version()
            ),
        }
    }
}

impl Config {
    /// What version `version` of this job owns (the same file's names, at that version).
    pub fn resources_of(&self, version: u64) -> VersionResources {
        let mut at = self.clone();
        at.job.version = version;
        VersionResources {
            consumer_group: at.consumer_group(),
            changelog_topic: at.changelog_topic(),
            lease_topic: at.lease_topic(),
            dead_letters: at.dlq_topic(),
            table: at.version_table(),
            transactional_id: at.transactional_id(),
        }
    }

    /// The job's settings, derived once from the validated file. Fails only on a job of Avro or
    /// Protobuf records whose schema registry client cannot be made (naming `registry`).
    pub fn resolve(&self) -> Result<JobSettings, ConfigError> {
        let schemas = self.schema_cache()?;
        let source = SourceGroup {
            kafka: self.kafka_settings(),
            source_topic: self.kafka.source_topic.clone(),
            consumer_group: self.consumer_group(),
        };
        let replicas = self.replica_settings();
        let operator = self.operator();
        let identity = IdentitySettings {
            identity: crate::identity::JobIdentity::of(self),
            kafka: self.kafka_settings(),
            registry_topic: self.registry_topic(),
            replication_factor: self.kafka.topic_replication_factor,
            replicas: replicas.clone(),
        };
        Ok(JobSettings {
            name: self.job.name.clone(),
            view: self.clickhouse.table.clone(),
            topics: JobTopics {
                dead_letters: self.dlq_topic(),
                changelog: self.changelog_topic(),
                lease: self.lease_topic(),
                replication_factor: self.kafka.topic_replication_factor,
            },
            sink: self.sink_settings(),
            read_side: ReadSideSettings {
                replicas: replicas.clone(),
                cluster: self.clickhouse.cluster.is_some(),
                lease_duration: self.job.session_timeout.as_duration(),
                // validate refuses a negative interval: 0 is the only one that is no folding.
                fold_interval: self.clickhouse.fold_interval.as_duration(),
                fold_rules: self.fold_rules(),
                holder_dir: self.state_dir(),
                source: source.clone(),
                takeover: (self.job.version > 1
                    && self.job.takeover == crate::config::TakeoverMode::Auto)
                    .then(|| TakeoverSettings {
                        view: self.clickhouse.table.clone(),
                        own_view: self.version_table(),
                        restate_from_ms: self.restate_from_ms(),
                        start_from: self.start_from(),
                        earlier: (1..self.job.version)
                            .map(|v| (v, self.resources_of(v)))
                            .collect(),
                        identity: identity.clone(),
                        capture: self.capture_settings(),
                    }),
            },
            identity,
            consume: ConsumeSettings {
                source_topic: self.kafka.source_topic.clone(),
                operator,
                program: self.program_with(schemas.clone()),
                start_from: self.start_from(),
                rebuilds: self.job.version > 1,
                checkpoint_interval: self.job.checkpoint_interval.as_duration(),
                max_epochs_in_flight: usize::try_from(self.job.max_epochs_in_flight).unwrap_or(1),
                schemas,
            },
            commit: CommitSettings {
                job: self.job.name.clone(),
                database: self.clickhouse.database.clone(),
                table: self.clickhouse.table.clone(),
                window_size_ms: operator.window.size_ms,
                out_of_orderness_ms: operator.out_of_orderness_ms,
                row_shape: self.row_shape(),
            },
            tasks: self.tasks(),
            standby_replicas: self.standby_replicas(),
            standby_refresh: self.job.standby_refresh.as_duration(),
            session_timeout: self.job.session_timeout.as_duration(),
            partition_discovery_interval: self.kafka.partition_discovery_interval.as_duration(),
            state_dir: self.state_dir(),
            version: self.job.version,
            transactional_id: self.transactional_id(),
            source,
            replicas,
        })
    }
}

#[cfg(test)]
mod tests;
