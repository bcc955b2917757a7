//! Property tests over random streams with disorder, duplicates, poison and late events.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use proptest::prelude::*;
use tally_core::FieldMapping;
use tally_core::seen_filter::id_hash;
use tally_core::{
    Accounting, Checkpoint, CheckpointBarrier, EpochCut, MemStore, OperatorConfig, PartitionId,
    Program, Record, SeenIdFilter, WindowAgg, WindowKey, WindowOperator, WindowSpec, WithInFlight,
};

const CONFIG: OperatorConfig = OperatorConfig {
    window: WindowSpec::tumbling(10_000),
    out_of_orderness_ms: 2_000,
    allowed_lateness_ms: 5_000,
    dedup_horizon_ms: 20_000,
    windows_from_ms: None,
};

#[derive(Debug, Clone)]
enum Item {
    Order {
        id: u8,
        customer: u8,
        currency: u8,
        cents: i32,
        dt: i64,
    },
    Poison(u8),
}

fn item() -> impl Strategy<Value = Item> {
    prop_oneof![
        8 => (0u8..40, 0u8..4, 0u8..2, -500i32..5_000, -9_000i64..3_000)
            .prop_map(|(id, customer, currency, cents, dt)| Item::Order { id, customer, currency, cents, dt }),
        1 => (0u8..8).prop_map(Item::Poison),
    ]
}

fn stream() -> impl Strategy<Value = Vec<(PartitionId, Item)>> {
    prop::collection::vec((0i32..3, item()), 1..160)
}

fn encode(partition: PartitionId, clock: &mut BTreeMap<PartitionId, i64>, item: &Item) -> Vec<u8> {
    match item {
        Item::Order { id, customer, currency, cents, dt } => {
            let now = clock.entry(partition).or_insert(1_000_000);
            *now += 700;
            let t = *now + dt;
            let ccy = ["EUR", "USD"][usize::from(*currency)];
            let sign = if *cents < 0 { "-" } else { "" };
            let abs = cents.unsigned_abs();
            format!(
                r#"{{"event_id":"e{id}","customer_id":"c{customer}","currency":"{ccy}","amount":"{sign}{}.{:02}","event_time":{t}}}"#,
                abs / 100,
                abs % 100
            )
            .into_bytes()
        }
        Item::Poison(kind) => match kind {
            0 => b"\xc3\x28".to_vec(),
            1 => b"{not json".to_vec(),
            2 => br#"{"customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#.to_vec(),
            3 => br#"{"event_id":1,"customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#.to_vec(),
            4 => br#"{"event_id":"p","customer_id":"c","currency":"EUR","amount":"x","event_time":1}"#.to_vec(),
            5 => br#"{"event_id":"p","customer_id":"c","currency":"eu","amount":1,"event_time":1}"#.to_vec(),
            6 => br#"{"event_id":"p","customer_id":"c","currency":"EUR","amount":1,"event_time":"x"}"#.to_vec(),
            _ => vec![b' '; 600],
        },
    }
}

/// Records with per-partition offsets, as a consumer would deliver them.
fn records(items: &[(PartitionId, Item)]) -> Vec<(PartitionId, i64, Vec<u8>)> {
    let mut clock = BTreeMap::new();
    let mut next: BTreeMap<PartitionId, i64> = BTreeMap::new();
    items
        .iter()
        .map(|(p, item)| {
            let offset = next.entry(*p).or_insert(0);
            let r = (*p, *offset, encode(*p, &mut clock, item));
            *offset += 1;
            r
        })
        .collect()
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Outputs {
    /// What a reader of the sink sees: the latest value of each window per partition.
    view: BTreeMap<(PartitionId, WindowKey), WindowAgg>,
    /// Dead letters by (partition, offset) → reason; a repeat is an error.
    dead_letters: BTreeMap<(PartitionId, i64), String>,
    totals: BTreeMap<PartitionId, Accounting>,
}

struct Run {
    store: MemStore,
    outputs: Outputs,
    snapshots: Vec<(MemStore, Outputs)>,
}

fn decoder() -> Program {
    Program::revenue_agg(&FieldMapping::default(), &CONFIG, 512).expect("revenue_agg")
}

/// How a restored operator's dedup id filter is completed.
#[derive(Debug, Clone, Copy)]
enum Filter {
    /// Never: every lookup of a restored partition goes to the store.
    StoreOnly,
    /// From the store's ids, with this first capacity (1 saturates it: many false positives).
    Adopted(usize),
}

fn restore(store: &MemStore, filter: Filter) -> WindowOperator {
    let op = WindowOperator::restore(CONFIG, decoder(), store.epoch, &store.partitions);
    let Filter::Adopted(capacity) = filter else {
        return op;
    };
    let mut op = op.with_seen_filter_capacity(capacity);
    for p in op.partitions_awaiting_seen_filter() {
        let mut ids = SeenIdFilter::new(CONFIG.dedup_horizon_ms, capacity);
        for ((sp, id), t) in &store.seen {
            if *sp == p {
                ids.insert(id_hash(id.as_bytes()), *t);
            }
        }
        op.adopt_seen_filter(p, ids);
    }
    op
}

fn process(
    store: &mut MemStore,
    outputs: &mut Outputs,
    records: &[(PartitionId, i64, Vec<u8>)],
    barriers: &BTreeSet<usize>,
    snapshots: &mut Vec<(MemStore, Outputs)>,
    filter: Filter,
) {
    let mut op = restore(store, filter);
    let checkpoint = |op: &mut WindowOperator, store: &mut MemStore, outputs: &mut Outputs| {
        let cp = op.handle_checkpoint(CheckpointBarrier {
            epoch: op.current_epoch(),
            is_final: false,
        });
        // (b) the accounting equation holds per partition in every epoch and in the totals.
        for (p, pc) in &cp.partitions {
            assert!(
                pc.epoch.balances(),
                "epoch {} partition {p}: {:?}",
                cp.epoch,
                pc.epoch
            );
            assert!(
                pc.totals.balances(),
                "totals partition {p}: {:?}",
                pc.totals
            );
            assert_eq!(
                pc.epoch.consumed as i64,
                pc.next_offset - pc.epoch_start_offset
            );
        }
        assert_eq!(
            cp.dead_letters.len() as u64,
            cp.accounting().dead_lettered + cp.accounting().late
        );
        commit(store, outputs, &cp);
    };
    for (i, (p, offset, value)) in records.iter().enumerate() {
        let Ok(_) = op.process(&*store, record(*p, *offset, value));
        if barriers.contains(&i) {
            checkpoint(&mut op, store, outputs);
            snapshots.push((store.clone(), clone_outputs(outputs)));
        }
    }
    checkpoint(&mut op, store, outputs);
}

fn record(partition: PartitionId, offset: i64, value: &[u8]) -> Record<'_> {
    Record {
        partition,
        offset,
        timestamp_ms: Some(0),
        key: None,
        value: Some(value),
    }
}

/// What the committer does with a checkpoint: the store and the sinks take it.
fn commit(store: &mut MemStore, outputs: &mut Outputs, cp: &Checkpoint) {
    store.apply(cp);
    for row in &cp.rows {
        outputs
            .view
            .insert((row.partition, row.key.clone()), row.value.clone());
    }
    for dl in &cp.dead_letters {
        let previous = outputs
            .dead_letters
            .insert((dl.partition, dl.offset), dl.reason.to_string());
        assert_eq!(previous, None, "dead letter repeated: {dl:?}");
    }
    for (p, pc) in &cp.partitions {
        outputs.totals.insert(*p, pc.totals);
    }
}

/// Like `run`, but each cut becomes durable only later (pipelined checkpoints): the operator
/// goes on reading through the cuts in flight until the store holds them (the worker's
/// pre-commit; its sinks' later steps change no state the operator reads). After each record
/// in `commit_at` the oldest cut in flight is committed; at most `max_in_flight` are held.
fn run_pipelined(
    records: &[(PartitionId, i64, Vec<u8>)],
    barriers: &BTreeSet<usize>,
    commit_at: &BTreeSet<usize>,
    max_in_flight: usize,
) -> (MemStore, Outputs) {
    let mut store = MemStore::default();
    let mut outputs = Outputs::default();
    let mut in_flight: VecDeque<Arc<EpochCut>> = VecDeque::new();
    let mut op = WindowOperator::restore(CONFIG, decoder(), store.epoch, &store.partitions);
    let barrier = |op: &mut WindowOperator| {
        Arc::new(op.cut(CheckpointBarrier {
            epoch: op.current_epoch(),
            is_final: false,
        }))
    };
    for (i, (p, offset, value)) in records.iter().enumerate() {
        let reader = WithInFlight {
            cuts: &in_flight,
            store: &store,
        };
        let Ok(_) = op.process(&reader, record(*p, *offset, value));
        if barriers.contains(&i) {
            // Backpressure: a full pipeline commits its oldest cut first.
            while in_flight.len() >= max_in_flight {
                let cut = in_flight.pop_front().unwrap();
                commit(&mut store, &mut outputs, &cut.to_checkpoint());
            }
            in_flight.push_back(barrier(&mut op));
        }
        if commit_at.contains(&i)
            && let Some(cut) = in_flight.pop_front()
        {
            commit(&mut store, &mut outputs, &cut.to_checkpoint());
        }
    }
    in_flight.push_back(barrier(&mut op));
    for cut in in_flight {
        commit(&mut store, &mut outputs, &cut.to_checkpoint());
    }
    (store, outputs)
}

fn clone_outputs(o: &Outputs) -> Outputs {
    Outputs {
        view: o.view.clone(),
        dead_letters: o.dead_letters.clone(),
        totals: o.totals.clone(),
    }
}

fn run(records: &[(PartitionId, i64, Vec<u8>)], barriers: &BTreeSet<usize>) -> Run {
    let mut store = MemStore::default();
    let mut outputs = Outputs::default();
    let mut snapshots = vec![(MemStore::default(), Outputs::default())];
    process(
        &mut store,
        &mut outputs,
        records,
        barriers,
        &mut snapshots,
        Filter::StoreOnly,
    );
    Run {
        store,
        outputs,
        snapshots,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// (a) Restoring from any checkpoint and replaying the rest of the input gives the same
    /// final aggregates, dead letters and counts as a run without a restart, whether the
    /// restored operator's id filter is rebuilt from the store (tiny and saturated or not) or
    /// every lookup goes to the store.
    #[test]
    fn restore_from_any_checkpoint_is_equivalent(
        items in stream(),
        barriers in prop::collection::btree_set(0usize..160, 0..12),
        replay_barriers in prop::collection::btree_set(0usize..160, 0..12),
        pick in any::<prop::sample::Index>(),
        filter in prop_oneof![Just(Filter::StoreOnly), Just(Filter::Adopted(1)), Just(Filter::Adopted(1 << 16))],
    ) {
        let records = records(&items);
        let reference = run(&records, &barriers);
        let (mut store, mut outputs) = {
            let (s, o) = &reference.snapshots[pick.index(reference.snapshots.len())];
            (s.clone(), clone_outputs(o))
        };
        // The consumer seeks every partition to its checkpointed offset.
        let rest: Vec<_> = records
            .iter()
            .filter(|(p, offset, _)| store.partitions.get(p).is_none_or(|c| *offset >= c.next_offset))
            .cloned()
            .collect();
        process(&mut store, &mut outputs, &rest, &replay_barriers, &mut Vec::new(), filter);
        prop_assert_eq!(&outputs, &reference.outputs);
        prop_assert_eq!(store.windows, reference.store.windows);
        // Every record is accounted for once.
        let consumed: u64 = outputs.totals.values().map(|a| a.consumed).sum();
        prop_assert_eq!(consumed, records.len() as u64);
    }

    /// Splitting the input into epochs differently never changes the results.
    #[test]
    fn barrier_placement_does_not_change_results(
        items in stream(),
        a in prop::collection::btree_set(0usize..160, 0..20),
        b in prop::collection::btree_set(0usize..160, 0..20),
    ) {
        let records = records(&items);
        prop_assert_eq!(run(&records, &a).outputs, run(&records, &b).outputs);
    }

    /// Committing each epoch later, while the next ones are processed through the cuts in
    /// flight, gives the same outputs and the same durable state as committing at the barrier.
    #[test]
    fn pipelined_commits_equal_stop_the_world(
        items in stream(),
        barriers in prop::collection::btree_set(0usize..160, 0..20),
        commit_at in prop::collection::btree_set(0usize..160, 0..20),
        max_in_flight in 1usize..4,
    ) {
        let records = records(&items);
        let reference = run(&records, &barriers);
        let (store, outputs) = run_pipelined(&records, &barriers, &commit_at, max_in_flight);
        prop_assert_eq!(&outputs, &reference.outputs);
        prop_assert_eq!(store, reference.store);
    }

    /// Revenue per window equals the sum of accepted amounts: the view and the accounting agree.
    #[test]
    fn view_matches_accounting(items in stream()) {
        let records = records(&items);
        let r = run(&records, &BTreeSet::new());
        let view_orders: u64 = r.outputs.view.values().map(|v| v.orders()).sum();
        let view_revenue: i128 = r.outputs.view.values().map(|v| i128::from(v.revenue().units())).sum();
        let aggregated: u64 = r.outputs.totals.values().map(|a| a.aggregated).sum();
        let revenue: i128 = r.outputs.totals.values().map(|a| a.revenue_units).sum();
        prop_assert_eq!(view_orders, aggregated);
        prop_assert_eq!(view_revenue, revenue);
        // Only open windows remain in state: closed ones were emitted and dropped.
        for (p, key) in r.store.windows.keys() {
            let wm = r.store.partitions[p].watermark.current(CONFIG.out_of_orderness_ms).unwrap();
            prop_assert!(key.window_start_ms + CONFIG.window.size_ms + CONFIG.allowed_lateness_ms > wm);
        }
    }
}
