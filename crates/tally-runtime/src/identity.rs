//! A job has one identity: the rules its state, checkpoints and tables were made by, and the
//! resources it owns. A worker whose rules differ from its job's, or a job that would share a
//! consumer group, changelog topic, transactional id or table with another, refuses to start,
//! naming each difference: a rolling configuration change or a copied job file must not make
//! two histories of one job.
//!
//! The identity is recorded twice, each by a compare-and-set of its store: in Kafka's registry of
//! jobs (`kafka.registry_topic`, the earlier record of a resource wins) and beside the job's
//! tables in ClickHouse (`<table>_job`, created with its one row by the first worker). Changing
//! the rules is a new job, not an edit: see [`CHANGE_RULES`].

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use tally_clickhouse::ClickHouseSink;

use crate::config::Config;

/// How to change a job's rules, for the refusals.
pub const CHANGE_RULES: &str = "a job's rules are fixed for its life (its state, checkpoints and tables were made by them). \
To change them, run the new rules as a new job (another job.name, clickhouse.table and kafka.consumer_group; \
it computes everything again from the source topic), move readers to its view, then stop the old job's workers \
and free its name with `tally retire --config <old job file>`";

/// What a job is and owns, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobIdentity {
    pub job: String,
    /// Every setting the job's results and coordination depend on, by config key.
    pub rules: BTreeMap<String, String>,
}

/// What checking and retiring a job's identity run with (see [`crate::settings`]).
#[derive(Debug, Clone)]
pub struct IdentitySettings {
    /// The job's identity, as its file makes it.
    pub identity: JobIdentity,
    pub kafka: tally_kafka::KafkaSettings,
    /// Kafka's registry of jobs (`kafka.registry_topic`).
    pub registry_topic: String,
    pub replication_factor: Option<i32>,
    /// Every ClickHouse replica: the identity beside the tables is on each.
    pub replicas: Vec<tally_clickhouse::SinkSettings>,
}

/// The rule a version above 1 is recorded under.
pub const VERSION: &str = "job.version";

/// The rule a version's `restate_from` is recorded under: its workers must agree on it.
pub const RESTATE_FROM: &str = "job.restate_from";

/// The keys of [`JobIdentity::rules`] that name a resource no two jobs may share.
const OWNED: &[&str] = &[
    "kafka.consumer_group",
    "kafka.changelog_topic",
    "kafka.transactional_id",
    "clickhouse.table",
];

impl JobIdentity {
    pub fn of(config: &Config) -> JobIdentity {
        let w = &config.window;
        let mut rules: BTreeMap<String, String> = [
            ("job.tasks", config.job.tasks.to_string()),
            (
                "job.max_record_bytes",
                config.job.max_record_bytes.to_string(),
            ),
            ("kafka.source_topic", config.kafka.source_topic.clone()),
            ("kafka.consumer_group", config.kafka.consumer_group.clone()),
            // The file's names: a version's own are derived from them.
            ("kafka.changelog_topic", config.file_changelog_topic()),
            ("kafka.dlq_topic", config.file_dlq_topic()),
            ("kafka.transactional_id", config.file_transactional_id()),
            ("window.size", w.size.to_string()),
            ("window.out_of_orderness", w.out_of_orderness.to_string()),
            ("window.allowed_lateness", w.allowed_lateness.to_string()),
            ("window.dedup_horizon", w.dedup_horizon.to_string()),
            (
                "clickhouse.table",
                format!("{}.{}", config.clickhouse.database, config.clickhouse.table),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        // revenue_agg's rules are recorded by its fields' names, as before declarations, so
        // that its deployments keep their identity; any other job's by its declaration.
        match config.revenue_agg_fields() {
            Some(f) => rules.extend(
                [
                    ("fields.event_id", f.event_id),
                    ("fields.customer_id", f.customer_id),
                    ("fields.currency", f.currency),
                    ("fields.amount", f.amount),
                    ("fields.event_time", f.event_time),
                ]
                .map(|(k, v)| (k.to_owned(), v)),
            ),
            None => {
                rules.insert("window.slide".into(), w.slide.unwrap_or(w.size).to_string());
                rules.insert(
                    "aggregation".into(),
                    crate::declaration::describe(&config.declared),
                );
            }
        }
        // Version 1 is not recorded: every job recorded before versions existed is version 1.
        if config.job.version > 1 {
            rules.insert(VERSION.into(), config.job.version.to_string());
        }
        if let Some(at) = &config.job.restate_from {
            rules.insert(RESTATE_FROM.into(), at.clone());
        }
        JobIdentity {
            job: config.job.name.clone(),
            rules,
        }
    }

    /// The job's version: its `job.version` rule, 1 when not recorded.
    pub fn version(&self) -> u64 {
        self.rules
            .get(VERSION)
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    }

    /// The topic the version reads (`kafka.source_topic`).
    pub fn source_topic(&self) -> Option<&str> {
        self.rules.get("kafka.source_topic").map(String::as_str)
    }

    /// `(key, recorded, mine)` for every rule that differs. A rule of several lines (the
    /// declaration) shows only the lines the other lacks.
    pub fn differences(&self, mine: &JobIdentity) -> Vec<(String, String, String)> {
        let keys: std::collections::BTreeSet<&String> =
            self.rules.keys().chain(mine.rules.keys()).collect();
        keys.into_iter()
            .filter_map(|k| {
                let (a, b) = (self.rules.get(k), mine.rules.get(k));
                (a != b).then(|| match (a, b) {
                    (Some(a), Some(b)) if a.contains('\n') || b.contains('\n') => {
                        let only = |x: &str, y: &str| {
                            let lines: Vec<&str> = x
                                .lines()
                                .map(str::trim)
                                .filter(|l| !y.lines().any(|o| o.trim() == *l))
                                .collect();
                            format!("{:?}", lines.join("; "))
                        };
                        (k.clone(), only(a, b), only(b, a))
                    }
                    _ => {
                        let show =
                            |v: Option<&String>| v.map_or("(none)".into(), |v| format!("{v:?}"));
                        (k.clone(), show(a), show(b))
                    }
                })
            })
            .collect()
    }

    fn owned(&self) -> impl Iterator<Item = (&'static str, &str)> {
        OWNED
            .iter()
            .filter_map(|k| self.rules.get(*k).map(|v| (*k, v.as_str())))
    }
}

/// A worker refused to start: its rules or resources clash with a recorded job's.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct IdentityRefused(pub String);

/// A worker of a version that a later one took over (or is taking over): it stops, exit 0.
#[derive(Debug, thiserror::Error)]
#[error("job {job}: version {by} took over the job from version {mine}: this worker stops")]
pub struct Superseded {
    pub job: String,
    pub mine: u64,
    pub by: u64,
}

fn refuse_differences(
    recorded: &JobIdentity,
    mine: &JobIdentity,
    place: &str,
) -> Result<(), IdentityRefused> {
    let diffs = recorded.differences(mine);
    if diffs.is_empty() {
        return Ok(());
    }
    let lines: Vec<String> = diffs
        .iter()
        .map(|(k, a, b)| format!("{k}: the job has {a}, this worker {b}"))
        .collect();
    Err(IdentityRefused(format!(
        "job {}: this worker's rules differ from the job's (recorded in {place}): {}. \
         Run every worker of a job with the job's configuration; {CHANGE_RULES}",
        mine.job,
        lines.join("; ")
    )))
}

/// Which recorded job (if another) first claimed a resource `mine` owns.
fn first_claimant<'a>(
    recorded: &'a [(i64, JobIdentity)],
    mine: &'a JobIdentity,
) -> Option<(&'static str, &'a str, &'a JobIdentity)> {
    for (key, value) in mine.owned() {
        let first = recorded
            .iter()
            .find(|(_, other)| other.rules.get(key).map(String::as_str) == Some(value));
        if let Some((_, other)) = first
            && other.job != mine.job
        {
            return Some((key, value, other));
        }
    }
    None
}

/// What a new version's record in the registry says (key `<job>@v<N>`, beside the job's own
/// record, which names the version that holds the job).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum VersionState {
    /// Rebuilding beside the version that holds the job, by these rules.
    Rebuilding(JobIdentity),
    /// Stopped by `tally retire` before it took over: its resources are never reused.
    Aborted,
    /// Taking the view over from the version that holds the job (its workers stop).
    TakingOver(JobIdentity),
    /// Took the job over: the job's record is its identity.
    TookOver,
}

/// The registry's key of version `version` of `job` (a job's name has no `@`).
fn version_key(job: &str, version: u64) -> String {
    format!("{job}@v{version}")
}

/// The registry as it stands: each job's record (the newest per job, retired ones left out) in
/// the order of their first record, and the new versions' records of each job.
#[derive(Debug, Default)]
struct Registry {
    jobs: Vec<(i64, JobIdentity)>,
    /// By job: `(first offset, version, state)`, oldest first.
    versions: BTreeMap<String, Vec<(i64, u64, VersionState)>>,
}

impl Registry {
    fn job(&self, job: &str) -> Option<&JobIdentity> {
        self.jobs.iter().map(|(_, r)| r).find(|r| r.job == job)
    }

    /// The version of `job` rebuilding above `holds`: of two that recorded themselves, the
    /// first (every worker reads the partition in one order).
    fn rebuilding(&self, job: &str, holds: u64) -> Option<&JobIdentity> {
        self.versions
            .get(job)?
            .iter()
            .find_map(|(_, v, state)| match state {
                VersionState::Rebuilding(id) | VersionState::TakingOver(id) if *v > holds => {
                    Some(id)
                }
                _ => None,
            })
    }

    /// The version taking `job` over from `holds`, if one is.
    fn taking_over(&self, job: &str, holds: u64) -> Option<u64> {
        self.versions.get(job)?.iter().find_map(|(_, v, state)| {
            matches!(state, VersionState::TakingOver(_) if *v > holds).then_some(*v)
        })
    }

    /// The version that took or is taking `job` over from `mine`, if one did.
    fn superseding(&self, job: &str, mine: u64) -> Option<u64> {
        let holds = self.job(job)?.version();
        if holds > mine {
            return Some(holds);
        }
        self.taking_over(job, holds).filter(|_| holds == mine)
    }

    fn aborted(&self, job: &str, version: u64) -> bool {
        self.versions.get(job).is_some_and(|vs| {
            vs.iter()
                .any(|(_, v, s)| *v == version && *s == VersionState::Aborted)
        })
    }
}

/// The registry's current records.
fn current(registrations: &[tally_kafka::job_registry::Registration]) -> Result<Registry> {
    let mut first: BTreeMap<&str, i64> = BTreeMap::new();
    let mut newest: BTreeMap<&str, Option<&[u8]>> = BTreeMap::new();
    for r in registrations {
        first.entry(&r.job).or_insert(r.offset);
        newest.insert(&r.job, r.value.as_deref());
        if r.value.is_none() {
            first.remove(r.job.as_str());
        }
    }
    let mut registry = Registry::default();
    for (key, value) in newest {
        let (Some(value), Some(&at)) = (value, first.get(key)) else {
            continue;
        };
        match key.split_once("@v") {
            None => {
                let identity: JobIdentity = serde_json::from_slice(value).with_context(|| {
                    format!("the registry's record of job {key} is not tally's")
                })?;
                registry.jobs.push((at, identity));
            }
            Some((job, version)) => {
                let version: u64 = version
                    .parse()
                    .with_context(|| format!("the registry's key {key} is not tally's"))?;
                let state: VersionState = serde_json::from_slice(value)
                    .with_context(|| format!("the registry's record of {key} is not tally's"))?;
                registry
                    .versions
                    .entry(job.to_owned())
                    .or_default()
                    .push((at, version, state));
            }
        }
    }
    registry.jobs.sort_by_key(|(at, _)| *at);
    for versions in registry.versions.values_mut() {
        versions.sort_by_key(|(at, _, _)| *at);
    }
    Ok(registry)
}

fn read_registry(settings: &IdentitySettings) -> Result<Registry> {
    current(&tally_kafka::job_registry::registrations(
        &settings.kafka,
        &settings.registry_topic,
    )?)
}

/// The registry as it stands, without recording anything; `None`: no registry topic yet.
fn read_registry_if_any(settings: &IdentitySettings) -> Result<Option<Registry>> {
    let (kafka, topic) = (&settings.kafka, &settings.registry_topic);
    if !tally_kafka::check_connection(kafka, Duration::from_secs(10))?.contains_key(topic) {
        return Ok(None);
    }
    read_registry(settings).map(Some)
}

/// The versions of a job the registry holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versions {
    /// The job's record: the identity of the version that holds the job (and its view).
    pub holder: JobIdentity,
    /// A new version rebuilding beside it.
    pub rebuilding: Option<u64>,
    /// Versions aborted (`tally retire` before they took over): their numbers are not reused.
    pub aborted: Vec<u64>,
    /// The rebuilding version is taking the view over.
    pub taking_over: bool,
}

impl Versions {
    /// The version that holds the job.
    pub fn holds(&self) -> u64 {
        self.holder.version()
    }
}

/// The job's versions as the registry holds them, without recording anything; `None`: the
/// registry holds no record of the job.
pub async fn versions(settings: &IdentitySettings) -> Result<Option<Versions>> {
    let job = &settings.identity.job;
    Ok(read_registry_if_any(settings)?.and_then(|r| {
        let holder = r.job(job)?.clone();
        let holds = holder.version();
        Some(Versions {
            holder,
            rebuilding: r.rebuilding(job, holds).map(JobIdentity::version),
            aborted: r
                .versions
                .get(job)
                .into_iter()
                .flatten()
                .filter(|(_, _, s)| *s == VersionState::Aborted)
                .map(|(_, v, _)| *v)
                .collect(),
            taking_over: r.taking_over(job, holds).is_some(),
        })
    }))
}

/// The version that took or is taking the job over from this worker's, if one did: a
/// blocking read of the registry.
pub fn superseded(settings: &IdentitySettings) -> Result<Option<Superseded>> {
    let mine = &settings.identity;
    Ok(read_registry_if_any(settings)?
        .and_then(|r| r.superseding(&mine.job, mine.version()))
        .map(|by| Superseded {
            job: mine.job.clone(),
            mine: mine.version(),
            by,
        }))
}

/// The takeover's record: this version (rebuilding) is taking the job over. Idempotent.
pub async fn record_taking_over(settings: &IdentitySettings) -> Result<()> {
    let mine = &settings.identity;
    let registry = read_registry(settings)?;
    let holds = registry.job(&mine.job).map_or(0, JobIdentity::version);
    if holds >= mine.version() || registry.taking_over(&mine.job, holds) == Some(mine.version()) {
        return Ok(());
    }
    if registry
        .rebuilding(&mine.job, holds)
        .is_none_or(|r| r != mine)
    {
        bail!(
            "job {}: version {} is not the version rebuilding (recorded in {}): it cannot take the job over",
            mine.job,
            mine.version(),
            settings.registry_topic
        );
    }
    let value = serde_json::to_vec(&VersionState::TakingOver(mine.clone()))
        .context("encoding the takeover")?;
    tally_kafka::job_registry::record(
        &settings.kafka,
        &settings.registry_topic,
        &version_key(&mine.job, mine.version()),
        Some(&value),
    )
    .await?;
    Ok(())
}

/// The takeover's end: the job's record becomes this version's identity. Idempotent.
pub async fn record_took_over(settings: &IdentitySettings) -> Result<()> {
    let mine = &settings.identity;
    let registry = read_registry(settings)?;
    if registry.job(&mine.job) == Some(mine) {
        return Ok(());
    }
    let (kafka, topic) = (&settings.kafka, &settings.registry_topic);
    let job = serde_json::to_vec(mine).context("encoding the job's identity")?;
    tally_kafka::job_registry::record(kafka, topic, &mine.job, Some(&job)).await?;
    let done = serde_json::to_vec(&VersionState::TookOver).context("encoding the takeover")?;
    tally_kafka::job_registry::record(
        kafka,
        topic,
        &version_key(&mine.job, mine.version()),
        Some(&done),
    )
    .await?;
    Ok(())
}

/// Checks the job against Kafka's registry, recording it there if it is new, or as the version
/// rebuilding beside the one that holds the job if it is a new version.
pub async fn check_registry(settings: &IdentitySettings) -> Result<()> {
    let (kafka, topic) = (&settings.kafka, &settings.registry_topic);
    tally_kafka::job_registry::ensure_job_registry(kafka, topic, settings.replication_factor)
        .await?;
    let mine = &settings.identity;
    let place = format!("Kafka topic {topic}");
    let mut recorded_now = false;
    loop {
        let registry = read_registry(settings)?;
        if let Some((key, value, other)) = first_claimant(&registry.jobs, mine) {
            bail!(IdentityRefused(format!(
                "job {}: {key} {value:?} belongs to job {} (recorded in {place} first): two jobs cannot share it \
                 (one would wait for ever for the other's lease, or truncate, fence or overwrite the other's records). \
                 Give this job its own {key}, or stop job {} and `tally retire` it",
                mine.job, other.job, other.job
            )));
        }
        let (key, value) = match registry.job(&mine.job) {
            Some(own) => {
                let (holds, new) = (own.version(), mine.version());
                if let Some(by) = registry.superseding(&mine.job, new) {
                    bail!(Superseded {
                        job: mine.job.clone(),
                        mine: new,
                        by
                    });
                }
                if new == holds {
                    refuse_differences(own, mine, &place)?;
                    return Ok(());
                }
                if new < holds {
                    bail!(IdentityRefused(format!(
                        "job {}: version {holds} holds the job (recorded in {place}); this worker runs version {new}, an earlier one. \
                         Run the job's workers with version {holds}'s file; going back is one more version with the old rules",
                        mine.job
                    )));
                }
                if registry.aborted(&mine.job, new) {
                    bail!(IdentityRefused(format!(
                        "job {}: version {new} was aborted (`tally retire` of it, recorded in {place}) and its resources are not reused: \
                         run the change as version {}",
                        mine.job,
                        new + 1
                    )));
                }
                match registry.rebuilding(&mine.job, holds) {
                    Some(r) if r.version() == new => {
                        refuse_differences(r, mine, &place)?;
                        tracing::info!(job = %mine.job, version = new, holds, "rebuilding beside the version that holds the job");
                        return Ok(());
                    }
                    Some(r) => bail!(IdentityRefused(format!(
                        "job {}: version {} is rebuilding already (recorded in {place}), one version at a time: \
                         let it take over, or stop its workers and `tally retire --config <its file>` (an abort), then run this one as version {}",
                        mine.job,
                        r.version(),
                        r.version().max(new) + 1
                    ))),
                    None => (
                        version_key(&mine.job, new),
                        serde_json::to_vec(&VersionState::Rebuilding(mine.clone())),
                    ),
                }
            }
            None if mine.version() > 1 => bail!(IdentityRefused(format!(
                "job {}: version {} is a new version of a running job, but the registry ({place}) holds no record of the job: \
                 start it at job.version = 1 (or leave job.version out)",
                mine.job,
                mine.version()
            ))),
            None => (mine.job.clone(), serde_json::to_vec(mine)),
        };
        if recorded_now {
            bail!("job {}: recorded in {topic}, but not read back", mine.job);
        }
        let value = value.context("encoding the job's identity")?;
        tally_kafka::job_registry::record(kafka, topic, &key, Some(&value)).await?;
        tracing::info!(job = %mine.job, version = mine.version(), topic = %topic, "recorded the job in the registry of jobs");
        // Read back: a job that claimed one of these resources, or a version recorded
        // rebuilding, just before wins.
        recorded_now = true;
    }
}

/// Checks the job (`mine`) against the identity recorded beside its tables, recording it if
/// the tables are new.
pub async fn check_tables(mine: &JobIdentity, sink: &ClickHouseSink) -> Result<()> {
    let rules = serde_json::to_string(mine).context("encoding the job's identity")?;
    let table = sink.names().identity();
    for attempt in 0..50 {
        match sink.recorded_identity(&rules).await? {
            Some(recorded) => {
                let recorded: JobIdentity = serde_json::from_str(&recorded)
                    .with_context(|| format!("{table} does not hold a tally job's identity"))?;
                if recorded.job != mine.job {
                    bail!(IdentityRefused(format!(
                        "job {}: the tables of {} are written by job {} (recorded in {table}): two jobs cannot write one table. \
                         Point clickhouse.table at a table of this job's own, or stop job {} and `tally retire` it",
                        mine.job,
                        sink.names().view_q(),
                        recorded.job,
                        recorded.job
                    )));
                }
                refuse_differences(&recorded, mine, &table)?;
                return Ok(());
            }
            // Created by another worker an instant ago, its row not written yet.
            None if attempt < 49 => tokio::time::sleep(Duration::from_millis(100)).await,
            None => {}
        }
    }
    bail!("{table} exists but holds no identity: drop it, and tally records the job's again")
}

/// Checks the job's identity in both places, waiting out services that are down. `false`: a
/// shutdown came first.
pub async fn check(
    settings: &IdentitySettings,
    shutdown: &std::sync::atomic::AtomicBool,
) -> Result<bool> {
    let mut backoff = Duration::from_millis(200);
    loop {
        let attempt = async {
            // First: a TLS or SASL failure is named here, and no retry cures it.
            tally_kafka::check_connection(&settings.kafka, Duration::from_secs(10))?;
            check_registry(settings).await?;
            // On a cluster, any replica that answers: the identity is replicated there.
            let sink = ClickHouseSink::connect_first(&settings.replicas).await?;
            sink.ensure_schema().await?;
            check_tables(&settings.identity, &sink).await
        };
        match attempt.await {
            Ok(()) => return Ok(true),
            Err(e)
                if e.is::<IdentityRefused>()
                    || e.is::<Superseded>()
                    || e.downcast_ref::<tally_clickhouse::SinkError>()
                        .is_some_and(|e| {
                            !matches!(e, tally_clickhouse::SinkError::Server { .. })
                        })
                    || e.downcast_ref::<tally_kafka::Error>()
                        .is_some_and(|e| matches!(e, tally_kafka::Error::Refused(_))) =>
            {
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "cannot check the job's identity yet; retrying");
            }
        }
        let until = std::time::Instant::now() + backoff;
        while std::time::Instant::now() < until {
            if shutdown.load(std::sync::atomic::Ordering::SeqCst) {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// `tally retire`: frees the job's name and resources in the registry and beside its tables;
/// of a new version still rebuilding, aborts it (the version that holds the job runs on).
pub async fn retire(settings: &IdentitySettings) -> Result<()> {
    let (kafka, topic) = (&settings.kafka, &settings.registry_topic);
    let mine = &settings.identity;
    let job = &mine.job;
    tally_kafka::job_registry::ensure_job_registry(kafka, topic, settings.replication_factor)
        .await?;
    let registry = read_registry(settings)?;
    let holds = registry.job(job).map(JobIdentity::version);
    let version = mine.version();
    if holds.is_some_and(|h| version > h) {
        if registry
            .rebuilding(job, holds.unwrap_or(1))
            .is_none_or(|r| r.version() != version)
        {
            bail!(
                "job {job}: version {version} is not rebuilding (recorded in {topic}): there is nothing of it to retire"
            );
        }
        if registry.taking_over(job, holds.unwrap_or(1)) == Some(version) {
            bail!(
                "job {job}: version {version} is taking the view over (recorded in {topic}): too late to abort; \
                 let it finish (its next holder of the read side does), and go back as one more version with the old rules"
            );
        }
        let aborted = serde_json::to_vec(&VersionState::Aborted).context("encoding the abort")?;
        tally_kafka::job_registry::record(kafka, topic, &version_key(job, version), Some(&aborted))
            .await?;
        println!(
            "aborted version {version} of job {job} in {topic}: version {} holds the job and runs on; a new attempt is version {}",
            holds.unwrap_or(1),
            version + 1
        );
    } else {
        tally_kafka::job_registry::record(kafka, topic, job, None).await?;
        println!("retired job {job} in {topic}");
    }
    // A table of each replica, replicated or not: dropped on every one.
    for replica in &settings.replicas {
        let sink = ClickHouseSink::connect(replica)
            .await
            .with_context(|| format!("retiring job {job} on {}", replica.url))?;
        sink.forget_identity().await?;
        println!(
            "dropped {} on {} (the version's tables and topics stay; drop them when no reader needs them)",
            sink.names().identity(),
            replica.url
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_kafka::job_registry::Registration;

    fn identity(job: &str, rules: &[(&str, &str)]) -> JobIdentity {
        JobIdentity {
            job: job.into(),
            rules: rules
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    fn registration(offset: i64, id: &JobIdentity) -> Registration {
        Registration {
            offset,
            job: id.job.clone(),
            value: serde_json::to_vec(id).ok(),
        }
    }

    #[test]
    fn every_differing_rule_is_named_with_both_values() {
        let job = identity("a", &[("window.size", "60000ms"), ("job.tasks", "1")]);
        let worker = identity("a", &[("window.size", "30000ms"), ("job.tasks", "1")]);
        let err = refuse_differences(&job, &worker, "x")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains(r#"window.size: the job has "60000ms", this worker "30000ms""#),
            "{err}"
        );
        assert!(!err.contains("job.tasks"), "{err}");
        assert!(refuse_differences(&job, &job, "x").is_ok());
        // A declaration shows the lines that differ, not itself twice.
        let declared = |filter: &str| {
            identity(
                "a",
                &[(
                    "aggregation",
                    &format!("aggregation:\n  field  status integer\n  filter {filter}\n"),
                )],
            )
        };
        let err = refuse_differences(&declared("status <= 599"), &declared("status <= 499"), "x")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains(
                r#"aggregation: the job has "filter status <= 599", this worker "filter status <= 499""#
            ),
            "{err}"
        );
    }

    #[test]
    fn the_first_job_to_record_a_resource_owns_it() {
        let a = identity(
            "a",
            &[("kafka.consumer_group", "g"), ("clickhouse.table", "t.a")],
        );
        let b = identity(
            "b",
            &[("kafka.consumer_group", "g"), ("clickhouse.table", "t.b")],
        );
        let recorded = current(&[registration(0, &a), registration(1, &b)])
            .unwrap_or_default()
            .jobs;
        let (key, _, owner) = first_claimant(&recorded, &b).unwrap_or(("", "", &b));
        assert_eq!((key, owner.job.as_str()), ("kafka.consumer_group", "a"));
        assert!(first_claimant(&recorded, &a).is_none(), "a is first");
        // Retired, a frees the group; a later record of a again comes after b's.
        let retired = Registration {
            offset: 2,
            job: "a".into(),
            value: None,
        };
        let recorded = current(&[registration(0, &a), registration(1, &b), retired.clone()])
            .unwrap_or_default()
            .jobs;
        assert!(first_claimant(&recorded, &b).is_none());
        let again = current(&[
            registration(0, &a),
            registration(1, &b),
            retired,
            registration(3, &a),
        ])
        .unwrap_or_default()
        .jobs;
        assert!(first_claimant(&again, &b).is_none());
        assert!(first_claimant(&again, &a).is_some());
    }

    fn claim(offset: i64, job: &str, version: u64, state: &VersionState) -> Registration {
        Registration {
            offset,
            job: version_key(job, version),
            value: serde_json::to_vec(state).ok(),
        }
    }

    #[test]
    fn of_two_new_versions_the_first_recorded_rebuilds_and_an_aborted_one_is_not_reused() {
        let v1 = identity("a", &[("kafka.consumer_group", "g")]);
        let with_version = |n: &str| identity("a", &[("kafka.consumer_group", "g"), (VERSION, n)]);
        let (v2, v3) = (with_version("2"), with_version("3"));
        let registry = current(&[
            registration(0, &v1),
            claim(1, "a", 3, &VersionState::Rebuilding(v3.clone())),
            claim(2, "a", 2, &VersionState::Rebuilding(v2.clone())),
        ])
        .unwrap_or_default();
        // The holder's record is the job's, not taken for another's: nothing is claimed twice.
        assert_eq!(registry.jobs.len(), 1);
        assert!(first_claimant(&registry.jobs, &v2).is_none());
        assert_eq!(registry.rebuilding("a", 1), Some(&v3), "recorded first");
        assert_eq!(registry.rebuilding("a", 3), None, "at or below the holder");
        let aborted = current(&[
            registration(0, &v1),
            claim(1, "a", 3, &VersionState::Rebuilding(v3)),
            claim(2, "a", 3, &VersionState::Aborted),
        ])
        .unwrap_or_default();
        assert_eq!(aborted.rebuilding("a", 1), None);
        assert!(aborted.aborted("a", 3));
        assert!(!aborted.aborted("a", 4));
        // A record of the releases before versions reads as before.
        let old = serde_json::to_vec(&v1).unwrap_or_default();
        assert_eq!(
            serde_json::from_slice::<JobIdentity>(&old).ok(),
            Some(v1.clone())
        );
        assert_eq!(v1.version(), 1);
    }

    #[test]
    fn a_version_taking_over_supersedes_the_holder_and_is_still_the_one_rebuilding() {
        let v1 = identity("a", &[("kafka.consumer_group", "g")]);
        let v2 = identity("a", &[("kafka.consumer_group", "g"), (VERSION, "2")]);
        let rebuilding = current(&[
            registration(0, &v1),
            claim(1, "a", 2, &VersionState::Rebuilding(v2.clone())),
        ])
        .unwrap_or_default();
        assert_eq!(rebuilding.superseding("a", 1), None, "rebuilding only");
        let taking = current(&[
            registration(0, &v1),
            claim(1, "a", 2, &VersionState::Rebuilding(v2.clone())),
            claim(2, "a", 2, &VersionState::TakingOver(v2.clone())),
        ])
        .unwrap_or_default();
        assert_eq!(taking.superseding("a", 1), Some(2), "the holder stops");
        assert_eq!(taking.superseding("a", 2), None, "not itself");
        assert_eq!(
            taking.rebuilding("a", 1),
            Some(&v2),
            "its workers still start"
        );
        assert_eq!(taking.taking_over("a", 1), Some(2));
        let took = current(&[
            registration(0, &v1),
            claim(1, "a", 2, &VersionState::TakingOver(v2.clone())),
            registration(2, &v2),
            claim(3, "a", 2, &VersionState::TookOver),
        ])
        .unwrap_or_default();
        assert_eq!(took.job("a").map(JobIdentity::version), Some(2));
        assert_eq!(
            took.superseding("a", 1),
            Some(2),
            "a late start of version 1 stops"
        );
        assert_eq!(took.superseding("a", 2), None);
        assert_eq!(took.rebuilding("a", 2), None);
        assert_eq!(took.taking_over("a", 2), None);
    }
}
