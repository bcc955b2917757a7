//! How the source's changes reach Kafka: the replication slot the connector reads (PostgreSQL
//! keeps the WAL from its confirmed position on, so nothing committed after it is lost while
//! the slot lives) and the connector's state in Kafka Connect. `doctor`'s evidence for the
//! Produced → Accepted hop of a change job.

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tally_core::declare::lsn_text;

use super::SourceDatabase;

/// The slot as PostgreSQL reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: String,
    pub active: bool,
    /// Up to where the connector confirmed it has the changes (flushed to Kafka).
    pub confirmed_lsn: u64,
    /// The WAL's end now.
    pub current_lsn: u64,
    /// `reserved`, `extended`, `unreserved` or `lost` (the WAL it needs is gone).
    pub wal_status: String,
}

impl Slot {
    /// WAL bytes written since the connector's confirmed position.
    pub fn behind_bytes(&self) -> u64 {
        self.current_lsn.saturating_sub(self.confirmed_lsn)
    }
}

/// Reads replication slot `name`; `None` if it does not exist.
pub async fn slot(source: &SourceDatabase, name: &str) -> Result<Option<Slot>> {
    let client = source.connect().await?;
    let row = client
        .query_opt(
            "SELECT active, coalesce(confirmed_flush_lsn, '0/0')::text, coalesce(wal_status, '')::text, \
             pg_current_wal_lsn()::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&name],
        )
        .await
        .with_context(|| format!("source: reading replication slot {name}"))?;
    let Some(row) = row else {
        return Ok(None);
    };
    Ok(Some(Slot {
        name: name.to_owned(),
        active: row.get(0),
        confirmed_lsn: super::lsn(&row.get::<_, String>(1))?,
        wal_status: row.get(2),
        current_lsn: super::lsn(&row.get::<_, String>(3))?,
    }))
}

/// A connector's state as Kafka Connect's REST API reports it.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct ConnectorStatus {
    pub name: String,
    pub connector: State,
    pub tasks: Vec<TaskState>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct State {
    pub state: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct TaskState {
    pub id: u32,
    pub state: String,
    #[serde(default)]
    pub trace: Option<String>,
}

impl ConnectorStatus {
    /// The connector and every task running.
    pub fn running(&self) -> bool {
        self.connector.state == "RUNNING"
            && !self.tasks.is_empty()
            && self.tasks.iter().all(|t| t.state == "RUNNING")
    }

    pub fn describe(&self) -> String {
        let tasks: Vec<String> = self
            .tasks
            .iter()
            .map(|t| {
                let first = t
                    .trace
                    .as_deref()
                    .and_then(|trace| trace.lines().next())
                    .map(|l| format!(" ({l})"))
                    .unwrap_or_default();
                format!("task {} {}{first}", t.id, t.state)
            })
            .collect();
        format!(
            "connector {} {}, {}",
            self.name,
            self.connector.state,
            if tasks.is_empty() {
                "no task".to_owned()
            } else {
                tasks.join(", ")
            }
        )
    }
}

/// `GET <connect_url>/connectors/<name>/status` (plain HTTP, as Kafka Connect's REST listener
/// serves by default).
pub async fn connector_status(connect_url: &str, name: &str) -> Result<ConnectorStatus> {
    let (status, body) = http_get(connect_url, &format!("/connectors/{name}/status")).await?;
    if status == 404 {
        bail!("Kafka Connect at {connect_url} has no connector {name:?}");
    }
    if status != 200 {
        bail!("Kafka Connect at {connect_url}: status of {name:?} answered {status}: {body}");
    }
    serde_json::from_str(&body)
        .with_context(|| format!("Kafka Connect at {connect_url}: status of {name:?}: {body}"))
}

/// One HTTP/1.0 GET: the status code and the body.
async fn http_get(base: &str, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(rest) = base.strip_prefix("http://") else {
        bail!(
            "{base:?}: source.connect_url is read over plain http:// (Kafka Connect's REST listener)"
        );
    };
    let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let prefix = prefix.trim_end_matches('/');
    let path = if prefix.is_empty() {
        path.to_owned()
    } else {
        format!("/{prefix}{path}")
    };
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        stream
            .write_all(
                format!(
                    "GET {path} HTTP/1.0\r\nHost: {authority}\r\nAccept: application/json\r\n\r\n"
                )
                .as_bytes(),
            )
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), exchange)
        .await
        .with_context(|| format!("Kafka Connect at {base}: no answer within 10 s"))?
        .with_context(|| format!("Kafka Connect at {base}: cannot connect"))?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("Kafka Connect at {base}: not an HTTP response: {head}"))?;
    Ok((status, body.to_owned()))
}

/// What `doctor` says of the capture: a line of evidence and whether it fails or warns.
pub struct CaptureCheck {
    pub evidence: String,
    pub fail: bool,
    pub warn: bool,
}

/// The slot and the connector of `config`'s source against the newest LSN the job committed.
pub async fn check(
    config: &tally_runtime::config::Config,
    committed_lsn: u64,
) -> Result<CaptureCheck> {
    let source = SourceDatabase::of(config, None)?;
    let mut evidence = Vec::new();
    let (mut fail, mut warn) = (false, false);
    match &config.source.slot {
        None => {
            warn = true;
            evidence.push("source.slot is not set: the replication slot is not checked".to_owned());
        }
        Some(name) => match slot(&source, name).await? {
            None => {
                fail = true;
                evidence.push(format!(
                    "replication slot {name} does not exist: PostgreSQL keeps no WAL for the connector, and changes committed while it is missing are lost to it (a new snapshot is needed)"
                ));
            }
            Some(s) => {
                if s.wal_status == "lost" {
                    fail = true;
                }
                if !s.active {
                    warn = true;
                }
                evidence.push(format!(
                    "slot {} {}, wal_status {}: confirmed {} ({} WAL bytes behind {}); the job committed changes up to {}",
                    s.name,
                    if s.active { "active" } else { "INACTIVE (no connector reading it)" },
                    if s.wal_status.is_empty() { "?" } else { &s.wal_status },
                    lsn_text(s.confirmed_lsn),
                    s.behind_bytes(),
                    lsn_text(s.current_lsn),
                    lsn_text(committed_lsn)
                ));
            }
        },
    }
    match (&config.source.connect_url, &config.source.connector) {
        (Some(url), Some(name)) => match connector_status(url, name).await {
            Ok(status) => {
                if !status.running() {
                    fail = true;
                }
                evidence.push(status.describe());
            }
            Err(e) => {
                fail = true;
                evidence.push(format!("{e:#}"));
            }
        },
        _ => {
            warn = true;
            evidence.push(
                "source.connect_url and source.connector are not set: the connector is not checked"
                    .to_owned(),
            );
        }
    }
    Ok(CaptureCheck {
        evidence: evidence.join("; "),
        fail,
        warn,
    })
}
