//! Proves the test harness talks to the real services: a Kafka transactional round trip read
//! back with read_committed, and a ClickHouse create/insert/select through the `clickhouse` crate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

mod common;

use std::time::Duration;

use common::{BROKERS, clickhouse, create_topic, unique};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};

fn read_all(topic: &str, isolation: &str, expect_at_least: usize) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("group.id", unique("harness"))
        .set("isolation.level", isolation)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < until && out.len() < expect_at_least + 2 {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            out.push(String::from_utf8_lossy(m.payload().unwrap_or_default()).into_owned());
        } else if out.len() >= expect_at_least
            && std::time::Instant::now() + Duration::from_secs(8) > until
        {
            break;
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_transactions_are_visible_to_read_committed_only_when_committed() {
    let topic = unique("harness");
    create_topic(&topic, 1).await;
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", BROKERS)
        .set("transactional.id", unique("harness-tx"))
        .create()
        .unwrap();
    producer.init_transactions(Duration::from_secs(30)).unwrap();
    producer.begin_transaction().unwrap();
    producer
        .send(BaseRecord::<(), str>::to(&topic).payload("aborted"))
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
    producer.abort_transaction(Duration::from_secs(10)).unwrap();
    producer.begin_transaction().unwrap();
    producer
        .send(BaseRecord::<(), str>::to(&topic).payload("committed"))
        .map_err(|(e, _)| e)
        .unwrap();
    producer
        .commit_transaction(Duration::from_secs(10))
        .unwrap();

    let committed = read_all(&topic, "read_committed", 1);
    assert_eq!(committed, vec!["committed".to_string()]);
    let uncommitted = read_all(&topic, "read_uncommitted", 2);
    assert_eq!(
        uncommitted,
        vec!["aborted".to_string(), "committed".to_string()]
    );
}

#[derive(Debug, serde::Serialize, serde::Deserialize, clickhouse::Row, PartialEq)]
struct Row {
    id: u64,
    name: String,
    amount: i64,
}

#[tokio::test(flavor = "multi_thread")]
async fn clickhouse_round_trip() {
    let db = unique("harness");
    let client = clickhouse();
    let version: String = client.query("SELECT version()").fetch_one().await.unwrap();
    assert!(!version.is_empty());
    client
        .query(&format!("CREATE DATABASE {db}"))
        .execute()
        .await
        .unwrap();
    client
        .query(&format!("CREATE TABLE {db}.t (id UInt64, name String, amount Decimal(18, 4)) ENGINE = MergeTree ORDER BY id"))
        .execute()
        .await
        .unwrap();
    let mut insert = client
        .clone()
        .with_database(&db)
        .insert::<Row>("t")
        .await
        .unwrap();
    for id in 0..3u64 {
        insert
            .write(&Row {
                id,
                name: format!("n{id}"),
                amount: id as i64 * 12_345,
            })
            .await
            .unwrap();
    }
    insert.end().await.unwrap();
    let rows: Vec<Row> = client
        .query(&format!("SELECT id, name, amount FROM {db}.t ORDER BY id"))
        .fetch_all()
        .await
        .unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(
        rows[2],
        Row {
            id: 2,
            name: "n2".into(),
            amount: 24_690
        }
    );
    let total: String = client
        .query(&format!("SELECT toString(sum(amount)) FROM {db}.t"))
        .fetch_one()
        .await
        .unwrap();
    assert_eq!(total, "3.7035");
    // An error in the middle of a query is reported, not lost.
    let err = client
        .query("SELECT throwIf(number = 3) FROM system.numbers LIMIT 10")
        .fetch_all::<u8>()
        .await;
    assert!(err.is_err());
    client
        .query(&format!("DROP DATABASE {db}"))
        .execute()
        .await
        .unwrap();
}
