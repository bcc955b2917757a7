//! A change job's records: each change of a row retracts the row's old contribution and adds
//! its new one, once per source position.

use smallvec::SmallVec;

use super::windows::{group_key, window_value};
use super::{Outcome, Record, StateReader, WindowOperator, window_bytes};
use crate::declare::{Change, Evaluation, Job, Op};
use crate::decode::{Poison, PoisonReason};
use crate::source_row::{Contribution, SourceRow};
use crate::types::{PartitionId, WindowKey};
use crate::window_agg::WindowAgg;

impl WindowOperator {
    /// Applies one change of a row: its old contribution out of its windows, its new one in,
    /// all or none, once per position (an older or repeated change is counted, not applied).
    pub(super) fn process_change<S: StateReader>(
        &mut self,
        store: &S,
        record: Record<'_>,
        job: &Job,
        max_record_bytes: usize,
    ) -> Result<Outcome, S::Error> {
        let cfg = self.config;
        if record.value.is_none() {
            self.count(record.partition, |a| a.tombstones += 1);
            return Ok(Outcome::Tombstone);
        }
        let change = match job.evaluate_change(record.value, max_record_bytes) {
            Ok(change) if change.op == Op::Truncate => {
                // Nothing is counted: the job stops here, and its next start reads it again.
                if let Some(state) = self.partitions.get_mut(&record.partition) {
                    state.next_offset = record.offset;
                    state.epoch.consumed -= 1;
                    state.totals.consumed -= 1;
                }
                return Ok(Outcome::Truncated);
            }
            Ok(change) => change,
            Err(poison) => return Ok(self.dead_letter(record, poison)),
        };
        let new = match &change.row {
            Ok(Some(Evaluation::Event(event))) => match job.contribution(&event.inputs) {
                Ok(value) => Ok(Some(Contribution {
                    event_time_ms: event.event_time_ms,
                    key: group_key(job, event.key.clone()),
                    value,
                })),
                Err(overflow) => Err(Poison::new(
                    PoisonReason::TooLarge,
                    format!(
                        "row {:?}: its value leaves the range of column {}",
                        change.key.replace('\0', ","),
                        overflow.column
                    ),
                )),
            },
            Ok(_) => Ok(None),
            Err(poison) => Err(poison.clone()),
        };
        let Some(state) = self.partitions.get_mut(&record.partition) else {
            return Ok(Outcome::AlreadyProcessed);
        };
        state.newest_change = state.newest_change.max(Some(change.position));
        if let Ok(Some(c)) = &new {
            state.watermark.observe(c.event_time_ms);
        }
        let watermark = state
            .watermark
            .current(cfg.out_of_orderness_ms)
            .unwrap_or(i64::MIN);
        // A row lacking a field is late first when its event time is behind the watermark.
        let new = match (&change.row, new) {
            (
                Ok(Some(Evaluation::Incomplete {
                    event_time_ms,
                    poison,
                })),
                _,
            ) => Err(cfg
                .late(*event_time_ms, watermark)
                .unwrap_or_else(|| poison.clone())),
            (_, new) => new,
        };
        let held = self.held_row(store, record.partition, &change.key)?;
        if let Some(held) = &held {
            if change.position == held.position {
                self.count(record.partition, |a| a.duplicates += 1);
                return Ok(Outcome::Duplicate);
            }
            if change.position < held.position {
                self.count(record.partition, |a| a.stale += 1);
                return Ok(Outcome::Stale);
            }
        }
        // A snapshot read brings no row back that the log took out (deleted, or left out by the
        // filter): Debezium's incremental snapshot can send a read of a row selected before a
        // delete after that delete, at a later position (seen after a PostgreSQL restart). The
        // log has every change of a row since, so a row coming back reaches the job as its own
        // change; the read is counted as applied, changing nothing, and takes no position.
        if change.op == Op::Read
            && held.as_ref().is_some_and(|h| h.contribution.is_none())
            && matches!(new, Ok(Some(_)))
        {
            self.count(record.partition, |a| a.aggregated += 1);
            return Ok(Outcome::Aggregated);
        }
        let old = held.and_then(|h| h.contribution);
        let new = match new {
            Ok(new) => new,
            Err(poison) => {
                // The row stays as it was; its position is taken, so that a replay of this
                // change is a duplicate rather than a second dead letter.
                self.hold_row(record.partition, &change, old);
                return Ok(self.dead_letter(record, poison));
            }
        };
        if old == new {
            let filtered = matches!(change.row, Ok(Some(Evaluation::Filtered)));
            self.hold_row(record.partition, &change, old);
            self.count(record.partition, |a| {
                if filtered {
                    a.filtered += 1
                } else {
                    a.aggregated += 1
                }
            });
            return Ok(if filtered {
                Outcome::Filtered
            } else {
                Outcome::Aggregated
            });
        }
        // A new version restating from a time computes only the windows from then on; a change
        // of none of them is filtered, its row held as it now is (its later changes retract it).
        let computed = |c: &Contribution| {
            cfg.window
                .starts_of(c.event_time_ms)
                .any(|start| cfg.computes(start))
        };
        if cfg.windows_from_ms.is_some()
            && !old.as_ref().is_some_and(computed)
            && !new.as_ref().is_some_and(computed)
        {
            self.hold_row(record.partition, &change, new);
            self.count(record.partition, |a| a.filtered += 1);
            return Ok(Outcome::Filtered);
        }
        let closed = |c: &Contribution| {
            cfg.window
                .starts_of(c.event_time_ms)
                .any(|start| cfg.window_closed(start, watermark))
        };
        if old.as_ref().is_some_and(closed) || new.as_ref().is_some_and(closed) {
            let window = |c: &Option<Contribution>| match c {
                Some(c) => format!(
                    "the window starting {} ({})",
                    crate::time::format_ms(cfg.window.start_of(c.event_time_ms)),
                    if closed(c) { "closed" } else { "open" }
                ),
                None => "none".to_owned(),
            };
            let message = format!(
                "change {:?} of row {:?} at {} is late: its old window is {} and its new window is {}, at watermark {} (allowed lateness {} ms); not applied, the view keeps the row as it was",
                op_name(change.op),
                change.key.replace('\0', ","),
                change.position,
                window(&old),
                window(&new),
                crate::time::format_ms(watermark),
                cfg.allowed_lateness_ms
            );
            // Its position is taken, so that a replay of it counts as a duplicate, not late again.
            self.hold_row(record.partition, &change, old);
            return Ok(self.dead_letter(record, Poison::new(PoisonReason::Late, message)));
        }
        let windows = self.dirty_windows.entry(record.partition).or_default();
        let mut changed: SmallVec<[(WindowKey, WindowAgg, bool); 4]> = SmallVec::new();
        let mut shift = |c: &Contribution, retract: bool| -> Result<Option<String>, S::Error> {
            for start in cfg
                .window
                .starts_of(c.event_time_ms)
                .filter(|&start| cfg.computes(start))
            {
                let key = WindowKey {
                    window_start_ms: start,
                    key: c.key.clone(),
                };
                let at = match changed.iter().position(|(k, _, _)| *k == key) {
                    Some(at) => at,
                    None => {
                        let (value, new) =
                            window_value(windows, store, record.partition, &key, job)?;
                        changed.push((key, value, new));
                        changed.len() - 1
                    }
                };
                if let Err(overflow) = job.shift(&mut changed[at].1, &c.value, retract) {
                    return Ok(Some(format!(
                        "{} row {:?} {} the window starting {} would leave the range of column {}",
                        if retract { "taking" } else { "adding" },
                        change.key.replace('\0', ","),
                        if retract { "out of" } else { "to" },
                        crate::time::format_ms(start),
                        overflow.column
                    )));
                }
            }
            Ok(None)
        };
        // Out of the old windows, then into the new: all or none.
        let mut failed = None;
        if let Some(old) = &old {
            failed = shift(old, true)?;
        }
        if let (None, Some(new)) = (&failed, &new) {
            failed = shift(new, false)?;
        }
        if let Some(message) = failed {
            self.hold_row(record.partition, &change, old);
            return Ok(self.dead_letter(record, Poison::new(PoisonReason::TooLarge, message)));
        }
        for (key, value, new) in changed {
            if new {
                self.state_bytes += window_bytes(&key, &value);
            }
            windows.insert(key, value);
        }
        self.hold_row(record.partition, &change, new);
        self.count(record.partition, |a| a.aggregated += 1);
        Ok(Outcome::Aggregated)
    }

    /// A change job's row as the newest cut, the cuts in flight or the store hold it.
    fn held_row<S: StateReader>(
        &self,
        store: &S,
        partition: PartitionId,
        key: &str,
    ) -> Result<Option<SourceRow>, S::Error> {
        if let Some(row) = self
            .dirty_rows
            .get(&partition)
            .and_then(|rows| rows.get(key))
        {
            return Ok(Some(row.clone()));
        }
        store.source_row(partition, key)
    }

    /// Records a change's position and the row's contribution after it.
    fn hold_row(
        &mut self,
        partition: PartitionId,
        change: &Change,
        contribution: Option<Contribution>,
    ) {
        let row = SourceRow {
            position: change.position,
            contribution,
        };
        let bytes = change.key.len() + row.bytes();
        if self
            .dirty_rows
            .entry(partition)
            .or_default()
            .insert(change.key.clone(), row)
            .is_none()
        {
            self.state_bytes += bytes;
        }
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Create => "c",
        Op::Update => "u",
        Op::Delete => "d",
        Op::Read => "r",
        Op::Truncate => "t",
    }
}
