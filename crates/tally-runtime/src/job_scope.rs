//! Which job a thread works for. A process running several jobs labels each series with the
//! job that emitted it (`tally_job`) and prefixes each log line with it: every thread of a
//! job's runtime is the job's, and a thread the job starts inherits it
//! ([`spawn`](spawn)).

use std::cell::RefCell;
use std::sync::Arc;

use metrics::{
    Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString, Unit,
};

/// The label every series carries with its job's name, so that one dashboard and one set of
/// alerts serve every job a Prometheus scrapes (`job` itself is Prometheus's scrape job).
pub const JOB_LABEL: &str = "tally_job";

thread_local! {
    static JOB: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
    /// The log span of the job, entered for the thread's life; dropped before the thread's
    /// own state goes (`leave`).
    static SPAN: RefCell<Option<tracing::span::EnteredSpan>> = const { RefCell::new(None) };
}

/// How a process names its jobs in what it reports.
#[derive(Debug, Clone)]
pub struct JobScope {
    job: Arc<str>,
    /// Several jobs share the process: log lines name the job.
    several: bool,
}

impl JobScope {
    pub fn new(job: &str, several: bool) -> JobScope {
        JobScope {
            job: job.into(),
            several,
        }
    }

    /// Marks this thread as working for the job until [`leave`].
    pub fn enter(&self) {
        JOB.with(|j| *j.borrow_mut() = Some(self.job.clone()));
        if self.several {
            let span = tracing::info_span!("job", job = %self.job).entered();
            SPAN.with(|s| *s.borrow_mut() = Some(span));
        }
    }

    /// The scope of the job this thread works for, if any.
    pub fn current() -> Option<JobScope> {
        let job = JOB.with(|j| j.borrow().clone())?;
        let several = SPAN.with(|s| s.borrow().is_some());
        Some(JobScope { job, several })
    }

    /// A multi-threaded runtime whose every thread works for the job.
    pub fn runtime(&self, worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
        let scope = self.clone();
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads)
            .enable_all()
            .on_thread_start(move || scope.enter())
            .on_thread_stop(leave)
            .build()
    }
}

/// Ends this thread's work for its job.
pub fn leave() {
    SPAN.with(|s| s.borrow_mut().take());
    JOB.with(|j| j.borrow_mut().take());
}

/// Starts a thread that works for the same job as this one.
pub fn spawn<F, T>(
    builder: std::thread::Builder,
    body: F,
) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let scope = JobScope::current();
    builder.spawn(move || {
        if let Some(scope) = &scope {
            scope.enter();
        }
        let out = body();
        leave();
        out
    })
}

/// A recorder that labels each series with the job of the thread registering it, or with
/// `fallback` (a process of one job) on a thread of no job. The label comes first, as the
/// Prometheus exporter's global labels do.
pub struct JobLabelled<R> {
    pub inner: R,
    pub fallback: Option<String>,
}

impl<R> JobLabelled<R> {
    fn key(&self, key: &Key) -> Key {
        let job = JOB
            .with(|j| j.borrow().as_deref().map(str::to_owned))
            .or_else(|| self.fallback.clone());
        match job {
            None => key.clone(),
            Some(job) => Key::from_parts(
                key.name().to_owned(),
                std::iter::once(Label::new(JOB_LABEL, job))
                    .chain(key.labels().cloned())
                    .collect::<Vec<_>>(),
            ),
        }
    }
}

impl<R: Recorder> Recorder for JobLabelled<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.inner.register_counter(&self.key(key), metadata)
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.inner.register_gauge(&self.key(key), metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.inner.register_histogram(&self.key(key), metadata)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_series_carries_the_job_of_its_thread_and_threads_inherit_it() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let labelled = JobLabelled {
            inner: recorder,
            fallback: None,
        };
        metrics::with_local_recorder(&labelled, || {
            metrics::counter!("tally_x_total", "reason" => "a").increment(1);
        });
        JobScope::new("orders", true).enter();
        metrics::with_local_recorder(&labelled, || {
            metrics::counter!("tally_x_total", "reason" => "a").increment(2);
        });
        // A thread the job starts is the job's too.
        let child = spawn(std::thread::Builder::new(), || {
            JobScope::current().map(|s| s.job.to_string())
        })
        .unwrap()
        .join()
        .unwrap();
        assert_eq!(child.as_deref(), Some("orders"));
        leave();
        assert!(JobScope::current().is_none());
        let text = handle.render();
        assert!(text.contains("tally_x_total{reason=\"a\"} 1"), "{text}");
        assert!(
            text.contains("tally_x_total{tally_job=\"orders\",reason=\"a\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn a_process_of_one_job_labels_every_series_with_it() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let labelled = JobLabelled {
            inner: recorder,
            fallback: Some("revenue_agg".into()),
        };
        metrics::with_local_recorder(&labelled, || metrics::gauge!("tally_epoch").set(3.0));
        assert!(
            handle
                .render()
                .contains("tally_epoch{tally_job=\"revenue_agg\"} 3"),
            "{}",
            handle.render()
        );
    }
}
