//! A new version takes the job's view over from the version that holds the job, once it has
//! caught up (docs/design/restatement.md, "Taking over the view"). Run by the holder of the new
//! version's read side on each replica, between its publishes; every step can be run again, so
//! the next holder finishes what a killed one began, reading where it stood from the registry
//! and ClickHouse.
//!
//! 1. *Record* (registry, `<job>@v<N>`: taking over): from here the holder's workers stop.
//! 2. *Fence* the holder's transactional ids: it commits nothing more to Kafka.
//! 3. *Claim* a generation of the holder's read side and log the takeover in it: the holder's
//!    read side is fenced, and every later holder of it steps down.
//! 4. *Keep* the windows before `restate_from` as the holder's view shows them (`_kept`).
//! 5. *Install* the job's view over this version's own view and the kept windows: one swap.
//! 6. *Retire* the holder: its tables on the replica; once every replica is done, its topics
//!    and group, and the registry's record of the job becomes this version's identity.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tally_clickhouse::{ClickHouseSink, ReadLease, SinkSettings};
use tally_core::PartitionId;
use tally_kafka::EpochTopics;

use crate::fault::FaultPoint;
use crate::identity;
use crate::settings::{SourceGroup, TakeoverSettings, VersionResources};

/// How often the conditions to start are read while the version catches up.
const CHECK_EVERY: Duration = Duration::from_secs(5);
/// How long the retirement waits for the group of the version taken over to empty (its
/// members that stopped a moment ago) before it leaves the group for an operator to delete.
const GROUP_EMPTIES_WITHIN: Duration = Duration::from_secs(120);

/// Where this replica's takeover stands.
enum Stage {
    /// Catching up: the source's ends when last read, which the version must have committed
    /// by the next check.
    Rebuilding {
        ends: Option<BTreeMap<PartitionId, i64>>,
    },
    /// The holder is fenced and its read side claimed under this lease: the job's view is to
    /// be replaced once this version has published as far as the holder had.
    Claimed {
        holder: Box<ClickHouseSink>,
        lease: ReadLease,
        from: u64,
        /// The holder's topic when it is not this version's (which reads a new snapshot's):
        /// the two meet in the source database's log, not in offsets.
        across: Option<String>,
    },
    /// The job's view is this version's on the replica and the holder's tables are dropped:
    /// its topics, group and the registry's record are left, once every replica is done.
    Retiring {
        from: u64,
        since: Instant,
    },
    Done,
}

/// One replica's takeover, driven by that replica's read-side agent.
pub(crate) struct Takeover {
    settings: TakeoverSettings,
    source: SourceGroup,
    /// This version's own tables' settings on the replica; the holder's differ by the table.
    replica: SinkSettings,
    /// The other replicas: the holder's topics go once its tables are gone from every one.
    peers: Vec<SinkSettings>,
    holder_name: String,
    stage: Stage,
    next_check: Instant,
    /// Where this version began reading each partition (for one it has committed nothing on).
    starts: Option<BTreeMap<PartitionId, i64>>,
    /// Across topics: where this version meets the fenced holder in the database's log.
    barrier: Option<Barrier>,
}

/// The database's position once the holder was fenced, this version's topic's ends once its
/// connector had confirmed that position, and when the wait was last logged.
struct Barrier {
    lsn: u64,
    ends: Option<BTreeMap<PartitionId, i64>>,
    logged: Option<Instant>,
}

/// What the agent learns from a step.
pub(crate) enum Progress {
    Waiting,
    Done,
}

impl Takeover {
    pub(crate) fn new(
        settings: TakeoverSettings,
        source: SourceGroup,
        replica: SinkSettings,
        peers: Vec<SinkSettings>,
        holder_name: String,
    ) -> Takeover {
        Takeover {
            settings,
            source,
            replica,
            peers,
            holder_name,
            stage: Stage::Rebuilding { ends: None },
            next_check: Instant::now(),
            starts: None,
            barrier: None,
        }
    }

    fn version(&self) -> u64 {
        self.settings.identity.identity.version()
    }

    fn job(&self) -> &str {
        &self.settings.identity.identity.job
    }

    /// Takes the next step that can be taken; `own` is this version's sink on the replica.
    pub(crate) async fn advance(
        &mut self,
        own: &ClickHouseSink,
        fault: &dyn Fn(FaultPoint),
    ) -> Result<Progress> {
        if matches!(self.stage, Stage::Done) {
            return Ok(Progress::Done);
        }
        if matches!(
            self.stage,
            Stage::Rebuilding { .. } | Stage::Retiring { .. }
        ) {
            if Instant::now() < self.next_check {
                return Ok(Progress::Waiting);
            }
            self.next_check = Instant::now() + CHECK_EVERY;
        }
        let result = self.step(own, fault).await;
        if result.is_err() && !matches!(self.stage, Stage::Retiring { .. }) {
            // A fenced or failed claim starts again from the registry.
            self.stage = Stage::Rebuilding { ends: None };
            self.barrier = None;
        }
        result
    }

    async fn step(&mut self, own: &ClickHouseSink, fault: &dyn Fn(FaultPoint)) -> Result<Progress> {
        match self.stage {
            Stage::Claimed { .. } => return self.replace_view(own, fault).await,
            Stage::Retiring { from, .. } => return self.finish_replica(own, from).await,
            _ => {}
        }
        let versions = identity::versions(&self.settings.identity)
            .await?
            .with_context(|| {
                format!(
                    "job {}: the registry holds no record of the job to take over",
                    self.job()
                )
            })?;
        let from = versions.holds();
        if from == self.version() {
            // The registry says done: this replica may still have its steps to finish
            // (another replica's agent recorded it).
            return self.retire(own, from).await;
        }
        if !(versions.taking_over && versions.rebuilding == Some(self.version())) {
            if !self.ready(own, from).await? {
                return Ok(Progress::Waiting);
            }
            identity::record_taking_over(&self.settings.identity).await?;
            tracing::info!(job = %self.job(), version = self.version(), from, "caught up: taking the job's view over");
            fault(FaultPoint::TakeoverAfterRecord);
        }
        let resources = self.resources(from)?;
        let tasks = versions
            .holder
            .rules
            .get("job.tasks")
            .and_then(|t| t.parse().ok())
            .unwrap_or(1);
        self.fence_kafka(resources, tasks)?;
        fault(FaultPoint::TakeoverAfterFence);
        let holder_sink = self.holder_sink(resources).await?;
        if holder_sink.version_dropped(&self.settings.view).await? {
            // Retired on this replica already: only the registry's record is left.
            return self.retire(own, from).await;
        }
        let lease = loop {
            if let Some(lease) = holder_sink
                .claim_read_side(&self.holder_name)
                .await
                .context("claiming the read side of the version that holds the job")?
            {
                break lease;
            }
        };
        holder_sink
            .log_took_over(
                &lease,
                &format!("version {} {}", self.version(), self.holder_name),
            )
            .await?;
        tracing::info!(
            job = %self.job(),
            from,
            generation = lease.generation,
            "fenced the read side of the version that holds the job"
        );
        fault(FaultPoint::TakeoverAfterClaim);
        self.stage = Stage::Claimed {
            holder: Box::new(holder_sink),
            lease,
            from,
            across: versions
                .holder
                .source_topic()
                .filter(|t| *t != self.source.source_topic)
                .map(str::to_owned),
        };
        self.replace_view(own, fault).await
    }

    fn resources(&self, from: u64) -> Result<&VersionResources> {
        self.settings.earlier.get(&from).with_context(|| {
            format!(
                "job {}: version {from} holds the job, which is not below version {}",
                self.job(),
                self.version()
            )
        })
    }

    /// Whether both conditions to start hold: this version has committed what the source
    /// held at the last check (it keeps up with the stream), and the holder has folded every
    /// window before `restate_from` (its answer there is final).
    async fn ready(&mut self, own: &ClickHouseSink, from: u64) -> Result<bool> {
        let Stage::Rebuilding { ends } = &mut self.stage else {
            return Ok(false);
        };
        let now = topic_ends(&self.source)?;
        let before = ends.replace(now);
        let Some(before) = before else {
            return Ok(false);
        };
        let committed = own.committed_offsets().await?;
        if self.starts.is_none() {
            self.starts = Some(tally_kafka::topic_starts(
                &self.source.kafka,
                &self.source.source_topic,
                self.settings.start_from,
            )?);
        }
        let starts = self.starts.as_ref();
        let behind = before.iter().any(|(p, end)| {
            let at = committed
                .get(p)
                .or_else(|| starts.and_then(|s| s.get(p)))
                .copied()
                .unwrap_or(0);
            // A batch's offset is its last record's or the next one's: within one record.
            at + 1 < *end
        });
        if behind {
            return Ok(false);
        }
        let Some(restate_from) = self.settings.restate_from_ms else {
            return Ok(true);
        };
        let holder = self.holder_sink(self.resources(from)?).await?;
        let frontier = holder.frontier().await?;
        let folded = i64::from(frontier.seconds) * 1000 >= restate_from;
        if !folded {
            tracing::info!(
                job = %self.job(),
                "caught up; waiting for version {from} to fold its windows before job.restate_from (its fold frontier is {})",
                tally_core::time::format_ms(i64::from(frontier.seconds) * 1000)
            );
        }
        Ok(folded)
    }

    /// `init_transactions` on each of the holder's transactional ids: its open transactions
    /// abort and its producers are fenced.
    fn fence_kafka(&self, holder: &VersionResources, tasks: u32) -> Result<()> {
        for id in holder.transactional_ids(tasks) {
            tally_kafka::UnfencedProducer::create(
                &self.source.kafka,
                &id,
                &EpochTopics {
                    dead_letters: &holder.dead_letters,
                    changelog: &holder.changelog_topic,
                    source: &self.source.source_topic,
                },
            )
            .and_then(tally_kafka::UnfencedProducer::fence)
            .with_context(|| format!("fencing transactional id {id}"))?;
        }
        Ok(())
    }

    async fn holder_sink(&self, holder: &VersionResources) -> Result<ClickHouseSink> {
        let settings = SinkSettings {
            table: holder.table.clone(),
            ..self.replica.clone()
        };
        Ok(ClickHouseSink::connect(&settings).await?)
    }

    /// Steps 4 to 6 under the holder's read side: once this version has published at least
    /// as far as the holder had.
    async fn replace_view(
        &mut self,
        own: &ClickHouseSink,
        fault: &dyn Fn(FaultPoint),
    ) -> Result<Progress> {
        let installed = own
            .job_view_reads(&self.settings.view, &self.settings.own_view)
            .await?;
        if !installed && !self.caught_up_with_holder(own).await? {
            return Ok(Progress::Waiting);
        }
        let Stage::Claimed {
            holder,
            lease,
            from,
            across,
        } = &self.stage
        else {
            return Ok(Progress::Waiting);
        };
        let from = *from;
        let s = &self.settings;
        if !installed {
            let kept_table = format!("{}_kept", s.own_view);
            let kept = match s.restate_from_ms {
                Some(ms) => {
                    let seconds = u32::try_from(ms.div_euclid(1000)).unwrap_or(0);
                    if let Some(rows) = holder
                        .keep_windows(lease, &s.view, &s.own_view, &kept_table, seconds)
                        .await?
                    {
                        tracing::info!(job = %self.job(), rows, table = %kept_table, "kept the windows before job.restate_from");
                    }
                    fault(FaultPoint::TakeoverAfterCopy);
                    Some((kept_table.as_str(), seconds))
                }
                None => None,
            };
            holder
                .install_job_view(lease, &s.view, &s.own_view, kept)
                .await?;
            tracing::info!(job = %self.job(), version = self.version(), from, view = %s.view, "took the job's view over");
            if let Some(topic) = across {
                tracing::warn!(job = %self.job(), from, topic = %topic, "version {from} read topic {topic}, which this version does not: delete its connector and replication slot once nothing else reads it (a slot nobody reads holds the database's WAL)");
            }
            fault(FaultPoint::TakeoverAfterInstall);
        }
        holder.drop_version_tables(&s.view).await?;
        if let Err(e) = holder.release_read_side(lease).await {
            tracing::debug!(error = %e, "releasing the read side of the version taken over");
        }
        fault(FaultPoint::TakeoverDuringRetire);
        self.retire(own, from).await
    }

    /// Whether this version has published at least as far as the fenced holder had. In one
    /// topic: its cut reaches the holder's. Across topics (a new snapshot's): its connector's
    /// slot has confirmed the database's position taken after the fence (every change the
    /// holder read is below it), and this version has published its topic up to the ends it
    /// had then.
    async fn caught_up_with_holder(&mut self, own: &ClickHouseSink) -> Result<bool> {
        let Stage::Claimed { holder, across, .. } = &self.stage else {
            return Ok(false);
        };
        if across.is_none() {
            let Some(theirs) = holder.published().await? else {
                return Ok(true);
            };
            return Ok(own
                .published()
                .await?
                .is_some_and(|mine| mine.cut.reaches(&theirs.cut)));
        }
        let ends = match self.barrier.as_ref().and_then(|b| b.ends.clone()) {
            Some(ends) => ends,
            None => match self.passed_in_the_log().await? {
                Some(ends) => ends,
                None => return Ok(false),
            },
        };
        let mine = own.published().await?.map(|p| p.cut).unwrap_or_default();
        Ok(ends
            .iter()
            .all(|(p, high)| *high == 0 || mine.0.get(p).is_some_and(|at| at >= high)))
    }

    /// Across topics: takes the database's position once (after the fence), then whether this
    /// version's connector has confirmed it; once it has, its topic's ends, which this version
    /// must publish up to. `None` while the connector is behind.
    async fn passed_in_the_log(&mut self) -> Result<Option<BTreeMap<PartitionId, i64>>> {
        let capture = self.settings.capture.as_ref().with_context(|| {
            format!(
                "job {}: source.slot: the version reads its own topic {}, not the one of the version it takes over; name its connector's slot and database (source.slot, source.postgres)",
                self.job(),
                self.source.source_topic
            )
        })?;
        let client = crate::capture::connect(&capture.postgres, &capture.password).await?;
        let barrier = match &mut self.barrier {
            Some(b) => b,
            None => {
                let lsn = crate::capture::current_lsn(&client).await?;
                if let Some(signal_table) = &capture.signal_table {
                    crate::capture::mark(
                        &client,
                        signal_table,
                        "tally: a new version takes the job over after this point",
                    )
                    .await?;
                }
                self.barrier.insert(Barrier {
                    lsn,
                    ends: None,
                    logged: None,
                })
            }
        };
        let confirmed = crate::capture::confirmed_lsn(&client, &capture.slot)
            .await?
            .with_context(|| {
                format!(
                    "source.slot: replication slot {} does not exist: nothing captures the version's topic {}",
                    capture.slot, self.source.source_topic
                )
            })?;
        if confirmed < barrier.lsn {
            if barrier.logged.is_none_or(|at| at.elapsed() >= CHECK_EVERY) {
                barrier.logged = Some(Instant::now());
                tracing::info!(
                    job = %self.settings.identity.identity.job,
                    slot = %capture.slot,
                    "waiting for the connector of this version's topic to confirm {} (it has {}): where the version taken over stopped",
                    tally_core::declare::lsn_text(barrier.lsn),
                    tally_core::declare::lsn_text(confirmed)
                );
            }
            return Ok(None);
        }
        let ends = topic_ends(&self.source)?;
        barrier.ends = Some(ends.clone());
        Ok(Some(ends))
    }

    /// The registry's end of the takeover, once the holder's tables are gone from every
    /// replica: its topics and group deleted, the job's record this version's identity.
    async fn retire(&mut self, own: &ClickHouseSink, from: u64) -> Result<Progress> {
        self.stage = Stage::Retiring {
            from,
            since: Instant::now(),
        };
        self.finish_replica(own, from).await
    }

    async fn finish_replica(&mut self, own: &ClickHouseSink, from: u64) -> Result<Progress> {
        let s = &self.settings;
        if !own.job_view_reads(&s.view, &s.own_view).await? {
            tracing::warn!(job = %self.job(), view = %s.view, "the registry says this version holds the job, but the view on this replica reads another: see `tally doctor`");
        }
        if from != self.version() {
            let resources = self.resources(from)?.clone();
            for peer in &self.peers {
                let settings = SinkSettings {
                    table: resources.table.clone(),
                    ..peer.clone()
                };
                let dropped = match ClickHouseSink::connect(&settings).await {
                    Ok(sink) => sink.version_dropped(&s.view).await.unwrap_or(false),
                    Err(_) => false,
                };
                if !dropped {
                    return Ok(Progress::Waiting);
                }
            }
            let topics = [
                resources.changelog_topic.as_str(),
                resources.lease_topic.as_str(),
            ];
            let waited = match self.stage {
                Stage::Retiring { since, .. } => since.elapsed(),
                _ => Duration::ZERO,
            };
            match tally_kafka::delete_topics_and_group(
                &self.source.kafka,
                &topics,
                &resources.consumer_group,
            )
            .await
            {
                Ok(true) => {}
                Ok(false) if waited < GROUP_EMPTIES_WITHIN => return Ok(Progress::Waiting),
                Ok(false) => {
                    tracing::warn!(group = %resources.consumer_group, "the consumer group of the version taken over still has members: delete it by hand once they are gone")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not delete the topics and group of the version taken over; delete them by hand")
                }
            }
            identity::record_took_over(&s.identity).await?;
            tracing::info!(job = %self.job(), version = self.version(), from, "the job is this version's: version {from} is retired");
        }
        self.stage = Stage::Done;
        Ok(Progress::Done)
    }
}

/// Where each partition of the version's source topic ends now.
fn topic_ends(source: &SourceGroup) -> Result<BTreeMap<PartitionId, i64>> {
    Ok(
        tally_kafka::topic_extent(&source.kafka, &source.source_topic)?
            .into_iter()
            .map(|(p, (_, high))| (p, high))
            .collect(),
    )
}
