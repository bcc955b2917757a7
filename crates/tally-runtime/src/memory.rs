//! Where a worker's memory is: the process's resident set, what the allocator holds, and what
//! RocksDB's shared memtables and block cache take of it. Sampled once a second into gauges, so
//! an operator sees which part grows before the worker meets its memory limit.

use std::time::Duration;

use crate::events::MemoryMeasured;

const EVERY: Duration = Duration::from_secs(1);

/// Samples until the runtime stops.
pub async fn report() {
    let mut peak_logged = 0;
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match measure() {
            Ok(m) => {
                m.emit(m.peak_rss > peak_logged);
                peak_logged = peak_logged.max(m.peak_rss);
            }
            Err(e) => {
                tracing::debug!(error = %e, "memory statistics unavailable");
                return;
            }
        }
    }
}

pub fn measure() -> Result<MemoryMeasured, String> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| format!("reading /proc/self/status: {e}"))?;
    let (rss, peak_rss) = (
        status_kib(&status, "VmRSS:")? << 10,
        status_kib(&status, "VmHWM:")? << 10,
    );
    let allocator = |e: tikv_jemalloc_ctl::Error| format!("jemalloc statistics: {e}");
    // The allocator's statistics are a snapshot, refreshed by advancing its epoch.
    tikv_jemalloc_ctl::epoch::advance().map_err(allocator)?;
    let rocks = tally_state::shared_memory_usage();
    Ok(MemoryMeasured {
        rss,
        peak_rss,
        allocated: tikv_jemalloc_ctl::stats::allocated::read().map_err(allocator)?,
        allocator_resident: tikv_jemalloc_ctl::stats::resident::read().map_err(allocator)?,
        allocator_metadata: tikv_jemalloc_ctl::stats::metadata::read().map_err(allocator)?,
        memtables: rocks.memtables,
        block_cache: rocks.block_cache,
    })
}

/// A `kB` field of a `/proc/<pid>/status` text, e.g. `VmRSS:`.
pub fn status_kib(status: &str, field: &str) -> Result<usize, String> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .ok_or_else(|| format!("no {field} in /proc/self/status"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_fields_in_kib() {
        let status = "Name:\ttally\nVmHWM:\t  312000 kB\nVmRSS:\t  250000 kB\n";
        assert_eq!(status_kib(status, "VmRSS:"), Ok(250_000));
        assert_eq!(status_kib(status, "VmHWM:"), Ok(312_000));
        assert!(status_kib(status, "VmSwap:").is_err());
    }

    #[test]
    fn a_measurement_sees_the_allocator_and_an_allocation() {
        let before = measure().expect("measured");
        let block = vec![1u8; 64 << 20];
        let after = measure().expect("measured");
        assert!(before.rss > 0 && before.peak_rss >= before.rss);
        // The test binary's allocator is jemalloc too (unprefixed), so its statistics see it.
        assert!(
            after.allocated >= before.allocated + (60 << 20),
            "{before:?} {after:?}"
        );
        drop(block);
    }
}
