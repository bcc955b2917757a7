//! Exact fixed-point money: 4 fractional digits, stored as scaled integers. Never f64.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Scale of every amount: 10^4 units per whole currency unit.
pub const SCALE: i64 = 10_000;
/// Input amounts must be strictly below this in absolute value (10^14 whole units).
pub const MAX_INPUT_UNITS: i64 = 100_000_000_000_000 * SCALE;
/// Largest absolute value a `Decimal(18,4)` column holds, in units.
pub const MAX_DECIMAL18_UNITS: i64 = 999_999_999_999_999_999;

/// An exact amount in units of 10^-4.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Amount(pub i64);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AmountError {
    #[error("amount is empty")]
    Empty,
    #[error("amount {0:?} is not a plain decimal number (digits, optional sign and point)")]
    Syntax(String),
    #[error("amount {0:?} has more than 4 fractional digits")]
    TooPrecise(String),
    #[error("amount {0:?} is not below 10^14 in absolute value")]
    OutOfRange(String),
}

impl Amount {
    pub const ZERO: Amount = Amount(0);

    /// Parses `-?\d+(\.\d{1,4})?` exactly. Exponents are refused rather than rounded.
    pub fn parse(text: &str) -> Result<Amount, AmountError> {
        parse_scaled(text, 4).map(Amount).map_err(|e| match e {
            DecimalError::Empty => AmountError::Empty,
            DecimalError::Syntax => AmountError::Syntax(text.to_owned()),
            DecimalError::TooPrecise => AmountError::TooPrecise(text.to_owned()),
            DecimalError::OutOfRange => AmountError::OutOfRange(text.to_owned()),
        })
    }

    /// Adds within the range of a `Decimal(18,4)` column; `None` means the sum would not fit.
    pub fn checked_add_decimal18(self, other: Amount) -> Option<Amount> {
        let sum = self.0.checked_add(other.0)?;
        (sum.abs() <= MAX_DECIMAL18_UNITS).then_some(Amount(sum))
    }

    pub fn units(self) -> i64 {
        self.0
    }
}

/// Why a decimal text was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecimalError {
    Empty,
    /// Not digits with an optional sign and point (exponents included).
    Syntax,
    /// More fractional digits than the scale.
    TooPrecise,
    /// Beyond what a `Decimal(18, scale)` holds.
    OutOfRange,
}

/// Parses `-?\d+(\.\d+)?` into units of 10^-scale exactly: exponents, more fractional digits
/// than `scale` and values a `Decimal(18, scale)` cannot hold are refused, never rounded.
pub fn parse_scaled(text: &str, scale: u32) -> Result<i64, DecimalError> {
    if text.is_empty() {
        return Err(DecimalError::Empty);
    }
    let (negative, body) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (int_part, frac_part) = match body.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (body, None),
    };
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(int_part) || frac_part.is_some_and(|f| !all_digits(f)) {
        return Err(DecimalError::Syntax);
    }
    let frac = frac_part.unwrap_or("");
    if frac.len() > scale as usize {
        return Err(DecimalError::TooPrecise);
    }
    let mut units: i64 = 0;
    for b in int_part.trim_start_matches('0').bytes().chain(frac.bytes()) {
        units = units
            .checked_mul(10)
            .and_then(|u| u.checked_add(i64::from(b - b'0')))
            .ok_or(DecimalError::OutOfRange)?;
    }
    for _ in frac.len()..scale as usize {
        units = units.checked_mul(10).ok_or(DecimalError::OutOfRange)?;
    }
    if units > MAX_DECIMAL18_UNITS {
        return Err(DecimalError::OutOfRange);
    }
    Ok(if negative { -units } else { units })
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.0 < 0 { "-" } else { "" };
        let abs = self.0.unsigned_abs();
        let scale = SCALE.unsigned_abs();
        write!(f, "{sign}{}.{:04}", abs / scale, abs % scale)
    }
}

/// Formats an i128 sum of units (totals across many windows can exceed i64).
pub fn format_units_i128(units: i128) -> String {
    let sign = if units < 0 { "-" } else { "" };
    let abs = units.unsigned_abs();
    let scale = SCALE.unsigned_abs() as u128;
    format!("{sign}{}.{:04}", abs / scale, abs % scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_exact_decimals() {
        assert_eq!(Amount::parse("0"), Ok(Amount(0)));
        assert_eq!(Amount::parse("12.5"), Ok(Amount(125_000)));
        assert_eq!(Amount::parse("-0.0001"), Ok(Amount(-1)));
        assert_eq!(Amount::parse("007.1234"), Ok(Amount(71_234)));
        assert_eq!(
            Amount::parse("99999999999999.9999"),
            Ok(Amount(MAX_INPUT_UNITS - 1))
        );
    }

    #[test]
    fn refuses_bad_amounts() {
        assert!(matches!(Amount::parse(""), Err(AmountError::Empty)));
        for bad in [
            "1e3", "+1", "1.", ".5", "1.2.3", "--1", "1,5", " 1", "NaN", "-",
        ] {
            assert!(
                matches!(Amount::parse(bad), Err(AmountError::Syntax(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            Amount::parse("1.00001"),
            Err(AmountError::TooPrecise(_))
        ));
        assert!(matches!(
            Amount::parse("100000000000000"),
            Err(AmountError::OutOfRange(_))
        ));
        assert!(matches!(
            Amount::parse("-100000000000000.0"),
            Err(AmountError::OutOfRange(_))
        ));
        assert!(matches!(
            Amount::parse("123456789012345678901"),
            Err(AmountError::OutOfRange(_))
        ));
    }

    #[test]
    fn sums_that_f64_gets_wrong_are_exact() {
        // 0.1 + 0.2 != 0.3 in f64; ten million cents drift in f64 but not here.
        let a = Amount::parse("0.1").and_then(|a| Ok((a, Amount::parse("0.2")?)));
        let (a, b) = a.expect("valid amounts");
        assert_eq!(
            a.checked_add_decimal18(b),
            Some(Amount::parse("0.3").expect("valid"))
        );
        assert_ne!(0.1_f64 + 0.2_f64, 0.3_f64);
        let cent = Amount::parse("0.01").expect("valid");
        let mut sum = Amount::ZERO;
        let mut float = 0.0_f64;
        for _ in 0..10_000_000 {
            sum = sum.checked_add_decimal18(cent).expect("fits");
            float += 0.01;
        }
        assert_eq!(sum.to_string(), "100000.0000");
        assert_ne!(float, 100_000.0);
    }

    #[test]
    fn decimal18_overflow_is_detected() {
        let big = Amount(MAX_DECIMAL18_UNITS);
        assert_eq!(big.checked_add_decimal18(Amount(1)), None);
        assert_eq!(
            Amount(-MAX_DECIMAL18_UNITS).checked_add_decimal18(Amount(-1)),
            None
        );
        assert_eq!(
            big.checked_add_decimal18(Amount(-1)),
            Some(Amount(MAX_DECIMAL18_UNITS - 1))
        );
    }

    #[test]
    fn display_round_trips() {
        for s in ["0.0000", "-0.0001", "12.3400", "-99999999999999.9999"] {
            assert_eq!(Amount::parse(s).expect("valid").to_string(), s);
        }
        assert_eq!(format_units_i128(-12_345), "-1.2345");
    }
}
