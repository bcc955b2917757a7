//! Read cost of the view against an ideal table that holds exactly the view's rows.
//!
//! `scripts/bench.sh --read` builds the history through the real pipeline and then runs
//! `cargo bench -p tally --bench read -- --database DB [--table T] [--runs N]`. Each
//! representative dashboard query runs on the view and on the ideal table, interleaved, and the
//! p50/p99 of the client-side wall time are printed with their ratio.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clickhouse::Client;

struct Args {
    url: String,
    database: Option<String>,
    table: String,
    runs: usize,
}

fn args() -> Result<Args> {
    let mut args = Args {
        url: "http://127.0.0.1:8123".into(),
        database: None,
        table: "revenue_agg".into(),
        runs: 30,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => args.url = value()?,
            "--database" => args.database = Some(value()?),
            "--table" => args.table = value()?,
            "--runs" => args.runs = value()?.parse().context("--runs")?,
            // Passed by `cargo bench`.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

async fn time_query(client: &Client, sql: &str) -> Result<Duration> {
    let started = Instant::now();
    let bytes = client
        .query(sql)
        .fetch_bytes("TSV")
        .with_context(|| sql.to_owned())?
        .collect()
        .await
        .with_context(|| sql.to_owned())?;
    std::hint::black_box(bytes);
    Ok(started.elapsed())
}

async fn scalar(client: &Client, sql: &str) -> Result<u64> {
    client
        .query(sql)
        .fetch_one::<u64>()
        .await
        .with_context(|| sql.to_owned())
}

async fn run(args: Args, database: &str) -> Result<()> {
    let client = Client::default()
        .with_url(&args.url)
        .with_setting("wait_end_of_query", "1")
        .with_validation(false);
    let (db, t) = (database, &args.table);
    let view = format!("{db}.{t}");
    let ideal = format!("{db}.{t}_ideal");
    client
        .query(&format!("DROP TABLE IF EXISTS {ideal}"))
        .execute()
        .await?;
    client
        .query(&format!(
            "CREATE TABLE {ideal} ENGINE = MergeTree PARTITION BY toYYYYMMDD(window_start) \
             ORDER BY (window_start, customer_id, currency) AS SELECT * FROM {view}"
        ))
        .execute()
        .await
        .context("building the ideal table")?;
    client
        .query(&format!("OPTIMIZE TABLE {ideal} FINAL"))
        .execute()
        .await?;
    let answer = scalar(&client, &format!("SELECT count() FROM {ideal}")).await?;
    let versions = scalar(&client, &format!("SELECT count() FROM {db}.{t}_data")).await?;
    let folded = scalar(&client, &format!("SELECT count() FROM {db}.{t}_final")).await?;
    let published = scalar(&client, &format!("SELECT count() FROM {db}.{t}_live")).await?;
    let end = scalar(
        &client,
        &format!("SELECT toUInt64(max(window_start)) FROM {ideal}"),
    )
    .await?;
    let first = scalar(
        &client,
        &format!("SELECT toUInt64(min(window_start)) FROM {ideal}"),
    )
    .await?;
    let customer: String = client
        .query(&format!(
            "SELECT customer_id FROM {ideal} WHERE window_start >= toDateTime({}) GROUP BY customer_id ORDER BY sum(orders) DESC LIMIT 1",
            end - 86_400
        ))
        .fetch_one()
        .await?;
    let pushdown: String = client
        .query(
            "SELECT value FROM system.settings WHERE name = 'enable_optimize_predicate_expression'",
        )
        .fetch_one()
        .await
        .unwrap_or_else(|_| "?".into());

    let hour = end - 3_600;
    let day = end - 86_400;
    let week = end.saturating_sub(7 * 86_400);
    let queries: Vec<(&str, String)> = vec![
        (
            "one customer, last hour",
            format!(
                "SELECT sum(orders), sum(revenue) FROM {{t}} WHERE customer_id = '{customer}' AND window_start >= toDateTime({hour})"
            ),
        ),
        (
            "one customer, last 7 days, per day",
            format!(
                "SELECT toDate(window_start) AS d, sum(orders), sum(revenue) FROM {{t}} WHERE customer_id = '{customer}' AND window_start >= toDateTime({week}) GROUP BY d ORDER BY d"
            ),
        ),
        (
            "all customers, last hour, per minute",
            format!(
                "SELECT window_start, sum(orders), sum(revenue) FROM {{t}} WHERE window_start >= toDateTime({hour}) GROUP BY window_start ORDER BY window_start"
            ),
        ),
        (
            "totals, last day",
            format!(
                "SELECT count(), sum(orders), sum(revenue) FROM {{t}} WHERE window_start >= toDateTime({day})"
            ),
        ),
        (
            "top 10 customers, last day",
            format!(
                "SELECT customer_id, sum(revenue) AS r FROM {{t}} WHERE window_start >= toDateTime({day}) GROUP BY customer_id ORDER BY r DESC, customer_id LIMIT 10"
            ),
        ),
    ];

    println!(
        "history: {:.1} days of windows; answer rows {answer}; data rows {} (folded {folded}, versions {versions}, published {published}); data rows per answer row {:.3}",
        (end - first) as f64 / 86_400.0,
        folded + versions + published,
        (folded + versions + published) as f64 / answer.max(1) as f64
    );
    println!(
        "enable_optimize_predicate_expression = {pushdown}; {} runs per query",
        args.runs
    );
    println!(
        "{:<38} {:>10} {:>10} {:>10} {:>10} {:>8}",
        "query", "view p50", "view p99", "ideal p50", "ideal p99", "ratio"
    );
    for (name, template) in &queries {
        let on_view = template.replace("{t}", &view);
        let on_ideal = template.replace("{t}", &ideal);
        // Same answer, or the comparison means nothing.
        let a = client.query(&on_view).fetch_bytes("TSV")?.collect().await?;
        let b = client
            .query(&on_ideal)
            .fetch_bytes("TSV")?
            .collect()
            .await?;
        if a != b {
            bail!("{name}: the view and the ideal table answer differently");
        }
        let (mut v, mut i) = (Vec::new(), Vec::new());
        for _ in 0..args.runs {
            v.push(time_query(&client, &on_view).await?);
            i.push(time_query(&client, &on_ideal).await?);
        }
        v.sort();
        i.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "{:<38} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>7.2}x",
            name,
            ms(percentile(&v, 0.5)),
            ms(percentile(&v, 0.99)),
            ms(percentile(&i, 0.5)),
            ms(percentile(&i, 0.99)),
            ms(percentile(&v, 0.5)) / ms(percentile(&i, 0.5)).max(1e-9)
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = args()?;
    let Some(database) = args.database.clone() else {
        println!("read bench: pass --database DB (scripts/bench.sh --read builds one)");
        return Ok(());
    };
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(run(args, &database))
}
