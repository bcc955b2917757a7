//! Records of a job's declaration, each one's fate decided by construction:
//! valid records pass every filter condition, filtered ones miss exactly one, duplicates
//! re-publish a recent valid record, late ones sit behind the watermark by more than a window
//! and the lateness, and poison ones break one declared field in one specific way. Values come
//! from each field's type; the manifest adds the valid records to every window holding them with
//! its own arithmetic, not tally's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};
use tally_core::declare::{
    FieldKind, Function, Job, StringFormat, Test, TimeUnit, Value, format_decimal,
};
use tally_core::{OperatorConfig, PoisonReason};

use super::framed::FramedWriter;
use super::{Fate, GeneratedRecord, Kind, LoadOptions, LoadSpec, Stream, open_source, produce_all};
use tally_runtime::config::Config;

/// Per field, the filter test loadgen generates it by (at most one), or why it cannot generate
/// records of `job` by construction (what `check-config` says too).
pub fn filter_tests(job: &Job) -> Result<Vec<Option<Test>>, String> {
    let mut tests = vec![None; job.fields.len()];
    for condition in &job.filter {
        let field = &job.fields[condition.field];
        if condition.field == job.event_id || condition.field == job.event_time {
            return Err(format!(
                "loadgen cannot generate a filter on field {:?}: it is the event id or the event time",
                field.name
            ));
        }
        if job.keys.contains(&condition.field) && matches!(condition.test, Test::Range { .. }) {
            return Err(format!(
                "loadgen cannot generate a range filter on field {:?}: it is a group-by key",
                field.name
            ));
        }
        if tests[condition.field]
            .replace(condition.test.clone())
            .is_some()
        {
            return Err(format!(
                "loadgen generates one filter condition per field; field {:?} has several",
                field.name
            ));
        }
    }
    Ok(tests)
}

/// Moduli deriving the second, third, ... group-by value from a record's key combination (the
/// first is the combination itself), so that a combination names one value of every key.
const KEY_DIVISORS: [u32; 4] = [7, 5, 3, 11];

/// What a valid record adds: its event time, its group-by values as the view shows them, and
/// per aggregate its input.
#[derive(Debug, Clone, PartialEq)]
pub struct Contribution {
    pub time_ms: i64,
    pub keys: Vec<String>,
    pub inputs: Vec<Input>,
}

/// One aggregate's input: none for `count`, else an exact number (integer, decimal units,
/// epoch ms) or a float.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Input {
    None,
    Exact(i64),
    Float(f64),
}

pub struct Generator {
    spec: LoadSpec,
    job: Arc<Job>,
    rules: OperatorConfig,
    stream: Stream,
    /// Per field, the filter test on it (at most one).
    tests: Vec<Option<Test>>,
    next_id: u64,
    poison_turn: usize,
    /// Avro or Protobuf: the registered schemas records are written with.
    framed: Option<FramedWriter>,
    /// Records generated so far (the stream's schema changes by it).
    generated: u64,
}

impl Generator {
    /// A generator for `job`, or why loadgen cannot generate records of it by construction.
    pub fn new(spec: LoadSpec, job: Arc<Job>, rules: OperatorConfig) -> Result<Self, String> {
        let tests = filter_tests(&job)?;
        Ok(Generator {
            stream: Stream::new(&spec)?,
            spec,
            job,
            rules,
            tests,
            next_id: 0,
            poison_turn: 0,
            framed: None,
            generated: 0,
        })
    }

    /// Writes records in the Confluent wire format with `writer`'s schemas, not JSON.
    pub fn with_writer(mut self, writer: FramedWriter) -> Self {
        self.framed = Some(writer);
        self
    }

    pub fn next_record(&mut self) -> GeneratedRecord {
        let rules = self.rules;
        let (index, partition, fate) = self.stream.draw(&self.spec, &rules);
        let combination = u32::try_from(index).unwrap_or(u32::MAX);
        let key = format!("k-{combination}").into_bytes();
        let now = self.stream.now(partition);
        self.generated += 1;
        if let Fate::Duplicate(key, value) = fate {
            return record(partition, key, value, Kind::Duplicate);
        }
        self.next_id += 1;
        let (kind, values, t) = match fate {
            Fate::Poison => {
                let (reason, value) = self.poison(combination, now);
                return record(partition, key, value, Kind::Poison(reason));
            }
            Fate::Late => {
                let late = self.stream.late_time(partition, &rules);
                let (values, t) = self.values(combination, late, None);
                (Kind::Late, values, t)
            }
            Fate::Filtered if self.tests.iter().any(Option::is_some) => {
                let missed = self.pick_condition();
                let (values, t) = self.values(combination, now, Some(missed));
                (Kind::Filtered, values, t)
            }
            _ => {
                // Times in seconds lose up to a second: keep them inside the bound all the same.
                let seconds = self.job.fields[self.job.event_time].unit == TimeUnit::Seconds;
                let bound = rules.out_of_orderness_ms - if seconds { 1_000 } else { 0 };
                let near = self.stream.valid_time(partition, bound);
                let (values, t) = self.values(combination, near, None);
                (Kind::Valid, values, t)
            }
        };
        let value = self.encode(&values);
        if kind == Kind::Late {
            return GeneratedRecord {
                late_ms: Some(t),
                ..record(partition, key, value, kind)
            };
        }
        if kind != Kind::Valid {
            return record(partition, key, value, kind);
        }
        let contribution = self.contribution(&values, t);
        self.stream.remember(partition, t, &key, &value);
        GeneratedRecord {
            contributes: Some(contribution),
            ..record(partition, key, value, Kind::Valid)
        }
    }

    /// A random field with a filter test.
    fn pick_condition(&mut self) -> usize {
        let with_test: Vec<usize> = (0..self.tests.len())
            .filter(|&i| self.tests[i].is_some())
            .collect();
        with_test[self.stream.rng.random_range(0..with_test.len())]
    }

    /// Every field's value (`None`: absent) of a record of key combination `combination` near
    /// event time `near_ms`, passing every filter test but `miss`'s. Returns the values and the
    /// event time as the job reads it back.
    fn values(
        &mut self,
        combination: u32,
        near_ms: i64,
        miss: Option<usize>,
    ) -> (Vec<Option<Value>>, i64) {
        let job = Arc::clone(&self.job);
        let mut t = near_ms;
        if job.fields[job.event_time].unit == TimeUnit::Seconds {
            t = t.div_euclid(1000) * 1000;
        }
        let mut values = Vec::with_capacity(job.fields.len());
        for (i, field) in job.fields.iter().enumerate() {
            let value = if i == job.event_time {
                Some(Value::Time(t))
            } else if i == job.event_id {
                Some(match field.kind {
                    FieldKind::Integer => Value::Int(
                        i64::try_from(self.spec.seed % 1_000)
                            .unwrap_or(0)
                            .saturating_mul(1_000_000_000_000)
                            .saturating_add(i64::try_from(self.next_id).unwrap_or(i64::MAX)),
                    ),
                    _ => Value::Str(format!("ev-{}-{}", self.spec.seed, self.next_id).into()),
                })
            } else if let Some(k) = job.keys.iter().position(|&key| key == i) {
                let index = match k {
                    0 => combination,
                    k => combination % KEY_DIVISORS[(k - 1) % KEY_DIVISORS.len()],
                };
                let value = if field.format == StringFormat::CurrencyCode {
                    currency(index)
                } else {
                    key_value(field.kind, &field.name, field.scale, index)
                };
                match (&self.tests[i], miss == Some(i)) {
                    (None, _) => Some(value),
                    (Some(test), true) => filtered_value(test, false, value, &mut self.stream.rng),
                    (Some(test), false) => Some(passing_key(test, value, index)),
                }
            } else {
                let any = if field.format == StringFormat::CurrencyCode {
                    currency(self.stream.rng.random_range(0..40))
                } else {
                    random_value(field.kind, field.scale, t, &mut self.stream.rng)
                };
                match &self.tests[i] {
                    Some(test) => filtered_value(test, miss != Some(i), any, &mut self.stream.rng),
                    None => Some(any),
                }
            };
            values.push(value);
        }
        (values, t)
    }

    fn contribution(&self, values: &[Option<Value>], time_ms: i64) -> Contribution {
        let keys = self
            .job
            .keys
            .iter()
            .map(|&k| values[k].as_ref().map_or(String::new(), shown_key))
            .collect();
        let inputs = self
            .job
            .aggregates
            .iter()
            .map(|a| match a.field.and_then(|f| values[f].as_ref()) {
                Some(Value::Int(i) | Value::Decimal(i) | Value::Time(i)) => Input::Exact(*i),
                Some(Value::Float(x)) => Input::Float(*x),
                _ => Input::None,
            })
            .collect();
        Contribution {
            time_ms,
            keys,
            inputs,
        }
    }

    /// The record in the job's format.
    fn encode(&self, values: &[Option<Value>]) -> Vec<u8> {
        match &self.framed {
            Some(writer) => writer.encode(self.generated, values),
            None => self.json(values),
        }
    }

    /// The record's JSON, each value at its field's path; a field a presence test reads is
    /// absent or, in every other record, null.
    fn json(&self, values: &[Option<Value>]) -> Vec<u8> {
        let mut root = Map::new();
        for ((field, value), test) in self.job.fields.iter().zip(values).zip(&self.tests) {
            if value.is_none()
                && matches!(test, Some(Test::Present(_)))
                && self.generated.is_multiple_of(2)
            {
                insert_at(&mut root, &field.path, Json::Null);
            }
            if let Some(value) = value {
                let json = match (value, field.unit) {
                    (Value::Time(ms), TimeUnit::Seconds) => Json::from(ms.div_euclid(1000)),
                    _ => to_json(value, field.scale),
                };
                insert_at(&mut root, &field.path, json);
            }
        }
        Json::Object(root).to_string().into_bytes()
    }

    /// A record broken in one way, in turn: not JSON, not UTF-8, a field missing, a field of the
    /// wrong type, an unreadable event time, too large (when Kafka takes such a record).
    fn poison(&mut self, combination: u32, now: i64) -> (PoisonReason, Vec<u8>) {
        if self.framed.is_some() {
            return self.framed_poison(combination, now);
        }
        let mut reasons = vec![
            PoisonReason::InvalidJson,
            PoisonReason::InvalidUtf8,
            PoisonReason::MissingField,
            PoisonReason::WrongType,
            PoisonReason::InvalidTime,
        ];
        if super::generates_too_large(self.spec.max_record_bytes) {
            reasons.push(PoisonReason::TooLarge);
        }
        // A decimal or a currency code no filter reads can be broken in its own way.
        let free_field = |wanted: fn(&tally_core::declare::FieldReader) -> bool| {
            (0..self.job.fields.len())
                .find(|&i| self.tests[i].is_none() && wanted(&self.job.fields[i]))
        };
        let decimal = free_field(|f| f.kind == FieldKind::Decimal);
        let currency = free_field(|f| f.format == StringFormat::CurrencyCode);
        if decimal.is_some() {
            reasons.push(PoisonReason::InvalidAmount);
        }
        if currency.is_some() {
            reasons.push(PoisonReason::InvalidCurrency);
        }
        let reason = reasons[self.poison_turn % reasons.len()];
        self.poison_turn += 1;
        let (mut values, _) = self.values(combination, now, None);
        // Fields no filter reads: breaking one of those cannot make the record filtered.
        let free: Vec<usize> = (0..values.len())
            .filter(|&i| self.tests[i].is_none())
            .collect();
        let job = Arc::clone(&self.job);
        let Some(&victim) = free.get(self.poison_turn % free.len().max(1)) else {
            let json = self.json(&values);
            return (PoisonReason::InvalidJson, json[..json.len() / 2].to_vec());
        };
        let bytes = match (reason, decimal, currency) {
            (PoisonReason::InvalidAmount, Some(field), _) => {
                // One decimal place more than the field's scale holds.
                let scale = job.fields[field].scale;
                let text = format!("1.{}", "1".repeat(scale as usize + 1));
                self.json_with(&values, field, Json::from(text))
            }
            (PoisonReason::InvalidCurrency, _, Some(field)) => {
                self.json_with(&values, field, Json::from("euro"))
            }
            (PoisonReason::InvalidUtf8, ..) => b"{\"id\":\"\xff\xfe\"}".to_vec(),
            (PoisonReason::MissingField, ..) => {
                values[victim] = None;
                self.json(&values)
            }
            (PoisonReason::WrongType, ..) => {
                let wrong = match job.fields[victim].kind {
                    FieldKind::Boolean => Json::from("yes"),
                    _ => Json::Bool(true),
                };
                self.json_with(&values, victim, wrong)
            }
            (PoisonReason::InvalidTime, ..) => {
                self.json_with(&values, job.event_time, Json::from("tomorrow"))
            }
            (PoisonReason::TooLarge, ..) => {
                let mut doc: Map<String, Json> =
                    serde_json::from_slice(&self.json(&values)).unwrap_or_default();
                let pad = usize::try_from(self.spec.max_record_bytes).unwrap_or(4096) + 1;
                doc.insert("tally_pad".into(), Json::from("x".repeat(pad)));
                Json::Object(doc).to_string().into_bytes()
            }
            _ => {
                let json = self.json(&values);
                json[..json.len() / 2].to_vec()
            }
        };
        (reason, bytes)
    }

    /// The record's JSON with `field`'s value replaced by `json`.
    fn json_with(&self, values: &[Option<Value>], field: usize, json: Json) -> Vec<u8> {
        let mut doc: Map<String, Json> =
            serde_json::from_slice(&self.json(values)).unwrap_or_default();
        insert_at(&mut doc, &self.job.fields[field].path, json);
        Json::Object(doc).to_string().into_bytes()
    }
}

impl Generator {
    /// A framed record broken in one way, in turn (see [`super::framed::POISON`]), or too
    /// large (when Kafka takes such a record).
    fn framed_poison(&mut self, combination: u32, now: i64) -> (PoisonReason, Vec<u8>) {
        let mut reasons = super::framed::POISON.to_vec();
        if super::generates_too_large(self.spec.max_record_bytes) {
            reasons.push(PoisonReason::TooLarge);
        }
        let turn = self.poison_turn;
        self.poison_turn += 1;
        let (mut values, _) = self.values(combination, now, None);
        // A field no filter reads: missing, it cannot make the record filtered instead.
        let free: Vec<usize> = (0..values.len())
            .filter(|&i| self.tests[i].is_none())
            .collect();
        let missing = free.get(turn % free.len().max(1)).copied().unwrap_or(0);
        let Some(writer) = &self.framed else {
            return (PoisonReason::InvalidJson, b"{".to_vec());
        };
        // Each reason in turn; one the job's fields cannot give falls to a broken payload.
        for step in 0..reasons.len() {
            let reason = reasons[(turn + step) % reasons.len()];
            if reason == PoisonReason::TooLarge {
                let mut bytes = writer.encode(self.generated, &values);
                let pad = usize::try_from(self.spec.max_record_bytes).unwrap_or(4096) + 1;
                bytes.resize(bytes.len() + pad, 0);
                return (reason, bytes);
            }
            if let Some(bytes) = writer.poison(reason, &mut values.clone(), missing) {
                return (reason, bytes);
            }
        }
        let bytes = writer
            .poison(PoisonReason::Undecodable, &mut values, missing)
            .unwrap_or_default();
        (PoisonReason::Undecodable, bytes)
    }
}

fn record(partition: i32, key: Vec<u8>, value: Vec<u8>, kind: Kind) -> GeneratedRecord {
    GeneratedRecord {
        partition,
        key,
        value,
        kind,
        contributes: None,
        late_ms: None,
    }
}

fn insert_at(root: &mut Map<String, Json>, path: &[String], value: Json) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut node = root;
    for key in parents {
        let child = node
            .entry(key.clone())
            .or_insert_with(|| Json::Object(Map::new()));
        if !child.is_object() {
            *child = Json::Object(Map::new());
        }
        let Json::Object(map) = child else {
            return;
        };
        node = map;
    }
    node.insert(last.clone(), value);
}

fn to_json(value: &Value, scale: u32) -> Json {
    match value {
        Value::Str(s) => Json::from(s.as_str()),
        Value::Int(i) | Value::Time(i) => Json::from(*i),
        Value::Decimal(units) => Json::from(format_decimal(i128::from(*units), scale)),
        Value::Float(x) => serde_json::Number::from_f64(*x).map_or(Json::Null, Json::Number),
        Value::Bool(b) => Json::from(*b),
    }
}

/// A group-by value as the view shows it, in the form [`Shown`] compares: decimals in units,
/// times in epoch seconds, booleans as 1 or 0.
fn shown_key(value: &Value) -> String {
    match value {
        Value::Str(s) => s.to_string(),
        Value::Int(i) | Value::Decimal(i) => i.to_string(),
        Value::Time(ms) => ms.div_euclid(1000).to_string(),
        Value::Float(x) => x.to_string(),
        Value::Bool(b) => u8::from(*b).to_string(),
    }
}

/// The `index`th currency code: common ones first, then made-up codes of three letters.
fn currency(index: u32) -> Value {
    const COMMON: [&str; 8] = ["EUR", "USD", "GBP", "JPY", "CHF", "SEK", "AUD", "CAD"];
    match COMMON.get(index as usize) {
        Some(code) => Value::Str((*code).into()),
        None => {
            let letter = |n: u32| char::from(b'A' + u8::try_from(n % 26).unwrap_or(0));
            Value::Str(format!("X{}{}", letter(index / 26), letter(index)).into())
        }
    }
}

/// The `index`th value of a group-by key of type `kind`.
pub(crate) fn key_value(kind: FieldKind, name: &str, scale: u32, index: u32) -> Value {
    match kind {
        FieldKind::String => Value::Str(format!("{name}-{index:04}").into()),
        FieldKind::Integer => Value::Int(i64::from(index)),
        FieldKind::Decimal => Value::Decimal(i64::from(index) * 10i64.pow(scale.min(17))),
        FieldKind::Float => Value::Float(f64::from(index) + 0.5),
        FieldKind::Boolean => Value::Bool(index % 2 == 1),
        FieldKind::Timestamp => Value::Time(1_700_000_000_000 + i64::from(index) * 1000),
    }
}

/// A random value of type `kind`; times fall within a minute of `near_ms`.
pub(crate) fn random_value(kind: FieldKind, scale: u32, near_ms: i64, rng: &mut impl Rng) -> Value {
    match kind {
        FieldKind::String => Value::Str(format!("v{}", rng.random_range(0..50)).into()),
        FieldKind::Integer => Value::Int(rng.random_range(-100..5_000)),
        FieldKind::Decimal => {
            let one = 10i64.pow(scale.min(15));
            Value::Decimal(rng.random_range(-one..one.saturating_mul(1_000)))
        }
        FieldKind::Float => Value::Float(f64::from(rng.random_range(-1_000..100_000)) / 100.0),
        FieldKind::Boolean => Value::Bool(rng.random()),
        FieldKind::Timestamp => Value::Time(near_ms + rng.random_range(0..60_000)),
    }
}

/// A value meeting `test` (`pass`) or not (`None`: absent). A value is present when `present`
/// is what `pass` asks for (`any`), else absent.
pub(crate) fn filtered_value(
    test: &Test,
    pass: bool,
    any: Value,
    rng: &mut impl Rng,
) -> Option<Value> {
    match (test, pass) {
        (Test::Equals(c), true) | (Test::NotEquals(c), false) => Some(c.clone()),
        (Test::Equals(c), false) | (Test::NotEquals(c), true) => {
            Some(outside(std::slice::from_ref(c)))
        }
        (Test::In(set), true) | (Test::NotIn(set), false) => {
            set.get(rng.random_range(0..set.len().max(1))).cloned()
        }
        (Test::In(set), false) | (Test::NotIn(set), true) => Some(outside(set)),
        (
            Test::Range {
                min: Some(Value::Int(lo)),
                max: Some(Value::Int(hi)),
            },
            true,
        ) if lo <= hi => Some(Value::Int(rng.random_range(*lo..=*hi))),
        (Test::Range { min, max }, true) => min.clone().or_else(|| max.clone()),
        (Test::Range { min: Some(min), .. }, false) => Some(below(min)),
        (Test::Range { max: Some(max), .. }, false) => Some(above(max)),
        (Test::Range { .. }, false) => None,
        (Test::Present(present), pass) => (*present == pass).then_some(any),
    }
}

/// The key value `value` (the `index`th of its key), or one of the filter's when it must be.
fn passing_key(test: &Test, value: Value, index: u32) -> Value {
    let is_in = |set: &[Value]| set.iter().any(|c| value.compare(c).is_eq());
    match test {
        Test::Equals(c) => c.clone(),
        Test::In(set) if !set.is_empty() => set[index as usize % set.len()].clone(),
        Test::NotEquals(c) if is_in(std::slice::from_ref(c)) => outside(std::slice::from_ref(c)),
        Test::NotIn(set) if is_in(set) => outside(set),
        _ => value,
    }
}

/// A value of the same type as `set`'s, equal to none of them.
fn outside(set: &[Value]) -> Value {
    set.iter()
        .skip(1)
        .fold(set.first().map_or(Value::Int(0), above), |acc, v| {
            let next = above(v);
            if next.compare(&acc).is_gt() {
                next
            } else {
                acc
            }
        })
}

fn above(v: &Value) -> Value {
    match v {
        Value::Str(s) => Value::Str(format!("{s}~").into()),
        Value::Int(i) => Value::Int(i.saturating_add(1)),
        Value::Decimal(u) => Value::Decimal(u.saturating_add(1)),
        Value::Float(x) => Value::Float(x + 1.0),
        Value::Bool(b) => Value::Bool(!b),
        Value::Time(ms) => Value::Time(ms.saturating_add(1_000)),
    }
}

fn below(v: &Value) -> Value {
    match v {
        // A proper prefix sorts before the string (empty strings are refused as missing).
        Value::Str(s) if s.chars().count() > 1 => {
            let mut t = s.to_string();
            t.pop();
            Value::Str(t.into())
        }
        Value::Str(s) => Value::Str(s.clone()),
        Value::Int(i) => Value::Int(i.saturating_sub(1)),
        Value::Decimal(u) => Value::Decimal(u.saturating_sub(1)),
        Value::Float(x) => Value::Float(x - 1.0),
        Value::Bool(b) => Value::Bool(!b),
        Value::Time(ms) => Value::Time(ms.saturating_sub(1_000)),
    }
}

/// One aggregate's running value in the manifest, computed without tally's code.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Running {
    Count(u64),
    Exact(i128),
    Float(f64),
    Avg(i128, u64),
    AvgFloat(f64, u64),
}

/// An aggregate as the view shows it: exactly (counts, integers, decimal units, epoch seconds)
/// or as a float, compared within 1e-9 relative.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shown {
    Exact(i128),
    Float(f64),
}

impl Shown {
    pub fn matches(&self, other: &Shown) -> bool {
        match (self, other) {
            (Shown::Exact(a), Shown::Exact(b)) => a == b,
            (Shown::Float(a), Shown::Float(b)) => {
                (a - b).abs() <= a.abs().max(b.abs()) * 1e-9 || (a - b).abs() < 1e-12
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shown::Exact(n) => write!(f, "{n}"),
            Shown::Float(x) => write!(f, "{x}"),
        }
    }
}

fn add(running: Option<Running>, function: Function, input: Input) -> Running {
    use Running as R;
    match (running, function, input) {
        (None, Function::Count, _) => R::Count(1),
        (Some(R::Count(n)), Function::Count, _) => R::Count(n + 1),
        (None, Function::Avg, Input::Float(x)) => R::AvgFloat(x, 1),
        (Some(R::AvgFloat(s, n)), Function::Avg, Input::Float(x)) => R::AvgFloat(s + x, n + 1),
        (None, Function::Avg, Input::Exact(x)) => R::Avg(i128::from(x), 1),
        (Some(R::Avg(s, n)), Function::Avg, Input::Exact(x)) => R::Avg(s + i128::from(x), n + 1),
        (None, _, Input::Float(x)) => R::Float(x),
        (None, _, Input::Exact(x)) => R::Exact(i128::from(x)),
        (Some(R::Float(a)), f, Input::Float(x)) => R::Float(match f {
            Function::Min => a.min(x),
            Function::Max => a.max(x),
            _ => a + x,
        }),
        (Some(R::Exact(a)), f, Input::Exact(x)) => R::Exact(match f {
            Function::Min => a.min(i128::from(x)),
            Function::Max => a.max(i128::from(x)),
            _ => a + i128::from(x),
        }),
        (held, _, _) => held.unwrap_or(R::Count(0)),
    }
}

/// Expected results of a generated stream: the view's windows and the dead letters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Manifest {
    pub spec: Option<LoadSpec>,
    pub source_topic: String,
    pub produced: u64,
    pub valid: u64,
    pub filtered: u64,
    pub duplicates: u64,
    pub late: u64,
    pub poison: u64,
    /// (window start ms, group-by values as shown, running value per aggregate).
    pub windows: Vec<(i64, Vec<String>, Vec<Running>)>,
    /// (partition, offset, reason)
    pub dead_letters: Vec<(i32, i64, PoisonReason)>,
    /// (partition, offset, event time ms) of each late event, for a version restating from a
    /// later time (it filters them rather than dead-letter them).
    #[serde(default)]
    pub late_times: Vec<(i32, i64, i64)>,
}

/// The manifest while records are added.
pub struct ManifestBuilder {
    manifest: Manifest,
    windows: BTreeMap<(i64, Vec<String>), Vec<Option<Running>>>,
    functions: Vec<Function>,
    size_ms: i64,
    slide_ms: i64,
}

impl ManifestBuilder {
    pub fn new(job: &Job, spec: Option<LoadSpec>, source_topic: String) -> Self {
        ManifestBuilder {
            manifest: Manifest {
                spec,
                source_topic,
                ..Manifest::default()
            },
            windows: BTreeMap::new(),
            functions: job.aggregates.iter().map(|a| a.function).collect(),
            size_ms: job.windows.size_ms,
            slide_ms: job.windows.slide_ms,
        }
    }

    pub fn record(&mut self, record: &GeneratedRecord, offset: i64) {
        let m = &mut self.manifest;
        m.produced += 1;
        match record.kind {
            Kind::Valid => {
                m.valid += 1;
                let Some(c) = &record.contributes else { return };
                // Every window [start, start + size) holding the time, starts a slide apart.
                let newest = c.time_ms.div_euclid(self.slide_ms) * self.slide_ms;
                let mut start = newest;
                while start + self.size_ms > c.time_ms {
                    let w = self
                        .windows
                        .entry((start, c.keys.clone()))
                        .or_insert_with(|| vec![None; self.functions.len()]);
                    for ((running, f), input) in w.iter_mut().zip(&self.functions).zip(&c.inputs) {
                        *running = Some(add(*running, *f, *input));
                    }
                    start -= self.slide_ms;
                }
            }
            Kind::Filtered => m.filtered += 1,
            Kind::Duplicate => m.duplicates += 1,
            Kind::Late => {
                m.late += 1;
                m.dead_letters
                    .push((record.partition, offset, PoisonReason::Late));
                if let Some(t) = record.late_ms {
                    m.late_times.push((record.partition, offset, t));
                }
            }
            Kind::Poison(reason) => {
                m.poison += 1;
                m.dead_letters.push((record.partition, offset, reason));
            }
        }
    }

    pub fn finish(mut self) -> Manifest {
        self.manifest.windows = self
            .windows
            .into_iter()
            .map(|((w, keys), running)| (w, keys, running.into_iter().flatten().collect()))
            .collect();
        self.manifest
    }
}

impl Manifest {
    /// The fate of the records produced, as [`tally_core::Accounting::fates`] counts them.
    pub fn fates(&self) -> [u64; 5] {
        [
            self.valid,
            self.filtered,
            self.duplicates,
            self.late,
            self.poison,
        ]
    }

    pub fn save(&self, path: &std::path::Path) -> std::io::Result<()> {
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }

    pub fn load(path: &std::path::Path) -> std::io::Result<Manifest> {
        let bytes = std::fs::read(path)?;
        serde_json::from_slice(&bytes).map_err(std::io::Error::other)
    }

    /// The windows as the view shows them: (window start ms, keys) → each aggregate's value.
    pub fn shown(&self, job: &Job) -> BTreeMap<(i64, Vec<String>), Vec<Shown>> {
        self.windows
            .iter()
            .map(|(w, keys, running)| {
                let cells = running
                    .iter()
                    .zip(&job.aggregates)
                    .map(|(r, a)| {
                        let time = a.input.is_some_and(|t| t.kind == FieldKind::Timestamp);
                        let decimal = a.input.is_some_and(|t| t.kind == FieldKind::Decimal);
                        match *r {
                            Running::Count(n) => Shown::Exact(i128::from(n)),
                            Running::Exact(x) if time => Shown::Exact(x.div_euclid(1000)),
                            Running::Exact(x) => Shown::Exact(x),
                            Running::Float(x) => Shown::Float(x),
                            // ClickHouse's decimal division truncates towards zero, as i128's.
                            Running::Avg(s, n) if decimal => Shown::Exact(s / i128::from(n)),
                            Running::Avg(s, n) => Shown::Float(s as f64 / n as f64),
                            Running::AvgFloat(s, n) => Shown::Float(s / n as f64),
                        }
                    })
                    .collect();
                ((*w, keys.clone()), cells)
            })
            .collect()
    }
}

/// Produces a stream for the job's declaration to its source topic and writes the manifest.
pub async fn produce(config: &Config, opts: LoadOptions) -> Result<Manifest> {
    let job = Arc::clone(&config.declared);
    let topic = &config.kafka.source_topic;
    let (producer, partitions) = open_source(config, opts.partitions).await?;
    let mut spec = opts.spec;
    spec.partitions = partitions;
    let mut generator = Generator::new(spec.clone(), Arc::clone(&job), config.operator())
        .map_err(anyhow::Error::msg)?;
    if job.format.is_framed() {
        let writer = FramedWriter::register(config, &job, opts.events).await?;
        generator = generator.with_writer(writer);
    }
    let mut builder = ManifestBuilder::new(&job, Some(spec), topic.clone());
    let started = Instant::now();
    produce_all(
        &producer,
        topic,
        (opts.events, opts.rate),
        || generator.next_record(),
        |r, offset| builder.record(r, offset),
    )
    .await?;
    let manifest = builder.finish();
    manifest
        .save(&opts.manifest)
        .with_context(|| format!("writing {}", opts.manifest.display()))?;
    let secs = started.elapsed().as_secs_f64();
    println!(
        "produced {} records in {secs:.1}s ({:.0}/s): {} valid, {} filtered, {} duplicates, {} late, {} poison; expected {} rows; manifest {}",
        manifest.produced,
        manifest.produced as f64 / secs.max(1e-9),
        manifest.valid,
        manifest.filtered,
        manifest.duplicates,
        manifest.late,
        manifest.poison,
        manifest.windows.len(),
        opts.manifest.display()
    );
    Ok(manifest)
}

#[cfg(test)]
mod tests;
