//! A worker of a shared job stopped (SIGTERM) and Kafka gone while it leaves the group: it
//! exits once it can, and a restart gives the exact answer. librdkafka's close could hang for good in the rebalance
//! callback here (librdkafka #4041), which the chaos run found. Alone in its file because it stops
//! the shared broker.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_stopped_while_kafka_is_down_exits_and_loses_nothing() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let manifest = produce_generated(&topic, 2, 29, 2_000).await;
    let job = Job::new(&topic, "tasks = 2\nsession_timeout = \"6s\"");
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    wait_for_view(&job, &manifest, Duration::from_secs(90)).await;

    // The broker goes away while the worker closes its group member: after its tasks stopped.
    let stopping = job.log().len();
    sigterm(&worker);
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while !job.log()[stopping..].contains("stopping") && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    services(&["down", "kafka"]);
    std::thread::sleep(Duration::from_secs(3));
    services(&["up", "kafka"]);
    let status = wait_exit(&mut worker, Duration::from_secs(120));
    assert!(
        status.is_some(),
        "the worker did not exit after SIGTERM with Kafka down and back:\n{}",
        job.log()
    );

    // Nothing was lost or counted twice: a restart catches up to the same answer.
    let mut again = job.spawn(&[]);
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_view_eq(&view, &manifest.rows, &job.log());
    sigterm(&again);
    let status = wait_exit(&mut again, Duration::from_secs(60));
    assert!(
        status.is_some_and(|s| s.success()),
        "the restarted worker did not exit 0 at SIGTERM ({status:?}):\n{}",
        job.log()
    );
}
