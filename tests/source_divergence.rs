//! The backstop sees the last hour: `reconcile --source` compares every window, open ones too,
//! where the table and the view stand at one point, so a divergence fails within a round
//! whatever the window's age (`window.allowed_lateness` is 6 h in the shipped orders job).
//! Against the real chain (PostgreSQL → Debezium → Kafka → tally → ClickHouse): a change job
//! caught up under load, tally killed with SIGKILL meanwhile and `reconcile --source --every`
//! polling all along (every round OK); then the table changed behind the connector's back,
//! rows updated while the table is out of the connector's publication and then a `TRUNCATE`
//! (which the connector skips by default): `reconcile --source` exits 1 naming the windows,
//! `doctor` FAILs the Queryable → Reported row, and the gauge of `--every` shows it; the time
//! from each divergence to the gauge is printed. And a connector that does emit truncates: the
//! job stops at it, saying what happened and what to do, and commits nothing past it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::{Duration, Instant};

use common::capture::{captured_table, finish, loadgen, psql, tail, verify_when_caught_up};
use common::*;

/// `tally_reconcile_keys_mismatched` and `tally_reconcile_runs_total` at `address`.
fn gauges(address: &str) -> Option<(f64, f64)> {
    let out = std::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "5",
            &format!("http://{address}/metrics"),
        ])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((
        value("tally_reconcile_keys_mismatched")?,
        value("tally_reconcile_runs_total")?,
    ))
}

/// Waits until the gauge shows windows that differ, in a round that started after `since`:
/// how long after `since`.
async fn until_the_gauge_fires(address: &str, since: Instant) -> Duration {
    let runs_before = gauges(address).map_or(0.0, |g| g.1);
    let deadline = since + Duration::from_secs(180);
    loop {
        if let Some((mismatched, runs)) = gauges(address)
            && mismatched > 0.0
            && runs > runs_before
        {
            return since.elapsed();
        }
        assert!(
            Instant::now() < deadline,
            "the gauge never showed the divergence"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_divergence_of_open_windows_fails_within_a_round() {
    let (capture, job, manifest) = captured_table(500).await;
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;

    // reconcile --source --every, from its own copy of the job file with a metrics address.
    let address = "127.0.0.1:19481";
    let every_config = job.dir.path().join("every.toml");
    std::fs::copy(&job.config, &every_config).unwrap();
    {
        let text = std::fs::read_to_string(&every_config).unwrap();
        let mut doc: toml::Table = toml::from_str(&text).unwrap();
        doc["metrics"]
            .as_table_mut()
            .unwrap()
            .insert("address".into(), address.into());
        std::fs::write(&every_config, toml::to_string(&doc).unwrap()).unwrap();
    }
    let rounds_path = job.dir.path().join("rounds.out");
    let _reconciler = Worker(
        std::process::Command::new(worker_binary())
            .args(["reconcile", "--config", every_config.to_str().unwrap()])
            .args(["--source", "--every", "1s", "--wait", "30s"])
            .stdout(std::fs::File::create(&rounds_path).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );

    // Changes under load, tally killed with SIGKILL in the middle and started again.
    let load = loadgen(&job, &manifest, &["--events", "3000", "--rate", "150"]);
    tokio::time::sleep(Duration::from_secs(6)).await;
    let committed = job.log().len();
    job.wait_for_log(committed, "checkpoint committed", Duration::from_secs(60))
        .await;
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let load = tokio::task::spawn_blocking(move || finish(load))
        .await
        .unwrap();
    println!("{load}");
    let (ok, report, _) = verify_when_caught_up(&job, &manifest).await;
    assert!(ok, "verify:\n{report}\nlog tail:\n{}", tail(&job.log()));

    // Every round so far compared open windows at one point, and none failed.
    let rounds = std::fs::read_to_string(&rounds_path).unwrap();
    let verdicts: Vec<&str> = rounds
        .lines()
        .filter(|l| l.starts_with("reconcile --source:"))
        .collect();
    assert!(verdicts.len() >= 5, "rounds under load:\n{rounds}");
    assert!(
        verdicts.iter().all(|v| !v.contains("FAILED")),
        "no false alarm while changes flow:\n{rounds}"
    );
    assert!(
        verdicts.iter().filter(|v| v.contains(": OK")).count() >= 5,
        "{rounds}"
    );
    let compared_open = rounds
        .lines()
        .filter(|l| l.starts_with("windows open (at the same point)"))
        .count();
    assert!(compared_open >= 5, "open windows compared:\n{rounds}");
    println!(
        "{} rounds under load and a kill -9, all OK; the last:\n{}",
        verdicts.len(),
        rounds
            .lines()
            .rev()
            .take(6)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Rows the job leaves out count nowhere in the table's SQL either: an empty status (absent
    // to the job: filtered) and an empty customer (missing: dead-lettered).
    let table = &capture.table;
    psql(&format!(
        "INSERT INTO {table} (order_id, customer_id, amount, status, created_at) \
         SELECT max(order_id) + 1000000, 'customer-x', 1.00, '', now() FROM {table}; \
         INSERT INTO {table} (order_id, customer_id, amount, status, created_at) \
         SELECT max(order_id) + 1, '', 2.00, 'new', now() FROM {table}"
    ));
    let until = Instant::now() + Duration::from_secs(90);
    let (mut ok, mut text) = (false, String::new());
    while !ok && Instant::now() < until {
        (ok, text) = tally_command(&job, "reconcile", &["--source"]);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(ok && text.contains("OK: every window"), "{text}");

    // 1. Rows updated while the table is out of the connector's publication: no change event.
    let name = table.trim_start_matches("public.");
    let changed: Vec<String> = psql(&format!(
        "SELECT DISTINCT customer_id FROM {table} WHERE status NOT IN ('cancelled', '') AND customer_id <> '' ORDER BY 1 LIMIT 3"
    ))
    .lines()
    .map(str::to_owned)
    .collect();
    assert_eq!(changed.len(), 3);
    let since = Instant::now();
    psql(&format!(
        "ALTER PUBLICATION {name} DROP TABLE {table}; \
         UPDATE {table} SET amount = amount + 1 WHERE customer_id IN ('{}'); \
         ALTER PUBLICATION {name} ADD TABLE {table}",
        changed.join("','")
    ));
    let fired = until_the_gauge_fires(address, since).await;
    println!("rows changed behind the connector: the gauge showed it after {fired:?}");
    let (ok, text) = tally_command(&job, "reconcile", &["--source"]);
    println!("{text}");
    assert!(!ok, "{text}");
    assert!(text.contains("FAILED"), "{text}");
    for customer in &changed {
        assert!(text.contains(customer.as_str()), "{customer} named: {text}");
    }
    let (ok, report) = doctor(&job);
    println!("{report}");
    assert!(!ok, "{report}");
    assert!(
        report.lines().any(|l| l.contains("Queryable → Reported")
            && l.contains("FAIL")
            && l.contains("source table")),
        "{report}"
    );

    // 2. The table emptied by TRUNCATE, which the connector skips by default.
    let since = Instant::now();
    psql(&format!("TRUNCATE {table}"));
    let fired = until_the_gauge_fires(address, since).await;
    println!("TRUNCATE: the gauge showed it after {fired:?}");
    let (ok, text) = tally_command(&job, "reconcile", &["--source"]);
    println!("{text}");
    assert!(!ok && text.contains("FAILED"), "{text}");
    let open = text
        .lines()
        .find(|l| l.starts_with("windows open (at the same point)"))
        .unwrap_or_else(|| panic!("open windows compared: {text}"));
    assert!(open.contains("/ 0 "), "the table holds no record: {open}");
    let (ok, report) = doctor(&job);
    assert!(!ok, "{report}");
    sigterm(&worker);
    wait_exit(&mut worker, Duration::from_secs(60));
}

/// A connector that emits truncates (`skipped.operations` without `t`): the job stops at the
/// truncate, saying what happened and what to do, and commits nothing past it; started again,
/// it stops there again.
#[tokio::test(flavor = "multi_thread")]
async fn a_truncate_the_connector_emits_stops_the_job() {
    let capture = common::capture::Capture::new();
    let job = capture.job();
    let manifest = job.dir.path().join("changes.json");
    let manifest = manifest.to_str().unwrap().to_owned();
    finish(loadgen(
        &job,
        &manifest,
        &["--events", "0", "--initial-rows", "200"],
    ));
    capture.register(&[("skipped.operations", "none")]).await;
    capture.wait_for_records(200).await;
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let (ok, report, _) = verify_when_caught_up(&job, &manifest).await;
    assert!(ok, "{report}");

    psql(&format!("TRUNCATE {}", capture.table));
    let status = wait_exit(&mut worker.0, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("the job stops at the truncate: {}", tail(&job.log())));
    assert!(!status.success());
    let log = job.log();
    assert!(
        log.contains("the source table was truncated") && log.contains("rebuild the job"),
        "{}",
        tail(&log)
    );
    // Nothing past it: the view still shows every row, the commit log ends before it.
    let (ok, text) = tally_command(&job, "reconcile", &[]);
    assert!(ok, "the view equals the topic up to the truncate: {text}");
    let before = job.log().len();
    let mut again = job.spawn(&[]);
    let status = wait_exit(&mut again.0, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("stops again: {}", tail(&job.log())));
    assert!(!status.success());
    assert!(job.log()[before..].contains("the source table was truncated"));
}
