use super::*;
use crate::amount::Amount;
use crate::declare::FieldMapping;
use crate::mem::MemStore;

fn operator() -> WindowOperator {
    operator_of(OperatorConfig {
        window: WindowSpec::tumbling(60_000),
        out_of_orderness_ms: 5_000,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
        windows_from_ms: None,
    })
}

/// revenue_agg's operator by `config`, new.
fn operator_of(config: OperatorConfig) -> WindowOperator {
    WindowOperator::restore(
        config,
        Program::revenue_agg(&FieldMapping::default(), &config, 4096).expect("revenue_agg"),
        Epoch(0),
        &BTreeMap::new(),
    )
}

fn order(id: &str, amount: &str, t: i64) -> Vec<u8> {
    format!(r#"{{"event_id":"{id}","customer_id":"c","currency":"EUR","amount":"{amount}","event_time":{t}}}"#).into_bytes()
}

fn feed(op: &mut WindowOperator, store: &MemStore, offset: i64, value: &[u8]) -> Outcome {
    let record = Record {
        partition: 0,
        offset,
        timestamp_ms: None,
        key: None,
        value: Some(value),
    };
    match op.process(store, record) {
        Ok(outcome) => outcome,
        Err(never) => match never {},
    }
}

/// Counts dedup lookups that reach the store.
#[derive(Default)]
struct CountingStore {
    inner: MemStore,
    seen_lookups: std::cell::Cell<u64>,
}

impl StateReader for CountingStore {
    type Error = std::convert::Infallible;
    fn window(&self, p: PartitionId, key: &WindowKey) -> Result<Option<WindowAgg>, Self::Error> {
        self.inner.window(p, key)
    }
    fn seen_event_time(&self, p: PartitionId, id: &str) -> Result<Option<i64>, Self::Error> {
        self.seen_lookups.set(self.seen_lookups.get() + 1);
        self.inner.seen_event_time(p, id)
    }
    fn source_row(
        &self,
        p: PartitionId,
        key: &str,
    ) -> Result<Option<crate::SourceRow>, Self::Error> {
        self.inner.source_row(p, key)
    }
}

#[test]
fn new_ids_skip_the_store_once_the_filter_is_complete() {
    let mut store = CountingStore::default();
    let mut op = operator();
    let mut offset = 0;
    let mut run = |op: &mut WindowOperator, store: &CountingStore, ids: std::ops::Range<u32>| {
        for n in ids {
            let record = order(&format!("id-{n}"), "1", 1_000_000 + i64::from(n));
            let value = Some(record.as_slice());
            let r = Record {
                partition: 0,
                offset,
                timestamp_ms: None,
                key: None,
                value,
            };
            offset += 1;
            let Ok(outcome) = op.process(store, r);
            assert_eq!(outcome, Outcome::Aggregated);
        }
    };
    // A partition without a checkpoint: its filter is complete from the start.
    run(&mut op, &store, 0..2_000);
    assert!(
        store.seen_lookups.get() < 60,
        "{} lookups",
        store.seen_lookups.get()
    );
    store.inner.apply(&op.handle_checkpoint(CheckpointBarrier {
        epoch: op.current_epoch(),
        is_final: false,
    }));
    // Restored from the store: every lookup goes to the store until the filter is adopted.
    let mut op = WindowOperator::restore(
        op.config,
        Program::revenue_agg(&FieldMapping::default(), &op.config, 4096).expect("revenue_agg"),
        store.inner.epoch,
        &store.inner.partitions,
    );
    assert_eq!(op.partitions_awaiting_seen_filter(), vec![0]);
    store.seen_lookups.set(0);
    run(&mut op, &store, 2_000..3_000);
    assert_eq!(store.seen_lookups.get(), 1_000);
    let mut restored = SeenIdFilter::new(op.config.dedup_horizon_ms, 4_096);
    for ((_, id), t) in &store.inner.seen {
        restored.insert(seen_filter::id_hash(id.as_bytes()), *t);
    }
    op.adopt_seen_filter(0, restored);
    assert!(op.partitions_awaiting_seen_filter().is_empty());
    store.seen_lookups.set(0);
    run(&mut op, &store, 3_000..5_000);
    assert!(
        store.seen_lookups.get() < 60,
        "{} lookups",
        store.seen_lookups.get()
    );
    // An id the store holds is still found.
    let Ok(outcome) = op.process(
        &store,
        Record {
            partition: 0,
            offset,
            timestamp_ms: None,
            key: None,
            value: Some(&order("id-7", "1", 1_000_007)),
        },
    );
    assert_eq!(outcome, Outcome::Duplicate);
}

#[test]
fn a_joining_partition_starts_at_the_job_s_watermark() {
    let store = MemStore::default();
    let mut op = operator();
    op.add_joining_partition(0, 0, 240_000);
    // Window [60_000, 120_000): end + lateness (60 s) = 180_000 <= 240_000: late, although
    // the partition saw no event before.
    assert_eq!(
        feed(&mut op, &store, 0, &order("a", "1", 119_999)),
        Outcome::DeadLettered(PoisonReason::Late)
    );
    // Window [180_000, 240_000): end + lateness = 300_000 > 240_000: aggregated.
    assert_eq!(
        feed(&mut op, &store, 1, &order("b", "1", 190_000)),
        Outcome::Aggregated
    );
    let cp = op.handle_checkpoint(CheckpointBarrier {
        epoch: op.current_epoch(),
        is_final: false,
    });
    assert_eq!(
        (
            cp.partitions[&0].epoch.late,
            cp.partitions[&0].epoch.aggregated
        ),
        (1, 1)
    );
    // Its watermark is checkpointed: a restart resumes with it.
    assert_eq!(cp.partitions[&0].watermark.current(5_000), Some(240_000));
    // A partition that is already in the job keeps its own watermark.
    op.add_joining_partition(0, 2, 10_000_000);
    assert_eq!(
        feed(&mut op, &store, 2, &order("c", "1", 200_000)),
        Outcome::Aggregated
    );
}

#[test]
fn lateness_edge_is_exclusive_of_the_watermark() {
    let store = MemStore::default();
    let mut op = operator();
    // Watermark = 185_000 - 5_000 = 180_000.
    assert_eq!(
        feed(&mut op, &store, 0, &order("a", "1", 185_000)),
        Outcome::Aggregated
    );
    // Window [60_000, 120_000): end + lateness = 180_000 <= watermark: late.
    assert_eq!(
        feed(&mut op, &store, 1, &order("b", "1", 119_999)),
        Outcome::DeadLettered(PoisonReason::Late)
    );
    // Window [120_000, 180_000): end + lateness = 240_000 > watermark: accepted.
    assert_eq!(
        feed(&mut op, &store, 2, &order("c", "1", 120_000)),
        Outcome::Aggregated
    );
    assert!(op.pending_dead_letter_bytes() > order("b", "1", 119_999).len());
    let cp = op.handle_checkpoint(CheckpointBarrier {
        epoch: Epoch(1),
        is_final: false,
    });
    assert_eq!(op.pending_dead_letter_bytes(), 0);
    let acc = cp.accounting();
    assert_eq!((acc.consumed, acc.aggregated, acc.late), (3, 2, 1));
    assert_eq!(cp.dead_letters.len(), 1);
    assert_eq!(cp.dead_letters[0].offset, 1);
    assert_eq!(cp.close_windows_before, vec![(0, 60_001)]);
}

#[test]
fn duplicates_are_counted_not_aggregated_across_checkpoints() {
    let mut store = MemStore::default();
    let mut op = operator();
    assert_eq!(
        feed(&mut op, &store, 0, &order("a", "1.5", 1_000)),
        Outcome::Aggregated
    );
    assert_eq!(
        feed(&mut op, &store, 1, &order("a", "1.5", 1_000)),
        Outcome::Duplicate
    );
    let cp = op.handle_checkpoint(CheckpointBarrier {
        epoch: Epoch(1),
        is_final: false,
    });
    store.apply(&cp);
    assert_eq!(
        feed(&mut op, &store, 2, &order("a", "9", 2_000)),
        Outcome::Duplicate
    );
    let cp2 = op.handle_checkpoint(CheckpointBarrier {
        epoch: Epoch(2),
        is_final: false,
    });
    assert!(cp2.rows.is_empty());
    assert_eq!(cp2.accounting().duplicates, 1);
    assert_eq!(cp.rows[0].value, WindowAgg::of_orders(1, Amount(15_000)));
}

#[test]
fn dedup_entries_expire_by_event_time() {
    let mut op = operator_of(OperatorConfig {
        window: WindowSpec::tumbling(10),
        out_of_orderness_ms: 0,
        allowed_lateness_ms: 0,
        dedup_horizon_ms: 100,
        windows_from_ms: None,
    });
    let store = MemStore::default();
    assert_eq!(
        feed(&mut op, &store, 0, &order("a", "1", 1_000)),
        Outcome::Aggregated
    );
    assert_eq!(
        feed(&mut op, &store, 1, &order("x", "1", 1_099)),
        Outcome::Aggregated
    );
    // Horizon not yet passed (1_000 + 100 > 1_099): still a duplicate.
    assert_eq!(
        feed(&mut op, &store, 2, &order("a", "1", 1_099)),
        Outcome::Duplicate
    );
    assert_eq!(
        feed(&mut op, &store, 3, &order("y", "1", 1_100)),
        Outcome::Aggregated
    );
    // Horizon passed: the id is new again and its event is judged on its own time.
    assert_eq!(
        feed(&mut op, &store, 4, &order("a", "1", 1_100)),
        Outcome::Aggregated
    );
}

#[test]
fn window_revenue_overflow_goes_to_dead_letters() {
    let store = MemStore::default();
    let mut op = operator();
    let max = "99999999999999.9999";
    // Decimal(18,4) holds exactly one maximal input amount; a second one cannot fit.
    assert_eq!(
        feed(&mut op, &store, 0, &order("a", max, 1_000)),
        Outcome::Aggregated
    );
    assert_eq!(
        feed(&mut op, &store, 1, &order("b", "0.0001", 1_000)),
        Outcome::DeadLettered(PoisonReason::TooLarge)
    );
    assert_eq!(
        feed(&mut op, &store, 2, &order("c", "-1", 1_000)),
        Outcome::Aggregated
    );
    assert_eq!(
        feed(&mut op, &store, 3, &order("b", "0.0001", 1_000)),
        Outcome::Aggregated,
        "the refused id was not recorded as seen"
    );
    let cp = op.handle_checkpoint(CheckpointBarrier {
        epoch: Epoch(1),
        is_final: false,
    });
    assert_eq!(
        cp.rows[0].value,
        WindowAgg::of_orders(3, Amount(999_999_999_999_990_000))
    );
    assert_eq!(cp.dead_letters[0].reason, PoisonReason::TooLarge);
    assert!(cp.accounting().balances());
}

#[test]
fn records_below_the_checkpointed_offset_are_not_processed_twice() {
    let store = MemStore::default();
    let mut op = operator();
    assert_eq!(
        feed(&mut op, &store, 5, &order("a", "1", 1_000)),
        Outcome::Aggregated
    );
    assert_eq!(
        feed(&mut op, &store, 5, &order("b", "1", 1_000)),
        Outcome::AlreadyProcessed
    );
    assert_eq!(op.next_offsets().get(&0), Some(&6));
}

/// A new version's `restate_from`: windows that start before it are not computed, and a record
/// of none other is filtered out, counted as such.
#[test]
fn a_restatement_computes_only_the_windows_from_its_start() {
    let run = |window: WindowSpec| {
        let mut op = operator_of(OperatorConfig {
            window,
            out_of_orderness_ms: 5_000,
            allowed_lateness_ms: 60_000,
            dedup_horizon_ms: 3_600_000,
            windows_from_ms: Some(120_000),
        });
        let store = MemStore::default();
        let outcomes: Vec<Outcome> = [30_000, 119_999, 120_000, 130_000]
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let offset = i64::try_from(i).unwrap_or_default();
                feed(&mut op, &store, offset, &order(&format!("id-{i}"), "1", t))
            })
            .collect();
        let cp = op.handle_checkpoint(CheckpointBarrier {
            epoch: Epoch(1),
            is_final: false,
        });
        let starts: Vec<i64> = cp.rows.iter().map(|r| r.key.window_start_ms).collect();
        let acc = cp.accounting();
        (outcomes, starts, acc)
    };
    let (outcomes, starts, acc) = run(WindowSpec::tumbling(60_000));
    assert_eq!(
        outcomes,
        [
            Outcome::Filtered,
            Outcome::Filtered,
            Outcome::Aggregated,
            Outcome::Aggregated
        ]
    );
    assert_eq!(starts, [120_000]);
    assert_eq!((acc.consumed, acc.filtered, acc.aggregated), (4, 2, 2));
    assert!(acc.balances());
    // Hopping: 130 s is also in the window from 60 s, which is not computed.
    let (outcomes, starts, acc) = run(WindowSpec {
        size_ms: 120_000,
        slide_ms: 60_000,
    });
    assert_eq!(outcomes[..2], [Outcome::Filtered, Outcome::Filtered]);
    assert_eq!(starts, [120_000]);
    assert_eq!((acc.filtered, acc.aggregated), (2, 2));
    assert!(acc.balances());
}
