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
use tally_kafka::{CommitMark, EpochProducer, EpochTopics, Source};
use tally_state::{StateError, StateStore};
use tokio::runtime::Handle;

use crate::background::Background;
use crate::config::Config;
use crate::health::Readiness;
use crate::worker::wait_for;

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

/// The group's committed offsets of the source topic, each with the mark of its transaction.
pub fn commit_marks(member: &Source) -> Result<BTreeMap<PartitionId, CommitMark>> {
    Ok(member
        .committed(&member.partitions()?)?
        .into_iter()
        .filter_map(|(p, (_, metadata))| Some((p, CommitMark::parse(&metadata)?)))
        .collect())
}

/// Joins the job's group and waits, standing by, until this worker holds the lease; then makes
/// the state directory the job's current state. `None`: asked to stop while standing by.
pub fn acquire(
    config: &Config,
    rt: &Handle,
    shutdown: &Arc<AtomicBool>,
    readiness: &Readiness,
) -> Result<Option<Lease>> {
    let kafka = config.kafka_settings();
    let lease_topic = config.lease_topic();
    // Kafka may be down or slow to come up: wait for it, unless it refuses this configuration.
    wait_for("kafka", shutdown, || {
        if let Err(refused) = settle(tally_kafka::check_connection(
            &kafka,
            Duration::from_secs(10),
        ))? {
            return Ok(Err(refused));
        }
        settle(rt.block_on(tally_kafka::ensure_topic(
            &kafka,
            &lease_topic,
            1,
            config.kafka.topic_replication_factor,
            &[],
        )))
    })??;
    let member = Arc::new(Source::join(
        &kafka,
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
        &lease_topic,
        &instance_id(config)?,
        config.job.session_timeout.as_duration(),
    )?);

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
    // Fence the previous holder first: its open transaction is aborted here, so the group's
    // offsets and the changelog read below are final.
    let producer = wait_for("kafka", shutdown, || {
        settle(EpochProducer::connect(
            &kafka,
            &config.transactional_id(),
            &EpochTopics {
                dead_letters: &config.dlq_topic(),
                changelog: &config.changelog_topic(),
                source: &config.kafka.source_topic,
            },
        ))
    })??;
    // Read through a client that fetches nothing: the member's requests queue behind its
    // long-polling fetch of the lease topic.
    let reader = Source::connect(
        &kafka,
        &config.kafka.source_topic,
        &config.kafka.consumer_group,
    )?;
    make_state_current(config, rt, &reader, shutdown, true)?;
    lease.producer = Some(producer);
    Ok(Some(lease))
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
        commit_marks(reader).map_err(|e| format!("{e:#}"))
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
fn start_warm_standby(config: &Config, rt: &Handle) -> Result<Option<Background>> {
    let every = config.job.standby_refresh.as_duration();
    if every.is_zero() {
        return Ok(None);
    }
    let stop = Arc::new(AtomicBool::new(false));
    let (config, rt) = (config.clone(), rt.clone());
    Background::spawn("tally-standby", stop.clone(), move || {
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
            if let Err(e) = make_state_current(&config, &rt, &reader, &stop, false)
                && !stop.load(Ordering::SeqCst)
            {
                tracing::warn!(error = %format!("{e:#}"), "standby: could not bring the state up to the job's; trying again");
            }
            let next = Instant::now() + every;
            while !stop.load(Ordering::SeqCst) && Instant::now() < next {
                std::thread::sleep(POLL);
            }
        }
    })
    .map(Some)
}
