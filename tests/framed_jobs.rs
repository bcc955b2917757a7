//! Jobs reading Avro and Protobuf in the Confluent wire format, against the real schema
//! registry (Apicurio, its Confluent-compatible API), Kafka and ClickHouse: `config/payments.toml`
//! as shipped (Avro) and as Protobuf. `tally loadgen` registers three schemas under the topic's
//! subject and changes schema mid-stream (a field added and an int widened, then a field
//! removed), with poison of every kind of the wire format mixed in; the worker is killed with
//! SIGKILL in the middle of the stream and started again. `verify` must find the view and the
//! dead-letter topic exactly as the manifest says, every offset accounted for once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::collections::BTreeSet;

use common::*;

async fn a_framed_job_is_exact_after_a_kill_9(format: &str) {
    let topic = unique(&format!("payments_{format}"));
    create_topic(&topic, 2).await;
    let job = Job::shipped("payments.toml", &topic);
    job.set("aggregation", "format", format);
    let manifest_path = job.dir.path().join("manifest.json");
    let manifest = manifest_path.to_str().unwrap().to_owned();

    // Before any schema: nothing to check against yet, which check-config says.
    let (ok, text) = tally_command(&job, "check-config", &[]);
    assert!(ok && text.contains("has no schema yet"), "{text}");

    let (mut worker, loadgen) = declared_stream_through_a_kill_9(&job, &manifest).await;
    let out = loadgen.wait_with_output().unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: BTreeSet<&str> = printed
        .lines()
        .find(|l| l.contains("a field added, then one removed"))
        .unwrap_or_else(|| panic!("loadgen names its schemas: {printed}"))
        .split("schema ids ")
        .nth(1)
        .unwrap()
        .split(" (")
        .next()
        .unwrap()
        .split(", ")
        .collect();
    assert_eq!(ids.len(), 3, "three schemas in the stream: {printed}");

    let line = verify_exact_then_stop(&job, &mut worker.0, &manifest).await;
    println!("payments ({format}) after a kill -9 and two schema changes: {line}");

    let m = tally_tools::loadgen::Manifest::load(&manifest_path).unwrap();
    assert_eq!(assert_accounting(&job, m.produced), 2);
    assert_fates(&job, &m);
    // Every fault of the wire format and of the schemas reached the dead-letter topic with its
    // reason (verify compared each with the manifest).
    let reasons: BTreeSet<String> = read_dead_letters(&job.dlq_topic())
        .into_iter()
        .map(|d| d.2)
        .collect();
    for reason in [
        "wire_format",
        "undecodable",
        "unknown_schema",
        "missing_field",
        "wrong_type",
        "invalid_time",
    ] {
        assert!(reasons.contains(reason), "{reason} in {reasons:?}");
    }
    // Each schema id was fetched once per process (the worker ran twice).
    let fetched = job.log().matches("fetched a writer schema").count();
    assert!(
        (6..=12).contains(&fetched),
        "each id fetched once per process: {fetched}\n{}",
        job.log()
    );

    // The source recomputed through the declaration (and the registry) agrees with the view.
    let (ok, text) = tally_command(&job, "reconcile", &[]);
    assert!(ok && text.contains("reconcile: OK"), "{text}");
    // The latest schema (the third) holds every declared field.
    let (ok, text) = tally_command(&job, "check-config", &[]);
    assert!(ok && text.contains("holds every declared field"), "{text}");
    // The worker stopped right after its last commit: fold what became final since its last
    // fold step, as a stopped job's operator would, so that doctor sees folding caught up.
    let (ok, text) = tally_command(&job, "fold", &[]);
    assert!(ok, "{text}");
    let (ok, report) = doctor(&job);
    assert!(ok, "{report}");
    for hop in [
        "Persisted → Processed",
        "Processed → Written",
        "Written → Queryable",
        "Queryable → Reported",
    ] {
        assert_eq!(status_of(&report, hop), "PASS", "{hop}: {report}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_avro_job_is_exact_through_a_kill_9_and_schema_changes() {
    a_framed_job_is_exact_after_a_kill_9("avro").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_protobuf_job_is_exact_through_a_kill_9_and_schema_changes() {
    a_framed_job_is_exact_after_a_kill_9("protobuf").await;
}

/// A declared field the subject's latest schema lacks: check-config names it and fails.
#[tokio::test(flavor = "multi_thread")]
async fn check_config_names_a_field_the_latest_schema_lacks() {
    let topic = unique("payments_check");
    let job = Job::shipped("payments.toml", &topic);
    let subject = format!("{topic}-value");
    let schema = r#"{"type":"record","name":"P","fields":[{"name":"payment_id","type":"string"}]}"#;
    let registry =
        tally_runtime::schemas::SchemaRegistry::new(&tally_runtime::config::SchemaRegistryConfig {
            url: Some("http://127.0.0.1:8081/apis/ccompat/v7".into()),
            ..Default::default()
        })
        .unwrap();
    registry.register(&subject, schema, "AVRO").await.unwrap();
    let (ok, text) = tally_command(&job, "check-config", &[]);
    assert!(!ok, "{text}");
    for named in [
        "captured_at",
        "merchant.id",
        "amount.value",
        "risk.score",
        "does not hold",
    ] {
        assert!(text.contains(named), "{named}: {text}");
    }
}

/// The table "Which evolutions the registry takes" in docs/formats.md, checked against the
/// local registry: each evolution registered after its first schema under a subject of each
/// compatibility level, passing or refused as the table says.
#[tokio::test(flavor = "multi_thread")]
async fn the_registry_takes_the_evolutions_formats_md_says() {
    let avro = |fields: &[&str]| {
        format!(
            r#"{{"type":"record","name":"E","fields":[{}]}}"#,
            fields.join(",")
        )
    };
    let (id, n, note) = (
        r#"{"name":"id","type":"string"}"#,
        r#"{"name":"n","type":"int"}"#,
        r#"{"name":"note","type":["null","string"],"default":null}"#,
    );
    let proto = |body: &str| format!("syntax = \"proto3\";\nmessage E {{\n{body}\n}}\n");
    let first = (
        avro(&[id, n, note]),
        proto("string id = 1; int32 n = 2; string note = 3;"),
    );
    // Each row's first cell names its evolution: (Avro, Protobuf) schema after the first.
    let evolutions: Vec<(&str, Option<String>, Option<String>)> = vec![
        (
            "a field added (Avro: nullable, with a default)",
            Some(avro(&[
                id,
                n,
                note,
                r#"{"name":"c","type":["null","string"],"default":null}"#,
            ])),
            Some(proto(
                "string id = 1; int32 n = 2; string note = 3; string c = 4;",
            )),
        ),
        (
            "a field added without a default",
            Some(avro(&[id, n, note, r#"{"name":"c","type":"string"}"#])),
            None,
        ),
        (
            "a field removed",
            Some(avro(&[id, n])),
            Some(proto("string id = 1; int32 n = 2;")),
        ),
        (
            "a field removed, its number and name reserved",
            None,
            Some(proto(
                "string id = 1; int32 n = 2; reserved 3; reserved \"note\";",
            )),
        ),
        (
            "an int widened to a long (Protobuf: int32 to int64)",
            Some(avro(&[id, r#"{"name":"n","type":"long"}"#, note])),
            Some(proto("string id = 1; int64 n = 2; string note = 3;")),
        ),
        (
            "a union gains a branch",
            Some(avro(&[
                id,
                n,
                r#"{"name":"note","type":["null","string","long"],"default":null}"#,
            ])),
            None,
        ),
        (
            "a field's type changed (string to int)",
            Some(avro(&[r#"{"name":"id","type":"int"}"#, n, note])),
            Some(proto("int32 id = 1; int32 n = 2; string note = 3;")),
        ),
    ];
    let doc = std::fs::read_to_string(format!(
        "{}/../../docs/formats.md",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let table: Vec<Vec<String>> = doc
        .split("## Which evolutions the registry takes")
        .nth(1)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| evolution"))
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .take_while(|cells: &Vec<String>| cells.len() == 5)
        .collect();
    assert_eq!(
        table.len(),
        evolutions.len(),
        "one row per evolution: {table:?}"
    );
    let registry =
        tally_runtime::schemas::SchemaRegistry::new(&tally_runtime::config::SchemaRegistryConfig {
            url: Some("http://127.0.0.1:8081/apis/ccompat/v7".into()),
            ..Default::default()
        })
        .unwrap();
    let mut checked = 0;
    for (name, avro_after, proto_after) in &evolutions {
        let row = table
            .iter()
            .find(|r| r[0] == *name)
            .unwrap_or_else(|| panic!("docs/formats.md has no row {name:?}"));
        let trials = [
            ("AVRO", &first.0, avro_after, "BACKWARD", &row[1]),
            ("AVRO", &first.0, avro_after, "NONE", &row[2]),
            ("PROTOBUF", &first.1, proto_after, "BACKWARD", &row[3]),
            ("PROTOBUF", &first.1, proto_after, "NONE", &row[4]),
        ];
        for (kind, before, after, level, says) in trials {
            let Some(after) = after else {
                assert_eq!(says, "—", "{name}: {kind} has no such evolution");
                continue;
            };
            let subject = unique("evolution");
            registry.set_compatibility(&subject, level).await.unwrap();
            registry.register(&subject, before, kind).await.unwrap();
            let taken = registry.register(&subject, after, kind).await;
            let found = if taken.is_ok() { "passes" } else { "refused" };
            assert_eq!(
                found, says,
                "{name}, {kind} under {level}: the registry answered {taken:?}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 22, "every cell but the dashes");
}
