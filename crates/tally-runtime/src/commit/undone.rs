//! Epochs that ClickHouse holds and Kafka undid, recovered without the state directory that
//! made them.
//!
//! A committed epoch's Kafka transaction can be undone afterwards (a hanging transaction aborted
//! by hand drops its dead letters, changelog records and group offsets), while ClickHouse keeps
//! its batch. The directory that made the epoch sends it again from its store. A directory
//! restored from the changelog elsewhere lacks it: its state ends one or more batches before
//! ClickHouse's commit log. Every decision of the operator is a function of each partition's
//! records and the state before them, so those batches are made again from the source topic,
//! cut exactly where the commit log says each ended, and checked against what ClickHouse
//! recorded of each (rows, events, revenue, dead letters) before their Kafka transaction is
//! committed again. ClickHouse's write is then found committed, and the job goes on exactly
//! once. When that cannot be done the worker stops and says what was lost and what to run.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tally_clickhouse::CommittedBatch;
use tally_core::{CheckpointBarrier, PartitionId, WindowOperator};
use tally_state::StateStore;

use super::sinks::BatchSink;
use crate::persist::PreCommitted;
use crate::retry::Failure;
use crate::settings::JobSettings;

/// The commit log's batches past `state` (per partition, the offset the state ends at), in
/// order, if they continue it: each starts every one of its partitions where the state (or the
/// batch before) ends. `Err`: ClickHouse is ahead of the state in a way no replay explains.
pub fn batches_past(
    batches: &[CommittedBatch],
    state: &BTreeMap<PartitionId, i64>,
    owns: impl Fn(PartitionId) -> bool,
) -> Result<Vec<CommittedBatch>, String> {
    let mut ahead: Vec<&CommittedBatch> = batches
        .iter()
        .filter(|b| {
            b.partitions
                .iter()
                .zip(&b.to_offsets)
                .any(|(p, to)| owns(*p) && state.get(p).is_none_or(|s| to > s))
        })
        .collect();
    ahead.sort_by_key(|b| b.from_offsets.iter().copied().min().unwrap_or(0));
    let mut at = state.clone();
    let mut chain = Vec::new();
    for b in ahead {
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            if !owns(*p) {
                return Err(format!(
                    "batch of epoch {} holds partition {p}, which this task does not run",
                    b.epoch
                ));
            }
            let here = at.get(p).copied();
            if here != Some(*from) {
                return Err(format!(
                    "partition {p}: the state ends at {}, the next batch in ClickHouse starts at {from}",
                    here.map_or("nothing".into(), |o| o.to_string())
                ));
            }
            at.insert(*p, *to);
        }
        chain.push(b.clone());
    }
    Ok(chain)
}

/// Makes `batch` again from the source topic with `operator` (restored to the state the batch
/// starts from) and returns it pre-committed in `store`, once it matches what ClickHouse
/// recorded of the batch.
pub fn remake(
    job: &JobSettings,
    clickhouse: &impl BatchSink,
    store: &StateStore,
    operator: &mut WindowOperator,
    batch: &CommittedBatch,
) -> Result<PreCommitted> {
    let topic = &job.source.source_topic;
    let ranges: BTreeMap<PartitionId, (i64, Option<i64>)> = batch
        .partitions
        .iter()
        .zip(&batch.from_offsets)
        .zip(&batch.to_offsets)
        .map(|((p, from), to)| (*p, (*from, Some(*to))))
        .collect();
    let mut failure = None;
    tally_kafka::read_committed_range(
        &job.source.kafka,
        topic,
        &ranges,
        Duration::from_secs(30),
        |m| {
            if failure.is_none()
                && let Err(e) = operator.process(store, tally_kafka::record_of(m))
            {
                failure = Some(e);
            }
        },
    )
    .with_context(|| format!("reading {topic} {ranges:?} again"))?;
    if let Some(e) = failure {
        return Err(anyhow::Error::new(e).context("processing a record again"));
    }
    let next = operator.next_offsets();
    for ((p, from), to) in batch
        .partitions
        .iter()
        .zip(&batch.from_offsets)
        .zip(&batch.to_offsets)
    {
        if next.get(p) != Some(to) {
            let read = next.get(p).map_or_else(
                || "none of them".to_owned(),
                |o| format!("up to offset {o}"),
            );
            bail!(
                "partition {p} of {topic} no longer holds every record of {from}..{to} (did retention delete some?): read {read}"
            );
        }
    }
    let cut = operator.cut(CheckpointBarrier {
        epoch: operator.current_epoch(),
        is_final: false,
    });
    let remade = PreCommitted::of(store, &cut)?;
    let ours = job.commit.batch_of(&remade.checkpoint);
    let recorded = clickhouse
        .batch_totals(&batch.partitions, &batch.to_offsets)
        .map_err(Failure::into_error)?;
    let made = tally_clickhouse::BatchTotals {
        rows: ours.rows.len() as u64,
        events: ours.event_count,
        revenue_units: ours.revenue_units,
        dead_letters: ours.dead_letters,
    };
    let committed = clickhouse
        .is_committed(&ours)
        .map_err(Failure::into_error)?;
    // Releases before one engine recorded no sum for a declared job's batch.
    let recorded = recorded.map(|r| match r.revenue_units {
        0 => tally_clickhouse::BatchTotals {
            revenue_units: made.revenue_units,
            ..r
        },
        _ => r,
    });
    if recorded.as_ref() != Some(&made) || !committed {
        bail!(
            "made again from the source, epoch {} is {made:?}, but ClickHouse recorded {recorded:?}",
            batch.epoch
        );
    }
    Ok(remade)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(epoch: u64, parts: &[(i32, i64, i64)]) -> CommittedBatch {
        CommittedBatch {
            epoch,
            partitions: parts.iter().map(|p| p.0).collect(),
            from_offsets: parts.iter().map(|p| p.1).collect(),
            to_offsets: parts.iter().map(|p| p.2).collect(),
        }
    }

    #[test]
    fn the_batches_past_the_state_must_continue_it() {
        let log = [
            batch(1, &[(0, 0, 10), (1, 0, 8)]),
            batch(2, &[(0, 10, 20), (1, 8, 9)]),
            batch(3, &[(0, 20, 25)]),
        ];
        let state = BTreeMap::from([(0, 10), (1, 8)]);
        let past = batches_past(&log, &state, |_| true).unwrap_or_default();
        assert_eq!(past.iter().map(|b| b.epoch).collect::<Vec<_>>(), [2, 3]);
        // Nothing past a current state.
        let current = BTreeMap::from([(0, 25), (1, 9)]);
        assert!(batches_past(&log, &current, |_| true).is_ok_and(|b| b.is_empty()));
        // A state older than a hole in what ClickHouse holds: no replay explains it.
        let old = BTreeMap::from([(0, 5), (1, 8)]);
        let err = batches_past(&log, &old, |_| true).err().unwrap_or_default();
        assert!(err.contains("partition 0: the state ends at 5"), "{err}");
        // Another task's partition in a batch: not this task's to make.
        let err = batches_past(&log, &state, |p| p == 0)
            .err()
            .unwrap_or_default();
        assert!(err.contains("does not run"), "{err}");
    }
}
