//! The source consumer. It never subscribes: it is assigned every partition of the topic at
//! the offsets of tally's last checkpoint, and reads only committed transactional data.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::{Offset as KOffset, TopicPartitionList};
use tally_core::{Offset, PartitionId, Record};

use crate::error::{Error, Result, kafka};
use crate::settings::{KafkaSettings, set_default};

const TIMEOUT: Duration = Duration::from_secs(30);

/// How long dropping a source waits for its consumer to close (to leave its group).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The first offset of `topic/partition` whose record is at or after `at` (ms, record time),
/// within `(low, high)`; `high` when no record is.
fn offset_at<C: Consumer<X>, X: rdkafka::consumer::ConsumerContext>(
    consumer: &C,
    topic: &str,
    partition: PartitionId,
    at: i64,
    (low, high): (Offset, Offset),
) -> Result<Offset> {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, KOffset::Offset(at))
        .map_err(kafka("building a lookup by time"))?;
    let found = consumer
        .offsets_for_times(tpl, TIMEOUT)
        .map_err(kafka(format!("looking up {topic}/{partition} at {at} ms")))?;
    Ok(
        match found.find_partition(topic, partition).map(|e| e.offset()) {
            Some(KOffset::Offset(o)) => o.clamp(low, high),
            _ => high,
        },
    )
}

/// Where `topic/partition`, holding `(low, high)`, starts for a job that starts `from`.
pub(crate) fn start_within<C: Consumer<X>, X: rdkafka::consumer::ConsumerContext>(
    consumer: &C,
    topic: &str,
    partition: PartitionId,
    from: StartFrom,
    (low, high): (Offset, Offset),
) -> Result<Offset> {
    Ok(match from {
        StartFrom::Earliest => low,
        StartFrom::Latest => high,
        StartFrom::Time(at) => offset_at(consumer, topic, partition, at, (low, high))?,
    })
}

/// Where a partition without a checkpoint starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartFrom {
    Earliest,
    Latest,
    /// The first record whose timestamp is at or after this time (ms since the epoch); the
    /// end when none is.
    Time(i64),
}

pub struct SourceConsumer {
    /// `None` only while the source is dropped ([`Drop for SourceConsumer`](SourceConsumer#impl-Drop-for-SourceConsumer)).
    consumer: Option<BaseConsumer<MemberContext>>,
    topic: String,
    group: String,
    settings: KafkaSettings,
}

/// A consumer group as the coordinator describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupMembers {
    /// Neither forming, nor rebalancing, nor empty; only then are assignments described.
    pub stable: bool,
    pub members: Vec<GroupMember>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupMember {
    pub client_id: String,
    /// The partitions assigned to the member, by topic.
    pub assigned: Vec<(String, PartitionId)>,
}

/// The partitions of a consumer-protocol assignment (Kafka's `ConsumerProtocolAssignment`,
/// the same layout in versions 0 to 3): a version (int16), then topics (int32 count; each a
/// string with an int16 length and int32 partitions with an int32 count), then user data.
/// `None` if the bytes are not such an assignment.
pub fn assigned_partitions(bytes: &[u8]) -> Option<Vec<(String, PartitionId)>> {
    fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (bytes.get(..n)?, bytes.get(n..)?);
        *bytes = rest;
        Some(head)
    }
    fn int16(bytes: &mut &[u8]) -> Option<i16> {
        take(bytes, 2).map(|b| i16::from_be_bytes([b[0], b[1]]))
    }
    fn int32(bytes: &mut &[u8]) -> Option<i32> {
        take(bytes, 4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    let mut rest = bytes;
    if !(0..=3).contains(&int16(&mut rest)?) {
        return None;
    }
    let mut out = Vec::new();
    for _ in 0..int32(&mut rest)?.max(0) {
        let len = usize::try_from(int16(&mut rest)?).ok()?;
        let topic = std::str::from_utf8(take(&mut rest, len)?).ok()?.to_owned();
        for _ in 0..int32(&mut rest)?.max(0) {
            out.push((topic.clone(), int32(&mut rest)?));
        }
    }
    Some(out)
}

/// A hook run when the group revokes partitions, before the revocation takes effect.
type RevokeHook = Box<dyn Fn(&[PartitionId]) + Send + Sync>;

/// Lets the owner of a group member act on a revocation before it takes effect (the
/// cooperative protocol, KIP-429): the hook runs inside `poll`, and the partitions stay this
/// member's, and no one else's, until it returns. Not for an assignment already lost (the
/// member was silent past its session timeout): the partitions are someone else's by then.
#[derive(Default)]
pub struct MemberContext {
    on_revoke: std::sync::Mutex<Option<RevokeHook>>,
}

impl rdkafka::ClientContext for MemberContext {}

impl rdkafka::consumer::ConsumerContext for MemberContext {
    /// rdkafka's default asks librdkafka for the rebalance protocol on every rebalance, and
    /// that call never returns if it comes after the consumer began to close (librdkafka
    /// #4041): a worker stopping while Kafka restarted hung in dropping its member. A member is
    /// always cooperative (`SourceConsumer::join`), so the assignment changes incrementally without
    /// asking.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: rdkafka::types::RDKafkaRespErr,
        partitions: &mut TopicPartitionList,
    ) {
        use rdkafka::consumer::Rebalance;
        use rdkafka::types::RDKafkaRespErr;
        let assign = err == RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS;
        let rebalance = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => Rebalance::Assign(partitions),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => Rebalance::Revoke(partitions),
            other => Rebalance::Error(rdkafka::error::KafkaError::Rebalance(other.into())),
        };
        self.pre_rebalance(consumer, &rebalance);
        let changed = if assign {
            consumer.incremental_assign(partitions)
        } else {
            consumer.incremental_unassign(partitions)
        };
        if let Err(e) = changed {
            tracing::warn!(error = %e, assign, "the group member could not change its assignment");
        }
    }

    fn pre_rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        rebalance: &rdkafka::consumer::Rebalance<'_>,
    ) {
        let rdkafka::consumer::Rebalance::Revoke(revoked) = rebalance else {
            return;
        };
        if consumer.assignment_lost() {
            return;
        }
        let partitions: Vec<PartitionId> =
            revoked.elements().iter().map(|e| e.partition()).collect();
        let hook = self
            .on_revoke
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(hook) = hook.as_ref() {
            hook(&partitions);
        }
    }
}

/// A consumed record, borrowed from the consumer until the next poll.
pub struct SourceRecord<'a> {
    message: BorrowedMessage<'a>,
}

impl SourceRecord<'_> {
    pub fn as_record(&self) -> Record<'_> {
        record_of(&self.message)
    }
}

/// The operator's view of a Kafka message.
pub fn record_of<'a>(message: &'a BorrowedMessage<'_>) -> Record<'a> {
    Record {
        partition: message.partition(),
        offset: message.offset(),
        timestamp_ms: message.timestamp().to_millis(),
        key: message.key(),
        value: message.payload(),
    }
}

/// Closing a group member can hang for good: a revocation that reaches the member as it
/// closes calls `incremental_unassign`, whose request librdkafka never answers once its group
/// handle is terminating (seen when a worker standing by was stopped just as the lease moved to
/// it). A member is static, so its close sends nothing the group needs: the close runs on a
/// thread of its own and is abandoned, with a warning, after [`CLOSE_TIMEOUT`].
impl Drop for SourceConsumer {
    fn drop(&mut self) {
        let Some(consumer) = self.consumer.take() else {
            return;
        };
        if let Err(error) =
            crate::deadline::with_deadline("tally-close", CLOSE_TIMEOUT, move || drop(consumer))
        {
            tracing::warn!(
                group = %self.group,
                timeout_s = CLOSE_TIMEOUT.as_secs(),
                %error,
                "the consumer did not close in time; going on without it"
            );
        }
    }
}

impl SourceConsumer {
    pub fn connect(
        settings: &KafkaSettings,
        topic: &str,
        group_id: &str,
    ) -> Result<SourceConsumer> {
        let mut config = settings.client_config();
        config
            .set("group.id", group_id)
            .set("isolation.level", "read_committed")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // An offset the broker no longer has means data was deleted before tally read it:
            // fail loudly rather than silently skip to another position.
            .set("auto.offset.reset", "error");
        // Bounds the prefetch buffer: the memory held while a sink is down. It counts message
        // payloads only: librdkafka holds about five times as much (a queued op per message and
        // the decompressed batches; 87 MB at 16 MiB, heap profile at 1M live keys), and 4 MiB
        // still holds a fraction of a second of the operator's consumption.
        set_default(&mut config, "queued.max.messages.kbytes", "4096");
        // The bound is checked before a fetch, so a fetch overshoots it by up to this much per
        // partition, held decompressed until its last record is consumed: at the default 1 MiB,
        // 11 MB of decompressed batches at a catch-up's peak (heap profile at 1M live keys).
        set_default(&mut config, "max.partition.fetch.bytes", "262144");
        // librdkafka's default (1 s) lets the fetcher sleep while the operator has drained the
        // queue: profiled, the operator waited on an empty queue for about half a catch-up.
        set_default(&mut config, "fetch.queue.backoff.ms", "20");
        let consumer: BaseConsumer<MemberContext> = config
            .create_with_context(MemberContext::default())
            .map_err(kafka("creating consumer"))?;
        Ok(SourceConsumer {
            consumer: Some(consumer),
            topic: topic.to_owned(),
            group: group_id.to_owned(),
            settings: settings.clone(),
        })
    }

    /// Joins the job's consumer group as a member subscribed to `lease_topic` (one
    /// partition): the member assigned it holds the job's lease. The assignment is sticky, so
    /// members that join later do not take it. Static membership (`instance_id`, the state
    /// directory's writer id) gives a restarted worker its lease back without waiting for its
    /// old session to time out. The consumer must be polled ([`SourceConsumer::poll_membership`]).
    /// It reads `source_topic`'s committed offsets and gives the group metadata for the
    /// transactions, which fences a member whose generation is stale (KIP-447).
    pub fn join(
        settings: &KafkaSettings,
        source_topic: &str,
        group_id: &str,
        lease_topic: &str,
        instance_id: &str,
        session_timeout: Duration,
    ) -> Result<SourceConsumer> {
        let mut config = settings.client_config();
        config
            .set("group.id", group_id)
            .set("group.instance.id", instance_id)
            // Names the member in the group's description (`SourceConsumer::group_members`).
            .set("client.id", instance_id)
            .set("isolation.level", "read_committed")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "latest")
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set(
                "session.timeout.ms",
                session_timeout.as_millis().to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                (session_timeout.as_millis() / 5).max(100).to_string(),
            );
        let consumer: BaseConsumer<MemberContext> = config
            .create_with_context(MemberContext::default())
            .map_err(kafka("creating group member"))?;
        consumer
            .subscribe(&[lease_topic])
            .map_err(kafka(format!("subscribing to {lease_topic}")))?;
        Ok(SourceConsumer {
            consumer: Some(consumer),
            topic: source_topic.to_owned(),
            group: group_id.to_owned(),
            settings: settings.clone(),
        })
    }

    /// The members of consumer group `group` (a member of a job's group is named by its static
    /// instance id, its client id) and what each is assigned, and whether the group is stable.
    pub fn group_members(&self, group: &str, timeout: Duration) -> Result<GroupMembers> {
        let list = self
            .consumer()
            .fetch_group_list(Some(group), timeout)
            .map_err(kafka(format!("describing consumer group {group}")))?;
        let Some(info) = list.groups().iter().find(|g| g.name() == group) else {
            return Ok(GroupMembers::default());
        };
        Ok(GroupMembers {
            stable: info.state() == "Stable",
            members: info
                .members()
                .iter()
                .map(|m| GroupMember {
                    client_id: m.client_id().to_owned(),
                    assigned: m
                        .assignment()
                        .and_then(assigned_partitions)
                        .unwrap_or_default(),
                })
                .collect(),
        })
    }

    /// Serves the group protocol (rebalances; librdkafka heartbeats on its own) and reports
    /// whether this member holds the lease of `lease_topic`.
    pub fn poll_membership(&self, lease_topic: &str, timeout: Duration) -> bool {
        self.poll_leases(lease_topic, timeout).contains(&0)
    }

    /// Serves the group protocol and returns the partitions of `lease_topic` this member holds.
    pub fn poll_leases(&self, lease_topic: &str, timeout: Duration) -> Vec<PartitionId> {
        // Nothing is ever produced to the lease topic: a poll only serves the protocol.
        let _ = self.consumer().poll(timeout);
        self.consumer().assignment().map_or_else(
            |_| Vec::new(),
            |a| {
                a.elements_for_topic(lease_topic)
                    .iter()
                    .map(|e| e.partition())
                    .collect()
            },
        )
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Runs `hook` with the partitions the group revokes from this member, before the
    /// revocation takes effect (see [`MemberContext`]); it replaces an earlier hook.
    pub fn on_revoke(&self, hook: impl Fn(&[PartitionId]) + Send + Sync + 'static) {
        *self
            .consumer()
            .context()
            .on_revoke
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::new(hook));
    }

    pub fn consumer(&self) -> &BaseConsumer<MemberContext> {
        match &self.consumer {
            Some(consumer) => consumer,
            None => unreachable!("the consumer is taken only when the source is dropped"),
        }
    }

    /// The partition count of every topic of the cluster, from one metadata request: asking
    /// by name could create a missing one.
    pub fn partition_counts(&self) -> Result<BTreeMap<String, usize>> {
        let metadata = self
            .consumer()
            .fetch_metadata(None, TIMEOUT)
            .map_err(kafka("fetching the cluster's metadata".to_owned()))?;
        Ok(crate::settings::partition_counts(&metadata))
    }

    pub fn partitions(&self) -> Result<Vec<PartitionId>> {
        let metadata = self
            .consumer()
            .fetch_metadata(Some(&self.topic), TIMEOUT)
            .map_err(kafka(format!("fetching metadata of {}", self.topic)))?;
        let topic = metadata
            .topics()
            .iter()
            .find(|t| t.name() == self.topic)
            .ok_or_else(|| Error::Other(format!("topic {} not found", self.topic)))?;
        if let Some(err) = topic.error() {
            return Err(Error::Other(format!(
                "topic {}: {:?}",
                self.topic,
                rdkafka::error::RDKafkaErrorCode::from(err)
            )));
        }
        let mut ids: Vec<_> = topic.partitions().iter().map(|p| p.id()).collect();
        ids.sort_unstable();
        if ids.is_empty() {
            return Err(Error::Other(format!(
                "topic {} has no partitions",
                self.topic
            )));
        }
        Ok(ids)
    }

    /// (low, high) watermarks of a partition.
    pub fn watermarks(&self, partition: PartitionId) -> Result<(Offset, Offset)> {
        self.consumer()
            .fetch_watermarks(&self.topic, partition, TIMEOUT)
            .map_err(kafka(format!(
                "fetching watermarks of {}/{partition}",
                self.topic
            )))
    }

    /// The end (high watermark) of each of `partitions` of `topic`.
    pub fn end_offsets(
        &self,
        topic: &str,
        partitions: impl Iterator<Item = PartitionId>,
    ) -> Result<BTreeMap<PartitionId, Offset>> {
        partitions
            .map(|p| {
                self.consumer()
                    .fetch_watermarks(topic, p, TIMEOUT)
                    .map(|(_, high)| (p, high))
                    .map_err(kafka(format!("fetching the end of {topic}/{p}")))
            })
            .collect()
    }

    /// A concrete start offset for a partition with no checkpoint, so the first checkpoint
    /// records where it really began.
    pub fn resolve_start(&self, partition: PartitionId, from: StartFrom) -> Result<Offset> {
        let bounds = self.watermarks(partition)?;
        start_within(self.consumer(), &self.topic, partition, from, bounds)
    }

    pub fn assign(&self, offsets: &BTreeMap<PartitionId, Offset>) -> Result<()> {
        let mut tpl = TopicPartitionList::new();
        for (&p, &o) in offsets {
            tpl.add_partition_offset(&self.topic, p, KOffset::Offset(o))
                .map_err(kafka("building assignment"))?;
        }
        self.consumer()
            .assign(&tpl)
            .map_err(kafka(format!("assigning partitions of {}", self.topic)))
    }

    /// Stops fetching `partitions` until [`SourceConsumer::resume`] (records already fetched may still
    /// arrive: the caller skips them).
    pub fn pause(&self, partitions: &[PartitionId]) -> Result<()> {
        self.consumer()
            .pause(&self.list(partitions))
            .map_err(kafka(format!(
                "pausing partitions {partitions:?} of {}",
                self.topic
            )))
    }

    pub fn resume(&self, partitions: &[PartitionId]) -> Result<()> {
        self.consumer()
            .resume(&self.list(partitions))
            .map_err(kafka(format!(
                "resuming partitions {partitions:?} of {}",
                self.topic
            )))
    }

    fn list(&self, partitions: &[PartitionId]) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition(&self.topic, p);
        }
        tpl
    }

    /// The next record, `None` when nothing arrived within `timeout`.
    pub fn poll(&self, timeout: Duration) -> Result<Option<SourceRecord<'_>>> {
        match self.consumer().poll(timeout) {
            None => Ok(None),
            Some(Ok(message)) => Ok(Some(SourceRecord { message })),
            Some(Err(e)) => Err(Error::Kafka {
                context: format!("consuming {}", self.topic),
                source: e,
            }),
        }
    }

    /// The group's committed offsets and their metadata, per partition.
    pub fn committed(
        &self,
        partitions: &[PartitionId],
    ) -> Result<BTreeMap<PartitionId, (Option<Offset>, String)>> {
        let mut tpl = TopicPartitionList::new();
        for &p in partitions {
            tpl.add_partition(&self.topic, p);
        }
        // read_committed: an open transaction on the group's offsets makes the broker answer
        // "unstable" until it ends, which librdkafka retries until this times out.
        match self.consumer().committed_offsets(tpl.clone(), TIMEOUT) {
            Ok(committed) => Ok(offsets_of(&committed)),
            Err(error) => match self.committed_ignoring_open_transactions(tpl) {
                Some(last_committed) => Err(Error::UnstableOffsets {
                    topic: self.topic.clone(),
                    group: self.group.clone(),
                    offsets_partition: self.offsets_partition(),
                    last_committed,
                }),
                None => Err(kafka(format!(
                    "fetching committed offsets of {}",
                    self.topic
                ))(error)),
            },
        }
    }

    /// The group's last committed offsets without waiting for open transactions (a
    /// read_uncommitted fetch), `None` if that fails too: then the broker does not answer,
    /// else an open transaction holds the offsets.
    fn committed_ignoring_open_transactions(
        &self,
        tpl: TopicPartitionList,
    ) -> Option<BTreeMap<PartitionId, (Option<Offset>, String)>> {
        let mut config = self.settings.client_config();
        config
            .set("group.id", &self.group)
            .set("isolation.level", "read_uncommitted")
            .set("enable.auto.commit", "false");
        let probe: BaseConsumer = config.create().ok()?;
        probe
            .committed_offsets(tpl, Duration::from_secs(10))
            .ok()
            .map(|c| offsets_of(&c))
    }

    /// The `__consumer_offsets` partition that holds the group's offsets, as the broker picks
    /// it (the group id's Java string hash modulo the topic's partitions), for the tools that
    /// find a hanging transaction.
    fn offsets_partition(&self) -> Option<i32> {
        let metadata = self
            .consumer()
            .fetch_metadata(Some("__consumer_offsets"), Duration::from_secs(10))
            .ok()?;
        let partitions = metadata.topics().first()?.partitions().len();
        group_partition(&self.group, partitions)
    }
}

/// Kafka's `Utils.abs(groupId.hashCode()) % partitions`.
fn group_partition(group: &str, partitions: usize) -> Option<i32> {
    let partitions = i32::try_from(partitions).ok().filter(|n| *n > 0)?;
    let hash = group
        .encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)));
    Some((hash & 0x7fff_ffff) % partitions)
}

fn offsets_of(committed: &TopicPartitionList) -> BTreeMap<PartitionId, (Option<Offset>, String)> {
    committed
        .elements()
        .iter()
        .map(|e| {
            let offset = match e.offset() {
                KOffset::Offset(o) => Some(o),
                _ => None,
            };
            (e.partition(), (offset, e.metadata().to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{assigned_partitions, group_partition};

    /// The partitions Java's `(s.hashCode() & 0x7fffffff) % 50` gives (computed with Java 17):
    /// "tally-revenue_agg" hashes to -670355587, a non-ASCII id hashes by UTF-16 units.
    #[test]
    fn the_group_partition_is_the_brokers() {
        assert_eq!(group_partition("tally-revenue_agg", 50), Some(11));
        assert_eq!(group_partition("tally-orders-ä", 50), Some(43));
        assert_eq!(group_partition("a", 50), Some(47));
        assert_eq!(group_partition("", 50), Some(0));
        assert_eq!(group_partition("g", 0), None);
    }

    /// A consumer-protocol assignment as a coordinator sends it.
    fn assignment(version: i16, topics: &[(&str, &[i32])], user_data: Option<&[u8]>) -> Vec<u8> {
        let mut b = version.to_be_bytes().to_vec();
        b.extend((topics.len() as i32).to_be_bytes());
        for (topic, partitions) in topics {
            b.extend((topic.len() as i16).to_be_bytes());
            b.extend(topic.as_bytes());
            b.extend((partitions.len() as i32).to_be_bytes());
            for p in *partitions {
                b.extend(p.to_be_bytes());
            }
        }
        match user_data {
            Some(d) => {
                b.extend((d.len() as i32).to_be_bytes());
                b.extend(d);
            }
            None => b.extend((-1i32).to_be_bytes()),
        }
        b
    }

    #[test]
    fn reads_the_partitions_of_every_topic() {
        let bytes = assignment(1, &[("lease", &[3, 0]), ("other", &[7])], Some(b"sticky"));
        assert_eq!(
            assigned_partitions(&bytes),
            Some(vec![
                ("lease".into(), 3),
                ("lease".into(), 0),
                ("other".into(), 7)
            ])
        );
        assert_eq!(assigned_partitions(&assignment(0, &[], None)), Some(vec![]));
    }

    #[test]
    fn refuses_what_is_not_an_assignment() {
        let bytes = assignment(3, &[("lease", &[1, 2])], None);
        // Cut inside the partitions: not half an answer.
        assert_eq!(assigned_partitions(&bytes[..bytes.len() - 9]), None);
        assert_eq!(
            assigned_partitions(&assignment(9, &[("t", &[1])], None)),
            None
        );
        assert_eq!(assigned_partitions(&[]), None);
    }
}
