//! The operator running declared jobs: the declared revenue_agg counts what the built-in decoder
//! read, filtered records are counted, and hopping windows add a record to each open
//! window, all or none.

use super::*;
use crate::declare::FieldMapping;
use crate::declare::WindowRules;
use crate::declare::built_in_oracle::RecordDecoder;
use crate::declare::tests::{PAGE_VIEWS, REVENUE_AGG, job};
use crate::mem::MemStore;
use crate::window_agg::Word;

const OUT_OF_ORDERNESS_MS: i64 = 5_000;

fn rules(size_ms: i64, slide_ms: Option<i64>) -> WindowRules {
    WindowRules {
        size_ms,
        slide_ms,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
    }
}

fn config_of(job: &Job, rules: WindowRules) -> OperatorConfig {
    OperatorConfig {
        window: job.windows,
        out_of_orderness_ms: OUT_OF_ORDERNESS_MS,
        allowed_lateness_ms: rules.allowed_lateness_ms,
        dedup_horizon_ms: rules.dedup_horizon_ms,
        windows_from_ms: None,
    }
}

fn declared(text: &str, rules: WindowRules) -> WindowOperator {
    let job = job(text, rules);
    let config = config_of(&job, rules);
    let program = Program::declared(Arc::new(job), 4096);
    WindowOperator::restore(config, program, Epoch(0), &BTreeMap::new())
}

fn feed(
    op: &mut WindowOperator,
    store: &MemStore,
    p: PartitionId,
    offset: i64,
    v: &str,
) -> Outcome {
    let record = Record {
        partition: p,
        offset,
        timestamp_ms: None,
        key: None,
        value: Some(v.as_bytes()),
    };
    match op.process(store, record) {
        Ok(outcome) => outcome,
        Err(never) => match never {},
    }
}

fn barrier(op: &mut WindowOperator) -> Checkpoint {
    let epoch = op.current_epoch();
    op.handle_checkpoint(CheckpointBarrier {
        epoch,
        is_final: false,
    })
}

/// A small deterministic generator (xorshift): no dependency, the same sequence every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Orders with duplicates, disorder, late events, poison and an amount that overflows.
fn orders(seed: u64, n: usize) -> Vec<(PartitionId, String)> {
    let mut rng = Rng(seed);
    let mut time = 1_800_000_000_000i64;
    (0..n)
        .map(|_| {
            time += rng.below(400) as i64;
            let p = rng.below(2) as PartitionId;
            let id = rng.below(n as u64 * 3 / 4);
            let t = match rng.below(50) {
                0 => time - 300_000,
                1..=10 => time - rng.below(4_000) as i64,
                _ => time,
            };
            let amount = match rng.below(200) {
                0 => "99999999999999.9999".to_owned(),
                _ => format!("{}.{:04}", rng.below(500), rng.below(10_000)),
            };
            let record = match rng.below(60) {
                0 => format!(r#"{{"event_id":"e{id}","customer_id":"c","currency":"eur","amount":"1","event_time":{t}}}"#),
                1 => "not json".to_owned(),
                _ => format!(
                    r#"{{"event_id":"e{id}","customer_id":"c{}","currency":"{}","amount":"{amount}","event_time":{t}}}"#,
                    rng.below(7),
                    ["EUR", "USD"][rng.below(2) as usize],
                ),
            };
            (p, record)
        })
        .collect()
}

/// The declared revenue_agg counts each record as one fate, and the commit log's revenue total
/// (`revenue_units`) is the sum of the amounts it aggregated, as the built-in decoder read them.
#[test]
fn the_declared_revenue_agg_counts_every_fate_and_the_revenue_it_aggregated() {
    let rules = rules(60_000, None);
    let oracle = RecordDecoder::new(FieldMapping::default(), 4096);
    let mut declared = declared(REVENUE_AGG, rules);
    let mut store = MemStore::default();
    let mut offsets: BTreeMap<PartitionId, i64> = BTreeMap::new();
    let mut outcomes = BTreeMap::new();
    let mut revenue = 0i128;
    let mut counted = 0i128;
    for (i, (p, record)) in orders(7, 6_000).iter().enumerate() {
        let offset = offsets.entry(*p).or_default();
        let outcome = feed(&mut declared, &store, *p, *offset, record);
        if outcome == Outcome::Aggregated {
            let order = oracle.decode(Some(record.as_bytes()));
            revenue += order.map_or(i128::MIN / 2, |o| i128::from(o.amount.units()));
        }
        *outcomes.entry(format!("{outcome:?}")).or_insert(0) += 1;
        *offset += 1;
        if i % 500 == 499 {
            let checkpoint = barrier(&mut declared);
            store.apply(&checkpoint);
            assert!(checkpoint.accounting().balances());
            counted += checkpoint.accounting().revenue_units;
        }
    }
    let checkpoint = barrier(&mut declared);
    counted += checkpoint.accounting().revenue_units;
    assert_eq!(counted, revenue);
    // Every kind of outcome was exercised.
    for kind in [
        "Aggregated",
        "Duplicate",
        "DeadLettered(Late)",
        "DeadLettered(TooLarge)",
        "DeadLettered(InvalidJson)",
    ] {
        assert!(outcomes.contains_key(kind), "{kind}: {outcomes:?}");
    }
}

fn view(at_s: i64, page: &str, kind: &str, load_ms: f64) -> String {
    format!(
        r#"{{"id":{id},"meta":{{"ts":{at_s}}},"page":"{page}","visitor":{{"geo":{{"country":"NL"}}}},"kind":"{kind}","bot":false,"load_ms":{load_ms}}}"#,
        id = at_s * 1000 + (load_ms as i64)
    )
}

fn windows(c: &Checkpoint) -> BTreeMap<(i64, String), Vec<Word>> {
    c.rows
        .iter()
        .map(|r| {
            (
                (r.key.window_start_ms, r.key.key.part(0).to_owned()),
                r.value.words().to_vec(),
            )
        })
        .collect()
}

#[test]
fn a_hopping_record_adds_to_each_of_its_windows_and_filtered_ones_are_counted() {
    // 5-minute windows every minute, in seconds of event time.
    let mut op = declared(PAGE_VIEWS, rules(300_000, Some(60_000)));
    let store = MemStore::default();
    let t0 = 1_800_000_000; // a window start (a multiple of 5 minutes), in seconds
    let records = [
        view(t0 + 10, "/a", "view", 10.0),
        view(t0 + 70, "/a", "reload", 30.0),
        view(t0 + 70, "/a", "click", 99.0),    // filtered: kind
        view(t0 + 75, "/a", "view", 70_000.0), // filtered: load_ms above the range
    ];
    let outcomes: Vec<Outcome> = records
        .iter()
        .enumerate()
        .map(|(i, r)| feed(&mut op, &store, 0, i as i64, r))
        .collect();
    assert_eq!(
        outcomes,
        [
            Outcome::Aggregated,
            Outcome::Aggregated,
            Outcome::Filtered,
            Outcome::Filtered
        ]
    );
    let c = barrier(&mut op);
    let acc = c.partitions[&0].epoch;
    assert_eq!((acc.consumed, acc.aggregated, acc.filtered), (4, 2, 2));
    assert!(acc.balances());
    let ms = |s: i64| s * 1000;
    let got = windows(&c);
    // The first view is in the windows starting t0-4m .. t0, the second in t0-3m .. t0+1m.
    let mut expected = BTreeMap::new();
    for k in -4..=1 {
        let start = ms(t0 + 60 * k);
        let (count, max, sum) = match k {
            -4 => (1, 10.0, 10.0),
            1 => (1, 30.0, 30.0),
            _ => (2, 30.0, 40.0),
        };
        expected.insert(
            (start, "/a".to_owned()),
            vec![
                Word::Count(count),
                Word::Float(max),
                Word::Float(sum),
                Word::Count(count),
            ],
        );
    }
    assert_eq!(got, expected);
    for r in &c.rows {
        assert_eq!(r.window_end_ms - r.key.window_start_ms, 300_000);
        assert_eq!(r.key.key.parts(), ["/a", "NL"]);
    }
    // A filtered record's id is not remembered: the same id valid later counts.
    let again = view(t0 + 70, "/a", "view", 99.0);
    assert_eq!(feed(&mut op, &store, 0, 4, &again), Outcome::Aggregated);
}

#[test]
fn a_record_adds_to_its_open_windows_and_is_late_only_when_all_are_closed() {
    let rules = rules(300_000, Some(60_000));
    let mut op = declared(PAGE_VIEWS, rules);
    let mut store = MemStore::default();
    let t0 = 1_800_000_000;
    // The watermark reaches t0 + 10m, so windows ending at or before t0 + 9m are closed (a
    // minute of lateness). An event at t0 + 3.5m is in windows ending t0+4m .. t0+8m: all
    // closed, late. One at t0 + 5.5m is in windows ending t0+6m .. t0+10m: the newest is open.
    let mut offset = 0;
    let mut next = |op: &mut WindowOperator, store: &MemStore, r: String| {
        offset += 1;
        feed(op, store, 0, offset, &r)
    };
    let wm_s = t0 + 600 + OUT_OF_ORDERNESS_MS / 1000;
    assert_eq!(
        next(&mut op, &store, view(wm_s, "/now", "view", 1.0)),
        Outcome::Aggregated
    );
    store.apply(&barrier(&mut op));
    assert_eq!(
        next(&mut op, &store, view(t0 + 210, "/old", "view", 2.0)),
        Outcome::DeadLettered(PoisonReason::Late)
    );
    assert_eq!(
        next(&mut op, &store, view(t0 + 330, "/old", "view", 3.0)),
        Outcome::Aggregated
    );
    let c = barrier(&mut op);
    let acc = c.partitions[&0].epoch;
    assert_eq!((acc.consumed, acc.aggregated, acc.late), (2, 1, 1));
    let starts: Vec<i64> = c
        .rows
        .iter()
        .filter(|r| r.key.key.part(0) == "/old")
        .map(|r| r.key.window_start_ms)
        .collect();
    // Exactly the event's windows still open, by the operator's closing predicate.
    let open: Vec<i64> = op
        .config
        .window
        .starts_of((t0 + 330) * 1000)
        .filter(|s| s + 300_000 + 60_000 > wm_s * 1000 - OUT_OF_ORDERNESS_MS)
        .collect();
    assert!(!open.is_empty() && open.len() < 5, "{open:?}");
    let mut sorted = starts.clone();
    sorted.sort_unstable();
    let mut want = open.clone();
    want.sort_unstable();
    assert_eq!(sorted, want);
}

const BIG_SUMS: &str = r#"
event_id = "id"
event_time = "at"
group_by = ["k"]

[[field]]
name = "id"
type = "string"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "k"
type = "string"
[[field]]
name = "n"
type = "integer"

[[aggregate]]
column = "events"
function = "count"
[[aggregate]]
column = "total"
function = "sum"
field = "n"
"#;

#[test]
fn an_overflow_in_one_window_leaves_all_of_the_records_windows_unchanged() {
    let mut op = declared(BIG_SUMS, rules(300_000, Some(60_000)));
    let store = MemStore::default();
    let t0 = 1_800_000_000_000i64;
    let record =
        |id: &str, at: i64, n: i64| format!(r#"{{"id":"{id}","at":{at},"k":"x","n":{n}}}"#);
    let big = i64::MAX - 10;
    assert_eq!(
        feed(&mut op, &store, 0, 0, &record("a", t0, big)),
        Outcome::Aggregated
    );
    // b's windows start t0 .. t0+4m; the one starting at t0 holds a already.
    assert_eq!(
        feed(&mut op, &store, 0, 1, &record("b", t0 + 240_000, 100)),
        Outcome::DeadLettered(PoisonReason::TooLarge)
    );
    assert_eq!(
        feed(&mut op, &store, 0, 2, &record("c", t0 + 240_000, 5)),
        Outcome::Aggregated
    );
    let c = barrier(&mut op);
    assert!(
        c.dead_letters[0].error.contains("column total"),
        "{}",
        c.dead_letters[0].error
    );
    let got: BTreeMap<i64, Vec<Word>> = c
        .rows
        .iter()
        .map(|r| (r.key.window_start_ms - t0, r.value.words().to_vec()))
        .collect();
    let mut want = BTreeMap::new();
    for k in -4..=0 {
        want.insert(k * 60_000, vec![Word::Count(1), Word::Exact(big)]);
    }
    want.insert(0, vec![Word::Count(2), Word::Exact(big + 5)]);
    for k in 1..=4 {
        want.insert(k * 60_000, vec![Word::Count(1), Word::Exact(5)]);
    }
    assert_eq!(got, want);
    assert!(c.accounting().balances());
}

/// A record lacking a field is late first when its event time is behind the watermark, and a
/// dead-lettered record never moves the watermark.
#[test]
fn a_record_lacking_a_field_is_named_late_first_and_moves_no_watermark() {
    const JOB: &str = r#"
event_id = "id"
event_time = "at"
group_by = ["page"]
[[field]]
name = "id"
type = "string"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "page"
type = "string"
[[aggregate]]
column = "views"
function = "count"
"#;
    let mut op = declared(JOB, rules(60_000, None));
    let store = MemStore::default();
    let t0 = 1_800_000_000_000i64;
    let at = |offset_ms: i64, page: Option<&str>| match page {
        Some(p) => format!(
            r#"{{"id":"v{offset_ms}","at":{},"page":"{p}"}}"#,
            t0 + offset_ms
        ),
        None => format!(r#"{{"id":"v{offset_ms}","at":{}}}"#, t0 + offset_ms),
    };
    assert_eq!(
        feed(&mut op, &store, 0, 0, &at(0, Some("/"))),
        Outcome::Aggregated
    );
    // Far ahead but lacking its page: dead-lettered, and the watermark stays where it was.
    assert_eq!(
        feed(&mut op, &store, 0, 1, &at(600_000, None)),
        Outcome::DeadLettered(PoisonReason::MissingField)
    );
    assert_eq!(
        feed(&mut op, &store, 0, 2, &at(1_000, Some("/"))),
        Outcome::Aggregated
    );
    // Now the watermark passes the first window's lateness: a record there lacking its page
    // is late, one of the open window lacks a field.
    assert_eq!(
        feed(&mut op, &store, 0, 3, &at(200_000, Some("/"))),
        Outcome::Aggregated
    );
    assert_eq!(
        feed(&mut op, &store, 0, 4, &at(2_000, None)),
        Outcome::DeadLettered(PoisonReason::Late)
    );
    assert_eq!(
        feed(&mut op, &store, 0, 5, &at(199_000, None)),
        Outcome::DeadLettered(PoisonReason::MissingField)
    );
    let c = barrier(&mut op);
    let reasons: Vec<PoisonReason> = c.dead_letters.iter().map(|d| d.reason).collect();
    assert_eq!(
        reasons,
        [
            PoisonReason::MissingField,
            PoisonReason::Late,
            PoisonReason::MissingField
        ]
    );
}
