//! What an operator relies on: `/health` and `/ready` on the metrics address of a running worker,
//! and a refusal, naming the key, when tally's topics cannot be as durable as configured.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;

fn get(addr: &str, path: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: tally\r\n\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

#[tokio::test(flavor = "multi_thread")]
async fn health_ready_and_metrics_are_served() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 17, 1_000).await;
    let job = Job::new(&topic, "");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
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
