//! The memory RocksDB shares across every store of this process.

use rocksdb::{Cache, WriteBufferManager};

/// The memory RocksDB shares across every store of this process (the tasks it runs, their
/// standbys, restores), so that a worker's memory does not grow with its tasks: half for all
/// memtables together (each column family's is `MEMTABLE_BYTES` at most), half for the block
/// cache, which holds index and filter blocks too. With the epochs in flight, the id filter and
/// the consumer's prefetch they make up most of a worker's memory (BENCHMARKS.md, "Memory").
pub const DEFAULT_SHARED_MEMORY_MIB: u64 = 64;
pub(crate) const MEMTABLE_BYTES: usize = 8 << 20;

static SHARED_MEMORY_MIB: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// Sets the shared memory for this process, before its first store opens (`job.state_memory_mib`).
/// Fails when it was set already, or a store opened with another size.
pub fn set_shared_memory_mib(mib: u64) -> Result<(), u64> {
    let set = *SHARED_MEMORY_MIB.get_or_init(|| mib);
    if set == mib { Ok(()) } else { Err(set) }
}

/// The block cache and the memtable budget of every store of this process.
pub(crate) fn process_memory() -> &'static (Cache, WriteBufferManager) {
    static SHARED: std::sync::OnceLock<(Cache, WriteBufferManager)> = std::sync::OnceLock::new();
    SHARED.get_or_init(|| {
        let mib = *SHARED_MEMORY_MIB.get_or_init(|| DEFAULT_SHARED_MEMORY_MIB);
        let half = usize::try_from(mib << 19).unwrap_or(usize::MAX);
        (
            Cache::new_lru_cache(half),
            WriteBufferManager::new_write_buffer_manager(half, false),
        )
    })
}

/// What the memory RocksDB shares across this process's stores holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedMemoryUsage {
    pub memtables: usize,
    /// Data, index and filter blocks (index and filters live in the cache).
    pub block_cache: usize,
}

pub fn shared_memory_usage() -> SharedMemoryUsage {
    let (cache, memtables) = process_memory();
    SharedMemoryUsage {
        memtables: memtables.get_usage(),
        block_cache: cache.get_usage(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_memory_is_set_once_for_the_process() {
        // Stores opened by other tests of this binary size it by the default, as no one sets it.
        assert_eq!(set_shared_memory_mib(DEFAULT_SHARED_MEMORY_MIB), Ok(()));
        assert_eq!(
            set_shared_memory_mib(DEFAULT_SHARED_MEMORY_MIB / 2),
            Err(DEFAULT_SHARED_MEMORY_MIB)
        );
        let usage = shared_memory_usage();
        assert!(usage.memtables <= (DEFAULT_SHARED_MEMORY_MIB as usize) << 19);
    }
}
