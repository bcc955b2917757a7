//! A deterministic stream for a job's declaration with known ground truth, for load tests, demos
//! and chaos runs.
//!
//! Every record's fate is decided by construction, independently of tally's code: valid events
//! are never late (their disorder stays inside the out-of-orderness bound), duplicates re-publish
//! a recent valid event of the same partition within the dedup horizon, late events sit further
//! behind the partition's maximum than window + lateness + out-of-orderness, and poison records
//! are malformed in one specific way each. The manifest is the expected view and dead letters.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use rand::distr::{Distribution, weighted::WeightedIndex};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tally_core::{OperatorConfig, PoisonReason};

use tally_runtime::config::Config;

mod framed;
mod generate;
pub use framed::FramedWriter;
pub use generate::{
    Contribution, Generator, Input, Manifest, ManifestBuilder, Running, Shown, filter_tests,
    produce,
};
pub(crate) use generate::{filtered_value, key_value, random_value};

/// Knobs of the stream.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadSpec {
    pub seed: u64,
    pub partitions: i32,
    pub customers: u32,
    pub currencies: Vec<String>,
    /// Zipf exponent of customer popularity (0 = uniform).
    pub skew: f64,
    pub duplicate_fraction: f64,
    pub poison_fraction: f64,
    pub late_fraction: f64,
    /// Records the job's filter leaves out (each misses one condition).
    #[serde(default)]
    pub filtered_fraction: f64,
    /// Event-time start (ms since epoch) and spacing between consecutive events of a partition,
    /// on average: event time advances by `step_ms / partitions` per record, in every partition
    /// alike (as real time does), however unevenly records fall on partitions.
    pub start_ms: i64,
    pub step_ms: i64,
    /// Records larger than this are generated for the `too_large` reason, unless no default
    /// Kafka client and broker would take such a record (see [`MAX_GENERATED_RECORD_BYTES`]).
    pub max_record_bytes: u64,
}

/// What one generated record is, by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    Valid,
    Duplicate,
    Late,
    Poison(PoisonReason),
    /// Left out by the job's filter.
    Filtered,
}

#[derive(Debug, Clone)]
pub struct GeneratedRecord {
    pub partition: i32,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub kind: Kind,
    /// What a valid event adds to its windows.
    pub contributes: Option<Contribution>,
    /// A late event's time: a new version restating from later counts it as filtered.
    pub late_ms: Option<i64>,
}

struct PartitionClock {
    now: i64,
    max_seen: i64,
    /// Recent valid records (event time, key, value): what duplicates re-publish.
    recent: VecDeque<(i64, Vec<u8>, Vec<u8>)>,
}

/// What a record is to be, drawn before its content.
enum Fate {
    /// Re-publishes this recent valid record (key, value).
    Duplicate(Vec<u8>, Vec<u8>),
    Poison,
    Late,
    Filtered,
    Valid,
}

/// What every generated stream shares: the Zipf choice of a record's key (`spec.customers`
/// of them), its partition, its fate, and each partition's event-time clock.
struct Stream {
    rng: ChaCha8Rng,
    popularity: WeightedIndex<f64>,
    clocks: Vec<PartitionClock>,
    /// Records drawn so far: the stream's clock.
    emitted: i64,
}

impl Stream {
    fn new(spec: &LoadSpec) -> Result<Stream, String> {
        if spec.partitions <= 0 || spec.customers == 0 {
            return Err("partitions and customers must be positive".into());
        }
        let weights: Vec<f64> = (1..=spec.customers)
            .map(|k| 1.0 / f64::from(k).powf(spec.skew))
            .collect();
        Ok(Stream {
            rng: ChaCha8Rng::seed_from_u64(spec.seed),
            popularity: WeightedIndex::new(weights).map_err(|e| e.to_string())?,
            clocks: (0..spec.partitions)
                .map(|_| PartitionClock {
                    now: spec.start_ms,
                    max_seen: i64::MIN,
                    recent: VecDeque::new(),
                })
                .collect(),
            emitted: 0,
        })
    }

    /// The next record's key index, partition and fate; advances the partitions' clocks. A
    /// record is late only once its partition has a valid one, and a duplicate only of a
    /// record within the dedup horizon.
    fn draw(&mut self, spec: &LoadSpec, rules: &OperatorConfig) -> (usize, i32, Fate) {
        let index = self.popularity.sample(&mut self.rng);
        let partition = (index as i32) % spec.partitions;
        let r: f64 = self.rng.random();
        let dup_cut = spec.duplicate_fraction;
        let poison_cut = dup_cut + spec.poison_fraction;
        let late_cut = poison_cut + spec.late_fraction;
        let filtered_cut = late_cut + spec.filtered_fraction;
        self.emitted += 1;
        let now =
            spec.start_ms + self.emitted.saturating_mul(spec.step_ms) / i64::from(spec.partitions);
        let clock = &mut self.clocks[partition as usize];
        clock.now = clock.now.max(now);
        let fate = if r < dup_cut {
            match clock
                .recent
                .get(self.rng.random_range(0..clock.recent.len().max(1)))
            {
                Some((t, key, value)) if t + rules.dedup_horizon_ms > clock.now => {
                    Fate::Duplicate(key.clone(), value.clone())
                }
                _ => Fate::Valid,
            }
        } else if r < poison_cut {
            Fate::Poison
        } else if r < late_cut && clock.max_seen != i64::MIN {
            Fate::Late
        } else if r >= late_cut && r < filtered_cut {
            Fate::Filtered
        } else {
            Fate::Valid
        };
        (index, partition, fate)
    }

    fn now(&self, partition: i32) -> i64 {
        self.clocks[partition as usize].now
    }

    /// An event time behind partition's watermark by more than a window and the lateness:
    /// late by construction.
    fn late_time(&self, partition: i32, rules: &OperatorConfig) -> i64 {
        self.clocks[partition as usize].max_seen
            - rules.out_of_orderness_ms
            - rules.window.size_ms
            - rules.allowed_lateness_ms
            - 1_000
    }

    /// An event time behind the partition's clock by less than `out_of_orderness_ms`: never late.
    fn valid_time(&mut self, partition: i32, out_of_orderness_ms: i64) -> i64 {
        let jitter = if out_of_orderness_ms > 1 {
            self.rng.random_range(0..out_of_orderness_ms)
        } else {
            0
        };
        self.now(partition) - jitter
    }

    /// Records a valid record: it moves the watermark, and duplicates may re-publish it.
    fn remember(&mut self, partition: i32, t: i64, key: &[u8], value: &[u8]) {
        let clock = &mut self.clocks[partition as usize];
        clock.max_seen = clock.max_seen.max(t);
        clock.recent.push_back((t, key.to_vec(), value.to_vec()));
        if clock.recent.len() > 256 {
            clock.recent.pop_front();
        }
    }
}

/// The largest record loadgen produces: a default client sends at most 1,000,000 bytes of
/// message (librdkafka's `message.max.bytes`; a broker takes 1,048,588 by default), less room
/// for the key, headers and framing. With `job.max_record_bytes` at or above it, no record a
/// default cluster accepts is too large for the job, so none is generated.
pub const MAX_GENERATED_RECORD_BYTES: u64 = 999_000;

/// Whether a record over `max_record_bytes` (with its JSON around the padding) still fits
/// [`MAX_GENERATED_RECORD_BYTES`].
pub fn generates_too_large(max_record_bytes: u64) -> bool {
    max_record_bytes.saturating_add(256) <= MAX_GENERATED_RECORD_BYTES
}

pub struct LoadOptions {
    pub events: u64,
    pub rate: Option<u64>,
    pub partitions: i32,
    pub spec: LoadSpec,
    pub manifest: std::path::PathBuf,
}

/// A producer for the job's source topic, the topic created with `partitions` if missing, and
/// the partitions it has.
async fn open_source(config: &Config, partitions: i32) -> Result<(FutureProducer, i32)> {
    let settings = config.kafka_settings();
    let topic = &config.kafka.source_topic;
    if tally_kafka::ensure_topic(&settings, topic, partitions, None, &[]).await? {
        eprintln!("created topic {topic} with {partitions} partitions");
    }
    // A topic just created can be missing from the metadata for a moment: wait for it.
    let until = Instant::now() + Duration::from_secs(15);
    let extent = loop {
        match tally_kafka::topic_extent(&settings, topic) {
            Ok(extent) if !extent.is_empty() || Instant::now() > until => break extent,
            Err(e) if Instant::now() > until => return Err(e.into()),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    let partitions = i32::try_from(extent.len()).context("partition count")?;
    let mut client = settings.client_config();
    client
        .set("enable.idempotence", "true")
        // A message whose delivery is unknown cannot go into the manifest or be sent again
        // (the ground truth would be wrong): wait through broker restarts instead of timing out.
        .set("message.timeout.ms", "0")
        .set("linger.ms", "20")
        .set("batch.num.messages", "10000")
        .set("compression.type", "lz4");
    let producer: FutureProducer = client.create().context("creating producer")?;
    Ok((producer, partitions))
}

/// Sends records (partition, key, value) and returns each one's offset, in order.
async fn send<'a>(
    producer: &FutureProducer,
    topic: &str,
    records: impl Iterator<Item = (i32, &'a [u8], &'a [u8])>,
) -> Result<Vec<i64>> {
    let mut deliveries = Vec::new();
    for (partition, key, value) in records {
        let mut record = FutureRecord::to(topic)
            .partition(partition)
            .key(key)
            .payload(value);
        loop {
            match producer.send_result(record) {
                Ok(f) => {
                    deliveries.push(f);
                    break;
                }
                Err((
                    rdkafka::error::KafkaError::MessageProduction(
                        rdkafka::types::RDKafkaErrorCode::QueueFull,
                    ),
                    back,
                )) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((e, _)) => return Err(e).context("producing"),
            }
        }
    }
    let mut offsets = Vec::with_capacity(deliveries.len());
    for f in deliveries {
        let delivery = f
            .await
            .context("delivery cancelled")?
            .map_err(|(e, _)| e)
            .context("delivery failed")?;
        offsets.push(delivery.offset);
    }
    Ok(offsets)
}

/// Waits until `sent` records at `rate` per second are due.
async fn pace(rate: Option<u64>, sent: u64, started: Instant) {
    if let Some(rate) = rate.filter(|r| *r > 0) {
        let due = Duration::from_secs_f64(sent as f64 / rate as f64);
        if let Some(wait) = due.checked_sub(started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Records produced per chunk: delivery is awaited, and the manifest written, chunk by chunk.
const CHUNK: u64 = 5_000;

/// Produces `events` records drawn by `next` at `rate` per second, and hands each to `note`
/// with its offset once delivered; flushes at the end.
async fn produce_all(
    producer: &FutureProducer,
    topic: &str,
    (events, rate): (u64, Option<u64>),
    mut next: impl FnMut() -> GeneratedRecord,
    mut note: impl FnMut(&GeneratedRecord, i64),
) -> Result<()> {
    let started = Instant::now();
    let mut sent = 0u64;
    while sent < events {
        let n = CHUNK.min(events - sent);
        let drawn: Vec<GeneratedRecord> = (0..n).map(|_| next()).collect();
        let offsets = send(
            producer,
            topic,
            drawn
                .iter()
                .map(|r| (r.partition, r.key.as_slice(), r.value.as_slice())),
        )
        .await?;
        for (d, offset) in drawn.iter().zip(offsets) {
            note(d, offset);
        }
        sent += n;
        pace(rate, sent, started).await;
    }
    producer
        .flush(Duration::from_secs(30))
        .context("flushing")?;
    Ok(())
}

/// The operator's view of a generated stream, for the tests that hold it against a manifest.
#[cfg(test)]
pub(crate) struct OperatorRun {
    /// Per source partition and window, the newest value a checkpoint wrote.
    pub latest: std::collections::BTreeMap<(i32, tally_core::WindowKey), tally_core::WindowAgg>,
    /// (partition, offset, reason) of every dead letter.
    pub dead: std::collections::BTreeSet<(i32, i64, PoisonReason)>,
    /// The last checkpoint's accounting, summed over partitions.
    pub totals: tally_core::Accounting,
}

/// Runs `n` records drawn by `next` through a fresh operator with a checkpoint every 997
/// records and at the end, handing each record to `note` with the offset it gets in its
/// partition.
#[cfg(test)]
pub(crate) fn run_through_operator(
    rules: OperatorConfig,
    program: impl Into<tally_core::Program>,
    n: usize,
    mut next: impl FnMut() -> GeneratedRecord,
    mut note: impl FnMut(&GeneratedRecord, i64),
) -> OperatorRun {
    use tally_core::{CheckpointBarrier, MemStore, Record, WindowOperator};
    let mut op = WindowOperator::restore(
        rules,
        program,
        tally_core::Epoch(0),
        &std::collections::BTreeMap::new(),
    );
    let mut store = MemStore::default();
    let mut offsets: std::collections::BTreeMap<i32, i64> = Default::default();
    let mut run = OperatorRun {
        latest: Default::default(),
        dead: Default::default(),
        totals: Default::default(),
    };
    for i in 0..n {
        let r = next();
        let next_offset = offsets.entry(r.partition).or_default();
        let offset = *next_offset;
        *next_offset += 1;
        note(&r, offset);
        let Ok(_) = op.process(
            &store,
            Record {
                partition: r.partition,
                offset,
                timestamp_ms: None,
                key: Some(&r.key),
                value: Some(&r.value),
            },
        );
        if i % 997 == 0 || i + 1 == n {
            let cp = op.handle_checkpoint(CheckpointBarrier {
                epoch: op.current_epoch(),
                is_final: false,
            });
            store.apply(&cp);
            for row in &cp.rows {
                run.latest
                    .insert((row.partition, row.key.clone()), row.value.clone());
            }
            for d in &cp.dead_letters {
                run.dead.insert((d.partition, d.offset, d.reason));
            }
            if i + 1 == n {
                for c in cp.partitions.values() {
                    run.totals.add(&c.totals);
                }
            }
        }
    }
    run
}
