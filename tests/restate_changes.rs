//! A new version of a job of changes whose topic retention has trimmed reads a new snapshot,
//! by a connector of its own, and takes the job's view over once that connector has passed,
//! in the database's log, where the running version stopped (docs/operations.md; real
//! PostgreSQL, Kafka Connect, Kafka and ClickHouse).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::{Duration, Instant};

use common::*;

/// orders runs on its connector's topic, and retention trims the topic: a version 2 reading it
/// from its start is refused, naming `kafka.source_topic` and the way out. A connector of version
/// 2's own snapshots the table into a topic of its own; version 2 (a column added, the later
/// half of the windows restated) reads that topic from its start beside version 1 and takes the
/// job's view over while the table keeps changing, across a kill -9 right after it fenced
/// version 1 (where it waits for its connector to pass, in the database's log, where version 1
/// stopped). Version 1 stops by itself, a reader polling the view sees no key twice and no group
/// emptied, and the view equals the table from `restate_from` on.
#[tokio::test(flavor = "multi_thread")]
async fn a_change_job_restates_from_a_new_snapshot_once_retention_trimmed_its_topic() {
    use common::capture::{captured_table, finish, loadgen, verify_when_caught_up};
    let (first, job, manifest) = captured_table(300).await;
    let before = job.log().len();
    let mut v1 = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    // More changes before the trim than after it: the new snapshot's topic never holds as many
    // records as the first one did, so its offsets never pass version 1's; only the database's
    // log tells when version 2 has caught up.
    finish(loadgen(
        &job,
        &manifest,
        &["--events", "3000", "--rate", "400"],
    ));
    let (ok, report, _) = verify_when_caught_up(&job, &manifest).await;
    assert!(ok, "version 1 is exact before the change:\n{report}");

    // Retention deletes every change the topic held.
    let settings = tally_kafka::KafkaSettings {
        brokers: BROKERS.into(),
        client: std::collections::BTreeMap::new(),
    };
    let extent = tally_kafka::topic_extent(&settings, &first.topic).unwrap();
    {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let admin: AdminClient<rdkafka::client::DefaultClientContext> =
            rdkafka::ClientConfig::new()
                .set("bootstrap.servers", BROKERS)
                .create()
                .unwrap();
        let mut tpl = rdkafka::TopicPartitionList::new();
        for (p, (_, high)) in &extent {
            tpl.add_partition_offset(&first.topic, *p, rdkafka::Offset::Offset(*high))
                .unwrap();
        }
        admin
            .delete_records(&tpl, &AdminOptions::new())
            .await
            .unwrap();
    }

    // Version 2 restates the later half of the windows version 1 shows.
    let view = format!("{}.{}", job.database, job.table);
    let (low, high): (u32, u32) = clickhouse()
        .query(&format!(
            "SELECT toUInt32(min(window_start)), toUInt32(max(window_start)) FROM {view}"
        ))
        .fetch_one()
        .await
        .unwrap();
    let restate_from = i64::from(low + (high - low) / 2) / 3600 * 3600 * 1000;
    let v1_file = job.dir.path().join("v1.toml");
    std::fs::copy(&job.config, &v1_file).unwrap();
    let text = std::fs::read_to_string(&job.config).unwrap();
    write_file(
        &job.config,
        &(text + "\n[[aggregation.aggregate]]\ncolumn = \"orders_v2\"\nfunction = \"count\"\n"),
    );
    job.set("job", "version", "2");
    job.set(
        "job",
        "restate_from",
        &tally_core::time::format_ms(restate_from),
    );
    let (ok, out) = tally_command(&job, "check-config", &[]);
    assert!(
        !ok && out.contains("kafka.source_topic")
            && out.contains("Give the version a new snapshot"),
        "{out}"
    );

    // Its own connector: the running one's settings, its own names, a first snapshot.
    let second = first.beside();
    second.register(&[]).await;
    second.wait_for_records(300).await;
    job.set("kafka", "source_topic", &second.topic);
    job.set("source", "slot", &second.name);
    job.set("source", "connector", &second.name);
    let (ok, out) = tally_command(&job, "check-config", &[]);
    assert!(
        ok && out.contains("a new snapshot by a connector of its own")
            && out.contains("the view gains column orders_v2"),
        "{out}"
    );

    // The table keeps changing all along; a reader polls the job's view.
    let load = loadgen(&job, &manifest, &["--events", "1500", "--rate", "40"]);
    // (By version 1's columns: its view lacks the one version 2 adds until the takeover.)
    let probe = reader(&v1_file);
    let before = job.log().len();
    let mut v2 = job.spawn(&[("TALLY_FAULT", "takeover_after_claim")]);
    let status = wait_exit(&mut v2, Duration::from_secs(300));
    assert!(
        status.is_some_and(|s| !s.success())
            && job.log()[before..].contains("point=\"takeover_after_claim\""),
        "killed after the claim; log:\n{}",
        job.log()
    );
    let before = job.log().len();
    let mut v2 = job.spawn(&[]);
    job.wait_for_log(before, "version 1 is retired", Duration::from_secs(240))
        .await;
    let status = wait_exit(&mut v1, Duration::from_secs(60));
    let log = job.log();
    assert!(
        status.is_some_and(|s| s.success())
            && log.contains("version 2 took over the job from version 1: this worker stops"),
        "version 1 stops by itself; log:\n{log}"
    );
    assert!(
        log.contains(&format!("version 1 read topic {}", first.topic)),
        "the version taken over's connector is named for deletion; log:\n{log}"
    );
    tokio::task::spawn_blocking(move || finish(load))
        .await
        .unwrap();

    // From restate_from on the view is the table's aggregation, through version 2.
    let deadline = Instant::now() + Duration::from_secs(240);
    let reconciled = loop {
        let (ok, out) = tally_command(&job, "reconcile", &["--source"]);
        if ok || Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    assert!(
        reconciled.contains("OK: every window matches the source table")
            && reconciled.contains("__v2"),
        "{reconciled}\nlog:\n{}",
        job.log()
    );
    let kept = ch_count(&format!(
        "SELECT count() FROM {view} WHERE toUInt32(window_start) < {}",
        restate_from / 1000
    ))
    .await;
    assert!(kept > 0, "the windows before restate_from are kept");
    assert_reader_saw_no_violation(probe, "the job's view across the takeover");
    sigterm(&v2);
    assert!(wait_exit(&mut v2, Duration::from_secs(60)).is_some_and(|s| s.success()));
    for line in job.log().lines().filter(|l| {
        [
            "rebuild progress",
            "caught up",
            "confirm",
            "took the job",
            "read topic",
            "retired",
        ]
        .iter()
        .any(|n| l.contains(n))
    }) {
        eprintln!("{line}");
    }
    eprintln!("{} windows kept; {reconciled}", kept);
    drop(second);
}
