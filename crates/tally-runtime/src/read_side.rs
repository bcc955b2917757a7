//! The read side of a job: publishing the answer after commits and folding final windows.
//!
//! Every `tally run` process of a job runs a read-side agent, whatever tasks it runs or stands
//! by for. One agent at a time holds the read side, by a lease ClickHouse keeps
//! ([`tally_clickhouse::ReadLease`]): a generation of its own that fences every earlier one, so a
//! step of an earlier holder (killed mid-insert, paused past its lease, cut off from Kafka) can
//! never land after a later holder's. The holder beats every quarter of `job.session_timeout`;
//! when it dies, hangs or loses ClickHouse, another agent claims the next generation once the
//! beats are older than the session timeout. A holder that stops cleanly publishes once more and
//! releases, and another agent claims at once.
//!
//! Publishes follow this process's commits at once and others' within [`PUBLISH_POLL`]; fold
//! steps come every `clickhouse.fold_interval` (at once while folding is behind, unless the
//! committer is). Neither waits for the commit path, and the commit path never waits for them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;
use tally_clickhouse::{
    ClickHouseSink, FoldStep, PublishStep, ReadLease, ReadSideHolder, SinkError,
};
use tally_core::Epoch;
use tally_kafka::SourceConsumer;
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::background::Background;
use crate::events::{Folded, Published, ReadSideChanged};
use crate::fault::{FaultPlan, FaultPoint};
use crate::settings::ReadSideSettings;
use crate::takeover::{Progress as TakeoverProgress, Takeover};

/// How often the holder looks at the commit log for batches other processes committed.
const PUBLISH_POLL: Duration = Duration::from_millis(500);
/// While the committer is behind (a catch-up), publishes are at least this far apart: the
/// commit path has the cores first, and the view shows the catch-up's progress meanwhile.
const PRESSED_PUBLISH_GAP: Duration = Duration::from_secs(5);
/// How long a stop waits for its last publish and the release.
const FINAL_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

/// When a barrier last had to be put off or wait because the committer was behind. The read
/// side reads it: a catch-up's back-to-back fold steps took the cores the committer needed
/// (profiled: the barriers that waited clustered in the steps, BENCHMARKS.md), so while the
/// committer is behind, folding keeps to its interval and the commit path goes first.
#[derive(Debug)]
pub struct CommitPressure {
    origin: Instant,
    /// Milliseconds after `origin`, plus one (zero: never).
    last: AtomicU64,
}

impl Default for CommitPressure {
    fn default() -> Self {
        CommitPressure {
            origin: Instant::now(),
            last: AtomicU64::new(0),
        }
    }
}

impl CommitPressure {
    fn millis_now(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    pub fn note(&self) {
        self.last.store(self.millis_now(), Ordering::Relaxed);
    }

    /// Whether a barrier was put off or waited within `window`.
    pub fn within(&self, window: Duration) -> bool {
        let last = self.last.load(Ordering::Relaxed);
        let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        last > 0 && self.millis_now().saturating_sub(last) <= window
    }
}

/// What the commit path of this process tells the read side: that it committed (publish now),
/// and when it was behind (fold later).
#[derive(Debug, Clone, Default)]
pub struct CommitSignals {
    pub pressure: Arc<CommitPressure>,
    pub committed: Arc<tokio::sync::Notify>,
}

/// How long the holder waits before publishing again after `failures` failed publishes in a
/// row: nothing at first, then from half a second doubling up to ten.
fn failure_backoff(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    (Duration::from_millis(250) * 2u32.saturating_pow(failures.min(6))).min(Duration::from_secs(10))
}

/// How long the holder waits before its next fold step: at once while it is behind, unless the
/// committer was behind within the interval; otherwise the interval.
fn next_fold_wait(fold_behind: bool, commit_pressed: bool, interval: Duration) -> Duration {
    if fold_behind && !commit_pressed {
        Duration::ZERO
    } else {
        interval
    }
}

/// What the agent's thread is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signal {
    Run,
    /// Stop at once: a step in progress is abandoned (the next holder repairs it), then release.
    Abandon,
    /// Publish what was committed, release, then stop: a worker that stops cleanly leaves the
    /// view showing every epoch it committed, and the next holder claims at once.
    PublishAndStop,
}

/// The running agent. Dropping it abandons a step in progress, releases the read side if held,
/// and joins the thread.
pub struct ReadSide {
    signal: watch::Sender<Signal>,
    /// One agent per replica the view is served from (one on a single server).
    _threads: Vec<Background>,
    /// On a cluster: hands each commit to every agent.
    forward: Option<tokio::task::JoinHandle<()>>,
}

impl ReadSide {
    /// Starts the job's agents, one per ClickHouse replica, each on a thread of its own: each
    /// replica's read side (lease, publishes, folds) is its own.
    pub fn start(
        settings: &ReadSideSettings,
        rt: Handle,
        signals: CommitSignals,
    ) -> Result<ReadSide> {
        let (signal, signal_rx) = watch::channel(Signal::Run);
        let replicas = &settings.replicas;
        let mut threads = Vec::new();
        let mut wakers = Vec::new();
        for (i, replica) in replicas.iter().enumerate() {
            let stop = Arc::new(AtomicBool::new(false));
            let mut own = signals.clone();
            if replicas.len() > 1 {
                own.committed = Arc::new(tokio::sync::Notify::new());
                wakers.push(own.committed.clone());
            }
            let agent = Agent {
                settings: settings.clone(),
                replica: replica.clone(),
                peers: replicas
                    .iter()
                    .filter(|p| p.url != replica.url)
                    .map(|p| (p.clone(), tokio::sync::OnceCell::new()))
                    .collect(),
                rt: rt.clone(),
                faults: ReadFaults::new(FaultPlan::from_env().map_err(|e| anyhow::anyhow!(e))?),
                signals: own,
                stop: stop.clone(),
                holder: holder_name(&settings.holder_dir, "run"),
            };
            let rx = signal_rx.clone();
            const NAMES: [&str; 4] = ["tally-read", "tally-read-2", "tally-read-3", "tally-read-4"];
            let name = NAMES.get(i).copied().unwrap_or("tally-read-n");
            threads.push(Background::spawn(name, stop, move || agent.run(rx))?);
        }
        let forward = (!wakers.is_empty()).then(|| {
            let committed = signals.committed.clone();
            rt.spawn(async move {
                loop {
                    committed.notified().await;
                    for w in &wakers {
                        w.notify_one();
                    }
                }
            })
        });
        Ok(ReadSide {
            signal,
            _threads: threads,
            forward,
        })
    }

    /// Publishes once more if holding (bounded by [`FINAL_PUBLISH_TIMEOUT`]), releases, and
    /// joins the thread.
    pub fn publish_and_stop(self) {
        self.signal.send_replace(Signal::PublishAndStop);
    }
}

impl Drop for ReadSide {
    /// Wakes a step waiting in the runtime; the thread's guard then sets the flag and joins.
    fn drop(&mut self) {
        if let Some(forward) = self.forward.take() {
            forward.abort();
        }
        self.signal.send_if_modified(|s| {
            let run = *s == Signal::Run;
            if run {
                *s = Signal::Abandon;
            }
            run
        });
    }
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
        .trim()
        .to_owned()
}

/// Who holds a generation: the tool, the host, the process and the state directory.
fn holder_name(state_dir: &std::path::Path, tool: &str) -> String {
    format!(
        "tally {tool}@{}:{}:{}",
        host_name(),
        std::process::id(),
        state_dir.display()
    )
}

/// Whether `holder` (a [`holder_name`]) was a process of this host that no longer runs: a
/// worker restarted after a crash claims its predecessor's read side at once instead of
/// waiting out the lease.
fn holder_is_gone(holder: &str) -> bool {
    let Some((_, rest)) = holder.split_once('@') else {
        return false;
    };
    let mut parts = rest.splitn(3, ':');
    let (Some(host), Some(pid)) = (parts.next(), parts.next()) else {
        return false;
    };
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    host == host_name()
        && pid != std::process::id()
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The read side's fault points, each keyed by how many times this process reached it
/// (`TALLY_FAULT_EPOCH=1`: the first time), since a read side has no epochs of its own.
struct ReadFaults {
    plan: FaultPlan,
    reached: [AtomicU64; FaultPoint::ALL.len()],
}

impl ReadFaults {
    fn new(plan: FaultPlan) -> ReadFaults {
        ReadFaults {
            plan,
            reached: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn hit(&self, point: FaultPoint) {
        let Some(i) = FaultPoint::ALL.iter().position(|p| *p == point) else {
            return;
        };
        let n = self.reached[i].fetch_add(1, Ordering::Relaxed) + 1;
        self.plan.hit(point, Epoch(n));
    }

    /// Whether a crash test waits for a step's insert to run on the server.
    fn watches(&self, point: FaultPoint) -> bool {
        self.plan.names(point)
    }

    fn fold(&self, step: FoldStep) {
        self.hit(match step {
            FoldStep::Inserting => FaultPoint::FoldDuringInsert,
            FoldStep::Staged => FaultPoint::FoldAfterStage,
            FoldStep::Inserted => FaultPoint::FoldAfterInsert,
            FoldStep::Logged => FaultPoint::FoldAfterLog,
            FoldStep::Installed => FaultPoint::FoldAfterInstall,
        });
    }

    fn publish(&self, step: PublishStep) {
        self.hit(match step {
            PublishStep::Inserting => FaultPoint::PublishDuringInsert,
            PublishStep::Staged => FaultPoint::PublishAfterStage,
            PublishStep::Replaced => FaultPoint::PublishAfterReplace,
        });
    }
}

/// How holding the read side ended.
enum Held {
    /// A later generation fenced this one: watch again.
    Lost,
    /// Told to stop; publish once more first if true.
    Stop(bool),
}

struct Agent {
    settings: ReadSideSettings,
    /// The replica whose read side this agent runs (the server, off a cluster).
    replica: tally_clickhouse::SinkSettings,
    /// The other replicas (connected once asked): versions are dropped only below what each
    /// still reads.
    peers: Vec<(
        tally_clickhouse::SinkSettings,
        tokio::sync::OnceCell<ClickHouseSink>,
    )>,
    rt: Handle,
    faults: ReadFaults,
    signals: CommitSignals,
    /// Set when the thread must end: ends a wait for ClickHouse.
    stop: Arc<AtomicBool>,
    holder: String,
}

impl Agent {
    fn lease_duration(&self) -> Duration {
        self.settings.lease_duration
    }

    fn beat_every(&self) -> Duration {
        (self.lease_duration() / 4).max(Duration::from_millis(500))
    }

    fn run(self, mut signal: watch::Receiver<Signal>) {
        let cluster = self.settings.cluster;
        let _replica =
            cluster.then(|| tracing::info_span!("replica", url = %self.replica.url).entered());
        ReadSideChanged::Watching.emit();
        // A connection of its own: the frontier it installs is this agent's state.
        let sink = match crate::retry::connect_replica(&self.replica, &self.rt, &self.stop) {
            Ok(sink) => sink,
            Err(e) => {
                if !self.stop.load(Ordering::SeqCst) {
                    tracing::warn!(error = %format!("{e:#}"), "the read side cannot connect to clickhouse; this process neither publishes nor folds until its next start");
                }
                return;
            }
        };
        // A replica that was down when the worker started gets its tables now.
        if cluster && let Err(e) = self.rt.block_on(sink.ensure_schema()) {
            tracing::warn!(error = %e, "the read side cannot create the job's tables on this replica; it neither publishes nor folds here until its next start");
            return;
        }
        // The source's partition count, asked of Kafka before each fold step: folding waits
        // for a watermark from every partition (the registry in ClickHouse counts them too).
        let source = &self.settings.source;
        let partitions = SourceConsumer::connect(
            &source.kafka,
            &source.source_topic,
            &source.consumer_group,
        )
        .inspect_err(|e| tracing::warn!(error = %e, "the read side has no Kafka client; folding counts the registered partitions only"))
        .ok();
        let mut takeover = self.settings.takeover.clone().map(|t| {
            Takeover::new(
                t,
                self.settings.source.clone(),
                self.replica.clone(),
                self.peers.iter().map(|(p, _)| p.clone()).collect(),
                self.holder.clone(),
            )
        });
        self.rt.block_on(async {
            loop {
                let Some(lease) = self.watch(&sink, &mut signal).await else {
                    return;
                };
                // A later version took the view over: this version's read side is done.
                match sink.taken_over_by().await {
                    Ok(Some(by)) => {
                        tracing::info!(by = %by, "a later version of the job took its view over: this read side stops");
                        self.release(&sink, &lease, false).await;
                        return;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot read whether a later version took the view over; giving the read side up");
                        self.release(&sink, &lease, false).await;
                        continue;
                    }
                }
                match self
                    .hold(&sink, &lease, partitions.as_ref(), &mut takeover, &mut signal)
                    .await
                {
                    Held::Lost => continue,
                    Held::Stop(publish) => {
                        self.release(&sink, &lease, publish).await;
                        return;
                    }
                }
            }
        });
    }

    /// Waits until the read side is free or its holder silent past the lease, then claims it.
    /// `None`: told to stop first.
    async fn watch(
        &self,
        sink: &ClickHouseSink,
        signal: &mut watch::Receiver<Signal>,
    ) -> Option<ReadLease> {
        let lease = self.lease_duration();
        // A generation with no beat yet is being claimed: silent only once that outlasts a lease.
        let mut unbeaten_since: Option<(u64, Instant)> = None;
        let mut said = None;
        loop {
            if *signal.borrow() != Signal::Run {
                return None;
            }
            let due = match sink.read_side_holder().await {
                Ok(ReadSideHolder::Vacant) => true,
                Ok(ReadSideHolder::Held {
                    generation,
                    holder,
                    beat_age,
                }) => {
                    let gone = holder.as_deref().is_some_and(holder_is_gone);
                    if said != Some(generation) && !gone {
                        tracing::info!(
                            generation,
                            holder = holder.as_deref().unwrap_or("?"),
                            "another process holds the read side"
                        );
                        said = Some(generation);
                    }
                    match beat_age {
                        _ if gone => true,
                        Some(age) => {
                            unbeaten_since = None;
                            Duration::from_secs(u64::from(age)) >= lease
                        }
                        None => {
                            let since = match unbeaten_since {
                                Some((g, at)) if g == generation => at,
                                _ => {
                                    unbeaten_since = Some((generation, Instant::now()));
                                    Instant::now()
                                }
                            };
                            since.elapsed() >= lease
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "could not read who holds the read side");
                    false
                }
            };
            if due {
                match sink.claim_read_side(&self.holder).await {
                    Ok(Some(lease)) => return Some(lease),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "could not claim the read side; trying again")
                    }
                }
            }
            tokio::select! {
                () = tokio::time::sleep(self.beat_every().min(Duration::from_secs(1))) => {},
                _ = signal.changed() => return None,
            }
        }
    }

    /// Publishes and folds under `lease` until fenced or told to stop.
    async fn hold(
        &self,
        sink: &ClickHouseSink,
        lease: &ReadLease,
        partitions: Option<&SourceConsumer>,
        takeover: &mut Option<Takeover>,
        signal: &mut watch::Receiver<Signal>,
    ) -> Held {
        ReadSideChanged::Claimed {
            generation: lease.generation,
            holder: &lease.holder,
        }
        .emit();
        let interval = self.settings.fold_interval;
        let folding = !interval.is_zero();
        let mut known_partitions = 0;
        // The view of the logged frontier is installed once the first publish succeeded (a
        // view of an earlier layout, reading the versions itself, is replaced only then); fold
        // steps follow it.
        let mut installed = false;
        let mut next_fold: Option<Instant> = None;
        let mut yielding = false;
        let mut last_publish: Option<Instant> = None;
        let mut failed_publishes = 0u32;
        let mut next_beat = Instant::now() + self.beat_every();
        loop {
            if next_beat <= Instant::now() {
                next_beat = Instant::now() + self.beat_every();
                if let Err(e) = sink.beat(lease).await {
                    if let Some(held) = self.lost(lease, &e) {
                        return held;
                    }
                    tracing::debug!(error = %e, "read side: a beat failed");
                }
            }
            if next_fold.is_some_and(|at| at <= Instant::now()) {
                if let Some(source) = partitions
                    && let Ok(p) = source.partitions()
                {
                    known_partitions = p.len();
                }
                if !self.peers.is_empty() {
                    sink.hold_versions_from(self.peers_floor().await);
                }
                let started = Instant::now();
                let step = sink.fold(
                    lease,
                    self.settings.fold_rules,
                    known_partitions,
                    |step| self.faults.fold(step),
                    self.faults.watches(FaultPoint::FoldDuringInsert),
                );
                let result = match self.run_step(sink, lease, signal, step).await {
                    Ok(result) => result,
                    Err(held) => return held,
                };
                Folded {
                    result: &result,
                    duration: started.elapsed(),
                }
                .emit();
                let behind = result.is_ok_and(|outcome| outcome.behind);
                let wait = next_fold_wait(behind, self.signals.pressure.within(interval), interval);
                if (behind && !wait.is_zero()) != yielding {
                    yielding = !yielding;
                    if yielding {
                        tracing::info!(
                            "folding is behind, and so is the committer: fold steps keep to the interval meanwhile"
                        );
                    } else {
                        tracing::info!("fold steps no longer wait for the committer");
                    }
                }
                next_fold = Some(Instant::now() + wait);
            }
            let gap = if self.signals.pressure.within(PRESSED_PUBLISH_GAP) {
                PRESSED_PUBLISH_GAP
            } else {
                Duration::ZERO
            };
            // A server down (a replica killed) is asked again less and less often.
            let gap = gap.max(failure_backoff(failed_publishes));
            if last_publish.map_or_else(Instant::now, |t| t + gap) <= Instant::now() {
                let publish = self.publish(sink, lease, failed_publishes > 0);
                let result = match self.run_step(sink, lease, signal, publish).await {
                    Ok(result) => result,
                    Err(held) => return held,
                };
                failed_publishes = if result.is_ok() {
                    if failed_publishes > 0 {
                        tracing::info!(failures = failed_publishes, "publishing works again");
                    }
                    0
                } else {
                    failed_publishes.saturating_add(1)
                };
                last_publish = Some(Instant::now());
                // A new version takes the job's view over between its publishes.
                if installed
                    && result.is_ok()
                    && let Some(t) = takeover.as_mut()
                {
                    let fault = |p: FaultPoint| self.faults.hit(p);
                    let step = self.beating(sink, lease, t.advance(sink, &fault));
                    let outcome = tokio::select! {
                        outcome = step => outcome,
                        _ = signal.changed() => return self.stopped(signal),
                    };
                    match outcome {
                        Ok(TakeoverProgress::Done) => *takeover = None,
                        Ok(TakeoverProgress::Waiting) => {}
                        Err(e) => {
                            tracing::warn!(error = %format!("{e:#}"), "the takeover of the job's view failed; trying again")
                        }
                    }
                }
                // The view of an earlier layout (or a fresh holder's) reads the published
                // answer once there is one.
                if !installed && result.is_ok() {
                    match sink.install_logged_view(lease).await {
                        Ok(_) => {
                            installed = true;
                            next_fold = folding.then(Instant::now);
                        }
                        Err(e) => {
                            if let Some(held) = self.lost(lease, &e) {
                                return held;
                            }
                            tracing::warn!(error = %e, "could not install the view; trying again");
                        }
                    }
                }
            }
            let mut wake = (Instant::now() + PUBLISH_POLL).min(next_beat);
            if let Some(at) = next_fold {
                wake = wake.min(at);
            }
            tokio::select! {
                () = self.signals.committed.notified() => {},
                () = tokio::time::sleep_until(wake.into()) => {},
                // A change, or the sender gone: either way, stop.
                _ = signal.changed() => return self.stopped(signal),
            }
        }
    }

    /// The oldest window whose versions another replica still reads (`None`: one did not
    /// say, so none is dropped).
    async fn peers_floor(&self) -> Option<tally_clickhouse::Frontier> {
        let mut floor: Option<tally_clickhouse::Frontier> = None;
        for (settings, peer) in &self.peers {
            let needed = async {
                peer.get_or_try_init(|| ClickHouseSink::connect(settings))
                    .await?
                    .versions_needed_from()
                    .await
            };
            match tokio::time::timeout(Duration::from_secs(5), needed).await {
                Ok(Ok(f)) => {
                    floor = Some(floor.map_or(f, |g| if f.seconds < g.seconds { f } else { g }));
                }
                _ => return None,
            }
        }
        floor
    }

    /// Runs a step under `lease`, beating meanwhile; `Err` ends the holding: told to stop (the
    /// step abandoned), or fenced.
    async fn run_step<T>(
        &self,
        sink: &ClickHouseSink,
        lease: &ReadLease,
        signal: &mut watch::Receiver<Signal>,
        step: impl std::future::Future<Output = Result<T, SinkError>>,
    ) -> Result<Result<T, SinkError>, Held> {
        let result = tokio::select! {
            result = self.beating(sink, lease, step) => result,
            _ = signal.changed() => return Err(self.stopped(signal)),
        };
        if let Err(e) = &result
            && let Some(held) = self.lost(lease, e)
        {
            return Err(held);
        }
        Ok(result)
    }

    fn stopped(&self, signal: &watch::Receiver<Signal>) -> Held {
        Held::Stop(*signal.borrow() == Signal::PublishAndStop)
    }

    /// `Some(Lost)` when `error` says a later generation fenced this one.
    fn lost(&self, lease: &ReadLease, error: &SinkError) -> Option<Held> {
        matches!(error, SinkError::Fenced { .. }).then(|| {
            ReadSideChanged::Lost {
                generation: lease.generation,
                error,
            }
            .emit();
            Held::Lost
        })
    }

    /// Runs `step`, beating meanwhile: a fold step can outlast the lease.
    async fn beating<T>(
        &self,
        sink: &ClickHouseSink,
        lease: &ReadLease,
        step: impl std::future::Future<Output = T>,
    ) -> T {
        tokio::pin!(step);
        let mut beats = tokio::time::interval(self.beat_every());
        beats.tick().await;
        loop {
            tokio::select! {
                out = &mut step => return out,
                _ = beats.tick() => {
                    if let Err(e) = sink.beat(lease).await {
                        tracing::debug!(error = %e, "read side: a beat failed");
                    }
                }
            }
        }
    }

    /// Publishes the answer if the commit log moved since the last publish.
    async fn publish(
        &self,
        sink: &ClickHouseSink,
        lease: &ReadLease,
        failed_before: bool,
    ) -> Result<tally_clickhouse::PublishOutcome, SinkError> {
        let started = Instant::now();
        let result = sink
            .publish(
                lease,
                |step| self.faults.publish(step),
                self.faults.watches(FaultPoint::PublishDuringInsert),
            )
            .await;
        if !matches!(result, Err(SinkError::Fenced { .. })) {
            Published {
                result: &result,
                duration: started.elapsed(),
                failed_before,
            }
            .emit();
        }
        result
    }

    /// Publishes once more if asked, then gives the read side up (bounded: a stop never waits
    /// long for ClickHouse; unreleased, the next holder claims after the lease).
    async fn release(&self, sink: &ClickHouseSink, lease: &ReadLease, publish: bool) {
        let done = tokio::time::timeout(FINAL_PUBLISH_TIMEOUT, async {
            if publish {
                let _ = self.publish(sink, lease, false).await;
            }
            sink.release_read_side(lease).await
        })
        .await;
        match done {
            Ok(Ok(())) => ReadSideChanged::Released {
                generation: lease.generation,
            }
            .emit(),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not release the read side; another process claims it after job.session_timeout")
            }
            Err(_) => tracing::warn!(
                "releasing the read side timed out; another process claims it after job.session_timeout"
            ),
        }
    }
}

/// `tally fold`: claims the read side (fencing its holder, which claims it back later), folds
/// every final window, publishes, and releases.
pub async fn fold_now(settings: &ReadSideSettings) -> Result<()> {
    for replica in &settings.replicas {
        if settings.replicas.len() > 1 {
            // Each replica folds its own copy; versions stay for the running read sides to drop.
            println!("replica {}:", replica.url);
        }
        fold_replica(settings, replica).await?;
    }
    Ok(())
}

async fn fold_replica(
    settings: &ReadSideSettings,
    replica: &tally_clickhouse::SinkSettings,
) -> Result<()> {
    let sink = ClickHouseSink::connect(replica).await?;
    sink.ensure_schema().await?;
    let source = &settings.source;
    let partitions = tally_kafka::topic_extent(&source.kafka, &source.source_topic)?.len();
    let holder = holder_name(&settings.holder_dir, "fold");
    let lease = loop {
        if let Some(lease) = sink.claim_read_side(&holder).await? {
            break lease;
        }
    };
    println!(
        "read side: generation {} claimed (the running holder, if any, steps down)",
        lease.generation
    );
    let folded = fold_until_caught_up(&sink, &lease, settings.fold_rules, partitions).await;
    if folded.is_ok()
        && let Some(rows) = sink.publish(&lease, |_| {}, false).await?.rows
    {
        println!("publish: {rows} rows of windows not folded yet");
    }
    sink.release_read_side(&lease).await?;
    folded
}

async fn fold_until_caught_up(
    sink: &ClickHouseSink,
    lease: &ReadLease,
    rules: tally_clickhouse::FoldRules,
    partitions: usize,
) -> Result<()> {
    // Steps until every final window is folded; then one more after READER_MARGIN drops the
    // versions the last ones folded (a step only drops below a frontier installed that long
    // before it).
    let mut caught_up = false;
    loop {
        if caught_up {
            tokio::time::sleep(tally_clickhouse::READER_MARGIN).await;
        }
        let outcome = sink.fold(lease, rules, partitions, |_| {}, false).await?;
        println!(
            "fold: frontier {}, {} rows folded, {} partitions dropped{}",
            tally_core::time::format_ms(i64::from(outcome.frontier.seconds) * 1000),
            outcome.folded_rows,
            outcome.dropped_partitions,
            if outcome.repaired {
                ", repaired an interrupted step"
            } else {
                ""
            }
        );
        if caught_up {
            return Ok(());
        }
        caught_up = !outcome.behind;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_publish_is_retried_less_and_less_often() {
        assert_eq!(failure_backoff(0), Duration::ZERO);
        assert_eq!(failure_backoff(1), Duration::from_millis(500));
        assert_eq!(failure_backoff(2), Duration::from_secs(1));
        assert_eq!(failure_backoff(40), Duration::from_secs(10));
    }

    #[test]
    fn folding_steps_back_to_back_only_while_the_committer_keeps_up() {
        let interval = Duration::from_secs(60);
        assert_eq!(next_fold_wait(true, false, interval), Duration::ZERO);
        assert_eq!(next_fold_wait(true, true, interval), interval);
        assert_eq!(next_fold_wait(false, false, interval), interval);
        assert_eq!(next_fold_wait(false, true, interval), interval);
    }

    #[test]
    fn commit_pressure_is_recent_only_after_a_note_and_within_the_window() {
        let pressure = CommitPressure::default();
        assert!(!pressure.within(Duration::from_secs(3600)), "never noted");
        pressure.note();
        assert!(pressure.within(Duration::from_secs(60)));
        // A note 10 s before now, without sleeping: move the origin back instead.
        let pressure = CommitPressure {
            origin: Instant::now()
                .checked_sub(Duration::from_secs(10))
                .expect("the monotonic clock is past 10 s"),
            last: AtomicU64::new(1),
        };
        assert!(!pressure.within(Duration::from_secs(5)));
        assert!(pressure.within(Duration::from_secs(60)));
    }

    #[test]
    fn only_a_holder_of_this_host_whose_process_ended_is_gone() {
        let here = host_name();
        // PIDs are below 2^22 on Linux.
        assert!(holder_is_gone(&format!(
            "tally run@{here}:4294967295:/var/lib/tally"
        )));
        let me = std::process::id();
        assert!(!holder_is_gone(&format!(
            "tally run@{here}:{me}:/var/lib/tally"
        )));
        assert!(
            !holder_is_gone(&format!("tally run@{here}:1:/x")),
            "init runs"
        );
        assert!(!holder_is_gone("tally run@another-host:4294967295:/x"));
        assert!(!holder_is_gone("sqlcheck"));
    }

    #[test]
    fn read_side_faults_count_each_point_on_its_own() {
        let faults = ReadFaults::new(FaultPlan::default());
        faults.fold(FoldStep::Staged);
        faults.fold(FoldStep::Staged);
        faults.publish(PublishStep::Staged);
        let count = |p: FaultPoint| {
            let i = FaultPoint::ALL.iter().position(|q| *q == p).unwrap_or(0);
            faults.reached[i].load(Ordering::Relaxed)
        };
        assert_eq!(count(FaultPoint::FoldAfterStage), 2);
        assert_eq!(count(FaultPoint::PublishAfterStage), 1);
        assert_eq!(count(FaultPoint::FoldAfterLog), 0);
    }
}
