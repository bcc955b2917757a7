//! The RocksDB store against the in-memory model, plus format and recovery edges.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;

use proptest::prelude::*;
use tally_core::amount::Amount;
use tally_core::declare::Position;
use tally_core::{
    Checkpoint, Contribution, Epoch, MemStore, OutputRow, PartitionCheckpoint, RowShape, SourceRow,
    StateReader, WindowAgg, WindowKey, Word, WordKind,
};
use tally_state::{EpochStatus, StateError, StateStore};

/// The window size of the rows these tests write.
const WINDOW_MS: i64 = 1000;

fn key(start: i64, customer: u8) -> WindowKey {
    WindowKey::of_orders(start * 1000, format!("c{customer}"), "EUR")
}

#[derive(Debug, Clone)]
enum Op {
    Row {
        p: i32,
        start: i64,
        customer: u8,
        orders: u64,
    },
    Seen {
        p: i32,
        id: u8,
        t: i64,
    },
    Close {
        p: i32,
        cutoff: i64,
    },
    Expire {
        p: i32,
        cutoff: i64,
    },
    /// A change job's row: its position and, unless deleted, its contribution.
    SourceConsumer {
        p: i32,
        row: u8,
        lsn: u64,
        contribution: Option<(i64, u8, u64)>,
    },
}

fn source_key(row: u8) -> String {
    // Keys of several parts join them with NUL.
    format!("{row}\0k")
}

fn source_row(lsn: u64, contribution: Option<(i64, u8, u64)>) -> SourceRow {
    SourceRow {
        position: Position {
            commit_lsn: lsn / 3,
            lsn,
        },
        contribution: contribution.map(|(t, customer, orders)| Contribution {
            event_time_ms: t,
            key: key(0, customer).key,
            value: WindowAgg::of_orders(orders, Amount(-(orders as i64))),
        }),
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0i32..2, 0i64..20, 0u8..5, 1u64..100).prop_map(|(p, start, customer, orders)| Op::Row {
            p,
            start,
            customer,
            orders
        }),
        (0i32..2, 0u8..30, 0i64..50).prop_map(|(p, id, t)| Op::Seen { p, id, t }),
        (0i32..2, 0i64..20).prop_map(|(p, cutoff)| Op::Close {
            p,
            cutoff: cutoff * 1000
        }),
        (0i32..2, 0i64..50).prop_map(|(p, cutoff)| Op::Expire { p, cutoff }),
        (
            0i32..2,
            0u8..12,
            0u64..1_000_000,
            proptest::option::of((-5i64..5_000, 0u8..5, 0u64..9))
        )
            .prop_map(|(p, row, lsn, contribution)| Op::SourceConsumer {
                p,
                row,
                lsn,
                contribution
            }),
    ]
}

fn checkpoint(epoch: u64, ops: &[Op]) -> Checkpoint {
    let mut cp = Checkpoint {
        epoch: Epoch(epoch),
        ..Checkpoint::default()
    };
    let mut rows = BTreeMap::new();
    let mut seen = BTreeMap::new();
    let mut source_rows = BTreeMap::new();
    for op in ops {
        match op {
            Op::Row {
                p,
                start,
                customer,
                orders,
            } => {
                let k = key(*start, *customer);
                let value = WindowAgg::of_orders(*orders, Amount(*orders as i64 * 7));
                rows.insert(
                    (*p, k.clone()),
                    OutputRow {
                        partition: *p,
                        window_end_ms: k.window_start_ms + WINDOW_MS,
                        key: k,
                        value,
                    },
                );
            }
            // The operator emits one entry per id per epoch.
            Op::Seen { p, id, t } => {
                seen.insert((*p, format!("e{id}")), *t);
            }
            Op::Close { p, cutoff } => cp.close_windows_before.push((*p, *cutoff)),
            Op::Expire { p, cutoff } => cp.expire_seen_before.push((*p, *cutoff)),
            // One entry per row per epoch, as the operator emits it: the last change's.
            Op::SourceConsumer {
                p,
                row,
                lsn,
                contribution,
            } => {
                source_rows.insert((*p, source_key(*row)), source_row(*lsn, *contribution));
            }
        }
    }
    cp.source_rows = source_rows
        .into_iter()
        .map(|((p, key), row)| (p, key, row))
        .collect();
    cp.rows = rows.into_values().collect();
    cp.seen = seen.into_iter().map(|((p, id), t)| (p, id, t)).collect();
    cp.partitions.insert(
        0,
        PartitionCheckpoint {
            next_offset: epoch as i64 * 10,
            newest_change: epoch.is_multiple_of(2).then_some(Position {
                commit_lsn: epoch,
                lsn: epoch * 7,
            }),
            totals: tally_core::Accounting {
                consumed: epoch * 3,
                stale: epoch,
                tombstones: epoch * 2,
                ..tally_core::Accounting::default()
            },
            ..PartitionCheckpoint::default()
        },
    );
    cp
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// (c) After any sequence of checkpoints the store reads exactly like the model, including
    /// after a reopen.
    #[test]
    fn rocksdb_store_matches_the_model(epochs in prop::collection::vec(prop::collection::vec(op(), 0..25), 1..8)) {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path(), "job").unwrap();
        let mut model = MemStore::default();
        // Watermarks only rise, so the operator's cutoffs per partition never go back.
        let (mut closed, mut expired) = (BTreeMap::new(), BTreeMap::new());
        for (i, ops) in epochs.iter().enumerate() {
            let mut cp = checkpoint(i as u64 + 1, ops);
            // Nor does it touch what an earlier checkpoint closed or expired: those events are late.
            cp.rows.retain(|r| closed.get(&r.partition).is_none_or(|c| r.key.window_start_ms >= *c));
            cp.seen.retain(|(p, _, t)| expired.get(p).is_none_or(|c| t >= c));
            for (cutoffs, seen_so_far) in [(&mut cp.close_windows_before, &mut closed), (&mut cp.expire_seen_before, &mut expired)] {
                for (p, c) in cutoffs.iter_mut() {
                    let prev: &mut i64 = seen_so_far.entry(*p).or_insert(*c);
                    *c = (*c).max(*prev);
                    *prev = *c;
                }
            }
            // And it records an id it has stored again only once the stored time is past the
            // horizon, i.e. below this checkpoint's expiry cutoff.
            cp.seen.retain(|(p, id, _)| match model.seen.get(&(*p, id.clone())) {
                None => true,
                Some(old) => expired.get(p).is_some_and(|c| old < c),
            });
            store.pre_commit(&cp).unwrap();
            model.apply(&cp);
            if i % 2 == 0 {
                store.mark_committed(cp.epoch).unwrap();
            }
        }
        // Compaction drops what expired, and nothing else.
        store.compact_dedup_ids().unwrap();
        prop_assert_eq!(store.stored_dedup_entries().unwrap(), model.seen.len());
        drop(store);
        let store = StateStore::open(dir.path(), "job").unwrap();
        let windows: BTreeMap<_, _> = store.windows().unwrap().into_iter().map(|(p, k, v)| ((p, k), v)).collect();
        prop_assert_eq!(&windows, &model.windows);
        let mut seen: Vec<_> = model.seen.iter().map(|((p, id), t)| (*p, id.clone(), *t)).collect();
        seen.sort();
        prop_assert_eq!(store.seen_entries().unwrap(), seen);
        for p in 0..2 {
            for id in 0..30u8 {
                let id = format!("e{id}");
                prop_assert_eq!(store.seen_event_time(p, &id).unwrap(), model.seen_event_time(p, &id).unwrap());
            }
            for start in 0..20 {
                for c in 0..5 {
                    let k = key(start, c);
                    prop_assert_eq!(store.window(p, &k).unwrap(), model.window(p, &k).unwrap());
                }
            }
        }
        let mut rows: Vec<_> = model.source_rows.iter().map(|((p, k), r)| (*p, k.clone(), r.clone())).collect();
        rows.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        prop_assert_eq!(store.source_rows().unwrap(), rows);
        for p in 0..2 {
            for row in 0..12 {
                let k = source_key(row);
                prop_assert_eq!(store.source_row(p, &k).unwrap(), model.source_row(p, &k).unwrap());
            }
        }
        let meta = store.meta().unwrap();
        prop_assert_eq!(meta.epoch, Epoch(epochs.len() as u64));
        prop_assert_eq!(&meta.partitions, &model.partitions);
    }
}

#[test]
fn pre_committed_outputs_survive_a_reopen_until_marked_committed() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path(), "job").unwrap();
    let cp = checkpoint(
        1,
        &[
            Op::Row {
                p: 0,
                start: 1,
                customer: 1,
                orders: 3,
            },
            Op::Seen { p: 0, id: 9, t: 1 },
        ],
    );
    store.pre_commit(&cp).unwrap();
    drop(store);
    let store = StateStore::open(dir.path(), "job").unwrap();
    assert_eq!(store.meta().unwrap().status, EpochStatus::PreCommitted);
    assert_eq!(
        store.pending(Epoch(1), WINDOW_MS).unwrap().0,
        without_ids(&cp)
    );
    store.mark_committed(Epoch(1)).unwrap();
    drop(store);
    let store = StateStore::open(dir.path(), "job").unwrap();
    assert_eq!(store.meta().unwrap().status, EpochStatus::Committed);
    assert!(store.pending_epochs().unwrap().is_empty());
    // Held until the next epoch is committed, in case Kafka undoes its transaction.
    assert_eq!(store.retained_commit().unwrap(), Some(Epoch(1)));
    assert_eq!(
        store.pending(Epoch(1), WINDOW_MS).unwrap().0,
        without_ids(&cp)
    );
    store.pre_commit(&checkpoint(2, &[])).unwrap();
    store.mark_committed(Epoch(2)).unwrap();
    assert_eq!(store.retained_commit().unwrap(), Some(Epoch(2)));
    assert!(matches!(
        store.pending(Epoch(1), WINDOW_MS),
        Err(StateError::MissingPending { .. })
    ));
}

#[test]
fn another_jobs_state_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path(), "job-a").unwrap();
    store.pre_commit(&checkpoint(1, &[])).unwrap();
    drop(store);
    let err = StateStore::open(dir.path(), "job-b").err().unwrap();
    assert!(matches!(err, StateError::JobMismatch { .. }), "{err}");
}

/// A page_views-like row: three key parts, a count, a float max and an avg (float sum, count).
fn hopping_row(p: i32, start: i64, page: &str, views: u64, slowest: f64) -> OutputRow {
    let key = WindowKey {
        window_start_ms: start * 1000,
        key: tally_core::GroupKey::new([page.into(), "DE".into(), "mobile".into()]),
    };
    OutputRow {
        partition: p,
        window_end_ms: key.window_start_ms + 5 * WINDOW_MS,
        key,
        value: WindowAgg::new([
            Word::Count(views),
            Word::Float(slowest),
            Word::Float(slowest * views as f64),
            Word::Count(views),
        ]),
    }
}

fn hopping_shape() -> RowShape {
    RowShape {
        key_parts: 3,
        words: vec![
            WordKind::Count,
            WordKind::Float,
            WordKind::Float,
            WordKind::Count,
        ],
    }
}

/// Rows of any shape go in and come back as written, in a directory that records their shape;
/// another shape is refused, naming both, once the directory holds a checkpoint.
#[test]
fn a_store_keeps_rows_of_its_recorded_shape_and_refuses_another() {
    let dir = tempfile::tempdir().unwrap();
    let rows = vec![
        hopping_row(0, 60, "/", 3, 812.5),
        hopping_row(0, 60, "/pricing", 1, 0.25),
        hopping_row(1, 120, "/", 7, 1e9),
    ];
    {
        let store = StateStore::open_for(dir.path(), "job", &hopping_shape()).unwrap();
        let mut cp = checkpoint(1, &[]);
        cp.rows = rows.clone();
        store.pre_commit(&cp).unwrap();
        store.mark_committed(Epoch(1)).unwrap();
        let wrong = WindowAgg::of_orders(1, Amount(1));
        let mut other = checkpoint(2, &[]);
        other.rows = vec![OutputRow {
            value: wrong,
            ..rows[0].clone()
        }];
        let refused = store.pre_commit(&other).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("is not a value of the store's words"),
            "{refused}"
        );
    }
    for shaped in [false, true] {
        let store = if shaped {
            StateStore::open_for(dir.path(), "job", &hopping_shape()).unwrap()
        } else {
            StateStore::open(dir.path(), "job").unwrap()
        };
        assert_eq!(store.row_shape(), &hopping_shape());
        let held: Vec<_> = rows
            .iter()
            .map(|r| (r.partition, r.key.clone(), r.value.clone()))
            .collect();
        assert_eq!(store.windows().unwrap(), held);
        assert_eq!(
            store.window(0, &rows[1].key).unwrap(),
            Some(rows[1].value.clone())
        );
    }
    let err = StateStore::open_for(dir.path(), "job", &RowShape::orders())
        .err()
        .unwrap();
    assert!(matches!(err, StateError::ShapeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("keys of 3 part(s)"), "{err}");
}

/// A directory written before format 4 records no shape: it holds revenue_agg's rows, which a
/// worker of revenue_agg then records; a new directory takes whatever shape it is opened for.
#[test]
fn a_directory_without_a_recorded_shape_holds_revenue_aggs_rows() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path(), "job").unwrap();
    store
        .pre_commit(&checkpoint(
            1,
            &[Op::Row {
                p: 0,
                start: 1,
                customer: 1,
                orders: 2,
            }],
        ))
        .unwrap();
    drop(store);
    assert!(matches!(
        StateStore::open_for(dir.path(), "job", &hopping_shape()).err(),
        Some(StateError::ShapeMismatch { .. })
    ));
    let store = StateStore::open_for(dir.path(), "job", &RowShape::orders()).unwrap();
    assert_eq!(store.windows().unwrap().len(), 1);
    let fresh = tempfile::tempdir().unwrap();
    let store = StateStore::open_for(fresh.path(), "job", &hopping_shape()).unwrap();
    assert_eq!(store.row_shape(), &hopping_shape());
}

#[test]
fn a_directory_keeps_its_writer_id_and_another_directory_has_its_own() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let first = StateStore::open(a.path(), "job").unwrap();
    let id = first.writer_id().to_owned();
    assert!(!id.is_empty());
    drop(first);
    assert_eq!(StateStore::open(a.path(), "job").unwrap().writer_id(), id);
    assert_ne!(StateStore::open(b.path(), "job").unwrap().writer_id(), id);
}

#[test]
fn an_unknown_format_version_is_refused_not_misread() {
    let dir = tempfile::tempdir().unwrap();
    drop(StateStore::open(dir.path(), "job").unwrap());
    {
        let cfs = [
            "meta",
            "windows",
            "seen_by_id",
            "source_rows",
            "pending",
            "pending_changelog",
        ];
        let db = rocksdb::DB::open_cf(&rocksdb::Options::default(), dir.path(), cfs).unwrap();
        db.put_cf(
            db.cf_handle("meta").unwrap(),
            b"format_version",
            99u32.to_be_bytes(),
        )
        .unwrap();
    }
    let err = StateStore::open(dir.path(), "job").err().unwrap();
    assert!(
        matches!(err, StateError::UnknownFormat { found: 99, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("version 99"), "{err}");
}

/// A format 1 store (ids also in a time index) opens as format 2: the index is dropped, the ids
/// stay, and a build of format 1 would now refuse it.
#[test]
fn a_format_1_store_loses_its_time_index_and_keeps_its_ids() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = StateStore::open(dir.path(), "job").unwrap();
        store
            .pre_commit(&checkpoint(1, &[Op::Seen { p: 0, id: 1, t: 5 }]))
            .unwrap();
    }
    {
        let mut opts = rocksdb::Options::default();
        opts.create_missing_column_families(true);
        let cfs = [
            "meta",
            "windows",
            "seen_by_id",
            "seen_by_time",
            "source_rows",
            "pending",
            "pending_changelog",
        ];
        let db = rocksdb::DB::open_cf(&opts, dir.path(), cfs).unwrap();
        db.put_cf(
            db.cf_handle("seen_by_time").unwrap(),
            b"time-index-entry",
            [],
        )
        .unwrap();
        db.put_cf(
            db.cf_handle("meta").unwrap(),
            b"format_version",
            1u32.to_be_bytes(),
        )
        .unwrap();
    }
    let store = StateStore::open(dir.path(), "job").unwrap();
    assert_eq!(
        store.seen_entries().unwrap(),
        vec![(0, "e1".to_string(), 5)]
    );
    drop(store);
    let cfs = rocksdb::DB::list_cf(&rocksdb::Options::default(), dir.path()).unwrap();
    assert!(!cfs.iter().any(|c| c == "seen_by_time"), "{cfs:?}");
    let db =
        rocksdb::DB::open_cf_for_read_only(&rocksdb::Options::default(), dir.path(), &cfs, false)
            .unwrap();
    let version = db
        .get_cf(db.cf_handle("meta").unwrap(), b"format_version")
        .unwrap()
        .unwrap();
    assert_eq!(version, tally_state::FORMAT_VERSION.to_be_bytes());
    assert_eq!(tally_state::FORMAT_VERSION, 6);
}

#[test]
fn a_reseen_id_keeps_its_new_time_through_expiry_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path(), "job").unwrap();
    store
        .pre_commit(&checkpoint(1, &[Op::Seen { p: 0, id: 1, t: 5 }]))
        .unwrap();
    // Expire the old entry and re-see the id in the same checkpoint: the new entry must survive.
    store
        .pre_commit(&checkpoint(
            2,
            &[
                Op::Expire { p: 0, cutoff: 10 },
                Op::Seen { p: 0, id: 1, t: 20 },
            ],
        ))
        .unwrap();
    assert_eq!(
        store.seen_entries().unwrap(),
        vec![(0, "e1".to_string(), 20)]
    );
    store
        .pre_commit(&checkpoint(
            3,
            &[
                Op::Expire { p: 0, cutoff: 25 },
                Op::Seen { p: 0, id: 1, t: 30 },
            ],
        ))
        .unwrap();
    assert_eq!(
        store.seen_entries().unwrap(),
        vec![(0, "e1".to_string(), 30)]
    );
    store.compact_dedup_ids().unwrap();
    assert_eq!(store.stored_dedup_entries().unwrap(), 1);
    assert_eq!(store.seen_event_time(0, "e1").unwrap(), Some(30));
}

/// An expired id no compaction has reached yet reads as absent, and compaction then drops it,
/// across a reopen (the cutoff is durable metadata).
#[test]
fn an_expired_id_reads_as_absent_before_compaction_drops_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path(), "job").unwrap();
    store
        .pre_commit(&checkpoint(
            1,
            &[
                Op::Seen { p: 0, id: 1, t: 5 },
                Op::Seen { p: 1, id: 1, t: 5 },
            ],
        ))
        .unwrap();
    store
        .pre_commit(&checkpoint(2, &[Op::Expire { p: 0, cutoff: 10 }]))
        .unwrap();
    assert_eq!(store.stored_dedup_entries().unwrap(), 2);
    assert_eq!(store.seen_event_time(0, "e1").unwrap(), None);
    assert_eq!(store.seen_event_time(1, "e1").unwrap(), Some(5));
    let mut scanned = Vec::new();
    store
        .scan_seen(0, |id, t| scanned.push((id.to_vec(), t)))
        .unwrap();
    assert!(scanned.is_empty(), "{scanned:?}");
    drop(store);
    let store = StateStore::open(dir.path(), "job").unwrap();
    store.compact_dedup_ids().unwrap();
    assert_eq!(store.stored_dedup_entries().unwrap(), 1);
    assert_eq!(
        store.seen_entries().unwrap(),
        vec![(1, "e1".to_string(), 5)]
    );
}

/// Pipelined checkpoints: epoch 2 is pre-committed before epoch 1 is committed. Committing 1
/// leaves 2 pre-committed, across a reopen, until 2 is committed too.
#[test]
fn two_epochs_in_flight_are_completed_oldest_first() {
    let dir = tempfile::tempdir().unwrap();
    let store = StateStore::open(dir.path(), "job").unwrap();
    let (one, two) = (
        checkpoint(1, &[Op::Seen { p: 0, id: 1, t: 5 }]),
        checkpoint(2, &[Op::Seen { p: 0, id: 2, t: 6 }]),
    );
    store.pre_commit(&one).unwrap();
    store.pre_commit(&two).unwrap();
    assert_eq!(store.pending_epochs().unwrap(), vec![Epoch(1), Epoch(2)]);
    store.mark_committed(Epoch(1)).unwrap();
    let meta = store.meta().unwrap();
    assert_eq!(
        (meta.epoch, meta.status),
        (Epoch(2), EpochStatus::PreCommitted)
    );
    drop(store);
    let store = StateStore::open(dir.path(), "job").unwrap();
    assert_eq!(store.pending_epochs().unwrap(), vec![Epoch(2)]);
    assert_eq!(
        store.pending(Epoch(2), WINDOW_MS).unwrap().0,
        without_ids(&two)
    );
    assert_eq!(store.retained_commit().unwrap(), Some(Epoch(1)));
    store.mark_committed(Epoch(2)).unwrap();
    assert_eq!(store.meta().unwrap().status, EpochStatus::Committed);
    assert!(store.pending_epochs().unwrap().is_empty());
    assert_eq!(store.retained_commit().unwrap(), Some(Epoch(2)));
    assert_eq!(store.seen_event_time(0, "e2").unwrap(), Some(6));
}

/// A pending epoch keeps what the sinks need: the checkpoint without its dedup ids.
fn without_ids(cp: &Checkpoint) -> Checkpoint {
    assert!(!cp.seen.is_empty(), "the test checkpoint should carry ids");
    Checkpoint {
        seen: Vec::new(),
        source_rows: Vec::new(),
        ..cp.clone()
    }
}
