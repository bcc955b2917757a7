#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use proptest::prelude::*;
use tally_core::{
    CheckpointBarrier, FieldMapping, OperatorConfig, Program, Record, WindowOperator, WindowSpec,
};

use super::*;
use crate::StateStore;

fn rules() -> OperatorConfig {
    OperatorConfig {
        window: WindowSpec::tumbling(10_000),
        out_of_orderness_ms: 1_000,
        allowed_lateness_ms: 5_000,
        dedup_horizon_ms: 30_000,
        windows_from_ms: None,
    }
}

/// (partition, event id, customer, time step in ms, poison)
type Event = (i32, u8, u8, i64, bool);

fn event() -> impl Strategy<Value = Event> {
    (
        0..3i32,
        0..40u8,
        0..6u8,
        -3_000..9_000i64,
        prop::bool::weighted(0.05),
    )
}

/// One committed epoch: its records and their liveness.
type Committed = (
    Vec<(PartitionId, Vec<u8>)>,
    BTreeMap<PartitionId, EpochLiveness>,
);

/// Runs `epochs` through an operator over `owner`, pre-committing and committing each with
/// its changelog; returns every epoch's records, encoded with `chunk_bytes`.
fn run_owner(owner: &StateStore, epochs: &[Vec<Event>], chunk_bytes: usize) -> Vec<Vec<u8>> {
    run_owner_epochs(owner, epochs, chunk_bytes)
        .into_iter()
        .flat_map(|(records, _)| records.into_iter().map(|(_, bytes)| bytes))
        .collect()
}

/// A change job over an orders table: per customer, its orders and their amount.
const ORDERS_CHANGES: &str = r#"
format = "debezium-json"
primary_key = ["order_id"]
event_time = "created_at"
group_by = ["customer_id"]
[[field]]
name = "order_id"
type = "integer"
[[field]]
name = "customer_id"
type = "string"
[[field]]
name = "amount"
type = "decimal"
scale = 2
[[field]]
name = "created_at"
type = "timestamp"
[[aggregate]]
column = "orders"
function = "count"
[[aggregate]]
column = "revenue"
function = "sum"
field = "amount"
"#;

/// The change job under `rules()`.
fn change_job() -> tally_core::declare::Job {
    let declaration: tally_core::declare::Declaration =
        toml::from_str(ORDERS_CHANGES).expect("declaration");
    let r = rules();
    declaration
        .resolve(tally_core::declare::WindowRules {
            size_ms: r.window.size_ms,
            slide_ms: None,
            allowed_lateness_ms: r.allowed_lateness_ms,
            dedup_horizon_ms: r.dedup_horizon_ms,
        })
        .expect("valid")
}

/// A store for the change job's rows.
fn change_store(path: &std::path::Path) -> StateStore {
    StateStore::open_for(path, "job", &change_job().row_shape()).unwrap()
}

fn change_operator() -> WindowOperator {
    let program = tally_core::Program::declared(std::sync::Arc::new(change_job()), 1 << 20);
    WindowOperator::restore(rules(), program, Epoch(0), &BTreeMap::new())
}

/// An event as a change of row `id`: an insert or update (`false`) or a delete (`true`), at
/// position `lsn`.
fn change_value(id: u8, customer: u8, time: i64, delete: bool, lsn: u64) -> Option<Vec<u8>> {
    let source = format!(r#""source":{{"sequence":"[\"{lsn}\",\"{lsn}\"]","lsn":{lsn}}}"#);
    Some(
        if delete {
            format!(r#"{{"before":{{"order_id":{id}}},"after":null,"op":"d",{source}}}"#)
        } else {
            format!(
                r#"{{"before":null,"after":{{"order_id":{id},"customer_id":"c{customer}","amount":"1.25","created_at":{time}}},"op":"u",{source}}}"#
            )
        }
        .into_bytes(),
    )
}

fn run_owner_epochs(
    owner: &StateStore,
    epochs: &[Vec<Event>],
    chunk_bytes: usize,
) -> Vec<Committed> {
    let decoder =
        Program::revenue_agg(&FieldMapping::default(), &rules(), 1 << 20).expect("revenue_agg");
    let op = WindowOperator::restore(rules(), decoder, Epoch(0), &BTreeMap::new())
        .with_seen_filter_capacity(64);
    run_epochs(owner, op, epochs, chunk_bytes, false)
}

/// [`run_owner_epochs`] for a change job: each event changes row `id` (deletes it when
/// "poison"), each at a newer position; a row's delete is followed by its tombstone.
fn run_changes_epochs(
    owner: &StateStore,
    epochs: &[Vec<Event>],
    chunk_bytes: usize,
) -> Vec<Committed> {
    run_epochs(owner, change_operator(), epochs, chunk_bytes, true)
}

fn run_epochs(
    owner: &StateStore,
    mut op: WindowOperator,
    epochs: &[Vec<Event>],
    chunk_bytes: usize,
    changes: bool,
) -> Vec<Committed> {
    let mut lsn = 0u64;
    for p in 0..3 {
        op.add_partition(p, 0);
    }
    let mut clock = [1_790_000_000_000i64; 3];
    let mut offsets = [0i64; 3];
    let mut log = Vec::new();
    for events in epochs {
        for &(p, id, customer, step, poison) in events {
            let i = p as usize;
            clock[i] += step;
            lsn += 1;
            let value = if changes {
                let value = change_value(id, customer, clock[i], poison, lsn);
                let record = Record {
                    partition: p,
                    offset: offsets[i],
                    timestamp_ms: Some(clock[i]),
                    key: None,
                    value: value.as_deref(),
                };
                offsets[i] += 1;
                op.process(owner, record).unwrap();
                if !poison {
                    continue;
                }
                // The delete's tombstone.
                let record = Record {
                    partition: p,
                    offset: offsets[i],
                    timestamp_ms: Some(clock[i]),
                    key: None,
                    value: None,
                };
                offsets[i] += 1;
                op.process(owner, record).unwrap();
                continue;
            } else if poison {
                b"{not json".to_vec()
            } else {
                format!(
                    r#"{{"event_id":"e{id}","customer_id":"c{customer}","currency":"EUR","amount":"1.25","event_time":{},"source":"t"}}"#,
                    clock[i]
                )
                .into_bytes()
            };
            let record = Record {
                partition: p,
                offset: offsets[i],
                timestamp_ms: Some(clock[i]),
                key: None,
                value: Some(&value),
            };
            offsets[i] += 1;
            op.process(owner, record).unwrap();
        }
        let epoch = op.current_epoch();
        let cut = op.cut(CheckpointBarrier {
            epoch,
            is_final: false,
        });
        let records = encode_in_chunks(&cut, chunk_bytes).unwrap();
        let checkpoint = cut.to_checkpoint_without_ids();
        owner
            .pre_commit_with_seen(&checkpoint, cut.seen_ids(), cut.source_rows(), &records)
            .unwrap();
        // The sinks' batch comes back whole from the changelog records kept beside it.
        assert_eq!(
            owner.pending(epoch, rules().window.size_ms).unwrap().0,
            checkpoint
        );
        owner.mark_committed(epoch).unwrap();
        log.push((records, liveness_of_cut(&cut)));
    }
    log
}

/// The changelog as the broker would hold it (per partition, consecutive offsets with a
/// commit marker after each epoch), and the restore points the owner committed.
fn simulate(epochs: &[Committed]) -> (Vec<(PartitionId, Offset, Vec<u8>)>, RestorePoints) {
    let mut next: BTreeMap<PartitionId, Offset> = BTreeMap::new();
    let mut points = RestorePoints::default();
    let mut log = Vec::new();
    for (records, liveness) in epochs {
        points = points.with_epoch(liveness);
        for (p, bytes) in records {
            let offset = next.entry(*p).or_default();
            log.push((*p, *offset, bytes.clone()));
            *offset += 1;
        }
        for &p in liveness.keys() {
            let end = next.entry(p).or_default();
            *end += 1;
            points.set_end(p, *end);
        }
    }
    (log, points)
}

/// Replays the records of `log` at or after each partition's `from` into `store`.
fn replay(
    store: &StateStore,
    log: &[(PartitionId, Offset, Vec<u8>)],
    from: impl Fn(PartitionId) -> Offset,
) -> BTreeMap<PartitionId, ChainCheck> {
    let mut chains: BTreeMap<PartitionId, ChainCheck> = BTreeMap::new();
    for (p, offset, bytes) in log {
        if *offset < from(*p) {
            continue;
        }
        let record = ChangelogRecord::decode(bytes).unwrap();
        let chain = chains.entry(*p).or_insert_with(|| {
            if from(*p) > 0 {
                ChainCheck::from_restore_point()
            } else {
                ChainCheck::default()
            }
        });
        chain.accept(&record).unwrap();
        store
            .apply_restored(&record.to_checkpoint(rules().window.size_ms))
            .unwrap();
    }
    chains
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A store rebuilt from the changelog alone equals the store that wrote it: windows,
    /// dedup entries, progress and cutoffs, with records chunked small or not at all.
    #[test]
    fn replaying_the_changelog_rebuilds_the_owners_state(
        epochs in prop::collection::vec(prop::collection::vec(event(), 0..60), 1..8),
        chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
    ) {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let owner = StateStore::open(a.path(), "job").unwrap();
        let log = run_owner(&owner, &epochs, chunk_bytes);
        let restored = StateStore::open(b.path(), "job").unwrap();
        let mut chains: BTreeMap<PartitionId, ChainCheck> = BTreeMap::new();
        for bytes in &log {
            let record = ChangelogRecord::decode(bytes).unwrap();
            chains.entry(record.partition).or_default().accept(&record).unwrap();
            restored.apply_restored(&record.to_checkpoint(rules().window.size_ms)).unwrap();
        }
        let last = Epoch(epochs.len() as u64);
        for (p, chain) in &chains {
            prop_assert_eq!(chain.finish(*p).unwrap(), Some(last));
        }
        restored.finish_restore(last, None, ("owner", last)).unwrap();
        prop_assert_eq!(restored.windows().unwrap(), owner.windows().unwrap());
        prop_assert_eq!(restored.seen_entries().unwrap(), owner.seen_entries().unwrap());
        prop_assert_eq!(restored.meta(), owner.meta());
        prop_assert_eq!(restored.adopted_writer().unwrap(), Some(("owner".to_string(), last)));
    }

    /// Replaying only from the restore points (the changelog truncated below them) rebuilds
    /// the same state as replaying everything, and the points never go back.
    #[test]
    fn replaying_from_the_restore_points_rebuilds_the_same_state(
        epochs in prop::collection::vec(prop::collection::vec(event(), 0..60), 1..10),
        chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
    ) {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let owner = StateStore::open(a.path(), "job").unwrap();
        let committed = run_owner_epochs(&owner, &epochs, chunk_bytes);
        let mut points = RestorePoints::default();
        for (_, liveness) in &committed {
            let next = points.with_epoch(liveness);
            for &p in liveness.keys() {
                prop_assert!(next.restore_from(p) >= points.restore_from(p));
            }
            points = next;
        }
        let (log, points) = simulate(&committed);
        let restored = StateStore::open(b.path(), "job").unwrap();
        let chains = replay(&restored, &log, |p| points.restore_from(p));
        let last = Epoch(epochs.len() as u64);
        for (p, chain) in &chains {
            prop_assert_eq!(chain.finish(*p).unwrap(), Some(last));
        }
        prop_assert_eq!(restored.windows().unwrap(), owner.windows().unwrap());
        prop_assert_eq!(restored.seen_entries().unwrap(), owner.seen_entries().unwrap());
        let (restored_meta, owner_meta) = (restored.meta().unwrap(), owner.meta().unwrap());
        prop_assert_eq!(restored_meta.partitions, owner_meta.partitions);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// A change job's rows come back whole from its changelog, with the windows and progress:
    /// from the start, and from the restore points (which never pass a record holding rows).
    #[test]
    fn replaying_a_change_jobs_changelog_rebuilds_its_rows(
        epochs in prop::collection::vec(prop::collection::vec(event(), 0..60), 1..8),
        chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
    ) {
        let (a, b, c) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let owner = change_store(a.path());
        let committed = run_changes_epochs(&owner, &epochs, chunk_bytes);
        let (log, points) = simulate(&committed);
        let whole = change_store(b.path());
        replay(&whole, &log, |_| 0);
        let from_points = change_store(c.path());
        replay(&from_points, &log, |p| points.restore_from(p));
        for restored in [&whole, &from_points] {
            prop_assert_eq!(restored.source_rows().unwrap(), owner.source_rows().unwrap());
            prop_assert_eq!(restored.windows().unwrap(), owner.windows().unwrap());
            prop_assert_eq!(&restored.meta().unwrap().partitions, &owner.meta().unwrap().partitions);
        }
        prop_assert!(epochs.iter().flatten().all(|e| e.4) || !owner.source_rows().unwrap().is_empty());
    }
}

/// Feeds `replay` the records of `log` from its starts (or, `rewound`, from the start of
/// the log: a start is a lower bound), as a read of the topic would.
fn feed(
    replay: &mut crate::replay::Replay<'_>,
    log: &[(PartitionId, Offset, Vec<u8>)],
    rewound: bool,
) {
    let starts = replay.starts().clone();
    for (p, offset, bytes) in log {
        if rewound || starts.get(p).is_some_and(|from| offset >= from) {
            replay.apply(*p, *offset, bytes).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// A warm standby that applies the changelog in rounds, each up to the epoch committed
    /// then, ends with exactly the owner's state and the owner's restore points.
    #[test]
    fn catching_up_in_rounds_rebuilds_the_owners_state(
        epochs in prop::collection::vec(prop::collection::vec(event(), 0..50), 2..9),
        chunk_bytes in prop_oneof![Just(usize::MAX), 1..400usize],
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 1..4),
        rewound in any::<bool>(),
    ) {
        use crate::replay::Replay;
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let owner = StateStore::open(a.path(), "job").unwrap();
        let committed = run_owner_epochs(&owner, &epochs, chunk_bytes);
        let (log, points) = simulate(&committed);
        let last = epochs.len() as u64;
        let mut rounds: Vec<u64> = cuts.iter().map(|i| 1 + i.index(epochs.len()) as u64).collect();
        rounds.push(last);
        rounds.sort_unstable();
        rounds.dedup();
        let standby = StateStore::open(b.path(), "job").unwrap();
        let size = rules().window.size_ms;
        let partitions = [0, 1, 2];
        for (i, &up_to) in rounds.iter().enumerate() {
            let mut replay = if i == 0 {
                Replay::whole(&standby, size, Epoch(up_to), partitions.iter().map(|&p| (p, 0)).collect())
            } else {
                Replay::continuing(&standby, size, Epoch(up_to), &partitions).unwrap()
            };
            feed(&mut replay, &log, rewound && i > 0);
            replay.check_complete().unwrap();
            replay.finish("owner", None).unwrap();
            prop_assert_eq!(standby.meta().unwrap().epoch, Epoch(up_to));
        }
        prop_assert_eq!(standby.windows().unwrap(), owner.windows().unwrap());
        prop_assert_eq!(standby.seen_entries().unwrap(), owner.seen_entries().unwrap());
        prop_assert_eq!(standby.meta().unwrap().partitions, owner.meta().unwrap().partitions);
        prop_assert_eq!(standby.adopted_writer().unwrap(), Some(("owner".to_string(), Epoch(last))));
        let kept = standby.restore_points().unwrap();
        for p in partitions {
            prop_assert_eq!(kept.restore_from(p), points.restore_from(p));
        }
        // Nothing more committed: the next round reads nothing.
        let replay = Replay::continuing(&standby, size, Epoch(last), &partitions).unwrap();
        prop_assert!(replay.is_current());
    }
}

#[test]
fn a_catch_up_refuses_a_gap_an_unfinished_replay_and_pending_epochs() {
    use crate::replay::{NotContinuable, Replay, ReplayError};
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let owner = StateStore::open(a.path(), "job").unwrap();
    let events: Vec<Event> = (0..30).map(|i| (0, i, i % 3, 1_000, false)).collect();
    let committed = run_owner_epochs(&owner, &vec![events; 4], usize::MAX);
    let (log, _) = simulate(&committed);
    let size = rules().window.size_ms;
    let partitions = [0, 1, 2];
    let standby = StateStore::open(b.path(), "job").unwrap();
    let mut replay = Replay::whole(
        &standby,
        size,
        Epoch(2),
        partitions.iter().map(|&p| (p, 0)).collect(),
    );
    feed(&mut replay, &log, false);
    replay.check_complete().unwrap();
    replay.finish("owner", None).unwrap();

    // Epoch 3 missing: epoch 4 does not start where the standby's state ends.
    let mut replay = Replay::continuing(&standby, size, Epoch(4), &partitions).unwrap();
    let epoch_4: Vec<_> = log
        .iter()
        .filter(|(_, _, bytes)| ChangelogRecord::decode(bytes).unwrap().epoch == Epoch(4))
        .collect();
    let (p, offset, bytes) = epoch_4[0];
    let err = replay.apply(*p, *offset, bytes).unwrap_err();
    assert!(err.to_string().contains("does not follow"), "{err}");
    // That replay began applying nothing; one that began and stopped leaves a mark.
    standby.begin_replay().unwrap();
    assert!(matches!(
        Replay::continuing(&standby, size, Epoch(4), &partitions),
        Err(ReplayError::NotContinuable(NotContinuable::Interrupted))
    ));
    // Another set of partitions than the job's.
    let (c, d) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let other = StateStore::open(c.path(), "job").unwrap();
    let mut replay = Replay::whole(
        &other,
        size,
        Epoch(2),
        partitions.iter().map(|&p| (p, 0)).collect(),
    );
    feed(&mut replay, &log, false);
    replay.finish("owner", None).unwrap();
    assert!(matches!(
        Replay::continuing(&other, size, Epoch(4), &[0, 1]),
        Err(ReplayError::NotContinuable(NotContinuable::Diverged(_)))
    ));
    // The owner's own directory with an epoch pre-committed and not committed.
    let fresh = StateStore::open(d.path(), "job").unwrap();
    fresh
        .pre_commit(&tally_core::Checkpoint {
            epoch: Epoch(1),
            ..tally_core::Checkpoint::default()
        })
        .unwrap();
    assert!(matches!(
        Replay::continuing(&fresh, size, Epoch(4), &[]),
        Err(ReplayError::NotContinuable(NotContinuable::Pending))
    ));
}

#[test]
fn restore_points_advance_past_records_whose_windows_closed_and_ids_expired() {
    let dir = tempfile::tempdir().unwrap();
    let owner = StateStore::open(dir.path(), "job").unwrap();
    // Five minutes of event time per epoch: far past the 10 s windows and the 30 s horizon.
    let epochs: Vec<Vec<Event>> = (0..6)
        .map(|e| {
            (0..30)
                .map(|i| (0, e * 30 + i, i % 3, 10_000, false))
                .collect()
        })
        .collect();
    let committed = run_owner_epochs(&owner, &epochs, usize::MAX);
    let (_, points) = simulate(&committed);
    // Each epoch is one record and a marker: the restore point is the newest epoch's.
    assert_eq!(points.restore_from(0), 10);
}

#[test]
fn a_gap_a_missing_start_or_another_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let owner = StateStore::open(dir.path(), "job").unwrap();
    let events: Vec<Event> = (0..30).map(|i| (0, i, i % 3, 1_000, false)).collect();
    let log = run_owner(
        &owner,
        &[events.clone(), events.clone(), events],
        usize::MAX,
    );
    let records: Vec<ChangelogRecord> = log
        .iter()
        .map(|b| ChangelogRecord::decode(b).unwrap())
        .filter(|r| r.partition == 0)
        .collect();
    // Small epochs: one record each.
    assert_eq!(records.len(), 3);
    // Epoch 2 missing.
    let mut chain = ChainCheck::default();
    chain.accept(&records[0]).unwrap();
    let err = chain.accept(&records[2]).unwrap_err();
    assert!(err.to_string().contains("does not follow"), "{err}");
    // Starting after the partition's first epoch.
    let err = ChainCheck::default().accept(&records[1]).unwrap_err();
    assert!(
        err.to_string().contains("not the partition's first"),
        "{err}"
    );
    let mut bytes = log[0].clone();
    bytes[0] = 9;
    assert!(matches!(
        ChangelogRecord::decode(&bytes),
        Err(ChangelogError::UnknownFormat { found: 9 })
    ));
    assert!(ChangelogRecord::decode(&[]).is_err());
}

/// Writes `record` as an earlier format would have: `key` and `value` give its windows' keys
/// and values in that format (whose progress had no filtered count before format 4, and no
/// stale or tombstone count nor rows before format 5).
fn in_earlier_format<K: Serialize, V: Serialize>(
    record: &ChangelogRecord,
    format: u8,
    key: impl Fn(&WindowKey) -> K,
    value: impl Fn(&WindowAgg) -> V,
) -> Vec<u8> {
    let windows: Vec<(K, V)> = record
        .windows
        .iter()
        .map(|(k, v)| (key(k), value(v)))
        .collect();
    let windows: Vec<_> = windows.iter().map(|(k, v)| (k, v)).collect();
    let seen: Vec<_> = record
        .seen
        .iter()
        .map(|(id, t)| (id.as_str(), *t))
        .collect();
    let p = &record.progress;
    assert!(record.rows.is_empty() && p.newest_change.is_none());
    if format == CHANGELOG_FORMAT_V4 {
        let v2 = crate::old_formats::AccountingV2::from;
        encode_earlier(record, format, &windows, &seen, v2(p.epoch), v2(p.totals))
    } else {
        let v1 = crate::old_formats::AccountingV1::from;
        encode_earlier(record, format, &windows, &seen, v1(p.epoch), v1(p.totals))
    }
}

/// A record of an earlier format with accountings `epoch` and `totals` of that format.
fn encode_earlier<K: Serialize, V: Serialize, A: Serialize>(
    record: &ChangelogRecord,
    format: u8,
    windows: &[(&K, &V)],
    seen: &[(&str, i64)],
    epoch: A,
    totals: A,
) -> Vec<u8> {
    let p = &record.progress;
    let progress = crate::old_formats::PartitionCheckpointV1 {
        epoch_start_offset: p.epoch_start_offset,
        next_offset: p.next_offset,
        watermark: p.watermark,
        epoch,
        totals,
    };
    let old = RecordRef {
        format,
        epoch: record.epoch,
        partition: record.partition,
        chunk: record.chunk,
        chunks: record.chunks,
        progress: &progress,
        close_windows_before: record.close_windows_before,
        expire_seen_before: record.expire_seen_before,
        windows,
        seen,
        rows: (),
    };
    bincode::serde::encode_to_vec(&old, config()).unwrap()
}

/// Formats 1 (written by the releases before group keys), 2 (before values of any shape), 3
/// (before filters) and 4 (before change jobs) read as the same record.
#[test]
fn records_of_the_releases_before_group_keys_values_and_filters_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let owner = StateStore::open(dir.path(), "job").unwrap();
    let events: Vec<Event> = (0..12).map(|i| (0, i, i % 3, 1_000, false)).collect();
    let log = run_owner(&owner, &[events], usize::MAX);
    let record = ChangelogRecord::decode(&log[0]).unwrap();
    assert!(record.windows.len() >= 3 && !record.seen.is_empty());
    let value_v2 = |v: &WindowAgg| crate::old_formats::WindowAggV2 {
        orders: v.orders(),
        revenue: v.revenue(),
    };
    let v1 = in_earlier_format(
        &record,
        CHANGELOG_FORMAT_V1,
        |k| crate::old_formats::WindowKeyV1 {
            window_start_ms: k.window_start_ms,
            customer_id: k.customer_id().into(),
            currency: k.currency().into(),
        },
        value_v2,
    );
    let v2 = in_earlier_format(&record, CHANGELOG_FORMAT_V2, WindowKey::clone, value_v2);
    let v3 = in_earlier_format(
        &record,
        CHANGELOG_FORMAT_V3,
        WindowKey::clone,
        WindowAgg::clone,
    );
    let v4 = in_earlier_format(
        &record,
        CHANGELOG_FORMAT_V4,
        WindowKey::clone,
        WindowAgg::clone,
    );
    for (bytes, format) in [
        (v1, CHANGELOG_FORMAT_V1),
        (v2, CHANGELOG_FORMAT_V2),
        (v3, CHANGELOG_FORMAT_V3),
        (v4, CHANGELOG_FORMAT_V4),
    ] {
        let read = ChangelogRecord::decode(&bytes).unwrap();
        assert_eq!(read.format, format);
        assert_eq!(
            ChangelogRecord {
                format: CHANGELOG_FORMAT,
                ..read
            },
            record
        );
    }
}

#[test]
fn large_epochs_are_split_into_chunks_that_chain() {
    let dir = tempfile::tempdir().unwrap();
    let owner = StateStore::open(dir.path(), "job").unwrap();
    let events: Vec<Event> = (0..40).map(|i| (1, i, i % 6, 10, false)).collect();
    let log = run_owner(&owner, &[events], 200);
    let records: Vec<ChangelogRecord> = log
        .iter()
        .map(|b| ChangelogRecord::decode(b).unwrap())
        .filter(|r| r.partition == 1)
        .collect();
    assert!(records.len() > 2, "{} chunks", records.len());
    let mut chain = ChainCheck::default();
    for r in &records {
        assert_eq!(r.chunks as usize, records.len());
        chain.accept(r).unwrap();
    }
    assert_eq!(chain.finish(1).unwrap(), Some(Epoch(1)));
    let ids: usize = records.iter().map(|r| r.seen.len()).sum();
    assert_eq!(ids, 40);
    // Cut short, the epoch is incomplete.
    let mut chain = ChainCheck::default();
    chain.accept(&records[0]).unwrap();
    assert!(chain.finish(1).is_err());
}
