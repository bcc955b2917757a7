//! Event-time parsing. Times are milliseconds since the Unix epoch (UTC).

use chrono::DateTime;

/// Earliest and latest event times tally accepts: the range of ClickHouse `DateTime`
/// (1970-01-01 .. 2105-12-31), so every window start is representable in the sink.
pub const MIN_EVENT_TIME_MS: i64 = 0;
pub const MAX_EVENT_TIME_MS: i64 = 4_291_747_199_000;

/// Parses RFC 3339 with an explicit offset (`Z` or `±HH:MM`).
pub fn parse_rfc3339_ms(text: &str) -> Option<i64> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.timestamp_millis())
}

pub fn in_range(ms: i64) -> bool {
    (MIN_EVENT_TIME_MS..=MAX_EVENT_TIME_MS).contains(&ms)
}

/// Formats milliseconds as RFC 3339 UTC for messages and reports.
pub fn format_ms(ms: i64) -> String {
    DateTime::from_timestamp_millis(ms)
        .map(|t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
        .unwrap_or_else(|| format!("{ms}ms"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_offsets() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339_ms("1970-01-01T01:00:00+01:00"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2026-11-29T10:00:00.250Z"),
            Some(1_795_946_400_250)
        );
        assert_eq!(parse_rfc3339_ms("2026-11-29 10:00:00"), None);
        assert_eq!(parse_rfc3339_ms("2026-11-29T10:00:00"), None);
        assert_eq!(format_ms(1_795_946_400_250), "2026-11-29T10:00:00.250Z");
    }
}
