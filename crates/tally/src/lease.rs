//! Which worker runs a job. Every worker joins the job's consumer group, subscribed to a
//! one-partition lease topic: the member assigned that partition runs the job, the others stand
//! by. Kafka's group protocol is the only coordinator: when the running worker stops or goes
//! silent for `job.session_timeout`, the group gives the lease to a standby, which fences the
//! previous worker's transactions, brings its state directory to the job's last commit and
//! carries on. A standby keeps its directory near that state all along (a warm standby: it
//! applies the changelog every `job.standby_refresh`), so a takeover replays only the last
//! few epochs, whatever the size of the state.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tally_core::PartitionId;
use tally_kafka::{CommitMark, EpochProducer, EpochTopics, Source, UnfencedProducer};
use tally_state::{StateError, StateStore};
use tokio::runtime::Handle;

use crate::background::Background;
use crate::config::Config;
use crate::health::Readiness;
use crate::worker::wait_for;

/// How often the group member is polled (the group protocol is served inside polls).
const POLL: Duration = Duration::from_millis(100);
/// How often a worker of a shared job re-reads the group's assignment to place its standbys.
const STANDBY_PLACEMENT: Duration = Duration::from_secs(5);

/// The worker lost the job's lease while running it: another worker runs the job now.
#[derive(Debug, thiserror::Error)]
#[error(
    "lost the lease of job {0} to another worker (this one was silent longer than job.session_timeout, or left the group); it stopped, and runs the job again only when the group gives the lease back"
)]
pub struct LostLease(pub String);

/// The lease of a running job: the group member that holds it, polled on a thread of its own
/// until dropped. Losing it sets the worker's shutdown flag.
pub struct Lease {
    member: Arc<Source>,
    /// The producer whose `init_transactions` fenced the previous holder: the worker's first
    /// transaction uses it rather than initialising another.
    producer: Option<EpochProducer>,
    lost: Arc<AtomicBool>,
    _poller: Background,
}

impl Lease {
    /// The group member: its committed offsets and group metadata are the job's.
    pub fn member(&self) -> &Arc<Source> {
        &self.member
    }

    pub fn take_producer(&mut self) -> Option<EpochProducer> {
        self.producer.take()
    }

    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
}

/// This worker's static member id in the job's group: stable across restarts of the same
/// worker (so it gets its lease straight back), distinct between workers: the host name and
/// the state directory.
fn instance_id(config: &Config) -> Result<String> {
    let dir = &config.job.state_dir;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let dir = std::fs::canonicalize(dir)
        .with_context(|| format!("resolving state directory {}", dir.display()))?;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into());
    Ok(format!("tally@{}:{}", host.trim(), dir.display()))
}

/// For [`wait_for`]: a refused configuration is returned, any other failure waited out.
fn settle<T>(result: Result<T, tally_kafka::Error>) -> Result<Result<T>, String> {
    match result {
        Ok(value) => Ok(Ok(value)),
        Err(e @ tally_kafka::Error::Refused(_)) => Ok(Err(e.into())),
        Err(e) => Err(e.to_string()),
    }
}

/// The first partition whose offsets were last committed by a writer that is neither this
/// directory's nor the one it was restored from (up to the epoch it restored).
pub fn foreign_mark(
    marks: &BTreeMap<PartitionId, CommitMark>,
    store: &StateStore,
) -> Result<Option<(PartitionId, CommitMark)>, StateError> {
    let ours = store.writer_id();
    let adopted = store.adopted_writer()?;
    Ok(marks
        .iter()
        .find(|(_, mark)| {
            mark.writer.as_deref().is_some_and(|w| {
                w != ours
                    && adopted
                        .as_ref()
                        .is_none_or(|(a, epoch)| a != w || mark.epoch > *epoch)
            })
        })
        .map(|(p, m)| (*p, m.clone())))
}

/// [`commit_marks`] through a client of its own.
pub fn job_commit_marks(config: &Config) -> Result<BTreeMap<PartitionId, CommitMark>> {
    let reader = Source::connect(
        &config.kafka_settings(),
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
    )?;
    commit_marks(&reader, config)
}

/// The group's committed offsets of the source partitions `config` runs, each with the mark of
/// its transaction.
pub fn commit_marks(member: &Source, config: &Config) -> Result<BTreeMap<PartitionId, CommitMark>> {
    Ok(committed_offsets(member, config)?
        .into_iter()
        .map(|(p, (_, mark))| (p, mark))
        .collect())
}

/// [`commit_marks`] with each partition's committed offset.
pub fn committed_offsets(
    member: &Source,
    config: &Config,
) -> Result<BTreeMap<PartitionId, (i64, CommitMark)>> {
    let partitions: Vec<PartitionId> = member
        .partitions()?
        .into_iter()
        .filter(|p| config.owns(*p))
        .collect();
    let committed = member.committed(&partitions).inspect_err(|error| {
        if matches!(error, tally_kafka::Error::UnstableOffsets { .. }) {
            crate::events::OffsetsHeldByOpenTransaction {
                error,
                brokers: &config.kafka.brokers,
                transactional_id: &config.transactional_id(),
                task: config.job.task,
            }
            .emit();
        }
    })?;
    Ok(committed
        .into_iter()
        .filter_map(|(p, (offset, metadata))| Some((p, (offset?, CommitMark::parse(&metadata)?))))
        .collect())
}

/// Joins the job's group, subscribed to its lease topic of `lease_partitions` partitions
/// (created, or grown, first). Kafka may be down or slow to come up: waited for, unless it
/// refuses this configuration.
fn join_group(
    config: &Config,
    rt: &Handle,
    shutdown: &AtomicBool,
    lease_partitions: i32,
) -> Result<Arc<Source>> {
    let kafka = config.kafka_settings();
    let lease_topic = config.lease_topic();
    wait_for("kafka", shutdown, || {
        let topics = match settle(tally_kafka::check_connection(
            &kafka,
            Duration::from_secs(10),
        ))? {
            Ok(topics) => topics,
            Err(refused) => return Ok(Err(refused)),
        };
        // Most starts find it in place: an admin client (a new connection) only to make or grow it.
        let wanted = usize::try_from(lease_partitions).unwrap_or(usize::MAX);
        if topics.get(&lease_topic).is_some_and(|&n| n >= wanted) {
            return Ok(Ok(false));
        }
        settle(rt.block_on(tally_kafka::ensure_topic(
            &kafka,
            &lease_topic,
            lease_partitions,
            config.kafka.topic_replication_factor,
            &[],
        )))
    })??;
    Ok(Arc::new(Source::join(
        &kafka,
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
        &lease_topic,
        &instance_id(config)?,
        config.job.session_timeout.as_duration(),
    )?))
}

/// Joins the job's group and waits, standing by, until this worker holds the lease; then makes
/// the state directory the job's current state. `None`: asked to stop while standing by.
pub fn acquire(
    config: &Config,
    rt: &Handle,
    shutdown: &Arc<AtomicBool>,
    readiness: &Readiness,
) -> Result<Option<Lease>> {
    let lease_topic = config.lease_topic();
    // Ready to fence the moment the lease is held; a client that cannot be made now is made
    // again there, where failing is retried.
    let unfenced = unfenced_producer(config)
        .inspect_err(
            |e| tracing::debug!(error = %e, "could not create the producer ahead of the lease"),
        )
        .ok();
    let member = join_group(config, rt, shutdown, 1)?;

    let waiting = Instant::now();
    let mut said = false;
    let mut standby = None;
    while !member.poll_membership(&lease_topic, POLL) {
        if shutdown.load(Ordering::SeqCst) {
            return Ok(None);
        }
        // A worker starting alone gets the lease within a rebalance: say nothing for that.
        if !said && waiting.elapsed() > Duration::from_secs(3) {
            tracing::info!(group = %config.kafka.consumer_group, "standing by: another worker of the job holds its lease");
            readiness.set_standby(true);
            said = true;
            standby = start_warm_standby(config, rt)?;
        }
    }
    readiness.set_standby(false);
    tracing::info!(
        waited_ms = waiting.elapsed().as_millis() as u64,
        "holding the job's lease"
    );
    // From here on the member is polled on its own thread, also while a long restore runs
    // (a member not polled for max.poll.interval.ms leaves the group).
    let lost = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (member, lost, shutdown) = (member.clone(), lost.clone(), shutdown.clone());
        let job = config.job.name.clone();
        Background::spawn("tally-member", stop.clone(), move || {
            while !stop.load(Ordering::SeqCst) {
                let held = member.poll_membership(&lease_topic, POLL);
                if !held && !lost.swap(true, Ordering::SeqCst) {
                    tracing::error!("{}", LostLease(job.clone()));
                    shutdown.store(true, Ordering::SeqCst);
                }
            }
        })?
    };
    let mut lease = Lease {
        member,
        producer: None,
        lost,
        _poller: poller,
    };
    // Its round in progress ends first: the directory is then between two committed epochs.
    drop(standby);
    lease.producer = Some(fence_and_make_current(config, rt, shutdown, unfenced)?);
    Ok(Some(lease))
}

/// Fences the previous holder of `config`'s job (or task) and brings the state directory to
/// its last commit; returns the producer that fenced. Fencing comes first: the previous
/// holder's open transaction is aborted there, so the group's offsets and the changelog read
/// next are final.
fn fence_and_make_current(
    config: &Config,
    rt: &Handle,
    stop: &AtomicBool,
    mut unfenced: Option<UnfencedProducer>,
) -> Result<EpochProducer> {
    let kafka = config.kafka_settings();
    let producer = wait_for("kafka", stop, || {
        settle(
            unfenced
                .take()
                .map_or_else(|| unfenced_producer(config), Ok)
                .and_then(UnfencedProducer::fence),
        )
    })??;
    // Read through a client that fetches nothing: the member's requests queue behind its
    // long-polling fetch of the lease topic.
    let reader = Source::connect(
        &kafka,
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
    )?;
    make_state_current(config, rt, &reader, stop, true)?;
    Ok(producer)
}

/// The job's (or task's) transactional producer, not yet fenced.
pub(crate) fn unfenced_producer(config: &Config) -> tally_kafka::Result<UnfencedProducer> {
    UnfencedProducer::create(
        &config.kafka_settings(),
        &config.transactional_id(),
        &EpochTopics {
            dead_letters: &config.dlq_topic(),
            changelog: &config.changelog_topic(),
            source: &config.kafka.source_topic,
        },
    )
}

/// Keeps the state directory if it holds the job's state (the commits are its own, or those of
/// the writer it was restored from, up to the last); catches it up with the changelog if it
/// holds an earlier committed state; otherwise moves it aside and restores the job's state from
/// the changelog. `taking_over`: this worker fenced the previous one and runs the job next; a
/// standby's rounds pass false. `stop` interrupts a whole restore (nothing is left behind).
pub fn make_state_current(
    config: &Config,
    rt: &Handle,
    reader: &Source,
    stop: &AtomicBool,
    taking_over: bool,
) -> Result<()> {
    let marks = wait_for("kafka", stop, || {
        commit_marks(reader, config).map_err(|e| format!("{e:#}"))
    })?;
    if marks.is_empty() {
        // A new job (or one started over): nothing to restore.
        return Ok(());
    }
    let dir = &config.job.state_dir;
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating state directory {}", dir.display()))?;
    let (local, foreign, replica) = {
        let store = StateStore::open(dir, &config.state_identity())?;
        let ours = store.writer_id().to_owned();
        // The last commit is the writer's this directory was restored from: the batch of
        // that epoch may still be missing in ClickHouse, which a catch-up checks.
        let replica = marks
            .values()
            .any(|m| m.writer.as_deref().is_some_and(|w| w != ours));
        (
            store.meta().map(|m| m.epoch),
            foreign_mark(&marks, &store)?,
            replica,
        )
    };
    match (local, foreign) {
        (Some(_), None) if !(taking_over && replica) => return Ok(()),
        (None, _) => {}
        (Some(epoch), foreign) => {
            if let Some(done) = try_catch_up(config, rt, &marks, stop, taking_over)? {
                crate::events::StateRestored {
                    restored: &done,
                    whole: false,
                    taking_over,
                    task: config.job.task,
                }
                .emit();
                return Ok(());
            }
            let aside = crate::restore::sibling(dir, &format!("stale-epoch-{epoch}"));
            let (partition, mark) = foreign.unzip();
            tracing::warn!(
                partition,
                committed_epoch = %mark.as_ref().map_or(epoch, |m| m.epoch),
                writer = mark.as_ref().and_then(|m| m.writer.as_deref()).unwrap_or(""),
                moved_to = %aside.display(),
                "the state directory cannot be caught up with the job's changelog: moving it aside and restoring the job's state whole"
            );
            if aside.exists() {
                std::fs::remove_dir_all(&aside)
                    .with_context(|| format!("removing {}", aside.display()))?;
            }
            std::fs::rename(dir, &aside).with_context(|| {
                format!("moving {} aside to {}", dir.display(), aside.display())
            })?;
        }
    }
    // A service failing mid-restore is waited out (a failed attempt leaves nothing behind);
    // a changelog that cannot give the job's state stops the worker with the reason.
    let done = wait_for(
        "the changelog restore",
        stop,
        || match crate::restore::restore(config, rt, &marks, Some(stop), taking_over) {
            Ok(done) => Ok(Ok(done)),
            Err(e) if crate::restore::is_transient(&e) => Err(format!("{e:#}")),
            Err(e) => Ok(Err(e.context(
                "restoring the job's state from the changelog on taking its lease",
            ))),
        },
    )??;
    crate::events::StateRestored {
        restored: &done,
        whole: true,
        taking_over,
        task: config.job.task,
    }
    .emit();
    Ok(())
}

/// A catch-up, with a failing service waited out. `None`: the directory needs a whole restore
/// (it cannot be caught up, or the changelog does not continue its state).
fn try_catch_up(
    config: &Config,
    rt: &Handle,
    marks: &BTreeMap<PartitionId, CommitMark>,
    stop: &AtomicBool,
    taking_over: bool,
) -> Result<Option<crate::restore::Restored>> {
    wait_for(
        "the changelog catch-up",
        stop,
        || match crate::restore::catch_up(config, rt, marks, taking_over) {
            Ok(done) => Ok(Ok(done)),
            Err(e) if crate::restore::is_transient(&e) => Err(format!("{e:#}")),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the state directory cannot be caught up with the changelog");
                Ok(Ok(None))
            }
        },
    )?
}

/// A standby's state kept near the job's: every `job.standby_refresh` a thread of its own
/// catches the state directory up with the changelog (restoring it whole first, if it holds
/// nothing of the job), so that taking the lease replays only the last few epochs. Dropping the
/// guard stops and joins the thread; a whole restore in progress is abandoned.
fn start_warm_standby(config: &Config, rt: &Handle) -> Result<Option<WarmStandby>> {
    let every = config.job.standby_refresh.as_duration();
    if every.is_zero() {
        return Ok(None);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let warm = Arc::new(AtomicBool::new(false));
    let (config, rt, rounds_done) = (config.clone(), rt.clone(), warm.clone());
    let thread = Background::spawn("tally-standby", stop.clone(), move || {
        let reader = match Source::connect(
            &config.kafka_settings(),
            &config.kafka.source_topic,
            &config.kafka.consumer_group,
        ) {
            Ok(reader) => reader,
            Err(e) => {
                tracing::warn!(error = %e, "standby: no client for the group's offsets; the state is restored on taking the lease");
                return;
            }
        };
        while !stop.load(Ordering::SeqCst) {
            match make_state_current(&config, &rt, &reader, &stop, false) {
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
fn start_standbys(
    config: &Config,
    rt: &Handle,
    standbys: &mut BTreeMap<u32, WarmStandby>,
    tasks: impl IntoIterator<Item = u32>,
) -> Result<()> {
    for task in tasks {
        if standbys.contains_key(&task) {
            continue;
        }
        match start_warm_standby(&config.for_task(task), rt)? {
            Some(standby) => standbys.insert(task, standby),
            None => break,
        };
    }
    Ok(())
}

/// A running warm standby; dropping it stops the standby's thread.
struct WarmStandby {
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
fn warm_up_before_joining(
    config: &Config,
    rt: &Handle,
    shutdown: &AtomicBool,
    reader: &Source,
    me: &str,
) -> Result<BTreeMap<u32, WarmStandby>> {
    let mut standbys = BTreeMap::new();
    if config.job.standby_refresh.as_duration().is_zero() {
        return Ok(standbys);
    }
    let group = &config.kafka.consumer_group;
    // Kafka down or slow: decided by joining, which waits for it.
    let others_running = |reader: &Source| {
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
        tasks = config.tasks(),
        "other workers run the job: warming this worker's copies of its tasks before joining the group"
    );
    start_standbys(config, rt, &mut standbys, 0..config.tasks())?;
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
fn standby_tasks(
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

/// How to stop a running task, and whether its thread has ended.
#[derive(Clone)]
struct TaskEnd {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
}

/// Sets its flag when dropped: when the task's thread ends, however it ends.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A task of a shared job running on this worker.
struct RunningTask {
    end: TaskEnd,
    /// The task's own: the worker's `/ready` says ready once every task it runs is.
    readiness: Arc<Readiness>,
    thread: std::thread::JoinHandle<Result<()>>,
}

/// Runs a job of several tasks (`job.tasks > 1`) until SIGTERM: joins the job's group
/// subscribed to the lease topic, one partition per task, and runs every task the group
/// assigns this worker, each on a thread of its own, exactly as a one-task job runs (fence
/// the task's previous holder with `init_transactions` on the task's transactional id,
/// bring its state directory to the task's last commit, consume and commit). A task the group
/// takes away stops (a final checkpoint, unless its new holder fenced it first); its new
/// holder carries on from the task's last commit. At SIGTERM every task takes its final
/// checkpoint, then the worker leaves the group.
pub fn share(
    config: &Config,
    rt: &Handle,
    shutdown: &Arc<AtomicBool>,
    readiness: &Arc<Readiness>,
    signals: &crate::read_side::CommitSignals,
) -> Result<()> {
    let lease_topic = config.lease_topic();
    let tasks = config.tasks();
    readiness.set_standby(true);
    // The group's description (who is in it, who holds which task) is read through a client of
    // its own: the member's requests queue behind its long-polling fetch.
    let me = instance_id(config)?;
    let describer = Source::connect(
        &config.kafka_settings(),
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
    )?;
    // Warm standbys of the tasks this worker does not run (`job.standby_refresh`), so that a
    // task moving here replays only its last few epochs.
    let mut standbys = warm_up_before_joining(config, rt, shutdown, &describer, &me)?;
    let member = join_group(
        config,
        rt,
        shutdown,
        i32::try_from(tasks).unwrap_or(i32::MAX),
    )?;
    let mut running: BTreeMap<u32, RunningTask> = BTreeMap::new();
    // A task the group takes away finishes its epochs before the group may give it to another
    // worker: its final checkpoint commits, and the next holder continues from it instead of
    // fencing it and redoing its epoch in flight.
    let draining: Arc<std::sync::Mutex<BTreeMap<u32, TaskEnd>>> = Arc::default();
    {
        let draining = draining.clone();
        let bound = config.job.session_timeout.as_duration() * 3;
        member.on_revoke(move |partitions| {
            let ends: Vec<(u32, TaskEnd)> = {
                let tasks = draining
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                partitions
                    .iter()
                    .filter_map(|p| u32::try_from(*p).ok())
                    .filter_map(|t| tasks.get(&t).map(|e| (t, e.clone())))
                    .collect()
            };
            let started = Instant::now();
            for (task, end) in &ends {
                if !end.stop.swap(true, Ordering::SeqCst) {
                    tracing::info!(task, "task moved to another worker: finishing its epochs before handing it over");
                }
            }
            while !ends.iter().all(|(_, e)| e.done.load(Ordering::SeqCst)) {
                if started.elapsed() > bound {
                    tracing::warn!(tasks = ?ends.iter().map(|(t, _)| t).collect::<Vec<_>>(), "tasks did not finish their epochs in time: handing them over anyway (their next holder fences them)");
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if !ends.is_empty() {
                tracing::info!(millis = started.elapsed().as_millis() as u64, "handed tasks over");
            }
        });
    }
    let mut held_before: Vec<u32> = Vec::new();
    let mut failures: BTreeMap<u32, Instant> = BTreeMap::new();
    // Which tasks to keep standbys of comes from the group's description.
    let mut wanted: Option<Vec<u32>> = None;
    let mut placed_before: Option<(Vec<u32>, Vec<u32>)> = None;
    let mut described: Option<Instant> = None;
    while !shutdown.load(Ordering::SeqCst) {
        let held: Vec<u32> = member
            .poll_leases(&lease_topic, POLL)
            .into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .filter(|t| *t < tasks)
            .collect();
        if held != held_before {
            tracing::info!(tasks = ?held, of = tasks, "the group assigned this worker its tasks");
            held_before.clone_from(&held);
        }
        // Taken away: stop it; its thread ends with a final checkpoint or fenced.
        for (task, run) in &running {
            if !held.contains(task) && !run.end.stop.swap(true, Ordering::SeqCst) {
                tracing::info!(task, "task moved to another worker: stopping it here");
            }
        }
        // Ended: joined; one that failed while still held starts again after a pause.
        let ended: Vec<u32> = running
            .iter()
            .filter(|(_, r)| r.thread.is_finished())
            .map(|(t, _)| *t)
            .collect();
        for task in ended {
            let Some(run) = running.remove(&task) else {
                continue;
            };
            draining
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&task);
            let moved = run.end.stop.load(Ordering::SeqCst);
            match run.thread.join() {
                Ok(Ok(())) => tracing::info!(task, "task stopped"),
                Ok(Err(e)) if moved => {
                    tracing::info!(task, error = %format!("{e:#}"), "task stopped after it moved (its new holder fenced it)")
                }
                Ok(Err(e)) => {
                    tracing::error!(task, error = %format!("{e:#}"), "task failed; starting it again in 5 s");
                    failures.insert(task, Instant::now());
                }
                Err(_) => {
                    tracing::error!(task, "task thread panicked; starting it again in 5 s");
                    failures.insert(task, Instant::now());
                }
            }
        }
        for &task in &held {
            let waiting = failures
                .get(&task)
                .is_some_and(|at| at.elapsed() < Duration::from_secs(5));
            if running.contains_key(&task) || waiting {
                continue;
            }
            failures.remove(&task);
            // Its standby round in progress ends first: the directory is then between two
            // committed epochs.
            drop(standbys.remove(&task));
            let run = start_task(config, rt, &member, task, signals.clone())?;
            draining
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(task, run.end.clone());
            running.insert(task, run);
        }
        if described.is_none_or(|at| at.elapsed() >= STANDBY_PLACEMENT) {
            described = Some(Instant::now());
            if let Some(placed) = describer
                .group_members(&config.kafka.consumer_group, POLL * 20)
                .ok()
                .and_then(|g| standby_tasks(&me, &g, &lease_topic, config.standby_replicas()))
                && wanted.as_ref() != Some(&placed)
            {
                tracing::info!(tasks = ?placed, "keeping warm standbys of these tasks");
                wanted = Some(placed);
            }
        }
        // Until the group has been described: standbys of every task not run here.
        let keep = |task: &u32| {
            !held.contains(task)
                && !running.contains_key(task)
                && wanted.as_ref().is_none_or(|w| w.contains(task))
        };
        standbys.retain(|task, _| keep(task));
        start_standbys(config, rt, &mut standbys, (0..tasks).filter(|t| keep(t)))?;
        let placed: (Vec<u32>, Vec<u32>) = (
            running.keys().copied().collect(),
            standbys.keys().copied().collect(),
        );
        if placed_before.as_ref() != Some(&placed) {
            crate::events::TasksPlaced {
                tasks,
                running: &placed.0,
                standbys: &placed.1,
            }
            .emit();
            placed_before = Some(placed);
        }
        readiness.aggregate(running.values().map(|r| r.readiness.as_ref()));
        readiness.set_standby(running.is_empty());
    }
    drop(standbys);
    for run in running.values() {
        run.end.stop.store(true, Ordering::SeqCst);
    }
    let mut outcome = Ok(());
    for (task, run) in running {
        match run.thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.is::<crate::worker::Interrupted>() => {
                tracing::info!(task, "stopped before the task's first record: {e:#}")
            }
            Ok(Err(e)) => {
                tracing::error!(task, error = %format!("{e:#}"), "task failed at stop");
                outcome = Err(e);
            }
            Err(_) => outcome = Err(anyhow::anyhow!("task {task}'s thread panicked")),
        }
    }
    leave_group(member, config.job.session_timeout.as_duration() * 3);
    outcome
}

/// Closes the group member (its final revocation, then leaving), waiting at most `within`: a
/// close librdkafka never finishes (as in its #4041) must not keep a stopped worker from
/// exiting. Not finished in time, it is left behind: the group drops a member that went
/// silent after its session timeout.
fn leave_group(member: Arc<Source>, within: Duration) {
    let (closed, wait) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("tally-leave".into())
        .spawn(move || {
            drop(member);
            let _ = closed.send(());
        });
    if spawned.is_ok() && wait.recv_timeout(within).is_err() {
        tracing::warn!(
            waited_ms = within.as_millis() as u64,
            "the group member did not finish closing: exiting without it (the group drops it after job.session_timeout)"
        );
    }
}

/// Starts task `task` on a thread of its own: fences the task's previous holder, makes its
/// state directory current and runs it until `stop`.
fn start_task(
    config: &Config,
    rt: &Handle,
    member: &Arc<Source>,
    task: u32,
    signals: crate::read_side::CommitSignals,
) -> Result<RunningTask> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let readiness = Arc::new(Readiness::default());
    let config = config.for_task(task);
    let (rt, member, flag, ready) = (rt.clone(), member.clone(), stop.clone(), readiness.clone());
    let ended = SetOnDrop(done.clone());
    let thread = std::thread::Builder::new()
        .name(format!("tally-task-{task}"))
        .spawn(move || -> Result<()> {
            let _ended = ended;
            tracing::info!(task, state_dir = %config.job.state_dir.display(), "starting task");
            let producer = fence_and_make_current(&config, &rt, &flag, None)?;
            crate::worker::Worker::start(config, rt, flag, ready, member, Some(producer), signals)?
                .run()
        })
        .context("starting a task thread")?;
    Ok(RunningTask {
        end: TaskEnd { stop, done },
        readiness,
        thread,
    })
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
