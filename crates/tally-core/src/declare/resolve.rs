//! A declaration checked as a whole and resolved into a [`Job`]: every mistake found at once,
//! each named by its key.

use super::*;

fn is_identifier(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

struct Checker {
    mistakes: Vec<Mistake>,
}

impl Checker {
    fn refuse(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.mistakes.push(Mistake {
            key: key.into(),
            message: message.into(),
        });
    }
}

impl Declaration {
    /// Checks the declaration with the job's window rules; every mistake is reported at once.
    pub fn resolve(&self, rules: WindowRules) -> Result<Job, DeclarationError> {
        let mut c = Checker {
            mistakes: Vec::new(),
        };
        // A change job names its rows by primary key: it keeps no event ids to expire.
        let windows = check_windows(&mut c, rules, !self.format.is_changes());
        let fields = self.check_fields(&mut c);
        let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
        let mut used = BTreeSet::new();
        let mut find = |c: &mut Checker, key: String, name: &str| -> Option<usize> {
            match names.iter().position(|n| *n == name) {
                Some(i) => {
                    used.insert(i);
                    Some(i)
                }
                None => {
                    c.refuse(
                        key,
                        format!(
                            "no field named {name:?} (declared: {})",
                            if names.is_empty() {
                                "none".to_owned()
                            } else {
                                names.join(", ")
                            }
                        ),
                    );
                    None
                }
            }
        };
        let kind_of = |i: usize| fields.get(i).map(|f: &FieldReader| f.kind);

        let changes = self.format.is_changes();
        // An event names itself by its id; a change names its row by the primary key, and
        // the key's first field stands for the id (the operator keeps no ids of changes).
        let mut primary_key = Vec::new();
        for (i, name) in self.primary_key.iter().enumerate() {
            let key = format!("aggregation.primary_key[{i}]");
            let Some(index) = find(&mut c, key.clone(), name) else {
                continue;
            };
            if let Some(kind) = kind_of(index)
                && !matches!(
                    kind,
                    FieldKind::String | FieldKind::Integer | FieldKind::Decimal
                )
            {
                c.refuse(
                    key.clone(),
                    format!(
                        "field {name:?} is a {}; a primary key is strings, integers or decimals",
                        kind.as_str()
                    ),
                );
            }
            if primary_key.contains(&index) {
                c.refuse(key, format!("field {name:?} is in the key twice"));
            }
            primary_key.push(index);
        }
        let event_id = match (changes, &self.event_id) {
            (false, Some(name)) => find(&mut c, "aggregation.event_id".into(), name),
            (false, None) => {
                c.refuse("aggregation.event_id", "missing: name the field that identifies an event (a repeated id is a duplicate)");
                None
            }
            (true, Some(_)) => {
                c.refuse("aggregation.event_id", format!("a job of {} changes names its rows by aggregation.primary_key, not by an event id", self.format.as_str()));
                None
            }
            (true, None) => primary_key.first().copied(),
        };
        if changes && self.primary_key.is_empty() {
            c.refuse("aggregation.primary_key", format!("missing: a job of {} changes names the fields of the table's primary key, which identify a row across its changes", self.format.as_str()));
        }
        if !changes && !self.primary_key.is_empty() {
            c.refuse(
                "aggregation.primary_key",
                "only a job of change events (format = \"debezium-json\") has a primary key; events are named by aggregation.event_id",
            );
        }
        if let (false, Some(kind)) = (changes, event_id.and_then(kind_of))
            && !matches!(kind, FieldKind::String | FieldKind::Integer)
        {
            c.refuse(
                "aggregation.event_id",
                format!(
                    "field {:?} is a {}; an event id is a string or an integer",
                    self.event_id.as_deref().unwrap_or_default(),
                    kind.as_str()
                ),
            );
        }
        let event_time = find(&mut c, "aggregation.event_time".into(), &self.event_time);
        if let Some(kind) = event_time.and_then(kind_of)
            && kind != FieldKind::Timestamp
        {
            c.refuse(
                "aggregation.event_time",
                format!(
                    "field {:?} is a {}; the event time is a timestamp",
                    self.event_time,
                    kind.as_str()
                ),
            );
        }

        if self.group_by.is_empty() {
            c.refuse(
                "aggregation.group_by",
                "groups by no field; name at least one",
            );
        }
        let mut keys = Vec::new();
        let mut columns: Vec<(String, String)> = Vec::new();
        for (i, name) in self.group_by.iter().enumerate() {
            let key = format!("aggregation.group_by[{i}]");
            let Some(index) = find(&mut c, key.clone(), name) else {
                continue;
            };
            if kind_of(index) == Some(FieldKind::Float) {
                c.refuse(key.clone(), format!("field {name:?} is a float; grouping by a float splits equal-looking values, use a decimal"));
            }
            if keys.contains(&index) {
                c.refuse(key.clone(), format!("field {name:?} is a key twice"));
            }
            keys.push(index);
            columns.push((name.clone(), key));
        }

        let mut filter = Vec::new();
        for (i, decl) in self.filter.iter().enumerate() {
            let key = format!("aggregation.filter[{i}]");
            let Some(index) = find(&mut c, format!("{key}.field"), &decl.field) else {
                continue;
            };
            let Some(field) = fields.get(index) else {
                continue;
            };
            if let Some(test) = check_condition(&mut c, &key, decl, field) {
                filter.push(Condition { field: index, test });
            }
        }

        let may_be_absent = self.check_may_be_absent(&mut c, &filter, &fields, &keys, &primary_key);

        if self.aggregates.is_empty() {
            c.refuse(
                "aggregation.aggregate",
                "computes nothing; declare at least one aggregate",
            );
        }
        let mut aggregates = Vec::new();
        for (i, decl) in self.aggregates.iter().enumerate() {
            let key = format!("aggregation.aggregate[{i}]");
            columns.push((decl.column.clone(), format!("{key}.column")));
            if changes && matches!(decl.function, Function::Min | Function::Max) {
                c.refuse(
                    format!("{key}.function"),
                    format!(
                        "{} is not exact under retraction: when a row is updated or deleted, a window keeping one word per aggregate cannot tell its next {} without every value of the window; a job of changes takes count, sum and avg",
                        decl.function.as_str(),
                        if decl.function == Function::Min { "smallest" } else { "largest" }
                    ),
                );
            }
            let field = match (&decl.field, decl.function) {
                (None, Function::Count) => None,
                (Some(_), Function::Count) => {
                    c.refuse(
                        format!("{key}.field"),
                        "count takes no field: it counts the records of the window",
                    );
                    None
                }
                (None, f) => {
                    c.refuse(
                        format!("{key}.field"),
                        format!("{} needs a field", f.as_str()),
                    );
                    continue;
                }
                (Some(name), f) => {
                    let Some(index) = find(&mut c, format!("{key}.field"), name) else {
                        continue;
                    };
                    let Some(input) = fields.get(index) else {
                        continue;
                    };
                    if absent_only(&filter, index) {
                        c.refuse(
                            format!("{key}.field"),
                            format!("field {name:?} has `present = false` in the filter: every record counted lacks it, so {} over it would always be empty (drop the aggregate, or the condition)", f.as_str()),
                        );
                    }
                    // A window keeps each aggregate in a word or two: a min or max of
                    // strings would need the string.
                    let fits = match f {
                        Function::Sum | Function::Avg => input.kind.is_numeric(),
                        _ => input.kind.is_numeric() || input.kind == FieldKind::Timestamp,
                    };
                    if changes && fits && input.kind == FieldKind::Float {
                        c.refuse(
                            format!("{key}.field"),
                            format!(
                                "{} of a float cannot be retracted exactly (x + y - y is not always x in floating point), and a job of changes retracts every update and delete; declare {name:?} as a decimal (type = \"decimal\" with its scale) or an integer",
                                f.as_str()
                            ),
                        );
                    }
                    if !fits {
                        let needs = if matches!(f, Function::Sum | Function::Avg) {
                            "an integer, decimal or float field"
                        } else {
                            "an integer, decimal, float or timestamp field"
                        };
                        c.refuse(
                            format!("{key}.function"),
                            format!(
                                "{} needs {needs}; {name:?} is a {}",
                                f.as_str(),
                                input.kind.as_str()
                            ),
                        );
                    }
                    Some(index)
                }
            };
            aggregates.push(Aggregate {
                column: decl.column.clone(),
                function: decl.function,
                field,
                input: field.and_then(|i| fields.get(i)).map(|f| FieldType {
                    kind: f.kind,
                    scale: f.scale,
                }),
            });
        }

        if changes
            && !self.aggregates.is_empty()
            && !self
                .aggregates
                .iter()
                .any(|a| a.function == Function::Count)
        {
            c.refuse(
                "aggregation.aggregate",
                "a job of changes counts its rows (declare a count aggregate): the view leaves out a group once its last row is deleted or moves away, when the count reaches 0",
            );
        }
        let mut seen = BTreeSet::new();
        for (column, key) in &columns {
            if !is_identifier(column) {
                c.refuse(key.clone(), format!("column {column:?} is not a name ClickHouse takes unquoted (letters, digits, _)"));
            } else if RESERVED_COLUMNS.contains(&column.as_str()) {
                c.refuse(
                    key.clone(),
                    format!("column {column:?} is written by tally itself; choose another name"),
                );
            } else if !seen.insert(column.as_str()) {
                c.refuse(key.clone(), format!("two columns are named {column:?}"));
            }
        }
        for (i, field) in self.fields.iter().enumerate() {
            if !used.contains(&i) {
                c.refuse(
                    format!("aggregation.field[{i}]"),
                    format!("field {:?} is declared but no key, filter, aggregate, event_id or event_time uses it", field.name),
                );
            }
        }

        match (c.mistakes.is_empty(), event_id, event_time, windows) {
            (true, Some(event_id), Some(event_time), Some(windows)) => {
                let paths = PathTree::new(fields.iter().map(|f| f.path.as_slice()));
                let changes = changes.then(|| ChangeSchema {
                    envelope: change::Envelope::new(&fields, &primary_key),
                    primary_key,
                });
                // Worked out once: the id is moved out of a record's values unless a key or an
                // aggregate reads the same field.
                let event_id_shared = keys.contains(&event_id)
                    || aggregates.iter().any(|a| a.field == Some(event_id));
                Ok(Job {
                    event_id_shared,
                    changes,
                    format: self.format,
                    fields,
                    paths,
                    event_id,
                    event_time,
                    keys,
                    filter,
                    may_be_absent,
                    aggregates,
                    windows,
                })
            }
            _ => Err(DeclarationError {
                mistakes: c.mistakes,
            }),
        }
    }

    /// Per field, whether the filter lets it be absent (`present = false`): such a field is
    /// absent in every record counted, so it may only be tested, never read as a key, an id,
    /// the event time or a primary key. Refuses those, and a field the filter also requires.
    fn check_may_be_absent(
        &self,
        c: &mut Checker,
        filter: &[Condition],
        fields: &[FieldReader],
        keys: &[usize],
        primary_key: &[usize],
    ) -> Vec<bool> {
        let absent: Vec<bool> = (0..fields.len()).map(|i| absent_only(filter, i)).collect();
        let because = |name: &str| {
            format!(
                "field {name:?} has `present = false` in the filter: every record counted lacks it"
            )
        };
        for (i, &k) in keys.iter().enumerate() {
            if absent[k] {
                c.refuse(
                    format!("aggregation.group_by[{i}]"),
                    format!("{}, so the key would be NULL in every row of the view (group by another field, or drop the condition)", because(&fields[k].name)),
                );
            }
        }
        for (i, &k) in primary_key.iter().enumerate() {
            if absent[k] {
                c.refuse(
                    format!("aggregation.primary_key[{i}]"),
                    format!(
                        "{}, and a row is named by its primary key",
                        because(&fields[k].name)
                    ),
                );
            }
        }
        let named = |key: &str, name: &Option<String>| {
            name.as_deref()
                .and_then(|n| fields.iter().position(|f| f.name == n))
                .filter(|&i| absent[i])
                .map(|i| (key.to_owned(), fields[i].name.clone()))
        };
        for (key, name) in [
            named("aggregation.event_id", &self.event_id),
            named("aggregation.event_time", &Some(self.event_time.clone())),
        ]
        .into_iter()
        .flatten()
        {
            c.refuse(
                key,
                format!("{}, and every record needs it", because(&name)),
            );
        }
        for (i, condition) in filter.iter().enumerate() {
            if absent[condition.field] && !matches!(condition.test, Test::Present(false)) {
                c.refuse(
                    format!("aggregation.filter[{i}]"),
                    format!(
                        "{}, and this condition needs a value: together they pass no record",
                        because(&fields[condition.field].name)
                    ),
                );
            }
        }
        absent
    }

    fn check_fields(&self, c: &mut Checker) -> Vec<FieldReader> {
        let mut readers = Vec::new();
        let mut names = BTreeSet::new();
        for (i, f) in self.fields.iter().enumerate() {
            let key = format!("aggregation.field[{i}]");
            if !names.insert(f.name.as_str()) {
                c.refuse(
                    format!("{key}.name"),
                    format!("field {:?} is declared twice", f.name),
                );
            }
            let path: Vec<String> = f
                .path
                .as_deref()
                .unwrap_or(&f.name)
                .split('.')
                .map(str::to_owned)
                .collect();
            if path.iter().any(String::is_empty) {
                c.refuse(
                    format!("{key}.path"),
                    "a path is object keys joined by dots, none of them empty",
                );
            }
            let scale = match (f.kind, f.scale) {
                (FieldKind::Decimal, Some(s)) if s <= MAX_DECIMAL_SCALE => s,
                (FieldKind::Decimal, Some(s)) => {
                    c.refuse(format!("{key}.scale"), format!("scale {s} is over {MAX_DECIMAL_SCALE}: a Decimal(18, s) keeps 18 digits in all"));
                    0
                }
                (FieldKind::Decimal, None) => {
                    c.refuse(
                        format!("{key}.scale"),
                        "a decimal needs its scale (fractional digits, 0..=18)",
                    );
                    0
                }
                (kind, Some(_)) => {
                    c.refuse(
                        format!("{key}.scale"),
                        format!(
                            "only a decimal has a scale; this field is a {}",
                            kind.as_str()
                        ),
                    );
                    0
                }
                (_, None) => 0,
            };
            let unit = match (f.kind, f.unit.as_deref()) {
                (_, None) | (FieldKind::Timestamp, Some("ms")) => TimeUnit::Millis,
                (FieldKind::Timestamp, Some("s")) => TimeUnit::Seconds,
                (FieldKind::Timestamp, Some("us")) => TimeUnit::Micros,
                (FieldKind::Timestamp, Some(other)) => {
                    c.refuse(
                        format!("{key}.unit"),
                        format!("unit {other:?} is not \"ms\", \"s\" or \"us\""),
                    );
                    TimeUnit::Millis
                }
                (kind, Some(_)) => {
                    c.refuse(
                        format!("{key}.unit"),
                        format!(
                            "only a timestamp has a unit; this field is a {}",
                            kind.as_str()
                        ),
                    );
                    TimeUnit::Millis
                }
            };
            let format = match (f.kind, f.format.as_deref()) {
                (_, None) => StringFormat::Any,
                (FieldKind::String, Some("currency_code")) => StringFormat::CurrencyCode,
                (FieldKind::String, Some(other)) => {
                    c.refuse(
                        format!("{key}.format"),
                        format!("format {other:?} is unknown (known: \"currency_code\")"),
                    );
                    StringFormat::Any
                }
                (kind, Some(_)) => {
                    c.refuse(
                        format!("{key}.format"),
                        format!(
                            "only a string has a format; this field is a {}",
                            kind.as_str()
                        ),
                    );
                    StringFormat::Any
                }
            };
            readers.push(FieldReader {
                name: f.name.clone(),
                path,
                kind: f.kind,
                scale,
                format,
                unit,
                allow_empty: f.allow_empty,
            });
        }
        readers
    }
}

fn check_windows(c: &mut Checker, rules: WindowRules, dedup: bool) -> Option<WindowSpec> {
    let size = rules.size_ms;
    let slide = rules.slide_ms.unwrap_or(size);
    let before = c.mistakes.len();
    if size <= 0 {
        c.refuse("window.size", "must be longer than 0s");
    } else if slide <= 0 || slide > size {
        c.refuse(
            "window.slide",
            format!(
                "{} must be longer than 0s and at most window.size ({})",
                format_duration(slide),
                format_duration(size)
            ),
        );
    } else if size % slide != 0 {
        c.refuse(
            "window.slide",
            format!(
                "{} does not divide window.size ({}): windows would not align",
                format_duration(slide),
                format_duration(size)
            ),
        );
    }
    let needed = size.saturating_add(rules.allowed_lateness_ms);
    if dedup && rules.dedup_horizon_ms < needed {
        c.refuse(
            "window.dedup_horizon",
            format!(
                "{} is shorter than window.size + window.allowed_lateness ({}): a duplicate could count again in a window still open",
                format_duration(rules.dedup_horizon_ms),
                format_duration(needed)
            ),
        );
    }
    (c.mistakes.len() == before).then_some(WindowSpec {
        size_ms: size,
        slide_ms: slide,
    })
}

fn check_condition(
    c: &mut Checker,
    key: &str,
    decl: &ConditionDecl,
    field: &FieldReader,
) -> Option<Test> {
    let constant = |c: &mut Checker, name: &str, written: &serde_json::Value| {
        filter::constant(field, written)
            .map_err(|e| c.refuse(format!("{key}.{name}"), e))
            .ok()
    };
    let tests = [
        decl.equals.is_some(),
        decl.not_equals.is_some(),
        decl.one_of.is_some(),
        decl.not_in.is_some(),
        decl.min.is_some() || decl.max.is_some(),
        decl.present.is_some(),
    ];
    if tests.iter().filter(|t| **t).count() != 1 {
        c.refuse(key, "a condition has exactly one test: equals, not_equals, in, not_in, min/max or present (write several conditions to combine them)");
        return None;
    }
    if let Some(v) = &decl.equals {
        return constant(c, "equals", v).map(Test::Equals);
    }
    if let Some(v) = &decl.not_equals {
        return constant(c, "not_equals", v).map(Test::NotEquals);
    }
    if let Some(set) = decl.one_of.as_ref().or(decl.not_in.as_ref()) {
        let name = if decl.one_of.is_some() {
            "in"
        } else {
            "not_in"
        };
        let values: Option<Vec<Value>> = set.iter().map(|v| constant(c, name, v)).collect();
        let values = values?;
        return Some(if decl.one_of.is_some() {
            Test::In(values)
        } else {
            Test::NotIn(values)
        });
    }
    if let Some(p) = decl.present {
        return Some(Test::Present(p));
    }
    if !field.kind.is_ordered() {
        c.refuse(
            key,
            format!(
                "a range needs a field with an order; {:?} is a {}",
                field.name,
                field.kind.as_str()
            ),
        );
        return None;
    }
    let min = match &decl.min {
        Some(v) => Some(constant(c, "min", v)?),
        None => None,
    };
    let max = match &decl.max {
        Some(v) => Some(constant(c, "max", v)?),
        None => None,
    };
    Some(Test::Range { min, max })
}

/// Whether the filter passes only records lacking field `field` (`present = false`).
fn absent_only(filter: &[Condition], field: usize) -> bool {
    filter
        .iter()
        .any(|c| c.field == field && c.test == Test::Present(false))
}
