//! Folding end to end: final windows end up as one row each, the versions they replace are
//! dropped, a reader polling the view during folding never sees a window twice, vanish or
//! shrink, and retention drops whole old days.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// Runs the job to the end of `manifest`, with a fold step every second, while `tally probe`
/// polls the view. Steps are bounded to a few hundred versions, so that a backlog folds in
/// many steps. Returns the probe's output.
async fn run_with_reader(job: &Job, manifest: &common::Manifest) -> String {
    let before = job.log().len();
    let mut worker = job.spawn(&[
        ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s"),
        ("TALLY_CLICKHOUSE__FOLD_STEP_ROWS", "300"),
    ]);
    job.wait_until_consuming(before).await;
    let reader = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["probe", "--config", job.config.to_str().unwrap()])
        .args(["--interval", "50ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let view = wait_for_view(job, manifest, Duration::from_secs(120)).await;
    // More fold steps once everything is in, past the reader margin, so that the versions
    // replaced by the last fold get dropped.
    tokio::time::sleep(tally_clickhouse::READER_MARGIN + Duration::from_secs(3)).await;
    sigterm(&worker);
    assert!(
        wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()),
        "clean stop; log:\n{}",
        job.log()
    );
    sigterm(&reader);
    let out = reader.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the reader saw an inconsistent view: {text}"
    );
    assert_view_eq(&view, &manifest.rows, &job.log());
    assert!(
        !job.log().contains("fold step failed"),
        "every fold step succeeds; log:\n{}",
        job.log()
    );
    text
}

#[tokio::test(flavor = "multi_thread")]
async fn final_windows_fold_to_one_row_and_readers_never_see_a_fold_half_done() {
    let topic = unique("orders");
    create_topic(&topic, 2).await;
    // One event per second and partition for 40 minutes of event time.
    let mut manifest = common::Manifest {
        source_topic: topic.clone(),
        ..Default::default()
    };
    let records = generate_spaced(21, 2, 4_800, 1_000);
    // In three parts, so that the reader sees folding happen between batches of input.
    let job = Job::new(&topic, "");
    produce_into(&topic, &records[..1_600], &mut manifest).await;
    let reader_out = run_with_reader(&job, &manifest).await;
    assert!(reader_out.contains("probe-summary"), "{reader_out}");
    produce_into(&topic, &records[1_600..], &mut manifest).await;
    let reader_out = run_with_reader(&job, &manifest).await;
    let reads: u64 = reader_out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("reads="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(reads > 10, "the reader polled during the run: {reader_out}");
    assert_folded(&job).await;

    let (db, t) = (&job.database, &job.table);
    let frontier = ch_count(&format!(
        "SELECT toUInt64(max(frontier)) FROM {db}.{t}_folds"
    ))
    .await;
    // With steps of about 300 versions the backlog folds a share of a partition at a time
    // (8 steps here; 2 without the bound).
    let steps = ch_count(&format!(
        "SELECT count() FROM {db}.{t}_folds WHERE folded_rows > 0"
    ))
    .await;
    assert!(steps >= 5, "the backlog folds in bounded steps: {steps}");
    let answer_rows = manifest.rows.len() as u64;
    let folded = ch_count(&format!("SELECT count() FROM {db}.{t}_final")).await;
    let expected_folded = manifest
        .rows
        .keys()
        .filter(|(w, _, _)| (*w / 1000) < frontier as i64)
        .count() as u64;
    assert_eq!(
        folded, expected_folded,
        "every window before the frontier is folded exactly once"
    );
    // Versions of folded windows are gone, but for the 10-minute partition the frontier is in.
    let stale = ch_count(&format!(
        "SELECT count() FROM {db}.{t}_data WHERE toUInt32(window_start) < {}",
        frontier - frontier % 600
    ))
    .await;
    assert_eq!(stale, 0, "replaced versions were dropped");
    let versions = ch_count(&format!("SELECT count() FROM {db}.{t}_data")).await;
    assert!(
        folded + versions < 3 * answer_rows,
        "storage is near the answer: {folded} folded + {versions} versions for {answer_rows} rows"
    );

    let ok = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["reconcile", "--config", job.config.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{text}");
    assert!(text.contains("every ratio is 1"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_drops_folded_days_older_than_it() {
    let topic = unique("orders");
    create_topic(&topic, 1).await;
    // One event every 90 s for 3 days.
    let manifest = produce_spaced(&topic, 1, 5, 2_900, 90_000).await;
    let job = Job::new(&topic, "");
    let before = job.log().len();
    let mut worker = job.spawn(&[
        ("TALLY_CLICKHOUSE__FOLD_INTERVAL", "1s"),
        ("TALLY_CLICKHOUSE__RETENTION", "1d"),
    ]);
    job.wait_until_consuming(before).await;
    let (db, t) = (&job.database, &job.table);
    let until = std::time::Instant::now() + Duration::from_secs(90);
    let mut days = 0;
    while std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1)).await;
        days = ch_count(&format!(
            "SELECT uniqExact(toYYYYMMDD(window_start)) FROM {db}.{t}_final"
        ))
        .await;
        let folds = ch_count(&format!("SELECT count() FROM {db}.{t}_folds")).await;
        if folds >= 1 && days <= 2 && days > 0 {
            break;
        }
    }
    sigterm(&worker);
    assert!(wait_exit(&mut worker, Duration::from_secs(30)).is_some_and(|s| s.success()));
    let frontier = ch_count(&format!(
        "SELECT toUInt64(max(frontier)) FROM {db}.{t}_folds"
    ))
    .await;
    let oldest = ch_count(&format!(
        "SELECT toUInt64(min(window_start)) FROM {db}.{t}_final"
    ))
    .await;
    assert!(days > 0 && days <= 2, "only recent days are kept: {days}");
    assert!(
        oldest + 2 * 86_400 > frontier,
        "nothing older than the retention's day: oldest {oldest}, frontier {frontier}"
    );
    // The view shows exactly the retained windows.
    let view = view(db, t).await.unwrap();
    let cutoff_day_start = (oldest / 86_400) * 86_400;
    let expected: std::collections::BTreeMap<_, _> = manifest
        .rows
        .iter()
        .filter(|((w, _, _), _)| (*w / 1000) as u64 >= cutoff_day_start)
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    assert_view_eq(&view, &expected, &job.log());
}
