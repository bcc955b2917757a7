//! ClickHouse stops mid-run and comes back: the worker waits without consuming (bounded
//! memory, no crash loop) and the results are still exact. Alone in its file because it stops the
//! shared server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| tally_runtime::memory::status_kib(&s, "VmRSS:").ok())
        .map_or(0, |kib| kib as u64)
}

#[tokio::test(flavor = "multi_thread")]
async fn clickhouse_down_for_a_while_then_back_is_still_exact() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(21, 2, 23_000);
    let mut manifest = common::Manifest::default();
    produce_into(&topic, &records[..3_000], &mut manifest).await;
    let job = Job::new(&topic, "");
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    wait_for_first_batch(&job).await;
    services(&["down", "clickhouse"]);
    assert!(
        view(&job.database, &job.table).await.is_err(),
        "ClickHouse still answers after `services.sh down clickhouse`: it was not started by this checkout's scripts/services.sh, so this test cannot stop it"
    );
    // In three bursts a few barriers apart: one epoch stuck at the sink, one more pre-committed
    // behind it, and records of a third the operator cannot cut (the pipeline is full).
    for (from, to) in [(3_000, 10_000), (10_000, 16_000), (16_000, 23_000)] {
        produce_into(&topic, &records[from..to], &mut manifest).await;
        tokio::time::sleep(Duration::from_millis(2_500)).await;
    }
    let mut peak = 0;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            worker.try_wait().unwrap().is_none(),
            "worker must wait, not exit; log:\n{}",
            job.log()
        );
        peak = peak.max(rss_kib(worker.id()));
    }
    assert!(
        peak > 0 && peak < 400 * 1024,
        "RSS while ClickHouse is down: {peak} KiB"
    );
    // By now the epochs in flight are at their limit and the operator waits at a barrier: a
    // SIGTERM still stops it, leaving epochs pre-committed for the next start.
    sigterm(&worker);
    assert!(
        wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()),
        "a stop during the outage, with the pipeline full; log:\n{}",
        job.log()
    );
    assert!(
        job.log().contains("stopping with epochs pre-committed"),
        "log:\n{}",
        job.log()
    );
    services(&["up", "clickhouse"]);
    let mut worker = job.spawn(&[]);
    let found = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    sigterm(&worker);
    assert!(
        wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()),
        "log:\n{}",
        job.log()
    );
    assert_view_eq(&found, &manifest.rows, &job.log());
    assert_eq!(
        sorted(read_dead_letters(&job.dlq_topic())),
        expected_dead_letters(&manifest)
    );
    let log = job.log();
    assert!(
        log.contains("sink write failed; retrying"),
        "the outage was seen and retried"
    );
    // Retries back off: far fewer attempts than a tight loop would make in 15 s.
    let retries = log.matches("sink write failed; retrying").count();
    assert!(retries < 40, "{retries} retries");
}
