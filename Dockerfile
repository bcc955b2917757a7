# syntax=docker/dockerfile:1
# tally container image: `docker build -t tally .` (BuildKit, the default builder, is needed for
# the cache mounts). Used by docker-compose.yml; the local dev loop without Docker is
# scripts/services.sh + cargo.

# ---- build ----
FROM rust:1.95-bookworm AS builder
# libclang-dev: rocksdb's bindgen (feature bindgen-runtime) loads libclang at build time.
# build-essential: C/C++ compilers for RocksDB and librdkafka (rdkafka-sys uses librdkafka's own
#   configure script, so no cmake).
# libssl-dev + pkg-config: rdkafka's "ssl" feature links the system OpenSSL.
# zlib1g-dev: librdkafka's zlib compression.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libclang-dev build-essential libssl-dev pkg-config zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache mounts keep the crates.io download and RocksDB's long C++ compile across rebuilds.
# The target dir is a cache mount (not in the layer), so the binary is copied out in the same step.
ENV CARGO_TARGET_DIR=/target
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/target \
    cargo build --release --locked -p tally \
 && cp /target/release/tally /usr/local/bin/tally

# ---- runtime ----
FROM debian:bookworm-slim
# ca-certificates for TLS to Kafka/ClickHouse; libssl3 and zlib1g are linked dynamically.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g \
 && rm -rf /var/lib/apt/lists/*
COPY --from=builder /usr/local/bin/tally /usr/local/bin/tally
COPY config/revenue_agg.toml /etc/tally/revenue_agg.toml
# Run unprivileged; the state dir (RocksDB + checkpoints) must be writable by that user and should
# be a volume: losing it while ClickHouse keeps later epochs makes tally refuse to start.
RUN useradd --system --uid 10001 --home-dir /var/lib/tally --shell /usr/sbin/nologin tally \
 && mkdir -p /var/lib/tally \
 && chown tally:tally /var/lib/tally
ENV TALLY_JOB__STATE_DIR=/var/lib/tally
VOLUME ["/var/lib/tally"]
USER tally
WORKDIR /var/lib/tally
# Prometheus metrics when TALLY_METRICS__ADDRESS=0.0.0.0:9464 (the config's default binds 127.0.0.1).
EXPOSE 9464
ENTRYPOINT ["tally"]
CMD ["run", "--config", "/etc/tally/revenue_agg.toml"]
