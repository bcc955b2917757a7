//! Fault injection for crash tests, off unless `TALLY_FAULT` is set.
//!
//! `TALLY_FAULT=<point>` SIGKILLs the process when it reaches that step of the checkpoint
//! protocol (`<point>,<point>…`: at the first of them it reaches); `TALLY_FAULT_EPOCH=<n>` (default: any) limits it to one epoch. A SIGKILL, not an exit:
//! nothing is flushed or cleaned up, exactly like `kill -9`. Unit tests of the commit protocol
//! use [`FaultPlan::crash_at`] instead: the step returns [`Crashed`], and the test drops what a
//! dead process would lose and starts again from the store.

use tally_core::Epoch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    AfterPreCommit,
    /// Pre-committed while an earlier epoch is pre-committed and not yet committed.
    TwoInFlight,
    AfterDeadLetterCommit,
    MidClickHouseInsert,
    AfterClickHouseInsert,
    DuringRestore,
    /// The server runs a fold step's insert into its stage table (seen in `system.processes`).
    FoldDuringInsert,
    /// A fold step's rows are in its stage table; none is attached to the folded table.
    FoldAfterStage,
    FoldAfterInsert,
    FoldAfterLog,
    FoldAfterInstall,
    /// The server runs a publish's insert into its stage table.
    PublishDuringInsert,
    /// A snapshot of the answer is built in the publisher's stage table, not yet installed.
    PublishAfterStage,
    /// The snapshot is installed; the stage table is not emptied yet.
    PublishAfterReplace,
    /// The epoch's Kafka transaction is aborted, not committed, and the epoch goes on as if it
    /// had committed; the kill comes once it is marked committed. Stands for a committed
    /// transaction that Kafka undid afterwards (a hanging one aborted by hand).
    KafkaCommitLost,
    /// A new version recorded that it takes the job over; the holder is not fenced yet.
    TakeoverAfterRecord,
    /// The holder's transactional ids are fenced; its read side is not.
    TakeoverAfterFence,
    /// A generation of the holder's read side is claimed and the takeover logged in it.
    TakeoverAfterClaim,
    /// The windows before `restate_from` are kept; the job's view is the holder's still.
    TakeoverAfterCopy,
    /// The job's view reads the new version; the holder's tables are not dropped yet.
    TakeoverAfterInstall,
    /// The holder's tables are dropped on the replica; the registry still names the holder.
    TakeoverDuringRetire,
}

impl FaultPoint {
    /// `TALLY_FAULT`'s points, comma-separated, as a [`FaultPlan`]'s bits.
    fn parse_all(names: &str) -> Result<u32, String> {
        let mut points = 0;
        for name in names.split(',') {
            let point = FaultPoint::ALL
                .into_iter()
                .find(|p| p.name() == name)
                .ok_or_else(|| {
                    format!(
                        "TALLY_FAULT={names:?}: {name:?} is not one of {:?}",
                        FaultPoint::ALL.map(FaultPoint::name)
                    )
                })?;
            points |= point.bit();
        }
        Ok(points)
    }

    /// The point's bit in a [`FaultPlan`] (fewer than 32 points).
    fn bit(self) -> u32 {
        1 << (self as u32)
    }

    pub const ALL: [FaultPoint; 21] = [
        FaultPoint::AfterPreCommit,
        FaultPoint::TwoInFlight,
        FaultPoint::AfterDeadLetterCommit,
        FaultPoint::MidClickHouseInsert,
        FaultPoint::AfterClickHouseInsert,
        FaultPoint::DuringRestore,
        FaultPoint::FoldDuringInsert,
        FaultPoint::FoldAfterStage,
        FaultPoint::FoldAfterInsert,
        FaultPoint::FoldAfterLog,
        FaultPoint::FoldAfterInstall,
        FaultPoint::PublishDuringInsert,
        FaultPoint::PublishAfterStage,
        FaultPoint::PublishAfterReplace,
        FaultPoint::KafkaCommitLost,
        FaultPoint::TakeoverAfterRecord,
        FaultPoint::TakeoverAfterFence,
        FaultPoint::TakeoverAfterClaim,
        FaultPoint::TakeoverAfterCopy,
        FaultPoint::TakeoverAfterInstall,
        FaultPoint::TakeoverDuringRetire,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultPoint::AfterPreCommit => "after_precommit",
            FaultPoint::TwoInFlight => "two_in_flight",
            FaultPoint::AfterDeadLetterCommit => "after_dlq_commit",
            FaultPoint::MidClickHouseInsert => "mid_clickhouse_insert",
            FaultPoint::AfterClickHouseInsert => "after_clickhouse_insert",
            FaultPoint::DuringRestore => "during_restore",
            FaultPoint::FoldDuringInsert => "fold_during_insert",
            FaultPoint::FoldAfterStage => "fold_after_stage",
            FaultPoint::FoldAfterInsert => "fold_after_insert",
            FaultPoint::FoldAfterLog => "fold_after_log",
            FaultPoint::FoldAfterInstall => "fold_after_install",
            FaultPoint::PublishDuringInsert => "publish_during_insert",
            FaultPoint::PublishAfterStage => "publish_after_stage",
            FaultPoint::PublishAfterReplace => "publish_after_replace",
            FaultPoint::KafkaCommitLost => "kafka_commit_lost",
            FaultPoint::TakeoverAfterRecord => "takeover_after_record",
            FaultPoint::TakeoverAfterFence => "takeover_after_fence",
            FaultPoint::TakeoverAfterClaim => "takeover_after_claim",
            FaultPoint::TakeoverAfterCopy => "takeover_after_copy",
            FaultPoint::TakeoverAfterInstall => "takeover_after_install",
            FaultPoint::TakeoverDuringRetire => "takeover_during_retire",
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct FaultPlan {
    /// The points armed, a bit each (by declaration order).
    points: u32,
    epoch: Option<Epoch>,
    /// Return [`Crashed`] instead of killing the process.
    unwind: bool,
}

/// A step stopped at a fault point as if the process had died there (unit tests only).
#[derive(Debug, thiserror::Error)]
#[error("fault injection: crashed at {0}")]
pub struct Crashed(pub &'static str);

impl FaultPlan {
    pub fn from_env() -> Result<FaultPlan, String> {
        let Ok(names) = std::env::var("TALLY_FAULT") else {
            return Ok(FaultPlan::default());
        };
        let points = FaultPoint::parse_all(&names)?;
        let epoch = match std::env::var("TALLY_FAULT_EPOCH") {
            Ok(e) => {
                Some(Epoch(e.parse().map_err(|_| {
                    format!("TALLY_FAULT_EPOCH={e:?} is not a number")
                })?))
            }
            Err(_) => None,
        };
        Ok(FaultPlan {
            points,
            epoch,
            unwind: false,
        })
    }

    /// A plan under which reaching `point` (at `epoch`, or any) returns [`Crashed`] from
    /// [`check`](Self::check) instead of killing the process.
    pub fn crash_at(point: FaultPoint, epoch: Option<Epoch>) -> FaultPlan {
        FaultPlan {
            points: point.bit(),
            epoch,
            unwind: true,
        }
    }

    pub fn is_armed(&self) -> bool {
        self.points != 0
    }

    /// Whether the plan targets this point (and epoch).
    pub fn targets(&self, point: FaultPoint, epoch: Epoch) -> bool {
        self.names(point) && self.epoch.is_none_or(|e| e == epoch)
    }

    /// Whether the plan names this point, at any epoch.
    pub fn names(&self, point: FaultPoint) -> bool {
        self.points & point.bit() != 0
    }

    /// Kills the process if the plan targets this point (and epoch).
    pub fn hit(&self, point: FaultPoint, epoch: Epoch) {
        if self.targets(point, epoch) {
            tracing::warn!(point = point.name(), %epoch, "fault injection: SIGKILL");
            kill_self();
        }
    }

    /// [`hit`](Self::hit), or [`Crashed`] under a [`crash_at`](Self::crash_at) plan.
    pub fn check(&self, point: FaultPoint, epoch: Epoch) -> Result<(), Crashed> {
        if self.unwind && self.targets(point, epoch) {
            return Err(Crashed(point.name()));
        }
        self.hit(point, epoch);
        Ok(())
    }
}

#[allow(unsafe_code)]
fn kill_self() {
    // SAFETY: kill(2) on our own pid has no memory-safety preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_points_are_armed_at_once_and_a_wrong_name_refused() {
        let plan = FaultPlan {
            points: FaultPoint::parse_all("takeover_after_fence,takeover_during_retire").unwrap(),
            ..FaultPlan::default()
        };
        assert!(plan.targets(FaultPoint::TakeoverAfterFence, Epoch(3)));
        assert!(plan.targets(FaultPoint::TakeoverDuringRetire, Epoch(3)));
        assert!(!plan.names(FaultPoint::TakeoverAfterClaim));
        assert!(!FaultPlan::default().is_armed());
        let all = FaultPoint::ALL.map(FaultPoint::name).join(",");
        assert_eq!(FaultPoint::parse_all(&all).unwrap().count_ones(), 21);
        let err = FaultPoint::parse_all("takeover_after_fence,nope").unwrap_err();
        assert!(err.contains("\"nope\" is not one of"), "{err}");
    }
}
