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
            create_table_query: None,
        },
        vec![ColumnInfo {
            name: "version".into(),
            type_: "UInt32".into(),
        }],
    );
    let problems = check(
        "tally.x_data",
        &info,
        "MergeTree",
        Some(&Shape::revenue_agg().data_sorting_key()),
        &borrowed(&Shape::revenue_agg().data_columns()),
    );
    let text = problems.join("\n");
    assert!(
        text.contains("engine ReplacingMergeTree, expected MergeTree"),
        "{text}"
    );
    assert!(text.contains("ordered by (epoch)"), "{text}");
    assert!(
        text.contains("tally.x_data.version has type UInt32, expected Int64"),
        "{text}"
    );
    assert!(
        text.contains("lacks column revenue Decimal(18, 4)"),
        "{text}"
    );
}

#[test]
fn the_view_reads_each_window_from_one_side_of_one_frontier() {
    let names = TableNames::new("tally", "r").unwrap_or_else(|e| unreachable!("{e}"));
    let frontier = Frontier {
        seconds: 1_790_000_400,
    };
    let sql = names.create_view("tally.r__next", frontier);
    assert!(sql.contains("FROM tally.r_final WHERE window_start < toDateTime(1790000400)"));
    assert!(sql.contains("FROM tally.r_live WHERE window_start >= toDateTime(1790000400)"));
    // Readers read published rows only: no versions, no commit log in their SELECT.
    assert!(
        !sql.contains("r_data") && !sql.contains("r_commits"),
        "{sql}"
    );
    assert_eq!(sql.matches("toDateTime(1790000400)").count(), 2);
    // The view is built in the read side's generation database: a fenced holder cannot.
    let swap = names.install_view_sql(frontier, true, "tally__r__read4");
    assert_eq!(
        swap[2],
        names.create_view("tally__r__read4.next_view", frontier)
    );
    assert_eq!(
        swap[3],
        "EXCHANGE TABLES tally.r AND tally__r__read4.next_view"
    );
    let swap = names.install_view_sql(frontier, false, "tally__r__read4");
    assert_eq!(
        swap[3],
        "RENAME TABLE tally.r TO tally__r__read4.old_view, tally__r__read4.next_view TO tally.r"
    );
}

#[test]
fn a_publish_reads_committed_versions_as_of_its_cut_from_its_frontier() {
    let names = TableNames::new("tally", "r").unwrap_or_else(|e| unreachable!("{e}"));
    let from = Frontier {
        seconds: 1_790_000_400,
    };
    let cut = Cut([(0, 20), (1, 8)].into_iter().collect());
    let stage = "tally__r__read3.live_0".to_string();
    let sql = names.stage_snapshot_sql(&stage, from, &cut).join("; ");
    // Batches are pruned by the newest window they hold, not by a writer's epoch, and the
    // cut is a literal: the versions are read after it was fixed.
    assert!(
        sql.contains("WHERE max_window_start >= toDateTime(1790000400))"),
        "{sql}"
    );
    assert!(sql.contains("indexOf([0, 1]"), "{sql}");
    assert!(sql.contains("arrayElement([20, 8]"), "{sql}");
    assert!(!sql.contains("epoch"), "{sql}");
    // Not REPLACE PARTITION: on 18.16 a restart brings the parts it replaced back.
    assert_eq!(
        names.swap_live_sql(&stage, "tally__r__read3", false),
        [
            "DROP TABLE IF EXISTS tally__r__read3.replaced",
            "RENAME TABLE tally.r_live TO tally__r__read3.replaced, tally__r__read3.live_0 TO tally.r_live",
            "DROP TABLE tally__r__read3.replaced",
        ]
    );
    assert_eq!(
        names.swap_live_sql(&stage, "tally__r__read3", true),
        [
            "EXCHANGE TABLES tally.r_live AND tally__r__read3.live_0",
            "DROP TABLE tally__r__read3.live_0",
        ]
    );
}

#[test]
fn datetime_with_zone_is_accepted() {
    assert_eq!(normalise("DateTime('UTC')"), "DateTime");
    assert_eq!(normalise("Decimal(18,4)"), normalise("Decimal(18, 4)"));
}

#[test]
fn the_commit_log_counts_filtered_records_and_an_earlier_one_gets_the_column() {
    let names = TableNames::new("tally", "r").unwrap_or_else(|e| unreachable!("{e}"));
    assert!(
        names
            .create_commits()
            .contains("committed_at DateTime, filtered_count UInt64 DEFAULT 0, duplicate_count UInt64 DEFAULT 0, stale_count UInt64 DEFAULT 0, tombstone_count UInt64 DEFAULT 0, source_lsn UInt64 DEFAULT 0)"),
        "{}",
        names.create_commits()
    );
    // Rebuilt with its key, the commit log keeps the column and its default.
    let migrate = names.migrate_commits_sql(false);
    assert!(
        migrate[1].contains("filtered_count UInt64 DEFAULT 0"),
        "{migrate:?}"
    );
    assert!(
        migrate[2].ends_with("committed_at, filtered_count, duplicate_count, stale_count, tombstone_count, source_lsn FROM tally.r_commits"),
        "{migrate:?}"
    );
    // 18.16 does not parse ADD COLUMN IF NOT EXISTS: ensure looks at the columns first.
    assert_eq!(
        names.add_commit_column_sql("filtered_count").as_deref(),
        Some("ALTER TABLE tally.r_commits ADD COLUMN filtered_count UInt64 DEFAULT 0")
    );
    assert_eq!(names.add_commit_column_sql("epoch"), None);
    let catalog = names.statement_catalog(
        Frontier::default(),
        Frontier::default(),
        &Cut::default(),
        "20260921",
        "2983334",
        false,
    );
    assert!(catalog.iter().any(|(n, s)| n == "upgrade.0"
        && s == "ALTER TABLE tally.r_commits ADD COLUMN filtered_count UInt64 DEFAULT 0"));
    assert!(catalog.iter().any(|(n, s)| n == "upgrade.4"
        && s == "ALTER TABLE tally.r_commits ADD COLUMN source_lsn UInt64 DEFAULT 0"));
}

fn commit_log(columns: &[(&str, &str)], sorting_key: &str) -> (TableInfo, Vec<ColumnInfo>) {
    (
        TableInfo {
            engine: "MergeTree".into(),
            sorting_key: Some(sorting_key.into()),
            create_table_query: None,
        },
        columns
            .iter()
            .map(|(n, t)| ColumnInfo {
                name: (*n).into(),
                type_: (*t).into(),
            })
            .collect(),
    )
}

#[test]
fn only_a_commit_log_of_an_earlier_release_is_altered() {
    let added = [
        "filtered_count",
        "duplicate_count",
        "stale_count",
        "tombstone_count",
        "source_lsn",
    ];
    let earlier: Vec<(&str, &str)> = COMMIT_COLUMNS
        .iter()
        .filter(|(n, _)| !added.contains(n))
        .copied()
        .collect();
    let full = "tally.r_commits";
    assert_eq!(
        commit_columns_to_add(full, "MergeTree", &commit_log(&earlier, COMMIT_SORTING_KEY)),
        added
    );
    // One sorted by epoch too: it is rebuilt with its key after the columns are added.
    assert_eq!(
        commit_columns_to_add(
            full,
            "MergeTree",
            &commit_log(&earlier, LEGACY_COMMIT_SORTING_KEY)
        ),
        added
    );
    // One of the release before change jobs lacks the last four only.
    let with_filtered: Vec<(&str, &str)> = COMMIT_COLUMNS
        .iter()
        .filter(|(n, _)| !added[1..].contains(n))
        .copied()
        .collect();
    assert_eq!(
        commit_columns_to_add(
            full,
            "MergeTree",
            &commit_log(&with_filtered, COMMIT_SORTING_KEY)
        ),
        added[1..]
    );
    let current = commit_log(COMMIT_COLUMNS, COMMIT_SORTING_KEY);
    assert!(commit_columns_to_add(full, "MergeTree", &current).is_empty());
    assert!(
        check(
            full,
            &current,
            "MergeTree",
            Some(COMMIT_SORTING_KEY),
            COMMIT_COLUMNS
        )
        .is_empty()
    );
    // Not a table of another shape: that is reported, not altered.
    let foreign = commit_log(
        &[("batch_id", "String"), ("x", "UInt8")],
        COMMIT_SORTING_KEY,
    );
    assert!(commit_columns_to_add(full, "MergeTree", &foreign).is_empty());
    let mut wrong_type = earlier.clone();
    wrong_type[2] = ("epoch", "UInt32");
    assert!(
        commit_columns_to_add(
            full,
            "MergeTree",
            &commit_log(&wrong_type, COMMIT_SORTING_KEY)
        )
        .is_empty()
    );
}
