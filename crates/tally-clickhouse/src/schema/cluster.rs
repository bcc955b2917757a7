//! The statements that look at a replicated cluster: its members, each server's replica name,
//! and a replica's fetch queues.

use super::{TableNames, quote};

/// The members of `cluster` as the server's `<remote_servers>` list them.
pub(crate) fn cluster_members_sql(cluster: &str) -> String {
    format!(
        "SELECT shard_num, replica_num, host_name, port FROM system.clusters WHERE cluster = {} ORDER BY shard_num, replica_num",
        quote(cluster)
    )
}

/// This server's `{replica}` macro.
pub(crate) const REPLICA_MACRO_SQL: &str =
    "SELECT substitution FROM system.macros WHERE macro = 'replica'";

/// The `{replica}` macro of the member at `address` (host:native port), asked through a server.
pub(crate) fn member_macro_sql(address: &str, user: &str, password: &str) -> String {
    format!(
        "SELECT substitution FROM remote({}, system.macros, {}, {}) WHERE macro = 'replica'",
        quote(address),
        quote(user),
        quote(password)
    )
}

impl TableNames {
    /// Waits until the replica has fetched every version logged before the call.
    pub(crate) fn sync_versions_sql(&self) -> String {
        format!("SYSTEM SYNC REPLICA {}", self.data)
    }

    /// Waits until the replica has fetched every commit row logged before the call.
    pub(crate) fn sync_commits_sql(&self) -> String {
        format!("SYSTEM SYNC REPLICA {}", self.commits)
    }
}
