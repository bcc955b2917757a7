//! Day partitions of the folded table (`YYYYMMDD`, UTC) as seconds, and the day before one.

/// End (exclusive, seconds since the epoch, UTC) of a `YYYYMMDD` day.
pub(crate) fn day_end_seconds(day: &str) -> Option<i64> {
    let n: i64 = day.parse().ok()?;
    let (y, m, d) = (n / 10_000, (n / 100) % 100, n % 100);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    Some((days_from_civil(y, m, d) + 1) * 86_400)
}

/// The `YYYYMMDD` day before `day`, if `day` is one.
pub(crate) fn previous_day(day: &str) -> Option<String> {
    let end = day_end_seconds(day)?;
    let (y, m, d) = civil_from_days(end / 86_400 - 2);
    Some(format!("{y:04}{m:02}{d:02}"))
}

/// The proleptic Gregorian date of a day since 1970-01-01 (inverse of [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_day_before_crosses_months_years_and_leap_days() {
        for (day, before) in [
            ("20260921", "20260920"),
            ("20260301", "20260228"),
            ("20240301", "20240229"),
            ("20270101", "20261231"),
            ("19700102", "19700101"),
        ] {
            assert_eq!(previous_day(day).as_deref(), Some(before), "{day}");
        }
        assert_eq!(previous_day("2026-09-21"), None);
    }

    #[test]
    fn day_partitions_end_at_midnight_utc() {
        assert_eq!(day_end_seconds("19700101"), Some(86_400));
        assert_eq!(day_end_seconds("20261130"), Some(1_796_083_200));
        assert_eq!(day_end_seconds("20240229"), Some(1_709_251_200));
        assert_eq!(day_end_seconds("2026113"), None);
        assert_eq!(day_end_seconds("x"), None);
    }
}
