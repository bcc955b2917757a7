//! The commit protocol against the in-memory sinks: every step, every recovery and the resend,
//! with crashes at every fault point (the committer is dropped as a dead process would be, and a
//! new one recovers from the same store and the same sinks). Real RocksDB in a scratch
//! directory; no services.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tally_core::{CheckpointBarrier, Epoch, Record, WindowOperator};
use tally_state::{EpochStatus, StateStore};

use super::fakes::{FakeClickHouse, FakeKafka};
use super::{Committer, CommitterParts};
use crate::config::Config;
use crate::events::BarrierPause;
use crate::fault::{Crashed, FaultPlan, FaultPoint};
use crate::health::Readiness;
use crate::persist::{Persisted, PreCommitted};
use crate::settings::JobSettings;

const JOB: &str = r#"
[job]
name = "unit"
state_dir = "unused"
[kafka]
brokers = "127.0.0.1:1"
source_topic = "orders"
consumer_group = "tally-unit"
[clickhouse]
url = "http://127.0.0.1:1"
"#;

/// A worker's store and operator over the fake sinks, which outlive its restarts.
struct Rig {
    dir: tempfile::TempDir,
    job: Arc<JobSettings>,
    store: Option<Arc<StateStore>>,
    kafka: FakeKafka,
    clickhouse: FakeClickHouse,
    op: WindowOperator,
    offset: i64,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().expect("scratch directory");
        let config = Config::parse("unit.toml", JOB, &[]).expect("config");
        let store = Arc::new(StateStore::open(dir.path(), "unit@orders").expect("store"));
        let mut op = WindowOperator::restore(
            config.operator(),
            config.program().expect("a JSON job's program"),
            Epoch(0),
            &BTreeMap::new(),
        );
        op.add_partition(0, 0);
        Rig {
            dir,
            job: Arc::new(config.resolve().expect("resolves")),
            store: Some(store),
            kafka: FakeKafka::default(),
            clickhouse: FakeClickHouse::default(),
            op,
            offset: 0,
        }
    }

    fn store(&self) -> Arc<StateStore> {
        self.store.clone().expect("an open store")
    }

    /// A committer of a (re)started process: a new producer-less client of the same sinks.
    fn committer(&self, fault: FaultPlan) -> Committer<FakeKafka, FakeClickHouse> {
        let parts = CommitterParts {
            job: self.job.clone(),
            task: self.job.whole(),
            shutdown: Arc::new(AtomicBool::new(false)),
            fault,
            store: self.store(),
            readiness: Arc::new(Readiness::default()),
            committed: Arc::new(tokio::sync::Notify::new()),
        };
        let mut committer = Committer::new(parts, self.kafka.restarted(), self.clickhouse.clone())
            .expect("committer");
        committer.first_backoff = Duration::from_millis(1);
        committer
    }

    /// The process died: the store is opened again from disk.
    fn restart(&mut self) {
        self.store = None;
        self.store = Some(Arc::new(
            StateStore::open(self.dir.path(), "unit@orders").expect("store reopens"),
        ));
    }

    /// `orders` orders and one poison record, cut and pre-committed as the next epoch.
    fn epoch(&mut self, orders: usize) -> PreCommitted {
        let store = self.store();
        let mut values: Vec<Vec<u8>> = (0..orders)
            .map(|i| {
                format!(
                    r#"{{"event_id":"e{}","customer_id":"c{}","currency":"EUR","amount":"2.5","event_time":{}}}"#,
                    self.offset + i as i64,
                    i % 3,
                    1_790_000_000_000 + (self.offset + i as i64) * 1_000
                )
                .into_bytes()
            })
            .collect();
        values.push(b"not json".to_vec());
        for value in &values {
            let record = Record {
                partition: 0,
                offset: self.offset,
                timestamp_ms: None,
                key: None,
                value: Some(value),
            };
            self.op.process(&*store, record).expect("processed");
            self.offset += 1;
        }
        let cut = self.op.cut(CheckpointBarrier {
            epoch: self.op.current_epoch(),
            is_final: false,
        });
        PreCommitted::of(&store, &cut).expect("pre-committed")
    }

    fn status(&self) -> Option<(Epoch, EpochStatus)> {
        self.store().meta().map(|m| (m.epoch, m.status))
    }
}

/// Hands `epochs` to a committer's `run`, as the persister does; returns what it returned and
/// the epochs it reported committed.
fn run(
    committer: Committer<FakeKafka, FakeClickHouse>,
    epochs: Vec<PreCommitted>,
) -> (anyhow::Result<()>, Vec<Epoch>) {
    let (tx, rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    for epoch in epochs {
        let _ = tx.send(Persisted {
            epoch,
            barrier_at: Instant::now(),
            pause: BarrierPause::default(),
        });
    }
    drop(tx);
    let result = committer.run(rx, done_tx);
    (result, done_rx.try_iter().collect())
}

#[test]
fn an_epoch_goes_through_both_sinks_once_and_is_marked_committed() {
    let mut rig = Rig::new();
    let epoch = rig.epoch(5);
    let mut committer = rig.committer(FaultPlan::default());
    committer.ensure_producer().expect("producer");
    let (result, committed) = run(committer, vec![epoch]);
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(committed, [Epoch(1)]);
    let kafka = rig.kafka.state();
    let (offset, mark) = &kafka.committed[&0];
    assert_eq!(*offset, 6, "the group's offset is the epoch's next offset");
    assert_eq!(mark.epoch, Epoch(1));
    assert_eq!(mark.writer.as_deref(), Some(rig.store().writer_id()));
    assert_eq!(
        kafka.transactions,
        [(Epoch(1), 1)],
        "one transaction, its dead letter"
    );
    assert_eq!(kafka.changelog_ends.get(&0), Some(&1));
    let clickhouse = rig.clickhouse.state();
    assert_eq!(clickhouse.batches.len(), 1);
    let batch = clickhouse.batches.values().next().expect("a batch");
    assert_eq!((batch.totals.events, batch.totals.dead_letters), (5, 1));
    drop((kafka, clickhouse));
    assert_eq!(rig.status(), Some((Epoch(1), EpochStatus::Committed)));
}

#[test]
fn failing_sinks_are_retried_until_they_succeed_and_a_failed_transaction_gets_a_new_producer() {
    let mut rig = Rig::new();
    let epoch = rig.epoch(3);
    rig.kafka.state().fail_commits = 2;
    rig.clickhouse.state().fail_writes = 3;
    let (result, committed) = run(rig.committer(FaultPlan::default()), vec![epoch]);
    assert!(result.is_ok(), "{result:?}");
    assert_eq!(committed, [Epoch(1)]);
    let kafka = rig.kafka.state();
    assert_eq!(kafka.transactions.len(), 1, "committed once");
    assert_eq!(
        kafka.producer_epoch, 3,
        "a new producer after each failed transaction"
    );
    assert_eq!(rig.clickhouse.state().batches.len(), 1);
}

#[test]
fn a_shutdown_while_a_sink_fails_stops_without_skipping_the_epoch() {
    let mut rig = Rig::new();
    let epoch = rig.epoch(3);
    rig.clickhouse.state().fail_writes = u32::MAX;
    let committer = rig.committer(FaultPlan::default());
    committer
        .shutdown
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (result, committed) = run(committer, vec![epoch]);
    assert!(
        result.is_err_and(|e| e.is::<crate::retry::Interrupted>()),
        "interrupted"
    );
    assert!(committed.is_empty());
    assert_eq!(rig.status(), Some((Epoch(1), EpochStatus::PreCommitted)));
}

/// Commits epoch 1, crashes at `point` while committing epoch 2, restarts, recovers: each sink
/// holds each epoch exactly once and the store marks epoch 2 committed. Returns the rig.
fn crash_and_recover(point: FaultPoint) -> Rig {
    let mut rig = Rig::new();
    let first = rig.epoch(3);
    let (result, _) = run(rig.committer(FaultPlan::default()), vec![first]);
    assert!(result.is_ok(), "{result:?}");
    let second = rig.epoch(4);
    let (result, committed) = run(
        rig.committer(FaultPlan::crash_at(point, Some(Epoch(2)))),
        vec![second],
    );
    assert!(
        result.is_err_and(|e| e.is::<Crashed>()),
        "{point:?}: the committer crashed there"
    );
    assert!(committed.is_empty(), "{point:?}");
    rig.restart();
    let mut committer = rig.committer(FaultPlan::default());
    committer.recover().expect("recovered");
    committer.ensure_producer().expect("producer");
    assert_eq!(
        rig.kafka.state().transactions,
        [(Epoch(1), 1), (Epoch(2), 1)],
        "{point:?}: each transaction committed exactly once"
    );
    assert_eq!(rig.clickhouse.state().batches.len(), 2, "{point:?}");
    assert_eq!(
        rig.status(),
        Some((Epoch(2), EpochStatus::Committed)),
        "{point:?}"
    );
    rig
}

#[test]
fn a_crash_after_the_kafka_commit_does_not_send_the_transaction_again() {
    let rig = crash_and_recover(FaultPoint::AfterDeadLetterCommit);
    assert_eq!(rig.clickhouse.state().already_committed, 0);
}

#[test]
fn a_crash_after_the_clickhouse_write_finds_the_batch_committed() {
    let rig = crash_and_recover(FaultPoint::AfterClickHouseInsert);
    assert_eq!(
        rig.clickhouse.state().already_committed,
        1,
        "the restart's write found the batch"
    );
}

#[test]
fn a_transaction_kafka_undid_is_sent_again_at_the_restart() {
    // The transaction was written and aborted, the epoch went on as committed (ClickHouse has
    // it), and the worker died: the restart finds the group's offsets behind it and resends.
    let rig = crash_and_recover(FaultPoint::KafkaCommitLost);
    assert_eq!(rig.kafka.state().committed[&0].1.epoch, Epoch(2));
}

#[test]
fn a_crash_during_the_restart_is_recovered_by_the_next_one() {
    let mut rig = Rig::new();
    let epoch = rig.epoch(2);
    drop(epoch); // pre-committed only: the process died before the sinks
    let mut committer = rig.committer(FaultPlan::crash_at(FaultPoint::DuringRestore, None));
    assert!(committer.recover().is_err_and(|e| e.is::<Crashed>()));
    drop(committer);
    rig.restart();
    rig.committer(FaultPlan::default())
        .recover()
        .expect("recovered");
    assert_eq!(rig.kafka.state().transactions.len(), 1);
    assert_eq!(rig.status(), Some((Epoch(1), EpochStatus::Committed)));
}

#[test]
fn epochs_left_pre_committed_are_completed_oldest_first() {
    let mut rig = Rig::new();
    let first = rig.epoch(2);
    let second = rig.epoch(3);
    drop((first, second));
    rig.restart();
    rig.committer(FaultPlan::default())
        .recover()
        .expect("recovered");
    let kafka = rig.kafka.state();
    assert_eq!(
        kafka
            .transactions
            .iter()
            .map(|(e, _)| *e)
            .collect::<Vec<_>>(),
        [Epoch(1), Epoch(2)]
    );
    assert_eq!(kafka.committed[&0].0, 7);
    assert_eq!(rig.clickhouse.state().batches.len(), 2);
    drop(kafka);
    assert_eq!(rig.status(), Some((Epoch(2), EpochStatus::Committed)));
}

#[test]
fn another_writer_s_commit_stops_the_worker_before_it_fences_anyone() {
    let rig = Rig::new();
    rig.kafka.state().committed.insert(
        0,
        (
            9,
            tally_kafka::CommitMark {
                epoch: Epoch(4),
                writer: Some("someone-else".into()),
                restore_from: None,
            },
        ),
    );
    let mut committer = rig.committer(FaultPlan::default());
    let error = committer.ensure_producer().expect_err("refused");
    assert!(error.is::<crate::marks::AnotherWriter>(), "{error:#}");
    assert_eq!(rig.kafka.state().producer_epoch, 0, "nobody fenced");
}

#[test]
fn batches_past_the_state_that_kafka_undid_are_found_and_any_other_lead_is_refused() {
    let mut rig = Rig::new();
    let first = rig.epoch(2);
    let (result, _) = run(rig.committer(FaultPlan::default()), vec![first]);
    assert!(result.is_ok(), "{result:?}");
    // ClickHouse holds a batch past the store's offset 3, and Kafka's offsets agree with the
    // store: an epoch whose transaction Kafka undid, made by a directory since lost.
    let rows = [];
    let lost = tally_clickhouse::Batch {
        job: "unit",
        epoch: Epoch(2),
        offsets: vec![(0, 3, 6)],
        watermarks: vec![i64::MIN],
        rows: &rows,
        event_count: 3,
        revenue_units: 0,
        dead_letters: 0,
        filtered_count: 0,
        duplicate_count: 0,
        stale_count: 0,
        tombstone_count: 0,
        source_lsn: 0,
    };
    rig.clickhouse.write(&lost, &|_| {}).expect("written");
    let committer = rig.committer(FaultPlan::default());
    let undone = committer.undone_batches().expect("read");
    assert_eq!(
        undone
            .iter()
            .map(|b| (b.from_offsets.clone(), b.to_offsets.clone()))
            .collect::<Vec<_>>(),
        [(vec![3], vec![6])]
    );
    // With Kafka's offsets past the store as well, no replay explains the lead: refused.
    rig.kafka
        .state()
        .committed
        .get_mut(&0)
        .expect("committed")
        .0 = 6;
    let error = committer.undone_batches().expect_err("refused");
    assert!(
        error.to_string().contains("has partition 0 up to offset 6"),
        "{error:#}"
    );
}

use super::sinks::BatchSink as _;
