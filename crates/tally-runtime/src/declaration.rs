//! A job file's `[aggregation]` section: checked with the job's `[window]` rules when the file is
//! loaded, printed by `tally check-config`, and run by the built-in operator when it declares
//! revenue_agg's shape (the only shape the pipeline writes in this release).

use std::fmt::Write as _;

use tally_core::FieldMapping;
use tally_core::declare::{
    FieldKind, Function, Job, StringFormat, Test, TimeUnit, format_duration,
};

/// The built-in operator's field mapping for a declaration of revenue_agg's shape, or why this
/// release cannot run the declaration.
pub fn built_in_fields(job: &Job) -> Result<FieldMapping, String> {
    let field = |i: usize| &job.fields[i];
    let path_of = |i: usize| -> Result<String, String> {
        match field(i).path.as_slice() {
            [key] => Ok(key.clone()),
            path => Err(format!(
                "field {:?} is nested ({}); the built-in operator reads top-level keys",
                field(i).name,
                path.join(".")
            )),
        }
    };
    let shape = "this release writes one shape: tumbling windows, group_by = [\"customer_id\", \"currency\"] \
                 (strings, currency with format = \"currency_code\"), aggregates orders = count and revenue = \
                 sum of a decimal of scale 4, a string event id, no filter";
    let refuse = |why: &str| Err(format!("{why}; {shape}"));
    if job.format != tally_core::declare::Format::Json {
        return refuse(&format!(
            "the declaration reads {} records",
            job.format.as_str()
        ));
    }
    if job.windows.slide_ms != job.windows.size_ms {
        return refuse("the window hops");
    }
    if !job.filter.is_empty() {
        return refuse("the declaration has a filter");
    }
    let [customer, currency] = job.keys.as_slice() else {
        return refuse("the declaration does not group by two fields");
    };
    let key_ok = |i: usize, name: &str, format: StringFormat| {
        let f = field(i);
        f.name == name && f.kind == FieldKind::String && f.format == format && !f.allow_empty
    };
    if !key_ok(*customer, "customer_id", StringFormat::Any)
        || !key_ok(*currency, "currency", StringFormat::CurrencyCode)
    {
        return refuse("the keys differ");
    }
    let [orders, revenue] = job.aggregates.as_slice() else {
        return refuse("the declaration does not compute two aggregates");
    };
    let Some(amount) = revenue.field else {
        return refuse("revenue has no field");
    };
    if orders.column != "orders"
        || orders.function != Function::Count
        || revenue.column != "revenue"
        || revenue.function != Function::Sum
        || field(amount).kind != FieldKind::Decimal
        || field(amount).scale != 4
    {
        return refuse("the aggregates differ");
    }
    let id = field(job.event_id);
    let time = field(job.event_time);
    if id.kind != FieldKind::String || id.allow_empty || time.unit != TimeUnit::Millis {
        return refuse("the event id or event time differ");
    }
    if job.fields.len() != 5 {
        return refuse("the declaration reads other fields");
    }
    Ok(FieldMapping {
        event_id: path_of(job.event_id)?,
        customer_id: path_of(*customer)?,
        currency: path_of(*currency)?,
        amount: path_of(amount)?,
        event_time: path_of(job.event_time)?,
    })
}

/// What `check-config` prints of a declaration: fields, filter, windows and the view's columns.
pub fn describe(job: &Job) -> String {
    let mut out = String::new();
    let field_names = |i: usize| job.fields[i].name.clone();
    let _ = writeln!(out, "aggregation:");
    for f in &job.fields {
        let extra = match f.kind {
            FieldKind::Decimal => format!("(18, {})", f.scale),
            FieldKind::Timestamp if f.unit == TimeUnit::Seconds => " (numbers in seconds)".into(),
            FieldKind::Timestamp if f.unit == TimeUnit::Micros => {
                " (numbers in microseconds)".into()
            }
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  field  {} {}{extra} at {}",
            f.name,
            f.kind.as_str(),
            f.path.join(".")
        );
    }
    match &job.changes {
        Some(changes) => {
            let key: Vec<String> = changes
                .primary_key
                .iter()
                .map(|&k| field_names(k))
                .collect();
            let _ = writeln!(
                out,
                "  source {} changes of rows keyed by ({}), time {}: an update retracts what the row's earlier image added, a delete retracts it",
                job.format.as_str(),
                key.join(", "),
                field_names(job.event_time)
            );
        }
        None => {
            let _ = writeln!(
                out,
                "  event  id {}, time {}",
                field_names(job.event_id),
                field_names(job.event_time)
            );
        }
    }
    for c in &job.filter {
        let name = field_names(c.field);
        let scale = job.fields[c.field].scale;
        let show = |v: &tally_core::declare::Value| v.display(scale).to_string();
        let list =
            |vs: &[tally_core::declare::Value]| vs.iter().map(show).collect::<Vec<_>>().join(", ");
        let test = match &c.test {
            Test::Equals(v) => format!("{name} = {}", show(v)),
            Test::NotEquals(v) => format!("{name} != {}", show(v)),
            Test::In(vs) => format!("{name} in [{}]", list(vs)),
            Test::NotIn(vs) => format!("{name} not in [{}]", list(vs)),
            Test::Range { min, max } => format!(
                "{} <= {name} <= {}",
                min.as_ref().map_or("-inf".into(), show),
                max.as_ref().map_or("+inf".into(), show)
            ),
            Test::Present(true) => format!("{name} is present"),
            Test::Present(false) => format!("{name} is absent or null (then not read)"),
        };
        let _ = writeln!(out, "  filter {test}");
    }
    let w = job.windows;
    let per_record = w.size_ms / w.slide_ms;
    let every = if per_record > 1 {
        format!(" every {}", format_duration(w.slide_ms))
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "  window {}{every}: {per_record} window(s) per record",
        format_duration(w.size_ms)
    );
    let keys: Vec<String> = job.keys.iter().map(|k| field_names(*k)).collect();
    let _ = writeln!(out, "  group  {}", keys.join(", "));
    let columns: Vec<String> = job
        .columns()
        .into_iter()
        .map(|(n, t)| format!("{n} {t}"))
        .collect();
    let _ = writeln!(out, "  view   {}", columns.join(", "));
    out
}
