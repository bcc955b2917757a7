//! `tally run` with one or more jobs: each job's file checked against the others before
//! anything starts, then each job on its own thread and runtime, with its own group, state
//! directory, transactional ids and tables. A job that fails stops alone: the others run on
//! until the process is asked to stop, and the process exits with an error naming it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::config::Config;
use crate::health::Readiness;
use crate::job_scope::JobScope;
use crate::retry::Interrupted;

/// The job files `paths` name: each file, and each directory's `*.toml` files in name order.
pub fn job_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        if path.is_dir() {
            let mut in_dir: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("reading the job directory {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "toml"))
                .collect();
            if in_dir.is_empty() {
                bail!("{}: a directory of no job file (*.toml)", path.display());
            }
            in_dir.sort();
            files.extend(in_dir);
        } else {
            files.push(path.clone());
        }
    }
    Ok(files)
}

/// Refuses jobs that one process cannot run side by side, naming both files and the key: the
/// same job twice, or a resource two jobs would share (its registry refuses that too, but only
/// once the first job has started); and the process's RocksDB budget, which must agree.
pub fn check_apart(jobs: &[(PathBuf, Config)]) -> Result<()> {
    type Owned = fn(&Config) -> String;
    let owned: [(&str, Owned); 7] = [
        ("job.name", |c| c.job.name.clone()),
        ("job.state_dir", |c| c.state_dir().display().to_string()),
        ("kafka.consumer_group", Config::consumer_group),
        ("kafka.transactional_id", Config::transactional_id),
        ("kafka.changelog_topic", Config::changelog_topic),
        ("kafka.dlq_topic", Config::dlq_topic),
        ("clickhouse.table", |c| {
            format!("{}.{}", c.clickhouse.database, c.version_table())
        }),
    ];
    for (i, (a_path, a)) in jobs.iter().enumerate() {
        for (b_path, b) in &jobs[i + 1..] {
            for (key, of) in &owned {
                if of(a) == of(b) {
                    bail!(
                        "{} and {}: {key} is {:?} in both: each job of a process needs its own",
                        a_path.display(),
                        b_path.display(),
                        of(a)
                    );
                }
            }
            if a.job.state_memory_mib != b.job.state_memory_mib {
                bail!(
                    "{} and {}: job.state_memory_mib is {} and {}: RocksDB's memory is one budget the process's jobs share; give both the same",
                    a_path.display(),
                    b_path.display(),
                    a.job.state_memory_mib,
                    b.job.state_memory_mib
                );
            }
        }
    }
    Ok(())
}

/// Runs `jobs` until `shutdown` and each has stopped. Each job's error is logged as it
/// happens; the result names every job that failed.
pub fn run(jobs: Vec<Config>, shutdown: Arc<AtomicBool>) -> Result<()> {
    let several = jobs.len() > 1;
    let readiness: Vec<(String, Arc<Readiness>)> = jobs
        .iter()
        .map(|c| (c.job.name.clone(), Arc::new(Readiness::default())))
        .collect();
    let control = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // Each metrics address serves the jobs that name it, as separate processes would.
    if jobs.iter().any(|c| !c.metrics.address.is_empty()) {
        let fallback = (!several).then(|| jobs[0].job.name.clone());
        let handle = crate::health::install_recorder(fallback)?;
        let mut by_address: std::collections::BTreeMap<&str, Vec<(String, Arc<Readiness>)>> =
            std::collections::BTreeMap::new();
        for (cfg, (name, ready)) in jobs.iter().zip(&readiness) {
            if !cfg.metrics.address.is_empty() {
                by_address
                    .entry(&cfg.metrics.address)
                    .or_default()
                    .push((name.clone(), ready.clone()));
            }
        }
        for (address, served) in by_address {
            let only_these = served.len() < jobs.len();
            control.block_on(crate::health::serve_at(
                address,
                handle.clone(),
                served,
                only_these,
            ))?;
        }
    }
    control.spawn(crate::memory::report());
    control.spawn(stop_on_signal(shutdown.clone()));
    let mut running = Vec::new();
    for (cfg, (_, ready)) in jobs.into_iter().zip(&readiness) {
        let (name, ready, shutdown) = (cfg.job.name.clone(), ready.clone(), shutdown.clone());
        let scope = JobScope::new(&name, several);
        let thread = std::thread::Builder::new()
            .name(format!("tally-job-{name}"))
            .spawn(move || -> Result<()> {
                scope.enter();
                let result = scope
                    .runtime(2)
                    .context("starting the job's async runtime")
                    .and_then(|rt| rt.block_on(run_job(&cfg, &shutdown, &ready)));
                if let Err(e) = &result {
                    ready.set_failed();
                    if several {
                        tracing::error!(error = %format!("{e:#}"), "the job stopped; the process's other jobs run on");
                    }
                }
                crate::job_scope::leave();
                result
            })
            .with_context(|| format!("starting job {name}"))?;
        running.push((name, thread));
    }
    let mut failed = Vec::new();
    for (name, thread) in running {
        match thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) if !several => return Err(e),
            Ok(Err(e)) => failed.push(format!("job {name}: {e:#}")),
            Err(_) => failed.push(format!("job {name}: its thread panicked")),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        bail!("{}", failed.join("; "))
    }
}

/// One job: its identity checked, its read side and its tasks run until a stop.
async fn run_job(
    cfg: &Config,
    shutdown: &Arc<AtomicBool>,
    readiness: &Arc<Readiness>,
) -> Result<()> {
    // A worker whose rules or resources clash with its job's, or another job's, stops here,
    // before it joins anything.
    if cfg.job.version > 1 && cfg.declared.format.is_changes() {
        let (kafka, topic) = (cfg.kafka_settings(), cfg.kafka.source_topic.clone());
        let extent = tokio::task::spawn_blocking(move || tally_kafka::topic_extent(&kafka, &topic))
            .await
            .context("reading the source topic's extent")??;
        if let Some(why) = crate::config::history_lost(&extent) {
            bail!(
                "job {}: job.version = {}: {why}",
                cfg.job.name,
                cfg.job.version
            );
        }
    }
    let settings = Arc::new(cfg.resolve()?);
    if cfg.job.version > 1
        && let Some(versions) = crate::identity::versions(&settings.identity).await?
        && versions.holds() < cfg.job.version
        && let Some(theirs) = versions.holder.source_topic()
        && let Some((key, why)) = cfg.topic_refused_after(theirs)
    {
        bail!("job {}: {key}: {why}", cfg.job.name);
    }
    match crate::identity::check(&settings.identity, shutdown).await {
        Ok(true) => {}
        Ok(false) => {
            tracing::info!("stopped before the job's identity was checked");
            return Ok(());
        }
        Err(e) if e.is::<crate::identity::Superseded>() => {
            tracing::info!("{e}");
            return Ok(());
        }
        Err(e) => return Err(e),
    }
    let handle = tokio::runtime::Handle::current();
    // The job's own stop: the process's, or a later version taking the job over.
    let stop = Arc::new(AtomicBool::new(false));
    let superseded = Arc::new(std::sync::OnceLock::new());
    let watcher = handle.spawn(watch_for_takeover(
        settings.identity.clone(),
        shutdown.clone(),
        stop.clone(),
        superseded.clone(),
    ));
    // Every worker of the job may hold its read side, standing by or not.
    let signals = crate::read_side::CommitSignals::default();
    let read_side =
        crate::read_side::ReadSide::start(&settings.read_side, handle.clone(), signals.clone())?;
    let (flag, readiness) = (stop.clone(), readiness.clone());
    let identity = settings.identity.clone();
    let result = tokio::task::spawn_blocking(move || {
        let result = crate::tasks::run(settings, handle, flag, readiness, signals);
        // A clean stop publishes what it committed and hands the read side on; otherwise it
        // is only released.
        if result.is_ok() {
            read_side.publish_and_stop();
        } else {
            drop(read_side);
        }
        result
    })
    .await
    .context("worker thread")?;
    watcher.abort();
    // Fenced by the version taking over (its commit failed), or stopped by the watcher.
    let superseded = match superseded.get() {
        Some(s) => Some(s.to_string()),
        None if result.is_err() => {
            tokio::task::spawn_blocking(move || crate::identity::superseded(&identity))
                .await
                .ok()
                .and_then(Result::ok)
                .flatten()
                .map(|s| s.to_string())
        }
        None => None,
    };
    if let Some(s) = superseded {
        tracing::info!("{s}");
        return Ok(());
    }
    match result {
        // Asked to stop while still waiting for a service: nothing to checkpoint.
        Err(e) if e.is::<Interrupted>() && shutdown.load(Ordering::SeqCst) => {
            tracing::info!("stopped before the first record: {e:#}");
            Ok(())
        }
        other => other,
    }
}

/// How often a running version reads the registry for a later version taking the job over.
const TAKEOVER_POLL: Duration = Duration::from_secs(3);

/// Sets `stop` when the process is asked to stop, or when a later version of the job takes it
/// over (recording which in `superseded`).
async fn watch_for_takeover(
    identity: crate::identity::IdentitySettings,
    shutdown: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    superseded: Arc<std::sync::OnceLock<crate::identity::Superseded>>,
) {
    let mut next_read = tokio::time::Instant::now() + TAKEOVER_POLL;
    loop {
        if shutdown.load(Ordering::SeqCst) {
            stop.store(true, Ordering::SeqCst);
            return;
        }
        if tokio::time::Instant::now() >= next_read {
            let id = identity.clone();
            let read = tokio::task::spawn_blocking(move || crate::identity::superseded(&id)).await;
            if let Ok(Ok(Some(s))) = read {
                let _ = superseded.set(s);
                stop.store(true, Ordering::SeqCst);
                return;
            }
            next_read = tokio::time::Instant::now() + TAKEOVER_POLL;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sets `shutdown` at SIGTERM or SIGINT.
pub async fn stop_on_signal(shutdown: Arc<AtomicBool>) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutdown requested");
    shutdown.store(true, Ordering::SeqCst);
}

/// Loads each job file of `paths` (see [`job_files`]) with `load` and checks them apart.
pub fn load_jobs(paths: &[PathBuf], load: impl Fn(&Path) -> Result<Config>) -> Result<Vec<Config>> {
    let files = job_files(paths)?;
    let mut jobs = Vec::new();
    for file in files {
        let cfg = load(&file)?;
        jobs.push((file, cfg));
    }
    check_apart(&jobs)?;
    Ok(jobs.into_iter().map(|(_, c)| c).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(name: &str, extra: &str) -> Config {
        let text = format!(
            "[job]\nname = \"{name}\"\nstate_dir = \"/tmp/{name}\"\n[kafka]\nbrokers = \"localhost:9092\"\nsource_topic = \"{name}_in\"\nconsumer_group = \"{name}_group\"\n[clickhouse]\nurl = \"http://localhost:8123\"\ntable = \"{name}\"\n{extra}"
        );
        Config::parse(&format!("{name}.toml"), &text, &[]).expect("a valid job")
    }

    #[test]
    fn jobs_of_one_process_own_their_resources_and_share_its_memory_budget() {
        let (a, b) = (job("orders", ""), job("payments", ""));
        let pair = |x: &Config, y: &Config| {
            check_apart(&[("a.toml".into(), x.clone()), ("b.toml".into(), y.clone())])
        };
        assert!(pair(&a, &b).is_ok());
        let same_name = pair(&a, &a).unwrap_err().to_string();
        assert!(
            same_name.contains("a.toml and b.toml: job.name is \"orders\" in both"),
            "{same_name}"
        );
        let mut shared_table = b.clone();
        shared_table.clickhouse.table = "orders".into();
        assert!(
            pair(&a, &shared_table)
                .unwrap_err()
                .to_string()
                .contains("clickhouse.table is \"tally.orders\" in both")
        );
        let mut shared_group = b.clone();
        shared_group.kafka.consumer_group = a.kafka.consumer_group.clone();
        assert!(
            pair(&a, &shared_group)
                .unwrap_err()
                .to_string()
                .contains("kafka.consumer_group")
        );
        let mut other_metrics = b.clone();
        other_metrics.metrics.address = "127.0.0.1:9999".into();
        assert!(
            pair(&a, &other_metrics).is_ok(),
            "each metrics address serves its jobs"
        );
        let mut other_memory = b;
        other_memory.job.state_memory_mib += 1;
        assert!(
            pair(&a, &other_memory)
                .unwrap_err()
                .to_string()
                .contains("job.state_memory_mib")
        );
    }

    #[test]
    fn a_directory_names_its_job_files_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["b.toml", "a.toml", "notes.md"] {
            std::fs::write(dir.path().join(f), "").unwrap();
        }
        let files = job_files(&[dir.path().to_path_buf()]).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["a.toml", "b.toml"]);
        let empty = tempfile::tempdir().unwrap();
        assert!(
            job_files(&[empty.path().to_path_buf()])
                .unwrap_err()
                .to_string()
                .contains("a directory of no job file")
        );
    }
}
