//! A new version of a job rebuilds beside the running one, in resources of its own, from
//! where its `restate_from` needs, and is aborted by `tally retire` without touching the
//! running version, or takes the job's view over atomically once caught up
//! (docs/design/restatement.md; real Kafka and ClickHouse).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::{Duration, Instant};

use common::*;
use rdkafka::producer::{FutureRecord, Producer};

const MINUTE: i64 = 60_000;

/// Requests every 10 s over two hours up to about now, on 2 partitions, each record's
/// timestamp its event time (as a producer's `CreateTime`). Every fifth answered 550: the
/// running version counts it, the fixed one filters it out.
struct Requests;

impl Requests {
    const EVERY_MS: i64 = 10_000;

    /// The requests from `LIVE` on, after the first two hours, are all answered: both
    /// versions count them alike.
    const LIVE: usize = 720;

    fn status(i: usize) -> u16 {
        if i.is_multiple_of(5) && i < Self::LIVE {
            550
        } else {
            200
        }
    }

    async fn produce(topic: &str, first: usize, count: usize, base_ms: i64) {
        Self::produce_over(topic, 2, first, count, base_ms).await;
    }

    async fn produce_over(
        topic: &str,
        partitions: usize,
        first: usize,
        count: usize,
        base_ms: i64,
    ) {
        Self::produce_every(topic, partitions, first, count, base_ms, Self::EVERY_MS).await;
    }

    /// Requests `first..first + count`, one every `every_ms` from `base_ms`.
    async fn produce_every(
        topic: &str,
        partitions: usize,
        first: usize,
        count: usize,
        base_ms: i64,
        every_ms: i64,
    ) {
        let producer = producer();
        let mut deliveries = Vec::new();
        for i in first..first + count {
            let at = base_ms + i64::try_from(i).unwrap() * every_ms;
            let value = format!(
                r#"{{"request_id":"r-{i}","timing":{{"started":{},"latency_ms":"{}.250"}},"service":{{"name":"svc-{}","env":"prod"}},"request":{{"route":"/r{}"}},"response":{{"status":{}}}}}"#,
                at / 1000,
                i % 100,
                i % 3,
                i % 2,
                Self::status(i)
            );
            let key = format!("r-{i}");
            let record = FutureRecord::to(topic)
                .partition(i32::try_from(i % partitions).unwrap())
                .key(key.as_bytes())
                .payload(value.as_bytes())
                .timestamp(at);
            deliveries.push(producer.send_result(record).map_err(|(e, _)| e).unwrap());
        }
        for d in deliveries {
            d.await.unwrap().unwrap();
        }
    }
}

/// The requests `view` counts; 0 while it does not exist.
async fn requests_in(view: &str) -> u64 {
    clickhouse()
        .query(&format!("SELECT toUInt64(sum(requests)) FROM {view}"))
        .fetch_one()
        .await
        .unwrap_or(0)
}

async fn wait_for_requests(job: &Job, view: &str, expected: u64) {
    let until = Instant::now() + Duration::from_secs(90);
    let mut found = 0;
    while Instant::now() < until {
        found = requests_in(view).await;
        if found == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!(
        "{view} counts {found} requests, not {expected}; log:\n{}",
        job.log()
    );
}

/// The start of the minute two hours ago: the first request's time.
fn two_hours_ago() -> i64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    (now - 2 * 60 * MINUTE) / MINUTE * MINUTE
}

/// The job file's version 2: the filter fixed, a column added, windows from `restate_from`.
fn write_version_2(job: &Job, restate_from: i64) {
    let text = std::fs::read_to_string(&job.config).unwrap();
    write_file(
        &job.config,
        &(text.replace("max = 599", "max = 499")
            + "\n[[aggregation.aggregate]]\ncolumn = \"latency_min_ms\"\nfunction = \"min\"\nfield = \"latency\"\n"),
    );
    job.set("job", "version", "2");
    job.set(
        "job",
        "restate_from",
        &tally_core::time::format_ms(restate_from),
    );
    // Checked beside the running version first; the takeover has a test of its own.
    job.set("job", "takeover", "hold");
}

/// api_latency's version 1 on a new two-partition topic of `total` requests from two hours ago,
/// once its view counts them all: (job, its worker, the first request's time).
async fn version_1_counting(total: usize) -> (Job, Worker, i64) {
    let topic = unique("api_latency");
    create_topic(&topic, 2).await;
    let job = Job::shipped("api_latency.toml", &topic);
    let base = two_hours_ago();
    Requests::produce(&topic, 0, total, base).await;
    let before = job.log().len();
    let v1 = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    wait_for_requests(&job, &format!("{}.api_latency", job.database), total as u64).await;
    (job, v1, base)
}

/// Starts `job` with `env`, expects it to exit refused within 60 s: its `error:` line.
fn refused(job: &Job, env: &[(&str, &str)]) -> String {
    let before = job.log().len();
    let mut worker = job.spawn(env);
    let status = wait_exit(&mut worker, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("the worker kept running; log:\n{}", job.log()));
    let log = job.log()[before..].to_owned();
    assert!(!status.success(), "refused; log:\n{log}");
    log.lines()
        .rev()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line; log:\n{log}"))
        .to_owned()
}

/// api_latency runs with a filter too wide (it counts 5xx answers); version 2 narrows it, adds
/// a column and restates the last hour. It reads only from the hour less a window and the
/// lateness (by record time), computes only the windows from the hour on, into its own tables
/// and own view, with every record it read counted as one fate; its progress is logged; the
/// running version serves the job's view untouched all along. A third version is refused while
/// the second rebuilds; `tally retire` of the second aborts it (it is not run again), and the
/// running version reads on.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_version_rebuilds_beside_the_running_one_and_is_aborted_without_touching_it() {
    let total = 720;
    let (job, mut v1, base) = version_1_counting(total).await;
    let topic = job.topic.clone();
    let view_v1 = format!("{}.api_latency", job.database);
    let view_v2 = format!("{}.api_latency__v2", job.database);

    // Version 2: the filter fixed, a column added, the last hour restated.
    let restate_from = base + 60 * MINUTE;
    let v1_file = job.dir.path().join("v1.toml");
    std::fs::copy(&job.config, &v1_file).unwrap();
    write_version_2(&job, restate_from);
    // Readers of both views all along: the running version's, and the new version's own.
    let readers = [reader(&v1_file), reader(&job.config)];
    let before = job.log().len();
    let mut v2 = job.spawn(&[]);
    let from_hour = (360..total).filter(|&i| Requests::status(i) == 200).count() as u64;
    wait_for_requests(&job, &view_v2, from_hour).await;
    let log = job.log()[before..].to_owned();

    // Only windows from restate_from, in version 2's own tables.
    let first_window = ch_count(&format!(
        "SELECT toUInt64(min(toUInt32(window_start))) FROM {view_v2}"
    ))
    .await;
    assert_eq!(first_window, u64::try_from(restate_from / 1000).unwrap());
    assert_eq!(
        ch_count(&format!(
            "SELECT count() FROM {view_v2} WHERE latency_min_ms IS NOT NULL AND latency_min_ms > 0"
        ))
        .await,
        ch_count(&format!("SELECT count() FROM {view_v2}")).await,
        "the added column is filled"
    );
    // It read from restate_from less 125 s (a window, out_of_orderness and lateness) by record
    // time, on each partition: not the hour before.
    let lead = MINUTE + 5_000 + MINUTE;
    let skipped = |p: usize| {
        (0..total)
            .filter(|&i| i % 2 == p && base + i as i64 * Requests::EVERY_MS < restate_from - lead)
            .count() as u64
    };
    let commits = format!("{}.api_latency__v2_commits", job.database);
    for p in 0..2 {
        let first = ch_count(&format!(
            "SELECT toUInt64(min(from_offsets[indexOf(partitions, {p})])) FROM {commits} WHERE has(partitions, {p})"
        ))
        .await;
        assert_eq!(
            first,
            skipped(p),
            "partition {p}'s first offset; log:\n{log}"
        );
    }
    // Every record it read is one fate: aggregated, or filtered (5xx, or only in windows before
    // restate_from).
    let read = total as u64 - skipped(0) - skipped(1);
    let (consumed, aggregated, others) = (
        format!(
            "SELECT toUInt64(sum(arraySum(to_offsets) - arraySum(from_offsets))) FROM (SELECT batch_id, any(to_offsets) AS to_offsets, any(from_offsets) AS from_offsets FROM {commits} GROUP BY batch_id)"
        ),
        format!(
            "SELECT toUInt64(sum(e)) FROM (SELECT batch_id, any(event_count) AS e FROM {commits} GROUP BY batch_id)"
        ),
        format!(
            "SELECT toUInt64(sum(f)) FROM (SELECT batch_id, any(filtered_count + duplicate_count + dead_letters) AS f FROM {commits} GROUP BY batch_id)"
        ),
    );
    assert_eq!(ch_count(&consumed).await, read);
    assert_eq!(ch_count(&aggregated).await, from_hour);
    assert_eq!(ch_count(&others).await, read - from_hour);
    job.wait_for_log(
        before,
        &format!("rebuild progress: {read} of {read} records read"),
        Duration::from_secs(30),
    )
    .await;

    // Its own replay agrees: reconcile of version 2 reads the topic by version 2's rules.
    let (ok, out) = tally_command(&job, "reconcile", &[]);
    assert!(ok && out.contains("OK: every ratio is 1"), "{out}");
    let (ok, report) = doctor(&job);
    assert!(ok, "{report}");
    assert!(
        report.contains("version 2 rebuilds beside version 1: this is its own view"),
        "{report}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["doctor", "--config", v1_file.to_str().unwrap()])
        .args(["--since", "3650d"])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && report.contains("is this version's (1); version 2 rebuilds beside it"),
        "{report}"
    );

    // Killed in the rebuild, it resumes from its checkpoint while both versions read on.
    v2.0.kill().unwrap();
    v2.0.wait().unwrap();
    let more = 60;
    Requests::produce(&topic, total, more, base).await;
    let before = job.log().len();
    let mut v2 = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    assert!(
        job.log()[before..].contains("resuming partition from checkpoint"),
        "resumed; log:\n{}",
        job.log()
    );
    let total = total + more;
    let from_hour = (360..total).filter(|&i| Requests::status(i) == 200).count() as u64;
    wait_for_requests(&job, &view_v2, from_hour).await;
    wait_for_requests(&job, &view_v1, total as u64).await;

    // The running version's view is its own: every request, without the new column.
    assert_eq!(requests_in(&view_v1).await, total as u64);
    assert_eq!(
        ch_count(&format!(
            "SELECT count() FROM system.columns WHERE database = '{}' AND table = 'api_latency' AND name = 'latency_min_ms'",
            job.database
        ))
        .await,
        0
    );

    let [of_v1, of_v2] = readers;
    assert_reader_saw_no_violation(of_v1, "the reader of version 1's view");
    assert_reader_saw_no_violation(of_v2, "the reader of version 2's own view");

    // One version rebuilds at a time.
    let error = refused(&job, &[("TALLY_JOB__VERSION", "3")]);
    assert!(error.contains("version 2 is rebuilding already"), "{error}");

    // The abort: version 2 stopped and retired; it does not run again, version 1 runs on.
    sigterm(&v2);
    assert!(wait_exit(&mut v2, Duration::from_secs(30)).is_some_and(|s| s.success()));
    let (ok, out) = tally_command(&job, "retire", &[]);
    assert!(ok && out.contains("aborted version 2"), "{out}");
    let error = refused(&job, &[]);
    assert!(error.contains("version 2 was aborted"), "{error}");
    let (ok, out) = tally_command(&job, "check-config", &[]);
    assert!(
        !ok && out.contains("job.version: version 2 was aborted"),
        "{out}"
    );
    assert!(v1.0.try_wait().unwrap().is_none(), "version 1 runs on");
    Requests::produce(&topic, total, 10, base).await;
    wait_for_requests(&job, &view_v1, total as u64 + 10).await;
    sigterm(&v1);
    assert!(wait_exit(&mut v1, Duration::from_secs(30)).is_some_and(|s| s.success()));
}

/// Two workers rebuild version 2 together, as workers share a job: its two tasks spread over
/// them (its own lease topic and transactional ids), and its own view is exact from
/// `restate_from` on, while one worker runs version 1 whole; then version 2 takes the job's
/// view over and version 1's worker stops by itself.
#[tokio::test(flavor = "multi_thread")]
async fn several_workers_rebuild_a_version_together() {
    let topic = unique("api_latency");
    let partitions = 4;
    create_topic(&topic, partitions as i32).await;
    let job = Job::shipped("api_latency.toml", &topic);
    let base = two_hours_ago();
    let total = 720;
    Requests::produce_over(&topic, partitions, 0, total, base).await;
    let before = job.log().len();
    let mut v1 = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    wait_for_requests(&job, &format!("{}.api_latency", job.database), total as u64).await;

    let restate_from = base + 90 * MINUTE;
    write_version_2(&job, restate_from);
    job.set("job", "tasks", "2");
    job.set("job", "takeover", "auto");
    let other = job.replica();
    let mut workers = [job.spawn(&[]), other.spawn(&[])];
    let view_v2 = format!("{}.api_latency__v2", job.database);
    let first = usize::try_from((restate_from - base) / Requests::EVERY_MS).unwrap();
    let expected = (first..total)
        .filter(|&i| Requests::status(i) == 200)
        .count() as u64;
    wait_for_requests(&job, &view_v2, expected).await;
    let tasks_of = |j: &Job| started_tasks(j, 0);
    wait_until(Duration::from_secs(30), || {
        !tasks_of(&job).is_empty() && !tasks_of(&other).is_empty()
    })
    .await;
    let (mine, theirs) = (tasks_of(&job), tasks_of(&other));
    assert!(
        !mine.is_empty() && !theirs.is_empty(),
        "each worker runs a task: {mine:?} {theirs:?}"
    );
    assert_eq!(
        ch_count(&format!(
            "SELECT toUInt64(min(toUInt32(window_start))) FROM {view_v2}"
        ))
        .await,
        u64::try_from(restate_from / 1000).unwrap()
    );
    let (ok, out) = tally_command(&job, "reconcile", &[]);
    assert!(ok && out.contains("OK: every ratio is 1"), "{out}");
    // Caught up, version 2 takes the job's view over from whichever worker holds its read
    // side; version 1 stops by itself, and the view holds its windows before restate_from
    // (every request) and version 2's from it on.
    let retired = |j: &Job| j.log().contains("version 1 is retired");
    wait_until(Duration::from_secs(120), || {
        retired(&job) || retired(&other)
    })
    .await;
    assert!(
        retired(&job) || retired(&other),
        "taken over; logs:\n{}\n{}",
        job.log(),
        other.log()
    );
    assert!(
        wait_exit(&mut v1, Duration::from_secs(60)).is_some_and(|s| s.success()),
        "version 1 stops by itself"
    );
    wait_for_requests(
        &job,
        &format!("{}.api_latency", job.database),
        first as u64 + expected,
    )
    .await;
    for w in workers.iter_mut() {
        sigterm(w);
        assert!(wait_exit(w, Duration::from_secs(60)).is_some_and(|s| s.success()));
    }
}

/// The first `rebuild progress` line of the log (from `from`) that has read every record to
/// read: `Some(records)`.
fn rebuilt(job: &Job, from: usize) -> Option<u64> {
    job.log()
        .get(from..)?
        .lines()
        .filter_map(|l| l.split("rebuild progress: ").nth(1))
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let read: u64 = words.next()?.parse().ok()?;
            let to_read: u64 = words.nth(1)?.parse().ok()?;
            (read == to_read && read > 0).then_some(read)
        })
        .next()
}

/// A job of Avro records (config/payments.toml, its schema changing twice mid-stream) restated
/// from the middle of its stream with a column added: version 2 reads its writer schemas from
/// the registry as version 1 does, its own view holds the windows from `restate_from` on, each
/// counting what version 1's counts there, and its replay through the registry agrees with it.
#[tokio::test(flavor = "multi_thread")]
async fn an_avro_job_restates_from_the_middle_of_its_stream() {
    let topic = unique("payments_avro");
    create_topic(&topic, 2).await;
    let job = Job::shipped("payments.toml", &topic);
    let manifest = job.dir.path().join("manifest.json");
    let manifest = manifest.to_str().unwrap().to_owned();
    let before = job.log().len();
    let mut v1 = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let loadgen = declared_loadgen(&job, &manifest);
    let out = loadgen.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verify = ["--manifest", manifest.as_str()];
    let until = Instant::now() + Duration::from_secs(120);
    while !tally_command(&job, "verify", &verify).0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (ok, text) = tally_command(&job, "verify", &verify);
    assert!(ok, "version 1 exact first: {text}");

    let view_v1 = format!("{}.payments", job.database);
    let view_v2 = format!("{}.payments__v2", job.database);
    let bounds = |f: &str| format!("SELECT toUInt64({f}(toUInt32(window_start))) FROM {view_v1}");
    let (first, last) = (
        ch_count(&bounds("min")).await,
        ch_count(&bounds("max")).await,
    );
    let restate_from_s = (first + last) / 2 / 60 * 60;
    assert!(first < restate_from_s && restate_from_s <= last);
    let text = std::fs::read_to_string(&job.config).unwrap();
    write_file(
        &job.config,
        &(text
            + "\n[[aggregation.aggregate]]\ncolumn = \"amount_min\"\nfunction = \"min\"\nfield = \"amount\"\n"),
    );
    job.set("job", "version", "2");
    job.set(
        "job",
        "restate_from",
        &tally_core::time::format_ms(i64::try_from(restate_from_s).unwrap() * 1000),
    );
    job.set("job", "takeover", "hold");
    let before = job.log().len();
    let mut v2 = job.spawn(&[]);
    wait_until(Duration::from_secs(120), || rebuilt(&job, before).is_some()).await;
    assert!(rebuilt(&job, before).is_some(), "log:\n{}", job.log());
    let (ok, out) = tally_command(&job, "reconcile", &[]);
    assert!(ok && out.contains("OK: every ratio is 1"), "{out}");
    assert_eq!(
        ch_count(&format!(
            "SELECT toUInt64(min(toUInt32(window_start))) FROM {view_v2}"
        ))
        .await,
        restate_from_s
    );
    // The same rules but a column: each window from restate_from counts what version 1's does.
    let counted = |view: &str| {
        format!(
            "SELECT toUInt64(sum(payments)) FROM {view} WHERE toUInt32(window_start) >= {restate_from_s}"
        )
    };
    let (mine, theirs) = (
        ch_count(&counted(&view_v2)).await,
        ch_count(&counted(&view_v1)).await,
    );
    assert!(mine > 0 && mine == theirs, "{mine} {theirs}");
    for w in [&mut v2, &mut v1] {
        sigterm(w);
        assert!(wait_exit(w, Duration::from_secs(60)).is_some_and(|s| s.success()));
    }
}

/// What a reader of `view` saw, polling it every 50 ms until `stop`.
struct Seen {
    /// The windows before `live` (seconds): one entry per change, as (the sum of the rows'
    /// hashes over the columns, rows). A read that failed is an entry too.
    settled: Vec<(String, u64)>,
    /// Each poll at which a key was there twice, or the requests of the windows from `live`
    /// on went down (a window gone or half shown).
    violations: Vec<String>,
    polls: u64,
}

/// A reader of `view` all along: its windows before `live` change only as a whole, and
/// those from `live` on (the stream still arriving) never lose a request.
fn watch_view(
    view: String,
    columns: Vec<String>,
    live: i64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<Seen> {
    tokio::spawn(async move {
        let mut seen = Seen {
            settled: Vec::new(),
            violations: Vec::new(),
            polls: 0,
        };
        let mut live_requests = 0u64;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let settled = view_state(&view, &columns, &format!("toUInt32(window_start) < {live}"))
                .await
                .unwrap_or_else(|e| (format!("error: {e}"), 0));
            if seen.settled.last() != Some(&settled) {
                seen.settled.push(settled);
            }
            let sql = format!(
                "SELECT count(), uniqExact(window_start, service, route), toUInt64(sumIf(requests, toUInt32(window_start) >= {live})) FROM {view}"
            );
            match clickhouse()
                .query(&sql)
                .fetch_one::<(u64, u64, u64)>()
                .await
            {
                Ok((rows, keys, requests)) => {
                    if rows != keys {
                        seen.violations
                            .push(format!("poll {}: {rows} rows, {keys} keys", seen.polls));
                    }
                    if requests < live_requests {
                        seen.violations.push(format!(
                            "poll {}: live requests went from {live_requests} to {requests}",
                            seen.polls
                        ));
                    }
                    live_requests = requests;
                }
                Err(e) => seen.violations.push(format!("poll {}: {e}", seen.polls)),
            }
            seen.polls += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        seen
    })
}

/// The rows of `view` that pass `filter`, as (the sum of their hashes over `columns`, rows).
async fn view_state(
    view: &str,
    columns: &[String],
    filter: &str,
) -> Result<(String, u64), clickhouse::error::Error> {
    let hashed: Vec<String> = columns.iter().map(|c| format!("toString({c})")).collect();
    clickhouse()
        .query(&format!(
            "SELECT toString(sum(cityHash64({}))), count() FROM {view} WHERE {filter}",
            hashed.join(", ")
        ))
        .fetch_one()
        .await
}

/// Produces a request of the live stream (from [`Requests::LIVE`] on) every 100 ms until
/// `stop`: how many.
fn live_stream(
    topic: String,
    base: i64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut n = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            Requests::produce(&topic, Requests::LIVE + n, 1, base).await;
            n += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        n
    })
}

/// api_latency runs with a filter too wide; version 2 (the filter fixed, a column added, the
/// last hour restated) rebuilds beside it and, once caught up, takes the job's view over while
/// requests keep arriving: the running version's workers stop by themselves (exit 0, naming
/// version 2), a kill -9 of version 2 at each step of the takeover is finished by its next
/// start, and a reader polling the job's view all along sees no key twice, never fewer
/// requests in the windows still arriving, and the windows before them as version 1 published
/// them, then as the new answer, and nothing else: before `restate_from` the windows version 1
/// published, from it on version 2's own. Version 1's tables, topics and group are gone, its file no longer runs,
/// and every request reaches the view through version 2.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_version_takes_the_view_over_atomically_across_kills() {
    let total = Requests::LIVE;
    let (job, mut v1, base) = version_1_counting(total).await;
    let topic = job.topic.clone();
    let view = format!("{}.api_latency", job.database);
    let view_v2 = format!("{}.api_latency__v2", job.database);

    let restate_from = base + 60 * MINUTE;
    let r = restate_from / 1000;
    // The windows from here on are the live stream's, produced all along from now.
    let live = (base + i64::try_from(total).unwrap() * Requests::EVERY_MS) / 1000;
    let settled = format!("toUInt32(window_start) < {live}");
    let columns: Vec<String> = clickhouse()
        .query(&format!(
            "SELECT name FROM system.columns WHERE database = '{}' AND table = 'api_latency'",
            job.database
        ))
        .fetch_all()
        .await
        .unwrap();
    let old_answer = view_state(&view, &columns, &settled).await.unwrap();
    let before_r = format!("toUInt32(window_start) < {r}");
    let old_before = view_state(&view, &columns, &before_r).await.unwrap();
    let v1_file = job.dir.path().join("v1.toml");
    std::fs::copy(&job.config, &v1_file).unwrap();
    write_version_2(&job, restate_from);
    job.set("job", "takeover", "auto");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = watch_view(view.clone(), columns.clone(), live, stop.clone());
    let stream = live_stream(topic.clone(), base, stop.clone());

    // Killed at each step of the takeover in turn: each start goes on from where the one
    // before stood (the registry's record, the read side's log, the kept table, the view).
    let before = job.log().len();
    for point in [
        "takeover_after_record",
        "takeover_after_fence",
        "takeover_after_claim",
        "takeover_after_copy",
        "takeover_after_install",
        "takeover_during_retire",
    ] {
        let mut v2 = job.spawn(&[("TALLY_FAULT", point)]);
        let status = wait_exit(&mut v2, Duration::from_secs(240));
        assert!(
            status.is_some_and(|s| !s.success())
                && job.log().contains(&format!("point=\"{point}\"")),
            "killed at {point}; log:\n{}",
            job.log()
        );
    }
    assert!(
        job.log()[before..].contains("caught up: taking the job's view over"),
        "log:\n{}",
        job.log()
    );
    // Version 1's workers stopped by themselves.
    let status = wait_exit(&mut v1, Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "version 1 exits 0; log:\n{}",
        job.log()
    );
    assert!(
        job.log()
            .contains("version 2 took over the job from version 1: this worker stops"),
        "log:\n{}",
        job.log()
    );
    let before = job.log().len();
    let mut v2 = job.spawn(&[]);
    job.wait_for_log(before, "version 1 is retired", Duration::from_secs(240))
        .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let produced = stream.await.unwrap();
    let seen = reader.await.unwrap();

    // Every request reaches the view: version 1's windows before restate_from (every
    // request), version 2's from it on (the answered ones, and the whole live stream).
    let from_hour = (360..total).filter(|&i| Requests::status(i) == 200).count() as u64;
    wait_for_requests(&job, &view, 360 + from_hour + produced as u64).await;
    let new_before = view_state(&view, &columns, &before_r).await.unwrap();
    assert_eq!(
        new_before, old_before,
        "the windows before restate_from are kept"
    );
    let with_column: Vec<String> = columns
        .iter()
        .cloned()
        .chain(["latency_min_ms".to_owned()])
        .collect();
    let from_r = format!("toUInt32(window_start) >= {r}");
    assert_eq!(
        view_state(&view, &with_column, &from_r).await.unwrap(),
        view_state(&view_v2, &with_column, &from_r).await.unwrap(),
        "from restate_from on, version 2's own answer"
    );
    let new_answer = view_state(&view, &columns, &settled).await.unwrap();
    assert_ne!(new_answer, old_answer);
    // The reader saw the old answer, then the new one: no gap, no key twice, no half.
    assert!(
        seen.polls > 100 && produced > 20,
        "{} polls, {produced} live requests",
        seen.polls
    );
    assert_eq!(
        (seen.settled, seen.violations),
        (vec![old_answer, new_answer], vec![]),
        "what the reader saw; log:\n{}",
        job.log()
    );
    // Version 1 is retired: its tables are gone, the registry names version 2, and its file
    // stops at once.
    assert_eq!(
        ch_count(&format!(
            "SELECT count() FROM system.tables WHERE database = '{}' AND name IN ('api_latency_data', 'api_latency_commits', 'api_latency_live')",
            job.database
        ))
        .await,
        0
    );
    let metadata = producer()
        .client()
        .fetch_metadata(None, Duration::from_secs(10))
        .unwrap();
    let topics: Vec<&str> = metadata.topics().iter().map(|t| t.name()).collect();
    let group = format!("tally-{topic}");
    for gone in [format!("{group}-changelog"), format!("{group}-lease")] {
        assert!(!topics.contains(&gone.as_str()), "{gone} deleted");
    }
    assert!(
        topics.contains(&format!("{group}-v2-changelog").as_str()),
        "version 2's changelog stays"
    );
    assert!(
        !job.log().contains("delete it by hand") && !job.log().contains("delete them by hand"),
        "version 1's group deleted; log:\n{}",
        job.log()
    );
    let mut old = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["run", "--config", v1_file.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut old, Duration::from_secs(60));
    let mut err = String::new();
    std::io::Read::read_to_string(old.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(
        status.is_some_and(|s| s.success()) && err.contains("version 2 took over the job"),
        "{err}"
    );
    sigterm(&v2);
    assert!(wait_exit(&mut v2, Duration::from_secs(60)).is_some_and(|s| s.success()));
    eprintln!("{}", job.log());
}

/// `clickhouse.retention` drops the kept windows' old days as it drops the folded table's: a
/// version that took over three days of history keeps, after the retention, only the days its
/// fold steps keep, in `_kept` and in the job's view.
#[tokio::test(flavor = "multi_thread")]
async fn retention_drops_the_kept_windows_old_days_too() {
    let topic = unique("api_latency");
    create_topic(&topic, 2).await;
    let job = Job::shipped("api_latency.toml", &topic);
    const DAY: i64 = 24 * 60 * MINUTE;
    let every = 10 * MINUTE;
    let total = 3 * 144;
    let base = two_hours_ago() - 3 * DAY + 2 * 60 * MINUTE + 10 * MINUTE;
    Requests::produce_every(&topic, 2, 0, total, base, every).await;
    let fold = [("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s")];
    let before = job.log().len();
    let mut v1 = job.spawn(&fold);
    job.wait_until_consuming(before).await;
    let (db, kept) = (
        &job.database,
        format!("{}.api_latency__v2_kept", job.database),
    );
    let view = format!("{db}.api_latency");
    wait_for_requests(&job, &view, total as u64).await;
    // Version 2 restates the last 12 hours and keeps the rest, then holds a day of it.
    let restate_from = (base + i64::try_from(total).unwrap() * every - 12 * 60 * MINUTE)
        / (60 * MINUTE)
        * (60 * MINUTE);
    write_version_2(&job, restate_from);
    job.set("job", "takeover", "auto");
    let before = job.log().len();
    let mut v2 = job.spawn(&[
        ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s"),
        ("TALLY_CLICKHOUSE__RETENTION", "1d"),
    ]);
    job.wait_for_log(before, "version 1 is retired", Duration::from_secs(240))
        .await;
    assert!(wait_exit(&mut v1, Duration::from_secs(60)).is_some_and(|s| s.success()));
    let oldest = |table: String| async move {
        ch_count(&format!(
            "SELECT toUInt64(min(toUInt32(window_start))) FROM {table}"
        ))
        .await
    };
    let frontier = ch_count(&format!(
        "SELECT toUInt64(max(frontier)) FROM {db}.api_latency__v2_folds"
    ))
    .await;
    // The retained days: those ending after the frontier less a day.
    let first_day = (frontier - 86_400) / 86_400 * 86_400;
    let until = Instant::now() + Duration::from_secs(60);
    while oldest(kept.clone()).await < first_day && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (kept_from, view_from) = (oldest(kept.clone()).await, oldest(view.clone()).await);
    assert!(
        kept_from >= first_day && view_from >= first_day,
        "kept from {kept_from}, view from {view_from}: nothing before {first_day}; log:\n{}",
        job.log()
    );
    let base_s = u64::try_from(base / 1000).unwrap();
    assert!(kept_from > base_s + 86_400, "the oldest days went");
    let kept_rows = ch_count(&format!("SELECT count() FROM {kept}")).await;
    assert!(kept_rows > 0, "the kept day within the retention stays");
    sigterm(&v2);
    assert!(wait_exit(&mut v2, Duration::from_secs(60)).is_some_and(|s| s.success()));
}
