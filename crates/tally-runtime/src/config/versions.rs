//! What each version of a job owns, named from the file's names (docs/design/restatement.md,
//! "Each version has its own resources"), and where a new version starts reading.

use super::{Config, StartFrom};

impl Config {
    /// A name of the file's, as this version's resources have it: version 1 keeps it (a job
    /// deployed before versions), version `N` adds `<sep>v<N>` (see docs/design/restatement.md).
    fn versioned(&self, name: String, sep: &str) -> String {
        match self.job.version {
            0 | 1 => name,
            n => format!("{name}{sep}v{n}"),
        }
    }

    /// `kafka.dlq_topic` as the file has it (the identity records it), or its default.
    pub(crate) fn file_dlq_topic(&self) -> String {
        self.kafka
            .dlq_topic
            .clone()
            .unwrap_or_else(|| format!("{}.dlq", self.kafka.source_topic))
    }

    /// `kafka.changelog_topic` as the file has it (the identity records it), or its default.
    pub(crate) fn file_changelog_topic(&self) -> String {
        self.kafka
            .changelog_topic
            .clone()
            .unwrap_or_else(|| format!("{}-changelog", self.kafka.consumer_group))
    }

    /// `kafka.transactional_id` as the file has it (the identity records it), or its default.
    pub(crate) fn file_transactional_id(&self) -> String {
        self.kafka
            .transactional_id
            .clone()
            .unwrap_or_else(|| format!("tally-{}", self.job.name))
    }

    /// This version's consumer group: `kafka.consumer_group`, or `<group>-v<N>`.
    pub fn consumer_group(&self) -> String {
        self.versioned(self.kafka.consumer_group.clone(), "-")
    }

    /// This version's dead-letter topic: `kafka.dlq_topic` (or `<source>.dlq`), or `<dlq>.v<N>`.
    pub fn dlq_topic(&self) -> String {
        self.versioned(self.file_dlq_topic(), ".")
    }

    /// This version's changelog topic: `kafka.changelog_topic` (`-v<N>` added), or
    /// `<group>-changelog` of this version's group.
    pub fn changelog_topic(&self) -> String {
        match &self.kafka.changelog_topic {
            Some(topic) => self.versioned(topic.clone(), "-"),
            None => format!("{}-changelog", self.consumer_group()),
        }
    }

    /// The one-partition topic whose assignment in the version's group says which worker runs it.
    pub fn lease_topic(&self) -> String {
        format!("{}-lease", self.consumer_group())
    }

    /// This version's transactional id; each task of several adds `-task-K` (see
    /// [`crate::settings::JobSettings::task`]).
    pub fn transactional_id(&self) -> String {
        self.versioned(self.file_transactional_id(), "-")
    }

    /// This version's state directory: `job.state_dir`, or `<state_dir>/v<N>`.
    pub fn state_dir(&self) -> std::path::PathBuf {
        match self.job.version {
            0 | 1 => self.job.state_dir.clone(),
            n => self.job.state_dir.join(format!("v{n}")),
        }
    }

    /// The name this version's tables are named after, and its own view's: `clickhouse.table`,
    /// or `<table>__v<N>` (the job's view, `clickhouse.table`, is the one its version holds).
    pub fn version_table(&self) -> String {
        self.versioned(self.clickhouse.table.clone(), "__")
    }

    /// `job.restate_from` in milliseconds since the epoch (validated at parse).
    pub fn restate_from_ms(&self) -> Option<i64> {
        self.job
            .restate_from
            .as_deref()
            .and_then(tally_core::time::parse_rfc3339_ms)
    }

    /// A change job's capture (`source.postgres`, `source.slot`): `None` for a job of events or
    /// when either is not set.
    pub fn capture_settings(&self) -> Option<crate::capture::CaptureSettings> {
        let source = &self.source;
        match (&self.declared.changes, &source.postgres, &source.slot) {
            (Some(_), Some(postgres), Some(slot)) => Some(crate::capture::CaptureSettings {
                postgres: postgres.clone(),
                password: source.password.expose().to_owned(),
                slot: slot.clone(),
                signal_table: source.signal_table.clone(),
            }),
            _ => None,
        }
    }

    /// Where the windows this version computes start: `restate_from` for a version above 1,
    /// `None` (every window) otherwise.
    pub fn computes_from_ms(&self) -> Option<i64> {
        (self.job.version > 1)
            .then(|| self.restate_from_ms())
            .flatten()
    }

    /// [`topic_refused`] for this version, when the version it takes over reads `running`.
    pub fn topic_refused_after(&self, running: &str) -> Option<(&'static str, String)> {
        topic_refused(
            running,
            &self.kafka.source_topic,
            self.declared.changes.is_some(),
            self.capture_settings().is_some(),
        )
    }

    /// How far before `restate_from` a restatement reads: a record of a window that starts at
    /// `restate_from` may come this much earlier in the source (its window's size, the
    /// out-of-orderness and the lateness the rules allow).
    pub fn restatement_lead_ms(&self) -> i64 {
        let w = &self.window;
        w.size
            .0
            .saturating_add(w.out_of_orderness.0)
            .saturating_add(w.allowed_lateness.0)
    }

    /// Where a new version starts in its topic: the records from `restate_from` less
    /// [`Config::restatement_lead_ms`] (by record time), or every record the topic holds; version
    /// 1 from `job.start_from`. A job of changes reads every record: a row's change retracts its
    /// earlier image, whenever that was written, and a row's time is not its change's.
    pub fn start_from(&self) -> tally_kafka::StartFrom {
        match (self.job.version, self.restate_from_ms()) {
            (0 | 1, _) => match self.job.start_from {
                StartFrom::Earliest => tally_kafka::StartFrom::Earliest,
                StartFrom::Latest => tally_kafka::StartFrom::Latest,
            },
            _ if self.declared.changes.is_some() => tally_kafka::StartFrom::Earliest,
            (_, Some(at)) => {
                tally_kafka::StartFrom::Time(at.saturating_sub(self.restatement_lead_ms()))
            }
            (_, None) => tally_kafka::StartFrom::Earliest,
        }
    }
}

/// Why a new version of a job of changes cannot be rebuilt from its topic, given each
/// partition's `(first, next)` offsets: it reads the topic from its start, and retention has
/// deleted changes from it. `None`: the topic holds every change since its connector's first
/// snapshot.
pub fn history_lost(extent: &std::collections::BTreeMap<i32, (i64, i64)>) -> Option<String> {
    let trimmed: Vec<String> = extent
        .iter()
        .filter(|(_, (first, _))| *first > 0)
        .map(|(p, (first, _))| format!("partition {p} starts at offset {first}"))
        .collect();
    (!trimmed.is_empty()).then(|| {
        format!(
            "a new version of a job of changes reads its topic from its start, for every change of each row (a change retracts the row's earlier image), and retention deleted changes from it ({}). Give the version a new snapshot: register a connector of its own (the running one's settings with its own name, slot.name and topic.prefix; snapshot.mode = initial), and name its topic in kafka.source_topic, its slot in source.slot (docs/operations.md, \"Restating a change job whose topic retention has trimmed\")",
            trimmed.join(", ")
        )
    })
}

/// Why a new version cannot read `mine` when the version it takes over reads `running`:
/// offsets of two topics do not compare, so only a job of changes may (its versions meet in
/// the database's log), and only with its connector's slot named. `None`: it may.
pub fn topic_refused(
    running: &str,
    mine: &str,
    changes: bool,
    captured: bool,
) -> Option<(&'static str, String)> {
    if running == mine {
        return None;
    }
    if !changes {
        return Some((
            "kafka.source_topic",
            format!(
                "{mine:?} is not the running version's topic {running:?}: a version of a job of events reads the topic the job reads (the takeover compares the two versions' offsets in it); a job of another topic is a new job"
            ),
        ));
    }
    (!captured).then(|| {
        (
            "source.slot",
            format!(
                "the version reads its own topic {mine:?}, a new snapshot, not the running version's {running:?}: the two versions meet in the database's log, so source.postgres and source.slot must name the database and the slot of the connector writing {mine:?} (the takeover waits until that slot has confirmed where the running version stopped)"
            ),
        )
    })
}
