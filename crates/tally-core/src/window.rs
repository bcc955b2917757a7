//! Tumbling event-time windows and per-partition watermarks.

use serde::{Deserialize, Serialize};

/// Tumbling windows aligned to the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpec {
    pub size_ms: i64,
}

impl WindowSpec {
    pub fn start_of(&self, event_time_ms: i64) -> i64 {
        event_time_ms.div_euclid(self.size_ms) * self.size_ms
    }

    pub fn end_of(&self, event_time_ms: i64) -> i64 {
        self.start_of(event_time_ms) + self.size_ms
    }
}

/// Event-time progress of one partition: the largest valid event time seen, minus the
/// out-of-orderness bound. `None` until the partition has seen a valid event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Watermark {
    pub max_event_time_ms: Option<i64>,
}

impl Watermark {
    pub fn observe(&mut self, event_time_ms: i64) {
        self.max_event_time_ms = Some(
            self.max_event_time_ms
                .map_or(event_time_ms, |m| m.max(event_time_ms)),
        );
    }

    pub fn current(&self, out_of_orderness_ms: i64) -> Option<i64> {
        self.max_event_time_ms.map(|m| m - out_of_orderness_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_exactly_on_a_boundary_opens_the_next_window() {
        let w = WindowSpec { size_ms: 60_000 };
        assert_eq!(w.start_of(60_000), 60_000);
        assert_eq!(w.start_of(59_999), 0);
        assert_eq!(w.end_of(59_999), 60_000);
        assert_eq!(w.end_of(60_000), 120_000);
        assert_eq!(w.start_of(0), 0);
    }

    #[test]
    fn watermark_tracks_the_maximum_minus_the_bound() {
        let mut wm = Watermark::default();
        assert_eq!(wm.current(5_000), None);
        wm.observe(10_000);
        wm.observe(7_000);
        assert_eq!(wm.current(5_000), Some(5_000));
        wm.observe(12_000);
        assert_eq!(wm.current(5_000), Some(7_000));
    }
}
