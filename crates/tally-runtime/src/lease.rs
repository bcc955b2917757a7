//! Which worker runs a job. Every worker joins the job's consumer group, subscribed to a
//! one-partition lease topic: the member assigned that partition runs the job, the others stand
//! by. Kafka's group protocol is the only coordinator: when the running worker stops or goes
//! silent for `job.session_timeout`, the group gives the lease to a standby, which fences the
//! previous worker's transactions, brings its state directory to the job's last commit and
//! carries on. A standby keeps its directory near that state all along (a warm standby: it
//! applies the changelog every `job.standby_refresh`), so a takeover replays only the last
//! few epochs, whatever the size of the state.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tally_kafka::{EpochProducer, EpochTopics, SourceConsumer, UnfencedProducer};
use tokio::runtime::Handle;

use crate::background::Background;
use crate::health::Readiness;
use crate::retry::wait_for;
use crate::settings::{JobSettings, TaskSettings};

/// How often the group member is polled (the group protocol is served inside polls).
const POLL: Duration = Duration::from_millis(100);

/// The worker lost the job's lease while running it: another worker runs the job now.
#[derive(Debug, thiserror::Error)]
#[error(
    "lost the lease of job {0} to another worker (this one was silent longer than job.session_timeout, or left the group); it stopped, and runs the job again only when the group gives the lease back"
)]
pub struct LostLease(pub String);

/// The lease of a running job: the group member that holds it, polled on a thread of its own
/// until dropped. Losing it sets the worker's shutdown flag.
pub struct Lease {
    member: Arc<SourceConsumer>,
    /// The producer whose `init_transactions` fenced the previous holder: the worker's first
    /// transaction uses it rather than initialising another.
    producer: Option<EpochProducer>,
    lost: Arc<AtomicBool>,
    _poller: Background,
}

impl Lease {
    /// The group member: its committed offsets and group metadata are the job's.
    pub fn member(&self) -> &Arc<SourceConsumer> {
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
/// the job's state directory.
pub(crate) fn instance_id(job: &JobSettings) -> Result<String> {
    let dir = &job.state_dir;
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

/// Joins the job's group, subscribed to its lease topic of `lease_partitions` partitions
/// (created, or grown, first). Kafka may be down or slow to come up: waited for, unless it
/// refuses this configuration.
pub(crate) fn join_group(
    job: &JobSettings,
    rt: &Handle,
    shutdown: &AtomicBool,
    lease_partitions: i32,
) -> Result<Arc<SourceConsumer>> {
    let kafka = &job.source.kafka;
    let lease_topic = &job.topics.lease;
    wait_for("kafka", shutdown, || {
        let topics = tally_kafka::check_connection(kafka, Duration::from_secs(10))?;
        // Most starts find it in place: an admin client (a new connection) only to make or grow it.
        let wanted = usize::try_from(lease_partitions).unwrap_or(usize::MAX);
        if topics.get(lease_topic).is_some_and(|&n| n >= wanted) {
            return Ok(false);
        }
        Ok(rt.block_on(tally_kafka::ensure_topic(
            kafka,
            lease_topic,
            lease_partitions,
            job.topics.replication_factor,
            &[],
        ))?)
    })?;
    Ok(Arc::new(SourceConsumer::join(
        kafka,
        &job.source.source_topic,
        &job.source.consumer_group,
        lease_topic,
        &instance_id(job)?,
        job.session_timeout,
    )?))
}

/// Joins the job's group and waits, standing by, until this worker holds the lease; then makes
/// the state directory the job's current state. `None`: asked to stop while standing by.
pub fn acquire(
    job: &Arc<JobSettings>,
    task: &TaskSettings,
    rt: &Handle,
    shutdown: &Arc<AtomicBool>,
    readiness: &Readiness,
) -> Result<Option<Lease>> {
    let lease_topic = job.topics.lease.clone();
    // Ready to fence the moment the lease is held; a client that cannot be made now is made
    // again there, where failing is retried.
    let unfenced = unfenced_producer(job, task)
        .inspect_err(
            |e| tracing::debug!(error = %e, "could not create the producer ahead of the lease"),
        )
        .ok();
    let member = join_group(job, rt, shutdown, 1)?;

    let waiting = Instant::now();
    let mut said = false;
    let mut standby = None;
    while !member.poll_membership(&lease_topic, POLL) {
        if shutdown.load(Ordering::SeqCst) {
            return Ok(None);
        }
        // A worker starting alone gets the lease within a rebalance: say nothing for that.
        if !said && waiting.elapsed() > Duration::from_secs(3) {
            tracing::info!(group = %job.source.consumer_group, "standing by: another worker of the job holds its lease");
            readiness.set_standby(true);
            said = true;
            standby = crate::standby::start_warm_standby(job, task, rt)?;
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
        let job = job.name.clone();
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
    lease.producer = Some(fence_and_make_current(job, task, rt, shutdown, unfenced)?);
    Ok(Some(lease))
}

/// Fences the previous holder of `task` and brings the state directory to
/// its last commit; returns the producer that fenced. Fencing comes first: the previous
/// holder's open transaction is aborted there, so the group's offsets and the changelog read
/// next are final.
pub(crate) fn fence_and_make_current(
    job: &JobSettings,
    task: &TaskSettings,
    rt: &Handle,
    stop: &AtomicBool,
    mut unfenced: Option<UnfencedProducer>,
) -> Result<EpochProducer> {
    let producer = wait_for("kafka", stop, || {
        Ok(unfenced
            .take()
            .map_or_else(|| unfenced_producer(job, task), Ok)
            .and_then(UnfencedProducer::fence)?)
    })?;
    // Read through a client that fetches nothing: the member's requests queue behind its
    // long-polling fetch of the lease topic.
    let source = &job.source;
    let reader =
        SourceConsumer::connect(&source.kafka, &source.source_topic, &source.consumer_group)?;
    crate::restore::make_state_current(job, task, rt, &reader, stop, true)?;
    Ok(producer)
}

/// The task's transactional producer, not yet fenced.
pub(crate) fn unfenced_producer(
    job: &JobSettings,
    task: &TaskSettings,
) -> tally_kafka::Result<UnfencedProducer> {
    UnfencedProducer::create(
        &job.source.kafka,
        &task.transactional_id,
        &EpochTopics {
            dead_letters: &job.topics.dead_letters,
            changelog: &job.topics.changelog,
            source: &job.source.source_topic,
        },
    )
}
