//! The command line: every subcommand, its arguments and their help texts.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

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
pub(crate) struct Cli {
    /// Log format on stderr. Filter with RUST_LOG (default: info).
    #[arg(long, value_enum, default_value_t = LogFormat::Human, global = true)]
    pub(crate) log_format: LogFormat,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// Produce a deterministic stream of the job's records to its source topic (a change job:
    /// changes to its source table) and write its ground truth.
    Loadgen(LoadgenArgs),
    /// Compare the view and the dead-letter topic with a loadgen manifest, exactly. Exit 1 on any difference.
    Verify {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long, short)]
        manifest: PathBuf,
        /// A new version that took the job's view over: the earlier version's file, whose
        /// answer the view keeps before `restate_from` (the manifest's, by its columns).
        #[arg(long)]
        earlier: Option<PathBuf>,
        /// Verify again every second until the job has caught up and the view is exact, for at
        /// most this long (e.g. 60s); only the last attempt's report is printed.
        #[arg(long)]
        wait: Option<String>,
    },
    /// Recompute the aggregates from the source topic (or, with --source, from a change job's
    /// table) and compare them with the view per window and key. Exit 1 when a window differs.
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
    /// vanishing, no count going down (for a job whose counts only grow). Exit 1 otherwise.
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
pub(crate) struct SchemaArgs {
    /// Print every statement (DDL, view, fold step, reads) for the parameters below.
    #[arg(long)]
    pub(crate) print_sql: bool,
    #[arg(long, default_value = "tally")]
    pub(crate) database: String,
    #[arg(long, default_value = "revenue_agg")]
    pub(crate) table: String,
    /// Fold frontier before the step, in seconds.
    #[arg(long, default_value_t = 0)]
    pub(crate) from: u32,
    /// Fold frontier after the step, in seconds.
    #[arg(long, default_value_t = 0)]
    pub(crate) to: u32,
    /// The cut for the as-of read, as PARTITION:OFFSET,… (empty: nothing committed).
    #[arg(long, default_value = "")]
    pub(crate) as_of: String,
    /// Day partition (YYYYMMDD) for the repair and retention statements.
    #[arg(long, default_value = "19700101")]
    pub(crate) day: String,
    /// Version partition for the drop statement.
    #[arg(long, default_value = "0")]
    pub(crate) data_partition: String,
    /// Statements for an Atomic database (current servers) instead of Ordinary (18.16).
    #[arg(long)]
    pub(crate) atomic: bool,
    /// Statements for a job on a replicated cluster (`clickhouse.cluster`): its truth in
    /// `ReplicatedMergeTree` tables, and the statements that look at the cluster.
    #[arg(long)]
    pub(crate) replicated: bool,
    /// A job file whose `[aggregation]` shapes the statements (its keys and aggregates as
    /// columns); default: revenue_agg's.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
}

pub(crate) fn parse_cut(text: &str) -> Result<tally_clickhouse::Cut> {
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
pub(crate) struct LoadgenArgs {
    #[arg(long, short)]
    pub(crate) config: PathBuf,
    /// Number of records (ignored with --rate and --duration).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) events: u64,
    /// Target records per second; with --duration, produces rate × duration records.
    #[arg(long)]
    pub(crate) rate: Option<u64>,
    /// How long to produce at --rate, e.g. 60s.
    #[arg(long)]
    pub(crate) duration: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Partitions of the source topic when loadgen creates it.
    #[arg(long, default_value_t = 4)]
    pub(crate) partitions: i32,
    /// Combinations of the job's group-by values (revenue_agg's customers).
    #[arg(long, default_value_t = 1000)]
    pub(crate) customers: u32,
    /// Zipf exponent of customer popularity (0 = uniform).
    #[arg(long, default_value_t = 1.1)]
    pub(crate) skew: f64,
    #[arg(long, default_value = "EUR,USD,GBP", value_delimiter = ',')]
    pub(crate) currencies: Vec<String>,
    /// Fraction of records that re-publish an earlier event (same key and id).
    #[arg(long, default_value_t = 0.02)]
    pub(crate) duplicates: f64,
    /// Fraction of poison records (every reason in turn).
    #[arg(long, default_value_t = 0.005)]
    pub(crate) poison: f64,
    /// Fraction of events later than the allowed lateness.
    #[arg(long, default_value_t = 0.005)]
    pub(crate) late: f64,
    /// Fraction of records the job's filter leaves out (each misses one condition).
    #[arg(long, default_value_t = 0.05)]
    pub(crate) filtered: f64,
    /// Event-time spacing between consecutive records of one partition, in ms.
    #[arg(long, default_value_t = 10)]
    pub(crate) step_ms: i64,
    /// First event time (ms since the epoch); default: now minus the span of the stream.
    #[arg(long)]
    pub(crate) start_ms: Option<i64>,
    /// Where to write the ground-truth manifest.
    #[arg(long, short, default_value = "manifest.json")]
    pub(crate) manifest: PathBuf,
    /// A change job: rows inserted into the source table before the --events changes (a table
    /// for the connector's first snapshot, with --events 0).
    #[arg(long, default_value_t = 0)]
    pub(crate) initial_rows: u64,
    /// A change job: new snapshots asked for through Debezium's signal table, spread over the
    /// changes.
    #[arg(long, default_value_t = 0)]
    pub(crate) snapshots: u32,
    /// A change job: REPLICA IDENTITY FULL (updates and deletes carry the old row), rather
    /// than the default (the key only).
    #[arg(long)]
    pub(crate) full_identity: bool,
}

#[derive(clap::Args)]
pub(crate) struct ReconcileArgs {
    #[arg(long, short)]
    pub(crate) config: PathBuf,
    /// Only windows starting at or after this time (RFC 3339).
    #[arg(long)]
    pub(crate) from: Option<String>,
    /// Only windows starting before this time (RFC 3339).
    #[arg(long)]
    pub(crate) to: Option<String>,
    /// Only windows of this first group-by value (revenue_agg's customer).
    #[arg(long)]
    pub(crate) customer: Option<String>,
    /// Keep running, reconciling every DURATION (e.g. 5m), and export the result as metrics.
    /// Each round reads only what was committed since the previous one.
    #[arg(long)]
    pub(crate) every: Option<String>,
    /// With --every: start over from the beginning every N rounds (which also re-checks
    /// windows that no new input touched).
    #[arg(long, default_value_t = 12)]
    pub(crate) full_every: u64,
    /// A change job: run the declaration's aggregation as SQL on the source table (this
    /// postgres:// URL, or source.postgres) and compare it with the view, instead of reading
    /// the topic again.
    #[arg(long, num_args = 0..=1, default_missing_value = "", value_name = "URL")]
    pub(crate) source: Option<String>,
    /// With --source: fail too when open windows could not be compared at one point with the
    /// table (no slot named, or the connector or the job not catching up within --wait).
    #[arg(long)]
    pub(crate) strict: bool,
    /// With --source: how long to wait for the connector to capture and the job to commit
    /// what the table's snapshot holds, before comparing only settled windows.
    #[arg(long, default_value = "60s")]
    pub(crate) wait: String,
}
