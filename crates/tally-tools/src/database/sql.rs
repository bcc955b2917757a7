//! The declaration's aggregation as SQL on the source table: the same fields (a column each),
//! filter, windows by the event-time column and group-by, so that PostgreSQL computes what the
//! view should show without any of tally's code. Each result row is a window and its keys with
//! the words tally keeps for it (a count, a sum in decimal units), read back into a
//! [`WindowAgg`] and compared as the view's cells are.

use std::fmt::Write as _;

use tally_core::declare::{
    FieldKind, FieldReader, Function, Job, Test, TimeUnit, Value, format_decimal, parse_decimal,
};
use tally_core::{WindowAgg, Word};

/// A column of the source table, as `information_schema.columns` names its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub data_type: String,
}

/// The aggregation statement and how to read its rows: after the window start (epoch ms),
/// `keys` text columns, then per word of a window's value one column (counts as `bigint`,
/// sums as `text`, each a decimal at its scale).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Aggregation {
    pub sql: String,
    pub keys: usize,
    /// Per word, the decimal scale of its text, or `None` for a count.
    pub words: Vec<Option<u32>>,
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn quote_text(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// The column a field reads: the declaration's path is the column (a row image is flat).
fn column_of<'a>(field: &FieldReader, columns: &'a [Column]) -> Result<&'a Column, String> {
    let [name] = field.path.as_slice() else {
        return Err(format!(
            "field {:?} is at path {}: a change job's fields are columns of the row (one name each)",
            field.name,
            field.path.join(".")
        ));
    };
    let column = columns.iter().find(|c| c.name == *name).ok_or_else(|| {
        let names: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
        format!(
            "field {:?}: the table has no column {name:?} (it has {})",
            field.name,
            names.join(", ")
        )
    })?;
    let t = column.data_type.as_str();
    let integer = matches!(t, "smallint" | "integer" | "bigint");
    let fits = match field.kind {
        FieldKind::String => matches!(t, "text" | "character varying" | "character" | "uuid"),
        FieldKind::Integer => integer,
        FieldKind::Decimal => integer || t == "numeric",
        FieldKind::Boolean => t == "boolean",
        FieldKind::Float => matches!(t, "real" | "double precision" | "numeric"),
        FieldKind::Timestamp => {
            integer || t.starts_with("timestamp") || matches!(t, "text" | "character varying")
        }
    };
    if fits {
        Ok(column)
    } else {
        Err(format!(
            "field {:?} is declared {} but column {name:?} is {t}",
            field.name,
            field.kind.as_str()
        ))
    }
}

/// The event time of a row in epoch milliseconds, as tally reads the column's Debezium value:
/// a timestamp (with or without time zone, which Debezium sends as UTC) or text by its time,
/// a number in the field's unit, rounded down.
fn time_ms(field: &FieldReader, column: &Column) -> String {
    let c = quote_ident(&column.name);
    match column.data_type.as_str() {
        "smallint" | "integer" | "bigint" => match field.unit {
            TimeUnit::Millis => format!("{c}::bigint"),
            TimeUnit::Seconds => format!("({c}::bigint * 1000)"),
            TimeUnit::Micros => format!("floor({c}::numeric / 1000)::bigint"),
        },
        "text" | "character varying" => {
            format!("floor(extract(epoch from {c}::timestamptz) * 1000)::bigint")
        }
        _ => format!("floor(extract(epoch from {c}) * 1000)::bigint"),
    }
}

/// A filter constant of `field` as SQL, compared with `expr`.
fn literal(field: &FieldReader, value: &Value) -> String {
    match value {
        Value::Str(s) => quote_text(s),
        Value::Int(i) | Value::Time(i) => i.to_string(),
        Value::Decimal(units) => format_decimal(i128::from(*units), field.scale),
        Value::Float(x) => format!("{x:?}"),
        Value::Bool(b) => b.to_string(),
    }
}

fn condition(expr: &str, field: &FieldReader, test: &Test) -> String {
    let list = |vs: &[Value]| {
        vs.iter()
            .map(|v| literal(field, v))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match test {
        Test::Equals(v) => format!("{expr} = {}", literal(field, v)),
        Test::NotEquals(v) => format!("{expr} <> {}", literal(field, v)),
        Test::In(vs) => format!("{expr} IN ({})", list(vs)),
        Test::NotIn(vs) => format!("{expr} NOT IN ({})", list(vs)),
        Test::Range { min, max } => {
            let mut parts = Vec::new();
            if let Some(v) = min {
                parts.push(format!("{expr} >= {}", literal(field, v)));
            }
            if let Some(v) = max {
                parts.push(format!("{expr} <= {}", literal(field, v)));
            }
            if parts.is_empty() {
                "true".to_owned()
            } else {
                parts.join(" AND ")
            }
        }
        Test::Present(true) => format!("{expr} IS NOT NULL"),
        Test::Present(false) => format!("{expr} IS NULL"),
    }
}

/// A field's value in SQL, in the terms its filter constants and keys are written in: times in
/// epoch milliseconds, an empty string as NULL (the job reads it as absent unless `allow_empty`),
/// everything else as the column holds it.
fn value_expr(field: &FieldReader, column: &Column) -> String {
    match field.kind {
        FieldKind::Timestamp => time_ms(field, column),
        FieldKind::String if !field.allow_empty => {
            format!("NULLIF({}, '')", quote_ident(&column.name))
        }
        _ => quote_ident(&column.name),
    }
}

/// A group-by key as the view's cells show it: text, a boolean as 1 or 0, a time in epoch
/// seconds (decimals are read back at the field's scale).
fn key_expr(field: &FieldReader, column: &Column) -> String {
    let value = value_expr(field, column);
    match field.kind {
        FieldKind::Boolean => format!("CASE WHEN {value} THEN '1' ELSE '0' END"),
        FieldKind::Timestamp => format!("floor({value}::numeric / 1000)::bigint::text"),
        _ => format!("{value}::text"),
    }
}

/// The declaration's aggregation over `table` (whose columns are `columns`), for windows
/// starting in `[from_ms, to_ms)` when given.
pub fn aggregation(
    job: &Job,
    table: &str,
    columns: &[Column],
    from_ms: Option<i64>,
    to_ms: Option<i64>,
) -> Result<Aggregation, Vec<String>> {
    statement(job, table, columns, (from_ms, to_ms), None)
}

/// The same aggregation over only the rows whose primary key is one of `rows` (each key's
/// values as text, in the key's order; PostgreSQL reads each as its column's type): the
/// windows those rows are in.
pub fn aggregation_of_rows(
    job: &Job,
    table: &str,
    columns: &[Column],
    rows: &[Vec<String>],
) -> Result<Aggregation, Vec<String>> {
    statement(job, table, columns, (None, None), Some(rows))
}

fn statement(
    job: &Job,
    table: &str,
    columns: &[Column],
    (from_ms, to_ms): (Option<i64>, Option<i64>),
    rows: Option<&[Vec<String>]>,
) -> Result<Aggregation, Vec<String>> {
    let mut problems = Vec::new();
    let mut column = |i: usize| match column_of(&job.fields[i], columns) {
        Ok(c) => Some(c.clone()),
        Err(e) => {
            problems.push(e);
            None
        }
    };
    let time = column(job.event_time);
    let keys: Vec<Option<Column>> = job.keys.iter().map(|&k| column(k)).collect();
    let inputs: Vec<Option<Column>> = job
        .aggregates
        .iter()
        .map(|a| a.field.and_then(&mut column))
        .collect();
    let filters: Vec<Option<Column>> = job.filter.iter().map(|c| column(c.field)).collect();
    let primary_key: Vec<Option<Column>> = match (rows, &job.changes) {
        (None, _) => Vec::new(),
        (Some(_), Some(changes)) => changes.primary_key.iter().map(|&k| column(k)).collect(),
        (Some(_), None) => {
            problems.push("the job reads events: its rows have no primary key".to_owned());
            Vec::new()
        }
    };
    for a in &job.aggregates {
        if matches!(a.function, Function::Min | Function::Max)
            || a.input.is_some_and(|t| t.kind == FieldKind::Float)
        {
            problems.push(format!(
                "aggregate {:?}: reconcile --source compares counts, and sums and averages of integers and decimals",
                a.column
            ));
        }
    }
    let Some(time) = time else {
        return Err(problems);
    };
    if !problems.is_empty() {
        return Err(problems);
    }
    let field = |i: usize| &job.fields[i];
    let mut inner = vec![format!("{} AS t__", time_ms(field(job.event_time), &time))];
    for (i, (&k, c)) in job.keys.iter().zip(&keys).enumerate() {
        if let Some(c) = c {
            inner.push(format!("{} AS k{i}__", key_expr(field(k), c)));
        }
    }
    for (i, c) in inputs.iter().enumerate() {
        if let Some(c) = c {
            inner.push(format!("{} AS a{i}__", quote_ident(&c.name)));
        }
    }
    let conditions: Vec<String> = job
        .filter
        .iter()
        .zip(&filters)
        .filter_map(|(cond, c)| {
            let f = field(cond.field);
            c.as_ref()
                .map(|c| condition(&value_expr(f, c), f, &cond.test))
        })
        .collect();
    let mut conditions = conditions;
    // A row lacking a field no condition tests is dead-lettered by the job (missing_field), so
    // it counts nowhere here either; a tested field's NULL fails its test as in the job.
    let mut required: Vec<usize> = vec![job.event_time];
    required.extend(&job.keys);
    required.extend(job.aggregates.iter().filter_map(|a| a.field));
    required.sort_unstable();
    required.dedup();
    for i in required {
        if job.filter.iter().any(|c| c.field == i) {
            continue;
        }
        if let Ok(c) = column_of(field(i), columns) {
            conditions.push(format!("{} IS NOT NULL", value_expr(field(i), c)));
        }
    }
    if let Some(rows) = rows {
        let key: Vec<String> = primary_key
            .iter()
            .flatten()
            .map(|c| quote_ident(&c.name))
            .collect();
        let tuples: Vec<String> = rows
            .iter()
            .map(|r| {
                let values: Vec<String> = r.iter().map(|v| quote_text(v)).collect();
                format!("({})", values.join(", "))
            })
            .collect();
        conditions.push(if tuples.is_empty() {
            "false".to_owned()
        } else {
            format!("({}) IN ({})", key.join(", "), tuples.join(", "))
        });
    }
    let mut sql = format!("SELECT {} FROM {table}", inner.join(", "));
    if !conditions.is_empty() {
        let _ = write!(sql, " WHERE {}", conditions.join(" AND "));
    }
    let (size, slide) = (job.windows.size_ms, job.windows.slide_ms);
    // The windows holding a row: starts aligned to the slide, from the newest back by the
    // size (one window when tumbling).
    let mut outer = vec!["w__.start".to_owned()];
    outer.extend((0..job.keys.len()).map(|i| format!("r__.k{i}__")));
    let mut words = Vec::new();
    for (i, a) in job.aggregates.iter().enumerate() {
        let scale = a.input.map_or(0, |t| {
            if t.kind == FieldKind::Decimal {
                t.scale
            } else {
                0
            }
        });
        match a.function {
            Function::Count => {
                outer.push("count(*)::bigint".to_owned());
                words.push(None);
            }
            Function::Sum => {
                outer.push(format!("sum(r__.a{i}__)::text"));
                words.push(Some(scale));
            }
            Function::Avg => {
                outer.push(format!("sum(r__.a{i}__)::text"));
                outer.push("count(*)::bigint".to_owned());
                words.push(Some(scale));
                words.push(None);
            }
            Function::Min | Function::Max => {}
        }
    }
    let mut range = Vec::new();
    if let Some(from) = from_ms {
        range.push(format!("w__.start >= {from}"));
    }
    if let Some(to) = to_ms {
        range.push(format!("w__.start < {to}"));
    }
    let group: Vec<String> = (1..=job.keys.len() + 1).map(|i| i.to_string()).collect();
    let sql = format!(
        "SELECT {outer} FROM ({sql}) AS r__ \
         CROSS JOIN LATERAL generate_series(r__.t__ - mod(r__.t__, {slide}) - {back}, r__.t__ - mod(r__.t__, {slide}), {slide}) AS w__(start){range} \
         GROUP BY {group}",
        outer = outer.join(", "),
        back = size - slide,
        range = if range.is_empty() {
            String::new()
        } else {
            format!(" WHERE {}", range.join(" AND "))
        },
        group = group.join(", "),
    );
    Ok(Aggregation {
        sql,
        keys: job.keys.len(),
        words,
    })
}

impl Aggregation {
    /// A result row's words read back from their text (counts as integers, sums as decimals
    /// at their scale).
    pub fn window(&self, words: &[String]) -> Result<WindowAgg, String> {
        let words: Result<Vec<Word>, String> = self
            .words
            .iter()
            .zip(words)
            .map(|(scale, text)| match scale {
                None => text
                    .parse::<u64>()
                    .map(Word::Count)
                    .map_err(|e| format!("count {text:?}: {e}")),
                Some(s) => parse_decimal(text, *s).map(Word::Exact),
            })
            .collect();
        Ok(WindowAgg::new(words?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn columns(list: &[(&str, &str)]) -> Vec<Column> {
        list.iter()
            .map(|(n, t)| Column {
                name: (*n).into(),
                data_type: (*t).into(),
            })
            .collect()
    }

    fn orders() -> Job {
        let config = tally_runtime::config::Config::parse(
            "orders.toml",
            include_str!("../../../../config/orders.toml"),
            &[],
        )
        .expect("the shipped orders job parses");
        config.declared.as_ref().clone()
    }

    const ORDERS_COLUMNS: &[(&str, &str)] = &[
        ("order_id", "bigint"),
        ("customer_id", "text"),
        ("amount", "numeric"),
        ("status", "text"),
        ("created_at", "timestamp with time zone"),
    ];

    #[test]
    fn the_shipped_orders_job_is_one_grouped_select_of_its_table() {
        let a = aggregation(
            &orders(),
            "public.orders",
            &columns(ORDERS_COLUMNS),
            None,
            None,
        )
        .expect("sql");
        assert_eq!(
            a.sql,
            "SELECT w__.start, r__.k0__, count(*)::bigint, sum(r__.a1__)::text FROM \
             (SELECT floor(extract(epoch from \"created_at\") * 1000)::bigint AS t__, NULLIF(\"customer_id\", '')::text AS k0__, \"amount\" AS a1__ \
             FROM public.orders WHERE NULLIF(\"status\", '') NOT IN ('cancelled') \
             AND NULLIF(\"customer_id\", '') IS NOT NULL AND \"amount\" IS NOT NULL \
             AND floor(extract(epoch from \"created_at\") * 1000)::bigint IS NOT NULL) AS r__ \
             CROSS JOIN LATERAL generate_series(r__.t__ - mod(r__.t__, 3600000) - 0, r__.t__ - mod(r__.t__, 3600000), 3600000) AS w__(start) \
             GROUP BY 1, 2"
        );
        assert_eq!((a.keys, a.words.clone()), (1, vec![None, Some(2)]));
        let value = a.window(&["3".into(), "-12.50".into()]).expect("row");
        assert_eq!(value.words(), &[Word::Count(3), Word::Exact(-1250)]);
    }

    #[test]
    fn a_table_that_does_not_fit_the_declaration_is_named_column_by_column() {
        let mut wrong = columns(ORDERS_COLUMNS);
        wrong[2].data_type = "text".into();
        wrong.retain(|c| c.name != "status");
        let problems =
            aggregation(&orders(), "public.orders", &wrong, None, None).expect_err("mismatch");
        assert!(
            problems
                .iter()
                .any(|p| p == "field \"amount\" is declared decimal but column \"amount\" is text"),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("field \"status\": the table has no column \"status\"")),
            "{problems:?}"
        );
    }

    #[test]
    fn times_read_as_debezium_sends_each_column_type() {
        let field = |unit| FieldReader {
            name: "t".into(),
            path: vec!["t".into()],
            kind: FieldKind::Timestamp,
            scale: 0,
            format: tally_core::declare::StringFormat::Any,
            unit,
            allow_empty: false,
        };
        let col = |t: &str| Column {
            name: "t".into(),
            data_type: t.into(),
        };
        assert_eq!(
            time_ms(&field(TimeUnit::Micros), &col("bigint")),
            "floor(\"t\"::numeric / 1000)::bigint"
        );
        assert_eq!(
            time_ms(&field(TimeUnit::Seconds), &col("integer")),
            "(\"t\"::bigint * 1000)"
        );
        assert_eq!(
            time_ms(
                &field(TimeUnit::Millis),
                &col("timestamp without time zone")
            ),
            "floor(extract(epoch from \"t\") * 1000)::bigint"
        );
        assert_eq!(
            condition(
                "x",
                &field(TimeUnit::Millis),
                &Test::Equals(Value::Str("o'k".into()))
            ),
            "x = 'o''k'"
        );
    }
}
