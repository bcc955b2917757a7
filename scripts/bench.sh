#!/usr/bin/env bash
# End-to-end throughput and memory of `tally run` (release build) on the local services:
# produce N orders, start the worker, and time it until every record is checkpointed and committed.
# Prints one table; then checks the result with `tally verify`.
#   scripts/bench.sh [--events N] [--partitions P]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
events=1000000 partitions=4
while (($#)); do
  case "$1" in
    --events) events=$2; shift 2 ;;
    --partitions) partitions=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

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

# Sum of a numeric `key=` field over the worker's checkpoint lines (0 before the first).
sum_field() { awk -v k=" $1=" '{ i = index($0, k); if (i) { split(substr($0, i + length(k)), a, " "); s += a[1] } } END { print s + 0 }' "$2"; }

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
