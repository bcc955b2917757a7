//! How a job's clients connect: the brokers and librdkafka settings, checked once at the start.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::error::{Error, Result, kafka};

/// Sets `key` unless the user's pass-through settings already did.
pub(crate) fn set_default(config: &mut ClientConfig, key: &str, value: &str) {
    if config.get(key).is_none() {
        config.set(key, value);
    }
}

/// Connection settings shared by every Kafka client of a job.
#[derive(Debug, Clone, Default)]
pub struct KafkaSettings {
    pub brokers: String,
    /// librdkafka properties passed through as they are (TLS, SASL, tuning).
    pub client: BTreeMap<String, String>,
}

impl KafkaSettings {
    pub fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        // A broker killed on a cluster: a consumer fetching from it found the partitions'
        // new leaders only at its next metadata refresh, 5 minutes by default, and read
        // nothing meanwhile (bench.sh --cluster-faults: no epoch for 300 s; 5.8 s with 10 s).
        config.set("topic.metadata.refresh.interval.ms", "10000");
        for (k, v) in &self.client {
            config.set(k, v);
        }
        config
    }
}

/// Collects what librdkafka reports in the background (handshake and authentication
/// failures only show up there).
#[derive(Default)]
struct ErrorCapture {
    last: std::sync::Mutex<Option<(KafkaError, String)>>,
}

impl rdkafka::ClientContext for ErrorCapture {
    fn error(&self, error: KafkaError, reason: &str) {
        if let Ok(mut last) = self.last.lock() {
            *last = Some((error, reason.to_owned()));
        }
    }
}

impl rdkafka::consumer::ConsumerContext for ErrorCapture {}

/// Whether a background error means the configuration can never connect.
fn is_permanent(error: &KafkaError, reason: &str) -> bool {
    let code = error.rdkafka_error_code();
    matches!(
        code,
        Some(
            RDKafkaErrorCode::Authentication
                | RDKafkaErrorCode::SaslAuthenticationFailed
                | RDKafkaErrorCode::SSL
        )
    ) || [
        "SSL handshake failed",
        "certificate verify failed",
        "Authentication failed",
        "SASL authentication error",
    ]
    .iter()
    .any(|needle| reason.contains(needle))
}

impl KafkaSettings {
    /// How this job connects, for error messages: brokers, protocol and SASL user, never secrets.
    pub fn describe(&self) -> String {
        let protocol = self
            .client
            .get("security.protocol")
            .map(String::as_str)
            .unwrap_or("plaintext");
        match self.client.get("sasl.username") {
            Some(user) => format!("{} ({protocol}, user {user})", self.brokers),
            None => format!("{} ({protocol})", self.brokers),
        }
    }
}

/// Connects and reads the cluster's metadata: the partition count of every topic. A failure no
/// retry can cure (TLS handshake, authentication) is `Refused`, naming the connection and
/// librdkafka's reason; a broker that is only down or slow gives a retryable error.
pub fn check_connection(
    settings: &KafkaSettings,
    timeout: Duration,
) -> Result<BTreeMap<String, usize>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let mut config = settings.client_config();
    config.set("group.id", "tally-connection-check");
    let consumer: BaseConsumer<ErrorCapture> = config
        .create_with_context(ErrorCapture::default())
        .map_err(kafka(format!(
            "configuring a client for {}",
            settings.describe()
        )))?;
    let result = consumer.fetch_metadata(None, timeout);
    let mut background = None;
    if result.is_err() {
        // Background errors reach the context only while the client is polled.
        for _ in 0..20 {
            let _ = consumer.poll(Duration::from_millis(100));
            background = consumer
                .context()
                .last
                .lock()
                .ok()
                .and_then(|mut l| l.take());
            if background.is_some() {
                break;
            }
        }
    }
    match (result, background) {
        (Ok(metadata), _) => Ok(partition_counts(&metadata)),
        (Err(_), Some((error, reason))) if is_permanent(&error, &reason) => {
            Err(Error::Refused(format!(
                "{}: cannot connect: {reason} ({error}); check kafka.client's ssl.* and sasl.* settings",
                settings.describe()
            )))
        }
        (Err(error), Some((_, reason))) => Err(Error::Other(format!(
            "{}: {error}: {reason}",
            settings.describe()
        ))),
        (Err(error), None) => Err(Error::Kafka {
            context: format!("connecting to {}", settings.describe()),
            source: error,
        }),
    }
}

/// The partition count of every topic in `metadata` that the broker described without error.
pub(crate) fn partition_counts(metadata: &rdkafka::metadata::Metadata) -> BTreeMap<String, usize> {
    metadata
        .topics()
        .iter()
        .filter(|t| t.error().is_none())
        .map(|t| (t.name().to_owned(), t.partitions().len()))
        .collect()
}
