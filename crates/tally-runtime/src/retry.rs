//! Waiting for services: what is worth a retry and what is not, and the waits themselves.
//!
//! A failure is [`Failure::Transient`] (a service down or slow: waited out with backoff) or
//! [`Failure::Permanent`] (a refusal no retry cures: a wrong password, a fenced producer, another
//! writer): the crates' own error types say which ([`tally_kafka::Error::Refused`],
//! [`tally_clickhouse::SinkError::Server`]), and the cause chain stays for the log line.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use tally_clickhouse::ClickHouseSink;
use tokio::runtime::Handle;

/// The longest wait between two attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// The run was asked to stop while waiting on a service.
#[derive(Debug, thiserror::Error)]
#[error("stopped while waiting for {0}")]
pub struct Interrupted(pub &'static str);

/// Why a step failed, by what a retry can do about it.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// Worth retrying: the service is down, slow or restarting.
    #[error("{0:#}")]
    Transient(anyhow::Error),
    /// No retry cures it.
    #[error("{0:#}")]
    Permanent(anyhow::Error),
}

impl Failure {
    pub fn transient(e: impl Into<anyhow::Error>) -> Failure {
        Failure::Transient(e.into())
    }

    pub fn permanent(e: impl Into<anyhow::Error>) -> Failure {
        Failure::Permanent(e.into())
    }

    pub fn into_error(self) -> anyhow::Error {
        match self {
            Failure::Transient(e) | Failure::Permanent(e) => e,
        }
    }
}

impl From<tally_kafka::Error> for Failure {
    fn from(e: tally_kafka::Error) -> Failure {
        match e {
            tally_kafka::Error::Refused(_) => Failure::permanent(e),
            e => Failure::transient(e),
        }
    }
}

impl From<tally_clickhouse::SinkError> for Failure {
    fn from(e: tally_clickhouse::SinkError) -> Failure {
        match e {
            tally_clickhouse::SinkError::Server { .. } => Failure::transient(e),
            e => Failure::permanent(e),
        }
    }
}

impl From<tally_state::StateError> for Failure {
    fn from(e: tally_state::StateError) -> Failure {
        Failure::permanent(e)
    }
}

/// Sleeps `duration`, or less if a stop is asked for meanwhile ([`Interrupted`]).
pub fn sleep_unless_stopped(
    shutdown: &AtomicBool,
    duration: Duration,
    what: &'static str,
) -> Result<(), Interrupted> {
    let until = Instant::now() + duration;
    while Instant::now() < until {
        if shutdown.load(Ordering::SeqCst) {
            return Err(Interrupted(what));
        }
        std::thread::sleep(
            Duration::from_millis(50).min(until.saturating_duration_since(Instant::now())),
        );
    }
    Ok(())
}

/// Retries `f` with backoff while it fails transiently, until it succeeds, fails permanently,
/// or a stop is asked for ([`Interrupted`], with the last failure as its context).
pub fn wait_for<T>(
    service: &'static str,
    shutdown: &AtomicBool,
    mut f: impl FnMut() -> Result<T, Failure>,
) -> anyhow::Result<T> {
    let mut backoff = Duration::from_millis(200);
    let mut attempt = 0u32;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(Failure::Permanent(e)) => return Err(e),
            Err(Failure::Transient(error)) => {
                attempt += 1;
                tracing::warn!(service, attempt, error = %format!("{error:#}"), "waiting for {service}");
                sleep_unless_stopped(shutdown, backoff, service)
                    .map_err(|_| anyhow!(Interrupted(service)).context(format!("{error:#}")))?;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Connects to ClickHouse (the first replica of `clickhouse.url` that answers), waiting while
/// none does; a refused connection (a bad certificate or password) stops at once.
pub fn connect_clickhouse(
    replicas: &[tally_clickhouse::SinkSettings],
    rt: &Handle,
    shutdown: &AtomicBool,
) -> anyhow::Result<ClickHouseSink> {
    wait_for("clickhouse", shutdown, || {
        Ok(rt.block_on(ClickHouseSink::connect_first(replicas))?)
    })
}

/// Connects to one ClickHouse server, waiting while it is unreachable.
pub fn connect_replica(
    settings: &tally_clickhouse::SinkSettings,
    rt: &Handle,
    shutdown: &AtomicBool,
) -> anyhow::Result<ClickHouseSink> {
    wait_for("clickhouse", shutdown, || {
        Ok(rt.block_on(ClickHouseSink::connect(settings))?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_returned_and_an_outage_waited_out() {
        let stop = AtomicBool::new(false);
        let mut attempts = 0;
        let got = wait_for("kafka", &stop, || {
            attempts += 1;
            if attempts < 2 {
                Err(tally_kafka::Error::Other("broker down".into()).into())
            } else {
                Ok(attempts)
            }
        });
        assert_eq!(got.ok(), Some(2));
        let refused = wait_for::<()>("kafka", &stop, || {
            Err(tally_kafka::Error::Refused("wrong password".into()).into())
        });
        assert!(
            refused.is_err_and(|e| e.to_string().contains("wrong password")),
            "a permanent failure is not retried"
        );
        stop.store(true, Ordering::SeqCst);
        let stopped = wait_for::<()>("clickhouse", &stop, || {
            Err(Failure::transient(anyhow!("connection refused")))
        });
        assert!(stopped.is_err_and(|e| e.is::<Interrupted>()));
    }
}
