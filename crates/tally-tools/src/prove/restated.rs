//! What `tally verify` expects of a new version of a job (docs/design/restatement.md): its own
//! view holds the windows from `restate_from` on; once it holds the job's view, that view shows
//! the earlier version's answer before then, as the takeover kept it; its dead-letter topic
//! holds what it dead-lettered from where it started reading.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use tally_clickhouse::{ClickHouseSink, ColumnType};
use tally_core::declare::{Aggregate, Job};
use tally_core::{PoisonReason, WindowSpec};
use tally_runtime::config::Config;

use crate::loadgen::{Manifest, Shown};

/// A view row's window start (ms) and group-by values.
pub(crate) type RowKey = (i64, Vec<String>);
/// A view's windows as the tools compare them: (window start ms, keys) → values.
pub(crate) type Windows = BTreeMap<RowKey, Vec<Shown>>;

/// Whether the job's view reads this version's own (the version holds the job), and the line
/// the tools print first saying which windows they compare and where readers read them
/// (`None` for version 1).
pub(crate) async fn readers_read(
    config: &Config,
    sink: &ClickHouseSink,
) -> Result<(bool, Option<String>)> {
    let holds = config.job.version > 1
        && sink
            .job_view_reads(&config.clickhouse.table, &config.version_table())
            .await?;
    Ok((holds, whose_windows(config, holds)))
}

/// Which windows a new version's tools compare and where readers read them, for their report;
/// `None` for version 1. `holds`: the job's view reads this version's.
fn whose_windows(config: &Config, holds: bool) -> Option<String> {
    let version = config.job.version;
    if version <= 1 {
        return None;
    }
    let from = config.restate_from_ms().map_or(String::new(), |r| {
        format!(", restating from {}", tally_core::time::format_ms(r))
    });
    let view = &config.clickhouse.table;
    Some(if holds {
        format!(
            "version {version}{from}: holds the job's view {view}, which shows its windows and, \
             before restate_from, the earlier version's answer as the takeover kept it ({view}__v{version}_kept)"
        )
    } else {
        format!(
            "version {version}{from}: its own view {} (the job's view {view} is the earlier version's until the takeover)",
            config.version_table()
        )
    })
}

/// The windows a version computes (those starting at `from_ms` or later), and the others.
pub(crate) fn split_at(windows: Windows, from_ms: Option<i64>) -> (Windows, Windows) {
    match from_ms {
        None => (windows, Windows::new()),
        Some(from) => windows
            .into_iter()
            .partition(|((start, _), _)| *start >= from),
    }
}

/// The lines of a declaration's description that decide which records count where: all but
/// its fields (a version may read one more) and its view's columns (compared one by one).
fn counting_rules(job: &Job) -> Vec<String> {
    let mut lines: Vec<String> = tally_runtime::declaration::describe(job)
        .lines()
        .filter(|l| !l.starts_with("  field") && !l.starts_with("  view") && l.starts_with("  "))
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// An aggregate as the earlier version computes it: the same function of the same field.
fn same_aggregate(earlier: &Job, a: &Aggregate, job: &Job, b: &Aggregate) -> bool {
    let field = |job: &Job, x: &Aggregate| x.field.map(|f| job.fields[f].name.clone());
    a.function == b.function && a.input == b.input && field(earlier, a) == field(job, b)
}

/// The earlier version's answer for the windows `before` (the manifest's, by this version's
/// rules) in this version's columns, as the takeover kept it: each column the earlier version
/// computes the same way, and the ones it lacks at their defaults. The manifest holds the truth
/// of one set of rules, so an earlier version whose rules differ beyond its columns is refused.
pub(crate) fn earlier_answer(
    earlier: &Config,
    config: &Config,
    before: &Windows,
    values: &[ColumnType],
) -> Result<Windows> {
    let (old, new) = (&earlier.declared, &config.declared);
    // The event-time rules but the restatement.
    let rules = |c: &Config| tally_core::OperatorConfig {
        windows_from_ms: None,
        ..c.operator()
    };
    if rules(earlier) != rules(config) || counting_rules(old) != counting_rules(new) {
        bail!(
            "--earlier: version {} of the job counts records by other rules than version {} (its \
             filter, keys, window or lateness differ): the manifest holds one version's truth, \
             so only the view's columns may differ",
            earlier.job.version,
            config.job.version
        );
    }
    let mut taken = Vec::with_capacity(new.aggregates.len());
    for (i, b) in new.aggregates.iter().enumerate() {
        match old.aggregates.iter().find(|a| a.column == b.column) {
            None => taken.push(None),
            Some(a) if same_aggregate(old, a, new, b) => taken.push(Some(i)),
            Some(_) => bail!(
                "--earlier: column {} is computed otherwise by version {}: the manifest holds \
                 version {}'s truth only",
                b.column,
                earlier.job.version,
                config.job.version
            ),
        }
    }
    let default = |t: &ColumnType| match t {
        ColumnType::Float64 => Shown::Float(0.0),
        _ => Shown::Exact(0),
    };
    Ok(before
        .iter()
        .map(|(key, shown)| {
            let row = taken
                .iter()
                .zip(values)
                .map(|(at, t)| match at.and_then(|i| shown.get(i)) {
                    Some(v) => *v,
                    None => default(t),
                })
                .collect();
            (key.clone(), row)
        })
        .collect())
}

/// The dead letters of a version that starts reading each partition at `starts` (all of it when
/// `None`) and computes the windows from `from_ms` on: the manifest's from those offsets, but
/// the late events of earlier windows, which it counts as filtered with their windows.
pub(crate) fn dead_letters_from(
    manifest: &Manifest,
    starts: Option<&BTreeMap<i32, i64>>,
    from_ms: Option<i64>,
    window: WindowSpec,
) -> BTreeMap<(i32, i64), PoisonReason> {
    let late: BTreeMap<(i32, i64), i64> = manifest
        .late_times
        .iter()
        .map(|(p, o, t)| ((*p, *o), *t))
        .collect();
    let read = |p: &i32, o: &i64| starts.is_none_or(|s| s.get(p).is_none_or(|start| o >= start));
    let computed = |p: &i32, o: &i64| match (from_ms, late.get(&(*p, *o))) {
        (Some(from), Some(t)) => window.start_of(*t) >= from,
        _ => true,
    };
    manifest
        .dead_letters
        .iter()
        .filter(|(p, o, _)| read(p, o) && computed(p, o))
        .map(|(p, o, r)| ((*p, *o), *r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn windows(rows: &[(i64, &str, i128)]) -> Windows {
        rows.iter()
            .map(|(w, k, n)| ((*w, vec![(*k).to_owned()]), vec![Shown::Exact(*n)]))
            .collect()
    }

    #[test]
    fn a_version_computes_the_windows_from_its_restatement() {
        let all = windows(&[(0, "a", 1), (60_000, "a", 2), (120_000, "b", 3)]);
        let (mine, before) = split_at(all.clone(), Some(60_000));
        assert_eq!(mine, windows(&[(60_000, "a", 2), (120_000, "b", 3)]));
        assert_eq!(before, windows(&[(0, "a", 1)]));
        let (mine, before) = split_at(all.clone(), None);
        assert_eq!((mine, before.len()), (all, 0));
    }

    /// revenue_agg, as version 2 with `extra` appended to its file.
    fn revenue_agg(version: u64, extra: &str) -> Config {
        let text = include_str!("../../../../config/revenue_agg.toml").replace(
            "[job]\n",
            &format!("[job]\nversion = {version}\nrestate_from = \"2026-01-01T00:01:00Z\"\n"),
        );
        Config::parse("revenue_agg.toml", &(text + extra), &[]).expect("the job parses")
    }

    #[test]
    fn the_kept_windows_are_the_earlier_answer_in_this_versions_columns() {
        let added = "\n[[aggregation.aggregate]]\ncolumn = \"largest\"\nfunction = \"max\"\nfield = \"amount\"\n";
        let v2 = revenue_agg(2, added);
        let v1 = Config::parse(
            "revenue_agg.toml",
            include_str!("../../../../config/revenue_agg.toml"),
            &[],
        )
        .unwrap();
        let types = [
            ColumnType::UInt64,
            ColumnType::Decimal(4),
            ColumnType::Decimal(4),
        ];
        let key = (0, vec!["c-1".to_owned(), "EUR".to_owned()]);
        let before: Windows = [(
            key.clone(),
            vec![Shown::Exact(3), Shown::Exact(15_000), Shown::Exact(9_000)],
        )]
        .into();
        let kept = earlier_answer(&v1, &v2, &before, &types).unwrap();
        assert_eq!(
            kept[&key],
            vec![Shown::Exact(3), Shown::Exact(15_000), Shown::Exact(0)],
            "version 1 has no `largest`: the takeover kept it at its default"
        );
        // Other counting rules: the manifest is not version 1's truth.
        let mut other = v1.clone();
        other.window.allowed_lateness.0 += 1;
        let err = earlier_answer(&other, &v2, &before, &types).unwrap_err();
        assert!(err.to_string().contains("other rules"), "{err}");
        // A column of the same name computed otherwise.
        let v3 = revenue_agg(3, &added.replace("\"max\"", "\"min\""));
        let err = earlier_answer(&v2, &v3, &before, &types).unwrap_err();
        assert!(err.to_string().contains("column largest"), "{err}");
    }

    #[test]
    fn a_version_dead_letters_what_it_reads_but_late_events_of_earlier_windows() {
        let manifest = Manifest {
            dead_letters: vec![
                (0, 3, PoisonReason::InvalidJson),
                (0, 10, PoisonReason::InvalidJson),
                (0, 11, PoisonReason::Late),
                (0, 12, PoisonReason::Late),
                (1, 0, PoisonReason::Late),
            ],
            late_times: vec![(0, 11, 59_999), (0, 12, 60_000), (1, 0, 1_000)],
            ..Manifest::default()
        };
        let window = WindowSpec {
            size_ms: 60_000,
            slide_ms: 60_000,
        };
        let starts = BTreeMap::from([(0, 10), (1, 0)]);
        let got = dead_letters_from(&manifest, Some(&starts), Some(60_000), window);
        assert_eq!(
            got.into_keys().collect::<Vec<_>>(),
            vec![(0, 10), (0, 12)],
            "before its start unread; a late event of a window before 60 s filtered"
        );
        assert_eq!(dead_letters_from(&manifest, None, None, window).len(), 5);
    }
}
