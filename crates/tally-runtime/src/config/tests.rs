use super::*;

const BASE: &str = r#"
[job]
name = "revenue_agg"
state_dir = "/tmp/x"
[kafka]
brokers = "127.0.0.1:9092"
source_topic = "orders"
consumer_group = "g"
[clickhouse]
url = "http://127.0.0.1:8123"
password = "hunter2"
"#;

fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Config::parse("job.toml", text, &env)
}

/// The error a configuration is refused with.
fn refusal(text: &str, env: &[(&str, &str)]) -> String {
    parse(text, env).unwrap_err().to_string()
}

#[test]
fn defaults_apply() {
    let c = parse(BASE, &[]).unwrap();
    assert_eq!(c.window.size, Millis(60_000));
    assert_eq!(c.window.dedup_horizon, Millis(3_600_000));
    assert_eq!(c.dlq_topic(), "orders.dlq");
    assert_eq!(c.transactional_id(), "tally-revenue_agg");
    assert_eq!(c.job.checkpoint_interval, Millis(5_000));
    assert_eq!(c.kafka.partition_discovery_interval, Millis(30_000));
}

#[test]
fn a_task_runs_its_partitions_with_its_own_directory_and_transactional_id() {
    let c = parse(BASE, &[("TALLY_JOB__TASKS", "3")]).unwrap();
    assert_eq!(c.tasks(), 3);
    let s = c.resolve().expect("a JSON job resolves");
    let whole = s.whole();
    assert!(
        (0..9).all(|p| whole.owns(p)),
        "the job as a whole runs every partition"
    );
    let t = s.task(1);
    assert_eq!(
        (0..9).filter(|p| t.owns(*p)).collect::<Vec<_>>(),
        vec![1, 4, 7]
    );
    assert_eq!(whole.transactional_id, "tally-revenue_agg");
    assert_eq!(t.transactional_id, "tally-revenue_agg-task-1");
    assert_eq!(t.state_dir, PathBuf::from("/tmp/x/task-1"));
    assert_eq!(whole.state_dir, PathBuf::from("/tmp/x"));
    assert_eq!(t.state_identity, "revenue_agg@orders#task-1");
    assert_eq!(whole.state_identity, "revenue_agg@orders");
    let err = refusal(BASE, &[("TALLY_JOB__TASKS", "0")]);
    assert!(err.contains("job.tasks"), "{err}");
}

#[test]
fn the_state_memory_is_bounded_and_named_when_out_of_range() {
    assert_eq!(parse(BASE, &[]).unwrap().job.state_memory_mib, 64);
    let c = parse(BASE, &[("TALLY_JOB__STATE_MEMORY_MIB", "32")]).unwrap();
    assert_eq!(c.job.state_memory_mib, 32);
    let err = refusal(BASE, &[("TALLY_JOB__STATE_MEMORY_MIB", "8")]);
    assert!(err.contains("job.state_memory_mib"), "{err}");
}

#[test]
fn a_fold_step_is_bounded_by_the_configured_versions() {
    let c = parse(BASE, &[]).unwrap();
    assert_eq!(c.fold_rules().step_rows, tally_clickhouse::FOLD_STEP_ROWS);
    let c = parse(BASE, &[("TALLY_CLICKHOUSE__FOLD_STEP_ROWS", "500")]).unwrap();
    assert_eq!(c.fold_rules().step_rows, 500);
    let err = refusal(BASE, &[("TALLY_CLICKHOUSE__FOLD_STEP_ROWS", "0")]);
    assert!(err.contains("clickhouse.fold_step_rows"), "{err}");
}

#[test]
fn a_misspelled_key_is_named_with_the_file() {
    let err = refusal(&format!("{BASE}\n[window]\nsise = \"60s\"\n"), &[]);
    assert!(err.starts_with("job.toml: window"), "{err}");
    assert!(err.contains("unknown field `sise`"), "{err}");
}

#[test]
fn a_negative_window_is_refused_by_key() {
    let err = refusal(&format!("{BASE}\n[window]\nsize = \"-60s\"\n"), &[]);
    assert!(err.contains("window.size"), "{err}");
    assert!(err.contains("negative"), "{err}");
}

#[test]
fn the_dedup_horizon_must_cover_window_and_lateness() {
    let err = refusal(
        &format!(
            "{BASE}\n[window]\nsize = \"60s\"\nallowed_lateness = \"60s\"\ndedup_horizon = \"90s\"\n"
        ),
        &[],
    );
    assert!(err.contains("window.dedup_horizon"), "{err}");
}

#[test]
fn environment_overrides_any_key() {
    let c = parse(
        BASE,
        &[
            ("TALLY_KAFKA__BROKERS", "kafka:29092"),
            ("TALLY_WINDOW__SIZE", "30s"),
            ("TALLY_KAFKA__CLIENT__SECURITY_PROTOCOL", "ssl"),
            ("TALLY_JOB__MAX_RECORD_BYTES", "2048"),
            ("TALLY_FAULT", "ignored"),
        ],
    )
    .unwrap();
    assert_eq!(c.kafka.brokers, "kafka:29092");
    assert_eq!(c.window.size, Millis(30_000));
    assert_eq!(
        c.kafka.client.get("security.protocol").map(String::as_str),
        Some("ssl")
    );
    assert_eq!(c.job.max_record_bytes, 2048);
    let err = refusal(BASE, &[("TALLY_WINDOW__SIZE", "soon")]);
    assert!(
        err.contains("window.size (from TALLY_WINDOW__SIZE)"),
        "{err}"
    );
    let err = refusal(BASE, &[("TALLY_WINDOW__SIZZE", "1s")]);
    assert!(err.contains("sizze"), "{err}");
}

#[test]
fn folding_defaults_on_and_retention_must_outlast_lateness() {
    let c = parse(BASE, &[]).unwrap();
    assert_eq!(c.clickhouse.fold_interval, Millis(60_000));
    assert_eq!(c.fold_rules().retention_ms, None);
    let c = parse(BASE, &[("TALLY_CLICKHOUSE__RETENTION", "30d")]).unwrap();
    assert_eq!(c.fold_rules().retention_ms, Some(30 * 86_400_000));
    let err = refusal(BASE, &[("TALLY_CLICKHOUSE__RETENTION", "90s")]);
    assert!(err.contains("clickhouse.retention"), "{err}");
    let err = refusal(BASE, &[("TALLY_CLICKHOUSE__FOLD_INTERVAL", "-1s")]);
    assert!(err.contains("clickhouse.fold_interval"), "{err}");
}

#[test]
fn the_password_never_shows_in_debug() {
    let c = parse(BASE, &[]).unwrap();
    let debug = format!("{c:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(debug.contains("***"));
}

#[test]
fn durations_parse() {
    assert_eq!(Millis::parse("500ms"), Ok(Millis(500)));
    assert_eq!(Millis::parse("1h"), Ok(Millis(3_600_000)));
    assert!(Millis::parse("5").is_err());
    assert!(Millis::parse("5 parsecs").is_err());
}

// Declared jobs: the `[aggregation]` section read with the rest of the file.
const REVENUE_AGG: &str = include_str!("../../../../config/revenue_agg.toml");
const PAGE_VIEWS: &str = include_str!("../../../../config/page_views.toml");
const API_LATENCY: &str = include_str!("../../../../config/api_latency.toml");

fn declared(text: &str) -> Result<(Config, Option<tally_core::declare::Job>), ConfigError> {
    Config::parse("job.toml", text, &[]).map(|c| {
        let job = c.declared.as_ref().clone();
        (c, Some(job))
    })
}

/// The shipped revenue_agg is a declaration whose identity records the field names of the
/// `[fields]` it replaces (and so an existing deployment's state, changelog and tables are
/// unchanged); a file without `[aggregation]` runs the same declaration, its rows of the shape
/// the releases before wrote.
#[test]
fn the_declared_revenue_agg_runs_with_the_fields_it_always_had() {
    let config = Config::parse("revenue_agg.toml", REVENUE_AGG, &[]).expect("runs");
    assert_eq!(
        config.revenue_agg_fields(),
        Some(tally_core::FieldMapping::default())
    );
    assert_eq!(config.row_shape(), tally_core::RowShape::orders());
    assert_eq!(config.sink_shape(), tally_clickhouse::Shape::revenue_agg());
    let without = REVENUE_AGG
        .split("\n[aggregation]")
        .next()
        .unwrap_or_default();
    let plain = Config::parse("revenue_agg.toml", without, &[]).expect("runs");
    assert_eq!(plain.declared, config.declared);
    let fields = format!(
        "{without}\n[fields]\nevent_id = \"event_id\"\ncustomer_id = \"customer_id\"\ncurrency = \"currency\"\namount = \"total\"\nevent_time = \"event_time\"\n"
    );
    let named = Config::parse("revenue_agg.toml", &fields, &[]).expect("runs");
    assert_eq!(
        named.revenue_agg_fields().map(|f| f.amount),
        Some("total".into())
    );
    let dotted = fields.replace("\"total\"", "\"order.total\"");
    let refused = Config::parse("revenue_agg.toml", &dotted, &[]).expect_err("dotted");
    assert!(refused.to_string().contains("fields.amount"), "{refused}");
    let renamed = REVENUE_AGG.replace(
        "name = \"amount\"\ntype = \"decimal\"",
        "name = \"amount\"\npath = \"total\"\ntype = \"decimal\"",
    );
    let config = Config::parse("revenue_agg.toml", &renamed, &[]).expect("runs");
    assert_eq!(
        config.revenue_agg_fields().map(|f| f.amount),
        Some("total".into())
    );
}

#[test]
fn the_example_declarations_are_valid_and_say_why_this_release_does_not_run_them() {
    for (text, view, why) in [
        (
            PAGE_VIEWS,
            "page String, country String, device String, views UInt64, fastest_load_ms Int64, slowest_load_ms Int64, mean_load_ms Float64",
            "the window hops",
        ),
        (
            API_LATENCY,
            "service String, route String, requests UInt64, latency_total_ms Decimal(18, 3), latency_max_ms Decimal(18, 3)",
            "the declaration has a filter",
        ),
    ] {
        let (_, job) = declared(text).expect("valid");
        let job = job.expect("declared");
        let described = crate::declaration::describe(&job);
        assert!(described.contains(view), "{described}");
        // Run as declared, with the declaration's shape in the state and in ClickHouse.
        let config = Config::parse("job.toml", text, &[]).expect("runs");
        assert_eq!(config.declared.as_ref(), &job);
        assert_eq!(config.row_shape(), job.row_shape());
        assert_eq!(config.sink_shape(), tally_clickhouse::Shape::of(&job));
        assert!(
            crate::declaration::built_in_fields(&job)
                .unwrap_err()
                .contains(why)
        );
    }
    let (_, job) = declared(PAGE_VIEWS).expect("valid");
    assert!(
        crate::declaration::describe(&job.expect("declared")).contains("5 window(s) per record")
    );
}

/// A declaration shapes the job's tables: revenue_agg's is the shape its tables always had; an
/// average is kept as its sum and count (so source partitions merge exactly) and shown divided.
#[test]
fn declarations_shape_the_tables_and_the_view() {
    let shape = |text: &str| {
        let (_, job) = declared(text).expect("valid");
        tally_clickhouse::Shape::of(&job.expect("declared"))
    };
    assert_eq!(shape(REVENUE_AGG), tally_clickhouse::Shape::revenue_agg());
    assert!(shape(REVENUE_AGG).is_revenue_agg());
    let page_views = shape(PAGE_VIEWS);
    assert!(!page_views.is_revenue_agg());
    let names = tally_clickhouse::TableNames::new("tally", "page_views")
        .expect("names")
        .with_shape(page_views);
    let statements = names.create_statements().join("\n");
    for expected in [
        "CREATE TABLE IF NOT EXISTS tally.page_views_data (version Int64, source_partition Int32, window_start DateTime, window_end DateTime, page String, country String, device String, views UInt64, fastest_load_ms Int64, slowest_load_ms Int64, mean_load_ms__sum Int64, mean_load_ms__count UInt64) ENGINE = MergeTree PARTITION BY intDiv(toUInt32(window_start), 600) ORDER BY (window_start, page, country, device, source_partition, version)",
        "SELECT window_start, window_end, page, country, device, views, fastest_load_ms, slowest_load_ms, mean_load_ms__sum / mean_load_ms__count AS mean_load_ms FROM tally.page_views_final",
    ] {
        assert!(statements.contains(expected), "{statements}");
    }
    let answer_of = |names: &tally_clickhouse::TableNames| {
        names.read_view_at_sql(
            tally_clickhouse::Frontier { seconds: 0 },
            &tally_clickhouse::Cut::default(),
            None,
        )
    };
    let answer = answer_of(&names);
    assert!(
        answer.contains("sum(p_views) AS views, min(p_fastest_load_ms) AS fastest_load_ms, max(p_slowest_load_ms) AS slowest_load_ms, sum(p_mean_load_ms__sum) AS mean_load_ms__sum, sum(p_mean_load_ms__count) AS mean_load_ms__count"),
        "{answer}"
    );
    let api_latency = tally_clickhouse::TableNames::new("tally", "api")
        .expect("names")
        .with_shape(shape(API_LATENCY));
    let versions = answer_of(&api_latency);
    assert!(
        versions.contains("toDecimal64(sum(p_latency_total_ms), 3) AS latency_total_ms, max(p_latency_max_ms) AS latency_max_ms"),
        "{versions}"
    );
}

#[test]
fn a_job_names_its_fields_one_way() {
    let both = format!("{REVENUE_AGG}\n[fields]\namount = \"total\"\n");
    let refused = declared(&both).expect_err("both").to_string();
    assert!(refused.starts_with("job.toml: fields: "), "{refused}");
    let hopping = REVENUE_AGG
        .split("\n[aggregation]")
        .next()
        .expect("has a declaration")
        .replace("size = \"60s\"", "size = \"60s\"\nslide = \"30s\"");
    // Without a declaration the job is revenue_agg's, which hops as any declaration does (and
    // is then recorded by its declaration, the built-in decoder never having hopped).
    let (config, _) = declared(&hopping).expect("revenue_agg hops");
    assert_eq!(config.declared.windows.slide_ms, 30_000);
    assert_eq!(config.revenue_agg_fields(), None);
}

#[test]
fn every_mistake_of_a_declaration_is_named_with_the_file() {
    let text = REVENUE_AGG
        .replace(
            "group_by = [\"customer_id\", \"currency\"]",
            "group_by = [\"customer\", \"currency\"]",
        )
        .replace("scale = 4 ", "scale = 19 ");
    let refused = declared(&text).expect_err("mistakes").to_string();
    assert!(
        refused.starts_with("job.toml: the job declaration has 3 mistake(s):"),
        "{refused}"
    );
    assert!(
        refused.contains("\n  aggregation.group_by[0]: no field named \"customer\""),
        "{refused}"
    );
    assert!(
        refused.contains("\n  aggregation.field[3].scale: scale 19 is over 18"),
        "{refused}"
    );
    assert!(
        refused.contains("\n  aggregation.field[1]: field \"customer_id\" is declared but"),
        "{refused}"
    );
}

/// The keys a `Deserialize` struct takes, as serde's derive names them (renames applied,
/// skipped fields left out): asked of the derive itself by a deserializer that records the
/// field list `deserialize_struct` is given.
fn keys_of<'de, T: Deserialize<'de>>() -> Vec<&'static str> {
    struct Keys<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Keys<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("keys recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut keys: &'static [&'static str] = &[];
    let _ = T::deserialize(Keys(&mut keys));
    keys.to_vec()
}

/// docs/configuration.md names every key of the job file, and only those: a key added,
/// renamed or removed in the code and not in the reference (or the reverse) fails here.
#[test]
fn the_reference_names_every_option_and_only_those() {
    use tally_core::declare::{AggregateDecl, ConditionDecl, Declaration, FieldDecl};
    let sections: Vec<(&str, Vec<&str>)> = vec![
        ("job", keys_of::<JobConfig>()),
        ("kafka", keys_of::<KafkaConfig>()),
        ("fields", keys_of::<FieldsConfig>()),
        ("window", keys_of::<WindowConfig>()),
        ("clickhouse", keys_of::<ClickHouseConfig>()),
        ("metrics", keys_of::<MetricsConfig>()),
        ("source", keys_of::<SourceDatabaseConfig>()),
        ("registry", keys_of::<SchemaRegistryConfig>()),
        ("aggregation", keys_of::<Declaration>()),
        ("aggregation.field[]", keys_of::<FieldDecl>()),
        ("aggregation.filter[]", keys_of::<ConditionDecl>()),
        ("aggregation.aggregate[]", keys_of::<AggregateDecl>()),
    ];
    let top = keys_of::<ConfigFile>();
    let known: Vec<&str> = sections.iter().map(|(s, _)| *s).collect();
    assert!(
        top.iter().all(|s| known.contains(s)),
        "a section of the job file this test does not know: {top:?}"
    );
    let mut in_code: std::collections::BTreeSet<String> = sections
        .iter()
        .flat_map(|(section, keys)| keys.iter().map(move |k| format!("{section}.{k}")))
        .collect();
    // A table of its own: documented as `kafka.client.*`.
    assert!(in_code.remove("kafka.client"));
    in_code.insert("kafka.client.*".into());
    let reference = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/configuration.md"
    ))
    .unwrap();
    let in_reference: std::collections::BTreeSet<String> = reference
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    let undocumented: Vec<&String> = in_code.difference(&in_reference).collect();
    let unknown: Vec<&String> = in_reference.difference(&in_code).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "options in the code and not in docs/configuration.md: {undocumented:?}; in the reference and not in the code: {unknown:?}"
    );
    assert!(in_code.len() > 60, "{in_code:?}");
}

#[test]
fn the_effective_settings_read_back_as_the_same_job_and_never_show_a_password() {
    let text = format!(
        "{BASE}retention = \"2h\"\n[window]\nsize = \"90s\"\n[kafka.client]\n\"security.protocol\" = \"ssl\"\n"
    );
    let c = parse(&text, &[]).unwrap();
    let shown = c.effective_toml().unwrap();
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(shown.contains("password = \"***\""), "{shown}");
    assert!(
        shown.contains("size = \"90s\"") && shown.contains("retention = \"2h\""),
        "{shown}"
    );
    assert!(shown.contains("dedup_horizon = \"1h\""), "{shown}");
    assert!(
        shown.find("[job]") < shown.find("[kafka]"),
        "in the file's order: {shown}"
    );

    let again = parse(&shown, &[]).unwrap();
    assert_eq!(again.effective_toml().unwrap(), shown);
    assert_eq!(again.clickhouse.retention, Some(Millis(7_200_000)));
    assert_eq!(
        again
            .kafka
            .client
            .get("security.protocol")
            .map(String::as_str),
        Some("ssl")
    );
}

#[test]
fn durations_show_in_the_largest_unit_that_holds_them() {
    let shown = |ms| toml::Value::try_from(Millis(ms)).unwrap().to_string();
    assert_eq!(shown(0), "\"0s\"");
    assert_eq!(shown(1_500), "\"1500ms\"");
    assert_eq!(shown(120_000), "\"2m\"");
    assert_eq!(shown(86_400_000), "\"24h\"");
    for ms in [0, 1, 999, 1_000, 61_000, 3_600_000, 90_000_000] {
        let text = toml::Value::try_from(Millis(ms)).unwrap();
        assert_eq!(Millis::parse(text.as_str().unwrap()), Ok(Millis(ms)));
    }
}

/// `job.version` is 1 when absent; `job.restate_from` is an RFC 3339 time, and only a new
/// version restates: each mistake names its key.
#[test]
fn a_version_and_its_restatement_are_checked_naming_the_key() {
    let c = parse(BASE, &[]).unwrap();
    assert_eq!((c.job.version, c.restate_from_ms()), (1, None));
    let c = parse(
        BASE,
        &[
            ("TALLY_JOB__VERSION", "2"),
            ("TALLY_JOB__RESTATE_FROM", "2026-12-01T00:00:00Z"),
        ],
    )
    .unwrap();
    assert_eq!(c.job.version, 2);
    assert_eq!(c.restate_from_ms(), Some(1_796_083_200_000));
    let err = refusal(BASE, &[("TALLY_JOB__VERSION", "0")]);
    assert!(err.contains("job.version: must be 1 or more"), "{err}");
    let err = refusal(
        BASE,
        &[
            ("TALLY_JOB__VERSION", "2"),
            ("TALLY_JOB__RESTATE_FROM", "yesterday"),
        ],
    );
    assert!(
        err.contains("job.restate_from: \"yesterday\" is not an RFC 3339 time"),
        "{err}"
    );
    let err = refusal(BASE, &[("TALLY_JOB__RESTATE_FROM", "2026-12-01T00:00:00Z")]);
    assert!(
        err.contains("job.restate_from: only a new version"),
        "{err}"
    );
    // Version 1 is not recorded in the identity: deployed jobs keep theirs.
    assert!(
        !crate::identity::JobIdentity::of(&parse(BASE, &[]).unwrap())
            .rules
            .contains_key("job.version")
    );
    assert_eq!(crate::identity::JobIdentity::of(&c).version(), 2);
}
