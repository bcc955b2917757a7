//! A test's job: its file, database and topic of its own, and the `tally run` processes that
//! run it.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{BROKERS, CLICKHOUSE, unique};

pub struct Job {
    /// The job's name, unique per test job: a name is a job's identity on the cluster.
    pub name: String,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub topic: String,
    pub database: String,
    pub table: String,
}

impl Job {
    pub fn new(topic: &str, extra: &str) -> Job {
        let dir = tempfile::tempdir().expect("tempdir");
        let database = unique("tally_it");
        let name = unique("it");
        let table = "revenue_agg".to_string();
        let config = dir.path().join("job.toml");
        let text = format!(
            r#"
[job]
name = "{name}"
state_dir = "{state}"
checkpoint_interval = "1s"
max_record_bytes = 4096
{extra}
[kafka]
brokers = "{BROKERS}"
source_topic = "{topic}"
consumer_group = "tally-{topic}"
[clickhouse]
url = "{CLICKHOUSE}"
database = "{database}"
table = "{table}"
request_timeout = "10s"
[metrics]
address = ""
"#,
            state = dir.path().join("state").display()
        );
        std::fs::write(&config, text).expect("write config");
        Job {
            name,
            dir,
            config,
            topic: topic.into(),
            database,
            table,
        }
    }

    /// A job running a shipped job file (`config/<file>`) as it is written, but for the names
    /// that make it the test's own (job, topic, group, database, state directory) and the
    /// test's services; checkpoints every second, folds every two, no metrics endpoint.
    pub fn shipped(file: &str, topic: &str) -> Job {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = format!("{}/../../config/{file}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).expect("shipped job file");
        let mut doc: toml::Table = toml::from_str(&text).expect("TOML");
        let database = unique("tally_it");
        let name = unique("it");
        let mut set = |section: &str, key: &str, value: String| {
            doc.entry(section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .expect("a section")
                .insert(key.into(), toml::Value::String(value));
        };
        set("job", "name", name.clone());
        set(
            "job",
            "state_dir",
            dir.path().join("state").display().to_string(),
        );
        set("job", "checkpoint_interval", "1s".into());
        set("kafka", "brokers", BROKERS.into());
        set("kafka", "source_topic", topic.into());
        set("kafka", "consumer_group", format!("tally-{topic}"));
        set("clickhouse", "url", CLICKHOUSE.into());
        set("clickhouse", "database", database.clone());
        // Fold while the test runs: a fold must never freeze a window that can still change.
        set("clickhouse", "fold_interval", "2s".into());
        set("metrics", "address", String::new());
        let table = doc["clickhouse"]["table"]
            .as_str()
            .expect("clickhouse.table")
            .to_owned();
        let config = dir.path().join("job.toml");
        std::fs::write(&config, toml::to_string(&doc).expect("TOML")).expect("write config");
        Job {
            name,
            dir,
            config,
            topic: topic.into(),
            database,
            table,
        }
    }

    /// Another worker of the same job (same config, topic and tables) with its own state
    /// directory and log: how a `replicas: N` deployment runs it.
    pub fn replica(&self) -> Job {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = std::fs::read_to_string(&self.config)
            .expect("read config")
            .replace(
                &self.state_dir().display().to_string(),
                &dir.path().join("state").display().to_string(),
            );
        let config = dir.path().join("job.toml");
        std::fs::write(&config, text).expect("write config");
        Job {
            name: self.name.clone(),
            dir,
            config,
            topic: self.topic.clone(),
            database: self.database.clone(),
            table: self.table.clone(),
        }
    }

    pub fn spawn(&self, env: &[(&str, &str)]) -> Worker {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("tally.log"))
            .expect("log file");
        let mut cmd = Command::new(worker_binary());
        cmd.arg("run")
            .arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Worker(cmd.spawn().expect("spawn tally"))
    }

    /// Waits until the worker started by the last `spawn` logs that it is consuming, so that a
    /// SIGTERM reaches its handler rather than a process still starting up.
    pub async fn wait_until_consuming(&self, log_len_before_spawn: usize) {
        let until = Instant::now() + Duration::from_secs(60);
        while Instant::now() < until {
            let log = self.log();
            let new = log.get(log_len_before_spawn..).unwrap_or("");
            if new.contains("resuming partition from checkpoint")
                || new.contains("partition has no checkpoint")
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("worker did not start consuming; log:\n{}", self.log());
    }

    /// Waits until the log has grown past `from` with a line containing `needle`.
    pub async fn wait_for_log(&self, from: usize, needle: &str, timeout: Duration) {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if self.log().get(from..).unwrap_or("").contains(needle) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "no {needle:?} in the log within {timeout:?}:\n{}",
            self.log()
        );
    }

    /// Sets `section.key` of the job file to the string `value`.
    pub fn set(&self, section: &str, key: &str, value: &str) {
        let text = std::fs::read_to_string(&self.config).expect("job file");
        let mut doc: toml::Table = toml::from_str(&text).expect("TOML");
        doc.entry(section)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .expect("a section")
            .insert(key.into(), toml::Value::String(value.into()));
        std::fs::write(&self.config, toml::to_string(&doc).expect("TOML")).expect("write config");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("tally.log")).unwrap_or_default()
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn dlq_topic(&self) -> String {
        format!("{}.dlq", self.topic)
    }
}

/// The `tally` that `Job::spawn` runs: this build's, or the one `TALLY_TEST_WORKER_BIN` names
/// (to show a test failing on an earlier build).
pub fn worker_binary() -> PathBuf {
    std::env::var_os("TALLY_TEST_WORKER_BIN")
        .map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tally")), PathBuf::from)
}

/// A `tally run` process that is SIGKILLed when dropped, so a test that fails (panics) leaves
/// no worker behind: std's `Child` does not kill on drop. Derefs to the `Child`.
pub struct Worker(pub Child);

impl std::ops::Deref for Worker {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Worker {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}
