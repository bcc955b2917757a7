//! Bad input at scale: arbitrary bytes and mutations of valid records go through the decoder and
//! the operator. Every record ends as an event or a dead letter with a reason, never a panic, and
//! the accounting balances. `TALLY_FUZZ_CASES=1000000 cargo test -p tally-core --test
//! decoder_fuzz --release` for a run at scale; CI runs the default.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;

use proptest::prelude::*;
use tally_core::FieldMapping;
use tally_core::{
    CheckpointBarrier, Epoch, MemStore, OperatorConfig, Program, Record, WindowOperator, WindowSpec,
};

const VALID: &str = r#"{"event_id":"e-1","customer_id":"c-7","currency":"EUR","amount":"12.3400","event_time":1790000000000}"#;

fn cases() -> u32 {
    std::env::var("TALLY_FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3_000)
}

/// A valid record changed in one of the ways real producers break them.
fn mutated() -> impl Strategy<Value = Vec<u8>> {
    let base = VALID.as_bytes().to_vec();
    let len = base.len();
    prop_oneof![
        // Truncated anywhere.
        (0..len).prop_map({
            let b = base.clone();
            move |n| b[..n].to_vec()
        }),
        // Bytes flipped.
        prop::collection::vec((0..len, any::<u8>()), 1..6).prop_map({
            let b = base.clone();
            move |flips| {
                let mut v = b.clone();
                for (i, x) in flips {
                    v[i] ^= x;
                }
                v
            }
        }),
        // A field replaced by a hostile value: huge numbers, wrong types, deep nesting.
        (
            prop::sample::select(vec![
                "event_id",
                "customer_id",
                "currency",
                "amount",
                "event_time"
            ]),
            prop_oneof![
                Just("1e400".to_owned()),
                Just("-99999999999999999999999999".to_owned()),
                Just("\"99999999999999.99999\"".to_owned()),
                Just("null".to_owned()),
                Just("[]".to_owned()),
                Just("true".to_owned()),
                Just("\"\"".to_owned()),
                (1usize..2_000).prop_map(|d| format!("{}1{}", "[".repeat(d), "]".repeat(d))),
                (1usize..2_000).prop_map(|d| format!("{}{}", "{\"a\":".repeat(d), "}".repeat(d))),
                any::<i64>().prop_map(|n| n.to_string()),
                any::<f64>().prop_map(|f| format!("{f}")),
                ".{0,12}".prop_map(|s| serde_json_string(&s)),
            ],
        )
            .prop_map(|(field, value)| replace_field(VALID, field, &value).into_bytes()),
        // Fields swapped.
        Just(
            VALID
                .replace("\"currency\"", "\"tmp\"")
                .replace("\"customer_id\"", "\"currency\"")
                .replace("\"tmp\"", "\"customer_id\"")
                .into_bytes()
        ),
    ]
}

fn serde_json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

fn replace_field(json: &str, field: &str, value: &str) -> String {
    let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).unwrap();
    v.remove(field);
    let rest = serde_json::to_string(&v).unwrap();
    // Splice the raw value in, so that it may be invalid JSON on purpose.
    format!("{{\"{field}\":{value},{}", &rest[1..])
}

fn input() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..300).prop_map(Some),
        6 => mutated().prop_map(Some),
        1 => Just(None),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn every_record_is_an_event_or_a_dead_letter_and_the_accounting_balances(
        values in prop::collection::vec(input(), 1..20)
    ) {
        let config = OperatorConfig {
            window: WindowSpec::tumbling(60_000),
            out_of_orderness_ms: 5_000,
            allowed_lateness_ms: 60_000,
            dedup_horizon_ms: 3_600_000,
            windows_from_ms: None,
        };
        let program = Program::revenue_agg(&FieldMapping::default(), &config, 4096).expect("revenue_agg");
        let mut op = WindowOperator::restore(config, program.clone(), Epoch(0), &BTreeMap::new());
        op.add_partition(0, 0);
        let store = MemStore::default();
        for (offset, value) in values.iter().enumerate() {
            // The decoder alone: an event, or poison with a reason and a message.
            if let Err(poison) = program.job.evaluate(value.as_deref(), 4096) {
                prop_assert!(!poison.message.is_empty());
            }
            let record = Record {
                partition: 0,
                offset: offset as i64,
                timestamp_ms: None,
                key: None,
                value: value.as_deref(),
            };
            let Ok(_) = op.process(&store, record);
        }
        let cp = op.handle_checkpoint(CheckpointBarrier { epoch: Epoch(1), is_final: false });
        let acc = cp.accounting();
        prop_assert!(acc.balances(), "{acc:?}");
        prop_assert_eq!(acc.consumed, values.len() as u64);
        prop_assert_eq!(acc.dead_lettered + acc.late, cp.dead_letters.len() as u64);
    }
}
