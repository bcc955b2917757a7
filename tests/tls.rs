//! Encrypted and authenticated connections against the local services: ClickHouse on its
//! `https_port` with a password, the broker on a SASL_SSL listener, both with certificates from a
//! CA that `scripts/services.sh` makes. A wrong CA or password stops the worker with an error
//! that names the connection and the cause.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;

const CLICKHOUSE_TLS: &str = "https://127.0.0.1:8443";
const CLICKHOUSE_USER: &str = "tally_secure";
const KAFKA_TLS: &str = "127.0.0.1:9094";
const SECRET: &str = "tally-secret";

/// The TLS material `scripts/services.sh up` made.
fn tls_file(name: &str) -> String {
    let dir = std::env::var_os("TALLY_SERVICES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.state/services"));
    let path = dir.join("tls").join(name);
    assert!(
        path.exists(),
        "{} is missing: scripts/services.sh up makes it",
        path.display()
    );
    path.display().to_string()
}

fn clickhouse_env(ca: &str, password: &str) -> Vec<(&'static str, String)> {
    vec![
        ("TALLY_CLICKHOUSE__URL", CLICKHOUSE_TLS.into()),
        ("TALLY_CLICKHOUSE__USER", CLICKHOUSE_USER.into()),
        ("TALLY_CLICKHOUSE__PASSWORD", password.into()),
        ("TALLY_CLICKHOUSE__CA_FILE", tls_file(ca)),
    ]
}

fn kafka_env(ca: &str, password: &str) -> Vec<(&'static str, String)> {
    vec![
        ("TALLY_KAFKA__BROKERS", KAFKA_TLS.into()),
        ("TALLY_KAFKA__CLIENT__SECURITY_PROTOCOL", "sasl_ssl".into()),
        ("TALLY_KAFKA__CLIENT__SASL_MECHANISM", "PLAIN".into()),
        ("TALLY_KAFKA__CLIENT__SASL_USERNAME", "tally".into()),
        ("TALLY_KAFKA__CLIENT__SASL_PASSWORD", password.into()),
        ("TALLY_KAFKA__CLIENT__SSL_CA_LOCATION", tls_file(ca)),
    ]
}

fn spawn(job: &Job, env: &[(&'static str, String)]) -> Worker {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    job.spawn(&env)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_and_doctor_run_over_tls_and_passwords_on_both_services() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 23, 2_000).await;
    let job = Job::new(&topic, "");
    let mut env = clickhouse_env("ca.pem", SECRET);
    env.extend(kafka_env("ca.pem", SECRET));
    let mut worker = spawn(&job, &env);
    let view = wait_for_view(&job, &manifest, Duration::from_secs(90)).await;
    sigterm(&worker);
    let status = wait_exit(&mut worker, Duration::from_secs(60));
    let log = job.log();
    assert_view_eq(&view, &manifest.rows, &log);
    assert!(
        status.is_some_and(|s| s.success()),
        "exit {status:?}; log:\n{log}"
    );
    assert!(
        log.contains(CLICKHOUSE_TLS),
        "the log names the https url:\n{log}"
    );
    let dead = read_dead_letters(&job.dlq_topic());
    assert_eq!(sorted(dead), sorted(expected_dead_letters(&manifest)));

    // `doctor` reaches both services the same way.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["doctor", "--config"])
        .arg(&job.config)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "doctor over TLS failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs a worker that must refuse to start; returns its log.
async fn refused(env: Vec<(&'static str, String)>) -> String {
    let topic = unique("orders");
    create_topic(&topic, 1).await;
    let job = Job::new(&topic, "");
    let mut worker = spawn(&job, &env);
    let status = wait_exit(&mut worker, Duration::from_secs(90));
    let log = job.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "a worker that cannot connect must stop with an error, got {status:?}; log:\n{log}"
    );
    log
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_ca_or_password_for_clickhouse_stops_the_worker_naming_the_cause() {
    let log = refused(clickhouse_env("other-ca.pem", SECRET)).await;
    assert!(
        log.contains(CLICKHOUSE_TLS) && log.contains("TLS handshake failed"),
        "{log}"
    );
    assert!(log.to_lowercase().contains("issuer"), "{log}");

    let log = refused(clickhouse_env("ca.pem", "not-the-password")).await;
    assert!(
        log.contains(CLICKHOUSE_TLS)
            && log.contains(CLICKHOUSE_USER)
            && log.contains("authentication failed"),
        "{log}"
    );
    assert!(
        !log.contains("not-the-password"),
        "the password leaked:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_ca_or_password_for_kafka_stops_the_worker_naming_the_cause() {
    let log = refused(kafka_env("other-ca.pem", SECRET)).await;
    assert!(
        log.contains(KAFKA_TLS) && log.contains("sasl_ssl") && log.contains("cannot connect"),
        "{log}"
    );
    assert!(log.contains("certificate verify failed"), "{log}");

    let log = refused(kafka_env("ca.pem", "not-the-password")).await;
    assert!(
        log.contains(KAFKA_TLS) && log.contains("user tally") && log.contains("cannot connect"),
        "{log}"
    );
    assert!(log.contains("Authentication failed"), "{log}");
    assert!(
        !log.contains("not-the-password"),
        "the password leaked:\n{log}"
    );
}
