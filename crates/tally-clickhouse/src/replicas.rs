//! A job on a replicated ClickHouse: one shard's replicas, every one listed in the settings.
//!
//! The truth (versions, commit log, partitions' registry) is in `ReplicatedMergeTree` tables that
//! tally creates on each replica; what readers see is built on each replica from its own copy
//! (see `docs/design/clusters.md`). Here:
//! - [`Replicas`]: the worker writes through one replica and moves to the next when it fails. A
//!   batch retried through another replica is written once in effect: its rows are absolute
//!   values versioned by the partition's offset (a second copy changes no `argMax`), and every
//!   reader of the commit log reads a batch by its id, once;
//! - [`ClickHouseSink::check_cluster`]: the settings name the cluster the servers know, and
//!   exactly its replicas;
//! - [`ClickHouseSink::sync_versions`]: a replica publishes or folds only once it holds the
//!   versions of every batch its commit log showed;
//! - versions are dropped only below what every replica has folded and published past.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Result, SinkError};
use crate::schema::{self, Frontier};
use crate::settings::SinkSettings;
use crate::sink::ClickHouseSink;

/// How long a replica may take to fetch the versions its commit log shows before a publish or
/// fold on it gives up (and is tried again at the next one; readers keep its last answer).
pub const SYNC_WAIT: Duration = Duration::from_secs(20);

/// A server of the cluster as `system.clusters` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ClusterMember {
    pub shard_num: u32,
    pub replica_num: u32,
    pub host_name: String,
    pub port: u16,
}

impl ClusterMember {
    pub fn address(&self) -> String {
        format!("{}:{}", self.host_name, self.port)
    }
}

#[derive(Debug, Deserialize)]
struct Substitution {
    substitution: String,
}

impl ClickHouseSink {
    /// This server's `{replica}` macro: the name its replicated tables register under.
    pub async fn replica_name(&self) -> Result<String> {
        let rows: Vec<Substitution> = schema::json_rows(
            &self.client,
            schema::REPLICA_MACRO_SQL,
            &self.url,
            "reading the server's macros",
        )
        .await?;
        rows.into_iter().next().map(|r| r.substitution).ok_or_else(|| {
            SinkError::Refused(format!(
                "clickhouse.url: the server at {} has no <macros><replica> in its configuration; replicated tables need it",
                self.url
            ))
        })
    }

    /// The members of `cluster` as this server knows them: one shard's replicas, or a refusal
    /// naming the key.
    pub async fn cluster_members(&self, cluster: &str) -> Result<Vec<ClusterMember>> {
        let members: Vec<ClusterMember> = schema::json_rows(
            &self.client,
            &schema::cluster_members_sql(cluster),
            &self.url,
            "reading system.clusters",
        )
        .await?;
        if members.is_empty() {
            #[derive(Deserialize)]
            struct Name {
                cluster: String,
            }
            let known: Vec<Name> = schema::json_rows(
                &self.client,
                "SELECT DISTINCT cluster FROM system.clusters ORDER BY cluster",
                &self.url,
                "reading system.clusters",
            )
            .await?;
            let known: Vec<String> = known.into_iter().map(|n| n.cluster).collect();
            return Err(SinkError::Refused(format!(
                "clickhouse.cluster: the server at {} knows no cluster {cluster:?} (its <remote_servers> have: {})",
                self.url,
                if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                }
            )));
        }
        let shards = members
            .iter()
            .map(|m| m.shard_num)
            .collect::<std::collections::BTreeSet<_>>();
        if shards.len() > 1 {
            return Err(SinkError::Refused(format!(
                "clickhouse.cluster: {cluster:?} has {} shards; tally writes the replicas of one shard (docs/design/clusters.md says why and how several would work)",
                shards.len()
            )));
        }
        Ok(members)
    }

    /// The `{replica}` macro of `member`, asked through this server.
    async fn member_replica_name(
        &self,
        member: &ClusterMember,
        user: &str,
        password: &str,
    ) -> Result<String> {
        let sql = schema::member_macro_sql(&member.address(), user, password);
        let rows: Vec<Substitution> = schema::json_rows(
            &self.client,
            &sql,
            &self.url,
            &format!("reading the macros of {}", member.address()),
        )
        .await?;
        rows.into_iter()
            .next()
            .map(|r| r.substitution)
            .ok_or_else(|| {
                SinkError::Refused(format!(
                    "clickhouse.cluster: member {} has no <macros><replica>",
                    member.address()
                ))
            })
    }

    /// Waits until this replica holds every version written before the call (its fetch queue
    /// emptied once): a batch whose commit row this replica showed before has all its rows
    /// here then, as the writer inserted them before that row. No-op off a cluster.
    pub(crate) async fn sync_versions(&self) -> Result<()> {
        self.sync(
            &self.names.sync_versions_sql(),
            "the versions its commit log shows",
        )
        .await
    }

    /// Waits until this replica holds every commit row written before the call, on any replica
    /// (no-op off a cluster): what a worker reads at its start to find the batches ClickHouse
    /// holds past its state must not miss one that another replica took.
    pub async fn sync_commit_log(&self) -> Result<()> {
        self.sync(&self.names.sync_commits_sql(), "every commit row")
            .await
    }

    /// Runs a `SYSTEM SYNC REPLICA` (`sql`) bounded by [`SYNC_WAIT`]; no-op off a cluster.
    async fn sync(&self, sql: &str, what: &str) -> Result<()> {
        if !self.names.replicated {
            return Ok(());
        }
        let wait = SYNC_WAIT.as_secs();
        self.client
            .query(sql)
            .with_setting("receive_timeout", wait.to_string())
            .execute()
            .await
            .map_err(self.err(format!(
                "waiting up to {wait} s for this replica to fetch {what} ({sql})"
            )))
    }

    /// The first server of `settings` that answers (a replica of a cluster may be down); a
    /// refusal no other server would cure (a password, a certificate) is returned at once.
    pub async fn connect_first(settings: &[SinkSettings]) -> Result<ClickHouseSink> {
        let mut last = None;
        for s in settings {
            match ClickHouseSink::connect(s).await {
                Ok(sink) => return Ok(sink),
                Err(e @ SinkError::Server { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| SinkError::Refused("clickhouse.url names no server".into())))
    }

    /// The oldest window whose versions this replica's read side may still read: its logged
    /// fold frontier, or the start of its published answer if older.
    pub async fn versions_needed_from(&self) -> Result<Frontier> {
        let logged = self.frontier().await?;
        let published = self.published().await?;
        Ok(Frontier {
            seconds: published.map_or(logged.seconds, |p| p.from.seconds.min(logged.seconds)),
        })
    }

    /// On a cluster: the oldest window another replica still reads versions of, from
    /// [`versions_needed_from`](Self::versions_needed_from) of each other replica (`None`: one
    /// did not answer, and no version is dropped).
    pub fn hold_versions_from(&self, floor: Option<Frontier>) {
        *self
            .versions_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = floor;
    }

    /// Below which window versions may be dropped, given this replica's own `settled` frontier.
    pub(crate) fn droppable_below(&self, settled: Frontier) -> Frontier {
        if !self.names.replicated {
            return settled;
        }
        let floor = *self
            .versions_floor
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Frontier {
            seconds: floor.map_or(0, |f| f.seconds.min(settled.seconds)),
        }
    }
}

/// Checks that `settings` (one per URL of `clickhouse.url`) name the replicas of the cluster
/// they name, through the servers that answer now (see [`judge_replicas`]). Returns the URLs
/// that did not answer.
pub async fn check_cluster(settings: &[SinkSettings]) -> Result<Vec<String>> {
    let Some(cluster) = settings.first().and_then(|s| s.cluster.clone()) else {
        return Ok(Vec::new());
    };
    let mut down = Vec::new();
    let mut members: Vec<(ClusterMember, Option<String>)> = Vec::new();
    let mut listed: Vec<(String, String)> = Vec::new();
    for s in settings {
        let sink = match ClickHouseSink::connect(s).await {
            Ok(sink) => sink,
            Err(SinkError::Refused(e)) => return Err(SinkError::Refused(e)),
            Err(_) => {
                down.push(s.url.clone());
                continue;
            }
        };
        let known = sink.cluster_members(&cluster).await?;
        if members.is_empty() {
            for m in known {
                let n = sink
                    .member_replica_name(&m, &s.user, s.password.expose())
                    .await
                    .ok();
                members.push((m, n));
            }
        }
        listed.push((s.url.clone(), sink.replica_name().await?));
    }
    judge_replicas(&cluster, &members, &listed, !down.is_empty()).map_err(SinkError::Refused)?;
    Ok(down)
}

/// The verdict on the URLs of a cluster: `members` as the cluster lists them with each one's
/// replica name (`None`: it did not answer), `listed` the (URL, replica name) of each URL that
/// answered. Each URL must be a member, no two the same, and, when every URL answered, every
/// member listed (a reader there would see no view otherwise).
pub fn judge_replicas(
    cluster: &str,
    members: &[(ClusterMember, Option<String>)],
    listed: &[(String, String)],
    some_down: bool,
) -> std::result::Result<(), String> {
    let names: Vec<&str> = members.iter().filter_map(|(_, n)| n.as_deref()).collect();
    for (i, (url, name)) in listed.iter().enumerate() {
        if let Some((other, _)) = listed[..i].iter().find(|(_, n)| n == name) {
            return Err(format!(
                "clickhouse.url: {other} and {url} are the same replica ({name})"
            ));
        }
        if !names.contains(&name.as_str()) {
            return Err(format!(
                "clickhouse.url: {url} is replica {name}, which is not one of cluster {cluster:?} (its replicas: {})",
                names.join(", ")
            ));
        }
    }
    if some_down {
        return Ok(());
    }
    for (member, name) in members {
        if let Some(name) = name
            && !listed.iter().any(|(_, n)| n == name)
        {
            return Err(format!(
                "clickhouse.url lacks replica {name} ({}) of cluster {cluster:?}: a reader there would see no view; list every replica's HTTP URL",
                member.address()
            ));
        }
    }
    Ok(())
}

/// The job's replicas for writing: the worker writes through one and moves to the next when
/// that one fails (down, read-only while its coordinator is away, its tables missing).
pub struct Replicas {
    settings: Vec<SinkSettings>,
    sinks: Vec<tokio::sync::OnceCell<Arc<ClickHouseSink>>>,
    current: AtomicUsize,
}

impl Replicas {
    /// Writes through `first` (connected to `settings[0]`'s or another replica's URL) first.
    pub fn new(settings: Vec<SinkSettings>, first: ClickHouseSink) -> Replicas {
        let index = settings
            .iter()
            .position(|s| s.url == first.url)
            .unwrap_or(0);
        let sinks: Vec<tokio::sync::OnceCell<Arc<ClickHouseSink>>> = settings
            .iter()
            .map(|_| tokio::sync::OnceCell::new())
            .collect();
        let replicas = Replicas {
            settings,
            sinks,
            current: AtomicUsize::new(index),
        };
        if let Some(cell) = replicas.sinks.get(index) {
            let _ = cell.set(Arc::new(first));
        }
        replicas
    }

    /// The URL writes go through now.
    pub fn current_url(&self) -> &str {
        let i = self.current.load(Ordering::Relaxed);
        self.settings.get(i).map_or("", |s| s.url.as_str())
    }

    async fn sink(&self, index: usize) -> Result<Arc<ClickHouseSink>> {
        let (Some(cell), Some(settings)) = (self.sinks.get(index), self.settings.get(index)) else {
            return Err(SinkError::Refused(format!("no replica {index}")));
        };
        cell.get_or_try_init(|| async { ClickHouseSink::connect(settings).await.map(Arc::new) })
            .await
            .cloned()
    }

    /// Runs `f` through the current replica, then each other in turn while it fails; the first
    /// that succeeds becomes the current one. Every replica failing returns the last error.
    pub async fn through<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: Fn(Arc<ClickHouseSink>) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let n = self.settings.len().max(1);
        let start = self.current.load(Ordering::Relaxed);
        let mut last = None;
        for step in 0..n {
            let index = (start + step) % n;
            let result = match self.sink(index).await {
                Ok(sink) => f(sink).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(v) => {
                    if index != start {
                        self.current.store(index, Ordering::Relaxed);
                    }
                    return Ok(v);
                }
                // The data cannot be written anywhere: no other replica would take it.
                Err(e @ SinkError::Row(_)) => return Err(e),
                Err(e) => {
                    if n > 1 {
                        tracing::warn!(
                            replica = %self.settings.get(index).map_or("", |s| s.url.as_str()),
                            error = %e,
                            "a clickhouse replica failed; trying the next"
                        );
                    }
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| SinkError::Refused("no clickhouse replica".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(n: u32, name: Option<&str>) -> (ClusterMember, Option<String>) {
        (
            ClusterMember {
                shard_num: 1,
                replica_num: n,
                host_name: "127.0.0.1".into(),
                port: 9010 + n as u16,
            },
            name.map(str::to_owned),
        )
    }

    fn urls(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(u, n)| ((*u).to_owned(), (*n).to_owned()))
            .collect()
    }

    #[test]
    fn every_replica_once_and_nothing_else() {
        let members = [member(1, Some("ch-1")), member(2, Some("ch-2"))];
        let both = urls(&[("http://a", "ch-1"), ("http://b", "ch-2")]);
        assert_eq!(judge_replicas("tally", &members, &both, false), Ok(()));
        // A replica left out: its readers would have no view.
        let one = urls(&[("http://a", "ch-1")]);
        let lacks = judge_replicas("tally", &members, &one, false).unwrap_err();
        assert!(
            lacks.starts_with("clickhouse.url lacks replica ch-2 (127.0.0.1:9012)"),
            "{lacks}"
        );
        // ... unless a URL did not answer: that may be the missing one.
        assert_eq!(judge_replicas("tally", &members, &one, true), Ok(()));
        // A server of another cluster.
        let foreign = urls(&[("http://a", "ch-1"), ("http://c", "other-3")]);
        let not_ours = judge_replicas("tally", &members, &foreign, false).unwrap_err();
        assert!(
            not_ours.contains("http://c is replica other-3, which is not one of cluster \"tally\" (its replicas: ch-1, ch-2)"),
            "{not_ours}"
        );
        // Two URLs of one server.
        let twice = urls(&[("http://a", "ch-1"), ("http://a2", "ch-1")]);
        let same = judge_replicas("tally", &members, &twice, false).unwrap_err();
        assert!(
            same.contains("http://a and http://a2 are the same replica (ch-1)"),
            "{same}"
        );
    }
}
