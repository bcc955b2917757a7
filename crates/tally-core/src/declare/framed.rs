//! Records in the Confluent wire format: a magic byte 0, the writer schema's id in the schema
//! registry (4 bytes, big-endian), for Protobuf the indexes of the record's message in the
//! schema, then the Avro or Protobuf payload. The writer schema comes from a [`Schemas`]: the
//! registry client and its cache, outside the core.

use std::sync::Arc;

use smallvec::{SmallVec, smallvec};

use super::avro::{AvroDecoder, AvroSchema};
use super::extract::Cell;
use super::protobuf::ProtobufDecoder;
use super::{Evaluation, Format, Job};
use crate::decode::{Poison, PoisonReason};

/// A writer schema compiled for a job's declaration.
#[derive(Debug, Clone, PartialEq)]
pub enum WriterSchema {
    Avro(AvroDecoder),
    Protobuf(ProtobufDecoder),
}

impl WriterSchema {
    /// Compiles the registry's schema text for `job`, by the job's format. Also returns what the
    /// schema lacks of the declaration, or holds of another type (`check-config` reports them;
    /// records of the schema then dead-letter naming the field).
    pub fn compile(job: &Job, text: &str) -> Result<(WriterSchema, Vec<String>), String> {
        match job.format {
            Format::Avro => {
                let schema = AvroSchema::parse(text)?;
                let (decoder, problems) = AvroDecoder::compile(schema, &job.fields);
                Ok((WriterSchema::Avro(decoder), problems))
            }
            Format::Protobuf => {
                let (decoder, problems) = ProtobufDecoder::compile(text, &job.fields)?;
                Ok((WriterSchema::Protobuf(decoder), problems))
            }
            other => Err(format!(
                "a job reading {} takes no registry schema",
                other.as_str()
            )),
        }
    }
}

/// Writer schemas by id, compiled for the job: a registry behind a cache.
pub trait Schemas: Send + Sync + std::fmt::Debug {
    /// Schema `id`, or why its records are poison (the registry does not know the id, the
    /// schema does not compile). A registry that cannot be reached is waited for, never an
    /// answer: a record is not poison for it.
    fn writer(&self, id: u32) -> Result<Arc<WriterSchema>, Poison>;
}

fn wire_format(message: String) -> Poison {
    Poison::new(PoisonReason::WireFormat, message)
}

/// The writer schema id of a record in the Confluent wire format.
pub fn schema_id(value: &[u8]) -> Result<u32, Poison> {
    match value {
        [0, a, b, c, d, ..] => Ok(u32::from_be_bytes([*a, *b, *c, *d])),
        [magic, ..] if *magic != 0 => Err(wire_format(format!(
            "magic byte {magic}, not 0: not in the Confluent wire format (magic byte, schema id, payload)"
        ))),
        short => Err(wire_format(format!(
            "{} bytes: shorter than the Confluent wire format's header (magic byte, schema id)",
            short.len()
        ))),
    }
}

/// A zig-zag varint (Protobuf's message indexes).
fn zigzag(bytes: &[u8], at: &mut usize) -> Option<i64> {
    let mut value: u64 = 0;
    for shift in (0..64).step_by(7) {
        let b = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(((value >> 1) as i64) ^ -((value & 1) as i64));
        }
    }
    None
}

/// The message indexes at the start of a Protobuf payload (a count, then the indexes; a count
/// of 0 stands for `[0]`, the first message), and the message's bytes.
pub fn message_indexes(rest: &[u8]) -> Result<(SmallVec<[i32; 2]>, &[u8]), String> {
    let mut at = 0;
    let bad = || "message indexes that do not read".to_owned();
    let count = zigzag(rest, &mut at).ok_or_else(bad)?;
    if count == 0 {
        return Ok((smallvec![0], &rest[at..]));
    }
    if !(1..=64).contains(&count) {
        return Err(format!("{count} message indexes"));
    }
    let mut indexes = SmallVec::new();
    for _ in 0..count {
        let i = zigzag(rest, &mut at).ok_or_else(bad)?;
        indexes.push(i32::try_from(i).map_err(|_| bad())?);
    }
    Ok((indexes, &rest[at..]))
}

/// Cells of one record, inline for jobs of up to 16 fields.
type Cells<'a> = SmallVec<[Option<Cell<'a>>; 16]>;

impl Job {
    /// Reads one event by the job's format: JSON, or the Confluent wire format with its writer
    /// schema from `schemas` (none given for such a job: every record is refused, naming why).
    pub fn read(
        &self,
        value: Option<&[u8]>,
        max_record_bytes: usize,
        schemas: Option<&dyn Schemas>,
    ) -> Result<Evaluation, Poison> {
        if !self.format.is_framed() {
            return self.evaluate(value, max_record_bytes);
        }
        match schemas {
            Some(schemas) => self.evaluate_framed(value, max_record_bytes, schemas),
            None => Err(Poison::new(
                PoisonReason::UnknownSchema,
                format!(
                    "a job of {} records has no schema registry",
                    self.format.as_str()
                ),
            )),
        }
    }

    /// Reads one record in the Confluent wire format, its writer schema from `schemas`.
    pub fn evaluate_framed(
        &self,
        value: Option<&[u8]>,
        max_record_bytes: usize,
        schemas: &dyn Schemas,
    ) -> Result<Evaluation, Poison> {
        let bytes = value.ok_or_else(|| wire_format("the record has no value".into()))?;
        if bytes.len() > max_record_bytes {
            return Err(Poison::new(
                PoisonReason::TooLarge,
                format!(
                    "record of {} bytes exceeds job.max_record_bytes {max_record_bytes}",
                    bytes.len()
                ),
            ));
        }
        let id = schema_id(bytes)?;
        let writer = schemas.writer(id)?;
        let payload = &bytes[5..];
        let mut cells: Cells<'_> = smallvec![None; self.fields.len()];
        let decoded = match (writer.as_ref(), self.format) {
            (WriterSchema::Avro(d), Format::Avro) => d.decode(payload, &mut cells),
            (WriterSchema::Protobuf(d), Format::Protobuf) => message_indexes(payload)
                .and_then(|(indexes, body)| d.decode(&indexes, body, &mut cells)),
            (_, format) => Err(format!(
                "the schema is not {}, the job's format",
                format.as_str()
            )),
        };
        decoded.map_err(|why| {
            Poison::new(PoisonReason::Undecodable, format!("{why} (schema id {id})"))
        })?;
        let named = |p: Poison| Poison::new(p.reason, format!("{} (schema id {id})", p.message));
        match self.evaluate_fields(&cells[..]) {
            Ok(Evaluation::Incomplete {
                event_time_ms,
                poison,
            }) => Ok(Evaluation::Incomplete {
                event_time_ms,
                poison: named(poison),
            }),
            other => other.map_err(named),
        }
    }
}
