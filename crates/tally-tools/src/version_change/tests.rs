use std::collections::BTreeMap;

use super::*;
use tally_runtime::config::Config;

const HOUR: i64 = 3_600_000;

fn identity(version: u64, filter: &str) -> JobIdentity {
    let mut rules: BTreeMap<String, String> = [
        ("kafka.source_topic", "orders"),
        ("window.size", "60000ms"),
        ("aggregation", filter),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    if version > 1 {
        rules.insert(VERSION.into(), version.to_string());
    }
    JobIdentity {
        job: "shop".into(),
        rules,
    }
}

fn columns(names: &[(&str, &str)]) -> Vec<(String, String)> {
    names
        .iter()
        .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
        .collect()
}

/// Version 1 runs with a filter and three columns; its source holds records from hour 10 on.
fn running() -> Running {
    Running {
        identity: Some(identity(1, "filter status = paid\nsum amount")),
        view_columns: Some(columns(&[
            ("window_start", "DateTime"),
            ("orders", "UInt64"),
            ("revenue", "Decimal(18, 4)"),
        ])),
        earliest: BTreeMap::from([(0, Some(10 * HOUR)), (1, Some(11 * HOUR)), (2, None)]),
        extent: BTreeMap::from([(0, (0, 40)), (1, (0, 12)), (2, (0, 0))]),
        rebuilding: None,
        aborted: Vec::new(),
    }
}

fn new_columns() -> Vec<(String, String)> {
    columns(&[
        ("window_start", "DateTime"),
        ("orders", "UInt64"),
        ("revenue", "Decimal(38, 4)"),
        ("refunds", "UInt64"),
    ])
}

#[test]
fn a_new_version_lists_each_rule_and_column_it_changes_but_not_its_version() {
    let mine = identity(
        2,
        "filter status in (paid, shipped)\nsum amount\ncount refunds",
    );
    let change = compare(
        &mine,
        &new_columns(),
        Some(12 * HOUR),
        HOUR,
        false,
        &running(),
    )
    .unwrap();
    assert_eq!((change.running, change.new), (1, 2));
    let keys: Vec<&str> = change.rules.iter().map(|(k, _, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["aggregation"],
        "the version is not a rule that changed"
    );
    assert_eq!(change.columns_added, ["refunds"]);
    assert!(change.columns_removed.is_empty());
    assert_eq!(
        change.columns_retyped,
        [(
            "revenue".to_owned(),
            "Decimal(18,4)".to_owned(),
            "Decimal(38,4)".to_owned()
        )]
    );
    assert_eq!(change.reads_from, Some(11 * HOUR));
    assert_eq!(change.earliest, Some(10 * HOUR));
    let shown = change.to_string();
    assert!(shown.contains("the view gains column refunds"), "{shown}");
    assert!(shown.contains("reading the source from"), "{shown}");
}

#[test]
fn a_version_not_above_the_running_one_is_refused() {
    let mut run = running();
    run.identity = Some(identity(3, "filter status = paid\nsum amount"));
    for version in [2, 3] {
        let refused = compare(
            &identity(version, "x"),
            &new_columns(),
            None,
            HOUR,
            false,
            &run,
        )
        .expect_err("not above 3");
        assert_eq!(refused.key, "job.version");
        assert!(refused.message.contains("running version 3"), "{refused}");
        assert!(refused.message.contains("is 4 or more"), "{refused}");
    }
    let not_running = Running {
        identity: None,
        ..running()
    };
    let refused = compare(
        &identity(2, "x"),
        &new_columns(),
        None,
        HOUR,
        false,
        &not_running,
    )
    .expect_err("nothing runs");
    assert_eq!(refused.key, "job.version");
    // One version rebuilds at a time, and an aborted number is not used again.
    let rebuilding = Running {
        rebuilding: Some(2),
        aborted: vec![3],
        ..running()
    };
    let refused = compare(
        &identity(4, "x"),
        &new_columns(),
        None,
        HOUR,
        false,
        &rebuilding,
    )
    .expect_err("2 rebuilds");
    assert_eq!(refused.key, "job.version");
    assert!(
        refused.message.contains("version 2 is rebuilding already"),
        "{refused}"
    );
    assert!(
        compare(
            &identity(2, "x"),
            &new_columns(),
            None,
            HOUR,
            false,
            &rebuilding
        )
        .is_ok()
    );
    let aborted = Running {
        aborted: vec![2, 3],
        ..running()
    };
    let refused = compare(
        &identity(3, "x"),
        &new_columns(),
        None,
        HOUR,
        false,
        &aborted,
    )
    .expect_err("3 was aborted");
    assert!(
        refused.message.contains("version 3 was aborted"),
        "{refused}"
    );
    assert!(
        refused.message.contains("make the change version 4"),
        "{refused}"
    );
    assert!(
        compare(
            &identity(4, "x"),
            &new_columns(),
            None,
            HOUR,
            false,
            &aborted
        )
        .is_ok()
    );
}

#[test]
fn a_restatement_the_source_no_longer_reaches_is_refused_naming_what_it_holds() {
    let mine = identity(2, "x");
    // Reads from hour 10.5: partition 0 reaches it, partition 1 (from hour 11) does not.
    let refused = compare(
        &mine,
        &new_columns(),
        Some(11 * HOUR + HOUR / 2),
        HOUR,
        false,
        &running(),
    )
    .expect_err("partition 1 starts too late");
    assert_eq!(refused.key, "job.restate_from");
    assert!(
        refused
            .message
            .contains("partition 1 from 1970-01-01T11:00:00.000Z"),
        "{refused}"
    );
    assert!(!refused.message.contains("partition 0"), "{refused}");
    // From hour 12 on, both reach; without restate_from the whole topic is rebuilt.
    assert!(
        compare(
            &mine,
            &new_columns(),
            Some(12 * HOUR),
            HOUR,
            false,
            &running()
        )
        .is_ok()
    );
    let whole = compare(&mine, &new_columns(), None, HOUR, false, &running()).unwrap();
    assert_eq!(whole.reads_from, None);
    assert!(
        whole.to_string().contains("rebuilds every window"),
        "{whole}"
    );
}

/// A job of changes reads its whole topic whatever `restate_from` (a row's change retracts
/// its earlier image, whenever written), and is refused once retention deleted from it.
#[test]
fn a_job_of_changes_restates_from_its_whole_topic_while_the_topic_holds_it() {
    let mine = identity(2, "x");
    // restate_from before what the topic's record times reach: a job of events is refused.
    let change = compare(&mine, &new_columns(), Some(HOUR), HOUR, true, &running()).unwrap();
    assert_eq!(change.reads_from, None);
    assert!(
        change.to_string().contains("reading the whole topic"),
        "{change}"
    );
    let trimmed = Running {
        extent: BTreeMap::from([(0, (0, 40)), (1, (7, 12))]),
        ..running()
    };
    let refused = compare(&mine, &new_columns(), None, HOUR, true, &trimmed)
        .expect_err("retention deleted changes");
    assert_eq!(refused.key, "kafka.source_topic");
    assert!(
        refused.message.contains("partition 1 starts at offset 7")
            && !refused.message.contains("partition 0"),
        "{refused}"
    );
    assert!(compare(&mine, &new_columns(), None, HOUR, false, &trimmed).is_ok());
}

/// A version of a change job naming a topic of its own reads a new snapshot: check-config
/// says so, naming both topics; offsets of two topics do not compare, so a job of events may
/// not, and a job of changes only with its connector's slot named.
#[test]
fn a_job_of_changes_may_read_a_new_snapshot_in_a_topic_of_its_own() {
    let mut mine = identity(2, "x");
    mine.rules
        .insert("kafka.source_topic".into(), "shop_v2.public.orders".into());
    let change = compare(&mine, &new_columns(), Some(HOUR), HOUR, true, &running()).unwrap();
    let text = change.to_string();
    assert!(
        text.contains(
            "reading its own topic \"shop_v2.public.orders\" from its start, a new snapshot"
        ) && text.contains("version 1 reads \"orders\""),
        "{text}"
    );
    use tally_runtime::config::topic_refused;
    assert_eq!(topic_refused("a", "a", false, false), None);
    assert_eq!(topic_refused("a", "b", true, true), None);
    let (key, why) = topic_refused("a", "b", false, true).expect("events: refused");
    assert_eq!(key, "kafka.source_topic");
    assert!(why.contains("a job of another topic is a new job"), "{why}");
    let (key, why) = topic_refused("a", "b", true, false).expect("no slot: refused");
    assert_eq!(key, "source.slot");
    assert!(why.contains("\"b\"") && why.contains("\"a\""), "{why}");
}

/// The rebuild reads a window's size, the out-of-orderness and the lateness before
/// `restate_from`: a record of the first restated window can be that far back in the source.
#[test]
fn the_rebuild_reads_as_far_back_as_a_record_of_its_first_window_can_be() {
    let text = include_str!("../../../../config/api_latency.toml");
    let config = Config::parse("api_latency.toml", text, &[]).expect("the shipped job parses");
    assert_eq!(config.restatement_lead_ms(), 60_000 + 5_000 + 60_000);
}
