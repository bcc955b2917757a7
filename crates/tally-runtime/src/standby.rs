//! Warm standbys: a worker that does not run a task keeps a copy of its state near the job's,
//! applying the changelog every `job.standby_refresh`, so that taking the task over replays only
//! the last few epochs (Kafka Streams' standby replicas, KIP-441's warm-ups).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use tally_kafka::SourceConsumer;
use tokio::runtime::Handle;

use crate::background::Background;
use crate::settings::{JobSettings, TaskSettings};

/// How often a standby's thread looks whether it was asked to stop.
const POLL: Duration = Duration::from_millis(100);

/// A standby's state kept near the job's: every `job.standby_refresh` a thread of its own
/// catches the state directory up with the changelog (restoring it whole first, if it holds
/// nothing of the job), so that taking the lease replays only the last few epochs. Dropping the
/// guard stops and joins the thread; a whole restore in progress is abandoned.
pub(crate) fn start_warm_standby(
    job: &Arc<JobSettings>,
    task: &TaskSettings,
    rt: &Handle,
) -> Result<Option<WarmStandby>> {
    let every = job.standby_refresh;
    if every.is_zero() {
        return Ok(None);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let warm = Arc::new(AtomicBool::new(false));
    let (job, task, rt, rounds_done) = (job.clone(), task.clone(), rt.clone(), warm.clone());
    let thread = Background::spawn("tally-standby", stop.clone(), move || {
        let source = &job.source;
        let reader = match SourceConsumer::connect(
            &source.kafka,
            &source.source_topic,
            &source.consumer_group,
        ) {
            Ok(reader) => reader,
            Err(e) => {
                tracing::warn!(error = %e, "standby: no client for the group's offsets; the state is restored on taking the lease");
                return;
            }
        };
        while !stop.load(Ordering::SeqCst) {
            match crate::restore::make_state_current(&job, &task, &rt, &reader, &stop, false) {
                Ok(()) => rounds_done.store(true, Ordering::SeqCst),
                Err(e) if !stop.load(Ordering::SeqCst) => {
                    tracing::warn!(error = %format!("{e:#}"), "standby: could not bring the state up to the job's; trying again");
                }
                Err(_) => {}
            }
            let next = Instant::now() + every;
            while !stop.load(Ordering::SeqCst) && Instant::now() < next {
                std::thread::sleep(POLL);
            }
        }
    })?;
    Ok(Some(WarmStandby {
        _thread: thread,
        warm,
    }))
}

/// Starts a warm standby of each of `tasks` that has none yet (none at all when
/// `job.standby_refresh` turns standbys off).
pub(crate) fn start_standbys(
    job: &Arc<JobSettings>,
    rt: &Handle,
    standbys: &mut BTreeMap<u32, WarmStandby>,
    tasks: impl IntoIterator<Item = u32>,
) -> Result<()> {
    for task in tasks {
        if standbys.contains_key(&task) {
            continue;
        }
        match start_warm_standby(job, &job.task(task), rt)? {
            Some(standby) => standbys.insert(task, standby),
            None => break,
        };
    }
    Ok(())
}

/// A running warm standby; dropping it stops the standby's thread.
pub(crate) struct WarmStandby {
    _thread: Background,
    /// Set once a round has brought the directory up to the job's commits of that moment.
    warm: Arc<AtomicBool>,
}

/// A worker joining a job that other workers run warms its copies of every task before it
/// joins the group: the tasks the group then moves here resume after a catch-up of their last
/// few epochs, instead of pausing for a whole restore of their state (Kafka Streams' warm-up
/// replicas, KIP-441; done before joining because the assignment is librdkafka's). It joins at
/// once when nothing runs that a late join would stop: no other member, its own earlier member
/// still holding tasks (static membership gives them straight back), or a group forming
/// (workers started together share the first assignment). It stops warming and joins if the
/// other members leave. Returns the standbys, which go on for the tasks it is not given.
pub(crate) fn warm_up_before_joining(
    job: &Arc<JobSettings>,
    rt: &Handle,
    shutdown: &AtomicBool,
    reader: &SourceConsumer,
    me: &str,
) -> Result<BTreeMap<u32, WarmStandby>> {
    let mut standbys = BTreeMap::new();
    if job.standby_refresh.is_zero() {
        return Ok(standbys);
    }
    let group = &job.source.consumer_group;
    // Kafka down or slow: decided by joining, which waits for it.
    let others_running = |reader: &SourceConsumer| {
        reader
            .group_members(group, Duration::from_secs(5))
            .ok()
            .and_then(|g| {
                let mine = g.members.iter().any(|m| m.client_id.as_str() == me);
                (g.stable && !mine && !g.members.is_empty()).then_some(g.members.len())
            })
    };
    let Some(others) = others_running(reader) else {
        return Ok(standbys);
    };
    tracing::info!(
        others,
        tasks = job.tasks,
        "other workers run the job: warming this worker's copies of its tasks before joining the group"
    );
    start_standbys(job, rt, &mut standbys, 0..job.tasks)?;
    let started = Instant::now();
    let mut checked = Instant::now();
    while !shutdown.load(Ordering::SeqCst) {
        if standbys.values().all(|s| s.warm.load(Ordering::SeqCst)) {
            tracing::info!(
                millis = started.elapsed().as_millis() as u64,
                "warmed this worker's copies of the job's tasks: joining the group"
            );
            break;
        }
        if checked.elapsed() >= Duration::from_secs(2) {
            checked = Instant::now();
            if others_running(reader).is_none() {
                tracing::info!(
                    millis = started.elapsed().as_millis() as u64,
                    "the other workers left while this one warmed its copies: joining the group now"
                );
                break;
            }
        }
        std::thread::sleep(POLL);
    }
    Ok(standbys)
}

/// The tasks `me` keeps warm standbys of, from the group's assignment of the lease topic: each
/// task's standbys are on the `replicas` members after its holder in the order of the members'
/// ids (cyclic), so each task has warm copies on other workers and each worker keeps about
/// `replicas × tasks / workers` of them, however many share the job. `None` while the group
/// rebalances (no assignment to go by): the standbys stay as they are.
pub(crate) fn standby_tasks(
    me: &str,
    group: &tally_kafka::GroupMembers,
    lease_topic: &str,
    replicas: usize,
) -> Option<Vec<u32>> {
    if !group.stable {
        return None;
    }
    let mut members: Vec<&tally_kafka::GroupMember> = group.members.iter().collect();
    members.sort_by(|a, b| a.client_id.cmp(&b.client_id));
    let mut mine = Vec::new();
    for (i, holder) in members.iter().enumerate() {
        let keeps = (1..members.len())
            .take(replicas)
            .any(|k| members[(i + k) % members.len()].client_id == me);
        if !keeps || holder.client_id == me {
            continue;
        }
        mine.extend(
            holder
                .assigned
                .iter()
                .filter(|(topic, _)| topic == lease_topic)
                .filter_map(|(_, p)| u32::try_from(*p).ok()),
        );
    }
    mine.sort_unstable();
    Some(mine)
}

#[cfg(test)]
mod tests {
    use super::standby_tasks;
    use tally_kafka::{GroupMember, GroupMembers};

    fn group(stable: bool, members: &[(&str, &[i32])]) -> GroupMembers {
        GroupMembers {
            stable,
            members: members
                .iter()
                .map(|(id, leases)| GroupMember {
                    client_id: (*id).into(),
                    assigned: leases.iter().map(|p| ("job.lease".into(), *p)).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn each_task_has_one_standby_on_another_worker() {
        // Listed out of order: the placement goes by the members' ids.
        let g = group(true, &[("c", &[2, 5]), ("a", &[0, 3]), ("b", &[1, 4])]);
        let placed: Vec<Vec<u32>> = ["a", "b", "c"]
            .iter()
            .map(|me| standby_tasks(me, &g, "job.lease", 1).unwrap_or_default())
            .collect();
        assert_eq!(placed, vec![vec![2, 5], vec![0, 3], vec![1, 4]]);
        // Every task exactly once, never on its holder.
        let mut all: Vec<u32> = placed.concat();
        all.sort_unstable();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
    }

    #[test]
    fn two_workers_keep_each_other_s_tasks_and_one_keeps_none() {
        let g = group(true, &[("a", &[0, 2]), ("b", &[1, 3])]);
        assert_eq!(standby_tasks("a", &g, "job.lease", 1), Some(vec![1, 3]));
        assert_eq!(standby_tasks("b", &g, "job.lease", 1), Some(vec![0, 2]));
        let alone = group(true, &[("a", &[0, 1, 2, 3])]);
        assert_eq!(standby_tasks("a", &alone, "job.lease", 1), Some(vec![]));
        // Not yet a member (warming up before it joins): no placement for it.
        assert_eq!(standby_tasks("z", &g, "job.lease", 1), Some(vec![]));
    }

    #[test]
    fn more_replicas_go_to_the_next_members_and_never_to_the_holder() {
        let g = group(true, &[("a", &[0]), ("b", &[1]), ("c", &[2])]);
        let placed = |me, replicas| standby_tasks(me, &g, "job.lease", replicas).unwrap();
        assert_eq!(placed("a", 2), vec![1, 2]);
        assert_eq!(placed("b", 2), vec![0, 2]);
        // More replicas than other workers: every other worker keeps one, no more.
        assert_eq!(placed("c", 5), vec![0, 1]);
        assert_eq!(placed("c", 0), Vec::<u32>::new());
    }

    #[test]
    fn a_rebalancing_group_changes_nothing() {
        let g = group(false, &[("a", &[]), ("b", &[])]);
        assert_eq!(standby_tasks("a", &g, "job.lease", 1), None);
        // Partitions of other topics are not tasks.
        let mut other = group(true, &[("a", &[0]), ("b", &[])]);
        other.members[0].assigned.push(("source".into(), 7));
        assert_eq!(standby_tasks("b", &other, "job.lease", 1), Some(vec![0]));
    }
}
