//! What a new version of a job changes against the running one (`tally check-config` of a file
//! with `job.version` above 1), and what makes it one that cannot be restated: the first slice
//! of docs/design/restatement.md. The comparison itself ([`compare`]) is pure; [`read`] gathers
//! what it compares from the registry of jobs, the view and the source topic.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use anyhow::{Context, Result};
use tally_clickhouse::ClickHouseSink;
use tally_runtime::identity::{JobIdentity, RESTATE_FROM, VERSION};
use tally_runtime::settings::JobSettings;

/// What the running version is, as the services hold it.
#[derive(Debug, Clone, Default)]
pub struct Running {
    /// The job's record in the registry of jobs; `None`: the job is not recorded.
    pub identity: Option<JobIdentity>,
    /// The view's columns by name and type (as `tally_clickhouse::normalise_type` writes it);
    /// `None`: no view.
    pub view_columns: Option<Vec<(String, String)>>,
    /// Each source partition's earliest record time still held (`None`: the partition is empty).
    pub earliest: BTreeMap<i32, Option<i64>>,
    /// Each source partition's first and next offsets.
    pub extent: BTreeMap<i32, (i64, i64)>,
    /// A new version rebuilding beside the running one.
    pub rebuilding: Option<u64>,
    /// Versions aborted before they took over.
    pub aborted: Vec<u64>,
}

/// What the new version changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionChange {
    pub job: String,
    pub running: u64,
    pub new: u64,
    /// `(key, running, new)` for every rule that differs but the version.
    pub rules: Vec<(String, String, String)>,
    pub columns_added: Vec<String>,
    pub columns_removed: Vec<String>,
    /// `(column, running type, new type)`.
    pub columns_retyped: Vec<(String, String, String)>,
    /// Where the rebuild starts reading, in event time: `restate_from` less what the rules let
    /// a record lag behind its window; `None`: the whole history the source holds.
    pub reads_from: Option<i64>,
    pub restate_from: Option<i64>,
    /// The earliest record the source holds, over its partitions.
    pub earliest: Option<i64>,
    /// A job of changes: it reads its whole topic whatever `restate_from`.
    pub changes: bool,
}

/// A new version that cannot be restated, naming the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub key: &'static str,
    pub message: String,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

impl std::error::Error for Refusal {}

/// Compares the new version's identity and view with the running version's; `changes`: a job
/// of changes.
pub fn compare(
    mine: &JobIdentity,
    view_columns: &[(String, String)],
    restate_from: Option<i64>,
    lead_ms: i64,
    changes: bool,
    running: &Running,
) -> Result<VersionChange, Refusal> {
    let Some(recorded) = &running.identity else {
        return Err(Refusal {
            key: "job.version",
            message: format!(
                "job {} is not running (the registry of jobs holds no record of it): there is no version to restate; start it at job.version = 1 (or leave job.version out)",
                mine.job
            ),
        });
    };
    let (old, new) = (recorded.version(), mine.version());
    if new <= old {
        return Err(Refusal {
            key: "job.version",
            message: format!(
                "{new} is not above the running version {old}: a new version is {} or more (going back is one more version, with the old rules)",
                old + 1
            ),
        });
    }
    if running.aborted.contains(&new) {
        return Err(Refusal {
            key: "job.version",
            message: format!(
                "version {new} was aborted (`tally retire` of it) and its resources are not reused: make the change version {}",
                running.aborted.iter().max().map_or(new, |a| *a.max(&new)) + 1
            ),
        });
    }
    if let Some(other) = running.rebuilding.filter(|r| *r != new) {
        return Err(Refusal {
            key: "job.version",
            message: format!(
                "version {other} is rebuilding already, one version at a time: let it take over, or stop its workers and `tally retire --config <its file>` (an abort)"
            ),
        });
    }
    let earliest = running.earliest.values().flatten().copied().min();
    if changes && let Some(why) = tally_runtime::config::history_lost(&running.extent) {
        return Err(Refusal {
            key: "kafka.source_topic",
            message: why,
        });
    }
    let reads_from = restate_from
        .filter(|_| !changes)
        .map(|at| at.saturating_sub(lead_ms));
    if let Some(from) = reads_from {
        let short: Vec<String> = running
            .earliest
            .iter()
            .filter_map(|(p, t)| t.filter(|t| *t > from).map(|t| (p, t)))
            .map(|(p, t)| format!("partition {p} from {}", tally_core::time::format_ms(t)))
            .collect();
        if !short.is_empty() {
            return Err(Refusal {
                key: "job.restate_from",
                message: format!(
                    "the source no longer holds what the restatement reads: it reads from {} (restate_from less the window's size, out_of_orderness and allowed_lateness), and the topic holds {}. Restate from later, or without restate_from rebuild what the topic holds",
                    tally_core::time::format_ms(from),
                    short.join(", ")
                ),
            });
        }
    }
    let rules = recorded
        .differences(mine)
        .into_iter()
        .filter(|(k, _, _)| k != VERSION && k != RESTATE_FROM)
        .collect();
    let found = running.view_columns.clone().unwrap_or_default();
    let named = |cs: &[(String, String)]| {
        cs.iter()
            .map(|(c, t)| (c.clone(), tally_clickhouse::normalise_type(t)))
            .collect::<BTreeMap<_, _>>()
    };
    let (was, will) = (named(&found), named(view_columns));
    Ok(VersionChange {
        job: mine.job.clone(),
        running: old,
        new,
        rules,
        columns_added: will
            .keys()
            .filter(|c| !was.contains_key(*c))
            .cloned()
            .collect(),
        columns_removed: was
            .keys()
            .filter(|c| !will.contains_key(*c))
            .cloned()
            .collect(),
        columns_retyped: will
            .iter()
            .filter_map(|(c, t)| {
                was.get(c)
                    .filter(|old| *old != t)
                    .map(|old| (c.clone(), old.clone(), t.clone()))
            })
            .collect(),
        reads_from,
        restate_from,
        earliest,
        changes,
    })
}

/// Reads the running version from the services the job's `settings` name: its record in the
/// registry of jobs, its view's columns, and the source topic's earliest records.
pub async fn read(settings: &JobSettings) -> Result<Running> {
    let versions = tally_runtime::identity::versions(&settings.identity)
        .await
        .context("reading the registry of jobs")?;
    let identity = versions.as_ref().map(|v| v.holder.clone());
    // The job's view, which the running version holds (not this version's own).
    let replicas: Vec<_> = settings
        .replicas
        .iter()
        .map(|r| tally_clickhouse::SinkSettings {
            table: settings.view.clone(),
            ..r.clone()
        })
        .collect();
    let sink = ClickHouseSink::connect_first(&replicas).await?;
    let view_columns = sink.found_view_columns().await?;
    let kafka = settings.source.kafka.clone();
    let topic = settings.source.source_topic.clone();
    let (earliest, extent) = tokio::task::spawn_blocking(move || earliest_times(&kafka, &topic))
        .await
        .context("reading the source's earliest records")??;
    Ok(Running {
        identity,
        view_columns,
        earliest,
        extent,
        rebuilding: versions.as_ref().and_then(|v| v.rebuilding),
        aborted: versions.map(|v| v.aborted).unwrap_or_default(),
    })
}

/// Each partition's earliest record time (the first readable record at or after its low
/// watermark: a transaction's marker holds no time; a few records on are enough), and its
/// first and next offsets.
type Extent = BTreeMap<i32, (i64, i64)>;
fn earliest_times(
    kafka: &tally_kafka::KafkaSettings,
    topic: &str,
) -> Result<(BTreeMap<i32, Option<i64>>, Extent)> {
    let extent = tally_kafka::topic_extent(kafka, topic)?;
    let ranges: BTreeMap<i32, (i64, Option<i64>)> = extent
        .iter()
        .filter(|(_, (low, high))| high > low)
        .map(|(p, (low, high))| (*p, (*low, Some((*low + 16).min(*high)))))
        .collect();
    let mut earliest: BTreeMap<i32, Option<i64>> = extent.keys().map(|p| (*p, None)).collect();
    tally_kafka::read_committed_range(kafka, topic, &ranges, Duration::from_secs(30), |m| {
        use rdkafka::Message;
        if let (Some(ms), Some(slot)) =
            (m.timestamp().to_millis(), earliest.get_mut(&m.partition()))
        {
            *slot = Some(slot.map_or(ms, |t: i64| t.min(ms)));
        }
    })
    .with_context(|| format!("reading the first records of {topic}"))?;
    Ok((earliest, extent))
}

impl fmt::Display for VersionChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "job {}: version {} changes the running version {}:",
            self.job, self.new, self.running
        )?;
        if self.rules.is_empty() {
            writeln!(f, "  rules: none changed")?;
        }
        for (key, old, new) in &self.rules {
            writeln!(f, "  rule {key}: {old} -> {new}")?;
        }
        for c in &self.columns_added {
            writeln!(f, "  the view gains column {c}")?;
        }
        for c in &self.columns_removed {
            writeln!(f, "  the view loses column {c}")?;
        }
        for (c, old, new) in &self.columns_retyped {
            writeln!(f, "  the view's column {c}: {old} -> {new}")?;
        }
        let held = self.earliest.map_or("nothing yet".to_owned(), |t| {
            format!("records from {} on", tally_core::time::format_ms(t))
        });
        // A job of changes whose version names a topic of its own reads a new snapshot.
        let topic = self
            .rules
            .iter()
            .find(|(k, _, _)| k == "kafka.source_topic")
            .map_or("the whole topic".to_owned(), |(_, old, new)| {
                format!("its own topic {new} from its start, a new snapshot by a connector of its own (version {} reads {old})", self.running)
            });
        match (self.restate_from, self.reads_from) {
            (Some(at), _) if self.changes => writeln!(
                f,
                "  restates windows from {} on, reading {topic} (it holds {held}, every change since the connector's first snapshot: a job of changes needs each row's every change); earlier windows stay as version {} published them",
                tally_core::time::format_ms(at),
                self.running
            ),
            (None, _) if self.changes => writeln!(
                f,
                "  rebuilds every window from {topic} (it holds {held}, every change since the connector's first snapshot)"
            ),
            (Some(at), Some(from)) => writeln!(
                f,
                "  restates windows from {} on, reading the source from {} (the topic holds {held}); earlier windows stay as version {} published them",
                tally_core::time::format_ms(at),
                tally_core::time::format_ms(from),
                self.running
            ),
            _ => writeln!(
                f,
                "  rebuilds every window from the whole topic (it holds {held})"
            ),
        }
    }
}

#[cfg(test)]
mod tests;
