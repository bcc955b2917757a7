//! A job on three Kafka brokers (`scripts/services.sh up --cluster`: KRaft, replication factor 3,
//! `min.insync.replicas` 2): every topic tally creates gets the cluster's replication, `doctor`'s
//! Produced → Accepted row PASSes with its evidence, WARNs with a broker killed (ISR still at
//! min ISR) and FAILs naming each partition below it with a second broker stopped, while the job
//! waits; the brokers back, the job resumes by itself and the view is exact. Ignored by a plain
//! `cargo test` (the single-node set runs then); the test command runs it on the cluster set with
//! `--ignored`. Alone in its file: it kills shared brokers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::{Duration, Instant};

use common::*;

const CLUSTER_BROKERS: &str = "127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094";

fn settings() -> tally_kafka::KafkaSettings {
    tally_kafka::KafkaSettings {
        brokers: CLUSTER_BROKERS.into(),
        client: std::collections::BTreeMap::new(),
    }
}

/// Polls `doctor` until its Produced → Accepted row has `status` (or four minutes pass).
async fn doctor_until(job: &Job, status: &str) -> String {
    let until = Instant::now() + Duration::from_secs(240);
    loop {
        let (_, report) = doctor(job);
        if status_of(&report, "Produced → Accepted") == status || Instant::now() > until {
            return report;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs the cluster set: scripts/services.sh up --cluster"]
async fn a_job_on_three_brokers_waits_out_broker_losses_and_stays_exact() {
    let topic = unique("orders");
    create_topic(&topic, 4).await;
    let records = generate(41, 4, 6_000);
    let mut manifest = Manifest {
        source_topic: topic.clone(),
        ..Manifest::default()
    };
    produce_into(&topic, &records[..3_000], &mut manifest).await;
    let job = Job::new(&topic, "");
    // The view is read through the helpers' single address; tally gets every broker.
    job.set("kafka", "brokers", CLUSTER_BROKERS);
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    // A cluster just started loads its transaction and offsets topics (RF 3) on the first use.
    let view = wait_for_view(&job, &manifest, Duration::from_secs(240)).await;
    assert_view_eq(&view, &manifest.rows, &job.log());

    // Every topic tally created has the cluster's replication.
    let config = tally_runtime::config::Config::load(&job.config).unwrap();
    for t in [
        topic.clone(),
        config.dlq_topic(),
        config.changelog_topic(),
        config.registry_topic(),
    ] {
        let d = tally_kafka::topic_durability(&settings(), &t)
            .await
            .unwrap();
        assert_eq!(
            (d.brokers, d.replication_factor, d.min_insync_replicas),
            (3, 3, Some(2)),
            "{t}"
        );
        assert!(d.partitions.iter().all(|p| p.in_sync == 3), "{t}: {d:?}");
    }
    let report = doctor_until(&job, "PASS").await;
    println!("{report}");
    assert_eq!(
        status_of(&report, "Produced → Accepted"),
        "PASS",
        "{report}"
    );
    assert!(
        report.contains(&format!(
            "{topic}: replication factor 3, min.insync.replicas 2, in sync p0=3/3"
        )),
        "{report}"
    );

    // A broker killed: the job goes on (two replicas in sync, the min ISR), doctor WARNs.
    let committed = job.log().len();
    let killed = Instant::now();
    kill_9_service("kafka-3");
    produce_into(&topic, &records[3_000..4_500], &mut manifest).await;
    job.wait_for_log(committed, "checkpoint committed", Duration::from_secs(120))
        .await;
    println!(
        "kafka-3 killed: the next epoch committed {:?} later",
        killed.elapsed()
    );
    let report = doctor_until(&job, "WARN").await;
    println!("{report}");
    assert_eq!(
        status_of(&report, "Produced → Accepted"),
        "WARN",
        "{report}"
    );
    assert!(report.contains("out of sync"), "{report}");

    // A second broker stopped: below the min ISR, writes are refused; doctor FAILs naming the
    // partitions, the job waits.
    services(&["down", "kafka-2"]);
    let report = doctor_until(&job, "FAIL").await;
    println!("{report}");
    assert_eq!(
        status_of(&report, "Produced → Accepted"),
        "FAIL",
        "{report}"
    );
    assert!(
        report.contains("below min.insync.replicas 2") && report.contains("partition"),
        "{report}"
    );
    assert!(worker.0.try_wait().unwrap().is_none(), "the job waits");

    // Both back: the job resumes by itself and the view is exact.
    services(&["up", "kafka-2", "kafka-3"]);
    let back = Instant::now();
    produce_into(&topic, &records[4_500..], &mut manifest).await;
    let view = wait_for_view(&job, &manifest, Duration::from_secs(180)).await;
    println!(
        "both brokers back: the view exact {:?} later",
        back.elapsed()
    );
    assert_stops_exact(&job, &mut worker.0, &view, &manifest);
    assert_eq!(
        status_of(&doctor_until(&job, "PASS").await, "Produced → Accepted"),
        "PASS"
    );
}
