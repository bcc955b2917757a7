//! The operator running a job of change events: a row's update retracts what its earlier image
//! added, once per source position, whatever Debezium replays; checked against the table the
//! changes describe.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::declare::WindowRules;
use crate::declare::tests::{ORDERS_CHANGES, job};
use crate::mem::MemStore;
use crate::window_agg::Word;

const HOUR_MS: i64 = 3_600_000;
const T0: i64 = 1_796_000_000_000 - 1_796_000_000_000 % HOUR_MS;

fn rules(allowed_lateness_ms: i64) -> WindowRules {
    WindowRules {
        size_ms: HOUR_MS,
        slide_ms: None,
        allowed_lateness_ms,
        dedup_horizon_ms: 2 * HOUR_MS + allowed_lateness_ms,
    }
}

fn operator(allowed_lateness_ms: i64) -> (WindowOperator, Arc<Job>) {
    restating(allowed_lateness_ms, None)
}

/// A version restating the windows from `windows_from_ms` on.
fn restating(allowed_lateness_ms: i64, windows_from_ms: Option<i64>) -> (WindowOperator, Arc<Job>) {
    let rules = rules(allowed_lateness_ms);
    let job = Arc::new(job(ORDERS_CHANGES, rules));
    let config = OperatorConfig {
        window: job.windows,
        out_of_orderness_ms: 0,
        allowed_lateness_ms: rules.allowed_lateness_ms,
        dedup_horizon_ms: rules.dedup_horizon_ms,
        windows_from_ms,
    };
    let program = Program::declared(Arc::clone(&job), 4096);
    (
        WindowOperator::restore(config, program, Epoch(0), &BTreeMap::new()),
        job,
    )
}

/// A row of the source table.
#[derive(Debug, Clone, PartialEq)]
struct Order {
    customer: u8,
    cents: i64,
    cancelled: bool,
    created_ms: i64,
}

fn image(id: u64, o: &Order) -> String {
    let created = crate::time::format_ms(o.created_ms).replace('Z', "000Z");
    format!(
        r#"{{"order_id":{id},"customer_id":"c{}","amount":"{}{}.{:02}","status":"{}","created_at":"{created}"}}"#,
        o.customer,
        if o.cents < 0 { "-" } else { "" },
        o.cents.abs() / 100,
        o.cents.abs() % 100,
        if o.cancelled { "cancelled" } else { "paid" },
    )
}

/// A Debezium change event as the JSON converter writes it, with or without its schema
/// envelope.
fn change(
    op: &str,
    id: u64,
    before: Option<&Order>,
    after: Option<&Order>,
    at: Position,
    envelope: bool,
) -> String {
    let before = match (op, before) {
        // REPLICA IDENTITY DEFAULT: a delete carries the key only.
        ("d", _) => format!(
            r#"{{"order_id":{id},"customer_id":null,"amount":null,"status":null,"created_at":null}}"#
        ),
        (_, Some(o)) => image(id, o),
        (_, None) => "null".to_owned(),
    };
    let after = after.map_or("null".to_owned(), |o| image(id, o));
    let payload = format!(
        r#"{{"before":{before},"after":{after},"source":{{"version":"3.6.1.Final","connector":"postgresql","name":"shop","ts_ms":1796000000000,"snapshot":"false","db":"shop","sequence":"[\"{}\",\"{}\"]","schema":"public","table":"orders","txId":771,"lsn":{},"xmin":null}},"transaction":null,"op":"{op}","ts_ms":1796000000001}}"#,
        at.commit_lsn, at.lsn, at.lsn
    );
    if envelope {
        format!(
            r#"{{"schema":{{"type":"struct","fields":[],"optional":false,"name":"shop.public.orders.Envelope"}},"payload":{payload}}}"#
        )
    } else {
        payload
    }
}

fn feed(
    op: &mut WindowOperator,
    store: &MemStore,
    p: PartitionId,
    offset: i64,
    value: Option<&str>,
) -> Outcome {
    let record = Record {
        partition: p,
        offset,
        timestamp_ms: None,
        key: None,
        value: value.map(str::as_bytes),
    };
    match op.process(store, record) {
        Ok(outcome) => outcome,
        Err(never) => match never {},
    }
}

fn barrier(op: &mut WindowOperator, store: &mut MemStore) -> Checkpoint {
    let epoch = op.current_epoch();
    let cp = op.handle_checkpoint(CheckpointBarrier {
        epoch,
        is_final: false,
    });
    store.apply(&cp);
    cp
}

/// The view's answer from the store: per window and customer, the partitions merged, groups
/// whose count fell to 0 left out (as the view leaves them out).
fn answer(job: &Job, store: &MemStore) -> BTreeMap<(i64, String), (u64, i64)> {
    let mut merged: BTreeMap<(i64, String), WindowAgg> = BTreeMap::new();
    for ((_, key), value) in &store.windows {
        let slot = merged
            .entry((key.window_start_ms, key.key.part(0).to_owned()))
            .or_insert_with(|| job.empty_value());
        job.merge(slot, value).expect("no overflow");
    }
    merged
        .into_iter()
        .filter_map(|(k, v)| match v.words() {
            [Word::Count(0), ..] => None,
            [Word::Count(n), Word::Exact(sum), ..] => Some((k, (*n, *sum))),
            other => panic!("unexpected words {other:?}"),
        })
        .collect()
}

/// What the job should show for `table`: the same aggregation, run on the rows.
fn expected(table: &BTreeMap<u64, Order>) -> BTreeMap<(i64, String), (u64, i64)> {
    let mut out: BTreeMap<(i64, String), (u64, i64)> = BTreeMap::new();
    for o in table.values().filter(|o| !o.cancelled) {
        let slot = out
            .entry((
                o.created_ms - o.created_ms.rem_euclid(HOUR_MS),
                format!("c{}", o.customer),
            ))
            .or_default();
        slot.0 += 1;
        slot.1 += o.cents;
    }
    out
}

fn order(customer: u8, cents: i64, hour: i64) -> Order {
    Order {
        customer,
        cents,
        cancelled: false,
        created_ms: T0 + hour * HOUR_MS + 1_234,
    }
}

#[test]
fn updates_retract_what_the_row_added_and_deletes_take_it_out() {
    let (mut op, job) = operator(24 * HOUR_MS);
    let mut store = MemStore::default();
    let pos = |n: u64| Position {
        commit_lsn: n * 10,
        lsn: n * 10 + 1,
    };
    let a = order(1, 1_250, 0);
    let moved = Order {
        customer: 2,
        cents: 990,
        ..order(1, 0, 1)
    };
    let events = [
        change("c", 7, None, Some(&a), pos(1), false),
        change("c", 8, None, Some(&order(1, 100, 0)), pos(2), true),
        // Amount corrected, then customer and hour changed, REPLICA IDENTITY DEFAULT (no before).
        change(
            "u",
            7,
            None,
            Some(&Order {
                cents: 1_300,
                ..a.clone()
            }),
            pos(3),
            false,
        ),
        change("u", 7, None, Some(&moved), pos(4), true),
        change("d", 8, None, None, pos(5), false),
    ];
    for (offset, e) in events.iter().enumerate() {
        assert_eq!(
            feed(&mut op, &store, 0, offset as i64, Some(e)),
            Outcome::Aggregated,
            "{e}"
        );
    }
    assert_eq!(feed(&mut op, &store, 0, 5, None), Outcome::Tombstone);
    let cp = barrier(&mut op, &mut store);
    let mut table = BTreeMap::new();
    table.insert(7, moved);
    assert_eq!(answer(&job, &store), expected(&table));
    // The emptied window is written with a count of 0 (so its version supersedes the last).
    assert!(
        cp.rows
            .iter()
            .any(|r| r.key.window_start_ms == T0 && r.value.words()[0] == Word::Count(0))
    );
    let acc = cp.accounting();
    assert_eq!((acc.consumed, acc.aggregated, acc.tombstones), (6, 5, 1));
    assert!(acc.balances());
    assert_eq!(cp.partitions[&0].newest_change, Some(pos(5)));
    assert_eq!(cp.source_rows.len(), 2);
}

#[test]
fn replays_are_duplicates_older_changes_stale_and_a_snapshot_read_is_an_upsert() {
    let (mut op, job) = operator(24 * HOUR_MS);
    let mut store = MemStore::default();
    let pos = |n: u64| Position {
        commit_lsn: n * 10,
        lsn: n * 10 + 1,
    };
    let a = order(3, 500, 0);
    let b = Order {
        cents: 700,
        ..a.clone()
    };
    let mut offset = 0;
    let mut next = |op: &mut WindowOperator, store: &MemStore, e: &str| {
        offset += 1;
        feed(op, store, 1, offset, Some(e))
    };
    assert_eq!(
        next(
            &mut op,
            &store,
            &change(
                "r",
                1,
                None,
                Some(&a),
                Position {
                    commit_lsn: 0,
                    lsn: 5
                },
                false
            )
        ),
        Outcome::Aggregated
    );
    barrier(&mut op, &mut store);
    assert_eq!(
        next(
            &mut op,
            &store,
            &change("u", 1, Some(&a), Some(&b), pos(2), false)
        ),
        Outcome::Aggregated
    );
    // Debezium restarted from an earlier offset: the same change again, across a barrier too.
    assert_eq!(
        next(
            &mut op,
            &store,
            &change("u", 1, Some(&a), Some(&b), pos(2), false)
        ),
        Outcome::Duplicate
    );
    barrier(&mut op, &mut store);
    assert_eq!(
        next(
            &mut op,
            &store,
            &change("u", 1, Some(&a), Some(&b), pos(2), true)
        ),
        Outcome::Duplicate
    );
    // A re-snapshot of the row as it is changes nothing; an older read of it is stale.
    assert_eq!(
        next(
            &mut op,
            &store,
            &change("r", 1, None, Some(&b), pos(3), false)
        ),
        Outcome::Aggregated
    );
    assert_eq!(
        next(
            &mut op,
            &store,
            &change(
                "r",
                1,
                None,
                Some(&a),
                Position {
                    commit_lsn: 0,
                    lsn: 5
                },
                false
            )
        ),
        Outcome::Stale
    );
    let cp = barrier(&mut op, &mut store);
    let table = BTreeMap::from([(1, b)]);
    assert_eq!(answer(&job, &store), expected(&table));
    let totals = cp.partitions[&1].totals;
    assert_eq!(
        (totals.aggregated, totals.duplicates, totals.stale),
        (3, 2, 1)
    );
    assert!(totals.balances());
}

/// Debezium's incremental snapshot sent a read of a row selected before its delete, after the
/// delete and at a later position (a CI run, after a PostgreSQL restart): the row must not come
/// back. A read of a row the job does not hold still adds it, and one of a held row replaces it.
#[test]
fn a_snapshot_read_sent_after_a_rows_delete_does_not_bring_the_row_back() {
    let (mut op, job) = operator(24 * HOUR_MS);
    let mut store = MemStore::default();
    let pos = |n: u64| Position {
        commit_lsn: n * 10,
        lsn: n * 10,
    };
    let a = order(3, 500, 0);
    let moved = Order {
        customer: 1,
        ..a.clone()
    };
    let mut offset = 0;
    let mut next = |op: &mut WindowOperator, store: &MemStore, e: Option<&str>| {
        offset += 1;
        feed(op, store, 1, offset, e)
    };
    let outcomes = [
        next(
            &mut op,
            &store,
            Some(&change("c", 7, None, Some(&a), pos(1), false)),
        ),
        // The primary key changed: a delete of 7 and a create of 8 in one transaction.
        next(
            &mut op,
            &store,
            Some(&change("d", 7, None, None, pos(2), false)),
        ),
        next(&mut op, &store, None),
        next(
            &mut op,
            &store,
            Some(&change("c", 8, None, Some(&a), pos(2), false)),
        ),
        // The stale read of 7, then a read of a row never seen and one of a held row.
        next(
            &mut op,
            &store,
            Some(&change("r", 7, None, Some(&a), pos(3), false)),
        ),
        next(
            &mut op,
            &store,
            Some(&change("r", 9, None, Some(&a), pos(3), false)),
        ),
        next(
            &mut op,
            &store,
            Some(&change("r", 8, None, Some(&moved), pos(3), false)),
        ),
    ];
    assert_eq!(
        outcomes,
        [
            Outcome::Aggregated,
            Outcome::Aggregated,
            Outcome::Tombstone,
            Outcome::Aggregated,
            Outcome::Aggregated,
            Outcome::Aggregated,
            Outcome::Aggregated,
        ]
    );
    let cp = barrier(&mut op, &mut store);
    let table = BTreeMap::from([(8, moved), (9, a)]);
    assert_eq!(answer(&job, &store), expected(&table));
    assert!(cp.partitions[&1].totals.balances());
}

#[test]
fn a_change_touching_a_closed_window_is_late_with_both_windows_named_and_the_row_kept() {
    let (mut op, job) = operator(0);
    let mut store = MemStore::default();
    let pos = |n: u64| Position {
        commit_lsn: n,
        lsn: n,
    };
    let old = order(1, 100, 0);
    feed(
        &mut op,
        &store,
        0,
        0,
        Some(&change("c", 1, None, Some(&old), pos(1), false)),
    );
    // A newer order moves the watermark two hours on: hour 0 is closed.
    let newer = order(2, 100, 2);
    feed(
        &mut op,
        &store,
        0,
        1,
        Some(&change("c", 2, None, Some(&newer), pos(2), false)),
    );
    let moved = Order {
        created_ms: newer.created_ms,
        ..old.clone()
    };
    let outcome = feed(
        &mut op,
        &store,
        0,
        2,
        Some(&change("u", 1, None, Some(&moved), pos(3), false)),
    );
    assert_eq!(outcome, Outcome::DeadLettered(PoisonReason::Late));
    // Replayed, it is a duplicate, not a second dead letter.
    let outcome = feed(
        &mut op,
        &store,
        0,
        3,
        Some(&change("u", 1, None, Some(&moved), pos(3), false)),
    );
    assert_eq!(outcome, Outcome::Duplicate);
    let cp = barrier(&mut op, &mut store);
    let [dead] = cp.dead_letters.as_slice() else {
        panic!("one dead letter: {:?}", cp.dead_letters);
    };
    let closed = crate::time::format_ms(T0);
    let open = crate::time::format_ms(T0 + 2 * HOUR_MS);
    assert!(
        dead.error.contains(&format!(
            "old window is the window starting {closed} (closed)"
        )),
        "{}",
        dead.error
    );
    assert!(
        dead.error
            .contains(&format!("new window is the window starting {open} (open)")),
        "{}",
        dead.error
    );
    // The view keeps the row where it was.
    let table = BTreeMap::from([(2, newer)]);
    let mut shown = expected(&table);
    shown.insert((T0, "c1".into()), (1, 100));
    let answered = answer(&job, &store);
    assert_eq!(
        answered.get(&(T0 + 2 * HOUR_MS, "c2".into())),
        shown.get(&(T0 + 2 * HOUR_MS, "c2".into()))
    );
    assert!(cp.accounting().balances());
}

#[test]
fn a_change_the_declaration_refuses_is_dead_lettered_and_keeps_its_position() {
    let (mut op, job) = operator(24 * HOUR_MS);
    let mut store = MemStore::default();
    let a = order(1, 100, 0);
    let at = Position {
        commit_lsn: 4,
        lsn: 9,
    };
    feed(
        &mut op,
        &store,
        0,
        0,
        Some(&change(
            "c",
            1,
            None,
            Some(&a),
            Position {
                commit_lsn: 1,
                lsn: 2,
            },
            false,
        )),
    );
    let bad = change("u", 1, None, Some(&a), at, false).replace("\"1.00\"", "\"1.001\"");
    assert!(matches!(
        feed(&mut op, &store, 0, 1, Some(&bad)),
        Outcome::DeadLettered(_)
    ));
    assert_eq!(feed(&mut op, &store, 0, 2, Some(&bad)), Outcome::Duplicate);
    let truncate = change("t", 1, None, None, at, false);
    // A truncate stops the job: not processed, not counted, its offset still the next one.
    assert_eq!(
        feed(&mut op, &store, 0, 3, Some(&truncate)),
        Outcome::Truncated
    );
    assert_eq!(op.next_offsets().get(&0), Some(&3));
    let cp = barrier(&mut op, &mut store);
    assert_eq!(answer(&job, &store), expected(&BTreeMap::from([(1, a)])));
    assert!(
        cp.dead_letters[0].error.contains("row \"1\""),
        "{}",
        cp.dead_letters[0].error
    );
    assert!(cp.accounting().balances());
}

/// What happens to the table, and how Debezium delivers it.
#[derive(Debug, Clone)]
enum Step {
    Insert {
        id: u64,
        customer: u8,
        cents: i64,
        hour: i64,
    },
    Update {
        id: u64,
        customer: Option<u8>,
        cents: Option<i64>,
        hour: Option<i64>,
        cancel: bool,
        full: bool,
    },
    Delete {
        id: u64,
    },
    /// Every row read again (a new snapshot).
    Snapshot,
    /// Debezium restarts and sends the last `n` events again.
    Replay {
        n: usize,
    },
    Barrier,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u64..12, 0u8..4, -5_000i64..50_000, 0i64..4).prop_map(|(id, customer, cents, hour)| Step::Insert { id, customer, cents, hour }),
        4 => (0u64..12, proptest::option::of(0u8..4), proptest::option::of(-5_000i64..50_000), proptest::option::of(0i64..4), proptest::bool::weighted(0.15), any::<bool>())
            .prop_map(|(id, customer, cents, hour, cancel, full)| Step::Update { id, customer, cents, hour, cancel, full }),
        1 => (0u64..12).prop_map(|id| Step::Delete { id }),
        1 => Just(Step::Snapshot),
        1 => (1usize..8).prop_map(|n| Step::Replay { n }),
        1 => Just(Step::Barrier),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever the table goes through and however Debezium replays it, the store's windows
    /// merged across partitions are the aggregation of the table; every record is counted once.
    /// A new version restating from an hour holds the aggregation's windows from that hour on.
    #[test]
    fn the_view_of_a_changing_table_is_its_aggregation(steps in prop::collection::vec(step(), 1..80), envelope in any::<bool>(), from_hour in proptest::option::of(0i64..5)) {
        let restate_from = from_hour.map(|h| T0 + h * HOUR_MS);
        let (mut op, job) = restating(24 * HOUR_MS, restate_from);
        let mut store = MemStore::default();
        let mut table: BTreeMap<u64, Order> = BTreeMap::new();
        // (partition, event) in the order Debezium sent them; positions grow.
        let mut sent: Vec<(PartitionId, Option<String>)> = Vec::new();
        let mut offsets = [0i64; 2];
        let (mut lsn, mut replayed) = (100u64, 0u64);
        let mut deliver = |op: &mut WindowOperator, store: &MemStore, p: PartitionId, e: Option<String>, sent: &mut Vec<_>| {
            feed(op, store, p, offsets[p as usize], e.as_deref());
            offsets[p as usize] += 1;
            sent.push((p, e));
        };
        for s in &steps {
            lsn += 3;
            let at = Position { commit_lsn: lsn - 1, lsn };
            match s.clone() {
                Step::Insert { id, customer, cents, hour } => {
                    if table.contains_key(&id) {
                        continue;
                    }
                    let o = order(customer, cents, hour);
                    let e = change("c", id, None, Some(&o), at, envelope);
                    table.insert(id, o);
                    deliver(&mut op, &store, (id % 2) as i32, Some(e), &mut sent);
                }
                Step::Update { id, customer, cents, hour, cancel, full } => {
                    let Some(old) = table.get(&id).cloned() else { continue };
                    let new = Order {
                        customer: customer.unwrap_or(old.customer),
                        cents: cents.unwrap_or(old.cents),
                        cancelled: old.cancelled || cancel,
                        created_ms: hour.map_or(old.created_ms, |h| order(0, 0, h).created_ms),
                    };
                    let e = change("u", id, full.then_some(&old), Some(&new), at, envelope);
                    table.insert(id, new);
                    deliver(&mut op, &store, (id % 2) as i32, Some(e), &mut sent);
                }
                Step::Delete { id } => {
                    if table.remove(&id).is_none() {
                        continue;
                    }
                    let e = change("d", id, None, None, at, envelope);
                    let p = (id % 2) as i32;
                    deliver(&mut op, &store, p, Some(e), &mut sent);
                    deliver(&mut op, &store, p, None, &mut sent);
                }
                Step::Snapshot => {
                    for (id, o) in table.clone() {
                        let e = change("r", id, None, Some(&o), Position { commit_lsn: lsn, lsn }, envelope);
                        deliver(&mut op, &store, (id % 2) as i32, Some(e), &mut sent);
                    }
                }
                Step::Replay { n } => {
                    let again: Vec<_> = sent.iter().rev().take(n).rev().cloned().collect();
                    for (p, e) in again {
                        replayed += u64::from(e.is_some());
                        deliver(&mut op, &store, p, e, &mut sent);
                    }
                }
                Step::Barrier => {
                    barrier(&mut op, &mut store);
                }
            }
        }
        let cp = barrier(&mut op, &mut store);
        let mut truth = expected(&table);
        truth.retain(|(start, _), _| restate_from.is_none_or(|from| *start >= from));
        prop_assert_eq!(answer(&job, &store), truth);
        let mut totals = Accounting::default();
        for p in cp.partitions.values() {
            prop_assert!(p.totals.balances(), "{:?}", p.totals);
            totals.add(&p.totals);
        }
        prop_assert_eq!(totals.consumed, sent.len() as u64);
        // A replayed change is never applied twice: it is a duplicate or stale.
        let tombstones = sent.iter().filter(|(_, e)| e.is_none()).count() as u64;
        prop_assert_eq!(totals.duplicates + totals.stale, replayed);
        prop_assert_eq!(totals.tombstones, tombstones);
        prop_assert_eq!(totals.dead_lettered + totals.late, 0);
    }
}
