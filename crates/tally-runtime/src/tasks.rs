//! Running a job's tasks: one task (the job), once this worker holds its lease, or several
//! shared with the job's other workers through the group protocol, each on a thread of its own.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tally_kafka::SourceConsumer;
use tokio::runtime::Handle;

use crate::health::Readiness;
use crate::read_side::CommitSignals;
use crate::settings::JobSettings;
use crate::standby::{standby_tasks, start_standbys, warm_up_before_joining};

/// How often the group member is polled (the group protocol is served inside polls).
const POLL: Duration = Duration::from_millis(100);
/// How often a worker of a shared job re-reads the group's assignment to place its standbys.
const STANDBY_PLACEMENT: Duration = Duration::from_secs(5);

/// Runs the job's tasks this worker is given (one task: the job, once it holds the lease) until
/// a stop.
pub fn run(
    job: Arc<JobSettings>,
    rt: Handle,
    shutdown: Arc<AtomicBool>,
    readiness: Arc<Readiness>,
    signals: CommitSignals,
) -> Result<()> {
    if job.tasks > 1 {
        return share(&job, &rt, &shutdown, &readiness, &signals);
    }
    let whole = job.whole();
    let Some(mut lease) = crate::lease::acquire(&job, &whole, &rt, &shutdown, &readiness)? else {
        tracing::info!("stopped while standing by");
        return Ok(());
    };
    let name = job.name.clone();
    let fenced = lease.take_producer();
    let member = lease.member().clone();
    let result =
        crate::worker::Worker::start(job, whole, rt, shutdown, readiness, member, fenced, signals)
            .and_then(crate::worker::Worker::run);
    if lease.is_lost() {
        return Err(anyhow::anyhow!(crate::lease::LostLease(name)));
    }
    result
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
fn share(
    job: &Arc<JobSettings>,
    rt: &Handle,
    shutdown: &Arc<AtomicBool>,
    readiness: &Arc<Readiness>,
    signals: &crate::read_side::CommitSignals,
) -> Result<()> {
    let lease_topic = &job.topics.lease;
    let tasks = job.tasks;
    readiness.set_standby(true);
    // The group's description (who is in it, who holds which task) is read through a client of
    // its own: the member's requests queue behind its long-polling fetch.
    let me = crate::lease::instance_id(job)?;
    let describer = SourceConsumer::connect(
        &job.source.kafka,
        &job.source.source_topic,
        &job.source.consumer_group,
    )?;
    // Warm standbys of the tasks this worker does not run (`job.standby_refresh`), so that a
    // task moving here replays only its last few epochs.
    let mut standbys = warm_up_before_joining(job, rt, shutdown, &describer, &me)?;
    let member =
        crate::lease::join_group(job, rt, shutdown, i32::try_from(tasks).unwrap_or(i32::MAX))?;
    let mut running: BTreeMap<u32, RunningTask> = BTreeMap::new();
    // A task the group takes away finishes its epochs before the group may give it to another
    // worker: its final checkpoint commits, and the next holder continues from it instead of
    // fencing it and redoing its epoch in flight.
    let draining: Arc<std::sync::Mutex<BTreeMap<u32, TaskEnd>>> = Arc::default();
    {
        let draining = draining.clone();
        let bound = job.session_timeout * 3;
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
            .poll_leases(lease_topic, POLL)
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
            let run = start_task(job, rt, &member, task, signals.clone())?;
            draining
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(task, run.end.clone());
            running.insert(task, run);
        }
        if described.is_none_or(|at| at.elapsed() >= STANDBY_PLACEMENT) {
            described = Some(Instant::now());
            if let Some(placed) = describer
                .group_members(&job.source.consumer_group, POLL * 20)
                .ok()
                .and_then(|g| standby_tasks(&me, &g, lease_topic, job.standby_replicas))
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
        start_standbys(job, rt, &mut standbys, (0..tasks).filter(|t| keep(t)))?;
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
            Ok(Err(e)) if e.is::<crate::retry::Interrupted>() => {
                tracing::info!(task, "stopped before the task's first record: {e:#}")
            }
            Ok(Err(e)) => {
                tracing::error!(task, error = %format!("{e:#}"), "task failed at stop");
                outcome = Err(e);
            }
            Err(_) => outcome = Err(anyhow::anyhow!("task {task}'s thread panicked")),
        }
    }
    leave_group(member, job.session_timeout * 3);
    outcome
}

/// Closes the group member (its final revocation, then leaving), waiting at most `within`: a
/// close librdkafka never finishes (as in its #4041) must not keep a stopped worker from
/// exiting. Not finished in time, it is left behind: the group drops a member that went
/// silent after its session timeout.
fn leave_group(member: Arc<SourceConsumer>, within: Duration) {
    let (closed, wait) = std::sync::mpsc::channel();
    let spawned = crate::job_scope::spawn(
        std::thread::Builder::new().name("tally-leave".into()),
        move || {
            drop(member);
            let _ = closed.send(());
        },
    );
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
    job: &Arc<JobSettings>,
    rt: &Handle,
    member: &Arc<SourceConsumer>,
    task: u32,
    signals: crate::read_side::CommitSignals,
) -> Result<RunningTask> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let readiness = Arc::new(Readiness::default());
    let (job, settings) = (job.clone(), job.task(task));
    let (rt, member, flag, ready) = (rt.clone(), member.clone(), stop.clone(), readiness.clone());
    let ended = SetOnDrop(done.clone());
    let thread = crate::job_scope::spawn(
        std::thread::Builder::new().name(format!("tally-task-{task}")),
        move || -> Result<()> {
            let _ended = ended;
            tracing::info!(task, state_dir = %settings.state_dir.display(), "starting task");
            let producer = crate::lease::fence_and_make_current(&job, &settings, &rt, &flag, None)?;
            crate::worker::Worker::start(
                job,
                settings,
                rt,
                flag,
                ready,
                member,
                Some(producer),
                signals,
            )?
            .run()
        },
    )
    .context("starting a task thread")?;
    Ok(RunningTask {
        end: TaskEnd { stop, done },
        readiness,
        thread,
    })
}
