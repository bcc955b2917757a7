//! Kafka at tally's edges: the source consumer (positions come from tally's checkpoints, never
//! from the group), the transactional producer that writes each epoch's dead letters and changelog
//! records and commits the group's offsets, the changelog reader, and topic administration.

mod consumer;
mod deadline;
mod error;
pub mod job_registry;
mod reader;
mod settings;
mod topics;
mod transaction;

pub use consumer::{
    GroupMember, GroupMembers, SourceConsumer, SourceRecord, StartFrom, assigned_partitions,
    record_of,
};
pub use error::{Error, Result};
pub use reader::{read_committed_range, topic_extent, topic_starts};
pub use settings::{KafkaSettings, check_connection};
pub use topics::{
    PartitionReplicas, RecordDeleter, TopicChange, TopicDurability, TopicSpec,
    delete_topics_and_group, ensure_topic, ensure_topics, topic_durability,
};
pub use transaction::{
    CommitMark, EpochCommit, EpochProducer, EpochTopics, HEADER_ERROR, HEADER_REASON,
    HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, HEADER_SOURCE_TIMESTAMP, HEADER_SOURCE_TOPIC,
    UnfencedProducer,
};
