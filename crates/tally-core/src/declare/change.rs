//! Change events: a row of a source table as Debezium captures it. A change names its row by
//! primary key, says what happened (`op`), carries the row's image after it (`after`; `before`
//! for a delete, which holds at least the key) and the source's position (`source.lsn`, and
//! `source.sequence` = `[last commit LSN, LSN]`). The record may come with or without the JSON
//! converter's schema envelope (`{"schema": .., "payload": ..}`); both are read in one pass.

use compact_str::CompactString;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use smallvec::{SmallVec, smallvec};

use super::extract::{FieldReader, PathTree};
use super::{Evaluation, Job};
use crate::decode::{Poison, PoisonReason, Raw, classify, document, not_a_json_object, string_of};

/// Where a change is in the source's log, ordered as the source committed the changes of one
/// row: by the commit LSN that precedes the change's transaction (Debezium's
/// `sequence[0]`; 0 when it is not given), then by the change's own LSN.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Position {
    pub commit_lsn: u64,
    pub lsn: u64,
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", lsn_text(self.commit_lsn), lsn_text(self.lsn))
    }
}

/// An LSN as PostgreSQL prints it (`16/B374D848`).
pub fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

/// Parses an LSN as PostgreSQL prints it.
pub fn parse_lsn(text: &str) -> Option<u64> {
    let (high, low) = text.trim().split_once('/')?;
    let high = u64::from_str_radix(high, 16).ok()?;
    let low = u64::from_str_radix(low, 16).ok()?;
    (high <= u64::from(u32::MAX) && low <= u64::from(u32::MAX)).then_some((high << 32) | low)
}

/// What happened to the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Create,
    Update,
    Delete,
    /// A snapshot read: the row as it is, whether tally holds it or not (an upsert).
    Read,
    /// Every row of the table removed (`TRUNCATE`): the event names no row, so the rows it
    /// removed are held in every partition; the operator stops the job at it.
    Truncate,
}

/// One change, read: its row's primary key (the key's values as text, joined by NUL, which
/// PostgreSQL text cannot hold), its position, and the row's new image as the declaration
/// reads it (`Ok(None)` for a delete; an image the declaration refuses is the poison, kept
/// apart so that the change still takes its position: a replay of it is then a duplicate).
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub op: Op,
    pub position: Position,
    pub key: CompactString,
    pub row: Result<Option<Evaluation>, Poison>,
}

/// The paths of a change job's record: per envelope (bare, then under `payload`), the
/// declared fields under `after`, the key fields under `before`, then `op`, `source.lsn` and
/// `source.sequence`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Envelope {
    tree: PathTree,
    fields: usize,
    primary_key: Vec<usize>,
}

const META: usize = 3;

impl Envelope {
    pub(crate) fn new(fields: &[FieldReader], primary_key: &[usize]) -> Envelope {
        let mut paths: Vec<Vec<String>> = Vec::new();
        for prefix in [&[][..], &["payload".to_owned()][..]] {
            let under = |image: &str, path: &[String]| {
                let mut p = prefix.to_vec();
                p.push(image.to_owned());
                p.extend_from_slice(path);
                p
            };
            paths.extend(fields.iter().map(|f| under("after", &f.path)));
            paths.extend(
                primary_key
                    .iter()
                    .map(|&k| under("before", &fields[k].path)),
            );
            let meta = |path: &[&str]| {
                let mut p = prefix.to_vec();
                p.extend(path.iter().map(|s| (*s).to_owned()));
                p
            };
            paths.push(meta(&["op"]));
            paths.push(meta(&["source", "lsn"]));
            paths.push(meta(&["source", "sequence"]));
        }
        Envelope {
            tree: PathTree::new(paths.iter().map(Vec::as_slice)),
            fields: fields.len(),
            primary_key: primary_key.to_vec(),
        }
    }

    fn stride(&self) -> usize {
        self.fields + self.primary_key.len() + META
    }
}

fn invalid(message: impl Into<String>) -> Poison {
    Poison::new(PoisonReason::InvalidChange, message)
}

/// A JSON number or string of digits as a `u64` (Debezium writes LSNs as numbers, sequences as
/// strings).
fn unsigned(raw: &RawValue) -> Option<u64> {
    match classify(raw) {
        Raw::Number(text) => text.parse().ok(),
        Raw::Str(raw) => string_of(raw).ok()?.parse().ok(),
        _ => None,
    }
}

/// `source.sequence`: a JSON string holding `["<last commit lsn>", "<lsn>"]`, either may be
/// null.
fn sequence(raw: &RawValue) -> Option<(u64, Option<u64>)> {
    let Raw::Str(raw) = classify(raw) else {
        return None;
    };
    let text = string_of(raw).ok()?;
    let items: Vec<Option<String>> = serde_json::from_str(&text).ok()?;
    let [commit, lsn] = items.as_slice() else {
        return None;
    };
    let number = |s: &Option<String>| s.as_deref().map(str::parse::<u64>).transpose().ok();
    Some((number(commit)?.unwrap_or(0), number(lsn)?))
}

impl Job {
    /// Reads one change event (a tombstone, which has no value, is the caller's to count).
    pub fn evaluate_change(
        &self,
        value: Option<&[u8]>,
        max_record_bytes: usize,
    ) -> Result<Change, Poison> {
        let Some(envelope) = self.changes.as_ref().map(|c| &c.envelope) else {
            return Err(invalid("the job does not read change events"));
        };
        let text = document(value, max_record_bytes)?;
        let stride = envelope.stride();
        let mut raws: SmallVec<[Option<&RawValue>; 64]> = smallvec![None; 2 * stride];
        envelope
            .tree
            .read(text, &mut raws)
            .map_err(not_a_json_object)?;
        let op_at = envelope.fields + envelope.primary_key.len();
        let present = |i: usize| raws[i].is_some_and(|r| r.get() != "null");
        let slot = if present(op_at) {
            &raws[..stride]
        } else if present(stride + op_at) {
            &raws[stride..]
        } else {
            return Err(invalid(
                "no \"op\": not a Debezium change event (op, before, after and source, bare or under \"payload\")",
            ));
        };
        let op_text = match slot[op_at].map(classify) {
            Some(Raw::Str(raw)) => string_of(raw)?,
            _ => return Err(invalid("\"op\" is not a string")),
        };
        let op = match op_text.as_ref() {
            "c" => Op::Create,
            "u" => Op::Update,
            "d" => Op::Delete,
            "r" => Op::Read,
            "t" => Op::Truncate,
            other => return Err(invalid(format!("op {other:?} is not c, u, d or r"))),
        };
        let lsn = slot[op_at + 1].and_then(unsigned);
        let seq = slot[op_at + 2]
            .filter(|r| r.get() != "null")
            .map(|raw| {
                sequence(raw).ok_or_else(|| {
                    invalid(format!(
                        "source.sequence {} is not [\"<commit lsn>\", \"<lsn>\"]",
                        raw.get()
                    ))
                })
            })
            .transpose()?;
        let position = match (seq, lsn) {
            (Some((commit_lsn, Some(lsn))), _) | (Some((commit_lsn, None)), Some(lsn)) => {
                Position { commit_lsn, lsn }
            }
            (None, Some(lsn)) => Position { commit_lsn: 0, lsn },
            _ => {
                return Err(Poison::new(
                    PoisonReason::MissingField,
                    "source.lsn is missing: the change has no position to order it by",
                ));
            }
        };
        if op == Op::Truncate {
            return Ok(Change {
                op,
                position,
                key: CompactString::default(),
                row: Ok(None),
            });
        }
        let (image, keys) = slot.split_at(envelope.fields);
        let before_keys = &keys[..envelope.primary_key.len()];
        let key_of = |raws: &[Option<&RawValue>], image: &str| {
            let mut key = CompactString::default();
            for (i, (&k, raw)) in envelope.primary_key.iter().zip(raws).enumerate() {
                let field = &self.fields[k];
                let value = field.read(*raw).map_err(|p| {
                    Poison::new(p.reason, format!("primary key in {image:?}: {}", p.message))
                })?;
                if i > 0 {
                    key.push('\0');
                }
                key.push_str(&value.key_text(field.scale));
            }
            Ok::<_, Poison>(key)
        };
        if op == Op::Delete {
            let key = key_of(before_keys, "before")?;
            return Ok(Change {
                op,
                position,
                key,
                row: Ok(None),
            });
        }
        if !image.iter().any(|r| r.is_some_and(|r| r.get() != "null")) {
            return Err(Poison::new(
                PoisonReason::MissingField,
                format!("the change (op {op_text:?}) has no \"after\" row"),
            ));
        }
        let after_keys: SmallVec<[Option<&RawValue>; 4]> =
            envelope.primary_key.iter().map(|&k| image[k]).collect();
        let key = key_of(&after_keys, "after")?;
        let named = |p: Poison| {
            Poison::new(
                p.reason,
                format!("row {:?}: {}", key.replace('\0', ","), p.message),
            )
        };
        let row = match self.evaluate_fields(image) {
            Ok(Evaluation::Incomplete {
                event_time_ms,
                poison,
            }) => Ok(Some(Evaluation::Incomplete {
                event_time_ms,
                poison: named(poison),
            })),
            Ok(evaluation) => Ok(Some(evaluation)),
            Err(p) => Err(named(p)),
        };
        Ok(Change {
            op,
            position,
            key,
            row,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsns_read_and_print_as_postgresql_writes_them() {
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(lsn_text(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("x/1"), None);
        assert_eq!(parse_lsn("1"), None);
    }

    #[test]
    fn positions_order_by_commit_then_lsn() {
        let p = |commit_lsn, lsn| Position { commit_lsn, lsn };
        assert!(p(10, 5) > p(9, 100));
        assert!(p(10, 6) > p(10, 5));
        assert_eq!(p(10, 5), p(10, 5));
    }

    #[test]
    fn sequences_read_with_nulls() {
        let raw = |s: &str| serde_json::from_str::<Box<RawValue>>(s).expect("json");
        assert_eq!(
            sequence(&raw(r#""[\"24023928\",\"24023976\"]""#)),
            Some((24_023_928, Some(24_023_976)))
        );
        assert_eq!(sequence(&raw(r#""[null,\"7\"]""#)), Some((0, Some(7))));
        assert_eq!(sequence(&raw(r#""[\"x\",\"7\"]""#)), None);
        assert_eq!(sequence(&raw("12")), None);
    }
}
