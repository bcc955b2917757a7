//! Where and how a job writes to ClickHouse.

use std::time::Duration;

use serde::Deserialize;

use crate::schema::Shape;

/// A password that never shows in logs or `Debug` output.
#[derive(Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Written as whether it is set (`***`), never as itself: settings shown back to a user.
impl serde::Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(if self.0.is_empty() { "" } else { "***" })
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "\"***\"" })
    }
}

#[derive(Debug, Clone)]
pub struct SinkSettings {
    pub url: String,
    pub database: String,
    /// Name of the reader view; the data and commit tables are named after it.
    pub table: String,
    pub user: String,
    pub password: Secret,
    /// PEM certificates trusted for `https://` besides the system's roots.
    pub ca_file: Option<std::path::PathBuf>,
    pub request_timeout: Duration,
    /// The job's keys and aggregates: its tables' columns and the rows it writes.
    pub shape: Shape,
    /// The cluster whose replica `url` is (`clickhouse.cluster`): the job's truth is then
    /// replicated (see `replicas`).
    pub cluster: Option<String>,
}
