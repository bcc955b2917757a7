//! The metrics address serves `/metrics` (Prometheus), `/health` (the process is alive) and
//! `/ready` (restored from its checkpoint, any pre-committed epoch completed, sinks reachable).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::job_scope::JOB_LABEL;

const FAILED: &str = "stopped: the job ended with an error (see the log)";

/// What `/ready` reports; the worker sets it.
#[derive(Debug, Default)]
pub struct Readiness {
    restored: AtomicBool,
    sinks_failing: AtomicBool,
    standby: AtomicBool,
    /// The job ended with an error while others of the process run on.
    failed: AtomicBool,
}

impl Readiness {
    pub fn set_restored(&self) {
        self.restored.store(true, Ordering::SeqCst);
    }

    pub fn set_sinks_failing(&self, failing: bool) {
        self.sinks_failing.store(failing, Ordering::SeqCst);
    }

    /// Another worker runs the job; this one is healthy and waits to take it over.
    pub fn set_standby(&self, standby: bool) {
        self.standby.store(standby, Ordering::SeqCst);
        metrics::gauge!("tally_worker_standby").set(if standby { 1.0 } else { 0.0 });
    }

    pub fn set_failed(&self) {
        self.failed.store(true, Ordering::SeqCst);
    }

    pub fn is_standby(&self) -> bool {
        self.standby.load(Ordering::SeqCst)
    }

    /// For a worker running several tasks, each with its own readiness: restored once every
    /// task is, failing while any task's sink is.
    pub fn aggregate<'a>(&self, tasks: impl IntoIterator<Item = &'a Readiness>) {
        let (mut restored, mut failing) = (true, false);
        for task in tasks {
            restored &= task.restored.load(Ordering::SeqCst);
            failing |= task.sinks_failing.load(Ordering::SeqCst);
        }
        self.restored.store(restored, Ordering::SeqCst);
        self.sinks_failing.store(failing, Ordering::SeqCst);
    }

    /// `Ok` when ready, else why not.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.failed.load(Ordering::SeqCst) {
            return Err(FAILED);
        }
        if !self.restored.load(Ordering::SeqCst) {
            return Err(
                "restoring: the checkpoint is not restored or a pre-committed epoch is not completed yet",
            );
        }
        if self.sinks_failing.load(Ordering::SeqCst) {
            return Err("a sink is failing: commits are being retried");
        }
        Ok(())
    }
}

fn response(status: &str, content_type: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// What `/ready` says of one job: `Ok` with "ready" or "standby", or why not.
fn job_status(readiness: &Readiness) -> Result<&'static str, &'static str> {
    // A standby is ready in its own way: healthy, waiting to take the job over.
    if readiness.is_standby() && !readiness.failed.load(Ordering::SeqCst) {
        return Ok("standby");
    }
    readiness.check().map(|()| "ready")
}

/// The answer to one request line, e.g. `GET /ready HTTP/1.1`, for the process's `jobs`
/// (name, readiness). With several jobs `/ready` is 200 only while every job is, and names
/// each job's status.
pub fn route(
    request_line: &str,
    jobs: &[(&str, &Readiness)],
    metrics: impl FnOnce() -> String,
) -> String {
    let path = request_line.split_whitespace().nth(1).unwrap_or("");
    let path = path.split('?').next().unwrap_or("");
    match path {
        "/metrics" => response("200 OK", "text/plain; version=0.0.4", &metrics()),
        "/health" => response("200 OK", "text/plain", "ok\n"),
        "/ready" => {
            let statuses: Vec<(&str, Result<&str, &str>)> = jobs
                .iter()
                .map(|(name, r)| (*name, job_status(r)))
                .collect();
            let all_ready = statuses.iter().all(|(_, s)| s.is_ok());
            let body = match statuses.as_slice() {
                [(_, one)] => format!("{}\n", one.unwrap_or_else(|why| why)),
                several => several
                    .iter()
                    .map(|(name, s)| format!("{name}: {}\n", s.unwrap_or_else(|why| why)))
                    .collect(),
            };
            if all_ready {
                response("200 OK", "text/plain", &body)
            } else {
                response("503 Service Unavailable", "text/plain", &body)
            }
        }
        _ => response(
            "404 Not Found",
            "text/plain",
            "try /metrics, /health or /ready\n",
        ),
    }
}

/// Installs the Prometheus recorder, every series labelled with the job of the thread that
/// registers it; `fallback` labels the series of no job's thread (a process of one job).
pub fn install_recorder(fallback: Option<String>) -> Result<PrometheusHandle> {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(crate::job_scope::JobLabelled {
        inner: recorder,
        fallback,
    })
    .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    Ok(handle)
}

/// The recorder for a process of one job, and its three paths on `address` (empty: none).
pub async fn serve(address: &str, jobs: Vec<(String, Arc<Readiness>)>) -> Result<()> {
    if address.is_empty() {
        return Ok(());
    }
    // One job: a series of no job's thread (the process's memory) is the job's too.
    let fallback = match jobs.as_slice() {
        [(name, _)] => Some(name.clone()),
        _ => None,
    };
    let handle = install_recorder(fallback)?;
    serve_at(address, handle, jobs, false).await
}

/// Series of `handle`'s rendering `text` that belong to one of `jobs` (`tally_job`), or to no
/// job (the process's own).
pub fn only_jobs(text: &str, jobs: &[&str]) -> String {
    let label = format!("{JOB_LABEL}=\"");
    text.lines()
        .filter(|line| {
            line.starts_with('#')
                || line.split_once(&label).is_none_or(|(_, rest)| {
                    rest.split_once('"')
                        .is_some_and(|(job, _)| jobs.contains(&job))
                })
        })
        .fold(String::new(), |mut out, line| {
            out.push_str(line);
            out.push('\n');
            out
        })
}

/// Serves `/metrics`, `/health` and `/ready` on `address` for `jobs`; with `only_these`, the
/// series of the process's other jobs (served on their own addresses) are left out.
pub async fn serve_at(
    address: &str,
    handle: PrometheusHandle,
    jobs: Vec<(String, Arc<Readiness>)>,
    only_these: bool,
) -> Result<()> {
    let addr: std::net::SocketAddr = address
        .parse()
        .with_context(|| format!("metrics.address {address:?}"))?;
    let jobs = Arc::new(jobs);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on metrics.address {addr}"))?;
    tracing::info!(%addr, "metrics at http://{addr}/metrics, health at /health and /ready");
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let handle = handle.clone();
            let jobs = jobs.clone();
            tokio::spawn(async move {
                // Read the request head, which may arrive in several segments.
                let mut buf = vec![0u8; 4096];
                let mut n = 0;
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
                while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    match tokio::time::timeout_at(deadline, stream.read(&mut buf[n..])).await {
                        Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
                        Ok(Ok(read)) => n += read,
                    }
                }
                let text = String::from_utf8_lossy(&buf[..n]);
                let line = text.lines().next().unwrap_or("");
                let jobs: Vec<(&str, &Readiness)> =
                    jobs.iter().map(|(n, r)| (n.as_str(), r.as_ref())).collect();
                let answer = route(line, &jobs, || {
                    let all = handle.render();
                    if only_these {
                        let names: Vec<&str> = jobs.iter().map(|(n, _)| *n).collect();
                        only_jobs(&all, &names)
                    } else {
                        all
                    }
                });
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_of_several_tasks_is_ready_once_every_task_is() {
        let (worker, a, b) = (
            Readiness::default(),
            Readiness::default(),
            Readiness::default(),
        );
        a.set_restored();
        worker.aggregate([&a, &b]);
        assert!(worker.check().is_err(), "task b is still restoring");
        b.set_restored();
        worker.aggregate([&a, &b]);
        assert!(worker.check().is_ok());
        b.set_sinks_failing(true);
        worker.aggregate([&a, &b]);
        assert_eq!(
            worker.check(),
            Err("a sink is failing: commits are being retried")
        );
    }

    #[test]
    fn ready_only_once_restored_and_while_sinks_work() {
        let r = Readiness::default();
        let job = [("revenue_agg", &r)];
        assert!(route("GET /health HTTP/1.1", &job, String::new).starts_with("HTTP/1.1 200"));
        let not_yet = route("GET /ready HTTP/1.1", &job, String::new);
        assert!(not_yet.starts_with("HTTP/1.1 503"), "{not_yet}");
        assert!(not_yet.contains("restoring"));
        r.set_restored();
        assert!(route("GET /ready HTTP/1.1", &job, String::new).starts_with("HTTP/1.1 200"));
        r.set_sinks_failing(true);
        let failing = route("GET /ready HTTP/1.1", &job, String::new);
        assert!(failing.contains("a sink is failing"), "{failing}");
        r.set_sinks_failing(false);
        assert!(route("GET /ready?x=1 HTTP/1.1", &job, String::new).starts_with("HTTP/1.1 200"));
        let m = route("GET /metrics HTTP/1.1", &job, || "tally_epoch 3\n".into());
        assert!(m.ends_with("tally_epoch 3\n") && m.contains("Content-Length: 14"));
        assert!(route("GET /nope HTTP/1.1", &job, String::new).starts_with("HTTP/1.1 404"));
    }

    #[test]
    fn with_several_jobs_ready_names_each_and_waits_for_all() {
        let (a, b) = (Readiness::default(), Readiness::default());
        a.set_restored();
        b.set_standby(true);
        let jobs = [("orders", &a), ("page_views", &b)];
        let ready = route("GET /ready HTTP/1.1", &jobs, String::new);
        assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
        assert!(
            ready.ends_with("orders: ready\npage_views: standby\n"),
            "{ready}"
        );
        b.set_standby(false);
        b.set_failed();
        let failed = route("GET /ready HTTP/1.1", &jobs, String::new);
        assert!(failed.starts_with("HTTP/1.1 503"), "{failed}");
        assert!(
            failed.ends_with(
                "orders: ready\npage_views: stopped: the job ended with an error (see the log)\n"
            ),
            "{failed}"
        );
    }

    #[test]
    fn an_address_of_some_jobs_serves_their_series_and_the_process_s() {
        let text = "# TYPE tally_epoch gauge\n\
                    tally_epoch{tally_job=\"orders\"} 3\n\
                    tally_epoch{tally_job=\"page_views\",task=\"1\"} 4\n\
                    tally_memory_bytes{part=\"rss\"} 9\n";
        assert_eq!(
            only_jobs(text, &["page_views"]),
            "# TYPE tally_epoch gauge\n\
             tally_epoch{tally_job=\"page_views\",task=\"1\"} 4\n\
             tally_memory_bytes{part=\"rss\"} 9\n"
        );
    }
}
