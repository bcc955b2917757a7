use std::time::Duration;

use crate::config::Config;

/// A job of two ClickHouse replicas on a cluster, its intervals and names not the defaults.
const JOB: &str = r#"
[job]
name = "shop"
state_dir = "/tmp/shop"
session_timeout = "12s"
tasks = 3
[kafka]
brokers = "k1:9092,k2:9092"
source_topic = "orders"
consumer_group = "g"
registry_topic = "jobs"
topic_replication_factor = 3
[kafka.client]
"client.id" = "shop"
[window]
size = "5m"
[clickhouse]
url = "http://ch1:8123, http://ch2:8123"
cluster = "two"
table = "shop_view"
fold_interval = "20s"
retention = "30d"
"#;

fn config() -> Config {
    Config::parse("shop.toml", JOB, &[]).expect("the job parses")
}

/// Resolved once, each part's settings are what the file's helpers derive.
#[test]
fn the_settings_are_what_the_file_says() {
    let c = config();
    let s = c.resolve().expect("a JSON job resolves");
    assert_eq!(s.name, "shop");
    assert_eq!(s.source.source_topic, "orders");
    assert_eq!(s.source.consumer_group, "g");
    assert_eq!(
        format!("{:?}", s.source.kafka),
        format!("{:?}", c.kafka_settings())
    );
    let urls: Vec<&str> = s.replicas.iter().map(|r| r.url.as_str()).collect();
    assert_eq!(urls, ["http://ch1:8123", "http://ch2:8123"]);
    assert_eq!(
        format!("{:?}", s.replicas),
        format!("{:?}", c.replica_settings())
    );
    let r = &s.read_side;
    assert_eq!(format!("{:?}", r.replicas), format!("{:?}", s.replicas));
    assert!(r.cluster);
    assert_eq!(r.lease_duration, Duration::from_secs(12));
    assert_eq!(r.fold_interval, Duration::from_secs(20));
    assert_eq!(
        format!("{:?}", r.fold_rules),
        format!("{:?}", c.fold_rules())
    );
    assert_eq!(r.fold_rules.window_size_ms, 300_000);
    assert_eq!(r.holder_dir, std::path::Path::new("/tmp/shop"));
    let i = &s.identity;
    assert_eq!(i.registry_topic, "jobs");
    assert_eq!(i.replication_factor, Some(3));
    assert_eq!(i.identity, crate::identity::JobIdentity::of(&c));
    assert_eq!(format!("{:?}", i.replicas), format!("{:?}", s.replicas));
}

/// The identity is recorded byte for byte as before: a rule written otherwise is a job whose
/// workers refuse to start ("rules differ").
#[test]
fn the_identity_s_rules_keep_their_bytes() {
    let rules = config()
        .resolve()
        .expect("resolves")
        .identity
        .identity
        .rules;
    assert_eq!(rules["window.size"], "300000ms");
    assert_eq!(rules["kafka.transactional_id"], "tally-shop");
    assert_eq!(rules["clickhouse.table"], "tally.shop_view");
    assert_eq!(rules["job.tasks"], "3");
}

/// A job off a cluster, without folding.
#[test]
fn one_server_without_folding() {
    let text = JOB
        .replace(
            "url = \"http://ch1:8123, http://ch2:8123\"",
            "url = \"http://ch1:8123\"",
        )
        .replace("cluster = \"two\"\n", "")
        .replace("fold_interval = \"20s\"", "fold_interval = \"0s\"");
    let s = Config::parse("shop.toml", &text, &[])
        .unwrap()
        .resolve()
        .expect("resolves");
    assert_eq!(s.replicas.len(), 1);
    assert!(!s.read_side.cluster);
    assert!(s.read_side.fold_interval.is_zero());
}

/// The parts the worker runs with: tally's own topics, the operator's and the commit
/// protocol's settings, each task's directory, transactional id and partitions.
#[test]
fn the_worker_s_parts_and_its_tasks() {
    let c = config();
    let s = c.resolve().expect("a JSON job resolves");
    assert_eq!(s.topics.dead_letters, "orders.dlq");
    assert_eq!(s.topics.changelog, "g-changelog");
    assert_eq!(s.topics.lease, "g-lease");
    assert_eq!(s.topics.replication_factor, Some(3));
    assert_eq!(s.sink.url, "http://ch1:8123");
    assert_eq!(s.consume.operator, c.operator());
    assert_eq!(s.consume.checkpoint_interval, Duration::from_secs(5));
    assert_eq!(s.consume.max_epochs_in_flight, 2);
    assert_eq!(s.commit.window_size_ms, 300_000);
    assert_eq!(
        (s.commit.database.as_str(), s.commit.table.as_str()),
        ("tally", "shop_view")
    );
    assert_eq!(s.session_timeout, Duration::from_secs(12));
    assert_eq!(s.tasks, 3);
    // The state identity names the task, never the directory: a restore may point the
    // directory elsewhere (doctor's restore check does).
    let t = s.task(2);
    assert_eq!(t.state_dir, std::path::Path::new("/tmp/shop/task-2"));
    assert_eq!(t.transactional_id, "tally-shop-task-2");
    assert_eq!(t.state_identity, "shop@orders#task-2");
    assert_eq!(
        (0..9).filter(|p| t.owns(*p)).collect::<Vec<_>>(),
        vec![2, 5, 8]
    );
    let w = s.whole();
    assert_eq!(
        (
            w.state_dir.as_path(),
            w.transactional_id.as_str(),
            w.state_identity.as_str()
        ),
        (
            std::path::Path::new("/tmp/shop"),
            "tally-shop",
            "shop@orders"
        )
    );
    assert!((0..9).all(|p| w.owns(p)));
}

/// Version 2 runs in resources of its own, named after version 1's; the job's view and the
/// identity's names stay the file's.
#[test]
fn a_new_version_has_resources_of_its_own() {
    let v2 = Config::parse(
        "shop.toml",
        JOB,
        &[
            ("TALLY_JOB__VERSION".into(), "2".into()),
            (
                "TALLY_JOB__RESTATE_FROM".into(),
                "2026-12-01T00:00:00Z".into(),
            ),
        ],
    )
    .expect("version 2 parses");
    let s = v2.resolve().expect("resolves");
    assert_eq!(s.source.consumer_group, "g-v2");
    assert_eq!(s.topics.changelog, "g-v2-changelog");
    assert_eq!(s.topics.lease, "g-v2-lease");
    assert_eq!(s.topics.dead_letters, "orders.dlq.v2");
    assert_eq!(s.state_dir, std::path::PathBuf::from("/tmp/shop/v2"));
    assert_eq!(s.sink.table, "shop_view__v2");
    assert_eq!(s.view, "shop_view");
    let task = s.task(1);
    assert_eq!(task.transactional_id, "tally-shop-v2-task-1");
    assert_eq!(
        task.state_dir,
        std::path::PathBuf::from("/tmp/shop/v2/task-1")
    );
    assert_eq!(task.state_identity, "shop@orders/v2#task-1");
    // It reads from restate_from less a window, out_of_orderness (default 5 s) and lateness
    // (default 60 s), by record time.
    let from = tally_core::time::parse_rfc3339_ms("2026-12-01T00:00:00Z").unwrap_or_default();
    assert_eq!(
        s.consume.start_from,
        tally_kafka::StartFrom::Time(from - 300_000 - 5_000 - 60_000)
    );
    assert!(s.consume.rebuilds);
    assert_eq!(s.consume.operator.windows_from_ms, Some(from));
    let rules = &s.identity.identity.rules;
    assert_eq!(rules["kafka.consumer_group"], "g");
    assert_eq!(rules["kafka.dlq_topic"], "orders.dlq");
    assert_eq!(rules["job.version"], "2");
    assert_eq!(rules["job.restate_from"], "2026-12-01T00:00:00Z");
    // Version 1 keeps today's names, and starts where job.start_from says.
    let v1 = config().resolve().expect("resolves");
    assert_eq!(
        (v1.source.consumer_group.as_str(), v1.sink.table.as_str()),
        ("g", "shop_view")
    );
    assert_eq!(v1.consume.start_from, tally_kafka::StartFrom::Earliest);
    assert!(!v1.consume.rebuilds);
    assert!(
        v1.read_side.takeover.is_none(),
        "version 1 takes nothing over"
    );
    // Version 2 takes the job's view over from whichever earlier version holds it: it knows
    // what each owns, by the same file's names.
    let t = s
        .read_side
        .takeover
        .as_ref()
        .expect("a new version takes over");
    assert_eq!(
        (t.view.as_str(), t.own_view.as_str()),
        ("shop_view", "shop_view__v2")
    );
    assert_eq!(t.restate_from_ms, Some(from));
    let v1_owns = &t.earlier[&1];
    assert_eq!(
        v1_owns,
        &crate::settings::VersionResources {
            consumer_group: "g".into(),
            changelog_topic: "g-changelog".into(),
            lease_topic: "g-lease".into(),
            dead_letters: "orders.dlq".into(),
            table: "shop_view".into(),
            transactional_id: "tally-shop".into(),
        }
    );
    assert_eq!(v1_owns.transactional_ids(1), vec!["tally-shop"]);
    assert_eq!(
        v1_owns.transactional_ids(2),
        vec!["tally-shop-task-0", "tally-shop-task-1"]
    );
    assert!(!t.earlier.contains_key(&2));
    // Held: it rebuilds beside the running version and never takes over.
    let held = Config::parse(
        "shop.toml",
        JOB,
        &[
            ("TALLY_JOB__VERSION".into(), "2".into()),
            ("TALLY_JOB__TAKEOVER".into(), "hold".into()),
        ],
    )
    .expect("parses");
    let held = held.resolve().expect("resolves");
    assert!(held.read_side.takeover.is_none());
    assert_eq!(
        held.identity.identity.rules,
        s.identity
            .identity
            .rules
            .iter()
            .filter(|(k, _)| *k != "job.restate_from")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        "job.takeover is not one of the rules"
    );
}
