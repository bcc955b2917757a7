use proptest::prelude::*;

use super::*;
use crate::declare::FieldMapping;
use crate::declare::built_in_oracle::RecordDecoder;
use crate::decode::PoisonReason;
use crate::window_agg::{WindowAgg, Word};

pub(crate) const REVENUE_AGG: &str = r#"
event_id = "event_id"
event_time = "event_time"
group_by = ["customer_id", "currency"]

[[field]]
name = "event_id"
type = "string"
[[field]]
name = "customer_id"
type = "string"
[[field]]
name = "currency"
type = "string"
format = "currency_code"
[[field]]
name = "amount"
type = "decimal"
scale = 4
[[field]]
name = "event_time"
type = "timestamp"

[[aggregate]]
column = "orders"
function = "count"
[[aggregate]]
column = "revenue"
function = "sum"
field = "amount"
"#;

pub(crate) const TUMBLING: WindowRules = WindowRules {
    size_ms: 60_000,
    slide_ms: None,
    allowed_lateness_ms: 60_000,
    dedup_horizon_ms: 3_600_000,
};

fn declaration(text: &str) -> Declaration {
    toml::from_str(text).expect("declaration parses")
}

pub(crate) fn job(text: &str, rules: WindowRules) -> Job {
    declaration(text)
        .resolve(rules)
        .expect("declaration is valid")
}

pub(crate) fn mistakes(text: &str, rules: WindowRules) -> Vec<(String, String)> {
    match declaration(text).resolve(rules) {
        Ok(_) => panic!("expected mistakes"),
        Err(e) => e.mistakes.into_iter().map(|m| (m.key, m.message)).collect(),
    }
}

/// The reason a record is dead-lettered for (a missing field: unless it is late).
pub(crate) fn poison_of(evaluation: Result<Evaluation, Poison>, what: &str) -> Poison {
    match evaluation {
        Err(poison) | Ok(Evaluation::Incomplete { poison, .. }) => poison,
        other => panic!("expected poison ({what}), got {other:?}"),
    }
}

pub(crate) fn event(job: &Job, record: &str) -> DeclaredEvent {
    match job.evaluate(Some(record.as_bytes()), 4096) {
        Ok(Evaluation::Event(e)) => e,
        other => panic!("expected an event from {record}, got {other:?}"),
    }
}

#[test]
fn revenue_agg_declared_has_the_columns_of_the_view_today() {
    let job = job(REVENUE_AGG, TUMBLING);
    let columns: Vec<String> = job
        .columns()
        .into_iter()
        .map(|(n, t)| format!("{n} {t}"))
        .collect();
    assert_eq!(
        columns,
        [
            "window_start DateTime",
            "window_end DateTime",
            "customer_id String",
            "currency String",
            "orders UInt64",
            "revenue Decimal(18, 4)",
        ]
    );
}

/// Records of the shapes loadgen and real producers send: valid orders, and each way an order
/// can be poison.
fn record() -> impl Strategy<Value = String> {
    let text = prop_oneof![
        Just("c1".to_owned()),
        Just(String::new()),
        Just("a\\\"b".to_owned()),
        "[a-z]{1,6}",
    ];
    let currency = prop_oneof![Just("EUR"), Just("usd"), Just("EURO"), Just("")];
    let amount = prop_oneof![
        Just("\"12.34\"".to_owned()),
        Just("-0.5".to_owned()),
        Just("\"1.23456\"".to_owned()),
        Just("\"1e3\"".to_owned()),
        Just("\"100000000000000\"".to_owned()),
        Just("\"99999999999999.9999\"".to_owned()),
        Just("true".to_owned()),
        Just("null".to_owned()),
        (-1_000_000i64..1_000_000).prop_map(|u| format!("\"{}\"", crate::Amount(u))),
    ];
    let time = prop_oneof![
        Just("1000".to_owned()),
        Just("\"2026-11-29T10:00:00Z\"".to_owned()),
        Just("\"tomorrow\"".to_owned()),
        Just("-5".to_owned()),
        Just("1.5".to_owned()),
        Just("[1]".to_owned()),
        (0i64..4_000_000_000_000).prop_map(|t| t.to_string()),
    ];
    (text.clone(), text, currency, amount, time, any::<u8>()).prop_map(
        |(id, customer, currency, amount, time, drop)| {
            let mut parts = vec![
                format!("\"event_id\":\"{id}\""),
                format!("\"customer_id\":\"{customer}\""),
                format!("\"currency\":\"{currency}\""),
                format!("\"amount\":{amount}"),
                format!("\"event_time\":{time}"),
            ];
            match drop % 8 {
                0 => {
                    parts.remove(usize::from(drop / 8) % parts.len());
                }
                1 => parts[1] = "\"customer_id\":42".to_owned(),
                2 => return format!("[{}]", parts.join(",")),
                3 => return format!("{{{}", parts.join(",")),
                _ => {}
            }
            format!("{{{},\"extra\":{{\"x\":[1,2]}}}}", parts.join(","))
        },
    )
}

proptest! {
    /// The declared revenue_agg reads every record as the built-in decoder does: the same
    /// order, or the same poison reason.
    #[test]
    fn declared_revenue_agg_decodes_as_the_built_in_decoder(record in record()) {
        let declared = job(REVENUE_AGG, TUMBLING);
        let built_in = RecordDecoder::new(FieldMapping::default(), 4096);
        let bytes = Some(record.as_bytes());
        match (built_in.decode(bytes), declared.evaluate(bytes, 4096)) {
            (Ok(order), Ok(Evaluation::Event(e))) => {
                prop_assert_eq!(e.event_id, order.event_id);
                prop_assert_eq!(e.event_time_ms, order.event_time_ms);
                prop_assert_eq!(e.key.to_vec(), vec![Value::Str(order.customer_id), Value::Str(order.currency)]);
                prop_assert_eq!(e.inputs.to_vec(), vec![None, Some(Value::Decimal(order.amount.0))]);
            }
            (Err(a), Err(b) | Ok(Evaluation::Incomplete { poison: b, .. })) => {
                prop_assert_eq!(a.reason, b.reason, "{} vs {}", a.message, b.message)
            }
            (a, b) => prop_assert!(false, "built-in {:?}, declared {:?}", a, b),
        }
    }

    /// Each of a hopping window's `size / slide` windows holds the event; no other does.
    #[test]
    fn an_event_is_in_every_hopping_window_that_holds_it(t in -10_000_000i64..10_000_000, slides in 1i64..7, slide in 1i64..5_000) {
        let w = crate::WindowSpec { size_ms: slide * slides, slide_ms: slide };
        let starts: Vec<i64> = w.starts_of(t).collect();
        prop_assert_eq!(starts.len() as i64, slides);
        for (i, s) in starts.iter().enumerate() {
            prop_assert!(*s <= t && t < s + w.size_ms);
            prop_assert_eq!(s.rem_euclid(slide), 0);
            if i > 0 {
                prop_assert_eq!(starts[i - 1] - s, slide);
            }
        }
        prop_assert!(starts[0] + slide > t, "the newest window is the last one opened");
    }
}

#[test]
fn tumbling_windows_are_the_built_in_ones() {
    let w = job(REVENUE_AGG, TUMBLING).windows;
    let built_in = crate::WindowSpec::tumbling(60_000);
    for t in [0, 59_999, 60_000, 1_795_946_400_250] {
        assert_eq!(w.starts_of(t).collect::<Vec<_>>(), [built_in.start_of(t)]);
    }
}

pub(crate) const PAGE_VIEWS: &str = r#"
event_id = "id"
event_time = "at"
group_by = ["page", "country"]

[[field]]
name = "id"
type = "integer"
[[field]]
name = "at"
type = "timestamp"
path = "meta.ts"
unit = "s"
[[field]]
name = "page"
type = "string"
[[field]]
name = "country"
type = "string"
path = "visitor.geo.country"
[[field]]
name = "kind"
type = "string"
[[field]]
name = "bot"
type = "boolean"
[[field]]
name = "load_ms"
type = "float"

[[filter]]
field = "kind"
in = ["view", "reload"]
[[filter]]
field = "bot"
equals = false
[[filter]]
field = "load_ms"
max = 60000.0

[[aggregate]]
column = "views"
function = "count"
[[aggregate]]
column = "slowest_ms"
function = "max"
field = "load_ms"
[[aggregate]]
column = "mean_ms"
function = "avg"
field = "load_ms"
"#;

#[test]
fn nested_paths_and_filters_read_what_they_name() {
    let job = job(PAGE_VIEWS, TUMBLING);
    let e = event(
        &job,
        r#"{"id":7,"meta":{"ts":120,"other":{"ts":1}},"page":"/","visitor":{"id":1,"geo":{"country":"NL"}},"kind":"view","bot":false,"load_ms":12.5}"#,
    );
    assert_eq!(e.event_id, "7");
    assert_eq!(e.event_time_ms, 120_000);
    assert_eq!(
        e.key.to_vec(),
        vec![Value::Str("/".into()), Value::Str("NL".into())]
    );
    assert_eq!(
        e.inputs.to_vec(),
        vec![None, Some(Value::Float(12.5)), Some(Value::Float(12.5))]
    );

    let evaluate = |r: &str| job.evaluate(Some(r.as_bytes()), 4096);
    // Left out by the filter, whatever else it lacks: another event type has another shape.
    assert_eq!(evaluate(r#"{"kind":"click"}"#), Ok(Evaluation::Filtered));
    assert_eq!(
        evaluate(r#"{"kind":"view","bot":true}"#),
        Ok(Evaluation::Filtered)
    );
    assert_eq!(
        evaluate(r#"{"kind":"view","bot":false,"load_ms":60000.5}"#),
        Ok(Evaluation::Filtered)
    );
    // An absent filter field fails its test; a filter field of the wrong type is poison.
    assert_eq!(evaluate(r#"{"bot":false}"#), Ok(Evaluation::Filtered));
    let poison = evaluate(r#"{"kind":1}"#).expect_err("wrong type");
    assert_eq!(poison.reason, PoisonReason::WrongType);
    assert!(poison.message.contains("\"kind\""), "{}", poison.message);
    // A later occurrence of a parent object replaces the earlier one, as in JSON.parse.
    let poison = poison_of(
        evaluate(
            r#"{"id":7,"meta":{"ts":120},"page":"/","visitor":{"geo":{"country":"NL"}},"visitor":{},"kind":"view","bot":false,"load_ms":1}"#,
        ),
        "country replaced",
    );
    assert_eq!(poison.reason, PoisonReason::MissingField);
    assert!(
        poison.message.contains("visitor.geo.country"),
        "{}",
        poison.message
    );
    // A parent that is not an object leaves its fields missing, whatever else it is.
    for meta in ["5", "null", "\"ts\"", "[{\"ts\":120}]", "true"] {
        let poison = poison_of(
            evaluate(&format!(
                r#"{{"id":7,"meta":{meta},"kind":"view","bot":false,"load_ms":1}}"#
            )),
            "no time",
        );
        assert_eq!(
            (poison.reason, poison.message.contains("meta.ts")),
            (PoisonReason::MissingField, true),
            "{meta}"
        );
    }
}

#[test]
fn output_types_follow_the_declaration() {
    let job = job(PAGE_VIEWS, TUMBLING);
    let types: Vec<String> = job
        .columns()
        .into_iter()
        .map(|(n, t)| format!("{n} {t}"))
        .collect();
    assert_eq!(
        types,
        [
            "window_start DateTime",
            "window_end DateTime",
            "page String",
            "country String",
            "views UInt64",
            "slowest_ms Float64",
            "mean_ms Float64",
        ]
    );
}

fn replace(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} is in the declaration");
    text.replacen(from, to, 1)
}

#[test]
fn each_mistake_is_named_by_its_key() {
    let cases: [(String, WindowRules, &str, &str); 13] = [
        (
            replace(
                REVENUE_AGG,
                "group_by = [\"customer_id\"",
                "group_by = [\"customr_id\"",
            ),
            TUMBLING,
            "aggregation.group_by[0]",
            "no field named \"customr_id\" (declared: event_id, customer_id, currency, amount, event_time)",
        ),
        (
            replace(REVENUE_AGG, "field = \"amount\"", "field = \"currency\""),
            TUMBLING,
            "aggregation.aggregate[1].function",
            "sum needs an integer, decimal or float field; \"currency\" is a string",
        ),
        (
            replace(
                REVENUE_AGG,
                "function = \"sum\"\nfield = \"amount\"",
                "function = \"max\"\nfield = \"customer_id\"",
            ),
            TUMBLING,
            "aggregation.aggregate[1].function",
            "max needs an integer, decimal, float or timestamp field; \"customer_id\" is a string",
        ),
        (
            REVENUE_AGG.to_owned(),
            WindowRules {
                slide_ms: Some(7_000),
                ..TUMBLING
            },
            "window.slide",
            "7s does not divide window.size (1m): windows would not align",
        ),
        (
            REVENUE_AGG.to_owned(),
            WindowRules {
                dedup_horizon_ms: 90_000,
                ..TUMBLING
            },
            "window.dedup_horizon",
            "90s is shorter than window.size + window.allowed_lateness (2m)",
        ),
        (
            replace(REVENUE_AGG, "scale = 4", "scale = 19"),
            TUMBLING,
            "aggregation.field[3].scale",
            "scale 19 is over 18",
        ),
        (
            replace(REVENUE_AGG, "column = \"revenue\"", "column = \"orders\""),
            TUMBLING,
            "aggregation.aggregate[1].column",
            "two columns are named \"orders\"",
        ),
        (
            replace(
                REVENUE_AGG,
                "group_by = [\"customer_id\", \"currency\"]",
                "group_by = []",
            ),
            TUMBLING,
            "aggregation.group_by",
            "groups by no field",
        ),
        (
            replace(
                REVENUE_AGG,
                "column = \"orders\"",
                "column = \"window_end\"",
            ),
            TUMBLING,
            "aggregation.aggregate[0].column",
            "written by tally itself",
        ),
        (
            replace(
                REVENUE_AGG,
                "function = \"count\"",
                "function = \"count\"\nfield = \"amount\"",
            ),
            TUMBLING,
            "aggregation.aggregate[0].field",
            "count takes no field",
        ),
        (
            replace(
                REVENUE_AGG,
                "event_time = \"event_time\"",
                "event_time = \"amount\"",
            ),
            TUMBLING,
            "aggregation.event_time",
            "field \"amount\" is a decimal; the event time is a timestamp",
        ),
        (
            replace(
                REVENUE_AGG,
                "column = \"revenue\"",
                "column = \"revenue-eur\"",
            ),
            TUMBLING,
            "aggregation.aggregate[1].column",
            "not a name ClickHouse takes unquoted",
        ),
        (
            replace(
                REVENUE_AGG,
                "name = \"event_id\"\ntype = \"string\"",
                "name = \"event_id\"\ntype = \"string\"\n[[field]]\nname = \"spare\"\ntype = \"integer\"",
            ),
            TUMBLING,
            "aggregation.field[1]",
            "\"spare\" is declared but no key",
        ),
    ];
    for (text, rules, key, message) in cases {
        let found = mistakes(&text, rules);
        assert!(
            found.iter().any(|(k, m)| k == key && m.contains(message)),
            "expected {key}: {message}, got {found:?}"
        );
    }
}

#[test]
fn every_mistake_is_reported_at_once() {
    let text = replace(
        &replace(REVENUE_AGG, "scale = 4", "scale = 40"),
        "field = \"amount\"",
        "field = \"amout\"",
    );
    let found = mistakes(
        &text,
        WindowRules {
            slide_ms: Some(0),
            ..TUMBLING
        },
    );
    let keys: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "window.slide",
            "aggregation.field[3].scale",
            "aggregation.aggregate[1].field",
            "aggregation.field[3]"
        ],
        "{found:?}"
    );
}

#[test]
fn filter_constants_take_the_fields_type() {
    let text = format!(
        "{PAGE_VIEWS}\n[[filter]]\nfield = \"bot\"\nequals = \"no\"\n[[filter]]\nfield = \"page\"\nmin = \"/a\"\nequals = \"/b\"\n"
    );
    let found = mistakes(&text, TUMBLING);
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.filter[3].equals" && m.contains("is not a boolean")),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.filter[4]" && m.contains("exactly one test")),
        "{found:?}"
    );
}

#[test]
fn min_and_max_keep_the_extremes_of_their_type() {
    let text = replace(
        &replace(
            PAGE_VIEWS,
            "function = \"max\"\nfield = \"load_ms\"",
            "function = \"min\"\nfield = \"at\"",
        ),
        "column = \"slowest_ms\"",
        "column = \"first_seen\"",
    );
    let job = job(&text, TUMBLING);
    assert_eq!(
        job.columns()[5],
        ("first_seen".to_owned(), "DateTime".to_owned())
    );
    let min = &job.aggregates[1];
    let mut words: Vec<Word> = min.empty().collect();
    for t in [300_000, 120_000, 240_000] {
        min.add(&mut words, Some(&Value::Time(t))).expect("adds");
    }
    assert_eq!(words, [Word::Exact(120_000)]);
}

/// Jobs of more than 16 fields read each record with scratch on the heap: the same values in the
/// same places as with fewer.
#[test]
fn a_job_of_many_fields_reads_every_one() {
    for keys in [3usize, 14, 15, 20] {
        let mut text = String::from("event_id = \"id\"\nevent_time = \"at\"\ngroup_by = [");
        let names: Vec<String> = (0..keys).map(|k| format!("k{k}")).collect();
        text += &names
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        text += "]\n[[field]]\nname = \"id\"\ntype = \"string\"\n[[field]]\nname = \"at\"\ntype = \"timestamp\"\n";
        for n in &names {
            text += &format!("[[field]]\nname = {n:?}\ntype = \"integer\"\n");
        }
        text += "[[aggregate]]\ncolumn = \"n\"\nfunction = \"count\"\n";
        let job = job(&text, TUMBLING);
        assert_eq!(job.fields.len(), keys + 2);
        let values: Vec<String> = (0..keys).map(|k| format!("\"k{k}\": {}", k * 7)).collect();
        let record = format!(
            "{{\"id\": \"e1\", \"at\": 1790000400000, {}}}",
            values.join(", ")
        );
        let event = event(&job, &record);
        assert_eq!(event.event_id, "e1");
        assert_eq!(event.event_time_ms, 1_790_000_400_000);
        let expected: Vec<Value> = (0..keys).map(|k| Value::Int(k as i64 * 7)).collect();
        assert_eq!(event.key.to_vec(), expected, "{keys} keys");
        // A missing field names itself, whichever scratch holds it.
        let short = format!(
            "{{\"id\": \"e1\", \"at\": 1790000400000, {}}}",
            values[1..].join(", ")
        );
        let poison = poison_of(job.evaluate(Some(short.as_bytes()), 1 << 20), "k0 missing");
        assert_eq!(poison.reason, PoisonReason::MissingField);
        assert!(poison.message.contains("\"k0\""), "{}", poison.message);
    }
}

#[test]
fn revenue_agg_declared_keeps_the_words_the_built_in_value_has() {
    let job = job(REVENUE_AGG, TUMBLING);
    assert_eq!(job.word_kinds(), crate::window_agg::ORDERS_WORDS);
    let mut value = job.empty_value();
    assert_eq!(value, WindowAgg::of_orders(0, crate::Amount(0)));
    job.add(&mut value, &[None, Some(Value::Decimal(12_500))])
        .expect("fits");
    assert_eq!(value, WindowAgg::of_orders(1, crate::Amount(12_500)));
}

#[test]
fn an_add_that_overflows_one_column_changes_no_column() {
    let job = job(REVENUE_AGG, TUMBLING);
    let mut value = WindowAgg::of_orders(4, crate::Amount(MAX_DECIMAL18_UNITS));
    let before = value.clone();
    let overflow = job.add(&mut value, &[None, Some(Value::Decimal(1))]);
    assert_eq!(
        overflow,
        Err(Overflow {
            column: "revenue".into()
        })
    );
    assert_eq!(value, before);
}

proptest! {
    /// A hopping job's window split among source partitions any way: merging the partitions'
    /// values gives the value of all its records at once (count, max, avg of floats).
    #[test]
    fn a_jobs_partition_values_merge_to_the_whole(
        loads in proptest::collection::vec(0u32..60_000, 1..40),
        cut in 0usize..40,
    ) {
        let job = job(PAGE_VIEWS, TUMBLING);
        let fold = |loads: &[u32]| {
            let mut value = job.empty_value();
            for load in loads {
                let inputs = [None, Some(Value::Float(f64::from(*load))), Some(Value::Float(f64::from(*load)))];
                job.add(&mut value, &inputs).expect("fits");
            }
            value
        };
        let cut = cut.min(loads.len());
        let mut merged = fold(&loads[..cut]);
        job.merge(&mut merged, &fold(&loads[cut..])).expect("fits");
        let whole = fold(&loads);
        // Float sums may differ in their last bits by the order of the additions.
        prop_assert_eq!(&merged.words()[..2], &whole.words()[..2]);
        prop_assert_eq!(merged.words()[3], whole.words()[3]);
        let (Word::Float(a), Word::Float(b)) = (merged.words()[2], whole.words()[2]) else {
            return Err(TestCaseError::fail("avg keeps a float sum"));
        };
        prop_assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0));
    }
}

/// An orders table captured by Debezium: revenue and orders per customer, by the time each
/// order was created; cancelled orders left out.
pub(crate) const ORDERS_CHANGES: &str = r#"
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
name = "status"
type = "string"
[[field]]
name = "created_at"
type = "timestamp"

[[filter]]
field = "status"
not_in = ["cancelled"]

[[aggregate]]
column = "orders"
function = "count"
[[aggregate]]
column = "revenue"
function = "sum"
field = "amount"
[[aggregate]]
column = "avg_amount"
function = "avg"
field = "amount"
"#;

#[test]
fn a_change_job_names_its_rows_by_primary_key_and_refuses_what_cannot_retract() {
    let j = job(ORDERS_CHANGES, TUMBLING);
    let changes = j.changes.as_ref().expect("a change job");
    assert_eq!(changes.primary_key, vec![0]);
    let with = |extra: &str| format!("{ORDERS_CHANGES}{extra}");
    let found = mistakes(
        &with("[[aggregate]]\ncolumn = \"biggest\"\nfunction = \"max\"\nfield = \"amount\"\n"),
        TUMBLING,
    );
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.aggregate[3].function"
                && m.contains("not exact under retraction")),
        "{found:?}"
    );
    let floats = ORDERS_CHANGES.replace(
        "name = \"amount\"\ntype = \"decimal\"\nscale = 2",
        "name = \"amount\"\ntype = \"float\"",
    );
    let found = mistakes(&floats, TUMBLING);
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.aggregate[1].field"
                && m.contains("cannot be retracted exactly")),
        "{found:?}"
    );
    let with_id = ORDERS_CHANGES.replace("primary_key = [\"order_id\"]", "event_id = \"order_id\"");
    let found = mistakes(&with_id, TUMBLING);
    assert!(
        found.iter().any(|(k, _)| k == "aggregation.event_id")
            && found.iter().any(|(k, _)| k == "aggregation.primary_key"),
        "{found:?}"
    );
    let no_count = ORDERS_CHANGES.replace(
        "[[aggregate]]\ncolumn = \"orders\"\nfunction = \"count\"\n",
        "",
    );
    let found = mistakes(&no_count, TUMBLING);
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.aggregate" && m.contains("count")),
        "{found:?}"
    );
    let events_with_key = format!("primary_key = [\"event_id\"]\n{REVENUE_AGG}");
    let found = mistakes(&events_with_key, TUMBLING);
    assert!(
        found.iter().any(|(k, _)| k == "aggregation.primary_key"),
        "{found:?}"
    );
}

/// An id whose field is also a key is copied to both, not moved out of one.
#[test]
fn an_id_read_as_a_key_too_is_in_both() {
    let text = "event_id = \"id\"\nevent_time = \"at\"\ngroup_by = [\"id\"]\n\
        [[field]]\nname = \"id\"\ntype = \"string\"\n\
        [[field]]\nname = \"at\"\ntype = \"timestamp\"\n\
        [[aggregate]]\ncolumn = \"n\"\nfunction = \"count\"\n";
    let shared = job(text, TUMBLING);
    let e = event(&shared, r#"{"id": "order-17", "at": 1790000400000}"#);
    assert_eq!(e.event_id, "order-17");
    assert_eq!(e.key.to_vec(), vec![Value::Str("order-17".into())]);
    assert_eq!(e.inputs.to_vec(), vec![None]);
}
