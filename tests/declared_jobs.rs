//! Jobs by declaration against the real services: a deployment whose job file named its fields
//! in `[fields]` switches to the declared revenue_agg (`config/revenue_agg.toml`'s
//! `[aggregation]`) on the same state directory, changelog and tables, after a kill -9, and
//! continues exactly once with the records produced since: it resumes from its checkpoint and
//! reprocesses nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::*;
use tally::loadgen::Manifest;

/// The `[aggregation]` section of the shipped job file, as it is written.
fn shipped_declaration() -> String {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/revenue_agg.toml"
    ))
    .unwrap();
    let at = text
        .find("\n[aggregation]")
        .expect("an [aggregation] section");
    text[at..].to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_named_by_fields_continues_under_its_declaration_exactly_once() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    let records = generate(34, 2, 20_000);
    let (first, second) = records.split_at(10_000);
    let mut manifest = Manifest::default();
    produce_into(&topic, first, &mut manifest).await;
    let job = Job::new(&topic, "");
    let before_fields = std::fs::read_to_string(&job.config).unwrap();
    assert!(!before_fields.contains("[aggregation]"));

    // The deployment as it ran before, with the built-in field names: it catches up with the
    // first half and is killed.
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_view_eq(&view, &manifest.rows, &job.log());
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let committed_before = ch_count(&format!(
        "SELECT count() FROM {}.{}_commits",
        job.database, job.table
    ))
    .await;
    assert!(committed_before >= 1);
    let consumed_before: u64 = {
        let store =
            tally_state::StateStore::open(&job.state_dir(), &format!("{}@{}", job.name, job.topic))
                .unwrap();
        let meta = store.meta().expect("a checkpoint");
        meta.partitions.values().map(|c| c.totals.consumed).sum()
    };
    assert_eq!(consumed_before, manifest.produced);
    produce_into(&topic, second, &mut manifest).await;

    // The same job, its fields now declared.
    std::fs::write(
        &job.config,
        format!("{before_fields}\n{}", shipped_declaration()),
    )
    .unwrap();
    let before = job.log().len();
    let mut worker = job.spawn(&[]);
    job.wait_until_consuming(before).await;
    let restarted = job.log()[before..].to_owned();
    assert!(
        restarted.contains("resuming partition from checkpoint"),
        "resumed, not recomputed:\n{restarted}"
    );
    let view = wait_for_view(&job, &manifest, Duration::from_secs(120)).await;
    assert_stops_exact(&job, &mut worker, &view, &manifest);
    // Every offset consumed exactly once across the two job files: nothing reprocessed.
    assert_eq!(assert_accounting(&job, manifest.produced), 2);
}
