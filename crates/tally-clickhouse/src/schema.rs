//! Tables and view of a job: created when absent, validated when present.

use clickhouse::Client;
use serde::Deserialize;

use crate::{Result, SinkError};

const DATA_COLUMNS: &[(&str, &str)] = &[
    ("epoch", "UInt64"),
    ("source_partition", "Int32"),
    ("window_start", "DateTime"),
    ("window_end", "DateTime"),
    ("customer_id", "String"),
    ("currency", "String"),
    ("orders", "UInt64"),
    ("revenue", "Decimal(18, 4)"),
];
const DATA_SORTING_KEY: &str = "window_start, customer_id, currency, source_partition, epoch";

const COMMIT_COLUMNS: &[(&str, &str)] = &[
    ("batch_id", "String"),
    ("job", "String"),
    ("epoch", "UInt64"),
    ("partitions", "Array(Int32)"),
    ("from_offsets", "Array(Int64)"),
    ("to_offsets", "Array(Int64)"),
    ("row_count", "UInt64"),
    ("event_count", "UInt64"),
    ("revenue_sum", "Decimal(38, 4)"),
    ("dead_letters", "UInt64"),
    ("committed_at", "DateTime"),
];
const COMMIT_SORTING_KEY: &str = "epoch";

const VIEW_COLUMNS: &[(&str, &str)] = &[
    ("window_start", "DateTime"),
    ("window_end", "DateTime"),
    ("customer_id", "String"),
    ("currency", "String"),
    ("orders", "UInt64"),
    ("revenue", "Decimal(18, 4)"),
];

/// Names of a job's objects, derived from the view name. Identifiers are validated so they
/// can be spliced into SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableNames {
    pub database: String,
    pub view: String,
    pub data: String,
    pub commits: String,
}

fn valid_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

impl TableNames {
    pub fn new(database: &str, view: &str) -> Result<TableNames> {
        for (what, name) in [("database", database), ("table", view)] {
            if !valid_identifier(name) {
                return Err(SinkError::Schema(format!(
                    "{what} name {name:?} must match [A-Za-z_][A-Za-z0-9_]*"
                )));
            }
        }
        Ok(TableNames {
            database: database.to_owned(),
            view: view.to_owned(),
            data: format!("{database}.{view}_data"),
            commits: format!("{database}.{view}_commits"),
        })
    }

    pub fn view_q(&self) -> String {
        format!("{}.{}", self.database, self.view)
    }

    pub fn data_q(&self) -> &str {
        &self.data
    }

    pub fn commits_q(&self) -> &str {
        &self.commits
    }

    fn create_data(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree PARTITION BY toYYYYMM(window_start) ORDER BY ({DATA_SORTING_KEY})",
            self.data,
            columns_sql(DATA_COLUMNS)
        )
    }

    fn create_commits(&self) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {} ({}) ENGINE = MergeTree ORDER BY {COMMIT_SORTING_KEY}",
            self.commits,
            columns_sql(COMMIT_COLUMNS)
        )
    }

    /// The reader view: committed epochs only; per window and partition the newest epoch wins;
    /// then partitions are summed. Plain SELECTs on it never see a duplicate or half a batch.
    pub fn create_view(&self) -> String {
        format!(
            "CREATE VIEW IF NOT EXISTS {view} AS \
             SELECT window_start, window_end, customer_id, currency, sum(p_orders) AS orders, toDecimal64(sum(p_revenue), 4) AS revenue \
             FROM (SELECT source_partition, window_start, window_end, customer_id, currency, \
                          argMax(orders, epoch) AS p_orders, argMax(revenue, epoch) AS p_revenue \
                   FROM {data} WHERE epoch IN (SELECT epoch FROM {commits}) \
                   GROUP BY source_partition, window_start, window_end, customer_id, currency) \
             GROUP BY window_start, window_end, customer_id, currency",
            view = self.view_q(),
            data = self.data,
            commits = self.commits
        )
    }
}

fn columns_sql(columns: &[(&str, &str)]) -> String {
    columns
        .iter()
        .map(|(n, t)| format!("{n} {t}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[derive(Debug, Deserialize)]
struct TableInfo {
    engine: String,
    #[serde(default)]
    sorting_key: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ColumnInfo {
    name: String,
    #[serde(rename = "type")]
    type_: String,
}

async fn json_rows<T: serde::de::DeserializeOwned>(
    client: &Client,
    sql: &str,
    url: &str,
    context: &str,
) -> Result<Vec<T>> {
    let mut cursor = client
        .query(sql)
        .fetch_bytes("JSONEachRow")
        .map_err(|source| SinkError::Server {
            url: url.to_owned(),
            context: context.to_owned(),
            source,
        })?;
    let bytes = cursor.collect().await.map_err(|source| SinkError::Server {
        url: url.to_owned(),
        context: context.to_owned(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| SinkError::Schema(format!("{context}: unexpected answer {l:?}: {e}")))
        })
        .collect()
}

async fn execute(client: &Client, sql: &str, url: &str) -> Result<()> {
    client
        .query(sql)
        .execute()
        .await
        .map_err(|source| SinkError::Server {
            url: url.to_owned(),
            context: format!("executing {sql}"),
            source,
        })
}

/// Checks one object against what tally needs; `None` when it does not exist.
async fn inspect(
    client: &Client,
    url: &str,
    database: &str,
    name: &str,
) -> Result<Option<(TableInfo, Vec<ColumnInfo>)>> {
    // sorting_key is absent on some old servers: select * and let serde pick.
    let tables: Vec<TableInfo> = json_rows(
        client,
        &format!("SELECT * FROM system.tables WHERE database = '{database}' AND name = '{name}'"),
        url,
        "reading system.tables",
    )
    .await?;
    let Some(table) = tables.into_iter().next() else {
        return Ok(None);
    };
    let columns = json_rows(
        client,
        &format!("SELECT name, type FROM system.columns WHERE database = '{database}' AND table = '{name}'"),
        url,
        "reading system.columns",
    )
    .await?;
    Ok(Some((table, columns)))
}

fn check(
    full_name: &str,
    info: &(TableInfo, Vec<ColumnInfo>),
    engine: &str,
    sorting_key: Option<&str>,
    expected: &[(&str, &str)],
) -> Vec<String> {
    let (table, columns) = info;
    let mut problems = Vec::new();
    if table.engine != engine {
        problems.push(format!(
            "{full_name} has engine {}, expected {engine}",
            table.engine
        ));
    }
    if let (Some(want), Some(have)) = (sorting_key, table.sorting_key.as_deref())
        && !have.is_empty()
        && have != want
    {
        problems.push(format!(
            "{full_name} is ordered by ({have}), expected ({want})"
        ));
    }
    for (name, ty) in expected {
        match columns.iter().find(|c| c.name == *name) {
            None => problems.push(format!("{full_name} lacks column {name} {ty}")),
            Some(c) if normalise(&c.type_) != normalise(ty) => {
                problems.push(format!(
                    "{full_name}.{name} has type {}, expected {ty}",
                    c.type_
                ));
            }
            Some(_) => {}
        }
    }
    for c in columns {
        if !expected.iter().any(|(n, _)| *n == c.name) {
            problems.push(format!(
                "{full_name} has unexpected column {} {}",
                c.name, c.type_
            ));
        }
    }
    problems
}

fn normalise(ty: &str) -> String {
    let ty: String = ty.chars().filter(|c| !c.is_whitespace()).collect();
    // A current server may print DateTime with its zone.
    if ty.starts_with("DateTime(") {
        "DateTime".into()
    } else {
        ty
    }
}

pub async fn ensure(client: &Client, names: &TableNames, url: &str) -> Result<()> {
    execute(
        client,
        &format!("CREATE DATABASE IF NOT EXISTS {}", names.database),
        url,
    )
    .await?;
    let objects = [
        (
            names.data.clone(),
            format!("{}_data", names.view),
            "MergeTree",
            Some(DATA_SORTING_KEY),
            DATA_COLUMNS,
            names.create_data(),
        ),
        (
            names.commits.clone(),
            format!("{}_commits", names.view),
            "MergeTree",
            Some(COMMIT_SORTING_KEY),
            COMMIT_COLUMNS,
            names.create_commits(),
        ),
        (
            names.view_q(),
            names.view.clone(),
            "View",
            None,
            VIEW_COLUMNS,
            names.create_view(),
        ),
    ];
    let mut problems = Vec::new();
    for (full, name, engine, key, columns, create) in objects {
        match inspect(client, url, &names.database, &name).await? {
            None => execute(client, &create, url).await?,
            Some(info) => problems.extend(check(&full, &info, engine, key, columns)),
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(SinkError::Schema(format!(
        "{}. tally owns these objects and cannot write exactly once into a different shape: \
         rename or drop them (DROP TABLE {v}; DROP TABLE {d}; DROP TABLE {c}) and tally recreates them, \
         or point clickhouse.table at another name",
        problems.join("; "),
        v = names.view_q(),
        d = names.data,
        c = names.commits
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(TableNames::new("tally", "revenue_agg").is_ok());
        assert!(TableNames::new("tally", "x; DROP TABLE y").is_err());
        assert!(TableNames::new("1db", "t").is_err());
    }

    #[test]
    fn a_wrong_engine_and_column_are_named() {
        let info = (
            TableInfo {
                engine: "ReplacingMergeTree".into(),
                sorting_key: Some("epoch".into()),
            },
            vec![ColumnInfo {
                name: "epoch".into(),
                type_: "UInt32".into(),
            }],
        );
        let problems = check(
            "tally.x_data",
            &info,
            "MergeTree",
            Some(DATA_SORTING_KEY),
            DATA_COLUMNS,
        );
        let text = problems.join("\n");
        assert!(
            text.contains("engine ReplacingMergeTree, expected MergeTree"),
            "{text}"
        );
        assert!(text.contains("ordered by (epoch)"), "{text}");
        assert!(
            text.contains("tally.x_data.epoch has type UInt32, expected UInt64"),
            "{text}"
        );
        assert!(
            text.contains("lacks column revenue Decimal(18, 4)"),
            "{text}"
        );
    }

    #[test]
    fn datetime_with_zone_is_accepted() {
        assert_eq!(normalise("DateTime('UTC')"), "DateTime");
        assert_eq!(normalise("Decimal(18,4)"), normalise("Decimal(18, 4)"));
    }
}
