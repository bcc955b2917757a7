//! The shape of a job's rows in ClickHouse: its group-by keys and, per aggregate, the columns the
//! tables keep, how the rows of several source partitions merge in the answer (sum of sums, min
//! of mins, ...) and what the view shows. Every statement that names a key or a value column
//! takes it from here, so one declaration gives one set of tables, publish, fold and view.

use tally_core::declare::{FieldKind, FieldType, Function, Job};

/// A job's keys and aggregates as ClickHouse columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shape {
    /// Group-by keys: (column, ClickHouse type), in declaration order.
    keys: Vec<(String, String)>,
    aggregates: Vec<AggregateColumns>,
    /// A job of changes: a group's rows can all be retracted, leaving a count of 0 that the
    /// answer leaves out, as the source table has no such group.
    retracts: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct AggregateColumns {
    column: String,
    function: Function,
    /// The type of the kept value (of the running sum, for `avg`).
    value_type: String,
    /// The decimal scale of the kept value, if it is a decimal.
    scale: Option<u32>,
}

impl AggregateColumns {
    /// (column, type) kept in the version, folded and live tables: `avg` keeps its sum and its
    /// count, so that partitions merge exactly; the view divides.
    fn kept(&self) -> Vec<(String, String)> {
        match self.function {
            Function::Avg => vec![
                (format!("{}__sum", self.column), self.value_type.clone()),
                (format!("{}__count", self.column), "UInt64".to_owned()),
            ],
            _ => vec![(self.column.clone(), self.value_type.clone())],
        }
    }

    /// The merge of the partitions' values of kept column `kept` (aliased `p_<kept>`).
    fn merge(&self, kept: &str, kept_type: &str) -> String {
        let merged = match self.function {
            Function::Min => format!("min(p_{kept})"),
            Function::Max => format!("max(p_{kept})"),
            Function::Count | Function::Sum | Function::Avg => format!("sum(p_{kept})"),
        };
        // A sum of Decimal(18, s) is Decimal(38, s) on every server: back to the column's type.
        match (self.scale, kept_type.starts_with("Decimal"), self.function) {
            (Some(s), true, Function::Sum | Function::Avg) => {
                format!("toDecimal64({merged}, {s}) AS {kept}")
            }
            _ => format!("{merged} AS {kept}"),
        }
    }

    /// What the view shows, and its type.
    fn shown(&self) -> (String, String) {
        match (self.function, self.scale) {
            (Function::Avg, Some(s)) => (
                format!(
                    "toDecimal64({c}__sum / {c}__count, {s}) AS {c}",
                    c = self.column
                ),
                format!("Decimal(18, {s})"),
            ),
            (Function::Avg, None) => (
                format!("{c}__sum / {c}__count AS {c}", c = self.column),
                "Float64".to_owned(),
            ),
            _ => (self.column.clone(), self.value_type.clone()),
        }
    }
}

impl Shape {
    /// revenue_agg's: orders and revenue per customer and currency.
    pub fn revenue_agg() -> Shape {
        Shape {
            keys: vec![
                ("customer_id".to_owned(), "String".to_owned()),
                ("currency".to_owned(), "String".to_owned()),
            ],
            aggregates: vec![
                AggregateColumns {
                    column: "orders".to_owned(),
                    function: Function::Count,
                    value_type: "UInt64".to_owned(),
                    scale: None,
                },
                AggregateColumns {
                    column: "revenue".to_owned(),
                    function: Function::Sum,
                    value_type: "Decimal(18, 4)".to_owned(),
                    scale: Some(4),
                },
            ],
            retracts: false,
        }
    }

    /// The shape of a declared job.
    pub fn of(job: &Job) -> Shape {
        let keys = job
            .keys
            .iter()
            .map(|&k| {
                let field = &job.fields[k];
                let kind = FieldType {
                    kind: field.kind,
                    scale: field.scale,
                };
                (field.name.clone(), kind.clickhouse_type())
            })
            .collect();
        let aggregates = job
            .aggregates
            .iter()
            .map(|a| {
                let decimal = a
                    .input
                    .filter(|t| t.kind == FieldKind::Decimal)
                    .map(|t| t.scale);
                let (value_type, scale) = match (a.function, a.input) {
                    (Function::Count, _) | (_, None) => ("UInt64".to_owned(), None),
                    (_, Some(t)) => (t.clickhouse_type(), decimal),
                };
                AggregateColumns {
                    column: a.column.clone(),
                    function: a.function,
                    value_type,
                    scale,
                }
            })
            .collect();
        Shape {
            keys,
            aggregates,
            retracts: job.changes.is_some(),
        }
    }

    /// Whether this is revenue_agg's shape: the one the worker's rows, reads and checks of
    /// totals are written for in this release.
    pub fn is_revenue_agg(&self) -> bool {
        *self == Shape::revenue_agg()
    }

    /// The keys, comma-separated.
    pub(crate) fn key_list(&self) -> String {
        join(self.keys.iter().map(|(name, _)| name.as_str()))
    }

    /// The group-by keys: (column, ClickHouse type), in order.
    pub(crate) fn keys(&self) -> &[(String, String)] {
        &self.keys
    }

    /// The kept value columns: (column, ClickHouse type), one per word of a window's value.
    pub(crate) fn kept(&self) -> Vec<(String, String)> {
        self.aggregates.iter().flat_map(|a| a.kept()).collect()
    }

    /// The kept value columns, comma-separated.
    pub(crate) fn kept_list(&self) -> String {
        join(self.kept().iter().map(|(name, _)| name.as_str()))
    }

    /// The view's value columns by name, comma-separated.
    pub(crate) fn value_list(&self) -> String {
        join(self.aggregates.iter().map(|a| a.column.as_str()))
    }

    /// The keys and the view's value columns as two arrays of text, for tools that read any
    /// shape: times as epoch seconds, everything else as `toString` prints it.
    pub(crate) fn cells_lists(&self) -> (String, String) {
        let text = |(name, kind): &(String, String)| match kind.as_str() {
            "String" => name.clone(),
            "DateTime" => format!("toString(toUInt32({name}))"),
            _ => format!("toString({name})"),
        };
        let values: Vec<(String, String)> = self
            .aggregates
            .iter()
            .map(|a| (a.column.clone(), a.shown().1))
            .collect();
        (
            format!("[{}]", join(self.keys.iter().map(text))),
            format!("[{}]", join(values.iter().map(text))),
        )
    }

    /// The view's value columns (each `avg` as the quotient of its kept sum and count).
    pub(crate) fn shown_list(&self) -> String {
        join(self.aggregates.iter().map(|a| a.shown().0))
    }

    /// Per kept column, its newest version in one source partition, aliased `p_<column>`.
    pub(crate) fn newest_per_partition(&self) -> String {
        join(
            self.kept()
                .iter()
                .map(|(c, _)| format!("argMax({c}, version) AS p_{c}")),
        )
    }

    /// What keeps a merged group in the answer: for a job of changes, rows counted (its first
    /// count column above 0); every group otherwise. Empty, or ` HAVING ...`.
    pub(crate) fn having(&self) -> String {
        match self
            .aggregates
            .iter()
            .find(|a| a.function == Function::Count)
        {
            Some(count) if self.retracts => format!(" HAVING {} > 0", count.column),
            _ => String::new(),
        }
    }

    /// Per kept column, the merge of the source partitions' values, aliased `<column>`.
    pub(crate) fn merged(&self) -> String {
        join(
            self.aggregates
                .iter()
                .flat_map(|a| a.kept().into_iter().map(move |(c, t)| a.merge(&c, &t))),
        )
    }

    fn window_and_keys(&self) -> Vec<(String, String)> {
        let mut columns = vec![
            ("window_start".to_owned(), "DateTime".to_owned()),
            ("window_end".to_owned(), "DateTime".to_owned()),
        ];
        columns.extend(self.keys.iter().cloned());
        columns
    }

    /// The folded and live tables' answer columns: window, keys, kept values.
    pub(crate) fn answer_columns(&self) -> Vec<(String, String)> {
        let mut columns = self.window_and_keys();
        columns.extend(self.kept());
        columns
    }

    /// The view's columns and types.
    pub fn view_columns(&self) -> Vec<(String, String)> {
        let mut columns = self.window_and_keys();
        columns.extend(
            self.aggregates
                .iter()
                .map(|a| (a.column.clone(), a.shown().1)),
        );
        columns
    }

    /// The version table's columns.
    pub(crate) fn data_columns(&self) -> Vec<(String, String)> {
        let mut columns = vec![
            ("version".to_owned(), "Int64".to_owned()),
            ("source_partition".to_owned(), "Int32".to_owned()),
        ];
        columns.extend(self.answer_columns());
        columns
    }

    /// The folded and live tables' sorting key. Time first: every dashboard query has a time
    /// range, and within it a key's rows are found by the next columns.
    pub(crate) fn answer_sorting_key(&self) -> String {
        format!("window_start, {}", self.key_list())
    }

    /// The version table's sorting key.
    pub(crate) fn data_sorting_key(&self) -> String {
        format!(
            "window_start, {}, source_partition, version",
            self.key_list()
        )
    }
}

fn join<S: AsRef<str>>(parts: impl Iterator<Item = S>) -> String {
    parts
        .map(|p| p.as_ref().to_owned())
        .collect::<Vec<_>>()
        .join(", ")
}
