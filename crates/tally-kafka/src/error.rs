//! Kafka errors with the context they happened in.

use std::collections::BTreeMap;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kafka: {context}: {source}")]
    Kafka { context: String, source: KafkaError },
    #[error("kafka: {0}")]
    Other(String),
    /// A request the cluster refuses whatever the retries: a configuration to fix.
    #[error("kafka: {0}")]
    Refused(String),
    /// A read_committed fetch of the group's offsets keeps answering "unstable" while a
    /// read_uncommitted one answers: a transaction that committed offsets for the group is
    /// open. `last_committed` is what the group has without it.
    #[error(
        "kafka: the committed offsets of {topic} for group {group} are held by an open transaction \
         (an unstable offset commit in __consumer_offsets partition {}); the group's offsets without it: {}",
        offsets_partition.map_or("?".to_owned(), |p| p.to_string()),
        describe_offsets(last_committed)
    )]
    UnstableOffsets {
        topic: String,
        group: String,
        offsets_partition: Option<i32>,
        last_committed: BTreeMap<tally_core::PartitionId, (Option<tally_core::Offset>, String)>,
    },
}

fn describe_offsets(
    offsets: &BTreeMap<tally_core::PartitionId, (Option<tally_core::Offset>, String)>,
) -> String {
    let parts: Vec<String> = offsets
        .iter()
        .map(|(p, (o, meta))| match o {
            Some(o) => format!("{p}@{o} ({meta})"),
            None => format!("{p}: none"),
        })
        .collect();
    parts.join(", ")
}

impl Error {
    /// The consumer's position is no longer on the broker (retention deleted the records
    /// before they were read): with `auto.offset.reset=error` librdkafka says so rather than
    /// skip them.
    pub fn is_offset_out_of_range(&self) -> bool {
        matches!(
            self,
            Error::Kafka { source, .. } if matches!(
                source.rdkafka_error_code(),
                Some(RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset)
            )
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn kafka(context: impl Into<String>) -> impl FnOnce(KafkaError) -> Error {
    let context = context.into();
    move |source| Error::Kafka { context, source }
}
