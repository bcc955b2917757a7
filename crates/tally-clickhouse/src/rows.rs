//! A job's data rows as RowBinary, encoded by its shape: the data table's columns in order
//! (`Shape::data_columns`). Encoded here rather than by a typed row, so that one sink writes
//! every declared shape; revenue_agg's rows come out byte for byte as its typed row's did.

use tally_core::declare::{MAX_DECIMAL_SCALE, MAX_DECIMAL18_UNITS, parse_decimal};
use tally_core::{OutputRow, Word};

use crate::error::{Result, SinkError};
use crate::schema::Shape;

/// The columns every data row starts with, before the keys.
const FIXED_COLUMNS: [&str; 4] = ["version", "source_partition", "window_start", "window_end"];

/// A ClickHouse type the sink writes in key and value columns (and the view shows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColumnType {
    String,
    Int64,
    UInt64,
    UInt8,
    Float64,
    /// `Decimal(18, scale)`: RowBinary of a Decimal64 is its units as an i64.
    Decimal(u32),
    /// Seconds as a u32; rows carry epoch milliseconds.
    DateTime,
}

impl ColumnType {
    /// The type a [`Shape`] column names (`Decimal(18, 2)`, ...).
    pub fn parse(ty: &str) -> Option<ColumnType> {
        let ty: String = ty.chars().filter(|c| !c.is_whitespace()).collect();
        Some(match ty.as_str() {
            "String" => ColumnType::String,
            "Int64" => ColumnType::Int64,
            "UInt64" => ColumnType::UInt64,
            "UInt8" => ColumnType::UInt8,
            "Float64" => ColumnType::Float64,
            "DateTime" => ColumnType::DateTime,
            _ => {
                let scale = ty.strip_prefix("Decimal(18,")?.strip_suffix(')')?;
                ColumnType::Decimal(scale.parse().ok().filter(|s| *s <= MAX_DECIMAL_SCALE)?)
            }
        })
    }
}

impl std::fmt::Display for ColumnType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ColumnType::String => f.write_str("String"),
            ColumnType::Int64 => f.write_str("Int64"),
            ColumnType::UInt64 => f.write_str("UInt64"),
            ColumnType::UInt8 => f.write_str("UInt8"),
            ColumnType::Float64 => f.write_str("Float64"),
            ColumnType::Decimal(s) => write!(f, "Decimal(18, {s})"),
            ColumnType::DateTime => f.write_str("DateTime"),
        }
    }
}

#[derive(Debug, Clone)]
struct Column {
    name: String,
    ty: ColumnType,
}

fn columns(of: &[(String, String)]) -> Result<Vec<Column>> {
    of.iter()
        .map(|(name, ty)| {
            ColumnType::parse(ty)
                .map(|ty| Column {
                    name: name.clone(),
                    ty,
                })
                .ok_or_else(|| {
                    SinkError::Schema(format!(
                        "column {name} has type {ty}, which the sink cannot write"
                    ))
                })
        })
        .collect()
}

/// Encodes a job's rows for `INSERT INTO <data> (<column_list>) FORMAT RowBinary`.
#[derive(Debug, Clone)]
pub(crate) struct RowEncoder {
    keys: Vec<Column>,
    values: Vec<Column>,
}

impl RowEncoder {
    pub(crate) fn new(shape: &Shape) -> Result<RowEncoder> {
        RowEncoder::of_columns(shape.keys(), &shape.kept())
    }

    /// Of key columns and kept value columns, each (column, ClickHouse type) in order.
    fn of_columns(keys: &[(String, String)], values: &[(String, String)]) -> Result<RowEncoder> {
        Ok(RowEncoder {
            keys: columns(keys)?,
            values: columns(values)?,
        })
    }

    /// The columns in the order a row is encoded, comma-separated.
    pub(crate) fn column_list(&self) -> String {
        FIXED_COLUMNS
            .iter()
            .copied()
            .chain(self.keys.iter().map(|c| c.name.as_str()))
            .chain(self.values.iter().map(|c| c.name.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Appends `row` at `version`; on an error `out` is left as it was.
    pub(crate) fn encode(&self, out: &mut Vec<u8>, version: i64, row: &OutputRow) -> Result<()> {
        let start = out.len();
        let encoded = self.encode_fields(out, version, row).map_err(|what| {
            SinkError::Row(format!(
                "row of partition {} window {} ms: {what}",
                row.partition, row.key.window_start_ms
            ))
        });
        if encoded.is_err() {
            out.truncate(start);
        }
        encoded
    }

    fn encode_fields(
        &self,
        out: &mut Vec<u8>,
        version: i64,
        row: &OutputRow,
    ) -> Result<(), String> {
        let parts = row.key.key.parts();
        if parts.len() != self.keys.len() {
            return Err(format!(
                "its key has {} part(s), the table {} key column(s)",
                parts.len(),
                self.keys.len()
            ));
        }
        let words = row.value.words();
        if words.len() != self.values.len() {
            return Err(format!(
                "its value has {} word(s), the table {} value column(s)",
                words.len(),
                self.values.len()
            ));
        }
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&row.partition.to_le_bytes());
        put_seconds(out, row.key.window_start_ms)
            .map_err(|e| format!("column window_start: {e}"))?;
        put_seconds(out, row.window_end_ms).map_err(|e| format!("column window_end: {e}"))?;
        for (column, part) in self.keys.iter().zip(parts) {
            put_key(out, column.ty, part).map_err(|e| {
                format!(
                    "key column {} ({}): part {part:?} {e}",
                    column.name, column.ty
                )
            })?;
        }
        for (column, word) in self.values.iter().zip(words) {
            put_word(out, column.ty, *word).map_err(|e| {
                format!(
                    "value column {} ({}): word {word:?} {e}",
                    column.name, column.ty
                )
            })?;
        }
        Ok(())
    }
}

/// A key part, canonical text of its column's type.
fn put_key(out: &mut Vec<u8>, ty: ColumnType, text: &str) -> Result<(), String> {
    let not = |what: &str| format!("is not {what}");
    match ty {
        ColumnType::String => put_string(out, text.as_bytes()),
        ColumnType::Int64 => {
            let n: i64 = text.parse().map_err(|_| not("an Int64"))?;
            out.extend_from_slice(&n.to_le_bytes());
        }
        ColumnType::UInt64 => {
            let n: u64 = text.parse().map_err(|_| not("a UInt64"))?;
            out.extend_from_slice(&n.to_le_bytes());
        }
        ColumnType::UInt8 => match text {
            "0" => out.push(0),
            "1" => out.push(1),
            _ => return Err(not("a boolean (0 or 1)")),
        },
        ColumnType::Float64 => {
            let x: f64 = text.parse().map_err(|_| not("a Float64"))?;
            out.extend_from_slice(&x.to_le_bytes());
        }
        ColumnType::Decimal(scale) => {
            let units = parse_decimal(text, scale).map_err(|e| format!("does not fit: {e}"))?;
            out.extend_from_slice(&units.to_le_bytes());
        }
        ColumnType::DateTime => {
            let ms: i64 = text.parse().map_err(|_| not("epoch milliseconds"))?;
            put_seconds(out, ms)?;
        }
    }
    Ok(())
}

/// A word of the value, of the kind its column's type holds.
fn put_word(out: &mut Vec<u8>, ty: ColumnType, word: Word) -> Result<(), String> {
    match (ty, word) {
        (ColumnType::UInt64, Word::Count(n)) => out.extend_from_slice(&n.to_le_bytes()),
        (ColumnType::Int64, Word::Exact(n)) => out.extend_from_slice(&n.to_le_bytes()),
        (ColumnType::Decimal(_), Word::Exact(units)) => {
            // Beyond 18 digits the server would keep a number it cannot print back.
            if units.unsigned_abs() > MAX_DECIMAL18_UNITS.unsigned_abs() {
                return Err("exceeds 18 digits".to_owned());
            }
            out.extend_from_slice(&units.to_le_bytes());
        }
        (ColumnType::DateTime, Word::Exact(ms)) => put_seconds(out, ms)?,
        (ColumnType::Float64, Word::Float(x)) => out.extend_from_slice(&x.to_le_bytes()),
        _ => return Err("is not of a kind the column holds".to_owned()),
    }
    Ok(())
}

/// Epoch milliseconds as a DateTime: whole seconds, as a u32.
fn put_seconds(out: &mut Vec<u8>, ms: i64) -> Result<(), String> {
    let seconds = u32::try_from(ms.div_euclid(1000))
        .map_err(|_| format!("time {ms} ms does not fit DateTime"))?;
    out.extend_from_slice(&seconds.to_le_bytes());
    Ok(())
}

/// A String: its length as unsigned LEB128, then its bytes.
fn put_string(out: &mut Vec<u8>, bytes: &[u8]) {
    let mut n = bytes.len() as u64;
    loop {
        let low = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(low);
            break;
        }
        out.push(low | 0x80);
    }
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests;
