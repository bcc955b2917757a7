//! Reading one declared job's records (config/payments.toml: seven fields under three parents,
//! a filter) in each format it can read: JSON, Avro and Protobuf in the Confluent wire format.
//! The same records in each (loadgen's, one seed), the writer schemas compiled beforehand as
//! the registry cache holds them; each record read to its event or its filter.
//!   cargo bench -p tally --bench formats
#![allow(clippy::expect_used, clippy::panic)] // a bench fails loudly

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tally_core::declare::{Evaluation, Format, Job, Schemas};
use tally_runtime::config::Config;
use tally_tools::loadgen::{FramedWriter, Generator, LoadSpec};

const N: usize = 10_000;

fn config(format: &str) -> Config {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/payments.toml");
    let mut text = std::fs::read_to_string(path)
        .expect("config/payments.toml")
        .replace("format = \"avro\"", &format!("format = \"{format}\""));
    if format == "json" {
        let start = text.find("\n[registry]").expect("a [registry] section");
        let end = start + 1 + text[start + 1..].find("\n[").expect("a section after it");
        text.replace_range(start..end, "");
    }
    Config::parse("payments.toml", &text, &[]).expect("payments parses")
}

/// `N` records of the job in its format, all valid (some filtered), and the schemas to read
/// them with (none for JSON).
/// A job, its records, and the schemas a framed job reads them with.
type Records = (Arc<Job>, Vec<Vec<u8>>, Option<Arc<dyn Schemas>>);

fn records(format: &str) -> Records {
    let config = config(format);
    let job = config.declared.clone();
    let spec = LoadSpec {
        seed: 1,
        partitions: 1,
        customers: 1_000,
        currencies: Vec::new(),
        skew: 1.1,
        duplicate_fraction: 0.0,
        poison_fraction: 0.0,
        late_fraction: 0.0,
        filtered_fraction: 0.05,
        start_ms: 1_790_000_000_000,
        step_ms: 10,
        max_record_bytes: 4096,
    };
    let mut generator =
        Generator::new(spec, Arc::clone(&job), config.operator()).expect("a generator");
    let mut schemas = None;
    if job.format != Format::Json {
        let writer = FramedWriter::offline(&job, N as u64, [1, 2, 3, 4, 5]).expect("a writer");
        schemas = Some(writer.schemas(&job).expect("schemas"));
        generator = generator.with_writer(writer);
    }
    let values = (0..N).map(|_| generator.next_record().value).collect();
    (job, values, schemas)
}

fn formats(c: &mut Criterion) {
    let mut group = c.benchmark_group("formats");
    group.throughput(Throughput::Elements(N as u64));
    for format in ["json", "avro", "protobuf"] {
        let (job, values, schemas) = records(format);
        let bytes: usize = values.iter().map(Vec::len).sum();
        println!("payments in {format}: {} bytes per record", bytes / N);
        let read = values
            .iter()
            .filter(|v| job.read(Some(v), 1 << 20, schemas.as_deref()).is_ok())
            .count();
        assert_eq!(read, N, "{format}: every record reads");
        group.bench_function(format!("payments_{format}"), |b| {
            b.iter(|| {
                let mut events = 0usize;
                for v in &values {
                    if let Ok(Evaluation::Event(e)) = job.read(Some(v), 1 << 20, schemas.as_deref())
                    {
                        events += e.inputs.len();
                    }
                }
                black_box(events)
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = formats
}
criterion_main!(benches);
