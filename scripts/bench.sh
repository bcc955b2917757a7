#!/usr/bin/env bash
# End-to-end throughput of `tally run` (release build) against the machine's ceiling, on the local
# services: produce N orders once, then per run (--repeat R, default 3) read the whole topic with a
# bare consumer (benches/ceiling.rs, tally's client settings, nothing else: the ceiling), and let a
# fresh tally job catch up to its last committed checkpoint; restart it on the same state to time the
# restore; check each run with `tally verify`. Prints medians over the runs (benches/summarize.py):
# ceiling, tally, ratio=0.NN, checkpoint pause p50/p99, commit latency p50/p99, restore, peak RSS,
# and the changelog: its bytes against the state changes', and a restore from it.
#   scripts/bench.sh [--events N] [--partitions P] [--repeat R] [--customers C] [--skew S] [--step-ms MS] [--no-verify]
#   scale: 1M+ live keys and 20M ids within the dedup horizon (see BENCHMARKS.md):
#     TALLY_WINDOW__ALLOWED_LATENESS=180s TALLY_WINDOW__DEDUP_HORIZON=2h \
#       scripts/bench.sh --events 20000000 --customers 1000000 --skew 0 --step-ms 1 --repeat 1 --no-verify
#   TALLY_BENCH_BIN=/path/to/tally [TALLY_BENCH_CONFIG=file] scripts/bench.sh ...   another build of tally
#   scripts/bench.sh --compare /path/to/other/tally ...   before/after: both builds on the same topic,
#       alternating within each repeat, each summarised on its own
#   scripts/bench.sh --with-standby ...   the same build alone and with a warm standby worker of the
#       job beside it on this machine (as docker-compose runs two workers), alternating
#   scripts/bench.sh --shared ...   the job split into one task per partition (job.tasks), run by one
#       worker and then shared by two workers on this machine, alternating; the second worker
#       starts once the first runs its tasks (a join under load), or with it (--together)
#   scripts/bench.sh --failover [--events N --customers C ...]
#       takeover by a warm standby after a SIGKILL, against a whole restore of the same state
#   scripts/bench.sh --failover --shared ...   the same with two workers sharing one task per
#       partition: the killed worker's tasks move to the other, which keeps warm standbys of them
#   scripts/bench.sh --join [--events N --customers C ...]   scale-out: worker A catches up the
#       backlog alone (one task per partition), then B joins; times each task moved to B, from A's
#       revocation to B consuming it
#   scripts/bench.sh --read [--days 7] [--events 1400000] [--live-seconds 180]
#       read cost of the view vs. an ideal table, before and after folding (see read_bench below)
#   scripts/bench.sh --changes [--rows 1000000] [--updates 1000000] [--repeat R]
#       a job of change events (config/orders.toml) against the append-only revenue_agg in the same
#       run: a PostgreSQL table of --rows rows read by a Debezium connector's first snapshot, then
#       --updates updates of it (amounts, customers, hours, cancellations), captured into one topic;
#       revenue_agg's topic holds as many events; alternating catch-ups of each, then the state's
#       size per live row and reconcile --source of the last change run
#   scripts/bench.sh --cluster [--events N --repeat R ...]   what replication costs, in one run: the
#       same records (one seed) produced into the single-node set and into the cluster set
#       (scripts/services.sh up --cluster: three brokers at RF 3 / min ISR 2, two ClickHouse
#       replicas; a job on both replicas), R catch-ups on each set, each summarised (the services'
#       CPU is the three brokers' and the two replicas'); then, on the cluster under a live load of
#       5000 records/s, the time from a SIGKILL of the replica written through, and of a broker, to
#       the commit of the first epoch begun after it (checkpoints every second);
#       --cluster-faults: those fault times alone
#   scripts/bench.sh --restate [--events N] [--rate R] [--live-seconds S]
#       a new version restating a day: N records (default 2M) over 24 h of event time caught up by
#       version 1, which then serves a live load of R records/s (default 2000): its commit latency
#       and throughput for S seconds (default 60) alone, then while version 2 (the same rules,
#       job.takeover = "hold") rebuilds the whole day beside it under the same load; version 2's
#       time and CPU for the day, and version 1's figures in both phases
#   scripts/bench.sh --formats [--events N] [--repeat R]
#       one declared job (config/payments.toml) on the same records in JSON, Avro and Protobuf
#       (Confluent wire format, schemas in the local registry, changing twice mid-stream):
#       alternating catch-ups of each topic, throughput and CPU per record
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
events="" partitions=4 mode=throughput days=7 live_seconds=180 repeat=3 rows=1000000 updates=1000000
customers=10000 skew=1.1 step_ms=10 verify=1 compare="" with_standby=0 shared=0 together=0 cluster=0
rate=2000 live_given=0
while (($#)); do
  case "$1" in
    --events) events=$2; shift 2 ;;
    --partitions) partitions=$2; shift 2 ;;
    --repeat) repeat=$2; shift 2 ;;
    --customers) customers=$2; shift 2 ;;
    --skew) skew=$2; shift 2 ;;
    --step-ms) step_ms=$2; shift 2 ;;
    --no-verify) verify=0; shift ;;
    --compare) compare=$2; shift 2 ;;
    --with-standby) with_standby=1; shift ;;
    --shared) shared=1; shift ;;
    --together) together=1; shift ;;
    --cluster) cluster=1; shift ;;
    --cluster-faults) cluster=1 mode=faults; shift ;;
    --read) mode=read; shift ;;
    --failover) mode=failover; shift ;;
    --join) mode=join; shift ;;
    --changes) mode=changes; shift ;;
    --formats) mode=formats; shift ;;
    --rows) rows=$2; shift 2 ;;
    --updates) updates=$2; shift 2 ;;
    --days) days=$2; shift 2 ;;
    --live-seconds) live_seconds=$2 live_given=1; shift 2 ;;
    --restate) mode=restate; shift ;;
    --rate) rate=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done

# cpu_ticks PIDS -- the CPU time (user + system, clock ticks) the processes have used so far; 0 once
# they are gone (PIDS space-separated). Fields after "pid (comm) ": utime is the 12th, stime the 13th.
cpu_ticks() { local p t=0; for p in $1; do t=$((t + $(stat_ticks "/proc/$p/stat"))); done; echo "$t"; }
stat_ticks() { awk '{ sub(/.*\) /, ""); print $12 + $13 }' "$1" 2>/dev/null || echo 0; }
ticks_s() { awk -v t="$1" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f", t / hz }'; }

# until_consuming PID LOG WHAT -- waits until the worker logs that it consumes, then stops it.
until_consuming() {
  until grep -q 'resuming partition from checkpoint' "$2"; do
    kill -0 "$1" 2>/dev/null || { echo "$3 exited" >&2; tail -20 "$2" >&2; exit 1; }
    sleep 0.05
  done
  kill -TERM "$1"; wait "$1" 2>/dev/null || true
}

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

# Shared by the failover and join benches: services, a release build (or TALLY_BENCH_BIN), a run
# directory and job of their own, and the backlog. Sets bin, run, dir and config.
two_worker_setup() {
  events=${events:-2000000}
  scripts/bootstrap.sh
  scripts/services.sh up >&2
  bin=${TALLY_BENCH_BIN:-}
  if [ -z "$bin" ]; then cargo build --release --locked -p tally >&2; bin="$CARGO_TARGET_DIR/release/tally"; fi
  run="$1_$(date +%s)"
  dir=".state/bench/$run"
  mkdir -p "$dir"
  config=${TALLY_BENCH_CONFIG:-config/revenue_agg.toml}
  export TALLY_JOB__NAME="$run" TALLY_JOB__MAX_RECORD_BYTES=4096 TALLY_METRICS__ADDRESS=""
  export TALLY_KAFKA__SOURCE_TOPIC="$run" TALLY_KAFKA__CONSUMER_GROUP="tally-$run"
  export TALLY_CLICKHOUSE__DATABASE="$run" TALLY_JOB__SESSION_TIMEOUT=6s
  "$bin" loadgen --config "$config" --events "$events" --partitions "$partitions" --customers "$customers" \
    --skew "$skew" --step-ms "$step_ms" --duplicates 0.02 --poison 0.005 --late 0.005 --manifest "$dir/manifest.json" >&2
}

# Failover with a warm standby: worker A catches up with the backlog while standby B keeps its
# directory near A's committed state; A is SIGKILLed, and B's takeover is timed (lease wait, the
# catch-up, first record consumed). Then the same state is restored whole into an empty directory
# (a cold standby's takeover, or a new machine), for comparison.
failover_bench() {
  two_worker_setup failover
  local running="holding the job's lease"
  if [ "$shared" = 1 ]; then export TALLY_JOB__TASKS="$partitions"; running="starting task"; fi
  TALLY_JOB__STATE_DIR="$dir/a" "$bin" run --config "$config" >"$dir/a.log" 2>&1 &
  local a=$!
  until grep -q "$running" "$dir/a.log"; do sleep 0.2; done
  TALLY_JOB__STATE_DIR="$dir/b" "$bin" run --config "$config" >"$dir/b.log" 2>&1 &
  local b=$!
  trap "kill -9 $a $b 2>/dev/null || true" EXIT
  until [ $(( $(sum_field consumed "$dir/a.log") + $(sum_field consumed "$dir/b.log") )) -ge "$events" ]; do
    kill -0 "$a" 2>/dev/null || { echo "worker A exited" >&2; tail -20 "$dir/a.log" >&2; exit 1; }
    sleep 1
  done
  # Let the standby's next round see A's last commits, as it would in a steady stream.
  sleep 12
  stat -c %s "$dir/b.log" >"$dir/b.log.at-kill"
  date -u +%Y-%m-%dT%H:%M:%S.%6NZ >"$dir/killed"
  kill -9 "$a"
  if [ "$shared" = 1 ]; then
    # Until every task A ran resumes on B: A's tasks are those B did not run.
    local moved; moved=$(( partitions - $(grep "the group assigned this worker its tasks" "$dir/b.log" | tail -1 | sed 's/.*tasks=\[\([^]]*\)\].*/\1/' | tr ',' '\n' | grep -c . || true) ))
    until [ "$(tail -c +$(( $(cat "$dir/b.log.at-kill") + 1 )) "$dir/b.log" | grep -c 'resuming partition from checkpoint')" -ge "$moved" ]; do
      kill -0 "$b" 2>/dev/null || { echo "worker B exited" >&2; tail -20 "$dir/b.log" >&2; exit 1; }
      sleep 0.2
    done
    kill -TERM "$b"; wait "$b" 2>/dev/null || true
    echo "cold restore: see the one-task run (tally restore is for jobs of one task)" >"$dir/cold.out"
  else
    until_consuming "$b" "$dir/b.log" "worker B"
    TALLY_JOB__STATE_DIR="$dir/cold" "$bin" restore --config "$config" >"$dir/cold.out"
  fi
  trap - EXIT
  "$bin" verify --config "$config" --manifest "$dir/manifest.json" | grep -E '^verify' || true
  python3 - "$dir" <<'PY'
import sys
sys.path.insert(0, "benches")
from bench_logs import field, stamp, ts
d = sys.argv[1]
killed = stamp(f"{d}/killed")
log = open(f"{d}/b.log").read().splitlines()
after = [l for l in log if l[:1].isdigit() and ts(l) > killed]
if any("the group assigned this worker its tasks" in l for l in after):
    held = next(l for l in after if "the group assigned this worker its tasks" in l)
    resumed = [l for l in after if "resuming partition from checkpoint" in l]
    caught = [l for l in after if "caught the state up with the changelog on taking the lease" in l]
    print(f"failover: kill -> tasks reassigned {(ts(held) - killed).total_seconds():.2f} s (session timeout 6 s); "
          f"reassigned -> every moved partition consuming {(ts(resumed[-1]) - ts(held)).total_seconds():.2f} s "
          f"({len(resumed)} partitions: " + ", ".join(f"{(ts(l) - ts(held)).total_seconds():.2f}" for l in resumed) + " s)")
    for l in caught:
        print(f"failover: warm takeover caught up {field(l, 'records')} records ({field(l, 'bytes')} bytes) in {field(l, 'millis')} ms")
    for l in after:
        if "restored the job's state from the changelog" in l:
            print(f"failover: a moved task restored whole: {field(l, 'records')} records, {field(l, 'ids')} ids in {field(l, 'millis')} ms")
    sys.exit(0)
held = next(l for l in after if "holding the job's lease" in l)
resumed = next(l for l in after if "resuming partition from checkpoint" in l)
caught = [l for l in after if "caught the state up with the changelog on taking the lease" in l]
whole_b = [l for l in after if "restored the job's state from the changelog" in l]
print(f"failover: kill -> lease {(ts(held) - killed).total_seconds():.2f} s (session timeout 6 s); "
      f"lease -> consuming {(ts(resumed) - ts(held)).total_seconds():.2f} s")
if caught:
    l = caught[0]
    print(f"failover: warm takeover caught up {field(l, 'records')} records ({field(l, 'bytes')} bytes) in {field(l, 'millis')} ms")
if whole_b:
    l = whole_b[0]
    print(f"failover: the takeover restored whole: {field(l, 'records')} records in {field(l, 'millis')} ms")
print("failover: cold (whole restore into an empty directory): " + open(f"{d}/cold.out").read().strip())
PY
}
# Scale-out under load: worker A runs the job's tasks (one per partition) and catches up the
# backlog alone; then B joins, and the group moves half of the tasks to it. Each moved task is
# timed from A's revocation to B consuming it. TALLY_BENCH_BIN: another build, for before/after.
join_bench() {
  two_worker_setup join
  export TALLY_JOB__TASKS="$partitions"
  TALLY_JOB__STATE_DIR="$dir/a" "$bin" run --config "$config" >"$dir/a.log" 2>&1 &
  local a=$!
  trap "kill -9 $a 2>/dev/null || true" EXIT
  until [ "$(sum_field consumed "$dir/a.log")" -ge "$events" ]; do
    kill -0 "$a" 2>/dev/null || { echo "worker A exited" >&2; tail -20 "$dir/a.log" >&2; exit 1; }
    sleep 1
  done
  date -u +%Y-%m-%dT%H:%M:%S.%6NZ >"$dir/joined"
  TALLY_JOB__STATE_DIR="$dir/b" "$bin" run --config "$config" >"$dir/b.log" 2>&1 &
  local b=$!
  trap "kill -9 $a $b 2>/dev/null || true" EXIT
  # Until B consumes every task it was given.
  until grep -q "the group assigned this worker its tasks tasks=\[[0-9]" "$dir/b.log" \
      && [ "$(grep -c 'resuming partition from checkpoint' "$dir/b.log")" -ge \
           "$(grep "the group assigned this worker its tasks" "$dir/b.log" | tail -1 | sed 's/.*tasks=\[\([^]]*\)\].*/\1/' | tr ',' '\n' | grep -c .)" ]; do
    kill -0 "$b" 2>/dev/null || { echo "worker B exited" >&2; tail -20 "$dir/b.log" >&2; exit 1; }
    sleep 0.2
  done
  kill -TERM "$a" "$b"; wait "$a" "$b" 2>/dev/null || true
  trap - EXIT
  "$bin" verify --config "$config" --manifest "$dir/manifest.json" | grep -E '^verify' || true
  python3 - "$dir" <<'PY'
import sys
sys.path.insert(0, "benches")
from bench_logs import field, stamp, ts
d = sys.argv[1]
lines = lambda f: [l for l in open(f"{d}/{f}").read().splitlines() if l[:1].isdigit()]
joined = stamp(f"{d}/joined")
a, b = lines("a.log"), lines("b.log")
for l in b:
    if "warmed this worker's copies" in l or "joining the group now" in l:
        print(f"join: B warmed its copies of every task in {int(field(l, 'millis')) / 1000:.2f} s before joining")
revoked = [l for l in a if "finishing its epochs before handing it over" in l and ts(l) > joined]
handed = next((l for l in a if "handed tasks over" in l and ts(l) > joined), None)
resumed = [l for l in b if "resuming partition from checkpoint" in l]
if not revoked or not resumed:
    sys.exit("join: no task moved")
start = min(ts(l) for l in revoked)
print(f"join: B started -> A revoked its tasks {(start - joined).total_seconds():.2f} s; "
      f"A handed them over in {int(field(handed, 'millis')) / 1000:.2f} s" if handed else "")
print(f"join: pause of each moved partition (revoked -> consuming on B): "
      + ", ".join(f"{(ts(l) - start).total_seconds():.2f}" for l in resumed) + " s")
for l in b:
    if "caught the state up with the changelog on taking the lease" in l:
        print(f"join: a moved task caught up {field(l, 'records')} records ({field(l, 'bytes')} bytes) in {field(l, 'millis')} ms")
    if "restored the job's state from the changelog" in l:
        when = "while its task was paused" if ts(l) > start else "before joining"
        print(f"join: B restored a task whole {when}: {field(l, 'records')} records, {field(l, 'ids')} ids in {field(l, 'millis')} ms")
PY
}
if [ "$mode" = read ]; then read_bench; exit 0; fi
[ "$mode" = changes ] && events=$(( rows + updates ))
if [ "$mode" = failover ]; then failover_bench; exit 0; fi
if [ "$mode" = join ]; then join_bench; exit 0; fi
if [ "$mode" = restate ]; then
  # A day of event time over the topic's partitions.
  events=${events:-2000000} step_ms=$(( 86400000 * partitions / ${events:-2000000} ))
  ((live_given)) || live_seconds=60
fi
events=${events:-1000000}

scripts/bootstrap.sh
# use_set SET -- the services of SET (single or cluster), the job's settings for it, and the pids
# whose CPU a run counts (the broker CPU is every broker's, ClickHouse's every replica's).
use_set() {
  if [ "$1" = cluster ]; then
    scripts/services.sh up --cluster >&2
    export TALLY_KAFKA__BROKERS=127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094
    export TALLY_CLICKHOUSE__URL=http://127.0.0.1:8123,http://127.0.0.1:8124 TALLY_CLICKHOUSE__CLUSTER=tally
    kafka_pid="$(scripts/services.sh pid kafka-1) $(scripts/services.sh pid kafka-2) $(scripts/services.sh pid kafka-3)"
    clickhouse_pid="$(scripts/services.sh pid clickhouse-1) $(scripts/services.sh pid clickhouse-2)"
  else
    scripts/services.sh up >&2
    unset TALLY_KAFKA__BROKERS TALLY_CLICKHOUSE__URL TALLY_CLICKHOUSE__CLUSTER
    kafka_pid=$(scripts/services.sh pid kafka) clickhouse_pid=$(scripts/services.sh pid clickhouse)
  fi
}
if ((cluster)); then
  if [ "$mode" = faults ]; then use_set cluster; else use_set single; fi
else
  scripts/services.sh up >&2
fi
if [ -n "${TALLY_BENCH_BIN:-}" ]; then
  bin="$TALLY_BENCH_BIN"   # e.g. an earlier build, for before/after figures with the same script
else
  cargo build --release --locked -p tally >&2
  bin="$CARGO_TARGET_DIR/release/tally"
fi
# The ceiling's binary, built once: later edits to the sources must not rebuild it mid-run.
ceiling_bin=$(cargo bench --locked -p tally --bench ceiling --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "ceiling" and m.get("executable"):
        print(m["executable"])')
[ -x "$ceiling_bin" ] || { echo "could not build benches/ceiling.rs" >&2; exit 1; }

topic="bench_$(date +%s)"
dir=".state/bench/$topic"
mkdir -p "$dir"
config=${TALLY_BENCH_CONFIG:-config/revenue_agg.toml}
export TALLY_JOB__MAX_RECORD_BYTES=4096 TALLY_KAFKA__SOURCE_TOPIC="$topic" TALLY_METRICS__ADDRESS=""

# One pre-loaded topic for every run below (--changes and --formats make their own, --cluster
# one per set).
if [ "$mode" != changes ] && [ "$mode" != formats ] && ((!cluster)); then
  "$bin" loadgen --config "$config" --events "$events"  --partitions "$partitions" --customers "$customers" \
    --skew "$skew" --step-ms "$step_ms" --duplicates 0.02 --poison 0.005 --late 0.005 --manifest "$dir/manifest.json" | tee "$dir/loadgen.log" >&2
fi

manifest="$dir/manifest.json"

# The CPU each run costs, beside its wall time: the broker's and ClickHouse's too, which share
# the machine's cores with the reader.
((cluster)) || { kafka_pid=$(scripts/services.sh pid kafka) clickhouse_pid=$(scripts/services.sh pid clickhouse); }

# ceiling_run FILE -- one ceiling run; its line in FILE, the CPU it cost in FILE.cpu.
ceiling_run() {
  local k0
  k0=$(cpu_ticks "$kafka_pid")
  { TIMEFORMAT='%U %S'; time "$ceiling_bin" --config "$config" 2>/dev/null >"$1.out"; } 2>"$1.time"
  grep '^ceiling' "$1.out" >"$1"
  { echo "consumer=$(awk '{ printf "%.2f", $1 + $2 }' "$1.time")"
    echo "broker=$(ticks_s $(( $(cpu_ticks "$kafka_pid") - k0 )))"; } >"$1.cpu"
}

# cpu_of_catch_up PID K0 C0 -- the worker's CPU per thread name, and the services' since K0/C0.
cpu_of_catch_up() {
  local t
  echo "broker=$(ticks_s $(( $(cpu_ticks "$kafka_pid") - $2 )))"
  echo "clickhouse=$(ticks_s $(( $(cpu_ticks "$clickhouse_pid") - $3 )))"
  for t in /proc/"$1"/task/*; do
    echo "$(tr ' ' _ <"$t/comm") $(stat_ticks "$t/stat")"
  done |
    awk -v hz="$(getconf CLK_TCK)" '{ s[$1] += $2 } END { for (k in s) printf "thread %s=%.2f\n", k, s[k] / hz }'
}

# Per run: its own job (state, group, transactional id), dead-letter topic and database.
run_env() {
  local id="$topic-$2r$1"
  export TALLY_JOB__NAME="$id" TALLY_JOB__STATE_DIR="$dir/r$1/state"
  export TALLY_KAFKA__CONSUMER_GROUP="tally-$id" TALLY_KAFKA__DLQ_TOPIC="$id.dlq"
  export TALLY_CLICKHOUSE__DATABASE="${id//-/_}"
}

# tally_run R [LABEL] [SECOND] -- catch-up of the whole topic (SECOND=1: with a second worker of
# the job standing by beside it; 2: with a second worker sharing the job's tasks); then a restart
# of the same state to time restore. Reads and writes the run's files under $dir (a label's own
# directory with --compare).
tally_run() {
  local r=$1 log="$dir/r$1/worker.log" consumed=0 peak_kib=0 kib pid standby="" second=""
  mkdir -p "$dir/r$r"
  run_env "$r" "${2:-}"
  [ "$shared" = 1 ] && export TALLY_JOB__TASKS="$partitions"
  date -u +%Y-%m-%dT%H:%M:%S.%6NZ >"$dir/r$r/started"
  local k0 c0
  k0=$(cpu_ticks "$kafka_pid") c0=$(cpu_ticks "$clickhouse_pid")
  "$bin" run --config "$config" >"$log" 2>&1 &
  pid=$!
  trap "kill -9 $pid 2>/dev/null || true" EXIT
  if [ "${3:-0}" = 1 ]; then
    # Started once the first worker holds the lease, so that it stands by.
    until grep -q "holding the job's lease" "$log"; do sleep 0.05; done
    TALLY_JOB__STATE_DIR="$dir/r$r/standby" "$bin" run --config "$config" >"$dir/r$r/standby.log" 2>&1 &
    standby=$!
    trap "kill -9 $pid $standby 2>/dev/null || true" EXIT
  fi
  if [ "${3:-0}" = 2 ]; then
    # Started once the first worker runs a task: the group then moves half of them over.
    # --together: started with the first, as the replicas of a deployment start.
    [ "$together" = 1 ] || until grep -q "starting task" "$log"; do sleep 0.05; done
    TALLY_JOB__STATE_DIR="$dir/r$r/second" "$bin" run --config "$config" >"$dir/r$r/second.log" 2>&1 &
    second=$!
    trap "kill -9 $pid $second 2>/dev/null || true" EXIT
  fi
  while [ "$consumed" -lt "$events" ]; do
    sleep 0.2
    kill -0 "$pid" 2>/dev/null || { echo "worker exited" >&2; tail -20 "$log" >&2; exit 1; }
    consumed=$(sum_field consumed "$log")
    [ -n "$second" ] && consumed=$((consumed + $(sum_field consumed "$dir/r$r/second.log")))
    kib=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
    [ "${kib:-0}" -gt "$peak_kib" ] && peak_kib=$kib
  done
  echo "$peak_kib" >"$dir/r$r/peak_kib"
  cpu_of_catch_up "$pid" "$k0" "$c0" >"$dir/r$r/cpu"
  # The standby goes first: it would take the job over from the stopping worker.
  if [ -n "$standby" ]; then kill -9 "$standby"; wait "$standby" 2>/dev/null || true; fi
  if [ -n "$second" ]; then
    kill -TERM "$pid" "$second"; wait "$pid" "$second" 2>/dev/null || true
    # Both workers' checkpoints, in time order, for the summary.
    sort -s -k1,1 "$log" "$dir/r$r/second.log" >"$log.both" && mv "$log.both" "$log"
  fi
  kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  # Restore: start again on the same state until it consumes, then stop.
  date -u +%Y-%m-%dT%H:%M:%S.%6NZ >"$dir/r$r/restarted"
  "$bin" run --config "$config" >"$dir/r$r/restore.log" 2>&1 &
  pid=$!
  until_consuming "$pid" "$dir/r$r/restore.log" "restart"
  trap - EXIT
  grep 'rebuilt the dedup id filter' "$dir/r$r/restore.log" | sed 's/.*rebuilt/restore: rebuilt/' >&2 || true
  # The same state rebuilt from the changelog on a "new machine" (builds with a changelog).
  if [ "$shared" = 0 ] && [ "${TALLY_JOB__TASKS:-1}" = 1 ] && "$bin" restore --help >/dev/null 2>&1; then
    TALLY_JOB__STATE_DIR="$dir/r$r/from-changelog" "$bin" restore --config "$config" >"$dir/r$r/changelog_restore"
    sed 's/^/changelog /' "$dir/r$r/changelog_restore" >&2
  fi
  if [ "$verify" = 1 ]; then
    # The build that wrote the manifest reads it (--compare: an older build may not).
    "${this_bin:-$bin}" verify --config "$config" --manifest "$manifest" | grep -E '^verify' >"$dir/r$r/verify"
  else
    echo "verify skipped (--no-verify)" >"$dir/r$r/verify"
  fi
}

# --changes: the change topic made once through the whole chain, then alternating catch-ups of
# the change job and of revenue_agg over as many events.
changes_bench() {
  local top=$dir table="public.$topic" pg_run
  pg() { PGPASSWORD=tally-secret psql -X -q -t -A -h 127.0.0.1 -U tally tally -c "$1"; }
  pg "CREATE TABLE $table (order_id bigint PRIMARY KEY, customer_id text NOT NULL, amount numeric(18, 2) NOT NULL,
      status text NOT NULL, created_at timestamptz NOT NULL)"
  # Orders every 100 ms up to now, over 10,000 customers.
  pg "INSERT INTO $table SELECT g, 'customer-' || (g % 10000), (g % 50000) / 100.0, 'paid',
      now() - (($rows - g) * interval '100 milliseconds') FROM generate_series(1, $rows) g"
  python3 - "$topic" "$partitions" <<'PY' | curl -fsS -X POST -H 'Content-Type: application/json' --data @- http://127.0.0.1:8083/connectors >/dev/null
import json, sys
run, partitions = sys.argv[1], sys.argv[2]
c = json.load(open("scripts/connect/orders-connector.json"))
c["name"] = run
c["config"].update({"topic.prefix": run, "slot.name": run, "publication.name": run,
                    "table.include.list": f"public.{run}", "signal.data.collection": f"public.{run}_signal",
                    "topic.creation.default.partitions": partitions, "snapshot.fetch.size": "20000"})
print(json.dumps(c))
PY
  trap 'curl -sS -X DELETE "http://127.0.0.1:8083/connectors/$topic" >/dev/null 2>&1 || true' EXIT
  local change_topic="$topic.public.$topic" held=0 t0
  topic_records() {
    scripts/services.sh kafka-cli org.apache.kafka.tools.GetOffsetShell --bootstrap-server 127.0.0.1:9092 \
      --topic "$1" 2>/dev/null | awk -F: '{s += $3} END {print s + 0}'
  }
  t0=$(date +%s)
  until [ "$held" -ge "$rows" ]; do sleep 2; held=$(topic_records "$change_topic"); done
  echo "changes: the first snapshot read $rows rows in $(( $(date +%s) - t0 )) s" >&2
  # The updates, a quarter of each kind: amounts, customers, hours (a row moves to another
  # window), cancellations (the filter takes the row out).
  local quarter=$(( updates / 4 ))
  t0=$(date +%s)
  pg "UPDATE $table SET amount = amount + 1.25 WHERE order_id <= $quarter"
  pg "UPDATE $table SET customer_id = 'customer-' || ((order_id * 7) % 10000) WHERE order_id > $quarter AND order_id <= $(( 2 * quarter ))"
  pg "UPDATE $table SET created_at = created_at + interval '1 hour' WHERE order_id > $(( 2 * quarter )) AND order_id <= $(( 3 * quarter ))"
  pg "UPDATE $table SET status = 'cancelled' WHERE order_id > $(( 3 * quarter )) AND order_id <= $(( 4 * quarter ))"
  until [ "$held" -ge "$events" ]; do sleep 2; held=$(topic_records "$change_topic"); done
  echo "changes: Debezium captured $(( 4 * quarter )) updates in $(( $(date +%s) - t0 )) s" >&2
  curl -sS -X DELETE "http://127.0.0.1:8083/connectors/$topic" >/dev/null 2>&1 || true
  trap - EXIT
  events=$(topic_records "$change_topic")
  # revenue_agg's topic: as many events.
  local events_topic="${topic}_events"
  TALLY_KAFKA__SOURCE_TOPIC="$events_topic" "$bin" loadgen --config config/revenue_agg.toml --events "$events" \
    --partitions "$partitions" --customers "$customers" --skew "$skew" --step-ms "$step_ms" \
    --duplicates 0.02 --poison 0.005 --late 0.005 --manifest "$top/manifest.json" >&2
  for r in $(seq 1 "$repeat"); do
    for label in changes events; do
      dir="$top/$label"
      mkdir -p "$dir"
      if [ "$label" = changes ]; then
        config=config/orders.toml verify=0
        export TALLY_KAFKA__SOURCE_TOPIC="$change_topic" TALLY_SOURCE__TABLE="$table" TALLY_WINDOW__ALLOWED_LATENESS=48h
      else
        config=config/revenue_agg.toml verify=1 manifest="$top/manifest.json"
        export TALLY_KAFKA__SOURCE_TOPIC="$events_topic"
        unset TALLY_SOURCE__TABLE TALLY_WINDOW__ALLOWED_LATENESS
      fi
      ceiling_run "$dir/ceiling_r$r"
      tally_run "$r" "$label"
      echo "$label run $r: $(cat "$dir/ceiling_r$r"); $(cat "$dir/r$r/verify" | tr '\n' ' ')" >&2
    done
  done
  for label in changes events; do
    echo "== $label: $([ "$label" = changes ] && echo "config/orders.toml on $change_topic" || echo "config/revenue_agg.toml on $events_topic") ($events records)"
    python3 benches/summarize.py "$top/$label" "$events" "$repeat"
  done
  # The change job's state: rows held (one per live row of the table) and the bytes on disk.
  local live state_bytes
  live=$(pg "SELECT count(*) FROM $table")
  state_bytes=$(du -sb "$top/changes/r$repeat/state" | cut -f1)
  echo "changes: state $state_bytes bytes on disk for $live live rows: $(( state_bytes / live )) bytes per row (RocksDB, after a clean stop)"
  config=config/orders.toml
  export TALLY_KAFKA__SOURCE_TOPIC="$change_topic" TALLY_SOURCE__TABLE="$table" TALLY_WINDOW__ALLOWED_LATENESS=48h
  run_env "$repeat" changes
  "$bin" reconcile --config "$config" --source --strict | grep -E '^(windows|reconcile)' || true
  pg "SELECT pg_drop_replication_slot('$topic')" >/dev/null 2>&1 || true
  pg "DROP PUBLICATION IF EXISTS $topic; DROP TABLE $table" >/dev/null 2>&1 || true
}
if [ "$mode" = changes ]; then changes_bench; exit 0; fi

# --formats: config/payments.toml's records written once per format, each to a topic of its own
# (the same seed: the same records), then alternating catch-ups of the three.
formats_bench() {
  local top=$dir fmt
  for fmt in json avro protobuf; do
    # The job file as shipped, in the format; JSON needs no registry.
    python3 - "$fmt" >"$top/payments_$fmt.toml" <<'PY'
import sys
fmt, out, skip = sys.argv[1], [], False
for line in open("config/payments.toml"):
    if line.startswith("["):
        skip = fmt == "json" and line.strip() == "[registry]"
    if not skip:
        out.append(line.replace('format = "avro"', f'format = "{fmt}"'))
print("".join(out), end="")
PY
    TALLY_KAFKA__SOURCE_TOPIC="${topic}_$fmt" "$bin" loadgen --config "$top/payments_$fmt.toml" \
      --events "$events" --partitions "$partitions" --customers "$customers" --skew "$skew" \
      --step-ms "$step_ms" --duplicates 0.02 --poison 0.005 --late 0.005 --filtered 0.05 \
      --seed 1 --manifest "$top/$fmt.json" >&2
  done
  for r in $(seq 1 "$repeat"); do
    for fmt in json avro protobuf; do
      dir="$top/$fmt" config="$top/payments_$fmt.toml" manifest="$top/$fmt.json"
      mkdir -p "$dir"
      export TALLY_KAFKA__SOURCE_TOPIC="${topic}_$fmt"
      ceiling_run "$dir/ceiling_r$r"
      tally_run "$r" "$fmt"
      echo "$fmt run $r: $(cat "$dir/ceiling_r$r"); $(cat "$dir/r$r/verify" | tr '\n' ' ')" >&2
    done
  done
  for fmt in json avro protobuf; do
    echo "== $fmt: config/payments.toml on ${topic}_$fmt ($events records)"
    python3 benches/summarize.py "$top/$fmt" "$events" "$repeat"
  done
}
if [ "$mode" = formats ]; then formats_bench; exit 0; fi

# --cluster: the fault times on the cluster set, under a live load: a fresh topic produced at
# 5000 records/s for 60 s while a job consumes it; the replica written through SIGKILLed after
# 15 s, a broker after 35 s, each started again 5 s later. Each time is from the kill to the
# commit of the first epoch begun after it (the last committed epoch at the kill plus the epochs
# that may have been in flight, job.max_epochs_in_flight, plus one).
fault_times() {
  local fdir="$top/faults" pid node e0 t0 t1 committed in_flight
  mkdir -p "$fdir"
  in_flight=$(sed -n 's/^max_epochs_in_flight *= *\([0-9]*\).*/\1/p' "$config"); in_flight=${in_flight:-2}
  export TALLY_KAFKA__SOURCE_TOPIC="${topic}_faults"
  run_env 0 faults
  # Checkpoints every second, so that the times measure the fault, not the interval.
  export TALLY_JOB__CHECKPOINT_INTERVAL=1s
  "$bin" loadgen --config "$config" --events 300000 --rate 5000 --partitions "$partitions" --customers "$customers" \
    --seed 3 --manifest "$fdir/manifest.json" >"$fdir/loadgen.log" 2>&1 &
  local loadgen=$!
  sleep 2
  "$bin" run --config "$config" >"$fdir/worker.log" 2>&1 &
  pid=$!
  trap "kill -9 $pid $loadgen 2>/dev/null || true" EXIT
  last_epoch() { sed -n 's/.*checkpoint committed epoch=\([0-9]*\).*/\1/p' "$fdir/worker.log" | tail -1; }
  for node in clickhouse-1 kafka-2; do
    sleep 15
    e0=$(last_epoch); e0=${e0:-0}
    t0=$(date +%s%N)
    kill -9 "$(scripts/services.sh pid "$node")"
    committed=0
    until [ "$committed" -ge $(( e0 + in_flight + 1 )) ]; do
      sleep 0.05
      committed=$(last_epoch); committed=${committed:-0}
      [ $(( ($(date +%s%N) - t0) / 1000000000 )) -lt 300 ] || { echo "no commit within 300 s of the $node kill" >&2; break; }
    done
    t1=$(date +%s%N)
    echo "fault: $node SIGKILLed at epoch $e0; epoch $(( e0 + in_flight + 1 )) (the first begun after it) committed $(( (t1 - t0) / 1000000 )) ms later" | tee -a "$fdir/times"
    sleep 5
    scripts/services.sh up "$node" >&2
  done
  wait "$loadgen" || true
  sleep 5
  kill -0 "$pid" 2>/dev/null || echo "fault: the worker exited: $(grep -m1 -E 'ERROR|^error' "$fdir/worker.log" | cut -c1-300)" | tee -a "$fdir/times"
  kill -TERM "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  trap - EXIT
  "$bin" verify --config "$config" --manifest "$fdir/manifest.json" | grep -E '^verify' | tee -a "$fdir/times"
  echo "fault: writes moved to another replica $(grep -c 'writing through another clickhouse replica' "$fdir/worker.log" || true) times" | tee -a "$fdir/times"
}

if ((cluster)) && [ "$mode" = faults ]; then
  top=$dir
  fault_times
  exit 0
fi
if ((cluster)); then
  # Each set's runs together (switching sets restarts every service), the single-node set first.
  top=$dir
  for set in single cluster; do
    use_set "$set"
    dir="$top/$set" manifest="$top/$set.json"
    mkdir -p "$dir"
    "$bin" loadgen --config "$config" --events "$events" --partitions "$partitions" --customers "$customers" \
      --skew "$skew" --step-ms "$step_ms" --duplicates 0.02 --poison 0.005 --late 0.005 --seed 1 \
      --manifest "$manifest" >"$dir/loadgen.log"
    for r in $(seq 1 "$repeat"); do
      ceiling_run "$dir/ceiling_r$r"
      tally_run "$r" "$set"
      echo "$set run $r: $(cat "$dir/ceiling_r$r"); $(cat "$dir/r$r/verify" | tr '\n' ' ')" >&2
    done
  done
  fault_times
  for set in single cluster; do
    echo "== $set: $([ "$set" = single ] && echo "one broker, one ClickHouse server" || echo "three brokers (RF 3, min ISR 2), two ClickHouse replicas (the job's truth replicated, a view on each)") ($events records)"
    python3 benches/summarize.py "$top/$set" "$events" "$repeat"
  done
  echo "== faults on the cluster set (5000 records/s)"
  cat "$top/faults/times"
  exit 0
fi

# --restate: see the usage above. One run: version 1 caught up, alone under the live load, then
# beside version 2 rebuilding the day under the same load.
restate_bench() {
  local rdir="$dir/restate" v1 v2 load t0 t1 k0 c0 cpu2 alone with
  mkdir -p "$rdir"
  run_env 1 restate
  # The live load: event time advances with the wall clock, records of its own seed.
  live() {
    "$bin" loadgen --config "$config" --rate "$rate" --duration "$1s" --partitions "$partitions" \
      --customers "$customers" --skew "$skew" --step-ms "$(( 1000 * partitions / rate ))" \
      --start-ms "$(date +%s%3N)" --seed "$2" --manifest "$rdir/live-$2.json" >"$rdir/live-$2.log" 2>&1
  }
  now() { date -u +%Y-%m-%dT%H:%M:%S.%6NZ; }
  "$bin" run --config "$config" >"$rdir/v1.log" 2>&1 &
  v1=$!
  trap "kill -9 $v1 \${v2:-} \${load:-} 2>/dev/null || true" EXIT
  until [ "$(sum_field consumed "$rdir/v1.log")" -ge "$events" ]; do
    kill -0 "$v1" 2>/dev/null || { echo "version 1 exited" >&2; tail -20 "$rdir/v1.log" >&2; exit 1; }
    sleep 0.5
  done
  echo "restate: version 1 caught up the day ($events records)" >&2
  alone="$(now)"
  live "$live_seconds" 2
  alone="$alone $(now)"
  echo "restate: version 1 alone under $rate records/s for ${live_seconds}s" >&2
  live 3600 3 &
  load=$!
  with="$(now)"
  k0=$(cpu_ticks "$kafka_pid") c0=$(cpu_ticks "$clickhouse_pid")
  t0=$(date +%s%N)
  TALLY_JOB__VERSION=2 TALLY_JOB__TAKEOVER=hold "$bin" run --config "$config" >"$rdir/v2.log" 2>&1 &
  v2=$!
  # Rebuilt: it has committed every record the topic held when it started (its first progress
  # line's records to read; committed every 5 s, the figure's resolution).
  local target=""
  until [ -n "$target" ] && [ "$(sum_field consumed "$rdir/v2.log")" -ge "$target" ]; do
    kill -0 "$v2" 2>/dev/null || { echo "version 2 exited" >&2; tail -20 "$rdir/v2.log" >&2; exit 1; }
    [ -n "$target" ] || target=$(sed -n 's/.*rebuild progress: .* to_read=\([0-9]*\).*/\1/p' "$rdir/v2.log" | head -1)
    sleep 0.2
  done
  t1=$(date +%s%N)
  cpu2=$(cpu_ticks "$v2")
  echo "broker=$(ticks_s $(( $(cpu_ticks "$kafka_pid") - k0 ))) clickhouse=$(ticks_s $(( $(cpu_ticks "$clickhouse_pid") - c0 )))" >"$rdir/services_cpu"
  with="$with $(now)"
  kill "$load" 2>/dev/null || true; wait "$load" 2>/dev/null || true
  kill -TERM "$v2" "$v1" 2>/dev/null || true; wait "$v2" "$v1" 2>/dev/null || true
  trap - EXIT
  echo "== restate a day: $events records over 24 h of event time, $partitions partitions; version 1 under $rate records/s"
  echo "version 2: committed the $target records the topic held at its start in $(awk -v n="$(( t1 - t0 ))" 'BEGIN { printf "%.1f", n / 1e9 }') s (from its start), CPU $(ticks_s "$cpu2") s; services meanwhile: $(cat "$rdir/services_cpu")"
  python3 - "$rdir/v1.log" "$alone" "$with" <<'PY'
import re, statistics, sys
from datetime import datetime
log, phases = sys.argv[1], {"alone": sys.argv[2].split(), "beside version 2": sys.argv[3].split()}
ts = lambda s: datetime.fromisoformat(s[:26])
lines = [l for l in open(log) if "checkpoint committed" in l]
for name, (a, b) in phases.items():
    a, b = ts(a), ts(b)
    inside = [l for l in lines if a <= ts(l[:26]) <= b]
    millis = sorted(int(re.search(r" millis=(\d+)", l).group(1)) for l in inside)
    consumed = sum(int(re.search(r" consumed=(\d+)", l).group(1)) for l in inside)
    seconds = (b - a).total_seconds()
    p = lambda q: millis[min(len(millis) - 1, round((len(millis) - 1) * q))] if millis else float("nan")
    print(f"version 1 {name}: {consumed / seconds:.0f} records/s over {seconds:.0f} s, commit latency p50 {p(0.5)} ms p99 {p(0.99)} ms ({len(millis)} commits)")
PY
}
if [ "$mode" = restate ]; then restate_bench; exit 0; fi

if [ -z "$compare" ] && [ "$with_standby" = 0 ] && [ "$shared" = 0 ]; then
  for r in $(seq 1 "$repeat"); do
    ceiling_run "$dir/ceiling_r$r"
    tally_run "$r"
    echo "run $r: $(cat "$dir/ceiling_r$r"); $(cat "$dir/r$r/verify" | tr '\n' ' ')" >&2
  done
  python3 benches/summarize.py "$dir" "$events" "$repeat"
  exit 0
fi

# --compare: per repeat, the other build then this one, each after a ceiling run of its own;
# --with-standby: this build alone, then with a standby beside it.
top=$dir this_bin=$bin labels="before after"
[ "$with_standby" = 1 ] && labels="alone standby"
[ "$shared" = 1 ] && labels="one two"
for r in $(seq 1 "$repeat"); do
  for label in $labels; do
    dir="$top/$label" bin=$this_bin
    [ "$label" = before ] && bin=$compare
    mkdir -p "$dir"
    ceiling_run "$dir/ceiling_r$r"
    tally_run "$r" "$label" "$(case $label in standby) echo 1 ;; two) echo 2 ;; *) echo 0 ;; esac)"
    echo "$label run $r: $(cat "$dir/ceiling_r$r"); $(cat "$dir/r$r/verify" | tr '\n' ' ')" >&2
  done
done
for label in $labels; do
  echo "== $label: $([ "$label" = before ] && echo "$compare" || echo "$this_bin")"
  python3 benches/summarize.py "$top/$label" "$events" "$repeat"
done
