//! A thread that runs beside the worker until its guard is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use anyhow::{Context, Result};

/// Owns a named thread and the flag that asks it to stop. Dropping it sets the flag and joins
/// the thread, so nothing it does outlives its owner.
pub(crate) struct Background {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    name: &'static str,
}

impl Background {
    /// Starts `body` on a thread called `name`; `body` returns once `stop` is set.
    pub(crate) fn spawn(
        name: &'static str,
        stop: Arc<AtomicBool>,
        body: impl FnOnce() + Send + 'static,
    ) -> Result<Background> {
        let thread = crate::job_scope::spawn(std::thread::Builder::new().name(name.into()), body)
            .with_context(|| format!("starting the {name} thread"))?;
        Ok(Background {
            stop,
            thread: Some(thread),
            name,
        })
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::warn!(thread = self.name, "a background thread panicked");
        }
    }
}
