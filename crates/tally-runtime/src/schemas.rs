//! The schema registry (its Confluent-compatible API: Confluent's own, or Apicurio's under
//! `/apis/ccompat/v7`), and the writer schemas a job of Avro or Protobuf records reads, by id:
//! each fetched once, compiled for the job's declaration and kept. A registry that cannot be
//! reached is waited for; only an id it says it does not know is an answer (the record is then
//! dead-lettered as `unknown_schema`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tally_clickhouse::Secret;
use tally_core::declare::{Format, Job, Schemas, WriterSchema, schema_id};
use tally_core::{PartitionId, Poison, PoisonReason, Record};
use tally_kafka::SourceConsumer;

type Https = hyper_rustls::HttpsConnector<HttpConnector>;

/// `[registry]`: the schema registry of a job reading Avro or Protobuf, by its
/// Confluent-compatible API.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaRegistryConfig {
    /// `http(s)://host:port` of Confluent's registry, or Apicurio's
    /// `http(s)://host:port/apis/ccompat/v7`.
    #[serde(default)]
    pub url: Option<String>,
    /// Basic authentication.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Secret::is_empty")]
    pub password: Secret,
    /// PEM file of CA certificates trusted for an `https://` url, besides the system's roots.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// The subject whose schemas the topic's values are written with (`check-config`, and
    /// `loadgen`, which registers there); default `<topic>-value` (TopicNameStrategy).
    #[serde(default)]
    pub subject: Option<String>,
}

/// Why a request to the registry got no answer (it is down, or unreachable), or what it
/// answered instead of the schema.
#[derive(Debug, thiserror::Error)]
pub enum SchemaRegistryError {
    #[error("schema registry {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("schema registry {url}: {path} answered {status}: {body}")]
    Refused {
        url: String,
        path: String,
        status: u16,
        body: String,
    },
}

/// A schema as the registry serves it.
#[derive(Debug, Clone, Deserialize)]
pub struct Fetched {
    pub schema: String,
    /// `AVRO` when absent (as Confluent and Apicurio answer for Avro).
    #[serde(rename = "schemaType", default)]
    pub schema_type: Option<String>,
}

impl Fetched {
    fn kind(&self) -> &str {
        self.schema_type.as_deref().unwrap_or("AVRO")
    }
}

/// The registry's HTTP API.
pub struct SchemaRegistry {
    base: String,
    authorization: Option<String>,
    client: HyperClient<Https, Full<Bytes>>,
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaRegistry")
            .field("url", &self.base)
            .field("basic_auth", &self.authorization.is_some())
            .finish()
    }
}

impl SchemaRegistry {
    pub fn new(config: &SchemaRegistryConfig) -> Result<SchemaRegistry> {
        let Some(url) = &config.url else {
            bail!(
                "registry.url: not set; a job of Avro or Protobuf records reads its writer schemas from a schema registry"
            );
        };
        let connector =
            tally_clickhouse::https_connector(config.ca_file.as_deref(), "registry.ca_file")
                .map_err(anyhow::Error::msg)?;
        let authorization = config.user.as_ref().map(|user| {
            use base64::Engine;
            let token = base64::engine::general_purpose::STANDARD
                .encode(format!("{user}:{}", config.password.expose()));
            format!("Basic {token}")
        });
        Ok(SchemaRegistry {
            base: url.trim_end_matches('/').to_owned(),
            authorization,
            client: HyperClient::builder(TokioExecutor::new()).build(connector),
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<(u16, String), SchemaRegistryError> {
        let url = format!("{}{path}", self.base);
        let unreachable = |reason: String| SchemaRegistryError::Unreachable {
            url: self.base.clone(),
            reason,
        };
        let mut request = http::Request::builder().method(method).uri(&url).header(
            "accept",
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        if let Some(auth) = &self.authorization {
            request = request.header("authorization", auth);
        }
        if body.is_some() {
            request = request.header("content-type", "application/vnd.schemaregistry.v1+json");
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| unreachable(format!("a request to {url}: {e}")))?;
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| {
                let mut text = e.to_string();
                let mut next = std::error::Error::source(&e);
                while let Some(cause) = next {
                    text.push_str(": ");
                    text.push_str(&cause.to_string());
                    next = cause.source();
                }
                unreachable(text)
            })?;
            let status = response.status().as_u16();
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|e| unreachable(format!("reading the answer: {e}")))?
                .to_bytes();
            Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
        };
        tokio::time::timeout(Duration::from_secs(30), exchange)
            .await
            .map_err(|_| unreachable("no answer within 30 s".into()))?
    }

    /// The JSON answer to `method path`; `None` when the registry answers 404 (it knows no
    /// such schema, subject or version).
    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<Option<T>, SchemaRegistryError> {
        let refused = |status: u16, body: String| SchemaRegistryError::Refused {
            url: self.base.clone(),
            path: path.to_owned(),
            status,
            body,
        };
        match self.call(method, path, body).await? {
            (200, text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| refused(200, format!("{e}: {text}"))),
            (404, _) => Ok(None),
            (status, text) => Err(refused(status, text)),
        }
    }

    /// Schema `id`; `None` when the registry does not know it.
    pub async fn schema(&self, id: u32) -> Result<Option<Fetched>, SchemaRegistryError> {
        self.json("GET", &format!("/schemas/ids/{id}"), None).await
    }

    /// The newest schema of `subject` and its id; `None` when the subject has none.
    pub async fn latest(
        &self,
        subject: &str,
    ) -> Result<Option<(u32, Fetched)>, SchemaRegistryError> {
        #[derive(Deserialize)]
        struct Version {
            id: u32,
            #[serde(flatten)]
            fetched: Fetched,
        }
        let path = format!("/subjects/{subject}/versions/latest");
        let version: Option<Version> = self.json("GET", &path, None).await?;
        Ok(version.map(|v| (v.id, v.fetched)))
    }

    /// Sets `subject`'s compatibility level (`BACKWARD`, `NONE`, ...): which new schemas the
    /// registry takes under it.
    pub async fn set_compatibility(
        &self,
        subject: &str,
        level: &str,
    ) -> Result<(), SchemaRegistryError> {
        let body = serde_json::json!({ "compatibility": level }).to_string();
        let _: Option<serde_json::Value> = self
            .json("PUT", &format!("/config/{subject}"), Some(body))
            .await?;
        Ok(())
    }

    /// Registers `schema` (of `kind`, `AVRO` or `PROTOBUF`) under `subject`; its id.
    pub async fn register(
        &self,
        subject: &str,
        schema: &str,
        kind: &str,
    ) -> Result<u32, SchemaRegistryError> {
        #[derive(Deserialize)]
        struct Id {
            id: u32,
        }
        let path = format!("/subjects/{subject}/versions");
        let body = serde_json::json!({"schema": schema, "schemaType": kind}).to_string();
        let id: Option<Id> = self.json("POST", &path, Some(body)).await?;
        id.map(|i| i.id)
            .ok_or_else(|| SchemaRegistryError::Refused {
                url: self.base.clone(),
                path,
                status: 404,
                body: "no such subject".into(),
            })
    }
}

/// The registry's name for a format's schemas.
pub fn schema_type(format: Format) -> &'static str {
    match format {
        Format::Protobuf => "PROTOBUF",
        _ => "AVRO",
    }
}

/// What the cache holds of an id.
#[derive(Debug, Clone)]
enum Entry {
    Known(Arc<WriterSchema>),
    /// The registry does not know the id, or its schema does not compile for the job.
    Refused(Poison),
}

/// Writer schemas by id, compiled for one job, fetched once each.
pub struct SchemaCache {
    registry: SchemaRegistry,
    job: Arc<Job>,
    entries: RwLock<HashMap<u32, Entry>>,
    /// Ids being fetched in the background.
    fetching: Mutex<HashSet<u32>>,
    /// Runs the registry's requests for callers outside an async runtime. Always set until the
    /// cache is dropped (see its `Drop`).
    runtime: Option<tokio::runtime::Runtime>,
}

/// The cache may be dropped anywhere, an async task included, where dropping a runtime the
/// usual way panics: its runtime shuts down in the background instead.
impl Drop for SchemaCache {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl std::fmt::Debug for SchemaCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.entries.read().map_or(0, |e| e.len());
        f.debug_struct("SchemaCache")
            .field("registry", &self.registry)
            .field("schemas", &held)
            .finish()
    }
}

/// How long a fetch waits between attempts while the registry is unreachable: from a tenth of
/// a second to five seconds.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << attempt.min(6)).min(5_000))
}

impl SchemaCache {
    pub fn new(registry: SchemaRegistry, job: Arc<Job>) -> Result<SchemaCache> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("tally-registry")
            .build()
            .context("starting the schema registry's client")?;
        Ok(SchemaCache {
            registry,
            job,
            entries: RwLock::new(HashMap::new()),
            fetching: Mutex::new(HashSet::new()),
            runtime: Some(runtime),
        })
    }

    pub fn registry(&self) -> &SchemaRegistry {
        &self.registry
    }

    fn entry(&self, id: u32) -> Option<Entry> {
        self.entries
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
            .cloned()
    }

    /// Whether id `id` has an answer: a schema, or the registry's refusal.
    pub fn resolved(&self, id: u32) -> bool {
        self.entry(id).is_some()
    }

    /// What the registry answers for `id`, compiled; `None` while it cannot be reached.
    async fn resolve(&self, id: u32) -> Result<Entry, SchemaRegistryError> {
        let fetched = self.registry.schema(id).await?;
        Ok(match fetched {
            None => Entry::Refused(Poison::new(
                PoisonReason::UnknownSchema,
                format!(
                    "schema id {id} is not in the schema registry {}",
                    self.registry.url()
                ),
            )),
            Some(f) => {
                let kind = f.kind();
                if kind != schema_type(self.job.format) {
                    Entry::Refused(Poison::new(
                        PoisonReason::Undecodable,
                        format!(
                            "schema id {id} is a {kind} schema; the job reads {}",
                            self.job.format.as_str()
                        ),
                    ))
                } else {
                    match WriterSchema::compile(&self.job, &f.schema) {
                        Ok((writer, problems)) => {
                            for problem in &problems {
                                tracing::warn!(schema_id = id, %problem, "a writer schema lacks what the declaration reads: its records are dead-lettered naming the field");
                            }
                            Entry::Known(Arc::new(writer))
                        }
                        Err(why) => Entry::Refused(Poison::new(
                            PoisonReason::Undecodable,
                            format!("schema id {id} does not compile: {why}"),
                        )),
                    }
                }
            }
        })
    }

    /// Fetches `id` until the registry answers, waiting while it is unreachable, and keeps the
    /// answer.
    fn fetch_blocking(&self, id: u32) -> Entry {
        let mut attempt = 0;
        loop {
            // On a thread of its own: a caller inside an async runtime cannot block on another.
            let answer = std::thread::scope(|scope| {
                scope
                    .spawn(|| match &self.runtime {
                        Some(runtime) => runtime.block_on(self.resolve(id)),
                        None => Err(SchemaRegistryError::Unreachable {
                            url: self.registry.url().to_owned(),
                            reason: "the client is closed".into(),
                        }),
                    })
                    .join()
                    .unwrap_or_else(|_| {
                        Err(SchemaRegistryError::Unreachable {
                            url: self.registry.url().to_owned(),
                            reason: "the request's thread ended".into(),
                        })
                    })
            });
            match answer {
                Ok(entry) => {
                    self.entries
                        .write()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(id, entry.clone());
                    crate::events::SchemaFetched {
                        id,
                        attempts: attempt + 1,
                        known: matches!(entry, Entry::Known(_)),
                    }
                    .emit();
                    return entry;
                }
                Err(e) => {
                    if attempt.is_power_of_two() || attempt == 0 {
                        tracing::warn!(schema_id = id, error = %e, "the schema registry does not answer; retrying (records of this schema wait, none is dead-lettered)");
                    }
                    std::thread::sleep(backoff(attempt));
                    attempt = attempt.saturating_add(1);
                }
            }
        }
    }

    /// The newest schema of `subject` and what it lacks of the declaration or holds of another
    /// type (`check-config`); `None` when the subject has no schema yet.
    pub fn check_latest(&self, subject: &str) -> Result<Option<(u32, Vec<String>)>> {
        let latest = std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    self.runtime
                        .as_ref()
                        .map(|runtime| runtime.block_on(self.registry.latest(subject)))
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the registry request's thread ended"))
        })?
        .ok_or_else(|| anyhow::anyhow!("the registry's client is closed"))??;
        let Some((id, fetched)) = latest else {
            return Ok(None);
        };
        let kind = fetched.kind();
        if kind != schema_type(self.job.format) {
            bail!(
                "subject {subject}: its latest schema (id {id}) is {kind}; the job reads {}",
                self.job.format.as_str()
            );
        }
        let (_, problems) = WriterSchema::compile(&self.job, &fetched.schema)
            .map_err(|why| anyhow::anyhow!("subject {subject}: schema id {id}: {why}"))?;
        Ok(Some((id, problems)))
    }

    /// Starts fetching `id` on a thread of its own, unless it is being fetched or known.
    pub fn fetch_in_background(self: &Arc<Self>, id: u32) {
        if self.resolved(id) {
            return;
        }
        {
            let mut fetching = self
                .fetching
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if !fetching.insert(id) {
                return;
            }
        }
        let cache = Arc::clone(self);
        let started = crate::job_scope::spawn(
            std::thread::Builder::new().name("tally-schema".into()),
            move || {
                cache.fetch_blocking(id);
                cache
                    .fetching
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(&id);
            },
        );
        if let Err(e) = started {
            tracing::warn!(error = %e, "cannot start a thread fetching a schema; the record waits for it inline");
        }
    }
}

impl Schemas for SchemaCache {
    fn writer(&self, id: u32) -> Result<Arc<WriterSchema>, Poison> {
        let entry = match self.entry(id) {
            Some(entry) => entry,
            None => self.fetch_blocking(id),
        };
        match entry {
            Entry::Known(writer) => Ok(writer),
            Entry::Refused(poison) => Err(poison),
        }
    }
}

/// Partitions waiting for the writer schema of their next record, the registry not having
/// answered for its id yet: paused, their records left on the broker and their offsets where
/// they were, while partitions whose schemas are cached go on.
pub struct SchemaWaits {
    cache: Arc<SchemaCache>,
    /// Ids with an answer, checked without the cache's lock (an answer is kept for good).
    answered: HashSet<u32>,
    /// Each waiting partition, with the offset and schema id of the record it waits at.
    waiting: std::collections::BTreeMap<PartitionId, (i64, u32)>,
}

impl SchemaWaits {
    pub fn new(cache: Arc<SchemaCache>) -> SchemaWaits {
        SchemaWaits {
            cache,
            answered: HashSet::new(),
            waiting: std::collections::BTreeMap::new(),
        }
    }

    /// Whether `record` must wait: its partition waits already, or the registry has not
    /// answered for its schema id (the partition then waits, and the id is fetched in the
    /// background). A record that is not in the wire format does not wait: it is poison.
    pub fn holds(&mut self, source: &SourceConsumer, record: &Record<'_>) -> Result<bool> {
        if self.waiting.contains_key(&record.partition) {
            return Ok(true);
        }
        let Some(Ok(id)) = record.value.map(schema_id) else {
            return Ok(false);
        };
        if self.answered.contains(&id) {
            return Ok(false);
        }
        if self.cache.resolved(id) {
            self.answered.insert(id);
            return Ok(false);
        }
        self.cache.fetch_in_background(id);
        source.pause(&[record.partition])?;
        self.waiting.insert(record.partition, (record.offset, id));
        crate::events::SchemaAwaited {
            partition: record.partition,
            offset: record.offset,
            id,
            waiting: self.waiting.len(),
        }
        .emit();
        Ok(true)
    }

    /// Resumes the waiting partitions whose schemas arrived, each at the record it waited at
    /// (`next_offsets`: every partition's next unprocessed record).
    pub fn release(
        &mut self,
        source: &SourceConsumer,
        next_offsets: impl FnOnce() -> std::collections::BTreeMap<PartitionId, i64>,
    ) -> Result<()> {
        if self.waiting.is_empty() {
            return Ok(());
        }
        let ready: Vec<PartitionId> = self
            .waiting
            .iter()
            .filter(|(_, (_, id))| self.cache.resolved(*id))
            .map(|(&p, _)| p)
            .collect();
        if ready.is_empty() {
            return Ok(());
        }
        for p in &ready {
            self.waiting.remove(p);
        }
        let offsets = next_offsets();
        for p in &ready {
            tracing::info!(
                partition = p,
                offset = offsets.get(p),
                "the writer schema arrived; the partition goes on"
            );
        }
        source.resume(&ready)?;
        // Assigning anew drops what was fetched past the waiting records.
        source.assign(&offsets)?;
        self.pause_waiting(source)?;
        metrics::gauge!("tally_partitions_awaiting_schema").set(self.waiting.len() as f64);
        Ok(())
    }

    /// Pauses the waiting partitions again (after the source is assigned anew).
    pub fn pause_waiting(&self, source: &SourceConsumer) -> Result<()> {
        if self.waiting.is_empty() {
            return Ok(());
        }
        let waiting: Vec<PartitionId> = self.waiting.keys().copied().collect();
        Ok(source.pause(&waiting)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> SchemaRegistryConfig {
        SchemaRegistryConfig {
            url: Some(url.into()),
            ..SchemaRegistryConfig::default()
        }
    }

    /// Basic auth as RFC 7617 spells it; the password never shows in the client's Debug.
    #[test]
    fn basic_auth_is_sent_as_rfc_7617_says() {
        let mut with_user = config("https://registry.example:8081/apis/ccompat/v7/");
        with_user.user = Some("tally".into());
        with_user.password = tally_clickhouse::Secret::new("tally-secret");
        let registry = SchemaRegistry::new(&with_user).unwrap();
        assert_eq!(
            registry.authorization.as_deref(),
            Some("Basic dGFsbHk6dGFsbHktc2VjcmV0")
        );
        assert_eq!(
            registry.url(),
            "https://registry.example:8081/apis/ccompat/v7"
        );
        assert!(!format!("{registry:?}").contains("secret"));
        assert!(
            SchemaRegistry::new(&config("http://127.0.0.1:8081"))
                .unwrap()
                .authorization
                .is_none()
        );
    }

    #[test]
    fn a_ca_file_that_cannot_be_read_is_named() {
        let mut bad = config("https://127.0.0.1:8081");
        bad.ca_file = Some("/nonexistent/ca.pem".into());
        let e = SchemaRegistry::new(&bad).unwrap_err().to_string();
        assert!(
            e.contains("registry.ca_file") && e.contains("/nonexistent/ca.pem"),
            "{e}"
        );
        let e = SchemaRegistry::new(&SchemaRegistryConfig::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("registry.url"), "{e}");
    }

    #[test]
    fn backoff_grows_to_five_seconds() {
        let waits: Vec<u64> = (0..10).map(|a| backoff(a).as_millis() as u64).collect();
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000]
        );
    }
}
