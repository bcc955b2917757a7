//! The schema registry stopped in the middle of an Avro stream, against the real services
//! (alone in its file: it stops the shared registry). Records whose writer schema the worker has
//! cached go on being processed and committed; a partition reaching a schema id the worker has
//! not fetched waits (paused, its records on the broker), and so does every partition of a
//! worker restarted by kill -9 with nothing cached; no record is dead-lettered for the outage.
//! When the registry is back, everything is consumed and `verify` is exact.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// The records consumed by the checkpoints committed in `log`.
fn consumed(log: &str) -> u64 {
    log.lines()
        // A recovered epoch was consumed by the worker before.
        .filter(|l| l.contains("checkpoint committed") && !l.contains("recovered=true"))
        .filter_map(|l| {
            l.split("consumed=")
                .nth(1)?
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

/// Restarts the registry if the test fails while it is down.
struct RegistryBack;

impl Drop for RegistryBack {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../scripts/services.sh"
            ))
            .args(["up", "registry"])
            .stdout(Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_outage_stalls_no_partition_whose_schemas_are_cached() {
    let topic = unique("payments_outage");
    create_topic(&topic, 2).await;
    let job = Job::shipped("payments.toml", &topic);
    let manifest_path = job.dir.path().join("manifest.json");
    let manifest = manifest_path.to_str().unwrap().to_owned();

    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    // 24,000 records at 1,000/s: the second schema from the 8,000th (8 s in), the third from
    // the 16,000th.
    let loadgen = Command::new(worker_binary())
        .args(["loadgen", "--config", job.config.to_str().unwrap()])
        .args(["--events", "24000", "--rate", "1000", "--partitions", "2"])
        .args(["--seed", "11", "--customers", "40", "--duplicates", "0.05"])
        .args(["--poison", "0.02", "--late", "0.01", "--filtered", "0.1"])
        .args(["--step-ms", "100", "--manifest", &manifest])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    // Every id of the stream's first part cached: the first schema, the two schemas of its
    // poison (a field of another type, a time as text), and the registry's answer that its
    // unknown id is unknown.
    wait_until(Duration::from_secs(60), || {
        job.log().matches("fetched a writer schema").count() >= 4
    })
    .await;
    assert!(
        job.log()
            .contains("schema_id=2147480000 attempts=1 known=false")
    );
    job.wait_for_log(0, "checkpoint committed", Duration::from_secs(60))
        .await;

    // The registry goes down while the stream is still on its first schema, which the worker
    // has cached: records go on being processed and committed.
    let _back = RegistryBack;
    services(&["down", "registry"]);
    let down_at = job.log().len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = consumed(&job.log()[down_at..]);
    println!("records of cached schemas committed in the outage's first 3 s: {during}");
    assert!(
        during > 1_000,
        "records of cached schemas were committed during the outage: {during}\n{}",
        job.log()
    );
    assert!(
        started.elapsed() < Duration::from_secs(7),
        "the stream reached its second schema before the check ran; the machine is too slow for this test's timing"
    );
    // Then the stream reaches its second schema, which no worker has fetched: its partitions
    // wait, and nothing is dead-lettered for it.
    job.wait_for_log(
        down_at,
        "waits for a writer schema",
        Duration::from_secs(30),
    )
    .await;

    // A worker killed and restarted during the outage has nothing cached: it waits too.
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let restarted_at = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(restarted_at).await;
    job.wait_for_log(
        restarted_at,
        "waits for a writer schema",
        Duration::from_secs(30),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Only a record without a schema id (poison: not the wire format) can pass a waiting
    // partition's head.
    let while_waiting = consumed(&job.log()[restarted_at..]);
    println!(
        "records committed by the restarted worker while the registry was down: {while_waiting}"
    );
    assert!(
        while_waiting < 20,
        "with nothing cached and the registry down, the partitions wait: {while_waiting} consumed\n{}",
        job.log()
    );
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker waits, it does not stop"
    );

    services(&["up", "registry"]);
    let out = loadgen.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = verify_exact_then_stop(&job, &mut worker.0, &manifest).await;
    println!("payments through a registry outage and a kill -9: {line}");
    let m = tally_tools::loadgen::Manifest::load(&manifest_path).unwrap();
    assert_eq!(assert_accounting(&job, m.produced), 2);
    assert_fates(&job, &m);
    assert!(
        job.log()
            .contains("the writer schema arrived; the partition goes on"),
        "{}",
        job.log()
    );
}
