//! A field the filter lets be absent (`present = false`) and the order in which a dead
//! letter's reason is chosen.

use super::tests::{TUMBLING, event, job, mistakes, poison_of};
use super::*;
use crate::declare::FieldMapping;
use crate::declare::built_in_oracle::RecordDecoder;

/// Shipments per carrier, with an optional `signed_by`: `present` is set by the test.
fn shipments(present: bool) -> Job {
    job(
        &format!(
            r#"
event_id = "id"
event_time = "at"
group_by = ["carrier"]

[[field]]
name = "id"
type = "string"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "carrier"
type = "string"
[[field]]
name = "weight"
type = "integer"
[[field]]
name = "signed_by"
type = "string"

[[filter]]
field = "signed_by"
present = {present}

[[aggregate]]
column = "shipments"
function = "count"
[[aggregate]]
column = "weight_total"
function = "sum"
field = "weight"
"#
        ),
        TUMBLING,
    )
}

#[test]
fn a_field_the_filter_lets_be_absent_is_read_as_absent_not_as_poison() {
    let absent = shipments(false);
    let present = shipments(true);
    let evaluate = |job: &Job, r: &str| job.evaluate(Some(r.as_bytes()), 4096);
    for record in [
        r#"{"id":"s1","at":1000,"carrier":"ups","weight":3}"#,
        r#"{"id":"s1","at":1000,"carrier":"ups","weight":3,"signed_by":null}"#,
        r#"{"id":"s1","at":1000,"carrier":"ups","weight":3,"signed_by":""}"#,
    ] {
        let e = event(&absent, record);
        assert_eq!(e.key.to_vec(), vec![Value::Str("ups".into())], "{record}");
        assert_eq!(
            e.inputs.to_vec(),
            vec![None, Some(Value::Int(3))],
            "{record}"
        );
        assert_eq!(
            evaluate(&present, record),
            Ok(Evaluation::Filtered),
            "{record}"
        );
    }
    for record in [
        r#"{"id":"s1","at":1000,"carrier":"ups","weight":3,"signed_by":"ann"}"#,
        // A presence test asks whether a value is there, not its type.
        r#"{"id":"s1","at":1000,"carrier":"ups","weight":3,"signed_by":7}"#,
    ] {
        assert_eq!(
            evaluate(&absent, record),
            Ok(Evaluation::Filtered),
            "{record}"
        );
    }
    let e = event(
        &present,
        r#"{"id":"s1","at":1000,"carrier":"ups","weight":3,"signed_by":"ann"}"#,
    );
    assert_eq!(e.inputs.to_vec(), vec![None, Some(Value::Int(3))]);
    // A record passing `present = false` still needs every other field.
    let p = poison_of(
        evaluate(&absent, r#"{"id":"s1","at":1000,"weight":3}"#),
        "no carrier",
    );
    assert_eq!(p.reason, PoisonReason::MissingField);
    assert!(p.message.contains("\"carrier\""), "{}", p.message);
}

#[test]
fn the_first_reason_that_applies_names_a_dead_letter() {
    let job = shipments(false);
    let evaluate = |r: &str| job.evaluate(Some(r.as_bytes()), 4096);
    // A wrong value before a missing field, whichever is declared first.
    let p = poison_of(
        evaluate(r#"{"id":"s1","at":1000,"weight":"heavy"}"#),
        "wrong weight, no carrier",
    );
    assert_eq!(p.reason, PoisonReason::WrongType, "{}", p.message);
    let p = poison_of(
        evaluate(r#"{"id":"s1","at":"tomorrow","carrier":"ups"}"#),
        "bad time, no weight",
    );
    assert_eq!(p.reason, PoisonReason::InvalidTime, "{}", p.message);
    // A missing field with a readable event time: the operator names it late first.
    assert!(matches!(
        evaluate(r#"{"id":"s1","at":1000,"carrier":"ups"}"#),
        Ok(Evaluation::Incomplete { event_time_ms: 1000, ref poison })
            if poison.reason == PoisonReason::MissingField && poison.message.contains("\"weight\"")
    ));
    // Without an event time, nothing can be late: the missing field is the reason.
    let p = evaluate(r#"{"id":"s1","carrier":"ups"}"#).expect_err("no time");
    assert_eq!(p.reason, PoisonReason::MissingField);
    // The built-in decoder names them in the same order.
    let built_in = RecordDecoder::new(FieldMapping::default(), 4096);
    let p = built_in
        .decode(Some(
            br#"{"event_id":"e","currency":"eur","amount":"1","event_time":1}"#,
        ))
        .expect_err("no customer, bad currency");
    assert_eq!(p.reason, PoisonReason::InvalidCurrency, "{}", p.message);
}

#[test]
fn a_field_the_filter_lets_be_absent_is_only_tested() {
    let with = |extra: &str, group_by: &str| {
        mistakes(
            &format!(
                r#"
event_id = "id"
event_time = "at"
group_by = [{group_by}]

[[field]]
name = "id"
type = "string"
[[field]]
name = "at"
type = "timestamp"
[[field]]
name = "carrier"
type = "string"
[[field]]
name = "signed_by"
type = "string"

[[filter]]
field = "signed_by"
present = false
{extra}
[[aggregate]]
column = "shipments"
function = "count"
"#
            ),
            TUMBLING,
        )
    };
    let found = with("", "\"carrier\", \"signed_by\"");
    assert!(
        found.iter().any(|(k, m)| k == "aggregation.group_by[1]"
            && m.contains("\"signed_by\"")
            && m.contains("NULL")),
        "{found:?}"
    );
    let found = with(
        "[[aggregate]]\ncolumn = \"last\"\nfunction = \"max\"\nfield = \"signed_by\"\n",
        "\"carrier\"",
    );
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.aggregate[0].field" && m.contains("always be empty")),
        "{found:?}"
    );
    let found = with(
        "[[filter]]\nfield = \"signed_by\"\nequals = \"ann\"\n",
        "\"carrier\"",
    );
    assert!(
        found
            .iter()
            .any(|(k, m)| k == "aggregation.filter[1]" && m.contains("pass no record")),
        "{found:?}"
    );
}
