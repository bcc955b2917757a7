#!/usr/bin/env bash
# End-to-end throughput and memory of `tally run` (release build) on the local services:
# produce N orders, start the worker, and time it until every record is checkpointed and committed.
# Prints one table; then checks the result with `tally verify`.
#   scripts/bench.sh [--events N] [--partitions P]
#   scripts/bench.sh --read [--days 7] [--events 1400000] [--live-seconds 180]
#       read cost of the view vs. an ideal table, before and after folding (see read_bench below)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
events="" partitions=4 mode=throughput days=7 live_seconds=180
while (($#)); do
  case "$1" in
    --events) events=$2; shift 2 ;;
    --partitions) partitions=$2; shift 2 ;;
    --read) mode=read; shift ;;
    --days) days=$2; shift 2 ;;
    --live-seconds) live_seconds=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

# Sum of a numeric `key=` field over the worker's checkpoint lines (0 before the first).
sum_field() { awk -v k=" $1=" '{ i = index($0, k); if (i) { split(substr($0, i + length(k)), a, " "); s += a[1] } } END { print s + 0 }' "$2"; }

# Builds `days` of history through the real pipeline: all but the last hour produced at once
# (about one version per window), then the last hour live-like, at 20 s of event time per wall
# second, so that each window collects versions from many 100 ms checkpoints as in production.
# Then times dashboard queries on the view with folding off (every version kept: the layout
# before folding) and after `tally fold`, each against an ideal table in the same run.
read_bench() {
  local events=${events:-1400000}
  scripts/bootstrap.sh
  scripts/services.sh up >&2
  cargo build --locked -p tally >&2
  local bin="$CARGO_TARGET_DIR/debug/tally"
  local run="readbench_$(date +%s)"
  local dir=".state/bench/$run"
  mkdir -p "$dir"
  export TALLY_JOB__NAME="$run" TALLY_JOB__STATE_DIR="$dir/state" TALLY_JOB__MAX_RECORD_BYTES=4096
  export TALLY_JOB__CHECKPOINT_INTERVAL=100ms TALLY_CLICKHOUSE__FOLD_INTERVAL=0s
  export TALLY_KAFKA__SOURCE_TOPIC="$run" TALLY_KAFKA__CONSUMER_GROUP="tally-$run"
  export TALLY_CLICKHOUSE__DATABASE="$run" TALLY_METRICS__ADDRESS=""
  local config=config/revenue_agg.toml
  local now_ms=$(( $(date +%s) * 1000 ))
  local live_span_ms=$(( live_seconds * 20000 ))
  local start_ms=$(( now_ms - days * 86400000 ))
  local history_ms=$(( days * 86400000 - live_span_ms ))
  local step_ms=$(( history_ms * partitions / events ))
  "$bin" run --config "$config" >"$dir/worker.log" 2>&1 &
  local pid=$!
  trap "kill -9 $pid 2>/dev/null || true" EXIT
  "$bin" loadgen --config "$config" --events "$events" --partitions "$partitions" --customers 2000 \
    --start-ms "$start_ms" --step-ms "$step_ms" --seed 1 --manifest "$dir/history.json" >&2
  local live_rate=1000
  "$bin" loadgen --config "$config" --rate "$live_rate" --duration "${live_seconds}s" --partitions "$partitions" \
    --customers 2000 --start-ms $(( start_ms + history_ms )) --step-ms $(( 20000 * partitions / live_rate )) \
    --seed 2 --manifest "$dir/live.json" >&2
  local produced=$(( events + live_rate * live_seconds ))
  until [ "$(sum_field consumed "$dir/worker.log")" -ge "$produced" ]; do
    kill -0 "$pid" 2>/dev/null || { echo "worker exited" >&2; tail -20 "$dir/worker.log" >&2; exit 1; }
    sleep 1
  done
  kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
  trap - EXIT
  echo "== before folding (every version kept)"
  cargo bench --profile dev --locked -p tally --bench read -- --database "$run" --runs 30
  TALLY_CLICKHOUSE__FOLD_INTERVAL=60s "$bin" fold --config "$config" >&2
  echo "== after folding"
  cargo bench --profile dev --locked -p tally --bench read -- --database "$run" --runs 30
  echo "== after folding, on the current engine (a copy of the same tables in chdb)"
  "$HOME/.cache/tally/py/bin/python" benches/read_current.py "$bin" "$run"
  "$bin" reconcile --config "$config" | tail -3
}
if [ "$mode" = read ]; then read_bench; exit 0; fi
events=${events:-1000000}

scripts/bootstrap.sh
scripts/services.sh up >&2
cargo build --release --locked -p tally >&2
bin="$CARGO_TARGET_DIR/release/tally"

run="bench_$(date +%s)"
dir=".state/bench/$run"
mkdir -p "$dir"
export TALLY_JOB__NAME="$run" TALLY_JOB__STATE_DIR="$dir/state" TALLY_JOB__MAX_RECORD_BYTES=4096
export TALLY_KAFKA__SOURCE_TOPIC="$run" TALLY_KAFKA__CONSUMER_GROUP="tally-$run"
export TALLY_CLICKHOUSE__DATABASE="$run" TALLY_METRICS__ADDRESS=""
config=config/revenue_agg.toml

"$bin" loadgen --config "$config" --events "$events" --partitions "$partitions" --customers 10000 \
  --duplicates 0.02 --poison 0.005 --late 0.005 --manifest "$dir/manifest.json" | tee "$dir/loadgen.log" >&2

start_ns=$(date +%s%N)
"$bin" run --config "$config" >"$dir/worker.log" 2>&1 &
pid=$!
trap 'kill -9 $pid 2>/dev/null || true' EXIT
consumed=0 peak_kib=0
while [ "$consumed" -lt "$events" ]; do
  sleep 0.2
  kill -0 "$pid" 2>/dev/null || { echo "worker exited" >&2; tail -20 "$dir/worker.log" >&2; exit 1; }
  consumed=$(sum_field consumed "$dir/worker.log")
  kib=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
  [ "${kib:-0}" -gt "$peak_kib" ] && peak_kib=$kib
done
end_ns=$(date +%s%N)
kill -TERM "$pid"; wait "$pid" 2>/dev/null || true
trap - EXIT
secs=$(awk -v a="$start_ns" -v b="$end_ns" 'BEGIN {printf "%.2f", (b - a) / 1e9}')
checkpoints=$(grep -c 'checkpoint committed' "$dir/worker.log")
p50=$(grep -o 'millis=[0-9]*' "$dir/worker.log" | cut -d= -f2 | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
p_max=$(grep -o 'millis=[0-9]*' "$dir/worker.log" | cut -d= -f2 | sort -n | tail -1)
rows=$(sum_field rows "$dir/worker.log")
printf '\n%-38s %s\n' "records" "$events"
printf '%-38s %s s (start, catch-up, every epoch committed)\n' "wall time" "$secs"
printf '%-38s %s records/s\n' "throughput" "$(awk -v n="$events" -v s="$secs" 'BEGIN {printf "%.0f", n / s}')"
printf '%-38s %s MiB\n' "peak RSS (VmHWM)" "$((peak_kib / 1024))"
printf '%-38s %s\n' "checkpoints" "$checkpoints"
printf '%-38s %s ms / %s ms\n' "checkpoint+commit median / max" "$p50" "$p_max"
printf '%-38s %s\n' "ClickHouse rows written" "$rows"
"$bin" verify --config "$config" --manifest "$dir/manifest.json" | grep -E '^verify'
