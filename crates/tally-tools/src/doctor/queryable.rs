//! `doctor`'s Written → Queryable row: on each replica, the view shows each key once and
//! exactly what the commit log committed, and publishing and folding keep up; on a cluster,
//! each replica's published cut against the newest, the one behind named with how far.

use std::time::Duration;

use anyhow::Result;
use tally_clickhouse::{ClickHouseSink, CommittedBatch, Cut};

use super::{Row, Status, declared_view, describe_read_side, row};
use tally_runtime::config::Config;

pub(super) const HOP: &str = "Written → Queryable";
const INVARIANT: &str =
    "no key twice, the view = what the commit log committed, publishing and folding keep up";

/// The row, from `sink` (the first replica) alone or from every replica of a cluster.
pub(super) async fn written_to_queryable(
    config: &Config,
    sink: &ClickHouseSink,
    committed_events: u64,
    committed_revenue: String,
    partitions: usize,
) -> Result<Row> {
    let replicas = config.replica_settings();
    if replicas.len() < 2 {
        let (status, evidence) = replica_row(
            config,
            sink,
            committed_events,
            committed_revenue,
            partitions,
        )
        .await?;
        return Ok(row(HOP, INVARIANT, status, evidence));
    }
    let mut status = Status::Pass;
    let mut evidence = Vec::new();
    let mut cuts = Vec::new();
    for settings in &replicas {
        let checked = async {
            let replica = ClickHouseSink::connect(settings).await?;
            let (s, e) = replica_row(
                config,
                &replica,
                committed_events,
                committed_revenue.clone(),
                partitions,
            )
            .await?;
            let cut = replica
                .published()
                .await?
                .map(|p| p.cut)
                .unwrap_or_default();
            anyhow::Ok((s, e, cut))
        };
        match tokio::time::timeout(Duration::from_secs(60), checked).await {
            Ok(Ok((s, e, cut))) => {
                status = status.max(s);
                evidence.push(format!("{}: {e}", settings.url));
                cuts.push((settings.url.clone(), cut));
            }
            Ok(Err(e)) => {
                status = Status::Fail;
                evidence.push(format!("{}: {e:#}", settings.url));
            }
            Err(_) => {
                status = Status::Fail;
                evidence.push(format!(
                    "{}: no answer in 60 s (readers there keep its last answer)",
                    settings.url
                ));
            }
        }
    }
    let batches = sink.committed_batches().await?;
    let lags: Vec<String> = cuts
        .iter()
        .filter_map(|(url, cut)| {
            let behind = batches_beyond(&batches, cut);
            (behind > 0).then(|| format!("{url} is {behind} batches behind the commit log"))
        })
        .collect();
    evidence.push(if lags.is_empty() {
        "every replica publishes the same cut".to_owned()
    } else {
        lags.join(", ")
    });
    Ok(row(HOP, INVARIANT, status, evidence.join("; ")))
}

/// Committed batches that end past `cut` on some partition: those a replica publishing `cut`
/// does not show yet.
fn batches_beyond(batches: &[CommittedBatch], cut: &Cut) -> usize {
    batches
        .iter()
        .filter(|b| {
            b.partitions
                .iter()
                .zip(&b.to_offsets)
                .any(|(p, o)| cut.0.get(p).is_none_or(|c| o > c))
        })
        .count()
}

/// The row's status and evidence on one server.
async fn replica_row(
    config: &Config,
    sink: &ClickHouseSink,
    committed_events: u64,
    committed_revenue: String,
    partitions: usize,
) -> Result<(Status, String)> {
    // Written → Queryable: the view shows each key once, and exactly what was committed.
    let unpublished_after = config.job.session_timeout.as_duration() + Duration::from_secs(30);
    let compare_totals = config.clickhouse.retention.is_none();
    let shown = declared_view(
        config,
        sink,
        unpublished_after,
        compare_totals,
        (committed_events, committed_revenue),
    )
    .await?;
    let frontier = sink.frontier().await?;
    let mut problems = Vec::new();
    let foldable = sink
        .foldable_frontier(config.fold_rules(), partitions)
        .await
        .unwrap_or_else(|e| {
            problems.push(format!("the committed watermarks cannot be read: {e}"));
            None
        });
    problems.extend(shown.problems);
    let (live_rows, live_points) = sink.live_points().await?;
    if live_points > 1 {
        problems.push(format!(
            "the published answer {} holds rows of {live_points} snapshots among its {live_rows}: a row no publish wrote",
            sink.names().view_q()
        ));
    }
    let read_side = describe_read_side(sink).await;
    if shown.unpublished > 0 {
        problems.push(format!(
            "{} batches committed more than {}s ago are not published: nothing publishes ({read_side})",
            shown.unpublished,
            unpublished_after.as_secs()
        ));
    }
    // How much of what is final is still read from versions.
    let oldest = sink.oldest_unfolded_window().await?;
    let behind = match (foldable, oldest) {
        (Some(f), Some(o)) => (i64::from(f) - i64::from(o.max(frontier.seconds))).max(0),
        _ => 0,
    };
    let allowed = 3 * config.clickhouse.fold_interval.0 / 1000 + config.window.size.0 / 1000;
    // Behind is no fault while fold steps happen: a backlog read at once makes many windows
    // final together, and a holder that just claimed the read side folds at its interval.
    let idle = sink.fold_idle_seconds().await?;
    let folding_late = config.clickhouse.fold_interval.0 > 0
        && behind > allowed
        && idle.is_none_or(|s| i64::from(s) > allowed);
    Ok((
        if !problems.is_empty() {
            Status::Fail
        } else if folding_late || !compare_totals {
            Status::Warn
        } else {
            Status::Pass
        },
        if problems.is_empty() {
            format!(
                "{}; {read_side}; {} s of final windows not folded yet{}",
                shown.summary,
                behind,
                match (folding_late, idle) {
                    (true, Some(s)) => format!(
                        " (more than {allowed} s, and no fold step for {s} s: is folding failing?)"
                    ),
                    (true, None) => format!(" (more than {allowed} s, and no fold step ever)"),
                    (false, Some(s)) if behind > 0 => format!(" (the last fold step {s} s ago)"),
                    _ => String::new(),
                }
            )
        } else {
            problems.join("; ")
        },
    ))
}
