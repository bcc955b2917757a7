//! The pre-commit: an epoch's cut made durable in RocksDB, with its offsets and outputs, in one
//! synced write batch. From then on the store answers for the epoch, and a restart completes it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use anyhow::Result;
use tally_core::{Checkpoint, EpochCut, PartitionId};
use tally_state::changelog::EpochLiveness;
use tally_state::{EncodedRecord, StateStore};

use crate::events::{BarrierPause, EpochBytes};
use crate::fault::{FaultPlan, FaultPoint};

/// An epoch durable in the store: what the sinks need of it.
pub struct PreCommitted {
    pub checkpoint: Checkpoint,
    pub changelog: Vec<EncodedRecord>,
    pub liveness: BTreeMap<PartitionId, EpochLiveness>,
    pub bytes: EpochBytes,
    pub took: Duration,
}

impl PreCommitted {
    /// Pre-commits `cut` in `store`. The sinks do not need the ids (the largest part of an
    /// epoch): they go from the cut to the store without a copy.
    pub fn of(store: &StateStore, cut: &EpochCut) -> Result<PreCommitted> {
        let started = Instant::now();
        let checkpoint = cut.to_checkpoint_without_ids();
        let changelog = tally_state::changelog::encode_epoch(cut)?;
        let state = store.pre_commit_with_seen(
            &checkpoint,
            cut.seen_ids(),
            cut.source_rows(),
            &changelog,
        )?;
        let bytes = EpochBytes {
            state,
            changelog: changelog.iter().map(|(_, b)| b.len()).sum(),
        };
        let liveness = tally_state::changelog::liveness_of_cut(cut);
        Ok(PreCommitted {
            checkpoint,
            changelog,
            liveness,
            bytes,
            took: started.elapsed(),
        })
    }
}

/// An epoch on its way from the barrier to the store.
pub struct Handoff {
    pub cut: Arc<EpochCut>,
    pub barrier_at: Instant,
    pub pause: BarrierPause,
}

/// A pre-committed epoch on its way to the sinks.
pub struct Persisted {
    pub epoch: PreCommitted,
    pub barrier_at: Instant,
    pub pause: BarrierPause,
}

/// Pre-commits the cuts the operator hands over, in order, on a thread of its own.
pub struct Persister {
    pub store: Arc<StateStore>,
    pub fault: FaultPlan,
    /// The newest epoch pre-committed, for the operator.
    pub precommitted: Arc<AtomicU64>,
}

impl Persister {
    pub fn run(self, handoffs: Receiver<Handoff>, persisted: Sender<Persisted>) -> Result<()> {
        for handoff in handoffs {
            let epoch = PreCommitted::of(&self.store, &handoff.cut)?;
            let number = epoch.checkpoint.epoch;
            // The operator's reference is then the last: it frees the cut off this thread.
            let Handoff {
                cut,
                barrier_at,
                pause,
            } = handoff;
            drop(cut);
            self.precommitted.store(number.0, Ordering::Release);
            self.fault.hit(FaultPoint::AfterPreCommit, number);
            if self.fault.is_armed() {
                // Under the store's lock: the sink thread must not commit the older epoch
                // between the count and the kill.
                self.store.with_pending_epochs(|pending| {
                    if pending.len() >= 2 {
                        self.fault.hit(FaultPoint::TwoInFlight, number);
                    }
                })?;
            }
            let next = Persisted {
                epoch,
                barrier_at,
                pause,
            };
            if persisted.send(next).is_err() {
                // The sink thread stopped (shutdown or error); the epoch stays pre-committed.
                break;
            }
        }
        Ok(())
    }
}
