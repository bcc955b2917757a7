//! A job has one identity: a worker whose rules differ from its job's, and a job that would
//! share a consumer group, changelog topic or table with another, stop at start with an error
//! naming what clashes (real Kafka and ClickHouse).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;

/// Starts `job` with `env` and returns (exit success, its log) once it exited, or panics if it
/// keeps running past 60 s.
fn run_to_exit(job: &Job, env: &[(&str, &str)]) -> (bool, String) {
    let before = job.log().len();
    let mut worker = job.spawn(env);
    let status = wait_exit(&mut worker, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("the worker kept running; log:\n{}", job.log()));
    (status.success(), job.log()[before..].to_owned())
}

/// The last line a refused worker printed: its `error:` line.
fn error_line(log: &str) -> String {
    log.lines()
        .rev()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no error line; log:\n{log}"))
        .to_owned()
}

/// Runs `job` until it has committed once and stops it cleanly.
async fn run_once(job: &Job) {
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    wait_for_first_batch(job).await;
    sigterm(&worker);
    assert!(
        wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()),
        "clean stop; log:\n{}",
        job.log()
    );
}

/// Another job on `job`'s topic: its own name, `group`, table (in `database`, or its own) and
/// the `extra` lines of its `[kafka]` section.
fn another_job(job: &Job, name: &str, group: &str, database: Option<&str>, extra: &str) -> Job {
    let mut other = Job::new(&job.topic, "");
    let mut text = std::fs::read_to_string(&other.config)
        .unwrap()
        .replace(
            &format!("name = \"{}\"", other.name),
            &format!("name = \"{name}\""),
        )
        .replace(
            &format!("consumer_group = \"tally-{}\"", job.topic),
            &format!("consumer_group = \"{group}\"\n{extra}"),
        );
    other.name = name.to_owned();
    if let Some(database) = database {
        text = text.replace(&other.database, database);
        other.database = database.to_owned();
    }
    std::fs::write(&other.config, text).unwrap();
    other
}

fn name_of(job: &Job) -> String {
    std::fs::read_to_string(&job.config)
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("name = \"")
                .map(|n| n.trim_end_matches('"').to_owned())
        })
        .unwrap()
}

/// Two jobs made by `make(base, name, shared)` on one topic, sharing the resource `shared`
/// (fresh each round): the one started first records itself, the other is refused naming it
/// and `named(shared)`; then again with the order of start reversed.
async fn refused_in_either_order(
    make: impl Fn(&Job, &str, &str) -> Job,
    named: impl Fn(&str) -> String,
) {
    for reversed in [false, true] {
        let topic = unique("orders");
        create_topic(&topic, 2).await;
        produce_generated(&topic, 2, 43, 300).await;
        let base = Job::new(&topic, "");
        let shared = unique("shared");
        let named = named(&shared);
        let (a, b) = (
            make(&base, &unique("job_a"), &shared),
            make(&base, &unique("job_b"), &shared),
        );
        let (first, second) = if reversed { (&b, &a) } else { (&a, &b) };
        run_once(first).await;
        let (ok, log) = run_to_exit(second, &[]);
        assert!(!ok, "the second job is refused; log:\n{log}");
        let error = error_line(&log);
        eprintln!("{error}");
        assert!(error.contains(&named), "{error}");
        assert!(
            error.contains(&name_of(first)),
            "names the other job: {error}"
        );
        // The first job is not disturbed by the refused one.
        run_once(first).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_whose_rules_differ_from_its_job_s_is_refused_naming_each_one() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    produce_generated(&topic, 2, 41, 500).await;
    let job = Job::new(&topic, "");
    run_once(&job).await;
    // A rolling change of the window and the task count: both named, with both values.
    let (ok, log) = run_to_exit(
        &job,
        &[("TALLY_WINDOW__SIZE", "30s"), ("TALLY_JOB__TASKS", "2")],
    );
    assert!(!ok, "refused; log:\n{log}");
    let error = error_line(&log);
    eprintln!("{error}");
    assert!(
        error.contains(r#"window.size: the job has "60000ms", this worker "30000ms""#),
        "{error}"
    );
    assert!(
        error.contains(r#"job.tasks: the job has "1", this worker "2""#),
        "{error}"
    );
    assert!(
        error.contains("tally retire"),
        "says how to change rules: {error}"
    );
    // The job's own configuration still runs.
    run_once(&job).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_jobs_in_one_consumer_group_are_refused_in_either_order() {
    refused_in_either_order(
        |base, name, group| another_job(base, name, group, None, ""),
        |group| format!("kafka.consumer_group {group:?} belongs to job"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_jobs_on_one_changelog_topic_are_refused_in_either_order() {
    refused_in_either_order(
        |base, name, changelog| {
            another_job(
                base,
                name,
                &unique("group"),
                None,
                &format!("changelog_topic = \"{changelog}\""),
            )
        },
        |changelog| format!("kafka.changelog_topic {changelog:?} belongs to job"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_jobs_writing_one_table_are_refused_in_either_order_even_without_a_shared_registry() {
    // Own groups, and registries of their own (as on two Kafka clusters): only the table is
    // shared, and ClickHouse's record of the job that writes it refuses the other.
    refused_in_either_order(
        |base, name, database| {
            another_job(
                base,
                name,
                &unique("group"),
                Some(database),
                &format!("registry_topic = \"{}\"", unique("registry")),
            )
        },
        |_| "two jobs cannot write one table".to_owned(),
    )
    .await;
}

/// The shipped api_latency job on a topic of its own, with `events` records of loadgen's in it.
async fn api_latency_with_records(events: u32) -> Job {
    let topic = unique("api_latency");
    create_topic(&topic, 2).await;
    let job = Job::shipped("api_latency.toml", &topic);
    let manifest = job.dir.path().join("m.json");
    let events = events.to_string();
    let args = ["--events", &events, "--partitions", "2", "--manifest"];
    let mut args = args.to_vec();
    args.push(manifest.to_str().unwrap());
    let (ok, out) = tally_command(&job, "loadgen", &args);
    assert!(ok, "{out}");
    job
}

/// A declared job run again with its declaration changed (its filter's status range narrowed) is
/// refused before it reads anything, naming the declaration and the way to migrate: a new job.
#[tokio::test(flavor = "multi_thread")]
async fn a_changed_declaration_is_refused_with_the_way_to_migrate() {
    let job = api_latency_with_records(600).await;
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_for_log(before, "checkpoint committed", Duration::from_secs(60))
        .await;
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));

    let text = std::fs::read_to_string(&job.config).unwrap();
    assert!(text.contains("max = 599"), "{text}");
    write_file(&job.config, &text.replace("max = 599", "max = 499"));
    let (ok, log) = run_to_exit(&job, &[]);
    assert!(!ok, "refused; log:\n{log}");
    let error = error_line(&log);
    eprintln!("{error}");
    assert!(error.contains("aggregation: the job has"), "{error}");
    assert!(
        error.contains("100 <= status <= 599"),
        "the old filter: {error}"
    );
    assert!(
        error.contains("100 <= status <= 499"),
        "the new filter: {error}"
    );
    assert!(
        error.contains("run the new rules as a new job") && error.contains("tally retire"),
        "says how to migrate: {error}"
    );
}

/// A new version of a running job (`job.version = 2`, its filter narrowed and a column added):
/// `check-config` reads the running version from the registry, the view and the source and
/// names what changes; it refuses a version not above the running one and a `restate_from` the
/// source no longer reaches, naming the key and what the topic holds; the running version is
/// untouched. (`tests/restate.rs` runs a new version.)
#[tokio::test(flavor = "multi_thread")]
async fn a_new_version_is_compared_with_the_running_one_and_refused_where_it_cannot_restate() {
    let job = api_latency_with_records(400).await;
    run_once(&job).await;

    let v1 = std::fs::read_to_string(&job.config).unwrap();
    let v2 = v1.replace("max = 599", "max = 499")
        + "\n[[aggregation.aggregate]]\ncolumn = \"latency_min_ms\"\nfunction = \"min\"\nfield = \"latency\"\n";
    write_file(&job.config, &v2);
    let version = |v: &'static str| [("TALLY_JOB__VERSION", v)];
    let check_config = |env: &[(&str, &str)]| tally_command_with(&job, "check-config", &[], env);

    let (ok, out) = check_config(&version("2"));
    eprintln!("{out}");
    assert!(ok, "{out}");
    assert!(
        out.contains("version 2 changes the running version 1"),
        "{out}"
    );
    assert!(
        out.contains("rule aggregation:"),
        "the declaration's lines: {out}"
    );
    assert!(
        out.contains("100 <= status <= 499"),
        "the new filter: {out}"
    );
    assert!(
        out.contains("the view gains column latency_min_ms"),
        "{out}"
    );
    assert!(
        out.contains("rebuilds every window from the whole topic"),
        "{out}"
    );

    // restate_from before what the topic holds: refused, naming the key and the partitions.
    let (ok, out) = check_config(&[
        ("TALLY_JOB__VERSION", "2"),
        ("TALLY_JOB__RESTATE_FROM", "2001-01-01T00:00:00Z"),
    ]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("job.restate_from: the source no longer holds"),
        "{out}"
    );
    assert!(
        out.contains("partition 0 from") && out.contains("partition 1 from"),
        "{out}"
    );
    // From now on the topic reaches back far enough.
    let (ok, out) = check_config(&[
        ("TALLY_JOB__VERSION", "2"),
        ("TALLY_JOB__RESTATE_FROM", "2100-01-01T00:00:00Z"),
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("restates windows from 2100-01-01T00:00:00.000Z on"),
        "{out}"
    );

    // A new version must be above the running one; restate_from needs a new version.
    let (ok, out) = check_config(&version("0"));
    assert!(
        !ok && out.contains("job.version: must be 1 or more"),
        "{out}"
    );
    let (ok, out) = check_config(&[("TALLY_JOB__RESTATE_FROM", "2100-01-01T00:00:00Z")]);
    assert!(
        !ok && out.contains("job.restate_from: only a new version"),
        "{out}"
    );

    write_file(&job.config, &v1);
    run_once(&job).await;
}
