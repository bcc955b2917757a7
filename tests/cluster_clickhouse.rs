//! A job on a replicated ClickHouse (`scripts/services.sh up --cluster`: two replicas of one
//! shard in the cluster `tally`, ZooKeeper, three brokers): its truth is replicated, each replica
//! serves the view, and readers polling **both** replicas never see a key twice, a key vanish or a
//! total go down while a replica is killed with SIGKILL (the one written through, then the other;
//! the worker killed and started again while the first is down),
//! ZooKeeper restarts and ZooKeeper is away for 20 s (writes wait, then resume); each replica's
//! view ends exact, also for a declared Avro job of two workers. Bad cluster settings are refused
//! naming the key or the table. Ignored by a plain `cargo test`; the test command runs it on the
//! cluster set with `--ignored`. Alone in its file: it kills shared servers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;

const CLUSTER_BROKERS: &str = "127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094";
const REPLICAS: [&str; 2] = ["http://127.0.0.1:8123", "http://127.0.0.1:8124"];

type View = BTreeMap<(i64, String, String), (u64, i64)>;

/// A job on both replicas and the three brokers.
fn cluster_job(topic: &str) -> Job {
    let job = Job::new(topic, "");
    job.set("kafka", "brokers", CLUSTER_BROKERS);
    job.set("clickhouse", "url", &REPLICAS.join(","));
    job.set("clickhouse", "cluster", "tally");
    job.set("clickhouse", "fold_interval", "2s");
    job
}

async fn wait_exact_at(url: &str, job: &Job, manifest: &Manifest, timeout: Duration) -> View {
    let until = Instant::now() + timeout;
    loop {
        let current = view_at(url, &job.database, &job.table)
            .await
            .unwrap_or_default();
        if current == manifest.rows || Instant::now() > until {
            assert_view_eq(&current, &manifest.rows, &job.log());
            return current;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Polls the view on `url` until `stop`: every read must hold each key once (the read fails
/// otherwise), and no key may vanish or count fewer orders than at the read before. A replica
/// that does not answer is skipped. Returns (reads, violations).
fn reader(
    url: &'static str,
    database: String,
    table: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(u64, Vec<String>)> {
    tokio::spawn(async move {
        let mut before: View = BTreeMap::new();
        let (mut reads, mut violations) = (0u64, Vec::new());
        while !stop.load(Ordering::SeqCst) {
            match view_at(url, &database, &table).await {
                Ok(now) => {
                    reads += 1;
                    for (key, (orders, _)) in &before {
                        match now.get(key) {
                            None => violations.push(format!("{url}: {key:?} vanished")),
                            Some((n, _)) if n < orders => violations
                                .push(format!("{url}: {key:?} went down from {orders} to {n}")),
                            Some(_) => {}
                        }
                    }
                    before = now;
                }
                Err(e) if e.to_string().contains("twice") => {
                    violations.push(format!("{url}: {e}"));
                }
                Err(_) => {} // the replica is down
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        (reads, violations)
    })
}

/// `doctor`'s Written → Queryable row PASSes, from every replica.
fn assert_every_replica_queryable(job: &Job) {
    let (_, report) = doctor(job);
    println!("{report}");
    assert_eq!(
        status_of(&report, "Written → Queryable"),
        "PASS",
        "{report}"
    );
    for url in REPLICAS {
        assert!(
            report.contains(&format!("{url}: ")),
            "{url} checked: {report}"
        );
    }
}

async fn engine(url: &str, database: &str, table: &str) -> String {
    let client = clickhouse::Client::default()
        .with_url(url)
        .with_validation(false);
    client
        .query(&format!(
            "SELECT engine FROM system.tables WHERE database = '{database}' AND name = '{table}'"
        ))
        .fetch_one::<String>()
        .await
        .unwrap_or_else(|e| format!("{e}"))
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs the cluster set: scripts/services.sh up --cluster"]
async fn every_replica_serves_the_view_exactly_once_through_replica_and_zookeeper_faults() {
    let topic = unique("orders");
    create_topic(&topic, 4).await;
    let records = generate(43, 4, 8_000);
    let mut manifest = Manifest {
        source_topic: topic.clone(),
        ..Manifest::default()
    };
    produce_into(&topic, &records[..2_000], &mut manifest).await;
    let job = cluster_job(&topic);
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    for url in REPLICAS {
        wait_exact_at(url, &job, &manifest, Duration::from_secs(240)).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = REPLICAS
        .iter()
        .map(|url| reader(url, job.database.clone(), job.table.clone(), stop.clone()))
        .collect();

    // The truth is replicated; what readers see is each replica's own.
    for url in REPLICAS {
        for (table, want) in [
            ("revenue_agg_data", "ReplicatedMergeTree"),
            ("revenue_agg_commits", "ReplicatedMergeTree"),
            ("revenue_agg_partitions", "ReplicatedMergeTree"),
            ("revenue_agg_live", "MergeTree"),
            ("revenue_agg_final", "MergeTree"),
            ("revenue_agg", "View"),
        ] {
            assert_eq!(
                engine(url, &job.database, table).await,
                want,
                "{url} {table}"
            );
        }
    }
    assert_every_replica_queryable(&job);

    // The replica not written through killed: writes go on, it catches up once back.
    kill_9_service("clickhouse-2");
    produce_into(&topic, &records[2_000..4_000], &mut manifest).await;
    wait_exact_at(REPLICAS[0], &job, &manifest, Duration::from_secs(120)).await;
    services(&["up", "clickhouse-2"]);
    let back = Instant::now();
    wait_exact_at(REPLICAS[1], &job, &manifest, Duration::from_secs(180)).await;
    println!(
        "clickhouse-2 back: its view exact {:?} later",
        back.elapsed()
    );

    // The replica written through killed: the worker moves to the other one.
    let committed = job.log().len();
    kill_9_service("clickhouse-1");
    let killed = Instant::now();
    produce_into(&topic, &records[4_000..5_000], &mut manifest).await;
    job.wait_for_log(committed, "checkpoint committed", Duration::from_secs(120))
        .await;
    assert!(
        job.log()[committed..].contains("writing through another clickhouse replica"),
        "{}",
        &job.log()[committed..]
    );
    println!(
        "clickhouse-1 killed: the next epoch committed through clickhouse-2 {:?} later",
        killed.elapsed()
    );
    wait_exact_at(REPLICAS[1], &job, &manifest, Duration::from_secs(120)).await;
    // A worker starting while the first replica is down starts through the other.
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let restarted = job.log().len();
    worker = job.spawn(&[]);
    job.wait_until_consuming(restarted).await;
    produce_into(&topic, &records[5_000..6_000], &mut manifest).await;
    wait_exact_at(REPLICAS[1], &job, &manifest, Duration::from_secs(120)).await;
    services(&["up", "clickhouse-1"]);
    wait_exact_at(REPLICAS[0], &job, &manifest, Duration::from_secs(180)).await;

    // ZooKeeper restarted at once: the servers keep their sessions.
    services(&["restart", "zookeeper"]);
    produce_into(&topic, &records[6_000..7_000], &mut manifest).await;
    for url in REPLICAS {
        wait_exact_at(url, &job, &manifest, Duration::from_secs(240)).await;
    }
    // ZooKeeper away for 20 s: the replicated tables refuse writes on both replicas, so the
    // worker waits, saying so, and resumes by itself once it is back.
    let committed = job.log().len();
    services(&["down", "zookeeper"]);
    produce_into(&topic, &records[7_000..], &mut manifest).await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    let waiting = job.log()[committed..].to_owned();
    services(&["up", "zookeeper"]);
    let back = Instant::now();
    assert!(waiting.contains("sink write failed; retrying"), "{waiting}");
    for url in REPLICAS {
        wait_exact_at(url, &job, &manifest, Duration::from_secs(240)).await;
    }
    println!(
        "zookeeper back after 20 s away: both views exact {:?} later",
        back.elapsed()
    );

    stop.store(true, Ordering::SeqCst);
    for (url, reader) in REPLICAS.iter().zip(readers) {
        let (reads, violations) = reader.await.unwrap();
        println!("{url}: {reads} reads");
        assert!(reads > 20, "{url}: {reads} reads");
        assert!(violations.is_empty(), "{violations:#?}");
    }
    assert_every_replica_queryable(&job);
    let view = view_at(REPLICAS[0], &job.database, &job.table)
        .await
        .unwrap();
    assert_stops_exact(&job, &mut worker.0, &view, &manifest);
}

/// `tally run` with `job`'s settings: its exit status and log, once it stopped by itself.
fn run_refused(job: &Job) -> String {
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    let status = wait_exit(&mut worker.0, Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| !s.success()),
        "tally run must refuse: {}",
        &job.log()[before..]
    );
    job.log()[before..].to_owned()
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs the cluster set: scripts/services.sh up --cluster"]
async fn bad_cluster_settings_are_refused_naming_the_key_or_the_table() {
    // A topic each: a consumer group is one job's.
    let mut topics = Vec::new();
    for _ in 0..3 {
        let topic = unique("orders");
        create_topic(&topic, 1).await;
        topics.push(topic);
    }

    let job = cluster_job(&topics[0]);
    job.set("clickhouse", "cluster", "nowhere");
    let log = run_refused(&job);
    assert!(
        log.contains("clickhouse.cluster") && log.contains("knows no cluster"),
        "{log}"
    );

    let job = cluster_job(&topics[1]);
    job.set("clickhouse", "url", REPLICAS[0]);
    let log = run_refused(&job);
    assert!(
        log.contains("clickhouse.url lacks replica clickhouse-2"),
        "{log}"
    );

    // A table made by hand with another engine is not written into.
    let job = cluster_job(&topics[2]);
    for url in REPLICAS {
        let client = clickhouse::Client::default().with_url(url);
        client
            .query(&format!("CREATE DATABASE {}", job.database))
            .execute()
            .await
            .unwrap();
        client
            .query(&format!(
                "CREATE TABLE {}.revenue_agg_data (x UInt8) ENGINE = MergeTree ORDER BY x",
                job.database
            ))
            .execute()
            .await
            .unwrap();
    }
    let log = run_refused(&job);
    assert!(
        log.contains(&format!(
            "{}.revenue_agg_data has engine MergeTree, expected ReplicatedMergeTree",
            job.database
        )),
        "{log}"
    );
}

/// `tally verify` of `job` against the view and commit log on the replica at `url`.
fn verify_at(job: &Job, url: &str, manifest: &str) -> (bool, String) {
    tally_command_with(
        job,
        "verify",
        &["--manifest", manifest],
        &[("TALLY_CLICKHOUSE__URL", url)],
    )
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs the cluster set: scripts/services.sh up --cluster"]
async fn a_declared_avro_job_of_two_workers_is_exact_on_every_replica() {
    let topic = unique("payments");
    create_topic(&topic, 2).await;
    let job = Job::shipped("payments.toml", &topic);
    job.set("kafka", "brokers", CLUSTER_BROKERS);
    job.set("clickhouse", "url", &REPLICAS.join(","));
    job.set("clickhouse", "cluster", "tally");
    let manifest_path = job.dir.path().join("manifest.json");
    let manifest = manifest_path.to_str().unwrap().to_owned();
    // Two workers of the job: the first runs it, the second stands by and takes it over when
    // the first is killed with SIGKILL mid-stream; the first comes back as the standby.
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let standby = job.replica();
    let mut second = standby.spawn(&[]);
    standby
        .wait_for_log(0, "standing by", Duration::from_secs(60))
        .await;
    let loadgen = declared_loadgen(&job, &manifest);
    let before = job.log().len();
    job.wait_for_log(before, "checkpoint committed", Duration::from_secs(60))
        .await;
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    standby
        .wait_for_log(0, "holding the job's lease", Duration::from_secs(60))
        .await;
    let mut worker = job.spawn(&[]);
    let out = loadgen.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for url in REPLICAS {
        let until = Instant::now() + Duration::from_secs(180);
        let (mut ok, mut text) = verify_at(&job, url, &manifest);
        while !ok && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(500)).await;
            (ok, text) = verify_at(&job, url, &manifest);
        }
        assert!(
            ok && text.contains("verify: OK: exact match"),
            "{url}: {text}\n{}",
            job.log()
        );
        println!(
            "{url}: {}",
            text.lines()
                .find(|l| l.starts_with("verify-summary"))
                .unwrap_or_default()
        );
    }
    for w in [&mut worker.0, &mut second.0] {
        sigterm(w);
        assert!(wait_exit(w, Duration::from_secs(30)).is_some_and(|s| s.success()));
    }
}
