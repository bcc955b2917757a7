//! What an operator relies on: `/health` and `/ready` on the metrics address of a running worker,
//! and a refusal, naming the key, when tally's topics cannot be as durable as configured.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use tally_core::Checkpoint;
use tally_state::StateStore;

fn get(addr: &str, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: tally\r\n\r\n").as_bytes())
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

/// A loopback address no one listens on, for a worker's metrics.
fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", listener.local_addr().unwrap().port())
}

#[tokio::test(flavor = "multi_thread")]
async fn health_ready_and_metrics_are_served() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 17, 1_000).await;
    let job = Job::new(&topic, "");
    let addr = free_addr();
    let before = job.log().len();
    let mut worker = job.spawn(&[("TALLY_METRICS__ADDRESS", &addr)]);
    job.wait_until_consuming(before).await;
    let until = Instant::now() + Duration::from_secs(60);
    let mut ready = String::new();
    while Instant::now() < until {
        ready = get(&addr, "/ready").unwrap_or_default();
        if ready.starts_with("HTTP/1.1 200") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    assert!(get(&addr, "/health").unwrap().starts_with("HTTP/1.1 200"));
    wait_for_view(&job, &manifest, Duration::from_secs(60)).await;
    // Lag is measured right after a checkpoint's commit and fold step: poll for it.
    let until = Instant::now() + Duration::from_secs(30);
    let mut metrics = String::new();
    while Instant::now() < until {
        metrics = get(&addr, "/metrics").unwrap_or_default();
        if metrics.contains("tally_partition_lag_records") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        metrics.contains("tally_records_consumed_total"),
        "{metrics}"
    );
    assert!(metrics.contains("tally_partition_lag_records"), "{metrics}");
    // Every series names its job, so that one dashboard serves several.
    let job_label = format!("tally_job=\"{}\"", job.name);
    let series_lines: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("tally_"))
        .collect();
    assert!(series_lines.len() > 5, "{metrics}");
    for line in series_lines {
        assert!(line.contains(&job_label), "{line} lacks {job_label}");
    }
    assert!(series(&metrics, "tally_records_consumed_total").is_some_and(|n| n >= 1.0));
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));
}

/// A series' name and its labels but the job's (`tally_job`, which every series carries).
fn name_and_labels(series: &str) -> (&str, Vec<&str>) {
    let Some((name, labels)) = series.split_once('{') else {
        return (series, Vec::new());
    };
    let mut labels: Vec<&str> = labels
        .trim_end_matches('}')
        .split(',')
        .filter(|l| !l.is_empty() && !l.starts_with("tally_job="))
        .collect();
    labels.sort_unstable();
    (name, labels)
}

/// The value of a series in a Prometheus text exposition, by its name and exact labels.
fn series(metrics: &str, wanted: &str) -> Option<f64> {
    let wanted = name_and_labels(wanted);
    metrics.lines().find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        (!l.starts_with('#') && name_and_labels(series) == wanted)
            .then(|| value.trim().parse().ok())?
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shared_job_labels_its_series_by_task_and_says_which_tasks_run_here() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 23, 1_000).await;
    let job = Job::new(&topic, "tasks = 2");
    let addr = free_addr();
    let mut worker = job.spawn(&[("TALLY_METRICS__ADDRESS", &addr)]);
    wait_for_view(&job, &manifest, Duration::from_secs(90)).await;
    let until = Instant::now() + Duration::from_secs(30);
    let mut metrics = String::new();
    while Instant::now() < until {
        metrics = get(&addr, "/metrics").unwrap_or_default();
        if (0..2).all(|t| series(&metrics, &format!("tally_epoch{{task=\"{t}\"}}")).is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for task in 0..2 {
        let label = format!("{{task=\"{task}\"}}");
        // Alone in the group: it runs both tasks and keeps no standby.
        assert_eq!(
            series(&metrics, &format!("tally_task_running{label}")),
            Some(1.0),
            "{metrics}"
        );
        assert_eq!(
            series(&metrics, &format!("tally_task_standby{label}")),
            Some(0.0),
            "{metrics}"
        );
        assert!(
            series(&metrics, &format!("tally_epoch{label}")).is_some_and(|e| e >= 1.0),
            "{metrics}"
        );
        assert!(
            series(
                &metrics,
                &format!("tally_checkpoints_committed_total{label}")
            )
            .is_some_and(|n| n >= 1.0),
            "{metrics}"
        );
    }
    // The tasks' epochs are their own series, never one overwriting the other.
    assert_eq!(series(&metrics, "tally_epoch"), None, "{metrics}");
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replication_factor_the_cluster_cannot_give_stops_the_start() {
    let topic = unique("orders");
    create_topic(&topic, 1).await;
    let job = Job::new(&topic, "");
    // The local cluster has one broker.
    let mut worker = job.spawn(&[("TALLY_KAFKA__TOPIC_REPLICATION_FACTOR", "3")]);
    let status = wait_exit(&mut worker, Duration::from_secs(60)).expect("exits");
    assert!(!status.success());
    let log = job.log();
    assert!(log.contains("kafka.topic_replication_factor"), "{log}");
}

/// Deletes the records before `offset` in partition 0 of `topic`, as retention would.
async fn delete_records_before(topic: &str, offset: i64) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, rdkafka::Offset::Offset(offset))
        .unwrap();
    admin
        .delete_records(&tpl, &AdminOptions::new())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn doctor_passes_a_healthy_run_and_names_each_broken_hop() {
    let topic = unique("orders");
    create_topic(&topic, 1).await;
    let records = generate(23, 1, 2_000);
    let mut manifest = common::Manifest::default();
    let job = Job::new(&topic, "");
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    // Three parts, so that the commit log holds a batch in the middle.
    for part in records.chunks(700) {
        produce_into(&topic, part, &mut manifest).await;
        wait_for_view(&job, &manifest, Duration::from_secs(60)).await;
    }
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));

    let (ok, report) = doctor(&job);
    assert!(ok, "{report}");
    for hop in [
        "Accepted → Persisted",
        "Persisted → Processed",
        "Processed → Written",
        "Queryable → Reported",
    ] {
        assert_eq!(status_of(&report, hop), "PASS", "{hop}: {report}");
    }
    // One broker: an acknowledged record is on one disk only.
    assert_eq!(
        status_of(&report, "Produced → Accepted"),
        "WARN",
        "{report}"
    );

    let (db, t) = (&job.database, &job.table);
    // A naive writer adds the batches' counts again as a new version, with a commit row that
    // makes it visible but records no events.
    ch(&format!("INSERT INTO {db}.{t}_data SELECT toInt64(1000000), source_partition, window_start, window_end, customer_id, currency, orders * 2, revenue * 2 FROM {db}.{t}_data")).await;
    ch(&format!("INSERT INTO {db}.{t}_commits (batch_id, job, epoch, partitions, from_offsets, to_offsets, row_count) VALUES ('replay', 'it', 1000000, [0], [1000000], [1000000], 1)")).await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert_eq!(
        status_of(&report, "Written → Queryable"),
        "FAIL",
        "{report}"
    );
    assert_eq!(
        status_of(&report, "Processed → Written"),
        "FAIL",
        "the foreign batch breaks the chain: {report}"
    );

    // Two histories of an offset range: a batch over epoch 1's ranges that ends elsewhere.
    // (A copy of a batch, same ends, is the same batch: a zombie's late write, harmless.)
    ch(&format!("INSERT INTO {db}.{t}_commits SELECT 'twice', job, 2000000, partitions, from_offsets, arrayMap(x -> x - 1, to_offsets), watermarks, max_window_start, row_count, event_count, revenue_sum, dead_letters, committed_at, filtered_count, duplicate_count, stale_count, tombstone_count, source_lsn FROM {db}.{t}_commits WHERE epoch = 1")).await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert!(
        report.contains("two batches start partition 0 at offset 0"),
        "{report}"
    );

    // A checkpoint whose accounting does not balance.
    {
        let store =
            StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic)).unwrap();
        let meta = store.meta().unwrap();
        let mut partitions = meta.partitions.clone();
        for c in partitions.values_mut() {
            c.totals.aggregated += 1;
        }
        let bad = Checkpoint {
            epoch: meta.epoch.next(),
            partitions,
            ..Checkpoint::default()
        };
        store.pre_commit(&bad).unwrap();
        store.mark_committed(bad.epoch).unwrap();
    }
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert_eq!(
        status_of(&report, "Persisted → Processed"),
        "FAIL",
        "{report}"
    );
    assert!(report.contains("does not balance"), "{report}");

    // Remove the replay, then delete a commit-log row in the middle of the chain.
    ch(&format!(
        "ALTER TABLE {db}.{t}_commits DELETE WHERE epoch >= 1000000 OR epoch = 2"
    ))
    .await;
    ch(&format!(
        "ALTER TABLE {db}.{t}_data DELETE WHERE version = 1000000"
    ))
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert_eq!(
        status_of(&report, "Processed → Written"),
        "FAIL",
        "{report}"
    );
    assert!(
        report.contains("epoch 3 starts partition 0 at offset"),
        "{report}"
    );

    // Dead letters deleted from the DLQ (a truncated topic).
    delete_records_before(&job.dlq_topic(), 5).await;
    let (_, report) = doctor(&job);
    assert!(report.contains("the dead-letter topic holds"), "{report}");

    // Retention deleted source records tally had not read yet.
    produce_into(&topic, &generate(24, 1, 500), &mut manifest).await;
    delete_records_before(&topic, 2_300).await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert_eq!(
        status_of(&report, "Accepted → Persisted"),
        "FAIL",
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn reconcile_every_reads_only_what_was_committed_since_the_last_round() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(29, 2, 1_600);
    let mut manifest = common::Manifest::default();
    let job = Job::new(&topic, "");
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    produce_into(&topic, &records[..1_000], &mut manifest).await;
    wait_for_view(&job, &manifest, Duration::from_secs(60)).await;

    let out_path = job.dir.path().join("reconcile.out");
    let out = std::fs::File::create(&out_path).unwrap();
    let mut reconciler = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["reconcile", "--config", job.config.to_str().unwrap()])
        .args(["--every", "500ms", "--full-every", "1000"])
        .stdout(out)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let rounds = reconcile_rounds;
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until
        && rounds(&std::fs::read_to_string(&out_path).unwrap(), "full").is_empty()
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    produce_into(&topic, &records[1_000..], &mut manifest).await;
    wait_for_view(&job, &manifest, Duration::from_secs(60)).await;
    let mut text = String::new();
    let until = Instant::now() + Duration::from_secs(60);
    while Instant::now() < until {
        text = std::fs::read_to_string(&out_path).unwrap();
        if rounds(&text, "incremental")
            .iter()
            .map(|r| r.0)
            .sum::<u64>()
            >= 600
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = reconciler.kill();
    let _ = reconciler.wait();
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));
    let full = rounds(&text, "full");
    let incremental = rounds(&text, "incremental");
    assert_eq!(full.len(), 1, "{text}");
    assert_eq!(
        full[0].0, 1_000,
        "the first round reads everything committed: {text}"
    );
    // Later rounds read the new records once, however they fall on rounds.
    assert_eq!(incremental.iter().map(|r| r.0).sum::<u64>(), 600, "{text}");
    assert!(
        full.iter().chain(&incremental).all(|r| r.1 == 0),
        "every round matches: {text}"
    );
}

/// A transaction that committed offsets for the job's group and stays open, as a hanging one
/// does (here another producer's, which neither commits nor aborts): the worker says what holds
/// it (the `__consumer_offsets` partition, the commands that find and abort it), counts it and
/// waits; once the transaction ends it goes on and loses nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_open_transaction_on_the_groups_offsets_is_named_and_waited_out() {
    use rdkafka::ClientConfig;
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::{BaseProducer, Producer};
    use rdkafka::{Offset, TopicPartitionList};

    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 31, 2_000).await;
    let job = Job::new(&topic, "");
    let group = format!("tally-{topic}");
    let stray: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("transactional.id", unique("stray"))
        .set("transaction.timeout.ms", "600000")
        .create()
        .unwrap();
    stray.init_transactions(Duration::from_secs(30)).unwrap();
    stray.begin_transaction().unwrap();
    let outsider: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("group.id", &group)
        .create()
        .unwrap();
    let mut offsets = TopicPartitionList::new();
    offsets
        .add_partition_offset(&topic, 0, Offset::Offset(0))
        .unwrap();
    stray
        .send_offsets_to_transaction(
            &offsets,
            &outsider.group_metadata().unwrap(),
            Duration::from_secs(30),
        )
        .unwrap();

    let addr = free_addr();
    let before = job.log().len();
    let mut worker = job.spawn(&[("TALLY_METRICS__ADDRESS", &addr)]);
    let until = Instant::now() + Duration::from_secs(120);
    let mut metrics = String::new();
    while Instant::now() < until {
        metrics = get(&addr, "/metrics").unwrap_or_default();
        if series(&metrics, "tally_kafka_offsets_unstable_total").is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(
        series(&metrics, "tally_kafka_offsets_unstable_total").is_some_and(|n| n >= 1.0),
        "{metrics}\n{}",
        job.log()
    );
    let log = job.log()[before..].to_owned();
    assert!(log.contains("held by an open transaction"), "{log}");
    assert!(log.contains("__consumer_offsets partition"), "{log}");
    assert!(log.contains("find-hanging"), "{log}");
    assert!(
        view(&job.database, &job.table)
            .await
            .unwrap_or_default()
            .is_empty(),
        "nothing is committed while the group's offsets are unknown"
    );

    stray.abort_transaction(Duration::from_secs(30)).unwrap();
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    assert_accounting(&job, manifest.produced);
}

/// Runs `sql` (an ALTER … DELETE) and waits for its mutation.
async fn mutate(database: &str, sql: &str) {
    ch(sql).await;
    wait_mutations(database).await;
}

/// The row of `hop` and the evidence line under it.
fn hop_text(report: &str, hop: &str) -> String {
    let mut lines = report.lines().skip_while(|l| !l.contains(hop));
    format!(
        "{}\n{}",
        lines.next().unwrap_or(""),
        lines.next().unwrap_or("")
    )
}

/// What `doctor` did not see before: the changelog a takeover restores from, the read side not
/// publishing, a row of the published answer that no publish wrote, the newest commit-log row
/// of a partition deleted behind tally's back, and a key twice (FAIL rows, not a stop).
#[tokio::test(flavor = "multi_thread")]
async fn doctor_sees_the_changelog_the_read_side_and_rows_changed_behind_tally_s_back() {
    let topic = unique("orders");
    create_topic(&topic, 1).await;
    // One event a second: most windows final, and folded.
    let manifest = produce_spaced(&topic, 1, 61, 2_000, 1_000).await;
    let job = Job::new(&topic, "");
    let before = job.log().len();
    let mut worker = job.spawn(&[("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s")]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(&job, &manifest, Duration::from_secs(60)).await;
    let (db, t) = (&job.database, &job.table);
    let until = Instant::now() + Duration::from_secs(60);
    while ch_count(&format!("SELECT count() FROM {db}.{t}_final")).await == 0 {
        assert!(
            Instant::now() < until,
            "nothing folded; log:\n{}",
            job.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_stops_exact(&job, &mut worker, &view, &manifest);

    let (ok, report) = doctor(&job);
    assert!(ok, "{report}");
    let restorable = hop_text(&report, "Processed → Restorable");
    assert!(restorable.starts_with("PASS"), "{report}");
    assert!(restorable.contains("restored from"), "{restorable}");
    let queryable = hop_text(&report, "Written → Queryable");
    assert!(queryable.contains("read side"), "{queryable}");

    // A row of the published answer that no publish wrote (another snapshot's point).
    ch(&format!(
        "INSERT INTO {db}.{t}_live SELECT window_start, window_end, 'intruder', currency, orders, revenue, published_from, [9], [9] FROM {db}.{t}_live LIMIT 1"
    ))
    .await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    let queryable = hop_text(&report, "Written → Queryable");
    assert!(
        queryable.starts_with("FAIL") && queryable.contains("a row no publish wrote"),
        "{report}"
    );
    mutate(
        db,
        &format!("ALTER TABLE {db}.{t}_live DELETE WHERE customer_id = 'intruder'"),
    )
    .await;

    // A batch committed an hour ago that no publish shows: nothing publishes.
    ch(&format!(
        "INSERT INTO {db}.{t}_commits SELECT 'unpublished', job, 999, partitions, to_offsets, arrayMap(o -> o + 1, to_offsets), watermarks, max_window_start, 0, 0, 0, 0, now() - 3600, 0, 0, 0, 0, 0 FROM {db}.{t}_commits ORDER BY epoch DESC LIMIT 1"
    ))
    .await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    let queryable = hop_text(&report, "Written → Queryable");
    assert!(
        queryable.starts_with("FAIL") && queryable.contains("are not published: nothing publishes"),
        "{report}"
    );
    mutate(
        db,
        &format!("ALTER TABLE {db}.{t}_commits DELETE WHERE batch_id = 'unpublished'"),
    )
    .await;

    // A key twice in the view: FAIL rows, the report whole.
    ch(&format!(
        "INSERT INTO {db}.{t}_final SELECT * FROM {db}.{t}_final LIMIT 1"
    ))
    .await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    assert!(
        hop_text(&report, "Written → Queryable").contains("more than once in the view"),
        "{report}"
    );
    assert_eq!(
        status_of(&report, "Queryable → Reported"),
        "FAIL",
        "{report}"
    );
    mutate(
        db,
        &format!(
            "ALTER TABLE {db}.{t}_final DELETE WHERE (window_start, customer_id) IN (SELECT window_start, customer_id FROM {db}.{t}_final GROUP BY window_start, customer_id, currency HAVING count() > 1)"
        ),
    )
    .await;

    // The newest commit-log row deleted behind tally's back: Kafka's offsets say it existed.
    mutate(
        db,
        &format!(
            "ALTER TABLE {db}.{t}_commits DELETE WHERE epoch = (SELECT max(epoch) FROM {db}.{t}_commits)"
        ),
    )
    .await;
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    let written = hop_text(&report, "Processed → Written");
    assert!(
        written.starts_with("FAIL") && written.contains("deleted behind tally's back"),
        "{report}"
    );

    // The changelog truncated past the committed state: a takeover elsewhere could not restore.
    let changelog = format!("tally-{topic}-changelog");
    let end = tally_kafka::topic_extent(
        &tally_kafka::KafkaSettings {
            brokers: BROKERS.into(),
            client: Default::default(),
        },
        &changelog,
    )
    .unwrap()[&0]
        .1;
    delete_records_before(&changelog, end).await;
    let (_, report) = doctor(&job);
    let restorable = hop_text(&report, "Processed → Restorable");
    assert!(
        restorable.starts_with("FAIL") && restorable.contains("does not restore"),
        "{report}"
    );
}
