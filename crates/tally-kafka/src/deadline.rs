//! A librdkafka call that can block past its own timeouts (librdkafka 5456, 5511: a
//! coordinator request whose timeout is never checked) runs on a thread of its own, and is given
//! up at a deadline: the caller goes on, the thread and what it holds are left to finish or not.

use std::time::Duration;

/// Runs `f` on a thread named `name` and waits at most `deadline` for its result.
pub(crate) fn with_deadline<T: Send + 'static>(
    name: &str,
    deadline: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            // The receiver is gone once the deadline passed: nothing waits for the result.
            let _ = sender.send(f());
        })
        .map_err(|e| format!("starting a thread: {e}"))?;
    receiver
        .recv_timeout(deadline)
        .map_err(|_| format!("no answer after {deadline:?}; given up"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_past_its_deadline_is_given_up_and_one_within_it_answers() {
        assert_eq!(with_deadline("t", Duration::from_secs(5), || 7), Ok(7));
        let started = std::time::Instant::now();
        let blocked = with_deadline("t", Duration::from_millis(50), || {
            std::thread::sleep(Duration::from_secs(3));
        });
        assert!(blocked.is_err_and(|e| e.contains("no answer after 50ms")));
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "waited for the call"
        );
    }
}
