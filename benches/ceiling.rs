//! The machine's ceiling for reading a topic: tally's own source consumer (same client settings,
//! read_committed, same prefetch bound) reads every partition from its first to its last offset
//! and does nothing else. `scripts/bench.sh` runs it on the topic it then gives `tally run`:
//! `cargo bench -p tally --bench ceiling -- --config FILE` (topic and brokers from the config and
//! its `TALLY_*` overrides). Prints `ceiling records=N seconds=S records_per_s=R`.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tally_kafka::SourceConsumer;
use tally_runtime::config::Config;

fn main() -> Result<()> {
    let mut config_path = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--config" => config_path = Some(PathBuf::from(it.next().context("--config FILE")?)),
            // Passed by `cargo bench`.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    let config = Config::load(&config_path.context("--config FILE is required")?)?;
    let group = format!(
        "{}-ceiling-{}",
        config.kafka.consumer_group,
        std::process::id()
    );
    let source =
        SourceConsumer::connect(&config.kafka_settings(), &config.kafka.source_topic, &group)?;
    let mut ends = BTreeMap::new();
    let mut starts = BTreeMap::new();
    for p in source.partitions()? {
        let (low, high) = source.watermarks(p)?;
        if high > low {
            starts.insert(p, low);
            ends.insert(p, high);
        }
    }
    // Transaction markers take offsets too: a partition is done at its last offset, not at a count.
    let total_offsets: i64 = ends.iter().map(|(p, h)| h - starts[p]).sum();
    source.assign(&starts)?;
    let started = Instant::now();
    let (mut records, mut bytes) = (0u64, 0usize);
    let mut last_progress = Instant::now();
    while !ends.is_empty() {
        match source.poll(Duration::from_millis(100))? {
            Some(record) => {
                let record = record.as_record();
                records += 1;
                bytes += record.value.map_or(0, <[u8]>::len);
                if ends
                    .get(&record.partition)
                    .is_some_and(|&end| record.offset + 1 >= end)
                {
                    ends.remove(&record.partition);
                }
                last_progress = Instant::now();
            }
            // The last offsets of a partition may be a transaction marker, never delivered.
            None if last_progress.elapsed() > Duration::from_secs(3) => break,
            None => {}
        }
    }
    let seconds = started.elapsed().as_secs_f64()
        - if ends.is_empty() {
            0.0
        } else {
            last_progress.elapsed().as_secs_f64()
        };
    println!(
        "ceiling records={records} offsets={total_offsets} bytes={bytes} seconds={seconds:.3} records_per_s={:.0}",
        records as f64 / seconds.max(1e-9)
    );
    Ok(())
}
