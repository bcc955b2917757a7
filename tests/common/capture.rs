//! The chain from the source database for tests: a table of the local PostgreSQL captured by a
//! Debezium connector of the local Kafka Connect, each test's own (table, signal table,
//! replication slot, publication, connector and topic named after it), and removed when
//! dropped: a replication slot left behind would hold PostgreSQL's WAL for good.

use std::process::{Command, Stdio};
use std::time::Duration;

use super::{Job, unique, wait_until};

pub const CONNECT: &str = "http://127.0.0.1:8083";
pub const POSTGRES: &str = "postgres://tally@127.0.0.1:5432/tally";
pub const POSTGRES_PASSWORD: &str = "tally-secret";

pub struct Capture {
    /// Names the connector, slot, publication and topic prefix.
    pub name: String,
    pub table: String,
    pub signal_table: String,
    /// The topic Debezium writes the table's changes to.
    pub topic: String,
}

/// Runs `sql` with psql as tally: its output, or why it failed.
fn try_psql(sql: &str) -> Result<String, String> {
    let out = Command::new("psql")
        .args([
            "-X",
            "-q",
            "-t",
            "-A",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            "127.0.0.1",
        ])
        .args(["-U", "tally", "tally", "-c", sql])
        .env("PGPASSWORD", POSTGRES_PASSWORD)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Runs `sql` with psql as tally; panics naming the statement if it fails.
pub fn psql(sql: &str) -> String {
    try_psql(sql).unwrap_or_else(|e| panic!("psql {sql}: {e}"))
}

fn curl(args: &[&str]) -> (bool, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "30"])
        .args(args)
        .output()
        .expect("curl");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

impl Capture {
    pub fn new() -> Capture {
        let name = unique("cdc");
        Capture {
            table: format!("public.{name}"),
            signal_table: format!("public.{name}_signal"),
            topic: format!("{name}.public.{name}"),
            name,
        }
    }

    /// A second capture of this one's table (and signal table): a connector, slot,
    /// publication and topic of its own, whose first snapshot reads the table as it is now.
    pub fn beside(&self) -> Capture {
        let name = unique("cdc");
        Capture {
            topic: format!("{name}.{}", self.table),
            table: self.table.clone(),
            signal_table: self.signal_table.clone(),
            name,
        }
    }

    /// The shipped orders job, reading this capture's topic and table.
    pub fn job(&self) -> Job {
        let job = Job::shipped("orders.toml", &self.topic);
        job.set("source", "table", &self.table);
        job.set("source", "signal_table", &self.signal_table);
        job.set("source", "slot", &self.name);
        job.set("source", "connector", &self.name);
        job.set("source", "connect_url", CONNECT);
        job.set("source", "postgres", POSTGRES);
        job.set("source", "password", POSTGRES_PASSWORD);
        job
    }

    /// Registers the connector (`scripts/connect/orders-connector.json` with this capture's
    /// names and `overrides`) and waits until its task runs.
    pub async fn register(&self, overrides: &[(&str, &str)]) {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/connect/orders-connector.json"
        );
        let mut connector: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("connector file"))
                .expect("connector JSON");
        connector["name"] = self.name.clone().into();
        let config = connector["config"].as_object_mut().expect("config");
        for (k, v) in [
            ("topic.prefix", self.name.as_str()),
            ("slot.name", self.name.as_str()),
            ("publication.name", self.name.as_str()),
            ("table.include.list", self.table.as_str()),
            ("signal.data.collection", self.signal_table.as_str()),
            // Back within two seconds of a PostgreSQL restart.
            ("retriable.restart.connector.wait.ms", "2000"),
        ]
        .into_iter()
        .chain(overrides.iter().copied())
        {
            config.insert(k.into(), v.into());
        }
        let body = connector.to_string();
        let (ok, out) = curl(&[
            "-f",
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "--data",
            &body,
            &format!("{CONNECT}/connectors"),
        ]);
        assert!(ok, "registering connector {}: {out}", self.name);
        wait_until(Duration::from_secs(120), || self.running()).await;
        assert!(
            self.running(),
            "connector {} did not start: {}",
            self.name,
            self.status()
        );
    }

    /// Waits until the topic holds `n` records: with nothing changing the table meanwhile, the
    /// connector's first snapshot of a table of `n` rows. (A change made before the snapshot's
    /// consistent point shows in the topic as part of the snapshot, not as itself.)
    pub async fn wait_for_records(&self, n: i64) {
        let settings = tally_kafka::KafkaSettings {
            brokers: super::BROKERS.into(),
            client: std::collections::BTreeMap::new(),
        };
        let held = || {
            tally_kafka::topic_extent(&settings, &self.topic)
                .map(|e| e.values().map(|(_, high)| high).sum::<i64>())
                .unwrap_or(0)
        };
        wait_until(Duration::from_secs(120), || held() >= n).await;
        assert!(held() >= n, "{} of {n} records in {}", held(), self.topic);
    }

    pub fn status(&self) -> String {
        curl(&[&format!("{CONNECT}/connectors/{}/status", self.name)]).1
    }

    /// Waits (up to two minutes) until the connector and its task run, restarting a failed task
    /// as an operator would (Kafka Connect never does): a task starting while PostgreSQL shuts
    /// down fails for good ("the database system is shutting down"). Whether it runs.
    pub async fn revive(&self) -> bool {
        let until = std::time::Instant::now() + Duration::from_secs(120);
        while !self.running() && std::time::Instant::now() < until {
            if self.status().contains("FAILED") {
                let _ = curl(&[
                    "-X",
                    "POST",
                    &format!(
                        "{CONNECT}/connectors/{}/restart?includeTasks=true&onlyFailed=true",
                        self.name
                    ),
                ]);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        self.running()
    }

    /// The connector and its task run.
    pub fn running(&self) -> bool {
        let status: serde_json::Value = serde_json::from_str(&self.status()).unwrap_or_default();
        status["connector"]["state"] == "RUNNING"
            && status["tasks"]
                .as_array()
                .is_some_and(|t| !t.is_empty() && t.iter().all(|t| t["state"] == "RUNNING"))
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = curl(&[
            "-X",
            "DELETE",
            &format!("{CONNECT}/connectors/{}", self.name),
        ]);
        // The slot is dropped once the connector's task has let go of it.
        let slot = format!(
            "FROM pg_replication_slots WHERE slot_name = '{}'",
            self.name
        );
        for _ in 0..60 {
            let _ = try_psql(&format!(
                "SELECT pg_drop_replication_slot(slot_name) {slot} AND NOT active"
            ));
            if try_psql(&format!("SELECT count(*) {slot}")).is_ok_and(|n| n == "0") {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        let _ = try_psql(&format!(
            "DROP PUBLICATION IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}",
            self.name, self.table, self.signal_table
        ));
    }
}

/// `tally loadgen` of a change job: changes made through SQL on the capture's table, written
/// down in `manifest` (which several runs extend).
pub fn loadgen(job: &Job, manifest: &str, args: &[&str]) -> std::process::Child {
    Command::new(super::worker_binary())
        .args(["loadgen", "--config", job.config.to_str().unwrap()])
        .args([
            "--manifest",
            manifest,
            "--step-ms",
            "60000",
            "--customers",
            "30",
        ])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("loadgen")
}

/// Waits for a loadgen; its output, or a panic with it if it failed.
pub fn finish(child: std::process::Child) -> String {
    let out = child.wait_with_output().expect("loadgen ends");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "loadgen failed:\n{text}");
    text
}

/// The value of `name=` in a `verify-summary` line.
pub fn field(summary: &str, name: &str) -> u64 {
    summary
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {summary}"))
}

/// A table of `rows` rows captured from the start: the connector registered and its first
/// snapshot in the topic. The capture, the shipped orders job reading it, and the path of the
/// loadgen manifest that the rows began.
pub async fn captured_table(rows: u32) -> (Capture, Job, String) {
    let capture = Capture::new();
    let job = capture.job();
    let manifest = job.dir.path().join("changes.json");
    let manifest = manifest.to_str().expect("a UTF-8 path").to_owned();
    finish(loadgen(
        &job,
        &manifest,
        &["--events", "0", "--initial-rows", &rows.to_string()],
    ));
    capture.register(&[]).await;
    capture.wait_for_records(i64::from(rows)).await;
    (capture, job, manifest)
}

/// Runs `tally verify --manifest` until it passes (Debezium and tally caught up) or four minutes
/// went by: whether it passed, its report and its `verify-summary` line.
pub async fn verify_when_caught_up(job: &Job, manifest: &str) -> (bool, String, String) {
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let (ok, report) = loop {
        let (ok, report) = super::tally_command(job, "verify", &["--manifest", manifest]);
        if ok || std::time::Instant::now() > deadline {
            break (ok, report);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    let summary = report
        .lines()
        .find(|l| l.starts_with("verify-summary"))
        .unwrap_or_default()
        .to_owned();
    (ok, report, summary)
}

/// The last 40 lines of a log.
pub fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
