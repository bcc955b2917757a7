//! A new version's progress through the history it rebuilds: records read out of records to
//! read, the rate over the last minute and the time left (docs/design/restatement.md). Pure:
//! the consumer feeds it offsets every 10 s and emits what it returns.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use tally_core::PartitionId;

use crate::events::RebuildProgress;

/// The window the rate is measured over.
const RATE_WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct Progress {
    /// Where each partition's rebuild began.
    starts: BTreeMap<PartitionId, i64>,
    /// `(when, records read)`, the last minute of them.
    samples: VecDeque<(Instant, u64)>,
}

impl Progress {
    pub fn new(starts: BTreeMap<PartitionId, i64>) -> Progress {
        Progress {
            starts,
            samples: VecDeque::new(),
        }
    }

    /// The progress at `now`, each partition `(next offset, end offset)`: what is read is
    /// counted from its start, what is left up to the end the broker has now.
    pub fn observe(
        &mut self,
        now: Instant,
        offsets: impl IntoIterator<Item = (PartitionId, i64, i64)>,
    ) -> RebuildProgress {
        let (mut read, mut left) = (0u64, 0u64);
        for (p, next, end) in offsets {
            let start = self.starts.get(&p).copied().unwrap_or(next).min(next);
            read += u64::try_from(next - start).unwrap_or(0);
            left += u64::try_from(end - next).unwrap_or(0);
        }
        self.samples.push_back((now, read));
        // The oldest sample kept is the newest at least a minute old.
        while self
            .samples
            .get(1)
            .is_some_and(|(t, _)| now.duration_since(*t) >= RATE_WINDOW)
        {
            self.samples.pop_front();
        }
        let per_second = self.samples.front().and_then(|(t, first)| {
            let secs = now.duration_since(*t).as_secs_f64();
            (secs > 0.0).then(|| read.saturating_sub(*first) as f64 / secs)
        });
        let time_left = match per_second {
            _ if left == 0 => Some(Duration::ZERO),
            Some(rate) if rate > 0.0 => Some(Duration::from_secs_f64(left as f64 / rate)),
            _ => None,
        };
        RebuildProgress {
            read,
            to_read: read + left,
            per_second,
            time_left,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_counts_from_each_start_and_rates_the_last_minute() {
        let mut p = Progress::new(BTreeMap::from([(0, 100), (1, 50)]));
        let t0 = Instant::now();
        let first = p.observe(t0, [(0, 100, 1_100), (1, 50, 1_050)]);
        assert_eq!((first.read, first.to_read), (0, 2_000));
        assert_eq!(first.per_second, None, "one sample has no rate");
        assert_eq!(first.time_left, None);
        let later = p.observe(
            t0 + Duration::from_secs(10),
            [(0, 600, 1_100), (1, 550, 1_150)],
        );
        assert_eq!((later.read, later.to_read), (1_000, 2_100), "the end moved");
        assert_eq!(later.per_second, Some(100.0));
        assert_eq!(later.time_left, Some(Duration::from_secs(11)));
        // Samples older than a minute leave the rate.
        let much_later = p.observe(
            t0 + Duration::from_secs(80),
            [(0, 1_100, 1_100), (1, 1_150, 1_150)],
        );
        assert_eq!(much_later.read, much_later.to_read);
        assert_eq!(much_later.time_left, Some(Duration::ZERO));
        assert_eq!(much_later.per_second, Some(1_100.0 / 70.0));
    }
}
