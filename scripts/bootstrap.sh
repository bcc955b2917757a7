#!/usr/bin/env bash
# Installs the system packages tally's build, services and tests need (Debian bookworm).
# Idempotent: only missing packages are installed.
set -euo pipefail

# libclang: librocksdb-sys runs bindgen. pkg-config, libssl-dev, zlib1g-dev: librdkafka (TLS, gzip).
# Java + Maven: the real Kafka broker and Kafka Connect, fetched as jars. clickhouse-server: the local
# ClickHouse. postgresql-15: the local PostgreSQL (services.sh runs its own cluster, as the postgres user).
# zookeeper: for the replicated ClickHouse of the cluster set (services.sh up --cluster).
# docker-compose: `docker-compose config` checks docker-compose.yml (no Docker engine needed).
PACKAGES=(build-essential pkg-config libclang-dev libssl-dev zlib1g-dev curl ca-certificates
          openjdk-17-jre-headless maven clickhouse-server clickhouse-client postgresql-15 zookeeper docker-compose)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[bootstrap] installing: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  # Debian's postgresql-15 would create (and on systemd machines start) a cluster "main" on port 5432,
  # the port of services.sh's own cluster: don't let it (same drop-in as services.sh).
  if [[ " ${missing[*]} " == *" postgresql-15 "* ]]; then
    $SUDO mkdir -p /etc/postgresql-common/createcluster.d
    printf '%s\n' "# scripts/services.sh (tally): no default cluster, tally runs its own on 5432." \
      "create_main_cluster = false" | $SUDO tee /etc/postgresql-common/createcluster.d/tally.conf >/dev/null
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The current ClickHouse engine, in process (chdb): tests/current_clickhouse.py runs tally's SQL on it.
py="$HOME/.cache/tally/py"
if ! "$py/bin/python" -c "import chdb" 2>/dev/null; then
  echo "[bootstrap] installing chdb-core (current ClickHouse engine) into $py" >&2
  python3 -m venv "$py"
  "$py/bin/pip" install -q --disable-pip-version-check chdb-core==26.9.0
fi
command -v cargo >/dev/null || { echo "[bootstrap] cargo not found: install Rust (stable, >= 1.95) with rustup" >&2; exit 1; }
