//! The dashboard and the alerts in deploy/ name only metrics tally exports (read from its source).

use std::collections::BTreeSet;

/// Metric names the code exports, read from its own source.
fn exported() -> BTreeSet<String> {
    let sources = [
        include_str!("../crates/tally-runtime/src/events.rs"),
        include_str!("../crates/tally-runtime/src/worker.rs"),
        include_str!("../crates/tally-tools/src/events.rs"),
        include_str!("../crates/tally/src/main.rs"),
    ];
    let mut names = BTreeSet::new();
    for source in sources {
        for macro_name in ["counter!(", "gauge!(", "histogram!("] {
            // The name may follow on the next line, as rustfmt breaks long calls.
            for piece in source.split(macro_name).skip(1) {
                if let Some(name) = piece
                    .trim_start()
                    .strip_prefix('"')
                    .and_then(|rest| rest.split('"').next())
                    && name.starts_with("tally_")
                {
                    names.insert(name.to_owned());
                }
            }
        }
    }
    names
}

fn referenced(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (i, _) in text.match_indices("tally_") {
        let name: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        // The job's label (and the dashboard's variable of that name) is not a metric.
        if name == tally_runtime::job_scope::JOB_LABEL {
            continue;
        }
        // Prometheus suffixes of histograms and summaries.
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        names.insert(base.to_owned());
    }
    names
}

#[test]
fn deploy_files_reference_only_exported_metrics() {
    let exported = exported();
    assert!(
        exported.contains("tally_records_consumed_total"),
        "{exported:?}"
    );
    let dashboard = include_str!("../deploy/grafana-dashboard.json");
    let parsed: serde_json::Value = serde_json::from_str(dashboard).expect("the dashboard is JSON");
    assert!(parsed["panels"].as_array().is_some_and(|p| p.len() >= 8));
    let alerts = include_str!("../deploy/alerts.yml");
    assert!(alerts.contains("groups:") && alerts.matches("- alert:").count() >= 5);
    for (file, text) in [
        ("grafana-dashboard.json", dashboard),
        ("alerts.yml", alerts),
    ] {
        let used = referenced(text);
        assert!(used.len() >= 5, "{file} references metrics");
        let unknown: Vec<_> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} references metrics tally does not export: {unknown:?}"
        );
    }
    // Names that are not tally's own (the dashboard's datasource uid) are not metrics.
    assert!(referenced("tally_x_bucket").contains("tally_x"));
    // The job is the dashboard's variable, and every panel shows the jobs chosen.
    let variables = parsed["templating"]["list"].as_array().expect("variables");
    assert!(variables.iter().any(|v| v["name"] == "tally_job"));
    let selector = format!("{}=~\"$tally_job\"", tally_runtime::job_scope::JOB_LABEL);
    for panel in parsed["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("an expression");
            let metrics = referenced(expr).len();
            assert_eq!(
                expr.matches(&selector).count(),
                expr.matches("tally_").count() - expr.matches("tally_job").count(),
                "{expr} selects every metric by job"
            );
            assert!(metrics >= 1, "{expr}");
        }
    }
}
