//! What tally finds in ClickHouse before it writes: each table and view inspected against the
//! job's shape, a commit log of an earlier release brought forward, and anything else refused
//! with what is wrong and what to do.

use super::*;

#[derive(Debug, Deserialize)]
pub(super) struct TableInfo {
    pub(super) engine: String,
    #[serde(default)]
    pub(super) sorting_key: Option<String>,
    #[serde(default)]
    pub(super) create_table_query: Option<String>,
}

#[derive(Debug, Deserialize)]
pub(super) struct ColumnInfo {
    pub(super) name: String,
    #[serde(rename = "type")]
    pub(super) type_: String,
}

/// Checks one object against what tally needs; `None` when it does not exist.
pub(super) async fn inspect(
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

pub(super) fn check(
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

/// A column type as tally compares it: without spaces, `DateTime` without its zone.
pub fn normalise(ty: &str) -> String {
    let ty: String = ty.chars().filter(|c| !c.is_whitespace()).collect();
    // A current server may print DateTime with its zone.
    if ty.starts_with("DateTime(") {
        "DateTime".into()
    } else {
        ty
    }
}

/// The columns added since an earlier release that the commit log `info` lacks, if it is
/// otherwise tally's commit log (any sorting key): a foreign table is reported, not altered.
pub(super) fn commit_columns_to_add(
    full_name: &str,
    engine: &str,
    info: &(TableInfo, Vec<ColumnInfo>),
) -> Vec<&'static str> {
    let missing: Vec<&'static str> = ADDED_COMMIT_COLUMNS
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !info.1.iter().any(|c| c.name == *n))
        .collect();
    let before: Vec<(&str, &str)> = COMMIT_COLUMNS
        .iter()
        .filter(|(n, _)| !missing.contains(n))
        .copied()
        .collect();
    if check(full_name, info, engine, None, &before).is_empty() {
        missing
    } else {
        Vec::new()
    }
}

/// Adds to a commit log of an earlier release the columns added since (a metadata change) and
/// reads it again. Several writers may race here: a column another one added meanwhile is as
/// good.
pub(super) async fn add_commit_columns(
    client: &Client,
    names: &TableNames,
    url: &str,
    name: &str,
    info: (TableInfo, Vec<ColumnInfo>),
) -> Result<(TableInfo, Vec<ColumnInfo>)> {
    let missing = commit_columns_to_add(&names.commits, names.truth_engine_name(), &info);
    if missing.is_empty() {
        return Ok(info);
    }
    for column in missing {
        let Some(sql) = names.add_commit_column_sql(column) else {
            continue;
        };
        if let Err(e) = execute(client, &sql, url).await {
            let now = inspect(client, url, &names.database, name).await?;
            if !now.is_some_and(|now| now.1.iter().any(|c| c.name == column)) {
                return Err(e);
            }
        }
        tracing::info!(table = %names.commits, column, "added a column to the commit log of an earlier release");
    }
    inspect(client, url, &names.database, name)
        .await?
        .ok_or_else(|| {
            SinkError::Schema(format!("{} vanished while adding columns", names.commits))
        })
}

/// What [`ensure`] left to its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ensured {
    /// The view is of an earlier layout: publish a snapshot, then install the current view.
    pub install_view: bool,
}

pub(crate) async fn ensure(client: &Client, names: &TableNames, url: &str) -> Result<Ensured> {
    execute(
        client,
        &format!("CREATE DATABASE IF NOT EXISTS {}", names.database),
        url,
    )
    .await?;
    // Refuses a database of an engine tally cannot swap tables in.
    atomic_database(client, names, url).await?;
    let short = |suffix: &str| format!("{}{suffix}", names.view);
    let shape = &names.shape;
    let (data_columns, answer_columns, live_columns, view_columns) = (
        shape.data_columns(),
        shape.answer_columns(),
        names.live_columns(),
        shape.view_columns(),
    );
    let (data_key, answer_key) = (shape.data_sorting_key(), shape.answer_sorting_key());
    let truth = names.truth_engine_name();
    let tables = [
        (
            names.data.clone(),
            short("_data"),
            Some(data_key.as_str()),
            borrowed(&data_columns),
            names.create_data(),
        ),
        (
            names.commits.clone(),
            short("_commits"),
            Some(COMMIT_SORTING_KEY),
            COMMIT_COLUMNS.to_vec(),
            names.create_commits(),
        ),
        (
            names.final_rows.clone(),
            short("_final"),
            Some(answer_key.as_str()),
            borrowed(&answer_columns),
            names.create_final_like(&names.final_rows),
        ),
        (
            names.partitions.clone(),
            short("_partitions"),
            Some("partition"),
            PARTITION_COLUMNS.to_vec(),
            names.create_partitions(),
        ),
        (
            names.read_side_log(),
            short("_read_side"),
            Some("generation, at"),
            READ_SIDE_COLUMNS.to_vec(),
            names.create_read_side_log(),
        ),
        (
            names.folds.clone(),
            short("_folds"),
            Some(FOLD_SORTING_KEY),
            FOLD_COLUMNS.to_vec(),
            names.create_folds(),
        ),
        (
            names.live.clone(),
            short("_live"),
            Some(answer_key.as_str()),
            borrowed(&live_columns),
            names.create_live(),
        ),
    ];
    let mut problems = Vec::new();
    let mut old_layout = false;
    let mut migrated = false;
    for (full, name, key, columns, create) in tables {
        match inspect(client, url, &names.database, &name).await? {
            None => execute(client, &create, url).await?,
            Some(info) => {
                let info = if name == short("_commits") {
                    add_commit_columns(client, names, url, &name, info).await?
                } else {
                    info
                };
                old_layout |= name == short("_data") && info.1.iter().any(|c| c.name == "epoch");
                let legacy_commits = name == short("_commits")
                    && info.0.sorting_key.as_deref() == Some(LEGACY_COMMIT_SORTING_KEY);
                let engine =
                    if [short("_data"), short("_commits"), short("_partitions")].contains(&name) {
                        truth
                    } else {
                        "MergeTree"
                    };
                let found = check(&full, &info, engine, key, &columns);
                // Only the key differs: same rows, sorted for the view's pruning by window.
                if legacy_commits && found.len() == 1 {
                    for sql in names.migrate_commits_sql(atomic_database(client, names, url).await?)
                    {
                        execute(client, &sql, url).await?;
                    }
                    tracing::info!(table = %full, "rebuilt the commit log sorted by window (it was sorted by epoch)");
                    migrated = true;
                } else {
                    problems.extend(found);
                }
            }
        }
    }
    let mut install_view = false;
    if problems.is_empty() {
        // Created last: it reads the tables, and its frontier is the fold log's newest.
        let frontier = latest_frontier(client, names, url).await?;
        match inspect(client, url, &names.database, &names.view).await? {
            None => execute(client, &names.create_view(&names.view_q(), frontier), url).await?,
            Some(info) => {
                problems.extend(check(
                    &names.view_q(),
                    &info,
                    "View",
                    None,
                    &borrowed(&view_columns),
                ));
                // A view of an earlier layout: it read the versions itself (which let a reader
                // see half a batch), or pruned the commit log by epoch.
                let reads_live = info
                    .0
                    .create_table_query
                    .as_deref()
                    .is_none_or(|q| q.contains(&format!("{}_live", names.view)));
                install_view = migrated || !reads_live;
            }
        }
    }
    if problems.is_empty() {
        return Ok(Ensured { install_view });
    }
    let drop_all = format!(
        "DROP TABLE {v}; DROP TABLE {d}; DROP TABLE {c}; DROP TABLE IF EXISTS {f}; DROP TABLE IF EXISTS {l}; DROP TABLE IF EXISTS {p}; DROP TABLE IF EXISTS {r}; DROP TABLE IF EXISTS {g}; DROP TABLE IF EXISTS {j}",
        v = names.view_q(),
        d = names.data,
        c = names.commits,
        f = names.final_rows,
        l = names.folds,
        p = names.live,
        r = names.partitions,
        g = names.read_side_log(),
        j = names.identity(),
    );
    if old_layout {
        return Err(SinkError::Schema(format!(
            "{}. {} was written by an earlier tally whose rows are versioned by a per-process epoch; \
             this version keys them by the source partition's offset so that any worker can continue a partition. \
             The old rows cannot be re-versioned without their offsets. Either keep running the earlier tally for this table, \
             or start over: {drop_all}; and delete the state directory, then tally recomputes everything from the topic \
             (only if the topic still holds it), or point clickhouse.table at a new name",
            problems.join("; "),
            names.data
        )));
    }
    Err(SinkError::Schema(format!(
        "{}. tally owns these objects and cannot write exactly once into a different shape: \
         rename or drop them ({drop_all}) and tally recreates them, \
         or point clickhouse.table at another name",
        problems.join("; "),
    )))
}
