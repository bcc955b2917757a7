//! The Produced → Accepted hop on a cluster: every topic a job uses, partition by partition.

use super::Status;

/// What the replication of a job's topics says of the Produced → Accepted hop.
pub(super) struct Verdict {
    pub(super) status: Status,
    pub(super) evidence: String,
}

/// PASS when every topic has two replicas or more, a min ISR of two or more, and every
/// partition all its replicas in sync; WARN when a partition lost a replica but keeps its min
/// ISR (a broker down: acknowledged records have one copy fewer), or on a cluster that cannot
/// keep a record through a broker's loss (one broker); FAIL naming each partition below its
/// min ISR (writes to it are refused, and what it holds has fewer copies than promised).
pub(super) fn replication_verdict(topics: &[(String, tally_kafka::TopicDurability)]) -> Verdict {
    let (mut below, mut behind, mut weak) = (Vec::new(), Vec::new(), Vec::new());
    let mut evidence = Vec::new();
    for (name, d) in topics {
        let min_isr = d.min_insync_replicas.unwrap_or(1);
        if d.replication_factor < 2 || min_isr < 2 {
            weak.push(name.as_str());
        }
        let mut shown = Vec::new();
        for p in &d.partitions {
            shown.push(format!("p{}={}/{}", p.partition, p.in_sync, p.replicas));
            if (p.in_sync as i64) < min_isr {
                below.push(format!(
                    "{name} partition {}: {} of {} replicas in sync, below min.insync.replicas {min_isr}",
                    p.partition, p.in_sync, p.replicas
                ));
            } else if p.in_sync < p.replicas {
                behind.push(format!("{name} partition {}", p.partition));
            }
        }
        evidence.push(format!(
            "{name}: replication factor {}, min.insync.replicas {min_isr}, in sync {}",
            d.replication_factor,
            shown.join(" ")
        ));
    }
    let brokers = topics.first().map_or(0, |(_, d)| d.brokers);
    let mut text = format!("{} broker(s); {}", brokers, evidence.join("; "));
    let status = if !below.is_empty() {
        text = format!("{}; {text}", below.join("; "));
        Status::Fail
    } else if !behind.is_empty() {
        text = format!(
            "a replica is out of sync (a broker down or catching up), min ISR still held: {}; {text}",
            behind.join(", ")
        );
        Status::Warn
    } else if !weak.is_empty() {
        text = format!(
            "{text}; {} cannot keep a record through a broker's loss: with acks=all a record is acknowledged once on one broker, and that broker's loss loses it",
            weak.join(", ")
        );
        Status::Warn
    } else {
        Status::Pass
    };
    Verdict {
        status,
        evidence: text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_kafka::{PartitionReplicas, TopicDurability};

    fn topic(
        name: &str,
        brokers: usize,
        min_isr: i64,
        isr: &[(usize, usize)],
    ) -> (String, TopicDurability) {
        (
            name.to_owned(),
            TopicDurability {
                brokers,
                replication_factor: isr.iter().map(|p| p.1).min().unwrap_or(0),
                min_insync_replicas: Some(min_isr),
                retention_ms: None,
                partitions: isr
                    .iter()
                    .enumerate()
                    .map(|(i, &(in_sync, replicas))| PartitionReplicas {
                        partition: i as i32,
                        replicas,
                        in_sync,
                    })
                    .collect(),
            },
        )
    }

    #[test]
    fn replication_passes_warns_and_fails_by_partition() {
        let healthy = [
            topic("orders", 3, 2, &[(3, 3), (3, 3)]),
            topic("orders.dlq", 3, 2, &[(3, 3)]),
        ];
        let v = replication_verdict(&healthy);
        assert_eq!(v.status, Status::Pass, "{}", v.evidence);
        assert!(
            v.evidence.contains(
                "orders.dlq: replication factor 3, min.insync.replicas 2, in sync p0=3/3"
            ),
            "{}",
            v.evidence
        );

        let broker_down = [topic("orders", 3, 2, &[(2, 3), (3, 3)]), healthy[1].clone()];
        let v = replication_verdict(&broker_down);
        assert_eq!(v.status, Status::Warn, "{}", v.evidence);
        assert!(v.evidence.contains("orders partition 0"), "{}", v.evidence);

        let below = [healthy[0].clone(), topic("orders.dlq", 3, 2, &[(1, 3)])];
        let v = replication_verdict(&below);
        assert_eq!(v.status, Status::Fail, "{}", v.evidence);
        assert!(
            v.evidence.contains(
                "orders.dlq partition 0: 1 of 3 replicas in sync, below min.insync.replicas 2"
            ),
            "{}",
            v.evidence
        );

        let one_broker = [topic("orders", 1, 1, &[(1, 1)])];
        let v = replication_verdict(&one_broker);
        assert_eq!(v.status, Status::Warn, "{}", v.evidence);
        assert!(
            v.evidence.contains("cannot keep a record"),
            "{}",
            v.evidence
        );
    }
}
