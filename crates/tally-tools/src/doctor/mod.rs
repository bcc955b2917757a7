//! `tally doctor`: one row per hop of Produced → Accepted → Persisted → Processed → Written →
//! Queryable → Reported, each with the invariant, the evidence checked and PASS, WARN or FAIL.

mod queryable;
mod replication;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;
use serde::Serialize;
use tally_clickhouse::ClickHouseSink;

use crate::prove::{self, ReconcileFilter};
use replication::replication_verdict;
use tally_runtime::config::Config;
use tally_runtime::settings::JobSettings;

/// Every fate a consumed record can have (a change job's `stale` and `tombstones` are 0 for
/// jobs of events), and the offsets they add up to.
const PROCESSED_INVARIANT: &str = "consumed = aggregated + duplicates + late + dead-lettered + filtered + stale + tombstones, and = next offset − first offset";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Pass,
    Warn,
    Fail,
}

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub hop: &'static str,
    pub invariant: &'static str,
    pub evidence: String,
    pub status: Status,
}

fn row(hop: &'static str, invariant: &'static str, status: Status, evidence: String) -> Row {
    Row {
        hop,
        invariant,
        evidence,
        status,
    }
}

/// Where each partition's committed input ends and starts, from the commit log.
fn committed_ranges(batches: &[tally_clickhouse::CommittedBatch]) -> BTreeMap<i32, (i64, i64)> {
    let mut ranges: BTreeMap<i32, (i64, i64)> = BTreeMap::new();
    for b in batches {
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            let e = ranges.entry(*p).or_insert((*from, *to));
            e.0 = e.0.min(*from);
            e.1 = e.1.max(*to);
        }
    }
    ranges
}

/// Which version's view the report reads, when the job has more than one: this version
/// rebuilding beside the one that holds the job, or one rebuilding beside this.
async fn versions_said(settings: &tally_runtime::settings::JobSettings) -> Option<String> {
    let versions = tally_runtime::identity::versions(&settings.identity)
        .await
        .inspect_err(|e| tracing::debug!(error = %e, "could not read the registry of jobs"))
        .ok()??;
    let mine = settings.version;
    let (db, view, own) = (
        &settings.sink.database,
        &settings.view,
        &settings.sink.table,
    );
    match versions.rebuilding {
        Some(n) if n == mine && versions.taking_over => Some(format!(
            "version {mine} is taking the job's view {db}.{view} over from version {}: this is its own view {db}.{own}",
            versions.holds()
        )),
        Some(n) if n == mine => Some(format!(
            "version {mine} rebuilds beside version {}: this is its own view {db}.{own}; the job's view {db}.{view} is version {}'s",
            versions.holds(),
            versions.holds()
        )),
        Some(n) if versions.holds() == mine => Some(format!(
            "the job's view {db}.{view} is this version's ({mine}); version {n} rebuilds beside it in tables of its own"
        )),
        _ => None,
    }
}

/// Checks every hop of the deployment `config` describes; `since` bounds the reconciliation.
pub async fn diagnose(config: &Config, since: Duration) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let settings = std::sync::Arc::new(config.resolve()?);
    let kafka = config.kafka_settings();
    let topic = &config.kafka.source_topic;
    tally_kafka::check_connection(&kafka, Duration::from_secs(10))?;
    let sink = ClickHouseSink::connect(&config.sink_settings()).await?;
    let batches = sink.committed_batches().await?;
    let ranges = committed_ranges(&batches);

    // Recomputed from the source first: Produced → Accepted reports its duplicates too. The
    // period is the job's event time (its newest watermark), not the wall clock: a job
    // catching up, or replaying old events, still has windows to compare.
    let accounting = sink.batch_accounting().await?;
    let newest_watermark = accounting
        .iter()
        .flat_map(|b| b.watermarks.iter().copied())
        .filter(|w| *w != i64::MIN)
        .max();
    let since_ms = i64::try_from(since.as_millis()).unwrap_or(i64::MAX);
    let period = match newest_watermark {
        Some(w) => format!(
            "windows from {} on (the last {}s of event time, before the job's watermark {})",
            tally_core::time::format_ms(w.saturating_sub(since_ms)),
            since.as_secs(),
            tally_core::time::format_ms(w)
        ),
        None => "no window (the job has no watermark: nothing committed yet)".to_owned(),
    };
    let filter = ReconcileFilter {
        from_ms: Some(newest_watermark.map_or(i64::MAX, |w| w.saturating_sub(since_ms))),
        to_ms: None,
        customer: None,
    };
    // A view that cannot be read back (a key twice) is a FAIL row, not the end of the report.
    let reconciled = prove::reconcile(config, &filter, false).await;
    let source_duplicates = reconciled
        .as_ref()
        .map_or_else(|_| "?".to_owned(), |r| r.source_duplicates.to_string());
    let changes = config.declared.changes.is_some();
    // A change job's source table: the capture into the topic, and the table itself.
    let with_source = changes && config.source.postgres.is_some();
    if with_source {
        let committed_lsn = accounting.iter().map(|b| b.source_lsn).max().unwrap_or(0);
        rows.push(match crate::database::capture::check(config, committed_lsn).await {
            Ok(c) => row(
                "Produced → Accepted",
                "every change the source commits is captured into the topic (the slot keeps the WAL from its confirmed position; the connector runs)",
                if c.fail {
                    Status::Fail
                } else if c.warn {
                    Status::Warn
                } else {
                    Status::Pass
                },
                c.evidence,
            ),
            Err(e) => row(
                "Produced → Accepted",
                "every change the source commits is captured into the topic (the slot keeps the WAL from its confirmed position; the connector runs)",
                Status::Fail,
                format!("the source could not be read: {e:#}"),
            ),
        });
    }
    // Produced → Accepted: can the cluster lose a record it acknowledged? Every topic the job
    // uses, partition by partition: its replicas, those in sync, the topic's min ISR.
    let durability = tally_kafka::topic_durability(&kafka, topic).await?;
    let mut topics = vec![(topic.clone(), durability.clone())];
    for other in [
        config.dlq_topic(),
        config.changelog_topic(),
        config.registry_topic(),
    ] {
        if tally_kafka::topic_extent(&kafka, &other).is_ok_and(|e| !e.is_empty()) {
            topics.push((
                other.clone(),
                tally_kafka::topic_durability(&kafka, &other).await?,
            ));
        }
    }
    let replicated = replication_verdict(&topics);
    rows.push(row(
        "Produced → Accepted",
        "an acknowledged record survives the loss of a broker",
        replicated.status,
        replicated.evidence + &if changes {
            format!(
                "; {source_duplicates} committed changes repeat a position already applied to their row (sent again by the connector; tally counts them, never applies them twice)"
            )
        } else {
            format!(
                "; {source_duplicates} committed records repeat an event id seen before (re-sent by a producer; tally counts and drops them)"
            )
        },
    ));

    // Accepted → Persisted: is every record still on the broker when tally reads it?
    let extent = tally_kafka::topic_extent(&kafka, topic)?;
    let mut deleted = Vec::new();
    let mut lag = Vec::new();
    for (p, (low, high)) in &extent {
        let next = ranges.get(p).map_or(*low, |r| r.1);
        if next < *low {
            deleted.push(format!(
                "partition {p}: next offset {next} < earliest on broker {low}"
            ));
        }
        lag.push(format!("p{p}={}", (high - next).max(0)));
    }
    rows.push(row(
        "Accepted → Persisted",
        "retention never deletes a record before tally has read it",
        if deleted.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        if deleted.is_empty() {
            format!(
                "retention.ms {}; every partition's next offset is on the broker; lag {}",
                durability.retention_ms.unwrap_or(-1),
                lag.join(" ")
            )
        } else {
            format!(
                "records lost before tally read them: {}",
                deleted.join("; ")
            )
        },
    ));

    // Persisted → Processed: the checkpoint accounts for every offset consumed, once, and one
    // writer (state directory) commits the job.
    let committed = {
        let reader = tally_kafka::SourceConsumer::connect(
            &kafka,
            &settings.source.source_topic,
            &settings.source.consumer_group,
        )?;
        tally_runtime::marks::committed_offsets(&reader, &settings, &settings.whole())?
    };
    let marks: BTreeMap<i32, tally_kafka::CommitMark> = committed
        .iter()
        .map(|(p, (_, m))| (*p, m.clone()))
        .collect();
    let writers: std::collections::BTreeSet<&str> =
        marks.values().filter_map(|m| m.writer.as_deref()).collect();
    let whole = settings.whole();
    rows.push(match tally_state::StateStore::open(&whole.state_dir, &whole.state_identity) {
        Ok(store) => match store.meta() {
            None if !writers.is_empty() => row(
                "Persisted → Processed",
                PROCESSED_INVARIANT,
                Status::Warn,
                format!(
                    "no checkpoint in {}, and writer(s) {writers:?} commit the job: a standby's directory (it restores the job from the changelog when it takes over), or not the job's",
                    whole.state_dir.display()
                ),
            ),
            None => row(
                "Persisted → Processed",
                PROCESSED_INVARIANT,
                Status::Warn,
                format!("no checkpoint in {}", whole.state_dir.display()),
            ),
            Some(meta) => {
                let mut broken = Vec::new();
                // A standby's copy of the job's state: restored from the changelog and kept
                // near the job's by its catch-ups; never committed by its own writer.
                let adopted = store.adopted_writer().ok().flatten();
                let replica = adopted.is_some() && !writers.contains(store.writer_id());
                match tally_runtime::marks::foreign_mark(&marks, &store) {
                    Ok(None) => {}
                    Ok(Some(_)) if replica => {}
                    Ok(Some((p, mark))) => broken.push(format!(
                        "partition {p} was last committed (epoch {}) by writer {}, not by this state directory (writer {}) or the one it was restored from: another worker runs the job, and this directory is behind it",
                        mark.epoch,
                        mark.writer.unwrap_or_default(),
                        store.writer_id()
                    )),
                    Err(e) => broken.push(e.to_string()),
                }
                // The group's offsets are the checkpoint's, once the checkpoint's epoch committed.
                for (p, (offset, mark)) in &committed {
                    if mark.epoch == meta.epoch
                        && meta.status == tally_state::EpochStatus::Committed
                        && mark.writer.as_deref() == Some(store.writer_id())
                        && let Some(c) = meta.partitions.get(p)
                        && c.next_offset != *offset
                    {
                        broken.push(format!(
                            "partition {p}: the group committed offset {offset} at epoch {}, the checkpoint of that epoch says {}",
                            mark.epoch, c.next_offset
                        ));
                    }
                }
                for (p, c) in &meta.partitions {
                    let first = ranges.get(p).map_or(c.next_offset, |r| r.0);
                    if !c.totals.balances() {
                        broken.push(format!("partition {p} does not balance: {:?}", c.totals));
                    } else if c.totals.consumed as i64 != c.next_offset - first {
                        broken.push(format!(
                            "partition {p}: consumed {} but offsets {first}..{}",
                            c.totals.consumed, c.next_offset
                        ));
                    }
                }
                let job_epoch = marks.values().map(|m| m.epoch).max().unwrap_or(meta.epoch);
                row(
                    "Persisted → Processed",
                    PROCESSED_INVARIANT,
                    match (broken.is_empty(), replica) {
                        (false, _) => Status::Fail,
                        (true, true) => Status::Warn,
                        (true, false) => Status::Pass,
                    },
                    if broken.is_empty() && replica {
                        format!(
                            "a standby's directory: a copy of the job's state at epoch {} (the job is at epoch {job_epoch}), restored from the changelog of writer {}; {} partitions balance; it takes the job over from there",
                            meta.epoch,
                            adopted.map(|(w, _)| w).unwrap_or_default(),
                            meta.partitions.len(),
                        )
                    } else if broken.is_empty() {
                        format!(
                            "checkpoint epoch {}: {} partitions balance; committed by this state directory's writer {}",
                            meta.epoch,
                            meta.partitions.len(),
                            store.writer_id()
                        )
                    } else {
                        broken.join("; ")
                    },
                )
            }
        },
        Err(e) => row(
            "Persisted → Processed",
            PROCESSED_INVARIANT,
            Status::Warn,
            format!("state directory not readable here ({e}); run doctor where the worker's state is, or on a copy"),
        ),
    });

    // The state survives its directory: each task's changelog restores the group's committed
    // epoch (a dry run into a scratch directory, as a takeover elsewhere would).
    rows.push(restorable(&settings).await);

    // Processed → Written: the commit log is one contiguous chain; the DLQ matches it.
    let gaps = prove::commit_log_gaps(&batches);
    let (committed_events, committed_revenue, committed_dead) = sink.commit_totals().await?;
    let dead = prove::read_dead_letters(config)?;
    let in_dlq: usize = dead.values().map(Vec::len).sum();
    let repeated = dead.values().filter(|v| v.len() > 1).count();
    // tally's own topic must be as durable as the cluster allows: a committed dead letter on
    // one disk of a larger cluster is one disk failure from lost.
    let dlq = tally_kafka::topic_durability(&kafka, &config.dlq_topic()).await;
    let dlq_fragile = dlq.as_ref().is_ok_and(|d| {
        d.brokers > 1 && (d.replication_factor < 2 || d.min_insync_replicas.unwrap_or(1) < 2)
    });
    let mut problems = gaps.clone();
    problems.extend(commits_missing(config, &sink, &committed).await?);
    if in_dlq as u64 != committed_dead {
        problems.push(format!(
            "the dead-letter topic holds {in_dlq} committed records, the commit log counts {committed_dead}"
        ));
    }
    if repeated > 0 {
        problems.push(format!(
            "{repeated} source records are dead-lettered more than once"
        ));
    }
    let dlq_evidence = match &dlq {
        Ok(d) => format!(
            "; {} has replication factor {}, min.insync.replicas {} on {} broker(s){}",
            config.dlq_topic(),
            d.replication_factor,
            d.min_insync_replicas.unwrap_or(1),
            d.brokers,
            if dlq_fragile {
                ": raise them (kafka-configs, kafka-reassign-partitions)"
            } else {
                ""
            }
        ),
        Err(e) => format!("; the dead-letter topic cannot be described: {e}"),
    };
    rows.push(row(
        "Processed → Written",
        "every epoch is written once, contiguous per partition; dead letters match the commit log",
        if !problems.is_empty() {
            Status::Fail
        } else if dlq_fragile {
            Status::Warn
        } else {
            Status::Pass
        },
        if problems.is_empty() {
            format!(
                "{} batches, contiguous; {in_dlq} dead letters = commit log{dlq_evidence}",
                batches.len()
            )
        } else {
            problems.join("; ") + &dlq_evidence
        },
    ));

    let mut queryable = queryable::written_to_queryable(
        config,
        &sink,
        committed_events,
        committed_revenue.clone(),
        ranges.len(),
    )
    .await?;
    if let Some(versions) = versions_said(&settings).await {
        queryable.evidence = format!("{versions}; {}", queryable.evidence);
    }
    rows.push(queryable);

    if with_source {
        let recent = ReconcileFilter {
            from_ms: filter.from_ms,
            to_ms: None,
            customer: None,
        };
        let invariant =
            "the numbers readers see equal the same aggregation run on the source table";
        let wait = Duration::from_secs(30);
        rows.push(
            match crate::database::reconcile::reconcile_source(config, None, &recent, wait, false)
                .await
            {
                Ok(r) => row(
                    "Queryable → Reported",
                    invariant,
                    if r.fails(false) {
                        Status::Fail
                    } else if r.open_not_compared.is_some() || r.compared() == 0 {
                        Status::Warn
                    } else {
                        Status::Pass
                    },
                    format!(
                        "{period}: {}settled {} keys, {} differ, records counted ratio {:.6}; open {}; the table read at WAL {}, the view at changes up to {}{}",
                        if r.compared() == 0 {
                            "NOTHING TO COMPARE: "
                        } else {
                            ""
                        },
                        r.settled.keys,
                        r.settled.mismatched,
                        r.settled.orders_ratio(),
                        match &r.open_not_compared {
                            None => format!(
                                "{} keys, {} differ, records counted ratio {:.6}, {} changed after the snapshot (next round)",
                                r.open.keys,
                                r.open.mismatched,
                                r.open.orders_ratio(),
                                r.touched
                            ),
                            Some(why) => format!("NOT COMPARED ({why})"),
                        },
                        tally_core::declare::lsn_text(r.source_lsn),
                        tally_core::declare::lsn_text(r.committed_lsn),
                        if r.truncates.is_empty() {
                            String::new()
                        } else {
                            format!("; a TRUNCATE in the topic at {}", r.truncates.join(", "))
                        }
                    ),
                ),
                Err(e) => row(
                    "Queryable → Reported",
                    invariant,
                    Status::Fail,
                    format!("the source table could not be compared: {e:#}"),
                ),
            },
        );
    }
    rows.push(match &reconciled {
        Ok(r) => row(
            "Queryable → Reported",
            "the numbers readers see equal a recomputation from the source",
            if r.mismatched > 0 {
                Status::Fail
            } else if r.keys == 0 {
                Status::Warn
            } else {
                Status::Pass
            },
            format!(
                "{period}: {}{} keys, {} differ; {}",
                if r.keys == 0 {
                    "NOTHING TO COMPARE: "
                } else {
                    ""
                },
                r.keys,
                r.mismatched,
                r.ratios(&config.declared)
            ),
        ),
        Err(e) => row(
            "Queryable → Reported",
            "the numbers readers see equal a recomputation from the source",
            Status::Fail,
            format!("the reconciliation could not compare: {e:#}"),
        ),
    });
    Ok(rows)
}

/// The view against what was committed: problems found, a summary, and how many batches
/// committed long ago are not published.
struct ViewAgainstCommits {
    problems: Vec<String>,
    summary: String,
    unpublished: u64,
}

/// The view, cell by cell, against the committed versions read at the published snapshot's
/// cut; with tumbling windows also its first `count` and first exact `sum` columns against the
/// commit log's totals, `(events, sum)` (with hopping ones a record counts in each open window
/// holding it, so no total of the commit log matches).
async fn declared_view(
    config: &Config,
    sink: &ClickHouseSink,
    unpublished_after: Duration,
    compare_totals: bool,
    (committed_events, committed_sum): (u64, String),
) -> Result<ViewAgainstCommits> {
    let job = &config.declared;
    let types = prove::ViewTypes::of(config, job)?;
    let mut problems = Vec::new();
    let read = |what: &str, cells: tally_clickhouse::Result<tally_clickhouse::Cells>| {
        cells
            .map_err(anyhow::Error::from)
            .and_then(|c| types.read(c))
            .map_err(|e| format!("{what}: {e:#}"))
    };
    // Read again if a publish or a fold step came between the reads.
    let mut attempts = 0;
    let (view, at_cut, (published_events, published_sum), unpublished) = loop {
        let published = sink.published().await?;
        let frontier = sink.frontier().await?;
        let cut = published
            .as_ref()
            .map(|p| p.cut.clone())
            .unwrap_or_default();
        let view = read("the view", sink.read_view_cells().await);
        let at_cut = read(
            "the committed versions at the published cut",
            sink.read_view_at_cells(&cut, None).await,
        );
        let (events, sum, unpublished) = sink
            .published_totals(published.as_ref(), unpublished_after)
            .await?;
        attempts += 1;
        if attempts == 3
            || (sink.published().await? == published && sink.frontier().await? == frontier)
        {
            break (view, at_cut, (events, sum), unpublished);
        }
    };
    let answer = read("the committed versions", sink.read_committed_cells().await);
    // A key twice reads as once above (the rows are keyed): counted here.
    let doubled = sink.view_doubled_keys().await?;
    if doubled > 0 {
        problems.push(format!("{doubled} keys appear more than once in the view"));
    }
    let doubled = sink.answer_doubled_keys().await?;
    if doubled > 0 {
        problems.push(format!(
            "{doubled} keys appear more than once in the committed versions"
        ));
    }
    let tumbling = config.window.slide.is_none_or(|s| s == config.window.size);
    let count_column = job
        .aggregates
        .iter()
        .find(|a| a.function == tally_core::declare::Function::Count)
        .map(|a| a.column.clone());
    // A job of changes counts rows, not the changes the commit log counts.
    let changes = job.changes.is_some();
    let compare_counts = compare_totals && tumbling && !changes && count_column.is_some();
    let counted = |w: &prove::Windows| prove::counted(job, w).map_or(0, |c| c.0);
    let mut summary = String::new();
    match (&view, &at_cut) {
        (Ok(view), Ok(at_cut)) => {
            let diff = prove::WindowDiff::compare(at_cut, view);
            if diff.is_empty() {
                summary = format!(
                    "{} rows = the committed versions at the published cut",
                    view.len()
                );
            } else {
                problems.push(format!(
                    "the view differs from the committed versions at its published cut: {}",
                    diff.summary()
                ));
            }
            if let Some(problem) = sum_differs(job, view, &published_sum, compare_counts) {
                problems.push(format!(
                    "the view {problem}, for the batches the commit log published"
                ));
            }
            if compare_counts && counted(view) != published_events {
                problems.push(format!(
                    "the view counts {} records ({}), the commit log recorded {published_events} for the batches it published",
                    counted(view),
                    count_column.as_deref().unwrap_or_default()
                ));
            }
        }
        (view, at_cut) => {
            problems.extend(view.as_ref().err().cloned());
            problems.extend(at_cut.as_ref().err().cloned());
        }
    }
    if let Ok(answer) = &answer
        && let Some(problem) = sum_differs(job, answer, &committed_sum, compare_counts)
    {
        problems.push(format!("the committed versions {problem}"));
    }
    match &answer {
        Ok(answer) if compare_counts && counted(answer) != committed_events => {
            problems.push(format!(
                "the committed versions count {} records ({}), the commit log recorded {committed_events}",
                counted(answer),
                count_column.as_deref().unwrap_or_default()
            ))
        }
        Ok(_) => {}
        Err(e) => problems.push(e.clone()),
    }
    let view_counted = view.as_ref().map_or(0, counted);
    summary += &match (compare_counts, count_column) {
        (true, Some(column)) => format!("; {view_counted} records counted ({column}) = commit log"),
        (_, Some(column)) if changes => format!(
            "; {view_counted} rows counted ({column}): a job of changes counts the source's rows, and the commit log its changes, so no commit log total compares"
        ),
        _ if !compare_totals => "; retention on: counts not compared with the commit log".into(),
        (_, Some(column)) => format!(
            "; {view_counted} window adds ({column}): a record counts in every open window of its hop, so no commit log total compares"
        ),
        (_, None) => "; no count column to compare with the commit log".into(),
    };
    Ok(ViewAgainstCommits {
        problems,
        summary,
        unpublished,
    })
}

/// How `windows`' first exact sum differs from the commit log's (`revenue_sum`, a decimal of
/// scale 4 holding the sum's units), if it does and `compare` holds. A log of 0 is not
/// compared: batches of releases before the log recorded a declared job's sum hold 0.
fn sum_differs(
    job: &tally_core::declare::Job,
    windows: &prove::Windows,
    logged: &str,
    compare: bool,
) -> Option<String> {
    // The log sums the first sum of exact words: compared when that is the first integer or
    // decimal sum, the one `totals` gives.
    let first_exact = job.aggregates.iter().find(|a| {
        a.function == tally_core::declare::Function::Sum
            && a.word_kinds() == [tally_core::WordKind::Exact]
    })?;
    let column = prove::first_sum(job).filter(|s| s.column == first_exact.column)?;
    let logged_units = tally_core::declare::parse_decimal(logged, 4).ok()?;
    let (_, shown) = prove::totals(job, windows);
    (compare && logged_units != 0 && i128::from(logged_units) != shown).then(|| {
        format!(
            "sum {shown} ({}, in units), the commit log recorded {logged_units}",
            column.column
        )
    })
}

/// Who holds the read side, and how recently it beat.
async fn describe_read_side(sink: &ClickHouseSink) -> String {
    match sink.read_side_holder().await {
        Ok(tally_clickhouse::ReadSideHolder::Vacant) => "no worker holds the read side".into(),
        Ok(tally_clickhouse::ReadSideHolder::Held {
            generation,
            holder,
            beat_age,
        }) => format!(
            "read side generation {generation} held by {}, {}",
            holder.as_deref().unwrap_or("?"),
            beat_age.map_or("not beating yet".into(), |a| format!("beat {a}s ago"))
        ),
        Err(e) => format!("the read side's holder cannot be read: {e}"),
    }
}

/// Partitions whose offsets the group committed past the commit log's newest batch: a batch
/// in flight (Kafka commits first) is written within a few seconds, so a gap that stays was
/// deleted behind tally's back (or the worker cannot write to ClickHouse).
async fn commits_missing(
    config: &Config,
    sink: &ClickHouseSink,
    committed: &BTreeMap<i32, (i64, tally_kafka::CommitMark)>,
) -> Result<Vec<String>> {
    let settle = (config.job.checkpoint_interval.as_duration() * 2)
        .min(Duration::from_secs(10))
        .max(Duration::from_secs(2));
    let mut missing = Vec::new();
    for attempt in 0..2 {
        let in_clickhouse = sink.committed_offsets().await?;
        missing = committed
            .iter()
            .filter(|(p, (offset, _))| in_clickhouse.get(p).copied().unwrap_or(0) < *offset)
            .map(|(p, (offset, mark))| {
                format!(
                    "the group committed partition {p} up to offset {offset} (epoch {}), the commit log only to {}: its newest batches were deleted behind tally's back, or the worker cannot write them",
                    mark.epoch,
                    in_clickhouse.get(p).copied().unwrap_or(0)
                )
            })
            .collect();
        if missing.is_empty() || attempt == 1 {
            break;
        }
        tokio::time::sleep(settle).await;
    }
    Ok(missing)
}

/// Restores each task's state from the changelog into a scratch directory, as a worker taking
/// the task over on another machine would, and checks it reaches the group's committed epoch.
async fn restorable(settings: &std::sync::Arc<JobSettings>) -> Row {
    let invariant = "each task's changelog restores the group's committed epoch (a takeover elsewhere loses nothing)";
    let tasks: Vec<Option<u32>> = if settings.tasks > 1 {
        (0..settings.tasks).map(Some).collect()
    } else {
        vec![None]
    };
    let mut evidence = Vec::new();
    let mut failed = false;
    for task in tasks {
        let settings = settings.clone();
        let checked = tokio::task::spawn_blocking(move || -> Result<Option<String>> {
            let scratch = tempfile::tempdir()?;
            let mut run = match task {
                Some(t) => settings.task(t),
                None => settings.whole(),
            };
            // The task's identity, in a directory of its own: the job's is not touched.
            run.state_dir = scratch.path().join("state");
            let rt = tokio::runtime::Handle::current();
            let marks = tally_runtime::marks::job_commit_marks(&settings, &run)?;
            if marks.is_empty() {
                return Ok(None);
            }
            let restored =
                tally_runtime::restore::restore(&settings, &run, &rt, &marks, None, false)?;
            Ok(Some(format!(
                "{}epoch {} of writer {} ({} records, {} ms)",
                task.map_or(String::new(), |t| format!("task {t}: ")),
                restored.epoch,
                restored.writer,
                restored.records,
                restored.duration.as_millis()
            )))
        })
        .await;
        match checked {
            Ok(Ok(Some(line))) => evidence.push(line),
            Ok(Ok(None)) => evidence.push(format!(
                "{}nothing committed yet",
                task.map_or(String::new(), |t| format!("task {t}: "))
            )),
            Ok(Err(e)) => {
                failed = true;
                evidence.push(format!(
                    "{}the changelog does not restore the committed state: {e:#}",
                    task.map_or(String::new(), |t| format!("task {t}: "))
                ));
            }
            Err(e) => {
                failed = true;
                evidence.push(format!("the restore check stopped: {e}"));
            }
        }
    }
    row(
        "Processed → Restorable",
        invariant,
        if failed { Status::Fail } else { Status::Pass },
        format!(
            "restored from {}: {}",
            settings.topics.changelog,
            evidence.join("; ")
        ),
    )
}

pub fn print(rows: &[Row], json: bool) {
    if json {
        for r in rows {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
        return;
    }
    for r in rows {
        let status = match r.status {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        println!("{status}  {:<22} {}", r.hop, r.invariant);
        println!("      {:<22} {}", "", r.evidence);
    }
}
