//! Shared helpers for integration tests against the real Kafka broker and ClickHouse server
//! started by `scripts/services.sh up`.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used, clippy::panic)] // test helpers fail loudly

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use tally_core::{OperatorConfig, WindowSpec};
use tally_tools::loadgen::{GeneratedRecord, Generator, LoadSpec};

pub mod capture;
mod job;
mod truth;

pub use job::{Job, Worker, worker_binary};
pub use truth::{Manifest, Rows, revenue_agg};

pub const BROKERS: &str = "127.0.0.1:9092";
pub const CLICKHOUSE: &str = "http://127.0.0.1:8123";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A name unique to this test process and call, usable as topic, database or table.
pub fn unique(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{n}_{}", std::process::id(), nanos % 100_000)
}

pub async fn create_topic(topic: &str, partitions: i32) {
    let settings = tally_kafka::KafkaSettings {
        brokers: BROKERS.into(),
        client: BTreeMap::new(),
    };
    tally_kafka::ensure_topic(&settings, topic, partitions, None, &[])
        .await
        .expect("create topic");
}

pub fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

/// Produces records in order and returns their offsets.
pub async fn produce(topic: &str, records: &[(i32, Vec<u8>, Vec<u8>)]) -> Vec<i64> {
    let producer = producer();
    let futures: Vec<_> = records
        .iter()
        .map(|(p, k, v)| {
            let record = FutureRecord::to(topic)
                .partition(*p)
                .key(k.as_slice())
                .payload(v.as_slice());
            producer
                .send_result(record)
                .map_err(|(e, _)| e)
                .expect("enqueue")
        })
        .collect();
    let mut offsets = Vec::new();
    for f in futures {
        let delivery = f.await.expect("delivery future").expect("delivered");
        offsets.push(delivery.offset);
    }
    producer.flush(Duration::from_secs(10)).expect("flush");
    offsets
}

pub fn rules() -> OperatorConfig {
    OperatorConfig {
        window: WindowSpec::tumbling(60_000),
        out_of_orderness_ms: 5_000,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
        windows_from_ms: None,
    }
}

pub fn spec(seed: u64, partitions: i32) -> LoadSpec {
    LoadSpec {
        seed,
        partitions,
        customers: 40,
        currencies: vec!["EUR".into(), "USD".into(), "GBP".into()],
        skew: 1.1,
        duplicate_fraction: 0.05,
        poison_fraction: 0.02,
        late_fraction: 0.02,
        filtered_fraction: 0.0,
        start_ms: 1_790_000_000_000,
        step_ms: 40,
        max_record_bytes: 4096,
    }
}

/// `n` records of a seeded stream; their fate is known by construction.
pub fn generate(seed: u64, partitions: i32, n: usize) -> Vec<GeneratedRecord> {
    generate_spaced(seed, partitions, n, spec(seed, partitions).step_ms)
}

/// Like [`generate`], with `step_ms` of event time between a partition's events.
pub fn generate_spaced(seed: u64, partitions: i32, n: usize, step_ms: i64) -> Vec<GeneratedRecord> {
    let spec = LoadSpec {
        step_ms,
        ..spec(seed, partitions)
    };
    let mut generator = Generator::new(spec, revenue_agg(), rules()).expect("generator");
    (0..n).map(|_| generator.next_record()).collect()
}

/// Produces records in order and adds them, at their offsets, to the ground truth.
pub async fn produce_into(topic: &str, records: &[GeneratedRecord], manifest: &mut Manifest) {
    let raw: Vec<_> = records
        .iter()
        .map(|r| (r.partition, r.key.clone(), r.value.clone()))
        .collect();
    let offsets = produce(topic, &raw).await;
    for (r, o) in records.iter().zip(offsets) {
        manifest.record(r, o);
    }
}

/// Produces `n` generated records and returns the ground truth.
pub async fn produce_generated(topic: &str, partitions: i32, seed: u64, n: usize) -> Manifest {
    produce_spaced(topic, partitions, seed, n, spec(seed, partitions).step_ms).await
}

/// Like [`produce_generated`], with `step_ms` of event time between a partition's events.
pub async fn produce_spaced(
    topic: &str,
    partitions: i32,
    seed: u64,
    n: usize,
    step_ms: i64,
) -> Manifest {
    let mut manifest = Manifest {
        source_topic: topic.into(),
        ..Manifest::default()
    };
    produce_into(
        topic,
        &generate_spaced(seed, partitions, n, step_ms),
        &mut manifest,
    )
    .await;
    manifest
}

/// Asserts two views are equal, naming the first differences.
pub fn assert_view_eq(found: &Rows, expected: &Rows, log: &str) {
    if found == expected {
        return;
    }
    let mut diffs = Vec::new();
    for (k, e) in expected {
        if found.get(k) != Some(e) {
            diffs.push(format!("{k:?}: expected {e:?}, found {:?}", found.get(k)));
        }
    }
    for k in found.keys().filter(|k| !expected.contains_key(*k)) {
        diffs.push(format!("{k:?}: unexpected {:?}", found[k]));
    }
    let tail: String = log
        .lines()
        .rev()
        .take(30)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    panic!(
        "view differs from ground truth in {} keys; first: {:#?}\nlog tail:\n{tail}",
        diffs.len(),
        &diffs[..diffs.len().min(8)]
    );
}

/// Runs this checkout's `scripts/services.sh` (e.g. `down kafka`), for tests that stop a
/// service; each such test is alone in its file, since the services are shared.
pub fn services(args: &[&str]) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/services.sh");
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .status()
        .expect("services.sh");
    assert!(status.success(), "services.sh {args:?}");
}

/// Kills a service this checkout's `scripts/services.sh` started (`connect`, `kafka-3`, ...)
/// with SIGKILL.
pub fn kill_9_service(name: &str) {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/services.sh");
    let out = Command::new("bash")
        .arg(script)
        .args(["pid", name])
        .output()
        .expect("services.sh pid");
    let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(!pid.is_empty(), "{name}'s pid");
    assert!(
        Command::new("kill")
            .args(["-9", &pid])
            .status()
            .expect("kill")
            .success(),
        "kill -9 {name}"
    );
}

pub fn sigterm(child: &Child) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
}

/// Waits for a child to exit, killing it after `timeout`.
/// Polls `done` every 200 ms until it holds or `timeout` passes; the caller asserts.
pub async fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !done() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + timeout;
    while Instant::now() < until {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    print_stacks(child.id());
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Prints every thread's stack of a process that did not exit in time, when gdb is at hand:
/// a hang found in CI then says where it waits.
fn print_stacks(pid: u32) {
    let out = Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "thread apply all bt",
        ])
        .output();
    if let Ok(out) = out {
        eprintln!(
            "stacks of process {pid} (still running after its timeout):\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

pub fn clickhouse() -> clickhouse::Client {
    clickhouse::Client::default()
        .with_url(CLICKHOUSE)
        .with_setting("wait_end_of_query", "1")
        .with_validation(false)
}

/// The reader view as (window_start_ms, customer, currency) → (orders, revenue units), read with
/// a plain SELECT; a key seen twice is an error.
pub async fn view(
    database: &str,
    table: &str,
) -> Result<BTreeMap<(i64, String, String), (u64, i64)>, tally_clickhouse::SinkError> {
    view_at(CLICKHOUSE, database, table).await
}

/// [`view`] as the server at `url` (a replica of a cluster) shows it.
pub async fn view_at(
    url: &str,
    database: &str,
    table: &str,
) -> Result<BTreeMap<(i64, String, String), (u64, i64)>, tally_clickhouse::SinkError> {
    let settings = tally_clickhouse::SinkSettings {
        url: url.into(),
        database: database.into(),
        table: table.into(),
        user: "default".into(),
        password: tally_clickhouse::Secret::default(),
        ca_file: None,
        request_timeout: Duration::from_secs(10),
        shape: tally_clickhouse::Shape::revenue_agg(),
        cluster: None,
    };
    tally_clickhouse::ClickHouseSink::connect(&settings)
        .await?
        .read_view()
        .await
}

/// Polls until the view equals the manifest's rows or the timeout passes; returns the last view.
pub async fn wait_for_view(
    job: &Job,
    manifest: &Manifest,
    timeout: Duration,
) -> BTreeMap<(i64, String, String), (u64, i64)> {
    let until = Instant::now() + timeout;
    loop {
        let current = view(&job.database, &job.table).await.unwrap_or_default();
        if current == manifest.rows || Instant::now() > until {
            return current;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Waits, up to a minute, until the job's first batch is in the view.
pub async fn wait_for_first_batch(job: &Job) {
    let until = Instant::now() + Duration::from_secs(60);
    while view(&job.database, &job.table)
        .await
        .map(|v| v.is_empty())
        .unwrap_or(true)
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Stops `worker` with SIGTERM and asserts a clean stop, `view` equal to the manifest and every
/// expected dead letter in the dead-letter topic exactly once.
pub fn assert_stops_exact(job: &Job, worker: &mut Child, view: &Rows, manifest: &Manifest) {
    sigterm(worker);
    let status = wait_exit(worker, Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "clean stop; log:\n{}",
        job.log()
    );
    assert_view_eq(view, &manifest.rows, &job.log());
    let dead = read_dead_letters(&job.dlq_topic());
    assert_eq!(
        dead.len(),
        manifest.dead_letters.len(),
        "dead letters exactly once"
    );
    assert_eq!(sorted(dead), expected_dead_letters(manifest));
}

/// Asserts the job's last checkpoint is committed and accounts for every record exactly once:
/// each partition's counts balance and reach its offset, and they sum to `produced`. Returns
/// the partitions it holds.
pub fn assert_accounting(job: &Job, produced: u64) -> usize {
    let store =
        tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
            .unwrap();
    let meta = store.meta().expect("a checkpoint");
    assert_eq!(meta.status, tally_state::EpochStatus::Committed);
    let mut consumed = 0;
    for (p, c) in &meta.partitions {
        assert!(c.totals.balances(), "partition {p}: {:?}", c.totals);
        assert_eq!(
            c.totals.consumed as i64, c.next_offset,
            "partition {p}: every offset consumed exactly once"
        );
        consumed += c.totals.consumed;
    }
    // A record processed twice would make this larger, one skipped smaller.
    assert_eq!(consumed, produced);
    meta.partitions.len()
}

/// Reads a topic to its end with read_committed and returns (source partition, source offset, reason)
/// per dead letter, in read order.
pub fn read_dead_letters(topic: &str) -> Vec<(i32, i64, String)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("group.id", unique("reader"))
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .create()
        .expect("consumer");
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Vec::new();
    };
    let mut tpl = TopicPartitionList::new();
    for p in t.partitions() {
        tpl.add_partition_offset(topic, p.id(), Offset::Beginning)
            .expect("tpl");
    }
    let partitions = t.partitions().len();
    consumer.assign(&tpl).expect("assign");
    let mut eof = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(30);
    while eof.len() < partitions && Instant::now() < until {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let mut fields = BTreeMap::new();
                if let Some(headers) = m.headers() {
                    for h in headers.iter() {
                        fields.insert(
                            h.key.to_string(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        );
                    }
                }
                let p = fields
                    .get("tally.source.partition")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(-1);
                let o = fields
                    .get("tally.source.offset")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(-1);
                out.push((
                    p,
                    o,
                    fields.get("tally.reason").cloned().unwrap_or_default(),
                ));
            }
            Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                eof.insert(p);
            }
            _ => {}
        }
    }
    out
}

pub fn expected_dead_letters(manifest: &Manifest) -> Vec<(i32, i64, String)> {
    manifest
        .dead_letters
        .iter()
        .map(|((p, o), r)| (*p, *o, r.to_string()))
        .collect()
}

pub fn sorted(mut v: Vec<(i32, i64, String)>) -> Vec<(i32, i64, String)> {
    v.sort();
    v
}

/// Asserts that folding ran and left one row per key in the folded table.
pub async fn assert_folded(job: &Job) {
    let db = &job.database;
    let t = &job.table;
    let folds: u64 = clickhouse()
        .query(&format!("SELECT count() FROM {db}.{t}_folds"))
        .fetch_one()
        .await
        .unwrap();
    assert!(folds > 0, "a fold step ran; log:\n{}", job.log());
    let (rows, keys): (u64, u64) = clickhouse()
        .query(&format!(
            "SELECT count(), uniqExact(window_start, customer_id, currency) FROM {db}.{t}_final"
        ))
        .fetch_one()
        .await
        .unwrap();
    assert!(rows > 0, "windows were folded");
    assert_eq!(rows, keys, "one folded row per window and key");
}

/// Runs one statement on the local ClickHouse, or fails the test with it.
pub async fn ch(sql: &str) {
    clickhouse()
        .query(sql)
        .execute()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A count from the local ClickHouse, or fails the test with the query.
pub async fn ch_count(sql: &str) -> u64 {
    clickhouse()
        .query(sql)
        .fetch_one()
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// Waits until `database` has no mutation (`ALTER … DELETE`) left to run.
pub async fn wait_mutations(database: &str) {
    for _ in 0..100 {
        let pending = ch_count(&format!(
            "SELECT count() FROM system.mutations WHERE database = '{database}' AND is_done = 0"
        ))
        .await;
        if pending == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("mutation did not finish");
}

/// Adds `partition_discovery_interval = "1s"` to `job`'s file: discovery every second rather
/// than the default, to keep a test short.
pub fn discover_partitions_every_second(job: &Job) {
    let config = std::fs::read_to_string(&job.config).unwrap().replace(
        "consumer_group =",
        "partition_discovery_interval = \"1s\"\nconsumer_group =",
    );
    write_file(&job.config, &config);
}

pub fn write_file(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write");
}

/// Runs `tally doctor` on `job`: (exit 0, report).
pub fn doctor(job: &Job) -> (bool, String) {
    // The generated stream's event time lies months back.
    tally_command(job, "doctor", &["--since", "3650d"])
}

/// Runs `tally <command> --config <job's> <args>` to its end: (exit 0, stdout and stderr).
pub fn tally_command(job: &Job, command: &str, args: &[&str]) -> (bool, String) {
    tally_command_with(job, command, args, &[])
}

/// [`tally_command`] with settings overridden by environment variables (`TALLY_<SECTION>__<KEY>`).
pub fn tally_command_with(
    job: &Job,
    command: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args([command, "--config", job.config.to_str().unwrap()])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The status word on the row of `hop`.
pub fn status_of(report: &str, hop: &str) -> String {
    report
        .lines()
        .find(|l| l.contains(hop))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or("missing")
        .to_owned()
}

/// `tally loadgen` for a declared job's file, as the examples' tests run it: 12,000 records at
/// 2,000/s over 2 partitions, with duplicates, poison, late and filtered records mixed in, its
/// manifest at `manifest`. Stdout and stderr piped.
pub fn declared_loadgen(job: &Job, manifest: &str) -> Child {
    Command::new(worker_binary())
        .args(["loadgen", "--config", job.config.to_str().unwrap()])
        .args([
            "--events",
            "12000",
            "--rate",
            "2000",
            "--partitions",
            "2",
            "--seed",
            "7",
            "--customers",
            "60",
            "--duplicates",
            "0.05",
            "--poison",
            "0.02",
            "--late",
            "0.01",
            "--filtered",
            "0.1",
            "--step-ms",
            "100",
            "--manifest",
            manifest,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("loadgen")
}

/// Starts a worker of `job` and `declared_loadgen` into it, kills the worker with SIGKILL
/// after its first commit in the middle of the stream, and starts it again: the new worker
/// (resumed from its checkpoint, asserted) and the loadgen still running.
pub async fn declared_stream_through_a_kill_9(job: &Job, manifest: &str) -> (Worker, Child) {
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let mut loadgen = declared_loadgen(job, manifest);
    let before = job.log().len();
    job.wait_for_log(before, "checkpoint committed", Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    assert!(
        loadgen.try_wait().unwrap().is_none(),
        "killed in the middle of the stream"
    );
    let before = job.log().len();
    let worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    assert!(
        job.log()[before..].contains("resuming partition from checkpoint"),
        "resumed, not recomputed:\n{}",
        job.log()
    );
    (worker, loadgen)
}

/// Waits (up to 120 s) for `tally verify --manifest <manifest>` to pass, then stops `worker`
/// with SIGTERM, asserts a clean stop and that verify passes on the stopped job: its
/// `verify-summary` line.
pub async fn verify_exact_then_stop(job: &Job, worker: &mut Child, manifest: &str) -> String {
    let verify = ["--manifest", manifest];
    let until = Instant::now() + Duration::from_secs(120);
    while !tally_command(job, "verify", &verify).0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    sigterm(worker);
    let status = wait_exit(worker, Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "clean stop; log:\n{}",
        job.log()
    );
    let (ok, text) = tally_command(job, "verify", &verify);
    assert!(
        ok && text.contains("verify: OK: exact match"),
        "{text}\nlog:\n{}",
        job.log()
    );
    text.lines()
        .find(|l| l.starts_with("verify-summary"))
        .unwrap_or_default()
        .to_owned()
}

/// Every record's fate in the job's checkpoint (aggregated, filtered, duplicate, late,
/// dead-lettered) is the one the declared manifest gave it.
pub fn assert_fates(job: &Job, m: &tally_tools::loadgen::Manifest) {
    let store =
        tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
            .unwrap();
    let mut totals = tally_core::Accounting::default();
    for c in store.meta().unwrap().partitions.values() {
        totals.add(&c.totals);
    }
    assert_eq!(
        totals.fates(),
        m.fates(),
        "every record's fate as the manifest has it"
    );
    assert!(m.duplicates > 0 && m.late > 0 && m.poison > 0, "{m:?}");
}

/// The rounds of `tally reconcile --every` output `text` of `kind` ("full" or
/// "incremental"): (records read, keys that differ) each.
pub fn reconcile_rounds(text: &str, kind: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter(|l| l.contains(&format!("({kind})")))
        .map(|l| {
            let num = |after: &str| -> u64 {
                l.split(after)
                    .next()
                    .unwrap_or("")
                    .split_whitespace()
                    .last()
                    .unwrap_or("0")
                    .parse()
                    .unwrap_or(0)
            };
            (num(" records read"), num(" differ"))
        })
        .collect()
}

/// The tasks a worker's log says it started, in order.
pub fn started_tasks(job: &Job, from: usize) -> Vec<u32> {
    job.log()
        .get(from..)
        .unwrap_or("")
        .lines()
        .filter(|l| l.contains("starting task"))
        .filter_map(|l| {
            let at = l.find("task=")? + "task=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// `tally probe` of the job file `config`: a reader polling its view every 50 ms.
pub fn reader(config: &std::path::Path) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["probe", "--config", config.to_str().unwrap()])
        .args(["--interval", "50ms"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// Stops a [`reader`] and asserts it saw no key twice, no window vanish and no count go down.
pub fn assert_reader_saw_no_violation(reader: std::process::Child, what: &str) {
    sigterm(&reader);
    let out = reader.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{what}: {text}");
    eprintln!("{what}: {text}");
}
