//! The `tally` command: run a job, check its config, and prove its results.

mod cli;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result, bail};
use clap::Parser;

use cli::{Cli, Command, LoadgenArgs, LogFormat, ReconcileArgs, SchemaArgs, parse_cut};

use tally_runtime::config::{Config, Millis};
use tally_tools::loadgen::LoadSpec;
use tally_tools::prove;

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,rdkafka=warn,tokio_postgres=warn")
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// jemalloc: the operator allocates each epoch's keys and other threads free them, a pattern
/// glibc's per-thread arenas hold at their peak. It is the process's `malloc` too (unprefixed),
/// so RocksDB's and librdkafka's memory follows the same rules: under glibc they held about twice
/// what they used (231 MB for 119 MB in use at 1M live keys and 18M ids, `malloc_stats`).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start: freed pages go back to the system within 200 ms, by
/// a background thread, rather than after jemalloc's default 10 s, so that peak RSS follows the
/// memory in use (each epoch frees tens of MiB at once; with 1 s the allocator held about 80 MiB
/// of free pages at the peak at 1M live keys, `tally_memory_bytes`). `MALLOC_CONF` in the
/// environment overrides them.
#[allow(unsafe_code)]
// SAFETY: a NUL-terminated byte string; jemalloc only reads it.
#[unsafe(export_name = "malloc_conf")]
static MALLOC_CONF: &[u8; 59] = b"background_thread:true,dirty_decay_ms:200,muzzy_decay_ms:0\0";

fn main() {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run { .. }) {
        die_quietly_on_closed_stdout();
    }
    init_logging(cli.log_format);
    if let Err(e) = real_main(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// A report piped into `head` ends like any Unix tool's when the reader goes, instead of
/// panicking in `println!` (Rust ignores SIGPIPE). Not for `run`: the worker's sockets already
/// write with MSG_NOSIGNAL, and it keeps the default that a signal never stops it mid-epoch.
#[allow(unsafe_code)]
fn die_quietly_on_closed_stdout() {
    // SAFETY: called first thing in main, before any thread exists; sets a signal's
    // disposition to the system's default, no handler runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Dispatches the command line to its command.
fn real_main(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run { config } => run(&config),
        Command::CheckConfig { config } => check_config(&config),
        Command::Loadgen(args) => loadgen(args),
        Command::Verify {
            config,
            manifest,
            earlier,
            wait: Some(wait),
        } => verify_until(
            &config,
            &manifest,
            earlier.as_deref(),
            parse_duration(&wait, "--wait")?,
        ),
        Command::Verify {
            config,
            manifest,
            earlier,
            wait: None,
        } => {
            let cfg = load_config(&config)?;
            let earlier = earlier.as_deref().map(load_config).transpose()?;
            let ok = if cfg.declared.changes.is_some() {
                runtime()?.block_on(tally_tools::database::verify::verify_changes(
                    &cfg, &manifest,
                ))?
            } else {
                runtime()?.block_on(prove::verify(&cfg, &manifest, earlier.as_ref()))?
            };
            exit_unless(ok)
        }
        Command::Reconcile(args) => reconcile(args),
        Command::Doctor {
            config,
            json,
            since,
        } => {
            let cfg = load_config(&config)?;
            let since = parse_duration(&since, "--since")?;
            let rows = runtime()?.block_on(tally_tools::doctor::diagnose(&cfg, since))?;
            tally_tools::doctor::print(&rows, json);
            exit_unless(
                !rows
                    .iter()
                    .any(|r| r.status == tally_tools::doctor::Status::Fail),
            )
        }
        Command::Fold { config } => {
            let settings = load_config(&config)?.resolve()?;
            runtime()?.block_on(tally_runtime::read_side::fold_now(&settings.read_side))
        }
        Command::Retire { config } => {
            let settings = load_config(&config)?.resolve()?;
            runtime()?.block_on(tally_runtime::identity::retire(&settings.identity))
        }
        Command::Probe {
            config,
            interval,
            duration,
        } => probe(&load_config(&config)?, &interval, duration.as_deref()),
        Command::Schema(args) => schema(&args),
        Command::Restore { config, task } => restore(&load_config(&config)?, task),
    }
}

/// `tally verify --wait`: verification in a process of its own, again each second until it
/// passes or `wait` is up; the last attempt's report is printed and its status is the exit's.
fn verify_until(
    config: &std::path::Path,
    manifest: &std::path::Path,
    earlier: Option<&std::path::Path>,
    wait: std::time::Duration,
) -> Result<()> {
    let me = std::env::current_exe().context("finding the tally binary")?;
    let until = std::time::Instant::now() + wait;
    loop {
        let attempt = std::process::Command::new(&me)
            .arg("verify")
            .arg("--config")
            .arg(config)
            .arg("--manifest")
            .arg(manifest)
            .args(
                earlier
                    .iter()
                    .flat_map(|e| [std::ffi::OsStr::new("--earlier"), e.as_os_str()]),
            )
            .output()
            .context("running verify")?;
        if attempt.status.success() || std::time::Instant::now() >= until {
            use std::io::Write;
            std::io::stdout().write_all(&attempt.stdout)?;
            std::io::stderr().write_all(&attempt.stderr)?;
            return exit_unless(attempt.status.success());
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// Exit status 1 when a check failed (its report is printed already).
fn exit_unless(ok: bool) -> Result<()> {
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

fn parse_duration(text: &str, flag: &str) -> Result<std::time::Duration> {
    Ok(Millis::parse(text)
        .map_err(anyhow::Error::msg)
        .with_context(|| flag.to_owned())?
        .as_duration())
}

/// `tally run`: each job file's jobs, until a stop.
fn run(paths: &[PathBuf]) -> Result<()> {
    // The files are checked against each other before the process takes their shared settings.
    let jobs = tally_runtime::process::load_jobs(paths, |file| Ok(Config::load(file)?))?;
    for cfg in &jobs {
        use_state_memory(cfg)?;
    }
    tally_runtime::process::run(jobs, Arc::new(AtomicBool::new(false)))
}

fn loadgen(args: LoadgenArgs) -> Result<()> {
    let cfg = load_config(&args.config)?;
    let events = match (args.rate, &args.duration) {
        (Some(rate), Some(d)) => rate * parse_duration(d, "--duration")?.as_secs().max(1),
        _ => args.events,
    };
    let per_partition = events / args.partitions.max(1) as u64 + 1;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let spec = LoadSpec {
        seed: args.seed,
        partitions: args.partitions,
        customers: args.customers,
        currencies: args.currencies,
        skew: args.skew,
        duplicate_fraction: args.duplicates,
        poison_fraction: args.poison,
        late_fraction: args.late,
        filtered_fraction: args.filtered,
        start_ms: args
            .start_ms
            .unwrap_or(now - per_partition as i64 * args.step_ms),
        step_ms: args.step_ms,
        max_record_bytes: cfg.job.max_record_bytes,
    };
    if cfg.declared.changes.is_some() {
        let spec = tally_tools::database::workload::WorkloadSpec {
            seed: args.seed,
            initial_rows: args.initial_rows,
            changes: events,
            rate: args.rate.map(|r| r as f64),
            keys: args.customers,
            step_ms: args.step_ms,
            snapshots: args.snapshots,
            full_identity: args.full_identity,
        };
        runtime()?.block_on(tally_tools::database::workload::run(
            &cfg,
            &spec,
            &args.manifest,
        ))?;
        return Ok(());
    }
    let opts = tally_tools::loadgen::LoadOptions {
        events,
        rate: args.rate,
        partitions: args.partitions,
        spec,
        manifest: args.manifest,
    };
    runtime()?.block_on(tally_tools::loadgen::produce(&cfg, opts))?;
    Ok(())
}

fn reconcile(args: ReconcileArgs) -> Result<()> {
    let cfg = load_config(&args.config)?;
    let parse_time = |t: &Option<String>, flag: &str| -> Result<Option<i64>> {
        t.as_ref()
            .map(|t| {
                tally_core::time::parse_rfc3339_ms(t)
                    .with_context(|| format!("{flag} {t:?} is not RFC 3339"))
            })
            .transpose()
    };
    let filter = prove::ReconcileFilter {
        from_ms: parse_time(&args.from, "--from")?,
        to_ms: parse_time(&args.to, "--to")?,
        customer: args.customer,
    };
    let rt = runtime()?;
    if let Some(url) = &args.source {
        let url = (!url.is_empty()).then_some(url.as_str());
        let wait = parse_duration(&args.wait, "--wait")?;
        return match args.every {
            None => {
                let r = rt.block_on(tally_tools::database::reconcile::reconcile_source(
                    &cfg, url, &filter, wait, true,
                ))?;
                exit_unless(!r.fails(args.strict))
            }
            Some(every) => {
                let every = parse_duration(&every, "--every")?;
                rt.block_on(tally_tools::database::reconcile::reconcile_source_every(
                    &cfg, url, &filter, every, wait,
                ))
            }
        };
    }
    match args.every {
        None => {
            let r = rt.block_on(prove::reconcile(&cfg, &filter, true))?;
            exit_unless(r.mismatched == 0)
        }
        Some(every) => {
            let every = parse_duration(&every, "--every")?;
            rt.block_on(prove::reconcile_every(
                &cfg,
                &filter,
                every,
                args.full_every,
            ))
        }
    }
}

fn probe(cfg: &Config, interval: &str, duration: Option<&str>) -> Result<()> {
    let interval = parse_duration(interval, "--interval")?;
    let duration = duration
        .map(|d| parse_duration(d, "--duration"))
        .transpose()?;
    let stop = Arc::new(AtomicBool::new(false));
    let report = runtime()?.block_on(async {
        tokio::spawn(tally_runtime::process::stop_on_signal(stop.clone()));
        prove::probe(cfg, interval, duration, &stop).await
    })?;
    println!(
        "probe-summary reads={} errors={} duplicated={} vanished={} decreased={} empty={}",
        report.reads,
        report.errors,
        report.duplicated,
        report.vanished,
        report.decreased,
        report.empty
    );
    for example in &report.examples {
        println!("  {example}");
    }
    exit_unless(report.violations() == 0)
}

fn schema(args: &SchemaArgs) -> Result<()> {
    if !args.print_sql {
        anyhow::bail!("nothing to do: pass --print-sql");
    }
    let mut names =
        tally_clickhouse::TableNames::new(&args.database, &args.table)?.replicated(args.replicated);
    if let Some(path) = &args.config {
        names = names.with_shape(Config::load(path)?.sink_shape());
    }
    let catalog = names.statement_catalog(
        tally_clickhouse::Frontier { seconds: args.from },
        tally_clickhouse::Frontier { seconds: args.to },
        &parse_cut(&args.as_of)?,
        &args.day,
        &args.data_partition,
        args.atomic,
    );
    for (name, sql) in catalog {
        println!("{}", serde_json::json!({ "name": name, "sql": sql }));
    }
    Ok(())
}

fn restore(cfg: &Config, task: Option<u32>) -> Result<()> {
    let settings = cfg.resolve()?;
    let run = match (settings.tasks, task) {
        (1, None) => settings.whole(),
        (1, Some(_)) => anyhow::bail!("--task: the job has one task (job.tasks = 1)"),
        (tasks, None) => anyhow::bail!(
            "job.tasks = {tasks}: pass --task K (0..{tasks}) to restore one task into <state_dir>/task-K"
        ),
        (tasks, Some(k)) if k >= tasks => {
            anyhow::bail!("--task {k}: the job's tasks are 0..{tasks}")
        }
        (_, Some(k)) => settings.task(k),
    };
    let rt = runtime()?;
    let marks = tally_runtime::marks::job_commit_marks(&settings, &run)?;
    let done = tally_runtime::restore::restore(&settings, &run, rt.handle(), &marks, None, true)?;
    println!(
        "restored epoch {} of writer {} into {}: {} partitions, {} changelog records ({} bytes), {} window values, {} event ids, in {:.2} s{}",
        done.epoch,
        done.writer,
        run.state_dir.display(),
        done.partitions,
        done.records,
        done.bytes,
        done.windows,
        done.ids,
        done.duration.as_secs_f64(),
        if done.pending {
            "; its last epoch is not in ClickHouse yet: `tally run` writes it first"
        } else {
            ""
        }
    );
    Ok(())
}

/// Each job file of `paths` checked and described (its effective settings, its declaration,
/// how `run` runs it); several are also checked against each other as one process would run
/// them.
fn check_config(paths: &[PathBuf]) -> Result<()> {
    let files = tally_runtime::process::job_files(paths)?;
    for file in &files {
        check_job_file(file)?;
    }
    if files.len() > 1 {
        tally_runtime::process::load_jobs(&files, |file| Ok(Config::load(file)?))?;
        println!("{} jobs can run in one process", files.len());
    }
    Ok(())
}

fn check_job_file(path: &std::path::Path) -> Result<()> {
    let cfg = Config::load(path)?;
    let job = cfg.declared.as_ref().clone();
    let settings = cfg
        .effective_toml()
        .map_err(|e| anyhow::anyhow!("{}: cannot show the settings: {e}", path.display()))?;
    println!("# {}, every default filled in\n{settings}", path.display());
    print!("{}", tally_runtime::declaration::describe(&job));
    // Once: the registry's client (a job of Avro or Protobuf) and the identity come from here.
    let resolved = cfg.resolve()?;
    if let Some(cache) = &resolved.consume.schemas {
        let subject = cfg.registry_subject();
        match cache.check_latest(&subject)? {
            None => println!(
                "subject {subject} of {} has no schema yet: the declaration is checked against each writer schema as records name it",
                cache.registry().url()
            ),
            Some((id, problems)) if problems.is_empty() => println!(
                "subject {subject}: its latest schema (id {id}) holds every declared field"
            ),
            Some((id, problems)) => bail!(
                "subject {subject}: its latest schema (id {id}) does not hold the declaration (its records would be dead-lettered):\n  {}",
                problems.join("\n  ")
            ),
        }
    }
    if cfg.job.version > 1 {
        // A new version: what it changes against the running one, read from the services.
        let running = runtime()?.block_on(tally_tools::version_change::read(&resolved))?;
        if let Some(theirs) = running.identity.as_ref().and_then(|i| i.source_topic())
            && let Some((key, why)) = cfg.topic_refused_after(theirs)
        {
            bail!("{}: {key}: {why}", path.display());
        }
        let change = tally_tools::version_change::compare(
            &resolved.identity.identity,
            &cfg.sink_shape().view_columns(),
            cfg.restate_from_ms(),
            cfg.restatement_lead_ms(),
            job.changes.is_some(),
            &running,
        )
        .map_err(|refused| anyhow::anyhow!("{}: {refused}", path.display()))?;
        print!("{change}");
        let takeover = if resolved.read_side.takeover.is_some() {
            format!(
                "once it has caught up with the stream it takes the job's view {} over in one swap, and the running version's workers stop (job.takeover = \"auto\")",
                resolved.view
            )
        } else {
            "it does not take the job's view over while job.takeover = \"hold\" (run it with \"auto\" to)".to_owned()
        };
        println!(
            "`tally run` of this file rebuilds it beside the running version, in resources of its own (its view {}); {takeover}. Until then `tally retire` of it aborts it (docs/design/restatement.md)",
            resolved.sink.table
        );
        println!("{}: ok", path.display());
        return Ok(());
    }
    println!("runs as declared");
    // What loadgen makes of the same declaration, so that the two never disagree unsaid.
    if job.changes.is_none() {
        match tally_tools::loadgen::filter_tests(&job) {
            Ok(_) => {
                println!("loadgen generates its records by construction (tally loadgen --config)")
            }
            Err(why) => println!("{why}: tally loadgen refuses this job (the job itself runs)"),
        }
    }
    println!("{}: ok", path.display());
    Ok(())
}

/// A job's configuration, with its RocksDB memory taken as the process's.
fn load_config(path: &std::path::Path) -> Result<Config> {
    let cfg = Config::load(path)?;
    use_state_memory(&cfg)?;
    Ok(cfg)
}

/// The process's RocksDB memory, from the job's `job.state_memory_mib`.
fn use_state_memory(cfg: &Config) -> Result<()> {
    tally_state::set_shared_memory_mib(cfg.job.state_memory_mib)
        .map_err(|set| anyhow::anyhow!("job.state_memory_mib: this process already uses {set} MiB"))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}
