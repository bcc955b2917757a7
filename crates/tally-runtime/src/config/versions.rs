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
/// deleted changes from it (a rebuild from a new snapshot, by a connector of the version's own,
/// is docs/design/restatement.md's, not built). `None`: the topic holds every change since the
/// connector's first snapshot.
pub fn history_lost(extent: &std::collections::BTreeMap<i32, (i64, i64)>) -> Option<String> {
    let trimmed: Vec<String> = extent
        .iter()
        .filter(|(_, (first, _))| *first > 0)
        .map(|(p, (first, _))| format!("partition {p} starts at offset {first}"))
        .collect();
    (!trimmed.is_empty()).then(|| {
        format!(
            "a new version of a job of changes reads its topic from its start, for every change of each row (a change retracts the row's earlier image), and retention deleted changes from it ({}): a rebuild from a new snapshot, by a connector of the version's own, is not built in this release (docs/design/restatement.md)",
            trimmed.join(", ")
        )
    })
}
