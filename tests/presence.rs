//! A filter passes what it says, in every format: `config/payments.toml` with an optional
//! `signed_by` field (a nullable union in Avro, an `optional` field in Protobuf, absent or
//! `null` in JSON) and a condition `present = true` or `present = false` on it. `tally loadgen`
//! generates records passing and failing that condition (and the job's other one), with
//! duplicates, late and poison records of every reason mixed in; the worker is killed with
//! SIGKILL in the middle of the stream. `verify` must find the view and the dead-letter topic
//! exactly as the manifest says: a record passing `present = false` is aggregated, not
//! dead-lettered, and each dead letter has the reason the manifest gave it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use common::*;

/// Declares `signed_by` (a string) and the condition `present = <present>` on it; a JSON job
/// reads no registry.
fn declare_signed_by(job: &Job, format: &str, present: bool) {
    let text = std::fs::read_to_string(&job.config).unwrap();
    let mut doc: toml::Table = toml::from_str(&text).unwrap();
    if format == "json" {
        doc.remove("registry");
    }
    let aggregation = doc
        .get_mut("aggregation")
        .and_then(toml::Value::as_table_mut)
        .unwrap();
    let field: toml::Table = toml::from_str("name = \"signed_by\"\ntype = \"string\"").unwrap();
    let condition: toml::Table =
        toml::from_str(&format!("field = \"signed_by\"\npresent = {present}")).unwrap();
    for (key, entry) in [("field", field), ("filter", condition)] {
        aggregation
            .get_mut(key)
            .and_then(toml::Value::as_array_mut)
            .unwrap()
            .push(toml::Value::Table(entry));
    }
    std::fs::write(&job.config, toml::to_string(&doc).unwrap()).unwrap();
}

async fn a_presence_filter_is_exact_through_a_kill_9(format: &str, present: bool) {
    let topic = unique(&format!("shipments_{format}_{present}"));
    create_topic(&topic, 2).await;
    let job = Job::shipped("payments.toml", &topic);
    job.set("aggregation", "format", format);
    declare_signed_by(&job, format, present);
    let manifest_path = job.dir.path().join("manifest.json");
    let manifest = manifest_path.to_str().unwrap().to_owned();

    // check-config takes the job and says what the condition means; loadgen takes it too.
    let (ok, text) = tally_command(&job, "check-config", &[]);
    let says = if present {
        "filter signed_by is present"
    } else {
        "filter signed_by is absent or null (then not read)"
    };
    assert!(ok && text.contains(says), "{text}");
    assert!(
        text.contains("loadgen generates its records by construction"),
        "{text}"
    );

    let (mut worker, loadgen) = declared_stream_through_a_kill_9(&job, &manifest).await;
    let out = loadgen.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let line = verify_exact_then_stop(&job, &mut worker.0, &manifest).await;
    println!("payments ({format}, signed_by present = {present}) after a kill -9: {line}");

    let m = tally_tools::loadgen::Manifest::load(&manifest_path).unwrap();
    assert_eq!(assert_accounting(&job, m.produced), 2);
    assert_fates(&job, &m);
    assert!(
        m.windows.len() > 50 && m.filtered > 1_000,
        "records pass the condition and records fail it: {} windows, {} filtered",
        m.windows.len(),
        m.filtered
    );
    // No dead letter blames the field the filter lets be absent, and every reason the
    // manifest gave is in the topic (verify compared each record's).
    let dead = read_dead_letters(&job.dlq_topic());
    assert_eq!(dead.len() as u64, m.poison + m.late, "{dead:?}");
    let reasons: std::collections::BTreeSet<&str> = dead.iter().map(|d| d.2.as_str()).collect();
    for reason in ["missing_field", "wrong_type", "late"] {
        assert!(reasons.contains(reason), "{reason} in {reasons:?}");
    }
    let (ok, text) = tally_command(&job, "reconcile", &[]);
    assert!(ok && text.contains("reconcile: OK"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn json_present_false_is_exact_through_a_kill_9() {
    a_presence_filter_is_exact_through_a_kill_9("json", false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn json_present_true_is_exact_through_a_kill_9() {
    a_presence_filter_is_exact_through_a_kill_9("json", true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_present_false_is_exact_through_a_kill_9() {
    a_presence_filter_is_exact_through_a_kill_9("avro", false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_present_true_is_exact_through_a_kill_9() {
    a_presence_filter_is_exact_through_a_kill_9("avro", true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn protobuf_present_false_is_exact_through_a_kill_9() {
    a_presence_filter_is_exact_through_a_kill_9("protobuf", false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn protobuf_present_true_is_exact_through_a_kill_9() {
    a_presence_filter_is_exact_through_a_kill_9("protobuf", true).await;
}
