//! The dead-letter topic read back by source position, and compared with the dead letters a
//! manifest expects.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, bail};
use rdkafka::Message;
use rdkafka::message::Headers;
use tally_core::PoisonReason;
use tally_kafka::{HEADER_REASON, HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION};

use tally_runtime::config::Config;

/// The dead-letter topic against the dead letters expected.
pub(crate) struct DeadLetterDiff {
    missing: Vec<(i32, i64)>,
    repeated: Vec<(i32, i64)>,
    extra: Vec<(i32, i64)>,
    wrong_reason: Vec<(i32, i64)>,
    /// Dead letters in the topic, repeats included.
    found: usize,
}

impl DeadLetterDiff {
    pub(crate) fn compare(
        expected: &BTreeMap<(i32, i64), PoisonReason>,
        found: &BTreeMap<(i32, i64), Vec<String>>,
    ) -> DeadLetterDiff {
        let mut diff = DeadLetterDiff {
            missing: Vec::new(),
            repeated: Vec::new(),
            extra: Vec::new(),
            wrong_reason: Vec::new(),
            found: found.values().map(Vec::len).sum(),
        };
        for (k, reason) in expected {
            match found.get(k) {
                None => diff.missing.push(*k),
                Some(reasons) if reasons.iter().any(|r| r != reason.as_str()) => {
                    diff.wrong_reason.push(*k)
                }
                Some(_) => {}
            }
        }
        for (k, reasons) in found {
            if reasons.len() > 1 {
                diff.repeated.push(*k);
            }
            if !expected.contains_key(k) {
                diff.extra.push(*k);
            }
        }
        diff
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.missing.is_empty()
            && self.repeated.is_empty()
            && self.extra.is_empty()
            && self.wrong_reason.is_empty()
    }

    pub(crate) fn print_summary(&self) {
        println!(
            "dead letters missing {}, repeated {}, extra {}, wrong reason {}",
            self.missing.len(),
            self.repeated.len(),
            self.extra.len(),
            self.wrong_reason.len()
        );
    }

    pub(crate) fn print_first(&self, limit: usize) {
        for (p, o) in self.missing.iter().take(limit) {
            println!("  dead letter missing  {p}/{o}");
        }
        for (p, o) in self.repeated.iter().take(limit) {
            println!("  dead letter repeated {p}/{o}");
        }
    }

    pub(crate) fn found(&self) -> usize {
        self.found
    }

    /// The `verify-summary` fields of the dead letters.
    pub(crate) fn summary_fields(&self, expected: usize) -> String {
        format!(
            "dl_expected={expected} dl_found={} dl_repeated={} dl_missing={}",
            self.found,
            self.repeated.len(),
            self.missing.len()
        )
    }
}

/// Dead letters as (source partition, source offset) → reasons found (more than one = repeated).
pub fn read_dead_letters(config: &Config) -> Result<BTreeMap<(i32, i64), Vec<String>>> {
    let settings = config.kafka_settings();
    let topic = config.dlq_topic();
    let extent = tally_kafka::topic_extent(&settings, &topic)?;
    let ranges = extent
        .iter()
        .map(|(p, (low, _))| (*p, (*low, None)))
        .collect();
    let mut out: BTreeMap<(i32, i64), Vec<String>> = BTreeMap::new();
    let mut malformed = 0u64;
    tally_kafka::read_committed_range(&settings, &topic, &ranges, Duration::from_secs(60), |m| {
        let get = |name: &str| {
            m.headers().and_then(|h| {
                h.iter()
                    .find(|x| x.key == name)
                    .and_then(|x| x.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
            })
        };
        let p = get(HEADER_SOURCE_PARTITION).and_then(|v| v.parse().ok());
        let o = get(HEADER_SOURCE_OFFSET).and_then(|v| v.parse().ok());
        match (p, o) {
            (Some(p), Some(o)) => out
                .entry((p, o))
                .or_default()
                .push(get(HEADER_REASON).unwrap_or_default()),
            _ => malformed += 1,
        }
    })?;
    if malformed > 0 {
        bail!("{malformed} records in {topic} lack tally.source.partition/offset headers");
    }
    Ok(out)
}
