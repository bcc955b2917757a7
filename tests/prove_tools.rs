//! `tally verify` and `tally reconcile` pass on an exact sink and demonstrably fail on a wrong one;
//! a wrong table shape is refused with an actionable error.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;

fn tally(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(args)
        .output()
        .expect("run tally")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_and_reconcile_catch_a_wrong_sink() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(31, 2, 4_000);
    let mut manifest = common::Manifest::default();
    let job = Job::new(&topic, "");
    let manifest_path = job.dir.path().join("manifest.json");
    let before = job.log().len();
    // Folding off: the corruptions below target version rows, which folding would replace.
    let mut worker = job.spawn(&[("TALLY_CLICKHOUSE__FOLD_INTERVAL", "0s")]);
    job.wait_until_consuming(before).await;
    // Two halves, so the commit log holds several batches.
    produce_into(&topic, &records[..2_000], &mut manifest).await;
    let found = wait_for_view(&job, &manifest, Duration::from_secs(90)).await;
    assert_view_eq(&found, &manifest.rows, &job.log());
    produce_into(&topic, &records[2_000..], &mut manifest).await;
    let found = wait_for_view(&job, &manifest, Duration::from_secs(90)).await;
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));
    assert_view_eq(&found, &manifest.rows, &job.log());
    manifest.save(&manifest_path).unwrap();
    let config = job.config.to_str().unwrap();
    let m = manifest_path.to_str().unwrap();

    let ok = tally(&["verify", "--config", config, "--manifest", m]);
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(text(&ok).contains("over_counted=0 lost=0"), "{}", text(&ok));
    let ok = tally(&["reconcile", "--config", config]);
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(text(&ok).contains("every ratio is 1"), "{}", text(&ok));

    let data = format!("{}.{}_data", job.database, job.table);
    let commits = format!("{}.{}_commits", job.database, job.table);
    let batch_of = |epoch: &str| {
        format!(
            "(source_partition, version) IN (SELECT cp, cv FROM {commits} ARRAY JOIN partitions AS cp, to_offsets AS cv WHERE epoch = {epoch})"
        )
    };
    // Writing a committed batch again (same versions) changes nothing: the sink's invariant.
    ch(&format!(
        "INSERT INTO {data} SELECT * FROM {data} WHERE {}",
        batch_of(&format!("(SELECT min(epoch) FROM {commits})"))
    ))
    .await;
    let still = tally(&["verify", "--config", config, "--manifest", m]);
    assert!(
        still.status.success(),
        "re-writing a batch must be idempotent: {}",
        text(&still)
    );

    // A naive sink replaying a batch as new data double counts: both tools must say so.
    ch(&format!(
        "INSERT INTO {data} SELECT toInt64(1000000), source_partition, window_start, window_end, customer_id, currency, orders * 2, revenue * 2 FROM {data} WHERE {}",
        batch_of(&format!("(SELECT max(epoch) FROM {commits} WHERE row_count > 0)"))
    ))
    .await;
    ch(&format!("INSERT INTO {commits} (batch_id, job, epoch, partitions, from_offsets, to_offsets, row_count) SELECT 'corrupt', 'it', 1000000, partitions, to_offsets, arrayMap(x -> toInt64(1000000), partitions), 1 FROM {commits} WHERE epoch = 1")).await;
    let bad = tally(&["verify", "--config", config, "--manifest", m]);
    assert_eq!(bad.status.code(), Some(1), "{}", text(&bad));
    assert!(text(&bad).contains("different"), "{}", text(&bad));
    assert!(!text(&bad).contains("over_counted=0 "), "{}", text(&bad));
    let bad = tally(&["reconcile", "--config", config]);
    assert_eq!(bad.status.code(), Some(1), "{}", text(&bad));
    assert!(
        text(&bad).contains("revenue ratio") || text(&bad).contains("orders ratio"),
        "{}",
        text(&bad)
    );

    // Deleting a batch (its commit) loses data: both tools must say so.
    // Delete a batch that readers depend on: one that holds the newest version of some window
    // and is not the last (a missing last batch is indistinguishable from one not yet committed).
    let victim: u64 = clickhouse()
        .query(&format!(
            "SELECT epoch FROM {commits} ARRAY JOIN partitions AS cp, to_offsets AS cv \
             WHERE (cp, cv) IN (SELECT source_partition, max(version) FROM {data} WHERE version < 1000000 \
                                GROUP BY source_partition, window_start, customer_id, currency) \
               AND epoch < (SELECT max(epoch) FROM {commits} WHERE epoch < 1000000) \
             GROUP BY epoch ORDER BY count() DESC LIMIT 1"
        ))
        .fetch_one()
        .await
        .unwrap();
    ch(&format!(
        "ALTER TABLE {commits} DELETE WHERE epoch = 1000000 OR epoch = {victim}"
    ))
    .await;
    wait_mutations(&job.database).await;
    let bad = tally(&["verify", "--config", config, "--manifest", m]);
    assert_eq!(bad.status.code(), Some(1), "{}", text(&bad));
    assert!(
        text(&bad).contains("lost=") && !text(&bad).contains(" lost=0 "),
        "{}",
        text(&bad)
    );
    let bad = tally(&["reconcile", "--config", config]);
    assert_eq!(bad.status.code(), Some(1), "{}", text(&bad));
    assert!(
        text(&bad).contains("commit log: epoch") || text(&bad).contains("commit log: partition"),
        "the missing batch is named: {}",
        text(&bad)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_table_with_the_wrong_engine_is_refused_with_advice() {
    let topic = unique("orders");
    create_topic(&topic, 1).await;
    let job = Job::new(&topic, "");
    ch(&format!("CREATE DATABASE {}", job.database)).await;
    ch(&format!(
        "CREATE TABLE {}.{}_data (epoch UInt64, source_partition Int32, window_start DateTime, window_end DateTime, customer_id String, currency String, orders UInt64, revenue Decimal(18, 4)) ENGINE = ReplacingMergeTree(epoch) ORDER BY (window_start, customer_id, currency, source_partition)",
        job.database, job.table
    ))
    .await;
    let mut worker = job.spawn(&[]);
    let status = wait_exit(&mut worker, Duration::from_secs(30)).expect("exits");
    assert!(!status.success());
    let log = job.log();
    assert!(
        log.contains("has engine ReplacingMergeTree, expected MergeTree"),
        "{log}"
    );
    assert!(log.contains("DROP TABLE"), "says what to do: {log}");
    assert!(
        log.contains("written by an earlier tally"),
        "an epoch-versioned table is recognised as the previous layout: {log}"
    );
}

#[test]
fn check_config_names_a_misspelled_key_and_a_negative_window() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/revenue_agg.toml"
    ))
    .unwrap();
    let ok_path = dir.path().join("ok.toml");
    std::fs::write(&ok_path, &base).unwrap();
    let ok = tally(&["check-config", "--config", ok_path.to_str().unwrap()]);
    assert!(ok.status.success(), "{}", text(&ok));
    assert!(!text(&ok).contains("password: \"x"), "no secrets");

    let typo = dir.path().join("typo.toml");
    std::fs::write(
        &typo,
        base.replace("out_of_orderness =", "out_of_ordernes ="),
    )
    .unwrap();
    let out = tally(&["check-config", "--config", typo.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("typo.toml: window.out_of_ordernes: unknown field `out_of_ordernes`"),
        "{}",
        text(&out)
    );

    let neg = dir.path().join("neg.toml");
    std::fs::write(&neg, base.replace("size = \"60s\"", "size = \"-60s\"")).unwrap();
    let out = tally(&["check-config", "--config", neg.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("neg.toml: window.size"),
        "{}",
        text(&out)
    );
}

/// The example declarations: `check-config` prints what each job reads and its view and that
/// `run` runs it as declared.
#[test]
fn check_config_prints_a_declared_job() {
    for (file, view) in [
        (
            "page_views.toml",
            "view   window_start DateTime, window_end DateTime, page String, country String, device String, views UInt64, fastest_load_ms Int64, slowest_load_ms Int64, mean_load_ms Float64",
        ),
        (
            "api_latency.toml",
            "view   window_start DateTime, window_end DateTime, service String, route String, requests UInt64, latency_total_ms Decimal(18, 3), latency_max_ms Decimal(18, 3)",
        ),
    ] {
        let path = format!("{}/../../config/{file}", env!("CARGO_MANIFEST_DIR"));
        let out = tally(&["check-config", "--config", &path]);
        assert!(out.status.success(), "{}", text(&out));
        assert!(text(&out).contains(view), "{}", text(&out));
        assert!(text(&out).contains("runs as declared"), "{}", text(&out));
    }
}

/// The load test of docs/guarantees.md ("`tally verify`") as written, with the shipped job file (its 1 MiB `max_record_bytes`
/// included): loadgen must produce only records a default broker takes, and the job then
/// verifies exactly. Only the names are the test's own, so that it shares nothing.
#[tokio::test(flavor = "multi_thread")]
async fn the_readme_load_test_runs_as_written() {
    let run = unique("readme");
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("m.json");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/revenue_agg.toml");
    let names = [
        ("TALLY_JOB__NAME", run.clone()),
        (
            "TALLY_JOB__STATE_DIR",
            dir.path().join("state").display().to_string(),
        ),
        ("TALLY_KAFKA__SOURCE_TOPIC", run.clone()),
        ("TALLY_KAFKA__CONSUMER_GROUP", format!("tally-{run}")),
        ("TALLY_CLICKHOUSE__DATABASE", run.clone()),
        ("TALLY_METRICS__ADDRESS", String::new()),
        ("TALLY_JOB__CHECKPOINT_INTERVAL", "1s".into()),
    ];
    let tally_with = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(args)
            .envs(names.iter().map(|(k, v)| (k, v)))
            .output()
            .expect("run tally")
    };
    let m = manifest.to_str().unwrap();
    let out = tally_with(&[
        "loadgen",
        "--config",
        config,
        "--events",
        "20000",
        "--manifest",
        m,
    ]);
    assert!(out.status.success(), "loadgen: {}", text(&out));
    let log = std::fs::File::create(dir.path().join("tally.log")).unwrap();
    let mut worker = common::Worker(
        Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(["run", "--config", config])
            .envs(names.iter().map(|(k, v)| (k, v)))
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let mut verified = None;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let out = tally_with(&["verify", "--config", config, "--manifest", m]);
        if out.status.success() {
            verified = Some(text(&out));
            break;
        }
    }
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));
    let verified = verified.unwrap_or_else(|| {
        panic!(
            "verify never passed; log:\n{}",
            std::fs::read_to_string(dir.path().join("tally.log")).unwrap_or_default()
        )
    });
    assert!(verified.contains("over_counted=0 lost=0"), "{verified}");
}
