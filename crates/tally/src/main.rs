//! The `tally` command: run a job, check its config, and prove its results.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};

use tally_runtime::config::{Config, Millis};
use tally_tools::loadgen::LoadSpec;
use tally_tools::prove;

/// Exactly-once stream processing from Kafka into ClickHouse.
///
/// tally reads records from a Kafka topic (JSON, Avro or Protobuf through a schema registry,
/// or Debezium change events from PostgreSQL), aggregates them by the windows, filter, keys
/// and aggregates a job file declares, keeps the windows in RocksDB, checkpoints them together
/// with the Kafka offsets, and writes each checkpoint to ClickHouse (one server or a replicated
/// cluster) as one id-keyed batch, so a crash at any instant neither loses nor double counts.
/// Records it cannot aggregate go to a dead-letter topic with the reason.
///
/// Start with `tally check-config --config config/revenue_agg.toml`, then `tally run` with
/// the same file. Every key can be overridden by an environment variable such as
/// TALLY_KAFKA__BROKERS or TALLY_CLICKHOUSE__URL (docs/configuration.md).
#[derive(Parser)]
#[command(name = "tally", version, about, long_about)]
struct Cli {
    /// Log format on stderr. Filter with RUST_LOG (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Human, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run jobs until SIGTERM or SIGINT (then each takes a final checkpoint and exits).
    Run {
        /// A job's TOML file, or a directory of them; repeat for several jobs in one process,
        /// each with its own group, state directory, tables and failures.
        #[arg(long, short, required = true)]
        config: Vec<PathBuf>,
    },
    /// Validate a job's config and print the effective settings (passwords masked); with
    /// several files (or a directory), also that one process can run them together.
    CheckConfig {
        #[arg(long, short, required = true)]
        config: Vec<PathBuf>,
    },
    /// Produce a deterministic order stream to the job's source topic and write its ground truth.
    Loadgen(LoadgenArgs),
    /// Compare the view and the dead-letter topic with a loadgen manifest, exactly. Exit 1 on any difference.
    Verify {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long, short)]
        manifest: PathBuf,
        /// Verify again every second until the job has caught up and the view is exact, for at
        /// most this long (e.g. 60s); only the last attempt's report is printed.
        #[arg(long)]
        wait: Option<String>,
    },
    /// Recompute counts and sums from the source topic and compare them with the sink per window
    /// and key. Exit 1 when any sink/source ratio differs from 1.
    Reconcile(ReconcileArgs),
    /// Check every hop from Produced to Reported on this deployment: one row per hop with the
    /// invariant, the evidence and PASS, WARN or FAIL. Exit 1 on any FAIL.
    Doctor {
        #[arg(long, short)]
        config: PathBuf,
        /// One JSON object per hop.
        #[arg(long)]
        json: bool,
        /// Reconcile windows of this recent period against the source.
        #[arg(long, default_value = "1h")]
        since: String,
    },
    /// Fold final windows now, then drop the versions they replace. The job's read side does
    /// this every clickhouse.fold_interval; this takes the read side over (fencing its holder,
    /// which stands by and takes it back once this releases it).
    Fold {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Free a job's name and resources (consumer group, changelog topic, transactional id,
    /// table) for another job: run it once every worker of the job has stopped for good. The
    /// job's tables and topics stay.
    Retire {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Poll the view like a dashboard and check what it shows: no key twice, no window
    /// vanishing, no count going down (for an input that only adds orders). Exit 1 otherwise.
    Probe {
        #[arg(long, short)]
        config: PathBuf,
        /// Time between reads.
        #[arg(long, default_value = "200ms")]
        interval: String,
        /// Stop after this long (default: at SIGTERM or SIGINT).
        #[arg(long)]
        duration: Option<String>,
    },
    /// Print the ClickHouse statements tally issues, as JSON lines {"name", "sql"}.
    Schema(SchemaArgs),
    /// Rebuild the job's state in an empty `job.state_dir` from its changelog topic: for a
    /// worker on a new machine when the one holding the state directory is lost. Run it only
    /// when the job's previous worker is gone; then `tally run`.
    Restore {
        #[arg(long, short)]
        config: PathBuf,
        /// With `job.tasks` > 1: the task to restore, into `<state_dir>/task-K`.
        #[arg(long)]
        task: Option<u32>,
    },
}

#[derive(clap::Args)]
struct SchemaArgs {
    /// Print every statement (DDL, view, fold step, reads) for the parameters below.
    #[arg(long)]
    print_sql: bool,
    #[arg(long, default_value = "tally")]
    database: String,
    #[arg(long, default_value = "revenue_agg")]
    table: String,
    /// Fold frontier before the step, in seconds.
    #[arg(long, default_value_t = 0)]
    from: u32,
    /// Fold frontier after the step, in seconds.
    #[arg(long, default_value_t = 0)]
    to: u32,
    /// The cut for the as-of read, as PARTITION:OFFSET,… (empty: nothing committed).
    #[arg(long, default_value = "")]
    as_of: String,
    /// Day partition (YYYYMMDD) for the repair and retention statements.
    #[arg(long, default_value = "19700101")]
    day: String,
    /// Version partition for the drop statement.
    #[arg(long, default_value = "0")]
    data_partition: String,
    /// Statements for an Atomic database (current servers) instead of Ordinary (18.16).
    #[arg(long)]
    atomic: bool,
    /// Statements for a job on a replicated cluster (`clickhouse.cluster`): its truth in
    /// `ReplicatedMergeTree` tables, and the statements that look at the cluster.
    #[arg(long)]
    replicated: bool,
    /// A job file whose `[aggregation]` shapes the statements (its keys and aggregates as
    /// columns); default: revenue_agg's.
    #[arg(long)]
    config: Option<PathBuf>,
}

fn parse_cut(text: &str) -> Result<tally_clickhouse::Cut> {
    text.split(',')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            pair.split_once(':')
                .and_then(|(p, o)| Some((p.parse().ok()?, o.parse().ok()?)))
                .with_context(|| format!("--as-of {pair:?} is not PARTITION:OFFSET"))
        })
        .collect::<Result<_>>()
        .map(tally_clickhouse::Cut)
}

#[derive(clap::Args)]
struct LoadgenArgs {
    #[arg(long, short)]
    config: PathBuf,
    /// Number of records (ignored with --rate and --duration).
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Target records per second; with --duration, produces rate × duration records.
    #[arg(long)]
    rate: Option<u64>,
    /// How long to produce at --rate, e.g. 60s.
    #[arg(long)]
    duration: Option<String>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Partitions of the source topic when loadgen creates it.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Customers, or for a declared job the combinations of its group-by values.
    #[arg(long, default_value_t = 1000)]
    customers: u32,
    /// Zipf exponent of customer popularity (0 = uniform).
    #[arg(long, default_value_t = 1.1)]
    skew: f64,
    #[arg(long, default_value = "EUR,USD,GBP", value_delimiter = ',')]
    currencies: Vec<String>,
    /// Fraction of records that re-publish an earlier event (same key and id).
    #[arg(long, default_value_t = 0.02)]
    duplicates: f64,
    /// Fraction of poison records (every reason in turn).
    #[arg(long, default_value_t = 0.005)]
    poison: f64,
    /// Fraction of events later than the allowed lateness.
    #[arg(long, default_value_t = 0.005)]
    late: f64,
    /// Fraction of records a declared job's filter leaves out (each misses one condition).
    #[arg(long, default_value_t = 0.05)]
    filtered: f64,
    /// Event-time spacing between consecutive records of one partition, in ms.
    #[arg(long, default_value_t = 10)]
    step_ms: i64,
    /// First event time (ms since the epoch); default: now minus the span of the stream.
    #[arg(long)]
    start_ms: Option<i64>,
    /// Where to write the ground-truth manifest.
    #[arg(long, short, default_value = "manifest.json")]
    manifest: PathBuf,
    /// A change job: rows inserted into the source table before the --events changes (a table
    /// for the connector's first snapshot, with --events 0).
    #[arg(long, default_value_t = 0)]
    initial_rows: u64,
    /// A change job: new snapshots asked for through Debezium's signal table, spread over the
    /// changes.
    #[arg(long, default_value_t = 0)]
    snapshots: u32,
    /// A change job: REPLICA IDENTITY FULL (updates and deletes carry the old row), rather
    /// than the default (the key only).
    #[arg(long)]
    full_identity: bool,
}

#[derive(clap::Args)]
struct ReconcileArgs {
    #[arg(long, short)]
    config: PathBuf,
    /// Only windows starting at or after this time (RFC 3339).
    #[arg(long)]
    from: Option<String>,
    /// Only windows starting before this time (RFC 3339).
    #[arg(long)]
    to: Option<String>,
    /// Only this customer (of a declared job: this first group-by value).
    #[arg(long)]
    customer: Option<String>,
    /// Keep running, reconciling every DURATION (e.g. 5m), and export the result as metrics.
    /// Each round reads only what was committed since the previous one.
    #[arg(long)]
    every: Option<String>,
    /// With --every: start over from the beginning every N rounds (which also re-checks
    /// windows that no new input touched).
    #[arg(long, default_value_t = 12)]
    full_every: u64,
    /// A change job: run the declaration's aggregation as SQL on the source table (this
    /// postgres:// URL, or source.postgres) and compare it with the view, instead of reading
    /// the topic again.
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "URL")]
    source: Option<String>,
    /// With --source: fail too when open windows could not be compared at one point with the
    /// table (no slot named, or the connector or the job not catching up within --wait).
    #[arg(long)]
    strict: bool,
    /// With --source: how long to wait for the connector to capture and the job to commit
    /// what the table's snapshot holds, before comparing only settled windows.
    #[arg(long, default_value = "60s")]
    wait: String,
}

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
            wait: Some(wait),
        } => verify_until(&config, &manifest, parse_duration(&wait, "--wait")?),
        Command::Verify {
            config,
            manifest,
            wait: None,
        } => {
            let cfg = load_config(&config)?;
            let ok = match cfg.declared.clone() {
                Some(job) if job.changes.is_some() => runtime()?.block_on(
                    tally_tools::database::verify::verify_changes(&cfg, &job, &manifest),
                )?,
                Some(job) => runtime()?.block_on(prove::verify_declared(&cfg, &job, &manifest))?,
                None => runtime()?.block_on(prove::verify(&cfg, &manifest))?,
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
            runtime()?.block_on(tally_runtime::read_side::fold_now(&load_config(&config)?))
        }
        Command::Retire { config } => {
            runtime()?.block_on(tally_runtime::identity::retire(&load_config(&config)?))
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

/// Exit status 1 when a check failed (its report is printed already).
/// `tally verify --wait`: verification in a process of its own, again each second until it
/// passes or `wait` is up; the last attempt's report is printed and its status is the exit's.
fn verify_until(
    config: &std::path::Path,
    manifest: &std::path::Path,
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
    if cfg.declared.as_ref().is_some_and(|j| j.changes.is_some()) {
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
    if cfg.declared.is_some() {
        runtime()?.block_on(tally_tools::loadgen::produce_declared(&cfg, opts))?;
    } else {
        runtime()?.block_on(tally_tools::loadgen::produce(&cfg, opts))?;
    }
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
    if let Some(path) = &args.config
        && let (_, Some(job)) = Config::load_declared(path)?
    {
        names = names.with_shape(tally_clickhouse::Shape::of(&job));
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
    let cfg = match (cfg.tasks(), task) {
        (1, None) => cfg.clone(),
        (1, Some(_)) => anyhow::bail!("--task: the job has one task (job.tasks = 1)"),
        (tasks, None) => anyhow::bail!(
            "job.tasks = {tasks}: pass --task K (0..{tasks}) to restore one task into <state_dir>/task-K"
        ),
        (tasks, Some(k)) if k >= tasks => {
            anyhow::bail!("--task {k}: the job's tasks are 0..{tasks}")
        }
        (_, Some(k)) => cfg.for_task(k),
    };
    let rt = runtime()?;
    let marks = tally_runtime::marks::job_commit_marks(&cfg)?;
    let done = tally_runtime::restore::restore(&cfg, rt.handle(), &marks, None, true)?;
    println!(
        "restored epoch {} of writer {} into {}: {} partitions, {} changelog records ({} bytes), {} window values, {} event ids, in {:.2} s{}",
        done.epoch,
        done.writer,
        cfg.job.state_dir.display(),
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

/// Loads the configuration and applies what is the process's, not one store's or client's.
/// Prints the effective settings and the declared job, and how `run` runs it.
/// Each job file of `paths` checked and described; several are also checked against each
/// other as one process would run them.
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
    let (cfg, job) = Config::load_declared(path)?;
    let settings = cfg
        .effective_toml()
        .map_err(|e| anyhow::anyhow!("{}: cannot show the settings: {e}", path.display()))?;
    println!("# {}, every default filled in\n{settings}", path.display());
    let Some(job) = job else {
        println!("{}: ok", path.display());
        return Ok(());
    };
    print!("{}", tally_runtime::declaration::describe(&job));
    if job.format.is_framed() {
        let registry = tally_runtime::schemas::SchemaRegistry::new(&cfg.registry)?;
        let cache =
            tally_runtime::schemas::SchemaCache::new(registry, std::sync::Arc::new(job.clone()))?;
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
    match tally_runtime::declaration::built_in_fields(&job) {
        Ok(_) => println!("runs on the built-in revenue_agg decoder"),
        Err(_) => println!("runs as declared"),
    }
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
