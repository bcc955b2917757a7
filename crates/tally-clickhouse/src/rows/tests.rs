use std::io::{BufRead, BufReader, Read, Write};

use serde::Serialize;
use tally_core::declare::{Declaration, WindowRules};
use tally_core::{Amount, GroupKey, OutputRow, WindowAgg, WindowKey, Word};

use super::*;

/// 2026-09-21 14:20:00 UTC.
const T0: i64 = 1_790_000_400_000;

fn owned(columns: &[(&str, &str)]) -> Vec<(String, String)> {
    columns
        .iter()
        .map(|(n, t)| ((*n).to_owned(), (*t).to_owned()))
        .collect()
}

fn encoder(keys: &[(&str, &str)], values: &[(&str, &str)]) -> RowEncoder {
    RowEncoder::of_columns(&owned(keys), &owned(values)).unwrap_or_else(|e| panic!("{e}"))
}

fn row(partition: i32, parts: &[&str], words: &[Word]) -> OutputRow {
    OutputRow {
        partition,
        key: WindowKey {
            window_start_ms: T0,
            key: GroupKey::new(parts.iter().map(|p| (*p).into())),
        },
        window_end_ms: T0 + 60_000,
        value: WindowAgg::new(words.iter().copied()),
    }
}

fn encode(encoder: &RowEncoder, version: i64, row: &OutputRow) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    encoder.encode(&mut out, version, row).map(|()| out)
}

/// The fixed columns of `row()` at version 7 of partition 2.
fn fixed() -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&7i64.to_le_bytes());
    out.extend_from_slice(&2i32.to_le_bytes());
    out.extend_from_slice(&1_790_000_400u32.to_le_bytes());
    out.extend_from_slice(&1_790_000_460u32.to_le_bytes());
    out
}

/// The bytes of one key part of type `ty` and text `text`, after the fixed columns.
fn key_bytes(ty: &str, text: &str) -> Result<Vec<u8>> {
    let bytes = encode(&encoder(&[("k", ty)], &[]), 7, &row(2, &[text], &[]))?;
    Ok(bytes[fixed().len()..].to_vec())
}

fn word_bytes(ty: &str, word: Word) -> Result<Vec<u8>> {
    let bytes = encode(&encoder(&[], &[("v", ty)]), 7, &row(2, &[], &[word]))?;
    Ok(bytes[fixed().len()..].to_vec())
}

fn refused(result: Result<Vec<u8>>) -> String {
    match result {
        Err(e @ SinkError::Row(_)) => e.to_string(),
        other => panic!("expected a refused row, got {other:?}"),
    }
}

#[test]
fn key_parts_are_written_as_their_columns_types() {
    let ok = |ty, text| key_bytes(ty, text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok("String", "c1"), b"\x02c1");
    // Lengths from 128 bytes on take two LEB128 bytes.
    let long = "x".repeat(300);
    assert_eq!(ok("String", &long)[..2], [0xac, 0x02]);
    assert_eq!(ok("String", &long).len(), 302);
    assert_eq!(ok("String", ""), [0]);
    assert_eq!(ok("Int64", "-42"), (-42i64).to_le_bytes());
    assert_eq!(ok("Decimal(18, 4)", "12.3400"), 123_400i64.to_le_bytes());
    assert_eq!(ok("Decimal(18,2)", "-0.05"), (-5i64).to_le_bytes());
    assert_eq!(ok("Decimal(18, 0)", "7"), 7i64.to_le_bytes());
    assert_eq!(ok("Float64", "0.1"), 0.1f64.to_le_bytes());
    assert_eq!(ok("Float64", "-3"), (-3.0f64).to_le_bytes());
    assert_eq!(ok("UInt8", "1"), [1]);
    assert_eq!(ok("UInt8", "0"), [0]);
    // Epoch milliseconds to whole seconds, rounded down.
    assert_eq!(
        ok("DateTime", "1790000400999"),
        1_790_000_400u32.to_le_bytes()
    );
}

#[test]
fn value_words_are_written_as_their_columns_types() {
    let ok = |ty, word| word_bytes(ty, word).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok("UInt64", Word::Count(3)), 3u64.to_le_bytes());
    assert_eq!(ok("Int64", Word::Exact(-9)), (-9i64).to_le_bytes());
    assert_eq!(
        ok("Decimal(18, 2)", Word::Exact(1250)),
        1250i64.to_le_bytes()
    );
    assert_eq!(
        ok("DateTime", Word::Exact(1_790_000_401_500)),
        1_790_000_401u32.to_le_bytes()
    );
    assert_eq!(ok("Float64", Word::Float(2.5)), 2.5f64.to_le_bytes());
}

#[test]
fn a_part_that_does_not_parse_is_refused_naming_column_and_value() {
    for (ty, text) in [
        ("Int64", "4.5"),
        ("Int64", "9223372036854775808"),
        ("Int64", ""),
        ("Decimal(18, 2)", "1.234"),
        ("Decimal(18, 2)", "1e3"),
        ("Decimal(18, 0)", "1000000000000000000"),
        ("Float64", "fast"),
        ("UInt8", "2"),
        ("UInt8", "true"),
        ("DateTime", "2026-09-21"),
        ("DateTime", "-1"),
        ("DateTime", "4294967296000"),
    ] {
        let text_of_error = refused(key_bytes(ty, text));
        assert!(
            text_of_error.contains("key column k") && text_of_error.contains(&format!("{text:?}")),
            "{ty} {text:?}: {text_of_error}"
        );
    }
}

#[test]
fn a_word_of_another_kind_or_out_of_range_is_refused() {
    for (ty, word) in [
        ("UInt64", Word::Exact(1)),
        ("UInt64", Word::Float(1.0)),
        ("Int64", Word::Count(1)),
        ("Decimal(18, 4)", Word::Float(1.0)),
        ("Decimal(18, 4)", Word::Exact(1_000_000_000_000_000_000)),
        ("Decimal(18, 4)", Word::Exact(i64::MIN)),
        ("Float64", Word::Exact(1)),
        ("DateTime", Word::Exact(i64::MAX)),
        ("DateTime", Word::Count(1)),
    ] {
        let text = refused(word_bytes(ty, word));
        assert!(text.contains("value column v"), "{ty} {word:?}: {text}");
    }
}

#[test]
fn a_row_of_another_shape_is_refused_and_nothing_written() {
    let encoder = encoder(
        &[("a", "String"), ("b", "Int64")],
        &[("n", "UInt64"), ("x", "Float64")],
    );
    let good = row(2, &["p", "1"], &[Word::Count(1), Word::Float(1.0)]);
    let mut out = b"earlier".to_vec();
    assert!(encoder.encode(&mut out, 7, &good).is_ok());
    let written = out.len();
    for (bad, says) in [
        (
            row(2, &["p"], &[Word::Count(1), Word::Float(1.0)]),
            "1 part(s), the table 2",
        ),
        (
            row(2, &["p", "1", "z"], &[Word::Count(1), Word::Float(1.0)]),
            "3 part(s), the table 2",
        ),
        (
            row(2, &["p", "1"], &[Word::Count(1)]),
            "1 word(s), the table 2",
        ),
        (
            row(2, &["p", "1"], &[Word::Float(1.0), Word::Count(1)]),
            "value column n",
        ),
        // The last part is bad: the parts before it were encoded and are taken back.
        (
            row(2, &["p", "x"], &[Word::Count(1), Word::Float(1.0)]),
            "key column b",
        ),
    ] {
        let text = match encoder.encode(&mut out, 7, &bad) {
            Err(e @ SinkError::Row(_)) => e.to_string(),
            other => panic!("expected a refused row, got {other:?}"),
        };
        assert!(
            text.contains(says) && text.contains("partition 2"),
            "{text}"
        );
        assert_eq!(out.len(), written, "{text}");
    }
    let time = row(2, &["p", "1"], &[Word::Count(1), Word::Float(1.0)]);
    let before = OutputRow {
        window_end_ms: -1,
        ..time
    };
    assert!(matches!(
        encoder.encode(&mut out, 7, &before),
        Err(SinkError::Row(e)) if e.contains("window_end")
    ));
}

#[test]
fn a_type_the_sink_cannot_write_is_a_schema_error() {
    for ty in [
        "Int32",
        "Decimal(38, 4)",
        "Decimal(18, 19)",
        "Nullable(String)",
    ] {
        let made = RowEncoder::of_columns(&owned(&[("k", ty)]), &[]);
        assert!(
            matches!(&made, Err(SinkError::Schema(e)) if e.contains(ty)),
            "{ty}: {made:?}"
        );
    }
}

/// A declared job of three keys of different types, count, max of a float, avg of a float and
/// min of a decimal.
fn mixed_shape() -> Shape {
    let declaration: Declaration = serde_json::from_value(serde_json::json!({
        "event_id": "id",
        "event_time": "at",
        "group_by": ["page", "user", "price", "mobile"],
        "field": [
            {"name": "id", "type": "string"},
            {"name": "at", "type": "timestamp"},
            {"name": "page", "type": "string"},
            {"name": "user", "type": "integer"},
            {"name": "price", "type": "decimal", "scale": 2},
            {"name": "mobile", "type": "boolean"},
            {"name": "load", "type": "float"},
        ],
        "aggregate": [
            {"column": "views", "function": "count"},
            {"column": "slowest", "function": "max", "field": "load"},
            {"column": "mean", "function": "avg", "field": "load"},
            {"column": "cheapest", "function": "min", "field": "price"},
        ],
    }))
    .unwrap_or_else(|e| panic!("{e}"));
    let job = declaration
        .resolve(WindowRules {
            size_ms: 60_000,
            slide_ms: None,
            allowed_lateness_ms: 0,
            dedup_horizon_ms: 3_600_000,
        })
        .unwrap_or_else(|e| panic!("{e}"));
    Shape::of(&job)
}

#[test]
fn a_declared_shape_is_encoded_in_its_data_tables_column_order() {
    let shape = mixed_shape();
    let encoder = RowEncoder::new(&shape).unwrap_or_else(|e| panic!("{e}"));
    let names: Vec<String> = shape.data_columns().into_iter().map(|(n, _)| n).collect();
    assert_eq!(encoder.column_list(), names.join(", "));
    assert_eq!(
        encoder.column_list(),
        "version, source_partition, window_start, window_end, page, user, price, mobile, \
         views, slowest, mean__sum, mean__count, cheapest"
    );
    let r = row(
        2,
        &["/home", "-42", "12.30", "1"],
        &[
            Word::Count(3),
            Word::Float(2.5),
            Word::Float(6.0),
            Word::Count(3),
            Word::Exact(999),
        ],
    );
    let mut want = fixed();
    want.extend_from_slice(b"\x05/home");
    want.extend_from_slice(&(-42i64).to_le_bytes());
    want.extend_from_slice(&1230i64.to_le_bytes());
    want.push(1);
    want.extend_from_slice(&3u64.to_le_bytes());
    want.extend_from_slice(&2.5f64.to_le_bytes());
    want.extend_from_slice(&6.0f64.to_le_bytes());
    want.extend_from_slice(&3u64.to_le_bytes());
    want.extend_from_slice(&999i64.to_le_bytes());
    assert_eq!(
        encode(&encoder, 7, &r).unwrap_or_else(|e| panic!("{e}")),
        want
    );
}

/// revenue_agg's row as earlier releases wrote it, with the clickhouse crate's serializer.
#[derive(Debug, Serialize, clickhouse::Row)]
struct DataRow<'a> {
    version: i64,
    source_partition: i32,
    window_start: u32,
    window_end: u32,
    customer_id: &'a str,
    currency: &'a str,
    orders: u64,
    revenue: i64,
}

/// Answers one HTTP request with 200 and returns its request line and body.
fn capture_one_request() -> (String, std::thread::JoinHandle<(String, Vec<u8>)>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}",
        listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap_or_else(|e| panic!("{e}"));
        let mut reader = BufReader::new(stream.try_clone().unwrap_or_else(|e| panic!("{e}")));
        let line = |reader: &mut BufReader<_>| {
            let mut line = String::new();
            reader
                .read_line(&mut line)
                .unwrap_or_else(|e| panic!("{e}"));
            line.trim_end().to_owned()
        };
        let request = line(&mut reader);
        let (mut chunked, mut length) = (false, 0usize);
        loop {
            let header = line(&mut reader).to_ascii_lowercase();
            if header.is_empty() {
                break;
            }
            chunked |= header.starts_with("transfer-encoding:") && header.contains("chunked");
            if let Some(n) = header.strip_prefix("content-length:") {
                length = n.trim().parse().unwrap_or_else(|e| panic!("{e}"));
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                let size = line(&mut reader);
                let size = usize::from_str_radix(size.split(';').next().unwrap_or(""), 16)
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut chunk = vec![0; size + 2];
                reader
                    .read_exact(&mut chunk)
                    .unwrap_or_else(|e| panic!("{e}"));
                if size == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..size]);
            }
        } else {
            body.resize(length, 0);
            reader
                .read_exact(&mut body)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        stream
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .unwrap_or_else(|e| panic!("{e}"));
        (request, body)
    });
    (url, server)
}

/// Percent-decoding of a request line's query (`+` is a space).
fn decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                out.push(u8::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{e}")));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn revenue_rows() -> Vec<OutputRow> {
    let row = |partition, minute: i64, customer: &str, currency: &str, orders, revenue| OutputRow {
        partition,
        key: WindowKey::of_orders(T0 + minute * 60_000, customer, currency),
        window_end_ms: T0 + (minute + 1) * 60_000,
        value: WindowAgg::of_orders(orders, Amount(revenue)),
    };
    let long = "ü".repeat(100);
    vec![
        row(0, 0, "c1", "EUR", 3, 305_000),
        row(1, 2, "", "USD", 1, -99_900),
        row(1, 3, long.as_str(), "GBP", u64::MAX, -MAX_DECIMAL18_UNITS),
    ]
}

#[tokio::test]
async fn revenue_aggs_rows_are_the_bytes_its_typed_row_gave() {
    let rows = revenue_rows();
    let version = |r: &OutputRow| 10 + i64::from(r.partition);
    // What the clickhouse crate sends for the typed row of earlier releases.
    let (url, server) = capture_one_request();
    let client = crate::tls::client(None)
        .unwrap_or_else(|e| panic!("{e}"))
        .with_url(url)
        .with_validation(false);
    let mut insert = client
        .insert_unescaped::<DataRow<'_>>("tally.revenue_agg_data")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for r in &rows {
        let typed = DataRow {
            version: version(r),
            source_partition: r.partition,
            window_start: u32::try_from(r.key.window_start_ms / 1000).unwrap_or(0),
            window_end: u32::try_from(r.window_end_ms / 1000).unwrap_or(0),
            customer_id: r.key.customer_id(),
            currency: r.key.currency(),
            orders: r.value.orders(),
            revenue: r.value.revenue().units(),
        };
        insert.write(&typed).await.unwrap_or_else(|e| panic!("{e}"));
    }
    insert.end().await.unwrap_or_else(|e| panic!("{e}"));
    let (request, typed) = server.join().unwrap_or_else(|_| panic!("server"));

    let encoder = RowEncoder::new(&Shape::revenue_agg()).unwrap_or_else(|e| panic!("{e}"));
    let mut ours = Vec::new();
    for r in &rows {
        encoder
            .encode(&mut ours, version(r), r)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(!typed.is_empty());
    assert_eq!(ours, typed);
    // And the same columns, in the same order.
    let request = decoded(&request);
    let typed_columns = request
        .split("INSERT INTO tally.revenue_agg_data(")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("{request}"))
        .replace(['`', ' '], "");
    assert_eq!(typed_columns, encoder.column_list().replace(' ', ""));

    // By hand, the first row.
    let mut first = Vec::new();
    first.extend_from_slice(&10i64.to_le_bytes());
    first.extend_from_slice(&0i32.to_le_bytes());
    first.extend_from_slice(&1_790_000_400u32.to_le_bytes());
    first.extend_from_slice(&1_790_000_460u32.to_le_bytes());
    first.extend_from_slice(b"\x02c1\x03EUR");
    first.extend_from_slice(&3u64.to_le_bytes());
    first.extend_from_slice(&305_000i64.to_le_bytes());
    assert_eq!(ours[..first.len()], first);
}

fn sink_at(url: String, shape: Shape) -> crate::ClickHouseSink {
    let names = crate::TableNames::new("tally", "r")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_shape(shape);
    crate::ClickHouseSink {
        client: crate::tls::client(None)
            .unwrap_or_else(|e| panic!("{e}"))
            .with_url(&url)
            .with_validation(false),
        url,
        encoder: RowEncoder::new(&names.shape).unwrap_or_else(|e| panic!("{e}")),
        names,
        version: String::new(),
        request_timeout: std::time::Duration::from_secs(10),
        installed: std::sync::Mutex::new(None),
        versions_floor: std::sync::Mutex::new(None),
        atomic: std::sync::OnceLock::new(),
    }
}

fn mixed_rows() -> Vec<OutputRow> {
    vec![
        row(
            0,
            &["/home", "-42", "12.30", "1"],
            &[
                Word::Count(3),
                Word::Float(2.5),
                Word::Float(6.0),
                Word::Count(3),
                Word::Exact(999),
            ],
        ),
        row(
            2,
            &["/cart", "7", "0.05", "0"],
            &[
                Word::Count(1),
                Word::Float(0.25),
                Word::Float(0.25),
                Word::Count(1),
                Word::Exact(5),
            ],
        ),
    ]
}

#[tokio::test]
async fn a_data_insert_names_the_shapes_columns_in_one_block() {
    let rows = mixed_rows();
    let batch = crate::Batch {
        job: "mixed",
        epoch: tally_core::Epoch(4),
        offsets: vec![(0, 5, 9), (2, 1, 3)],
        watermarks: vec![0, 0],
        rows: &rows,
        event_count: 4,
        revenue_units: 0,
        dead_letters: 0,
        filtered_count: 0,
        duplicate_count: 0,
        stale_count: 0,
        tombstone_count: 0,
        source_lsn: 0,
    };
    let (url, server) = capture_one_request();
    let sink = sink_at(url, mixed_shape());
    sink.insert_rows(&batch, &rows)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (request, body) = server.join().unwrap_or_else(|_| panic!("server"));
    let request = decoded(&request);
    assert!(
        request.contains(
            "INSERT INTO tally.r_data (version, source_partition, window_start, window_end, page, \
             user, price, mobile, views, slowest, mean__sum, mean__count, cheapest) FORMAT RowBinary"
        ),
        "{request}"
    );
    assert!(request.contains("max_insert_block_size=3"), "{request}");
    // Each row at its partition's version: the offset the batch ends it at.
    let mut want = Vec::new();
    sink.encoder
        .encode(&mut want, 9, &rows[0])
        .unwrap_or_else(|e| panic!("{e}"));
    sink.encoder
        .encode(&mut want, 3, &rows[1])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(body, want);

    // A row that does not fit fails the insert before any request: nothing listens there.
    let unused = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
    let url = format!(
        "http://{}",
        unused.local_addr().unwrap_or_else(|e| panic!("{e}"))
    );
    drop(unused);
    let sink = sink_at(url, mixed_shape());
    let mut bad = rows.clone();
    bad[1].value = WindowAgg::new([Word::Count(1)]);
    let refused = sink.insert_rows(&batch, &bad).await;
    assert!(matches!(refused, Err(SinkError::Row(_))), "{refused:?}");
    // A row of a partition the batch has no offsets for.
    let mut stray = rows.clone();
    stray[0].partition = 5;
    let refused = sink.insert_rows(&batch, &stray).await;
    assert!(matches!(refused, Err(SinkError::Refused(_))), "{refused:?}");
}
