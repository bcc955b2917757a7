//! A change job's source database: its table aggregated by SQL and compared with the view
//! (`reconcile --source`), its capture checked (`doctor`), the workload that changes it
//! (`loadgen` of a change job), and `verify` of a change job against that workload.

pub mod capture;
pub mod consistent;
pub mod reconcile;
pub mod sql;
pub mod verify;
pub mod workload;

use anyhow::{Context, Result, bail};
use tokio_postgres::Client;

use sql::Column;
use tally_runtime::config::{Config, is_table_name};

/// Where a change job's rows live: the database URL (without its password) and the table.
#[derive(Debug, Clone)]
pub struct SourceDatabase {
    url: String,
    password: String,
    pub table: String,
}

impl SourceDatabase {
    /// The job's source, the URL `url` overriding `source.postgres`.
    pub fn of(config: &Config, url: Option<&str>) -> Result<SourceDatabase> {
        if config.declared.changes.is_none() {
            bail!(
                "job {}: only a job of change events (aggregation.format = \"debezium-json\") has a source table",
                config.job.name
            );
        }
        let Some(url) = url.or(config.source.postgres.as_deref()) else {
            bail!(
                "source.postgres: not set; name the database (postgres://user@host:port/database) there or with --source"
            )
        };
        Ok(SourceDatabase {
            url: url.to_owned(),
            password: config.source.password.expose().to_owned(),
            table: table_of(config)?,
        })
    }

    /// Connects; the connection runs on the current runtime until the client is dropped.
    pub async fn connect(&self) -> Result<Client> {
        tally_runtime::capture::connect(&self.url, &self.password).await
    }

    /// The table's columns and their types, in order.
    pub async fn columns(&self, client: &Client) -> Result<Vec<Column>> {
        let (schema, table) = self
            .table
            .split_once('.')
            .unwrap_or(("public", &self.table));
        let rows = client
            .query(
                "SELECT column_name::text, data_type::text FROM information_schema.columns \
                 WHERE table_schema = $1 AND table_name = $2 ORDER BY ordinal_position",
                &[&schema, &table],
            )
            .await
            .with_context(|| format!("source: reading the columns of {}", self.table))?;
        if rows.is_empty() {
            bail!("source: {}: no such table in {}", self.table, self.url);
        }
        Ok(rows
            .iter()
            .map(|r| Column {
                name: r.get(0),
                data_type: r.get(1),
            })
            .collect())
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

/// `source.table`, or the source topic's last two parts (Debezium's `<prefix>.<schema>.<table>`).
pub fn table_of(config: &Config) -> Result<String> {
    if let Some(table) = &config.source.table {
        return Ok(table.clone());
    }
    let topic = &config.kafka.source_topic;
    let parts: Vec<&str> = topic.split('.').collect();
    let name = match parts.as_slice() {
        [.., schema, table] => format!("{schema}.{table}"),
        _ => String::new(),
    };
    if is_table_name(&name) {
        Ok(name)
    } else {
        bail!(
            "source.table: not set, and topic {topic:?} is not named <prefix>.<schema>.<table> as Debezium names it; set it"
        )
    }
}

/// An LSN as PostgreSQL prints it, from a `pg_lsn` read as text.
pub fn lsn(text: &str) -> Result<u64> {
    tally_runtime::capture::lsn(text)
}
