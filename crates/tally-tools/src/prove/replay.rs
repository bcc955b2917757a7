//! The job's committed source ranges run again through its operator, in memory, and the commit
//! log's chains checked: what `tally reconcile` and its `--every` rounds compare the sink with.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use tally_clickhouse::ClickHouseSink;
use tally_core::{CheckpointBarrier, Epoch, MemStore, OutputRow, Program, WindowOperator};

use tally_runtime::config::Config;

/// The job's operator run again, in memory, over committed offset ranges of the source topic:
/// what the sink should hold, per window key and source partition. `tally reconcile` reads the
/// whole committed ranges once; `--every` keeps one between rounds and reads what is new. `K`
/// and `V` are a view row's key and value as the reconciliation compares them.
pub(crate) struct SourceReplay<K, V> {
    op: WindowOperator,
    store: MemStore,
    /// Per window key and source partition, the value the replay computed.
    pub(crate) values: BTreeMap<K, BTreeMap<i32, V>>,
    /// Per partition, where the replay's reading ended.
    pub(super) read_to: BTreeMap<i32, i64>,
    /// A row of a checkpoint as a key and value.
    row: fn(&OutputRow) -> (K, V),
}

/// What one [`SourceReplay::read`] did.
pub(crate) struct ReadBack<K> {
    pub(super) records: u64,
    pub(crate) duplicates: u64,
    /// The window keys whose value changed.
    pub(super) changed: BTreeSet<K>,
}

impl<K: Ord + Clone, V> SourceReplay<K, V> {
    /// A replay of `config`'s job reading records as `program` does.
    pub(crate) fn new(config: &Config, program: Program, row: fn(&OutputRow) -> (K, V)) -> Self {
        SourceReplay {
            op: WindowOperator::restore(config.operator(), program, Epoch(0), &BTreeMap::new()),
            store: MemStore::default(),
            values: BTreeMap::new(),
            read_to: BTreeMap::new(),
            row,
        }
    }

    /// Reads `ranges` of the source (per partition `[from, to)`; a partition new to the replay
    /// starts at its `from`), checkpointing every `flush_every` records to bound memory.
    pub(crate) fn read(
        &mut self,
        config: &Config,
        ranges: &BTreeMap<i32, (i64, Option<i64>)>,
        flush_every: u64,
    ) -> Result<ReadBack<K>> {
        for (p, (from, _)) in ranges {
            if !self.read_to.contains_key(p) {
                self.op.add_partition(*p, *from);
            }
        }
        let mut back = ReadBack {
            records: 0,
            duplicates: 0,
            changed: BTreeSet::new(),
        };
        let settings = config.kafka_settings();
        let topic = &config.kafka.source_topic;
        tally_kafka::read_committed_range(
            &settings,
            topic,
            ranges,
            Duration::from_secs(120),
            |m| {
                let Ok(_) = self.op.process(&self.store, tally_kafka::record_of(m));
                back.records += 1;
                if back.records.is_multiple_of(flush_every) {
                    self.flush(&mut back);
                }
            },
        )?;
        self.flush(&mut back);
        for (p, (_, end)) in ranges {
            if let Some(end) = end {
                self.read_to.insert(*p, *end);
            }
        }
        Ok(back)
    }

    fn flush(&mut self, back: &mut ReadBack<K>) {
        let cp = self.op.handle_checkpoint(CheckpointBarrier {
            epoch: self.op.current_epoch(),
            is_final: false,
        });
        self.store.apply(&cp);
        back.duplicates += cp.accounting().duplicates;
        for row in &cp.rows {
            let (key, value) = (self.row)(row);
            self.values
                .entry(key.clone())
                .or_default()
                .insert(row.partition, value);
            back.changed.insert(key);
        }
    }
}

/// What the commit log says was committed: the last epoch, the cut after every batch, the
/// source ranges the batches hold (per partition `[from, to)`, within the topic), and the
/// breaks found in the log.
pub(crate) struct Committed {
    pub(crate) epoch: Epoch,
    pub(crate) cut: tally_clickhouse::Cut,
    pub(crate) ranges: BTreeMap<i32, (i64, Option<i64>)>,
    pub(crate) gaps: Vec<String>,
}

/// The commit log read for a reconciliation; `None` before the first commit.
pub(crate) async fn committed(config: &Config, sink: &ClickHouseSink) -> Result<Option<Committed>> {
    let batches = sink.committed_batches().await?;
    let Some(last) = batches.last() else {
        return Ok(None);
    };
    let epoch = Epoch(last.epoch);
    let cut = tally_clickhouse::Cut::after(&batches);
    let mut gaps = commit_log_gaps(&batches);
    let mut ranges: BTreeMap<i32, (i64, Option<i64>)> = BTreeMap::new();
    for b in &batches {
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            let e = ranges.entry(*p).or_insert((*from, Some(*to)));
            e.0 = e.0.min(*from);
            e.1 = Some(e.1.unwrap_or(*to).max(*to));
        }
    }
    let settings = config.kafka_settings();
    // A commit log that claims offsets the topic never had is corrupt: say so, and read only
    // what exists rather than wait for records that will never come.
    let extent = tally_kafka::topic_extent(&settings, &config.kafka.source_topic)?;
    // Where the job (a new version: its restatement) began reading each partition.
    let from = config.start_from();
    if from != tally_kafka::StartFrom::Latest {
        let starts: BTreeMap<i32, i64> = ranges.iter().map(|(p, (s, _))| (*p, *s)).collect();
        let began = tally_kafka::topic_starts(&settings, &config.kafka.source_topic, from)?;
        gaps.extend(missing_first_batches(&starts, &began));
    }
    for (p, (_, end)) in ranges.iter_mut() {
        let high = extent.get(p).map_or(0, |(_, high)| *high);
        if let Some(to) = end
            && *to > high
        {
            gaps.push(format!(
                "the commit log claims partition {p} up to offset {to}, but the topic ends at {high}"
            ));
            *end = Some(high);
        }
    }
    Ok(Some(Committed {
        epoch,
        cut,
        ranges,
        gaps,
    }))
}

/// The committed source ranges replayed, and where the commit log says they were committed.
pub(crate) struct Replayed<K, V> {
    pub(crate) epoch: Epoch,
    pub(crate) cut: tally_clickhouse::Cut,
    pub(crate) gaps: Vec<String>,
    pub(crate) replay: SourceReplay<K, V>,
    /// Records whose event id the replay saw before.
    pub(crate) duplicates: u64,
}

/// Reads the commit log and replays its committed ranges of the source, keeping each row by
/// `row`; `None` (said when `print`) before the first commit.
pub(crate) async fn replay_committed<K, V>(
    config: &Config,
    sink: &ClickHouseSink,
    row: fn(&OutputRow) -> (K, V),
    print: bool,
) -> Result<Option<Replayed<K, V>>>
where
    K: Ord + Clone + Send + 'static,
    V: Send + 'static,
{
    let Some(Committed {
        epoch,
        cut,
        ranges,
        gaps,
    }) = committed(config, sink).await?
    else {
        if print {
            println!("reconcile: nothing committed yet");
        }
        return Ok(None);
    };
    let replay_config = config.clone();
    let (replay, duplicates) =
        tokio::task::spawn_blocking(move || -> Result<(SourceReplay<K, V>, u64)> {
            let mut replay = SourceReplay::new(&replay_config, replay_config.program()?, row);
            let back = replay.read(&replay_config, &ranges, 100_000)?;
            Ok((replay, back.duplicates))
        })
        .await
        .context("reconcile thread")??;
    Ok(Some(Replayed {
        epoch,
        cut,
        gaps,
        replay,
        duplicates,
    }))
}

/// Breaks in the commit log's chains: per source partition, the batches holding it start at
/// its first offset in the log and each starts where another ended, and no two batches start
/// at the same offset with different ends (two histories). Writers number their epochs
/// independently, so the chains are per partition, not per epoch. A missing or foreign batch
/// shows as a break.
pub fn commit_log_gaps(batches: &[tally_clickhouse::CommittedBatch]) -> Vec<String> {
    chain_gaps(&BTreeMap::new(), batches)
}

/// [`commit_log_gaps`] for `batches` that continue the chains ending at `ends` (checked before).
pub(super) fn chain_gaps(
    ends: &BTreeMap<i32, i64>,
    batches: &[tally_clickhouse::CommittedBatch],
) -> Vec<String> {
    let mut gaps = Vec::new();
    // Per partition: from offset -> (to offset, epoch of the batch).
    let mut links: BTreeMap<i32, BTreeMap<i64, (i64, u64)>> = BTreeMap::new();
    // Per partition, the batches that had nothing new for it: (offset, epoch).
    let mut idle: BTreeMap<i32, Vec<(i64, u64)>> = BTreeMap::new();
    for b in batches {
        if b.partitions.len() != b.from_offsets.len()
            || b.partitions.len() != b.to_offsets.len()
            || b.partitions.is_empty()
        {
            gaps.push(format!("epoch {} has no valid offset ranges", b.epoch));
            continue;
        }
        for ((p, from), to) in b.partitions.iter().zip(&b.from_offsets).zip(&b.to_offsets) {
            let chain = links.entry(*p).or_default();
            // A partition with nothing new in the batch: no link of the chain, but it must
            // sit on one (checked below).
            if from == to {
                idle.entry(*p).or_default().push((*from, b.epoch));
                continue;
            }
            match chain.get(from) {
                Some((other, _)) if other != to => gaps.push(format!(
                    "two batches start partition {p} at offset {from}: one ends at {other}, epoch {}'s at {to} (two histories)",
                    b.epoch
                )),
                _ => {
                    chain.insert(*from, (*to, b.epoch));
                }
            }
        }
    }
    // Where each partition's history starts, when no earlier round says: the lowest offset a
    // batch of it starts at, idle or not.
    let start_of = |p: &i32| -> Option<i64> {
        ends.get(p).copied().or_else(|| {
            let first_link = links.get(p).and_then(|c| c.keys().next().copied());
            let first_idle = idle.get(p).and_then(|b| b.iter().map(|(o, _)| *o).min());
            first_link.into_iter().chain(first_idle).min()
        })
    };
    for (p, chain) in &links {
        let mut end = start_of(p);
        for (from, (to, epoch)) in chain {
            if let Some(e) = end
                && *from != e
            {
                if *to <= e {
                    // Within what was checked already (an incremental round's earlier batches).
                    continue;
                }
                gaps.push(format!(
                    "epoch {epoch} starts partition {p} at offset {from}, but the previous batch ended at {e}"
                ));
            }
            end = Some(end.map_or(*to, |e| e.max(*to)));
        }
    }
    for (p, batches) in &idle {
        let chain = links.get(p);
        let start = start_of(p);
        for (offset, epoch) in batches {
            let on_chain = Some(*offset) == start
                || chain.is_some_and(|c| c.values().any(|(to, _)| to == offset));
            if !on_chain {
                gaps.push(format!(
                    "epoch {epoch} leaves partition {p} at offset {offset}, where no batch of it ended"
                ));
            }
        }
    }
    gaps
}

/// For a job that read its partitions from where they began (`lows`: the earliest offsets, or
/// a restatement's): a partition whose first committed batch starts after it lacks the batches before it (epochs
/// are numbered per writer, so only the offsets can tell that the first one is gone).
fn missing_first_batches(starts: &BTreeMap<i32, i64>, lows: &BTreeMap<i32, i64>) -> Vec<String> {
    starts
        .iter()
        .filter_map(|(p, from)| {
            let low = lows.get(p).copied().unwrap_or(0);
            (*from > low).then(|| {
                format!(
                    "partition {p}'s first committed batch starts at offset {from}, but the job began it at {low}: the batches before it are missing"
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(epoch: u64, ranges: &[(i32, i64, i64)]) -> tally_clickhouse::CommittedBatch {
        tally_clickhouse::CommittedBatch {
            epoch,
            partitions: ranges.iter().map(|r| r.0).collect(),
            from_offsets: ranges.iter().map(|r| r.1).collect(),
            to_offsets: ranges.iter().map(|r| r.2).collect(),
        }
    }

    #[test]
    fn chains_are_per_partition_whoever_numbered_the_epochs() {
        // Writer A: partitions 0 and 1; writer B takes partition 1 over, its epochs from 1.
        let batches = [
            batch(1, &[(0, 0, 10), (1, 0, 5)]),
            batch(2, &[(0, 10, 10), (1, 5, 9)]),
            batch(1, &[(1, 9, 12)]),
            batch(3, &[(0, 10, 14)]),
        ];
        assert!(commit_log_gaps(&batches).is_empty());
        // Listed in any order.
        let mut shuffled = batches.to_vec();
        shuffled.reverse();
        assert!(commit_log_gaps(&shuffled).is_empty());
    }

    #[test]
    fn a_missing_batch_and_two_histories_are_breaks() {
        let gaps = commit_log_gaps(&[batch(1, &[(0, 0, 10)]), batch(3, &[(0, 12, 20)])]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(
            gaps[0].contains("starts partition 0 at offset 12, but the previous batch ended at 10")
        );
        let gaps = commit_log_gaps(&[
            batch(1, &[(0, 0, 10)]),
            batch(7, &[(0, 0, 8)]),
            batch(2, &[(0, 10, 11)]),
        ]);
        assert!(
            gaps.iter()
                .any(|g| g.contains("two batches start partition 0 at offset 0")),
            "{gaps:?}"
        );
    }

    #[test]
    fn a_missing_batch_after_an_idle_first_one_is_named_where_it_is_missing() {
        // Epoch 1 had nothing for partition 0; epoch 2 (0 -> 700) is gone.
        let gaps = commit_log_gaps(&[batch(1, &[(0, 0, 0)]), batch(3, &[(0, 700, 1400)])]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(
            gaps[0].contains(
                "epoch 3 starts partition 0 at offset 700, but the previous batch ended at 0"
            ),
            "{gaps:?}"
        );
    }

    #[test]
    fn a_missing_first_batch_shows_against_the_topic_start() {
        let starts = BTreeMap::from([(0, 0), (1, 40)]);
        let lows = BTreeMap::from([(0, 0), (1, 0)]);
        let gaps = missing_first_batches(&starts, &lows);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
        assert!(gaps[0].contains("partition 1's first committed batch starts at offset 40"));
        // Retention deleted what the job read long ago: nothing is missing.
        assert!(missing_first_batches(&starts, &BTreeMap::from([(1, 90)])).is_empty());
    }

    #[test]
    fn an_incremental_round_continues_the_chains_it_checked() {
        let ends = BTreeMap::from([(0, 10), (1, 5)]);
        assert!(chain_gaps(&ends, &[batch(4, &[(0, 10, 12), (1, 5, 5)])]).is_empty());
        // An idle partition must sit where its chain is.
        let gaps = chain_gaps(&ends, &[batch(4, &[(0, 10, 12), (1, 7, 7)])]);
        assert!(
            gaps[0].contains("leaves partition 1 at offset 7"),
            "{gaps:?}"
        );
        let gaps = chain_gaps(&ends, &[batch(4, &[(0, 11, 12)])]);
        assert_eq!(gaps.len(), 1, "{gaps:?}");
    }
}
