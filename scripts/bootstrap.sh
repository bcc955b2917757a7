#!/usr/bin/env bash
# Installs the system packages tally's build, services and tests need (Debian bookworm).
# Idempotent: only missing packages are installed.
set -euo pipefail

# libclang: librocksdb-sys runs bindgen. pkg-config, libssl-dev, zlib1g-dev: librdkafka (TLS, gzip).
# Java + Maven: the real Kafka broker, fetched as jars. clickhouse-server: the local ClickHouse.
PACKAGES=(build-essential pkg-config libclang-dev libssl-dev zlib1g-dev curl ca-certificates
          openjdk-17-jre-headless maven clickhouse-server clickhouse-client)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[bootstrap] installing: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
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
