//! revenue_agg, tally's first job, as a declaration: orders counted and their amounts summed per
//! customer, currency and window. `config/revenue_agg.toml` writes the same `[aggregation]`; a
//! job file of the releases before it named the five fields in `[fields]` instead, and is read
//! as this declaration under those names.

use super::{AggregateDecl, Declaration, FieldDecl, FieldKind, Format, Function};

/// The JSON keys revenue_agg reads its five fields from (`[fields]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldMapping {
    pub event_id: String,
    pub customer_id: String,
    pub currency: String,
    pub amount: String,
    pub event_time: String,
}

impl Default for FieldMapping {
    fn default() -> Self {
        FieldMapping {
            event_id: "event_id".into(),
            customer_id: "customer_id".into(),
            currency: "currency".into(),
            amount: "amount".into(),
            event_time: "event_time".into(),
        }
    }
}

/// revenue_agg's declaration, each field read from the top-level key `fields` names.
pub fn revenue_agg(fields: &FieldMapping) -> Declaration {
    let field = |name: &str, path: &str, kind: FieldKind| FieldDecl {
        name: name.into(),
        kind,
        path: (path != name).then(|| path.to_owned()),
        scale: None,
        unit: None,
        format: None,
        allow_empty: false,
    };
    Declaration {
        format: Format::Json,
        fields: vec![
            field("event_id", &fields.event_id, FieldKind::String),
            field("customer_id", &fields.customer_id, FieldKind::String),
            FieldDecl {
                format: Some("currency_code".into()),
                ..field("currency", &fields.currency, FieldKind::String)
            },
            FieldDecl {
                scale: Some(4),
                ..field("amount", &fields.amount, FieldKind::Decimal)
            },
            field("event_time", &fields.event_time, FieldKind::Timestamp),
        ],
        event_id: Some("event_id".into()),
        primary_key: Vec::new(),
        event_time: "event_time".into(),
        group_by: vec!["customer_id".into(), "currency".into()],
        filter: Vec::new(),
        aggregates: vec![
            AggregateDecl {
                column: "orders".into(),
                function: Function::Count,
                field: None,
            },
            AggregateDecl {
                column: "revenue".into(),
                function: Function::Sum,
                field: Some("amount".into()),
            },
        ],
    }
}

#[cfg(test)]
#[allow(clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;
    use crate::amount::Amount;
    use crate::declare::{Evaluation, Job, Value, WindowRules};
    use crate::decode::{Poison, PoisonReason};

    const RULES: WindowRules = WindowRules {
        size_ms: 60_000,
        slide_ms: None,
        allowed_lateness_ms: 60_000,
        dedup_horizon_ms: 3_600_000,
    };

    /// What the declared revenue_agg makes of a record, as the built-in decoder's tests read it.
    #[derive(Debug, PartialEq)]
    struct Order {
        event_id: String,
        customer_id: String,
        currency: String,
        amount: Amount,
        event_time_ms: i64,
    }

    struct Decoder(Job, usize);

    impl Decoder {
        fn new(fields: FieldMapping, max_record_bytes: usize) -> Decoder {
            let job = revenue_agg(&fields).resolve(RULES);
            Decoder(job.expect("revenue_agg resolves"), max_record_bytes)
        }

        fn decode(&self, value: Option<&[u8]>) -> Result<Order, Poison> {
            let text = |v: &Value| match v {
                Value::Str(s) => s.to_string(),
                other => format!("{other:?}"),
            };
            match self.0.evaluate(value, self.1)? {
                Evaluation::Event(e) => Ok(Order {
                    event_id: e.event_id.to_string(),
                    customer_id: text(&e.key[0]),
                    currency: text(&e.key[1]),
                    amount: match e.inputs[1] {
                        Some(Value::Decimal(units)) => Amount(units),
                        _ => Amount(i64::MIN),
                    },
                    event_time_ms: e.event_time_ms,
                }),
                Evaluation::Incomplete { poison, .. } => Err(poison),
                Evaluation::Filtered => Err(Poison::new(PoisonReason::InvalidJson, "filtered")),
            }
        }
    }

    fn decoder() -> Decoder {
        Decoder::new(FieldMapping::default(), 1024)
    }

    #[test]
    fn the_declaration_of_the_shipped_file_is_revenue_aggs() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/revenue_agg.toml"
        ))
        .unwrap_or_default();
        let table: toml::Table = toml::from_str(&text).unwrap_or_default();
        let shipped: Result<Declaration, _> = table
            .get("aggregation")
            .cloned()
            .map(toml::Value::try_into)
            .unwrap_or_else(|| Err(serde::de::Error::custom("no [aggregation]")));
        assert_eq!(shipped.ok(), Some(revenue_agg(&FieldMapping::default())));
    }

    #[test]
    fn renamed_keys_are_read_from_their_paths_under_revenue_aggs_names() {
        let fields = FieldMapping {
            amount: "total".into(),
            ..FieldMapping::default()
        };
        let job = revenue_agg(&fields).resolve(RULES);
        let job = job.as_ref().map_err(ToString::to_string);
        let amount = job.map(|j| (j.fields[3].name.clone(), j.fields[3].path.clone()));
        assert_eq!(amount, Ok(("amount".to_owned(), vec!["total".to_owned()])));
    }

    fn reason(value: &[u8]) -> PoisonReason {
        match decoder().decode(Some(value)) {
            Ok(ev) => panic!("expected poison, decoded {ev:?}"),
            Err(p) => p.reason,
        }
    }

    const GOOD: &str = r#"{"event_id":"e1","customer_id":"c1","currency":"EUR","amount":"12.34","event_time":"2026-11-29T10:00:00Z","extra":[1,{"x":2}]}"#;

    #[test]
    fn decodes_a_valid_order() {
        let ev = decoder().decode(Some(GOOD.as_bytes())).expect("valid");
        assert_eq!(ev.event_id, "e1");
        assert_eq!(ev.customer_id, "c1");
        assert_eq!(ev.currency, "EUR");
        assert_eq!(ev.amount, Amount(123_400));
        assert_eq!(ev.event_time_ms, 1_795_946_400_000);
    }

    #[test]
    fn accepts_numbers_and_epoch_millis_and_escapes() {
        let v = br#"{"event_id":"e\u0031","customer_id":"c\"1","currency":"USD","amount":-0.5,"event_time":1000}"#;
        let ev = decoder().decode(Some(v)).expect("valid");
        assert_eq!(ev.event_id, "e1");
        assert_eq!(ev.customer_id, "c\"1");
        assert_eq!(ev.amount, Amount(-5_000));
        assert_eq!(ev.event_time_ms, 1000);
    }

    /// Strings without escapes are read in place: that relies on serde_json rejecting what a
    /// JSON string may not hold raw, and escaped amounts and times still decode.
    #[test]
    fn strings_read_in_place_are_validated_and_escaped_ones_unescaped() {
        let raw_newline = b"{\"event_id\":\"e\n1\",\"customer_id\":\"c1\",\"currency\":\"EUR\",\"amount\":\"1.5\",\"event_time\":1000}";
        let err = decoder()
            .decode(Some(raw_newline))
            .expect_err("control character");
        assert_eq!(err.reason, PoisonReason::InvalidJson, "{err:?}");
        let escaped = br#"{"event_id":"e1","customer_id":"c1","currency":"E\u0055R","amount":"1\u002e5","event_time":"2026-12-01T00:00:00\u005a"}"#;
        let ev = decoder().decode(Some(escaped)).expect("valid");
        assert_eq!(ev.currency, "EUR");
        assert_eq!(ev.amount, Amount(15_000));
        assert_eq!(ev.event_time_ms, 1_796_083_200_000);
    }

    #[test]
    fn honours_the_field_mapping() {
        let mapping = FieldMapping {
            event_id: "id".into(),
            customer_id: "cust".into(),
            currency: "ccy".into(),
            amount: "amt".into(),
            event_time: "ts".into(),
        };
        let d = Decoder::new(mapping, 1024);
        let ev = d
            .decode(Some(br#"{"id":"x","cust":"y","ccy":"GBP","amt":1,"ts":5}"#))
            .expect("valid");
        assert_eq!(ev.customer_id, "y");
        assert_eq!(
            d.decode(Some(GOOD.as_bytes())).map_err(|p| p.reason),
            Err(PoisonReason::MissingField)
        );
    }

    #[test]
    fn every_poison_reason() {
        assert_eq!(reason(b"\xff\xfe{}"), PoisonReason::InvalidUtf8);
        assert_eq!(reason(b"{\"event_id\":"), PoisonReason::InvalidJson);
        assert_eq!(reason(b"[1,2]"), PoisonReason::InvalidJson);
        assert_eq!(reason(b"{} trailing"), PoisonReason::InvalidJson);
        assert_eq!(
            decoder().decode(None).map_err(|p| p.reason),
            Err(PoisonReason::InvalidJson)
        );
        assert_eq!(
            reason(br#"{"customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#),
            PoisonReason::MissingField
        );
        assert_eq!(
            reason(
                br#"{"event_id":"","customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#
            ),
            PoisonReason::MissingField
        );
        assert_eq!(reason(br#"{"event_id":"e","customer_id":null,"currency":"EUR","amount":1,"event_time":1}"#), PoisonReason::MissingField);
        assert_eq!(
            reason(
                br#"{"event_id":7,"customer_id":"c","currency":"EUR","amount":1,"event_time":1}"#
            ),
            PoisonReason::WrongType
        );
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":true,"event_time":1}"#), PoisonReason::WrongType);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":[1]}"#), PoisonReason::WrongType);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1e3,"event_time":1}"#), PoisonReason::InvalidAmount);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":"1.23456","event_time":1}"#), PoisonReason::InvalidAmount);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":100000000000000,"event_time":1}"#), PoisonReason::InvalidAmount);
        assert_eq!(
            reason(
                br#"{"event_id":"e","customer_id":"c","currency":"eur","amount":1,"event_time":1}"#
            ),
            PoisonReason::InvalidCurrency
        );
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EURO","amount":1,"event_time":1}"#), PoisonReason::InvalidCurrency);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":"yesterday"}"#), PoisonReason::InvalidTime);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":1.5}"#), PoisonReason::InvalidTime);
        assert_eq!(reason(br#"{"event_id":"e","customer_id":"c","currency":"EUR","amount":1,"event_time":-1}"#), PoisonReason::InvalidTime);
        let big = format!(
            r#"{{"event_id":"e","customer_id":"{}","currency":"EUR","amount":1,"event_time":1}}"#,
            "x".repeat(2000)
        );
        assert_eq!(reason(big.as_bytes()), PoisonReason::TooLarge);
    }

    #[test]
    fn poison_messages_name_the_field() {
        let err = decoder()
            .decode(Some(
                br#"{"event_id":"e","customer_id":"c","currency":"EUR","event_time":1}"#,
            ))
            .err()
            .map(|p| p.message)
            .unwrap_or_default();
        assert!(err.contains("\"amount\""), "{err}");
    }
}
