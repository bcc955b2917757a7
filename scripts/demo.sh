#!/usr/bin/env bash
# The main job on local services: creates topics and tables, produces orders (with duplicates,
# poison of every reason and late events), runs `tally run`, SIGKILLs it once in the middle,
# restarts it, and prints the view's totals next to the totals of what was produced.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
events="${1:-50000}"  # produced at 5000/s, so the default run streams for 10 s

scripts/bootstrap.sh
scripts/services.sh up >&2
cargo build --locked -p tally >&2

run="demo_$(date +%s)"
dir=".state/demo/$run"
mkdir -p "$dir"
# Each demo run gets its own topic, tables and state so reruns start clean.
export TALLY_JOB__NAME="$run"
export TALLY_JOB__STATE_DIR="$dir/state"
export TALLY_KAFKA__SOURCE_TOPIC="orders_$run"
export TALLY_KAFKA__CONSUMER_GROUP="tally-$run"
export TALLY_CLICKHOUSE__TABLE="revenue_agg_$run"
export TALLY_JOB__CHECKPOINT_INTERVAL="1s"
export TALLY_JOB__MAX_RECORD_BYTES="4096"
config=config/revenue_agg.toml

"$TALLY_BIN" check-config --config "$config" >/dev/null
echo "== producing $events orders to $TALLY_KAFKA__SOURCE_TOPIC at 5000/s while tally runs"
"$TALLY_BIN" loadgen --config "$config" --events "$events" --rate 5000 --partitions 4 --customers 200 \
  --duplicates 0.03 --poison 0.01 --late 0.01 --manifest "$dir/manifest.json" &
loadgen=$!
sleep 1

echo "== tally run (it will be SIGKILLed once, mid-stream)"
"$TALLY_BIN" run --config "$config" >>"$dir/worker.log" 2>&1 &
pid=$!
trap 'kill -9 $pid $loadgen 2>/dev/null || true' EXIT
sleep 4
kill -9 "$pid"; wait "$pid" 2>/dev/null || true
echo "   killed with SIGKILL after 4s while consuming; restarting (log: $dir/worker.log)"
"$TALLY_BIN" run --config "$config" >>"$dir/worker.log" 2>&1 &
pid=$!
wait "$loadgen"
for _ in $(seq 1 120); do
  "$TALLY_BIN" verify --config "$config" --manifest "$dir/manifest.json" >"$dir/verify.txt" 2>&1 && break
  sleep 2
done
kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
trap - EXIT

echo "== the view tally.$TALLY_CLICKHOUSE__TABLE vs what was produced"
"$TALLY_BIN" verify --config "$config" --manifest "$dir/manifest.json" | grep -v '^verify-summary'
echo "== reconcile: recomputed from the source topic"
"$TALLY_BIN" reconcile --config "$config"
echo "== query it yourself:"
echo "   clickhouse-client -q \"SELECT customer_id, currency, sum(orders), sum(revenue) FROM tally.$TALLY_CLICKHOUSE__TABLE GROUP BY customer_id, currency ORDER BY 4 DESC LIMIT 5\""
