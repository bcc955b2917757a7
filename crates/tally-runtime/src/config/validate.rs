//! The checks a job file passes before anything starts, each naming the key it refuses.

use std::net::SocketAddr;

use super::{Config, FieldsConfig, Millis, is_table_name};

impl Config {
    pub(super) fn validate(&self) -> Result<(), (&'static str, String)> {
        let w = &self.window;
        if w.size.0 <= 0 {
            return Err(("window.size", "must be greater than zero".into()));
        }
        if w.size.0 % 1000 != 0 || w.allowed_lateness.0 % 1000 != 0 {
            return Err((
                if w.size.0 % 1000 != 0 {
                    "window.size"
                } else {
                    "window.allowed_lateness"
                },
                "must be a whole number of seconds (ClickHouse DateTime has second resolution)"
                    .into(),
            ));
        }
        if self.job.version == 0 {
            return Err(("job.version", "must be 1 or more (1 when absent)".into()));
        }
        if let Some(at) = &self.job.restate_from {
            if tally_core::time::parse_rfc3339_ms(at).is_none() {
                return Err((
                    "job.restate_from",
                    format!("{at:?} is not an RFC 3339 time such as \"2026-12-01T00:00:00Z\""),
                ));
            }
            if self.job.version == 1 {
                return Err((
                    "job.restate_from",
                    "only a new version of a job restates its history: raise job.version above the running one's".into(),
                ));
            }
        }
        // A job of changes names its rows by primary key and keeps no event ids.
        let changes = self.declared.format.is_changes();
        let dedup = !changes;
        let framed = self.declared.format.is_framed();
        if framed && self.registry.url.is_none() {
            return Err((
                "registry.url",
                "missing: a job of Avro or Protobuf records reads its writer schemas from a schema registry (its Confluent-compatible API)".into(),
            ));
        }
        if !framed && (self.registry.url.is_some() || self.registry.subject.is_some()) {
            return Err((
                "registry",
                "only a job of Avro or Protobuf records (aggregation.format = \"avro\" or \"protobuf\") reads a schema registry".into(),
            ));
        }
        if !changes && !self.source.is_empty() {
            return Err((
                "source",
                "only a job of change events (aggregation.format = \"debezium-json\") reads a source database".into(),
            ));
        }
        if let Some(url) = &self.source.postgres {
            let Some(rest) = url
                .strip_prefix("postgres://")
                .or_else(|| url.strip_prefix("postgresql://"))
            else {
                return Err((
                    "source.postgres",
                    format!("{url:?} is not a postgres://user@host:port/database URL"),
                ));
            };
            let authority = rest.split('/').next().unwrap_or_default();
            if authority
                .split('@')
                .next()
                .is_some_and(|user| user.contains(':'))
                && authority.contains('@')
            {
                return Err((
                    "source.postgres",
                    "holds a password: put it in source.password (or TALLY_SOURCE__PASSWORD) so that it never shows in logs".into(),
                ));
            }
        }
        for (key, value) in [
            ("source.table", &self.source.table),
            ("source.signal_table", &self.source.signal_table),
        ] {
            if let Some(name) = value
                && !is_table_name(name)
            {
                return Err((
                    key,
                    format!("{name:?} is not schema.table of letters, digits and '_'"),
                ));
            }
        }
        if dedup && w.dedup_horizon.0 < w.size.0 + w.allowed_lateness.0 {
            return Err((
                "window.dedup_horizon",
                format!(
                    "{} is shorter than window.size + window.allowed_lateness ({}); a duplicate could then be aggregated twice",
                    w.dedup_horizon,
                    Millis(w.size.0 + w.allowed_lateness.0)
                ),
            ));
        }
        if self.job.checkpoint_interval.0 <= 0 {
            return Err((
                "job.checkpoint_interval",
                "must be greater than zero".into(),
            ));
        }
        if self.job.name.is_empty()
            || !self
                .job
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err((
                "job.name",
                format!(
                    "{:?} must be non-empty and use only letters, digits, '_' and '-'",
                    self.job.name
                ),
            ));
        }
        if self.clickhouse.fold_interval.0 < 0 {
            return Err((
                "clickhouse.fold_interval",
                "must not be negative (\"0s\" turns folding off)".into(),
            ));
        }
        if let Some(retention) = self.clickhouse.retention
            && retention.0 < w.size.0 + w.allowed_lateness.0
        {
            return Err((
                "clickhouse.retention",
                format!(
                    "{retention} is shorter than window.size + window.allowed_lateness ({}): windows would be dropped before they are final",
                    Millis(w.size.0 + w.allowed_lateness.0)
                ),
            ));
        }
        within(
            "job.max_epochs_in_flight",
            self.job.max_epochs_in_flight,
            1..=4,
            "each epoch in flight holds its changes in memory",
        )?;
        within(
            "clickhouse.fold_step_rows",
            self.clickhouse.fold_step_rows,
            1..=u64::MAX,
            "versions one fold step groups in the server's memory",
        )?;
        within(
            "job.state_memory_mib",
            self.job.state_memory_mib,
            16..=65_536,
            "MiB of RocksDB memtables and block cache",
        )?;
        // The broker's default bounds (group.min/max.session.timeout.ms).
        if !(6_000..=1_800_000).contains(&self.job.session_timeout.0) {
            return Err((
                "job.session_timeout",
                "must be between 6s and 30m (the broker's default bounds)".into(),
            ));
        }
        if self.job.max_record_bytes == 0 {
            return Err(("job.max_record_bytes", "must be greater than zero".into()));
        }
        if self.job.standby_replicas > 1024 {
            return Err((
                "job.standby_replicas",
                format!("{} is outside 0..=1024", self.job.standby_replicas),
            ));
        }
        if !(1..=1024).contains(&self.job.tasks) {
            return Err((
                "job.tasks",
                format!("{} is outside 1..=1024", self.job.tasks),
            ));
        }
        for (key, value) in [
            ("kafka.brokers", &self.kafka.brokers),
            ("kafka.source_topic", &self.kafka.source_topic),
            ("kafka.consumer_group", &self.kafka.consumer_group),
            ("clickhouse.url", &self.clickhouse.url),
        ] {
            if value.trim().is_empty() {
                return Err((key, "must not be empty".into()));
            }
        }
        let urls = self.clickhouse_urls();
        for url in &urls {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err((
                    "clickhouse.url",
                    format!(
                        "{url:?} must start with http:// or https:// (the HTTP interface, e.g. port 8123, or 8443 for TLS)"
                    ),
                ));
            }
        }
        if urls.len() != urls.iter().collect::<std::collections::BTreeSet<_>>().len() {
            return Err(("clickhouse.url", "lists a server twice".into()));
        }
        match self.clickhouse.cluster.as_deref().map(str::trim) {
            None if urls.len() > 1 => {
                return Err((
                    "clickhouse.url",
                    format!(
                        "lists {} servers: name the cluster they are the replicas of in clickhouse.cluster",
                        urls.len()
                    ),
                ));
            }
            Some(cluster)
                if cluster.is_empty()
                    || !cluster
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) =>
            {
                return Err((
                    "clickhouse.cluster",
                    format!("{cluster:?} is not a cluster name (letters, digits, _ - .)"),
                ));
            }
            _ => {}
        }
        if self.clickhouse.ca_file.is_some() && !urls.iter().all(|u| u.starts_with("https://")) {
            return Err((
                "clickhouse.ca_file",
                "is only used with an https:// clickhouse.url".into(),
            ));
        }
        if self.kafka.topic_replication_factor.is_some_and(|r| r < 1) {
            return Err((
                "kafka.topic_replication_factor",
                "must be at least 1 (leave it out for the broker's default)".into(),
            ));
        }
        if self.dlq_topic() == self.kafka.source_topic {
            return Err((
                "kafka.dlq_topic",
                "must differ from kafka.source_topic".into(),
            ));
        }
        if [&self.kafka.source_topic, &self.dlq_topic()].contains(&&self.changelog_topic()) {
            return Err((
                "kafka.changelog_topic",
                "must differ from kafka.source_topic and kafka.dlq_topic".into(),
            ));
        }
        if let Err(e) =
            tally_clickhouse::TableNames::new(&self.clickhouse.database, &self.clickhouse.table)
        {
            return Err(("clickhouse.table", e.to_string()));
        }
        if !self.metrics.address.is_empty() && self.metrics.address.parse::<SocketAddr>().is_err() {
            return Err((
                "metrics.address",
                format!(
                    "{:?} is not an address like 127.0.0.1:9464",
                    self.metrics.address
                ),
            ));
        }
        Ok(())
    }
}

impl FieldsConfig {
    pub(super) fn validate(&self) -> Result<(), (&'static str, String)> {
        for (key, field) in [
            ("fields.event_id", &self.event_id),
            ("fields.customer_id", &self.customer_id),
            ("fields.currency", &self.currency),
            ("fields.amount", &self.amount),
            ("fields.event_time", &self.event_time),
        ] {
            if field.is_empty() {
                return Err((key, "must not be empty".into()));
            }
            // A declaration reads a dotted path as nested keys.
            if field.contains('.') {
                return Err((
                    key,
                    format!(
                        "{field:?}: [fields] names top-level keys; declare a nested field's path in [[aggregation.field]]"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// A setting outside its range, named with the range and why it is bounded.
fn within(
    key: &'static str,
    value: u64,
    range: std::ops::RangeInclusive<u64>,
    why: &str,
) -> Result<(), (&'static str, String)> {
    if range.contains(&value) {
        return Ok(());
    }
    let (low, high) = range.into_inner();
    Err((key, format!("{value} is outside {low}..={high} ({why})")))
}
