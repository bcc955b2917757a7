//! Job configuration: one TOML file per job, every key overridable from the environment.
//!
//! Environment overrides: `TALLY_<SECTION>__<KEY>=value`, upper-case, `__` between levels, e.g.
//! `TALLY_KAFKA__BROKERS`, `TALLY_WINDOW__SIZE`, `TALLY_CLICKHOUSE__PASSWORD`. Keys of the
//! librdkafka pass-through table use `_` for `.`: `TALLY_KAFKA__CLIENT__SECURITY_PROTOCOL=ssl`
//! sets `security.protocol`. Variables without `__` (such as `TALLY_FAULT`) are not config.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize, Serializer};
use tally_clickhouse::Secret;
use tally_core::{FieldMapping, OperatorConfig, WindowSpec};

pub use crate::schemas::SchemaRegistryConfig;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: invalid TOML: {message}")]
    Syntax { file: String, message: String },
    #[error("{file}: {error}")]
    Declaration {
        file: String,
        error: tally_core::declare::DeclarationError,
    },
    #[error("{file}: {key}: {message}")]
    Key {
        file: String,
        key: String,
        message: String,
    },
}

/// A duration written as `500ms`, `5s`, `10m`, `1h` or `1d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Millis(pub i64);

impl Millis {
    pub fn parse(text: &str) -> Result<Millis, String> {
        let text = text.trim();
        if text.starts_with('-') {
            return Err(format!("{text:?} is negative; durations must be positive"));
        }
        let split = text
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(text.len());
        let (digits, unit) = text.split_at(split);
        let n: i64 = digits.parse().map_err(|_| {
            format!("{text:?} is not a duration like \"500ms\", \"5s\", \"10m\" or \"1h\"")
        })?;
        let scale = match unit.trim() {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(format!("{text:?} has no unit; use ms, s, m, h or d")),
        };
        n.checked_mul(scale)
            .map(Millis)
            .ok_or_else(|| format!("{text:?} is too long"))
    }

    pub fn as_duration(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.0.max(0).unsigned_abs())
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Millis, D::Error> {
        let text = String::deserialize(d)?;
        Millis::parse(&text).map_err(de::Error::custom)
    }
}

/// Written back as a user would write it (`90s`, `5m`, `1h`).
impl Serialize for Millis {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&tally_core::declare::format_duration(self.0))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// Accepts an integer or a string of digits (environment overrides are strings).
fn de_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum U64OrString {
        N(u64),
        S(String),
    }
    match U64OrString::deserialize(d)? {
        U64OrString::N(n) => Ok(n),
        U64OrString::S(s) => s
            .trim()
            .parse()
            .map_err(|_| de::Error::custom(format!("{s:?} is not a non-negative integer"))),
    }
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StartFrom {
    Earliest,
    Latest,
}

/// A job's settings, parsed and checked (see [`Config::parse`]).
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    pub job: JobConfig,
    pub kafka: KafkaConfig,
    pub window: WindowConfig,
    pub clickhouse: ClickHouseConfig,
    pub metrics: MetricsConfig,
    /// A change job's source database and capture (`reconcile --source`, `doctor`, loadgen).
    pub source: SourceDatabaseConfig,
    /// The schema registry of a job reading Avro or Protobuf.
    pub registry: SchemaRegistryConfig,
    /// What the job computes: its `[aggregation]`, or revenue_agg's under the names of a
    /// `[fields]` section (the job files of the releases before declarations).
    #[serde(skip)]
    pub declared: std::sync::Arc<tally_core::declare::Job>,
    /// The file the job was read from, for errors found after parsing.
    #[serde(skip)]
    pub file: String,
}

/// The job file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    job: JobConfig,
    kafka: KafkaConfig,
    fields: Option<FieldsConfig>,
    #[serde(default)]
    window: WindowConfig,
    clickhouse: ClickHouseConfig,
    #[serde(default)]
    metrics: MetricsConfig,
    #[serde(default)]
    source: SourceDatabaseConfig,
    #[serde(default)]
    registry: SchemaRegistryConfig,
    aggregation: Option<tally_core::declare::Declaration>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JobConfig {
    pub name: String,
    pub state_dir: PathBuf,
    #[serde(default = "default_checkpoint_interval")]
    pub checkpoint_interval: Millis,
    #[serde(default = "default_start_from")]
    pub start_from: StartFrom,
    #[serde(default = "default_max_record_bytes", deserialize_with = "de_u64")]
    pub max_record_bytes: u64,
    /// Epochs handed to the committer and not yet committed while the operator goes on
    /// consuming; the operator waits at a barrier when this many are in flight.
    #[serde(default = "default_max_epochs_in_flight", deserialize_with = "de_u64")]
    pub max_epochs_in_flight: u64,
    /// RocksDB's memory for the whole process, in MiB: half for memtables, half for the block
    /// cache, shared by every state store the worker opens.
    #[serde(default = "default_state_memory_mib", deserialize_with = "de_u64")]
    pub state_memory_mib: u64,
    /// How long the job's group waits for a silent worker before a standby takes the job over.
    #[serde(default = "default_session_timeout")]
    pub session_timeout: Millis,
    /// How often a standby applies the changelog to its state directory, so that a takeover
    /// replays only what was committed since; "0s": only at the takeover (a cold standby).
    #[serde(default = "default_standby_refresh")]
    pub standby_refresh: Millis,
    /// A job of several tasks: how many other workers keep a warm standby of each task (the
    /// members after its holder, in the order of their ids). A task moving to a worker without
    /// one is restored whole; more standbys cost each worker that task's state writes.
    #[serde(default = "default_standby_replicas", deserialize_with = "de_u64")]
    pub standby_replicas: u64,
    /// How many tasks the job is split into: source partition `p` belongs to task
    /// `p % tasks`, and the job's workers share the tasks through the group protocol (each
    /// task runs on one worker at a time, with its own state directory under `state_dir`
    /// and its own transactional id). 1: one worker runs the whole job, the others stand by.
    /// Fixed for the life of a job.
    #[serde(default = "default_tasks", deserialize_with = "de_u64")]
    pub tasks: u64,
    /// The job's version (1 when absent). A higher version of a running job is a restatement
    /// (docs/design/restatement.md): `check-config` shows what it changes against the running
    /// version; `run` rebuilds it beside the running one, in resources of its own.
    #[serde(default = "default_version", deserialize_with = "de_u64")]
    pub version: u64,
    /// A new version's restatement: windows from this time on (RFC 3339) are recomputed, earlier
    /// ones kept as the running version published them. Absent: the whole history the source
    /// holds is rebuilt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restate_from: Option<String>,
    /// When a new version takes the job's view over: `auto`, once it has caught up with the
    /// stream; `hold`, never while it runs so (its own view can be checked first; run it with
    /// `auto` to take over). Not one of the rules: its workers may differ in it.
    #[serde(default)]
    pub takeover: TakeoverMode,
}

/// `job.takeover`.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TakeoverMode {
    #[default]
    Auto,
    Hold,
}

fn default_checkpoint_interval() -> Millis {
    Millis(5_000)
}
fn default_start_from() -> StartFrom {
    StartFrom::Earliest
}
fn default_max_record_bytes() -> u64 {
    1 << 20
}
fn default_max_epochs_in_flight() -> u64 {
    2
}
fn default_state_memory_mib() -> u64 {
    tally_state::DEFAULT_SHARED_MEMORY_MIB
}
fn default_session_timeout() -> Millis {
    Millis(10_000)
}
fn default_registry_topic() -> String {
    "tally-jobs".into()
}
fn default_partition_discovery_interval() -> Millis {
    Millis(30_000)
}
fn default_tasks() -> u64 {
    1
}
fn default_version() -> u64 {
    1
}
fn default_standby_replicas() -> u64 {
    1
}
fn default_standby_refresh() -> Millis {
    Millis(10_000)
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    pub brokers: String,
    pub source_topic: String,
    pub consumer_group: String,
    /// Default: `<source_topic>.dlq`.
    #[serde(default)]
    pub dlq_topic: Option<String>,
    /// Default: `tally-<job name>`. One per job: it fences a second worker of the same job.
    #[serde(default)]
    pub transactional_id: Option<String>,
    /// Each epoch's state changes, written in the epoch's transaction; `tally restore` rebuilds
    /// a state directory from it. Default: `<consumer_group>-changelog`.
    #[serde(default)]
    pub changelog_topic: Option<String>,
    /// The registry of jobs: each job records its rules and what it owns there, so that no two
    /// jobs share a group, changelog topic, transactional id or table. One per cluster.
    #[serde(default = "default_registry_topic")]
    pub registry_topic: String,
    /// Replication factor of the topics tally creates (the dead-letter topic). Default: the
    /// broker's `default.replication.factor`.
    #[serde(default)]
    pub topic_replication_factor: Option<i32>,
    /// How often a running worker looks for partitions added to the source topic; "0s": only
    /// at its start.
    #[serde(default = "default_partition_discovery_interval")]
    pub partition_discovery_interval: Millis,
    /// librdkafka properties passed through to every client (TLS, SASL, tuning).
    #[serde(default)]
    pub client: BTreeMap<String, String>,
}

/// `[fields]`: the keys revenue_agg reads, in a job file of the releases before declarations.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FieldsConfig {
    pub event_id: String,
    pub customer_id: String,
    pub currency: String,
    pub amount: String,
    pub event_time: String,
}

impl Default for FieldsConfig {
    fn default() -> Self {
        FieldsConfig::from(FieldMapping::default())
    }
}

impl From<FieldMapping> for FieldsConfig {
    fn from(m: FieldMapping) -> Self {
        FieldsConfig {
            event_id: m.event_id,
            customer_id: m.customer_id,
            currency: m.currency,
            amount: m.amount,
            event_time: m.event_time,
        }
    }
}

impl From<FieldsConfig> for FieldMapping {
    fn from(f: FieldsConfig) -> Self {
        FieldMapping {
            event_id: f.event_id,
            customer_id: f.customer_id,
            currency: f.currency,
            amount: f.amount,
            event_time: f.event_time,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WindowConfig {
    #[serde(default = "default_size")]
    pub size: Millis,
    #[serde(default = "default_ooo")]
    pub out_of_orderness: Millis,
    #[serde(default = "default_lateness")]
    pub allowed_lateness: Millis,
    #[serde(default = "default_horizon")]
    pub dedup_horizon: Millis,
    /// Hopping windows: a new window opens every `slide` (a divisor of `size`); absent: tumbling.
    pub slide: Option<Millis>,
}

fn default_size() -> Millis {
    Millis(60_000)
}
fn default_ooo() -> Millis {
    Millis(5_000)
}
fn default_lateness() -> Millis {
    Millis(60_000)
}
fn default_horizon() -> Millis {
    Millis(3_600_000)
}

impl Default for WindowConfig {
    fn default() -> Self {
        WindowConfig {
            size: default_size(),
            out_of_orderness: default_ooo(),
            allowed_lateness: default_lateness(),
            dedup_horizon: default_horizon(),
            slide: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClickHouseConfig {
    /// The server's HTTP URL; on a replicated cluster every replica's, comma-separated.
    pub url: String,
    /// The cluster whose replicas `url` lists: the job's truth is then replicated, and each
    /// replica serves the view (docs/design/clusters.md).
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default = "default_database")]
    pub database: String,
    #[serde(default = "default_table")]
    pub table: String,
    #[serde(default = "default_user")]
    pub user: String,
    #[serde(default, skip_serializing_if = "Secret::is_empty")]
    pub password: Secret,
    /// PEM file of CA certificates trusted for an `https://` url, besides the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default = "default_request_timeout")]
    pub request_timeout: Millis,
    /// How often final windows are folded into one row each; "0s" turns folding off.
    #[serde(default = "default_fold_interval")]
    pub fold_interval: Millis,
    /// Folded windows older than this are dropped; absent keeps everything.
    #[serde(default)]
    pub retention: Option<Millis>,
    /// About the most versions one fold step groups: bounds the memory a step takes on the
    /// server.
    #[serde(default = "default_fold_step_rows", deserialize_with = "de_u64")]
    pub fold_step_rows: u64,
}

fn default_fold_step_rows() -> u64 {
    tally_clickhouse::FOLD_STEP_ROWS
}

fn default_fold_interval() -> Millis {
    Millis(60_000)
}

fn default_database() -> String {
    "tally".into()
}
fn default_table() -> String {
    "revenue_agg".into()
}
fn default_user() -> String {
    "default".into()
}
fn default_request_timeout() -> Millis {
    Millis(30_000)
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Prometheus endpoint; empty disables it.
    #[serde(default = "default_metrics_address")]
    pub address: String,
}

fn default_metrics_address() -> String {
    "127.0.0.1:9464".into()
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            address: default_metrics_address(),
        }
    }
}

/// `[source]`: where a change job's rows live and how they are captured. Every key is
/// optional; the tools that need one name it.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SourceDatabaseConfig {
    /// The PostgreSQL database, `postgres://user@host:port/database` (no password: see
    /// `password`).
    #[serde(default)]
    pub postgres: Option<String>,
    #[serde(default, skip_serializing_if = "Secret::is_empty")]
    pub password: Secret,
    /// The captured table, `schema.table`; default: the source topic's last two parts
    /// (Debezium names topics `<prefix>.<schema>.<table>`).
    #[serde(default)]
    pub table: Option<String>,
    /// The connector's replication slot (`doctor`).
    #[serde(default)]
    pub slot: Option<String>,
    /// Kafka Connect's REST address and the connector's name (`doctor`).
    #[serde(default)]
    pub connect_url: Option<String>,
    #[serde(default)]
    pub connector: Option<String>,
    /// Debezium's signal table (`signal.data.collection`), through which `loadgen` asks for a
    /// new snapshot.
    #[serde(default)]
    pub signal_table: Option<String>,
}

impl SourceDatabaseConfig {
    fn is_empty(&self) -> bool {
        self.postgres.is_none()
            && self.password.is_empty()
            && self.table.is_none()
            && self.slot.is_none()
            && self.connect_url.is_none()
            && self.connector.is_none()
            && self.signal_table.is_none()
    }
}

/// `schema.table` (or `table`), each part of letters, digits and `_`: safe to put in SQL.
pub fn is_table_name(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    parts.len() <= 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && !p.starts_with(|c: char| c.is_ascii_digit())
                && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        })
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let vars: Vec<(String, String)> = std::env::vars().collect();
        Config::load_with_env(path, &vars)
    }

    pub fn load_with_env(path: &Path, env: &[(String, String)]) -> Result<Config, ConfigError> {
        let (file, text) = read(path)?;
        Config::parse(&file, &text, env)
    }

    /// The subject the topic's values are registered under: `registry.subject`, or Confluent's
    /// TopicNameStrategy, `<topic>-value`.
    pub fn registry_subject(&self) -> String {
        self.registry
            .subject
            .clone()
            .unwrap_or_else(|| format!("{}-value", self.kafka.source_topic))
    }

    /// The settings as the job runs them, every default filled in, as TOML (`check-config`).
    /// Passwords show as `***`; the declaration is left to `describe`.
    pub fn effective_toml(&self) -> Result<String, String> {
        let mut value = toml::Value::try_from(self).map_err(|e| e.to_string())?;
        if let toml::Value::Table(sections) = &mut value {
            for (_, section) in sections.iter_mut() {
                if let toml::Value::Table(keys) = section {
                    keys.retain(|_, v| !matches!(v, toml::Value::Table(t) if t.is_empty()));
                }
            }
            sections.retain(|_, v| !matches!(v, toml::Value::Table(t) if t.is_empty()));
        }
        toml::to_string(&value).map_err(|e| e.to_string())
    }

    /// Parses and checks a job file, its declaration resolved: its `[aggregation]`, or
    /// revenue_agg's (under the names of its `[fields]`, if any) for a file without one.
    pub fn parse(file: &str, text: &str, env: &[(String, String)]) -> Result<Config, ConfigError> {
        let mut table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Syntax {
            file: file.to_owned(),
            message: e.to_string(),
        })?;
        let mut from_env = BTreeMap::new();
        for (name, value) in env {
            let Some(rest) = name.strip_prefix("TALLY_") else {
                continue;
            };
            if !rest.contains("__") {
                continue;
            }
            let mut path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if path.len() == 3 && path[0] == "kafka" && path[1] == "client" {
                path[2] = path[2].replace('_', ".");
            }
            set_path(&mut table, &path, value).map_err(|message| ConfigError::Key {
                file: file.to_owned(),
                key: format!("{} (from {name})", path.join(".")),
                message,
            })?;
            from_env.insert(path.join("."), name.clone());
        }
        let parsed: ConfigFile = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| {
                let key = e.path().to_string();
                let key = match from_env.get(&key) {
                    Some(var) => format!("{key} (from {var})"),
                    None => key,
                };
                ConfigError::Key {
                    file: file.to_owned(),
                    key,
                    message: e.into_inner().to_string(),
                }
            })?;
        let invalid = |(key, message): (&str, String)| ConfigError::Key {
            file: file.to_owned(),
            key: key.to_owned(),
            message,
        };
        if let Some(fields) = &parsed.fields {
            fields.validate().map_err(invalid)?;
        }
        let refuse = |key: &str, message: &str| ConfigError::Key {
            file: file.to_owned(),
            key: key.to_owned(),
            message: message.to_owned(),
        };
        let declaration = match (parsed.aggregation, &parsed.fields) {
            (Some(_), Some(_)) => {
                return Err(refuse(
                    "fields",
                    "a job declares its fields in [[aggregation.field]] or names them in [fields], not both",
                ));
            }
            (Some(declaration), None) => declaration,
            (None, fields) => {
                let fields = fields.clone().unwrap_or_default();
                tally_core::declare::revenue_agg(&FieldMapping::from(fields))
            }
        };
        let w = &parsed.window;
        let rules = tally_core::declare::WindowRules {
            size_ms: w.size.0,
            slide_ms: w.slide.map(|s| s.0),
            allowed_lateness_ms: w.allowed_lateness.0,
            dedup_horizon_ms: w.dedup_horizon.0,
        };
        let job = declaration
            .resolve(rules)
            .map_err(|error| ConfigError::Declaration {
                file: file.to_owned(),
                error,
            })?;
        let config = Config {
            job: parsed.job,
            kafka: parsed.kafka,
            window: parsed.window,
            clickhouse: parsed.clickhouse,
            metrics: parsed.metrics,
            source: parsed.source,
            registry: parsed.registry,
            declared: std::sync::Arc::new(job),
            file: file.to_owned(),
        };
        config.validate().map_err(invalid)?;
        Ok(config)
    }

    /// A job of Avro or Protobuf records: a client of its schema registry with an empty cache
    /// of writer schemas. Made when the job starts, not when the file is read: the client has
    /// threads of its own.
    pub fn schema_cache(
        &self,
    ) -> Result<Option<std::sync::Arc<crate::schemas::SchemaCache>>, ConfigError> {
        if !self.declared.format.is_framed() {
            return Ok(None);
        }
        crate::schemas::SchemaRegistry::new(&self.registry)
            .and_then(|registry| {
                crate::schemas::SchemaCache::new(registry, std::sync::Arc::clone(&self.declared))
            })
            .map(|cache| Some(std::sync::Arc::new(cache)))
            .map_err(|e| ConfigError::Key {
                file: self.file.clone(),
                key: "registry".into(),
                message: format!("{e:#}"),
            })
    }

    /// The names revenue_agg reads its fields under, when the job is revenue_agg's shape (its
    /// identity then records them as a job of the releases before declarations did).
    pub fn revenue_agg_fields(&self) -> Option<FieldMapping> {
        crate::declaration::built_in_fields(&self.declared).ok()
    }

    pub fn registry_topic(&self) -> String {
        self.kafka.registry_topic.clone()
    }

    pub fn standby_replicas(&self) -> usize {
        usize::try_from(self.job.standby_replicas).unwrap_or(usize::MAX)
    }

    /// The job's task count (at least 1).
    pub fn tasks(&self) -> u32 {
        u32::try_from(self.job.tasks).unwrap_or(1).max(1)
    }

    pub fn operator(&self) -> OperatorConfig {
        OperatorConfig {
            window: WindowSpec {
                size_ms: self.window.size.0,
                slide_ms: self.window.slide.map_or(self.window.size.0, |s| s.0),
            },
            out_of_orderness_ms: self.window.out_of_orderness.0,
            allowed_lateness_ms: self.window.allowed_lateness.0,
            dedup_horizon_ms: self.window.dedup_horizon.0,
            windows_from_ms: self.restate_from_ms(),
        }
    }

    pub fn kafka_settings(&self) -> tally_kafka::KafkaSettings {
        tally_kafka::KafkaSettings {
            brokers: self.kafka.brokers.clone(),
            client: self.kafka.client.clone(),
        }
    }

    /// The ClickHouse URLs of `clickhouse.url`: one server, or every replica of the cluster.
    pub fn clickhouse_urls(&self) -> Vec<String> {
        self.clickhouse
            .url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The sink's settings for each server of `clickhouse.url`, in its order.
    pub fn replica_settings(&self) -> Vec<tally_clickhouse::SinkSettings> {
        self.clickhouse_urls()
            .into_iter()
            .map(|url| tally_clickhouse::SinkSettings {
                url,
                ..self.sink_settings()
            })
            .collect()
    }

    /// The sink's settings for the first server of `clickhouse.url`.
    pub fn sink_settings(&self) -> tally_clickhouse::SinkSettings {
        tally_clickhouse::SinkSettings {
            url: self
                .clickhouse_urls()
                .into_iter()
                .next()
                .unwrap_or_default(),
            cluster: self.clickhouse.cluster.clone(),
            database: self.clickhouse.database.clone(),
            table: self.version_table(),
            user: self.clickhouse.user.clone(),
            password: self.clickhouse.password.clone(),
            ca_file: self.clickhouse.ca_file.clone(),
            request_timeout: self.clickhouse.request_timeout.as_duration(),
            shape: self.sink_shape(),
        }
    }

    pub fn fold_rules(&self) -> tally_clickhouse::FoldRules {
        tally_clickhouse::FoldRules {
            window_size_ms: self.window.size.0,
            window_slide_ms: self.operator().window.slide_ms,
            allowed_lateness_ms: self.window.allowed_lateness.0,
            retention_ms: self.clickhouse.retention.map(|r| r.0),
            step_rows: self.clickhouse.fold_step_rows,
        }
    }

    /// What the operator reads records as, with a client of the schema registry for a job
    /// of Avro or Protobuf records ([`Config::schema_cache`]).
    pub fn program(&self) -> Result<tally_core::Program, ConfigError> {
        Ok(self.program_with(self.schema_cache()?))
    }

    /// What the operator reads records as, its writer schemas (if any) from `schemas`.
    pub fn program_with(
        &self,
        schemas: Option<std::sync::Arc<crate::schemas::SchemaCache>>,
    ) -> tally_core::Program {
        tally_core::Program {
            job: std::sync::Arc::clone(&self.declared),
            max_record_bytes: usize::try_from(self.job.max_record_bytes).unwrap_or(usize::MAX),
            schemas: schemas.map(|s| s as std::sync::Arc<dyn tally_core::declare::Schemas>),
        }
    }

    /// The shape of the job's rows in the state directory.
    pub fn row_shape(&self) -> tally_core::RowShape {
        self.declared.row_shape()
    }

    /// The shape of the job's rows in ClickHouse.
    pub fn sink_shape(&self) -> tally_clickhouse::Shape {
        tally_clickhouse::Shape::of(&self.declared)
    }
}

fn read(path: &Path) -> Result<(String, String), ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        file: file.clone(),
        source,
    })?;
    Ok((file, text))
}

fn set_path(table: &mut toml::Table, path: &[String], value: &str) -> Result<(), String> {
    let Some((last, parents)) = path.split_last() else {
        return Err("empty key".into());
    };
    let mut current = table;
    for key in parents {
        let entry = current
            .entry(key.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        current = entry
            .as_table_mut()
            .ok_or_else(|| format!("{key} is not a table"))?;
    }
    current.insert(last.clone(), toml::Value::String(value.to_owned()));
    Ok(())
}

mod validate;
mod versions;
pub use versions::{history_lost, topic_refused};

#[cfg(test)]
mod tests;
