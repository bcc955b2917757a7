#!/usr/bin/env bash
# The whole test suite on a fresh machine: system packages, Kafka and ClickHouse, formatting,
# lints, unit + property + integration tests against the real services, then the chaos runs and
# an upgrade in place from an earlier release under chaos, then the tests of the cluster set
# (scripts/services.sh up --cluster), which it leaves running.
#   scripts/test.sh            everything
#   TALLY_SKIP_CHAOS=1 scripts/test.sh   without the chaos run
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
started=$(date +%s)

scripts/bootstrap.sh
scripts/services.sh up

echo "== docker-compose.yml (the same topology as services.sh up --cluster, current images)"
docker-compose -f docker-compose.yml config -q
echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== import circles (scripts/import-graph.py)"
python3 scripts/import-graph.py
echo "== cargo test"
log=$(mktemp)
set +e
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
passed=$(grep -Eo '^test result: .* ([0-9]+) passed' "$log" | grep -Eo '[0-9]+ passed' | awk '{s+=$1} END {print s+0}')
failed=$(grep -E '^test result: ' "$log" | grep -Eo '[0-9]+ failed' | awk '{s+=$1} END {print s+0}')
if [ "$status" -ne 0 ]; then
  echo "cargo test failed"
  echo "tests: $passed passed, $failed failed"
  exit "$status"
fi

echo "== tally's SQL on the current ClickHouse engine (chdb) and on the local server"
cargo build --locked -p tally
set +e
"$HOME/.cache/tally/py/bin/python" tests/current_clickhouse.py "$TALLY_BIN" | tee "$log"
status=${PIPESTATUS[0]}
set -e
passed=$(( passed + $(sed -n 's/^sqlcheck: \([0-9]*\) passed.*/\1/p' "$log" | head -1) + 0 ))
failed=$(( failed + $(sed -n 's/^sqlcheck: [0-9]* passed, \([0-9]*\) failed.*/\1/p' "$log" | head -1) + 0 ))
if [ "$status" -ne 0 ]; then
  echo "sqlcheck failed"
  echo "tests: $passed passed, $failed failed"
  exit "$status"
fi

if [ -z "${TALLY_SKIP_CHAOS:-}" ]; then
  echo "== chaos (defaults)"
  scripts/chaos.sh
  echo "== chaos (3 workers: failovers under load)"
  scripts/chaos.sh --workers 3 --events 100000 --rate 4000 --kills 3 --zombies 1 --leaves 1 --restarts 1
  echo "== chaos (3 workers sharing 4 tasks: rebalances under load)"
  scripts/chaos.sh --workers 3 --tasks 4 --events 100000 --rate 4000 --kills 3 --zombies 1 --leaves 1 --restarts 1
  echo "== chaos of a declared hopping job (config/page_views.toml: 10 s windows sliding by 2 s, 3 workers)"
  scripts/chaos.sh --config config/page_views.toml --workers 3 --events 100000 --rate 4000 --kills 3 --zombies 1 --leaves 1 --restarts 1
  echo "== chaos of a job of change events (config/orders.toml: PostgreSQL -> Debezium -> tally, 3 workers, Kafka Connect killed, PostgreSQL restarted, new snapshots)"
  scripts/chaos.sh --config config/orders.toml --workers 3 --events 6000 --rate 150 --kills 3 --zombies 1 --leaves 1 --restarts 1
  echo "== a new version takes the job over under chaos (--restate: a column added, the last 60 % of the stream's windows restated, 3 workers a version, kill -9 at three takeover steps)"
  scripts/chaos.sh --restate --workers 3 --events 100000 --rate 4000 --kills 3 --zombies 1 --leaves 1 --restarts 1
  echo "== a new version of a job of changes takes it over under chaos (--restate --config config/orders.toml: rebuilt from the whole topic, compared with the table)"
  scripts/chaos.sh --restate --config config/orders.toml --workers 3 --events 6000 --rate 150 --kills 3 --zombies 1 --leaves 1 --restarts 1
  echo "== upgrade in place under chaos (from the release before the state and changelog formats changed)"
  # No service restarts: that release stops if it starts while Kafka restarts (fixed since).
  scripts/upgrade.sh --events 60000 --rate 4000 --kills 3 --restarts 0
fi
echo "== the cluster set: three Kafka brokers (RF 3, min ISR 2), ZooKeeper, two ClickHouse replicas"
scripts/services.sh up --cluster
set +e
# One test at a time: they kill shared servers.
cluster_tests=(--test cluster_kafka --test cluster_clickhouse)
cargo test --locked -p tally "${cluster_tests[@]}" -- --ignored --nocapture --test-threads=1 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
  # Once, on the fresh clone, cluster_kafka failed right after the cluster's first start (its
  # output is above); a second run shows whether that was the start or the test.
  echo "the cluster tests failed once; running them again"
  cargo test --locked -p tally "${cluster_tests[@]}" -- --ignored --nocapture --test-threads=1 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
fi
set -e
passed=$(( passed + $(grep -Eo '^test result: .* ([0-9]+) passed' "$log" | grep -Eo '[0-9]+ passed' | awk '{s+=$1} END {print s+0}') ))
failed=$(( failed + $(grep -E '^test result: ' "$log" | grep -Eo '[0-9]+ failed' | awk '{s+=$1} END {print s+0}') ))
if [ "$status" -ne 0 ]; then
  echo "cluster tests failed"
  echo "tests: $passed passed, $failed failed"
  exit "$status"
fi
if [ -z "${TALLY_SKIP_CHAOS:-}" ]; then
  echo "== chaos on the cluster set (3 workers; brokers and ClickHouse replicas SIGKILLed one at a time, ZooKeeper restarted, a reader on each replica)"
  scripts/chaos.sh --cluster --workers 3 --events 60000 --rate 3000 --kills 3 --zombies 1 --leaves 1 --restarts 2
  echo "== chaos of a job of change events on the cluster set (config/orders.toml, 3 workers)"
  scripts/chaos.sh --cluster --config config/orders.toml --workers 3 --events 3000 --rate 150 --kills 2 --zombies 1 --leaves 1 --restarts 1
  echo "== a new version takes the job over on the cluster set (--restate --cluster: the takeover on each replica, verify on each)"
  scripts/chaos.sh --cluster --restate --workers 3 --events 60000 --rate 3000 --kills 3 --zombies 1 --leaves 1 --restarts 2
fi
echo "wall time: $(( $(date +%s) - started ))s"
echo "tests: $passed passed, $failed failed"
