//! `tally run`'s worker for one job (or one task of a job): the pipeline wired together.
//!
//! Per epoch: records → the operator ([`crate::consume`]) → barrier → **pre-commit** (state,
//! offsets and the epoch's outputs in one synced RocksDB batch, [`crate::persist`]) → the Kafka
//! transaction (dead letters, changelog records, the group's offsets) → the ClickHouse batch and
//! its commit-log row → **mark committed** ([`crate::commit`]) → the read side publishes it
//! ([`crate::read_side`]). Three threads, in epoch order: the operator consumes and cuts, the
//! persister pre-commits, the committer commits. Every sink step is idempotent and checkable,
//! so a process that dies anywhere restarts by finishing the pre-committed epochs, oldest
//! first, before it reads new input.
//!
//! The worker runs only while it holds the job's lease ([`crate::lease`]); every commit names its
//! writer, and a commit by another writer outside the lease stops it
//! ([`crate::marks::AnotherWriter`]).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use tally_core::{Epoch, PartitionId};
use tally_kafka::{EpochProducer, SourceConsumer};
use tally_state::StateStore;
use tokio::runtime::Handle;

use crate::commit::clickhouse::ClickHouseBatches;
use crate::commit::kafka::KafkaTransactions;
use crate::commit::{Committer, CommitterParts};
use crate::consume::{Consumer, Stop, rebuild_seen_filters};
use crate::fault::FaultPlan;
use crate::health::Readiness;
use crate::persist::{Handoff, Persisted, Persister};
use crate::read_side::CommitSignals;
use crate::retry::{Interrupted, connect_clickhouse, wait_for};
use crate::settings::{JobSettings, TaskSettings};

/// A job's worker: the consuming part and the committing part.
pub struct Worker {
    job: Arc<JobSettings>,
    task: TaskSettings,
    consumer: Consumer,
    committer: Committer<KafkaTransactions, ClickHouseBatches>,
    fault: FaultPlan,
    rt: Handle,
}

impl Worker {
    /// Opens state, connects to both services (waiting for them), validates the sink schema.
    #[allow(clippy::too_many_arguments)] // the worker's parts, each used here
    pub fn start(
        job: Arc<JobSettings>,
        task: TaskSettings,
        rt: Handle,
        shutdown: Arc<AtomicBool>,
        readiness: Arc<Readiness>,
        member: Arc<SourceConsumer>,
        fenced: Option<EpochProducer>,
        signals: CommitSignals,
    ) -> Result<Worker> {
        let fault = FaultPlan::from_env().map_err(|e| anyhow!(e))?;
        if fault.is_armed() {
            tracing::warn!("fault injection is armed (TALLY_FAULT)");
        }
        std::fs::create_dir_all(&task.state_dir)
            .with_context(|| format!("creating state directory {}", task.state_dir.display()))?;
        let opening = Instant::now();
        let store = Arc::new(StateStore::open_for(
            &task.state_dir,
            &task.state_identity,
            &job.commit.row_shape,
        )?);
        tracing::info!(
            millis = opening.elapsed().as_millis() as u64,
            path = %task.state_dir.display(),
            "opened state store"
        );
        let kafka = &job.source.kafka;
        let sink = connect_clickhouse(&job.replicas, &rt, &shutdown)?;
        tracing::info!(version = sink.version(), url = %sink.url(), "connected to clickhouse");
        if let Some(cluster) = &job.sink.cluster {
            let down = rt.block_on(tally_clickhouse::check_cluster(&job.replicas))?;
            let urls: Vec<&str> = job.replicas.iter().map(|r| r.url.as_str()).collect();
            tracing::info!(cluster = %cluster, replicas = %urls.join(","), down = ?down, "writing a replicated cluster: every replica serves the view");
            // Each replica's read side creates its tables too, so a replica down now gets
            // them once it answers.
            for settings in &job.replicas {
                if settings.url != sink.url()
                    && let Ok(other) =
                        rt.block_on(tally_clickhouse::ClickHouseSink::connect(settings))
                {
                    match rt.block_on(other.ensure_schema()) {
                        Ok(()) => {}
                        // Unreachable meanwhile: its read side creates them once it answers.
                        Err(e @ tally_clickhouse::SinkError::Server { .. }) => {
                            tracing::warn!(replica = %settings.url, error = %e, "could not create the job's tables on this replica yet");
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
            }
        }
        // ClickHouse restarting between the connection and these is waited out, not fatal.
        wait_for("clickhouse", &shutdown, || {
            Ok(rt.block_on(sink.ensure_schema())?)
        })?;
        if !wait_for("clickhouse", &shutdown, || {
            Ok(rt.block_on(sink.pushes_predicates_into_views())?)
        })? {
            tracing::warn!(
                view = %sink.names().view_q(),
                "this server does not push WHERE clauses into views (enable_optimize_predicate_expression=0): \
                 every query on the view reads all of it; set enable_optimize_predicate_expression=1 in the readers' profile"
            );
        }
        let source =
            SourceConsumer::connect(kafka, &job.source.source_topic, &job.source.consumer_group)?;
        // The lease proved the settings; the source's client, not yet assigned, has no fetch
        // for these requests to wait behind, and one connection serves them all (a new client's
        // first request costs about 0.1 s of connecting).
        let partitions = wait_for("kafka", &shutdown, || Ok(source.partitions()?))?;
        let own_topics = [&job.topics.dead_letters, &job.topics.changelog];
        let in_place = |counts: &BTreeMap<String, usize>| {
            own_topics
                .iter()
                .all(|t| counts.get(*t).is_some_and(|&n| n >= partitions.len()))
        };
        wait_for("kafka", &shutdown, || {
            if in_place(&source.partition_counts()?) {
                return Ok(());
            }
            Ok(crate::partitions::ensure_own_topics(
                &job.topics,
                kafka,
                &rt,
                partitions.len(),
            )?)
        })?;
        tracing::info!(topic = %job.source.source_topic, partitions = partitions.len(), "source partitions");
        // Registered before any record is consumed: folding waits for each partition's
        // watermark, and one added to the topic since the job began joins at the job's.
        let added = wait_for("clickhouse", &shutdown, || {
            Ok(rt.block_on(sink.register_partitions(&partitions))?)
        })?;
        let joining = {
            let meta = store.meta();
            let fresh_added = partitions.iter().any(|p| {
                task.owns(*p)
                    && added.contains(p)
                    && meta.as_ref().is_none_or(|m| !m.partitions.contains_key(p))
            });
            if fresh_added {
                wait_for("clickhouse", &shutdown, || {
                    Ok(rt.block_on(sink.joining_watermark())?)
                })?
            } else {
                None
            }
        };
        // One task of several runs its own partitions only.
        let partitions: Vec<PartitionId> =
            partitions.into_iter().filter(|p| task.owns(*p)).collect();
        if let Some(k) = task.task {
            tracing::info!(task = k, partitions = ?partitions, "running task {k} of {}", task.tasks);
        }
        let committer = Committer::new(
            CommitterParts {
                job: job.clone(),
                task: task.clone(),
                shutdown: shutdown.clone(),
                fault,
                store: store.clone(),
                readiness: readiness.clone(),
                committed: signals.committed,
            },
            KafkaTransactions::new(&job, &task, rt.clone(), member, fenced)?,
            ClickHouseBatches::new(
                tally_clickhouse::Replicas::new(job.replicas.clone(), sink),
                rt.clone(),
                &job.source.source_topic,
            ),
        )?;
        Ok(Worker {
            consumer: Consumer::new(
                job.consume.clone(),
                shutdown,
                store,
                source,
                partitions,
                (added, joining),
                readiness,
                signals.pressure,
            ),
            committer,
            fault,
            rt,
            job,
            task,
        })
    }

    /// Runs until SIGTERM/SIGINT, then takes a final checkpoint.
    pub fn run(self) -> Result<()> {
        let Worker {
            job,
            task,
            mut consumer,
            mut committer,
            fault,
            rt,
        } = self;
        // First, since it says best what is wrong when a second worker of the job starts.
        wait_for("kafka", &consumer.shutdown(), || {
            committer.refuse_another_writer()
        })?;
        let undone = committer.undone_batches()?;
        committer.recover()?;
        // Fence any earlier instance now, not at the first checkpoint.
        committer.ensure_producer()?;
        let mut operator = consumer.restore_operator()?;
        committer.remake_undone(&mut operator, &undone)?;
        let filters = rebuild_seen_filters(
            consumer.store(),
            operator.partitions_awaiting_seen_filter(),
            job.consume.operator.dedup_horizon_ms,
        )?;
        consumer.assign(&operator)?;
        let (_discovery, added) = match crate::partitions::start_partition_discovery(
            &job,
            &task,
            &rt,
            consumer.partitions(),
        )? {
            Some((thread, added)) => (Some(thread), Some(added)),
            None => (None, None),
        };

        let (handoff_tx, handoff_rx) = mpsc::channel::<Handoff>();
        let (persisted_tx, persisted_rx) = mpsc::channel::<Persisted>();
        // Epochs committed in every sink, from the sink thread only: when it ends, for whatever
        // reason, the operator sees the channel close.
        let (committed_tx, committed_rx) = mpsc::channel::<Epoch>();
        // The newest epoch pre-committed, from the persister: the store answers for it and every
        // older one (those before the operator's first epoch were in the store at its start).
        let precommitted = Arc::new(AtomicU64::new(operator.current_epoch().0.saturating_sub(1)));
        let persister = Persister {
            store: consumer.store(),
            fault,
            precommitted: precommitted.clone(),
        };
        let persister = crate::job_scope::spawn(
            std::thread::Builder::new().name("tally-persist".into()),
            move || persister.run(handoff_rx, persisted_tx),
        )
        .context("starting the persister thread")?;
        let sink_thread = crate::job_scope::spawn(
            std::thread::Builder::new().name("tally-sinks".into()),
            move || committer.run(persisted_rx, committed_tx),
        )
        .context("starting the sink thread")?;

        let consumed = consumer.consume(
            &mut operator,
            handoff_tx,
            &precommitted,
            committed_rx,
            filters,
            added,
        );
        // The committing threads finish what was handed to them (or stop at a shutdown).
        let persisted = persister
            .join()
            .map_err(|_| anyhow!("the persister thread panicked"))?;
        let committed = sink_thread
            .join()
            .map_err(|_| anyhow!("the sink thread panicked"))?;
        let outcome = match (consumed, persisted.and(committed)) {
            (Ok(stop), Ok(())) => Ok(stop),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        };
        if outcome.is_ok()
            && let Err(e) = consumer.store().flush()
        {
            // Only the next start's speed depends on it.
            tracing::warn!(error = %e, "could not flush the state store at stop");
        }
        match outcome {
            Err(e) if e.is::<Interrupted>() => {
                tracing::warn!(
                    "stopping with epochs pre-committed or not yet cut; the next start completes them"
                );
                Ok(())
            }
            Err(e) => Err(e),
            Ok(Stop::Idle) => {
                tracing::info!("nothing consumed since the last checkpoint; stopping");
                Ok(())
            }
            Ok(Stop::Final(epoch)) => {
                tracing::info!(%epoch, "final checkpoint committed; stopping");
                Ok(())
            }
        }
    }
}
