//! A new version of a job taking the job's view over from the version that holds it
//! (docs/design/restatement.md): under a generation of the holder's read side (which fences
//! the holder's own), the windows before `restate_from` are kept as the holder's view shows
//! them, the job's view is swapped for one over the new version's own view and those kept
//! windows, and the holder's tables are dropped.
//!
//! The job's view reads the new version's own view by name, which the new version's fold
//! steps swap as they always do: the job's view is installed once, at the takeover.

use serde::Deserialize;

use crate::error::Result;
use crate::read_side::ReadLease;
use crate::schema::{self, TableNames, quote};
use crate::sink::ClickHouseSink;

/// The read side's log event of a takeover: a holder of this version's read side that reads
/// it steps down for good.
const TOOK_OVER: &str = "took_over";

#[derive(Debug, Deserialize)]
struct ColumnRow {
    name: String,
}

impl TableNames {
    /// The statements that make `view` (qualified) the view `create` builds (given the name to
    /// build it under), swapped in as a fold step swaps the view (see
    /// [`install_view_sql`](Self::install_view_sql)).
    pub(crate) fn replace_view_sql(
        view: &str,
        create: impl Fn(&str) -> String,
        atomic_database: bool,
        lease_database: &str,
    ) -> Vec<String> {
        let (next, old) = (
            format!("{lease_database}.next_view"),
            format!("{lease_database}.old_view"),
        );
        let mut sql = vec![
            format!("DROP TABLE IF EXISTS {old}"),
            format!("DROP TABLE IF EXISTS {next}"),
            create(&next),
        ];
        if atomic_database {
            sql.push(format!("EXCHANGE TABLES {view} AND {next}"));
            sql.push(format!("DROP TABLE IF EXISTS {next}"));
        } else {
            sql.push(format!("RENAME TABLE {view} TO {old}, {next} TO {view}"));
            sql.push(format!("DROP TABLE IF EXISTS {old}"));
        }
        sql
    }

    /// The job's view once a new version holds it: the version's own view from
    /// `kept.1` (seconds) on, and the windows kept from the earlier holder before it.
    pub(crate) fn job_view_sql(
        &self,
        name: &str,
        columns: &[String],
        own_view: &str,
        kept: Option<(&str, u32)>,
    ) -> String {
        let list = columns.join(", ");
        let db = &self.database;
        match kept {
            None => format!("CREATE VIEW {name} AS SELECT {list} FROM {db}.{own_view}"),
            Some((kept, from)) => format!(
                "CREATE VIEW {name} AS \
                 SELECT {list} FROM {db}.{own_view} WHERE window_start >= toDateTime({from}) \
                 UNION ALL \
                 SELECT {list} FROM {db}.{kept} WHERE window_start < toDateTime({from})"
            ),
        }
    }

    /// Who took this version's view over, newest first (see [`ClickHouseSink::taken_over_by`]).
    pub(crate) fn taken_over_by_sql(&self) -> String {
        format!(
            "SELECT holder FROM {} WHERE event = '{TOOK_OVER}' ORDER BY at DESC LIMIT 1",
            self.read_side_log()
        )
    }

    /// Logs that `by` took this version's view over, from the claimed generation's
    /// `lease_table` (fenced as every read-side statement is).
    pub(crate) fn log_took_over_sql(&self, by: &str, lease_table: &str) -> String {
        format!(
            "INSERT INTO {} SELECT generation, {}, '{TOOK_OVER}', now() FROM {lease_table}",
            self.read_side_log(),
            quote(by)
        )
    }

    /// Keeps in `kept` the windows before `before` (seconds) of the view `from`: a table
    /// shaped as the view `shaped_as` built in `stage` from the `common` columns (the others
    /// take their defaults), then renamed into place. Unqualified names are the job's
    /// database's.
    pub(crate) fn keep_windows_sql(
        &self,
        stage: &str,
        from: &str,
        shaped_as: &str,
        kept: &str,
        common: &[String],
        before: u32,
    ) -> Vec<String> {
        let db = &self.database;
        let list = common.join(", ");
        vec![
            format!("DROP TABLE IF EXISTS {stage}"),
            format!(
                "CREATE TABLE {stage} ENGINE = MergeTree PARTITION BY toYYYYMMDD(window_start) ORDER BY window_start \
                 AS SELECT * FROM {db}.{shaped_as} WHERE 0"
            ),
            format!(
                "INSERT INTO {stage} ({list}) SELECT {list} FROM {db}.{from} WHERE window_start < toDateTime({before})"
            ),
            format!("RENAME TABLE {stage} TO {db}.{kept}"),
        ]
    }

    /// Makes the job's view `view` read `own_view` (whose `columns` it shows) and, before
    /// `kept.1`, the kept windows `kept.0`, built in `lease_database` and swapped in.
    pub(crate) fn install_job_view_sql(
        &self,
        view: &str,
        columns: &[String],
        own_view: &str,
        kept: Option<(&str, u32)>,
        atomic_database: bool,
        lease_database: &str,
    ) -> Vec<String> {
        TableNames::replace_view_sql(
            &format!("{}.{view}", self.database),
            |next| self.job_view_sql(next, columns, own_view, kept),
            atomic_database,
            lease_database,
        )
    }

    /// How many of [`version_tables`](Self::version_tables) the server still has.
    pub(crate) fn version_tables_left_sql(&self, job_view: &str) -> String {
        let db = format!("{}.", self.database);
        let names: Vec<String> = self
            .version_tables(job_view)
            .iter()
            .map(|t| format!("'{}'", t.strip_prefix(&db).unwrap_or(t)))
            .collect();
        format!(
            "SELECT count() FROM system.tables WHERE database = '{}' AND name IN ({})",
            self.database,
            names.join(", ")
        )
    }

    /// Every table of this version but its read side's log (which tells a late holder of its
    /// read side that the version was taken over), and its own view unless it is `job_view`.
    pub(crate) fn version_tables(&self, job_view: &str) -> Vec<String> {
        let mut tables = vec![
            self.data.clone(),
            self.commits.clone(),
            self.final_rows.clone(),
            self.live.clone(),
            self.folds.clone(),
            self.partitions.clone(),
        ];
        if self.view != job_view {
            // Its own view, and the windows it kept from the version before it.
            tables.push(self.view_q());
            tables.push(format!("{}_kept", self.view_q()));
        }
        tables.push(self.identity());
        tables
    }
}

impl ClickHouseSink {
    /// Who took this version's view over, as its read side's log says; `None`: nobody (or no
    /// log yet).
    pub async fn taken_over_by(&self) -> Result<Option<String>> {
        let sql = self.names.taken_over_by_sql();
        match self.client.query(&sql).fetch_optional::<String>().await {
            Ok(by) => Ok(by),
            // 60: no log, so no takeover either.
            Err(e) if e.to_string().contains("Code: 60") => Ok(None),
            Err(e) => Err(self.err("reading the read side's log")(e)),
        }
    }

    /// Logs under `lease` (a generation of this version's read side) that `by` took the view
    /// over: every later holder of this read side steps down.
    pub async fn log_took_over(&self, lease: &ReadLease, by: &str) -> Result<()> {
        let sql = self.names.log_took_over_sql(by, &lease.lease_table());
        self.exec_fenced(lease, &sql).await
    }

    /// Whether `table` (unqualified) exists in the job's database.
    pub async fn table_exists(&self, table: &str) -> Result<bool> {
        let n: u64 = self
            .fetch(
                &format!(
                    "SELECT count() FROM system.tables WHERE database = '{}' AND name = '{table}'",
                    self.names.database
                ),
                "listing tables",
            )
            .await?;
        Ok(n > 0)
    }

    /// The names of the columns of `table` (unqualified, in the job's database), in order.
    async fn columns_of(&self, table: &str) -> Result<Vec<String>> {
        let rows: Vec<ColumnRow> = schema::json_rows(
            &self.client,
            // DESCRIBE, in the table's order on every server (18.16's system.columns has no
            // position).
            &format!("DESCRIBE TABLE {}.{table}", self.names.database),
            &self.url,
            "reading a view's columns",
        )
        .await?;
        Ok(rows.into_iter().map(|r| r.name).collect())
    }

    /// Keeps in `kept` (unqualified; shaped as the view `shaped_as`) the windows before
    /// `before` (seconds) of the view `from`, under `lease`: built in a stage table of the
    /// lease's database and renamed into place, the step's commit point. A column `from`
    /// lacks takes its default. Done already (`kept` exists): nothing. The rows kept.
    pub async fn keep_windows(
        &self,
        lease: &ReadLease,
        from: &str,
        shaped_as: &str,
        kept: &str,
        before: u32,
    ) -> Result<Option<u64>> {
        if self.table_exists(kept).await? {
            return Ok(None);
        }
        let stage = lease.table("kept");
        let theirs = self.columns_of(from).await?;
        let mut common = self.columns_of(shaped_as).await?;
        common.retain(|c| theirs.contains(c));
        let statements = self
            .names
            .keep_windows_sql(&stage, from, shaped_as, kept, &common, before);
        let Some((rename, fill)) = statements.split_last() else {
            return Ok(None);
        };
        for sql in fill {
            self.exec_fenced(lease, sql).await?;
        }
        let rows: u64 = self
            .fetch(
                &format!("SELECT count() FROM {stage}"),
                "counting kept rows",
            )
            .await?;
        self.exec_fenced(lease, rename).await?;
        Ok(Some(rows))
    }

    /// Makes the job's view `view` (unqualified) read `own_view` and, before `kept.1`, the
    /// kept windows `kept.0`, under `lease`: one swap, so a reader sees the earlier view or
    /// this one.
    pub async fn install_job_view(
        &self,
        lease: &ReadLease,
        view: &str,
        own_view: &str,
        kept: Option<(&str, u32)>,
    ) -> Result<()> {
        let columns = self.columns_of(own_view).await?;
        let atomic = self.atomic_database().await?;
        for sql in self.names.install_job_view_sql(
            view,
            &columns,
            own_view,
            kept,
            atomic,
            lease.database(),
        ) {
            self.exec_fenced(lease, &sql).await?;
        }
        Ok(())
    }

    /// Whether the job's view `view` (unqualified) reads `own_view`: installed by its version.
    pub async fn job_view_reads(&self, view: &str, own_view: &str) -> Result<bool> {
        let db = &self.names.database;
        let statement = match self
            .client
            .query(&format!("SHOW CREATE TABLE {db}.{view}"))
            .fetch_optional::<String>()
            .await
        {
            Ok(s) => s.unwrap_or_default(),
            Err(e) if e.to_string().contains("Code: 60") => return Ok(false),
            Err(e) => return Err(self.err("reading the job's view")(e)),
        };
        Ok(names_table(&statement, &format!("{db}.{own_view}")))
    }

    /// Drops this version's tables (see [`TableNames::version_tables`]) once another holds the
    /// job's view `job_view`; the identity's last.
    pub async fn drop_version_tables(&self, job_view: &str) -> Result<()> {
        for table in self.names.version_tables(job_view) {
            self.exec(&format!("DROP TABLE IF EXISTS {table}")).await?;
        }
        Ok(())
    }

    /// Whether this version's tables are gone from the replica once another holds the job's
    /// view `job_view`: none of them is left. Its identity table goes last, but is no marker
    /// alone: a replica may never have had it (the worker's check creates it on the first
    /// replica that answers), while the version's other tables are there.
    pub async fn version_dropped(&self, job_view: &str) -> Result<bool> {
        let sql = self.names.version_tables_left_sql(job_view);
        let left: u64 = self.fetch(&sql, "listing the version's tables").await?;
        Ok(left == 0)
    }
}

/// Whether `sql` names `table` (qualified) as a whole word, not as the prefix of another name.
fn names_table(sql: &str, table: &str) -> bool {
    sql.match_indices(table).any(|(at, _)| {
        sql[at + table.len()..]
            .chars()
            .next()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_view_reads_the_new_version_from_restate_from_and_the_kept_windows_before() {
        let names = TableNames::new("tally", "api_v2").unwrap_or_else(|e| unreachable!("{e}"));
        let cols = ["window_start".to_owned(), "route".to_owned()];
        let sql = names.job_view_sql("g.next_view", &cols, "api__v2", Some(("api__v2_kept", 60)));
        assert_eq!(
            sql,
            "CREATE VIEW g.next_view AS SELECT window_start, route FROM tally.api__v2 WHERE window_start >= toDateTime(60) \
             UNION ALL SELECT window_start, route FROM tally.api__v2_kept WHERE window_start < toDateTime(60)"
        );
        let whole = names.job_view_sql("g.next_view", &cols, "api__v2", None);
        assert_eq!(
            whole,
            "CREATE VIEW g.next_view AS SELECT window_start, route FROM tally.api__v2"
        );
        // Version 1's own view is the job's: never dropped with its tables.
        let v1 = TableNames::new("tally", "api").unwrap_or_else(|e| unreachable!("{e}"));
        assert!(!v1.version_tables("api").contains(&"tally.api".to_owned()));
        assert!(
            v1.version_tables("api")
                .contains(&"tally.api_data".to_owned())
        );
        assert!(
            !v1.version_tables("api")
                .contains(&"tally.api_read_side".to_owned())
        );
        assert!(names_table(
            "SELECT a FROM tally.api__v2 WHERE x",
            "tally.api__v2"
        ));
        assert!(names_table("SELECT a FROM tally.api__v2", "tally.api__v2"));
        assert!(!names_table(
            "SELECT a FROM tally.api__v2_kept",
            "tally.api__v2"
        ));
        let v2 = TableNames::new("tally", "api__v2").unwrap_or_else(|e| unreachable!("{e}"));
        let v2_tables = v2.version_tables("api");
        assert!(v2_tables.contains(&"tally.api__v2".to_owned()));
        assert!(v2_tables.contains(&"tally.api__v2_kept".to_owned()));
        assert_eq!(v2_tables.last(), Some(&"tally.api__v2_job".to_owned()));
        // Retired on a replica once none of them is left, its identity table or not.
        let left = v1.version_tables_left_sql("api");
        assert!(left.starts_with("SELECT count() FROM system.tables WHERE database = 'tally' AND name IN ('api_data', 'api_commits'"), "{left}");
        assert!(
            left.ends_with("'api_job')") && !left.contains("'api'"),
            "{left}"
        );
    }
}
