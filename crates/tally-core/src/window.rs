//! Tumbling and hopping event-time windows and per-partition watermarks.

use serde::{Deserialize, Serialize};

/// Windows of `size_ms` starting every `slide_ms`, aligned to the Unix epoch: tumbling when the
/// slide is the size, hopping when it divides it (the declaration checks that it does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpec {
    pub size_ms: i64,
    pub slide_ms: i64,
}

impl WindowSpec {
    pub const fn tumbling(size_ms: i64) -> WindowSpec {
        WindowSpec {
            size_ms,
            slide_ms: size_ms,
        }
    }

    /// Start of the newest window holding `event_time_ms` (its only one, when tumbling).
    pub fn start_of(&self, event_time_ms: i64) -> i64 {
        event_time_ms.div_euclid(self.slide_ms) * self.slide_ms
    }

    /// End of the newest window holding `event_time_ms`: the last of its windows to close.
    pub fn end_of(&self, event_time_ms: i64) -> i64 {
        self.start_of(event_time_ms) + self.size_ms
    }

    /// Starts of the windows holding `event_time_ms`, newest first: `size / slide` of them.
    pub fn starts_of(&self, event_time_ms: i64) -> impl Iterator<Item = i64> + use<> {
        let WindowSpec { size_ms, slide_ms } = *self;
        let newest = self.start_of(event_time_ms);
        (0..size_ms / slide_ms)
            .map(move |i| newest - i * slide_ms)
            .take_while(move |start| *start > event_time_ms - size_ms)
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
        let w = WindowSpec::tumbling(60_000);
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
