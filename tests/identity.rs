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

/// A declared job run again with its declaration changed (its filter's status range narrowed) is
/// refused before it reads anything, naming the declaration and the way to migrate: a new job.
#[tokio::test(flavor = "multi_thread")]
async fn a_changed_declaration_is_refused_with_the_way_to_migrate() {
    let topic = unique("api_latency");
    create_topic(&topic, 2).await;
    let job = Job::shipped("api_latency.toml", &topic);
    let manifest = job.dir.path().join("m.json");
    let (ok, out) = tally_command(
        &job,
        "loadgen",
        &[
            "--events",
            "600",
            "--partitions",
            "2",
            "--manifest",
            manifest.to_str().unwrap(),
        ],
    );
    assert!(ok, "{out}");
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
