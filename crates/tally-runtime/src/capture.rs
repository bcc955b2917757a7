//! The source database as its change connector captures it: a connection, the WAL position
//! now, and how far a replication slot has confirmed. A version of a change job that reads a
//! new snapshot's topic has no offsets in common with the version it takes over; what they
//! share is the database's log, so it takes over only once its connector has captured past
//! where the fenced version stopped (docs/design/restatement.md, "Change jobs").

use anyhow::{Context, Result};
use tokio_postgres::{Client, NoTls};

/// Where a change job's connector reads: `source.postgres`, its password and `source.slot`,
/// and Debezium's signal table (`source.signal_table`), through which a position is marked.
#[derive(Debug, Clone)]
pub struct CaptureSettings {
    pub postgres: String,
    pub password: String,
    pub slot: String,
    pub signal_table: Option<String>,
}

/// Connects to `url`; the connection runs on the current runtime until the client is dropped.
pub async fn connect(url: &str, password: &str) -> Result<Client> {
    let mut pg: tokio_postgres::Config = url
        .parse()
        .with_context(|| format!("source: {url} is not a PostgreSQL URL"))?;
    if !password.is_empty() {
        pg.password(password);
    }
    pg.application_name("tally");
    pg.connect_timeout(std::time::Duration::from_secs(10));
    let (client, connection) = pg
        .connect(NoTls)
        .await
        .with_context(|| format!("source: {url}: cannot connect"))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "source connection closed");
        }
    });
    Ok(client)
}

/// The server's WAL position now: every change committed before this call is below it.
pub async fn current_lsn(client: &Client) -> Result<u64> {
    let row = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .context("source: reading pg_current_wal_lsn()")?;
    lsn(&row.get::<_, String>(0))
}

/// The position slot `slot` has confirmed (its connector has written every change below it to
/// Kafka); `None`: no such slot.
pub async fn confirmed_lsn(client: &Client, slot: &str) -> Result<Option<u64>> {
    let row = client
        .query_opt(
            "SELECT coalesce(confirmed_flush_lsn, '0/0')::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .with_context(|| format!("source: reading replication slot {slot}"))?;
    row.map(|r| lsn(&r.get::<_, String>(0))).transpose()
}

/// Writes a Debezium `log` signal into `signal_table` (and takes the row out again, in the
/// same transaction): a change the connector reads and confirms, so that its slot's confirmed
/// position passes this point even when the captured table is idle.
pub async fn mark(client: &Client, signal_table: &str, message: &str) -> Result<()> {
    let id = format!(
        "tally-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let data = serde_json::json!({ "message": message })
        .to_string()
        .replace('\'', "''");
    client
        .batch_execute(&format!(
            "BEGIN; INSERT INTO {signal_table} (id, type, data) VALUES ('{id}', 'log', '{data}'); \
             DELETE FROM {signal_table} WHERE id = '{id}'; COMMIT"
        ))
        .await
        .with_context(|| format!("source: writing a log signal into {signal_table}"))?;
    Ok(())
}

/// An LSN as PostgreSQL prints it, as a number.
pub fn lsn(text: &str) -> Result<u64> {
    tally_core::declare::parse_lsn(text).with_context(|| format!("source: {text:?} is not an LSN"))
}
