#!/usr/bin/env bash
# The users' acceptance test: produce under load, SIGKILL the worker at random moments, restart
# ClickHouse and Kafka underneath it, then check the view and the dead-letter topic against the
# ground truth, exactly. Prints one table; exits non-zero on any difference.
#
#   scripts/chaos.sh                                   CI defaults (200k events, 10 kills, 1 restart each)
#   scripts/chaos.sh --events 10000000 --rate 40000 --kills 100 --restarts 3   the big run
#   scripts/chaos.sh --workers 3 --zombies 2 --leaves 2   replicas: one runs the job, the others stand by
#   scripts/chaos.sh --workers 3 --tasks 4 --zombies 2 --leaves 2   the workers share the job's tasks
#   scripts/chaos.sh --workers 3 --fold-kills 3   kills timed to fall inside a fold step
#   scripts/chaos.sh --config config/page_views.toml   a declared job (here 10 s windows sliding by 2 s)
#
# Options: --events N  --rate R (records/s)  --kills K  --restarts M (per service)  --partitions P
#          --seed S  --catch-up SECONDS (wait for the worker after the load, default 600)
#          --release (run the release build of tally, as production would; TALLY_CHAOS_BIN=path
#          runs that build instead)
#          --workers W (replicas of the job, each with its own state directory; kills hit the one
#          running the job)  --zombies Z (SIGSTOP the running worker past the session timeout,
#          then SIGCONT it)  --leaves L (SIGTERM a random worker and start it again)
#          --tasks T (job.tasks: the workers share T tasks; kills and zombies hit a worker running
#          tasks, whose tasks move to the others)  --fold-kills F (SIGKILL the read side's holder
#          while the server runs its fold step's insert, and start it again at once)
#          --customers C (distinct customers, default 1000)  --zombie-seconds S (how long a zombie
#          stays paused, default 9)  --upgrade-from BIN (each worker's first start runs BIN, an
#          earlier build; every start after a kill, zombie or leave runs this one, on the state,
#          changelog and tables BIN wrote: an upgrade in place under the chaos)
#          --config FILE (the job file, default config/revenue_agg.toml; a hopping job's slide is
#          shortened with its size, to TALLY_WINDOW__SLIDE or 2s)
#          --cluster (the cluster set of scripts/services.sh: the job on the three brokers and both
#          ClickHouse replicas; each Kafka restart is a SIGKILL of one broker at a time, each
#          ClickHouse restart a SIGKILL of one replica at a time, each started again after 5 s,
#          and each restart adds a ZooKeeper restart; a reader polls each replica's view and
#          verify checks each replica)
#          --restate (a new version of the job takes it over under the chaos: version 2, the
#          same rules with a column added and restate_from 40 % into the stream's event time,
#          starts on as many workers of its own a third of the way through; three steps of the
#          takeover, drawn at random, each SIGKILL the worker that first runs it; kills, zombies and
#          leaves then hit version 2; version 1's workers must stop by themselves; verify checks
#          the job's view against version 1's answer before restate_from and version 2's from it)
#
# A job of change events (config/orders.toml) runs on the whole chain: loadgen changes a
# PostgreSQL table of the run's own (inserts, updates, deletes, key changes, --snapshots new
# snapshots), a Debezium connector of its own captures it, and the chaos adds SIGKILLs of Kafka
# Connect (Debezium sends again what it had not flushed) and PostgreSQL restarts (--restarts
# each). The check is verify's: every change in the topic once, applied once, and the view
# equal to the table. Its connector, slot, publication and tables are dropped at the end.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

events=200000 rate=5000 kills=10 restarts=1 partitions=4 seed=42 catch_up=600 profile=debug
workers=1 zombies=0 leaves=0 tasks=1 fold_kills=0 customers=1000 zombie_seconds=9 upgrade_from=""
config=config/revenue_agg.toml snapshots=2 cluster=0 restate=0
while (($#)); do
  case "$1" in
    --events) events=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --kills) kills=$2; shift 2 ;;
    --restarts) restarts=$2; shift 2 ;;
    --partitions) partitions=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --catch-up) catch_up=$2; shift 2 ;;
    --release) profile=release; shift ;;
    --workers) workers=$2; shift 2 ;;
    --zombies) zombies=$2; shift 2 ;;
    --leaves) leaves=$2; shift 2 ;;
    --tasks) tasks=$2; shift 2 ;;
    --fold-kills) fold_kills=$2; shift 2 ;;
    --customers) customers=$2; shift 2 ;;
    --zombie-seconds) zombie_seconds=$2; shift 2 ;;
    --upgrade-from) upgrade_from=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --snapshots) snapshots=$2; shift 2 ;;
    --cluster) cluster=1; shift ;;
    --restate) restate=1; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
RANDOM=$seed
started=$(date +%s)

scripts/bootstrap.sh
bootstrap=127.0.0.1:9092
if ((cluster)); then
  scripts/services.sh up --cluster >&2
  bootstrap=127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094
  export TALLY_KAFKA__BROKERS="$bootstrap"
  export TALLY_CLICKHOUSE__URL="http://127.0.0.1:8123,http://127.0.0.1:8124" TALLY_CLICKHOUSE__CLUSTER=tally
else
  scripts/services.sh up >&2
fi
if [ -n "${TALLY_CHAOS_BIN:-}" ]; then
  TALLY_BIN="$TALLY_CHAOS_BIN"   # a given build: the run never picks up a rebuild made meanwhile
elif [ "$profile" = release ]; then
  cargo build --release --locked -p tally >&2
  TALLY_BIN="$CARGO_TARGET_DIR/release/tally"
else
  cargo build --locked -p tally >&2
fi
# Restarting a service needs it to be ours (started by this checkout's services.sh).
if scripts/services.sh status 2>/dev/null | grep -c "not started by this script" >/dev/null; then
  echo "chaos: services were started elsewhere; skipping service restarts" >&2
  restarts=0
fi

run="chaos_$(date +%s)_$$"
dir=".state/chaos/$run"
mkdir -p "$dir"
export TALLY_JOB__NAME="$run"
export TALLY_JOB__CHECKPOINT_INTERVAL="1s"
export TALLY_JOB__SESSION_TIMEOUT="6s"
export TALLY_JOB__TASKS="$tasks"
export TALLY_JOB__MAX_RECORD_BYTES="4096"
export TALLY_KAFKA__SOURCE_TOPIC="$run"
export TALLY_KAFKA__CONSUMER_GROUP="tally-$run"
export TALLY_CLICKHOUSE__DATABASE="$run"
export TALLY_METRICS__ADDRESS=""
# A job of change events reads a PostgreSQL table of the run's own through a connector of its own.
changes=0
if grep -q '^format *= *"debezium-json"' "$config"; then
  changes=1
  export TALLY_KAFKA__SOURCE_TOPIC="$run.public.$run"
  export TALLY_SOURCE__TABLE="public.$run" TALLY_SOURCE__SIGNAL_TABLE="public.${run}_signal"
  export TALLY_SOURCE__SLOT="$run" TALLY_SOURCE__CONNECTOR="$run"
  # Corrections reach back six windows; the table's clock runs 16 s of event time a second.
  export TALLY_WINDOW__ALLOWED_LATENESS="${TALLY_WINDOW__ALLOWED_LATENESS:-60s}"
  export TALLY_WINDOW__OUT_OF_ORDERNESS="${TALLY_WINDOW__OUT_OF_ORDERNESS:-5s}"
fi
# Short windows and frequent fold steps, so that folding runs many times under the chaos.
export TALLY_WINDOW__SIZE="${TALLY_WINDOW__SIZE:-10s}"
export TALLY_WINDOW__ALLOWED_LATENESS="${TALLY_WINDOW__ALLOWED_LATENESS:-10s}"
export TALLY_CLICKHOUSE__FOLD_INTERVAL="${TALLY_CLICKHOUSE__FOLD_INTERVAL:-2s}"
# A hopping job keeps five windows per record in the short size.
if grep -q '^slide *=' "$config"; then export TALLY_WINDOW__SLIDE="${TALLY_WINDOW__SLIDE:-2s}"; fi
# The job's view and group-by keys, as its file declares them (revenue_agg's without one).
job_table=$(sed -n '/^\[clickhouse\]/,/^\[/s/^table *= *"\(.*\)".*/\1/p' "$config")
keys=$(sed -n 's/^group_by *= *\[\(.*\)\].*/\1/p' "$config" | tr -d '" ')
keys=${keys:-customer_id,currency}
# The verify and probe tools read the first worker's settings; they touch no state directory.
export TALLY_JOB__STATE_DIR="$dir/state-0"
# Workers 0..workers-1 run the job's file; with --restate, workers..2*workers-1 run version 2.
cfg_of=() pending_faults=()
cur_lo=0
loadgen_config=$config loadgen_start=()
if ((restate)); then
  case "$TALLY_WINDOW__SIZE" in *[0-9]s) size_ms=$(( ${TALLY_WINDOW__SIZE%s} * 1000 )) ;;
    *) echo "chaos: --restate needs window sizes in seconds" >&2; exit 2 ;; esac
  # version 2's file: the job's, with a column added, restating from $1 (ms).
  write_version_2() {
    restate_from=$(date -u -d "@$(($1 / 1000))" +%Y-%m-%dT%H:%M:%SZ)
    sed "/^\[job\]/a version = 2\nrestate_from = \"$restate_from\"" "$dir/v1.toml" >"$dir/v2.toml"
    printf '\n[[aggregation.aggregate]]\ncolumn = "records_v2"\nfunction = "count"\n' >>"$dir/v2.toml"
  }
  cp "$config" "$dir/v1.toml"
  config="$dir/v1.toml"
  if ((!changes)); then
    # loadgen's event time: from its start, 10 ms a record per partition (its --step-ms).
    span_ms=$(( events / partitions * 10 ))
    start_ms=$(( $(date +%s%3N) - span_ms ))
    write_version_2 $(( (start_ms + span_ms * 2 / 5) / size_ms * size_ms ))
    # The manifest holds version 2's columns; version 1's answer is the same less one.
    loadgen_config="$dir/v2.toml" loadgen_start=(--start-ms "$start_ms")
  fi
  # (A job of changes: its rows' times are the table's; restate_from is set when version 2
  # starts, halfway through the windows version 1 shows then. verify compares with the table.)
  # Three of the takeover's six steps: each start of a version 2 worker arms those not yet
  # reached, so that each SIGKILLs whichever worker runs it first (a step a killed worker
  # left done is not run again; one it left undone may kill a second worker).
  points=(takeover_after_record takeover_after_fence takeover_after_claim takeover_after_copy takeover_after_install takeover_during_retire)
  pending_faults=()
  for ((i = 0; i < ${#points[@]}; i++)); do
    if (( RANDOM % (${#points[@]} - i) < 3 - ${#pending_faults[@]} )); then pending_faults+=("${points[i]}"); fi
  done
  for ((w = 0; w < workers; w++)); do cfg_of[workers + w]="$dir/v2.toml"; done
fi

# ClickHouse over HTTP, for what the run counts and where it aims its fold kills.
# The servers readers read: one, or each replica of the cluster.
IFS=, read -r -a ch_urls <<<"${TALLY_CLICKHOUSE__URL:-http://127.0.0.1:8123}"
chq() { curl -sS "${2:-${ch_urls[0]}}/" --data-binary "$1"; }
table=${TALLY_CLICKHOUSE__TABLE:-${job_table:-revenue_agg}}
# The tables of the version that runs the job (version 2's once it started, with --restate).
vt=$table

# Worker i: its own state directory and log; pids[i], and where its log was when it started.
pids=() log_at=() first_started=() upgraded=0
worker_log() { echo "$dir/worker-$1.log"; }
start_worker() {
  local log bin=$TALLY_BIN fault=""; log=$(worker_log "$1")
  if ((restate && $1 >= workers)); then fault=$(IFS=,; echo "${pending_faults[*]}"); fi
  touch "$log"; log_at[$1]=$(stat -c %s "$log")
  if [ -n "$upgrade_from" ]; then
    if [ -z "${first_started[$1]:-}" ]; then bin=$upgrade_from; else upgraded=$((upgraded + 1)); fi
    first_started[$1]=1
  fi
  # The events at debug (tally::events in releases before the runtime crate): a line per
  # publish, counted below.
  env ${fault:+TALLY_FAULT=$fault} \
    RUST_LOG="${RUST_LOG:-info,rdkafka=warn,tally::events=debug,tally_runtime::events=debug}" \
    TALLY_JOB__STATE_DIR="$dir/state-$1" "$bin" run --config "${cfg_of[$1]:-$config}" >>"$log" 2>&1 &
  pids[$1]=$!
}
# Version 2 beside version 1 (--restate): its workers start, and the chaos moves to them.
v2_started_at="" v1_stopped=0 fault_kills=""
start_version_2() {
  local w bounds lo hi
  if ((changes)); then
    bounds=$(chq "SELECT toUInt32(min(window_start)), toUInt32(max(window_start)) FROM ${run}.${table}" 2>/dev/null || true)
    read -r lo hi <<<"${bounds:-0 0}"
    if ((hi <= lo)); then lo=$(date +%s) hi=$lo; fi
    write_version_2 $(( ((lo + hi) / 2 * 1000) / size_ms * size_ms ))
  fi
  for ((w = workers; w < 2 * workers; w++)); do start_worker "$w"; done
  cur_lo=$workers vt="${table}__v2" v2_started_at=$(( $(date +%s) - started ))
}
# A worker that exited by itself: started again if it lost its lease (a woken zombie: its
# supervisor would) or was SIGKILLed at a takeover step; left alone if a new version took the
# job over (it exits 0). Anything else fails the run (after catching up: is only reported).
tend_workers() {
  local w log since point i
  for ((w = 0; w < ${#pids[@]}; w++)); do
    [ -n "${pids[w]}" ] || continue
    kill -0 "${pids[w]}" 2>/dev/null && continue
    log=$(worker_log "$w"); since=$(tail -c +$((log_at[w] + 1)) "$log")
    if grep -c "lost the lease" >/dev/null <<<"$since"; then
      zombie_exits=$((zombie_exits + 1)); start_worker "$w"
    elif ((restate)) && grep -c "took over the job from version 1: this worker stops" >/dev/null <<<"$since" \
        && wait "${pids[w]}"; then
      v1_stopped=$((v1_stopped + 1)); pids[w]=""
    elif ((restate)) && grep -c "fault injection: SIGKILL" >/dev/null <<<"$since"; then
      point=$(grep -o 'takeover_[a-z_]*' <<<"$since" | tail -1)
      fault_kills="$fault_kills $point"
      for ((i = 0; i < ${#pending_faults[@]}; i++)); do
        if [ "${pending_faults[i]}" = "$point" ]; then pending_faults=("${pending_faults[@]:0:i}" "${pending_faults[@]:i+1}"); break; fi
      done
      start_worker "$w"
    else
      echo "worker $w exited on its own; log tail:" >&2; tail -20 "$log" >&2
      [ "$1" = report ] || exit 1
    fi
  done
}
# The worker running the job: it took the lease since its last start. With tasks, a random
# worker among those that started a task since their last start.
active_worker() {
  local w running=()
  for ((w = cur_lo; w < cur_lo + workers; w++)); do
    if ((tasks > 1)); then
      tail -c +$((log_at[w] + 1)) "$(worker_log "$w")" | grep -c "starting task" >/dev/null && running+=("$w")
    elif tail -c +$((log_at[w] + 1)) "$(worker_log "$w")" | grep -c "holding the job's lease" >/dev/null; then
      echo "$w"; return
    fi
  done
  if ((${#running[@]})); then echo "${running[RANDOM % ${#running[@]}]}"; else echo "$cur_lo"; fi
}
# kill_one_node KIND N -- SIGKILLs one of the cluster's nodes KIND-1..KIND-N at random, starts it
# again 5 s later, and prints its name.
kill_one_node() {
  local node="$1-$(( RANDOM % $2 + 1 ))"
  kill -9 "$(scripts/services.sh pid "$node")" 2>/dev/null || true
  sleep 5
  scripts/services.sh up "$node" >&2
  echo "$node"
}
connect_url=http://127.0.0.1:8083
pg() { PGPASSWORD=tally-secret psql -X -q -t -A -h 127.0.0.1 -U tally tally -c "$1"; }
connector_state() { curl -sS "$connect_url/connectors/$run/status" 2>/dev/null | python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["connector"]["state"], *[t["state"] for t in s["tasks"]])' 2>/dev/null || echo "?"; }
# The run's connector: scripts/connect/orders-connector.json with the run's names.
register_connector() {
  python3 - "$run" "$partitions" <<'PY' | curl -fsS -X POST -H 'Content-Type: application/json' --data @- "$connect_url/connectors" >/dev/null
import json, sys
run, partitions = sys.argv[1], sys.argv[2]
c = json.load(open("scripts/connect/orders-connector.json"))
c["name"] = run
c["config"].update({"topic.prefix": run, "slot.name": run, "publication.name": run,
                    "table.include.list": f"public.{run}", "signal.data.collection": f"public.{run}_signal",
                    "topic.creation.default.partitions": partitions,
                    "retriable.restart.connector.wait.ms": "2000"})
print(json.dumps(c))
PY
}
connector_restarts=0
# A connector task failed (Kafka restarted under it, say) is restarted, as an operator would.
revive_connector() {
  if [[ $(connector_state) == *FAILED* ]]; then
    curl -fsS -X POST "$connect_url/connectors/$run/restart?includeTasks=true&onlyFailed=true" >/dev/null 2>&1 || true
    connector_restarts=$((connector_restarts + 1))
  fi
}
drop_capture() {
  curl -sS -X DELETE "$connect_url/connectors/$run" >/dev/null 2>&1 || true
  for _ in $(seq 60); do
    pg "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '$run' AND NOT active" >/dev/null 2>&1 || true
    [ "$(pg "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '$run'" 2>/dev/null)" = 0 ] && break
    sleep 0.5
  done
  pg "DROP PUBLICATION IF EXISTS $run; DROP TABLE IF EXISTS public.$run; DROP TABLE IF EXISTS public.${run}_signal" >/dev/null 2>&1 || true
}
cleanup() {
  for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null || true; kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${probe_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ -n "${loadgen_pid:-}" ] && kill "$loadgen_pid" 2>/dev/null || true
  if ((changes)); then drop_capture; fi
}
trap cleanup EXIT

duration=$(( (events + rate - 1) / rate ))
if ((changes)); then
  # The table's first rows, read by the connector's first snapshot; then the changes in the
  # background, new snapshots asked for among them.
  "$TALLY_BIN" loadgen --config "$config" --events 0 --initial-rows 500 --step-ms 1000 --seed "$seed" \
    --customers "$customers" --manifest "$dir/manifest.json" >"$dir/loadgen.log" 2>&1
  register_connector
  # The changes start once the first snapshot has read those rows: a change made before its
  # consistent point would show in the topic as part of the snapshot, not as itself.
  snapshot_deadline=$(( $(date +%s) + 120 ))
  until [ "$(scripts/services.sh kafka-cli org.apache.kafka.tools.GetOffsetShell --bootstrap-server "$bootstrap" \
            --topic "$TALLY_KAFKA__SOURCE_TOPIC" 2>/dev/null | awk -F: '{s += $3} END {print s + 0}')" -ge 500 ]; do
    [ "$(date +%s)" -lt "$snapshot_deadline" ] || { echo "chaos: the connector's first snapshot did not arrive" >&2; exit 1; }
    sleep 1
  done
  "$TALLY_BIN" loadgen --config "$config" --events "$events" --rate "$rate" --step-ms 200 --seed "$seed" \
    --customers "$customers" --snapshots "$snapshots" --manifest "$dir/manifest.json" >>"$dir/loadgen.log" 2>&1 &
  loadgen_pid=$!
else
  # Produce in the background at the target rate, with duplicates, poison of every reason and late events.
  "$TALLY_BIN" loadgen --config "$loadgen_config" "${loadgen_start[@]}" --events "$events" --rate "$rate" --partitions "$partitions" --seed "$seed" \
    --customers "$customers" --duplicates 0.03 --poison 0.005 --late 0.005 --manifest "$dir/manifest.json" >"$dir/loadgen.log" 2>&1 &
  loadgen_pid=$!
fi
sleep 2
for ((w = 0; w < workers; w++)); do start_worker "$w"; done
# A dashboard reading the view all along (on each replica of a cluster): it must never see a
# window twice, vanish or shrink.
probe_pids=()
for ((r = 0; r < ${#ch_urls[@]}; r++)); do
  TALLY_CLICKHOUSE__URL="${ch_urls[r]}" "$TALLY_BIN" probe --config "$config" --interval 250ms \
    >"$dir/probe-$r.txt" 2>"$dir/probe-$r.log" &
  probe_pids+=($!)
done

# Spread kills and service restarts over the load's duration.
total_events=$(( kills + (2 + 2 * changes + cluster) * restarts + zombies + leaves + fold_kills ))
actions=()
for ((i = 0; i < kills; i++)); do actions+=(kill); done
for ((i = 0; i < restarts; i++)); do actions+=(clickhouse kafka); done
if ((cluster)); then for ((i = 0; i < restarts; i++)); do actions+=(zookeeper); done; fi
if ((changes)); then for ((i = 0; i < restarts; i++)); do actions+=(connect postgres); done; fi
for ((i = 0; i < zombies; i++)); do actions+=(zombie); done
for ((i = 0; i < leaves; i++)); do actions+=(leave); done
for ((i = 0; i < fold_kills; i++)); do actions+=(foldkill); done
for ((i = ${#actions[@]} - 1; i > 0; i--)); do j=$((RANDOM % (i + 1))); t=${actions[i]}; actions[i]=${actions[j]}; actions[j]=$t; done
gap_ms=$(( duration * 1000 / (total_events + 1) ))
done_kills=0 done_ch=0 done_kafka=0 done_zombies=0 done_leaves=0 zombie_exits=0 done_fold_kills=0 read_side_back=""
done_connect=0 done_pg=0 done_zk=0
load_started=$(date +%s%3N)
for action in "${actions[@]}"; do
  # A random moment: on average one gap apart, anywhere from half a gap to one and a half.
  sleep_ms=$(( gap_ms / 2 + RANDOM % (gap_ms > 1 ? gap_ms : 1) ))
  # Version 2 starts a third of the way through the load, its chaos after it.
  if ((restate)) && [ -z "$v2_started_at" ] && (( $(date +%s%3N) + sleep_ms - load_started >= duration * 1000 / 3 )); then
    sleep "$(printf '%d.%03d' $(( (sleep_ms / 2) / 1000)) $(( (sleep_ms / 2) % 1000)))"
    start_version_2
    sleep_ms=$(( sleep_ms / 2 ))
  fi
  sleep "$(printf '%d.%03d' $((sleep_ms / 1000)) $((sleep_ms % 1000)))"
  case "$action" in
    kill)
      w=$(active_worker)
      kill -9 "${pids[w]}" 2>/dev/null || true
      wait "${pids[w]}" 2>/dev/null || true
      done_kills=$((done_kills + 1))
      # With replicas, stay down past the session timeout so that a standby takes over (a
      # worker back sooner gets its own lease back: static membership).
      if ((workers > 1)); then sleep 8; fi
      start_worker "$w" ;;
    zombie)
      # Paused past the session timeout: a standby takes over (or, alone, the worker gets its
      # lease back on waking). Woken, the worker stops by itself if its lease moved.
      w=$(active_worker)
      kill -STOP "${pids[w]}" 2>/dev/null || true
      sleep "$zombie_seconds"
      kill -CONT "${pids[w]}" 2>/dev/null || true
      done_zombies=$((done_zombies + 1)) ;;
    leave)
      w=$((cur_lo + RANDOM % workers))
      kill -TERM "${pids[w]}" 2>/dev/null || true
      wait "${pids[w]}" 2>/dev/null || true
      done_leaves=$((done_leaves + 1))
      start_worker "$w" ;;
    foldkill)
      # Wait for a fold step's insert on the server, find the worker holding the read side (its
      # pid is in the generation's lease), SIGKILL it mid-insert and start it again at once.
      until_s=$(( $(date +%s) + 120 ))
      until [ "$(chq "SELECT count() FROM system.processes WHERE query LIKE 'INSERT INTO ${run}__${table}__read%.fold%'" 2>/dev/null || echo 0)" -gt 0 ] \
            || [ "$(date +%s)" -ge "$until_s" ]; do sleep 0.05; done
      gen=$(chq "SELECT max(generation) FROM ${run}.${vt}_read_side" 2>/dev/null || echo 0)
      holder_pid=$(chq "SELECT holder FROM ${run}__${vt}__read${gen}.lease" 2>/dev/null | sed -n 's/^tally run@[^:]*:\([0-9]*\):.*/\1/p')
      for ((w = cur_lo; w < cur_lo + workers; w++)); do
        [ "${pids[w]}" = "$holder_pid" ] || continue
        killed_at=$(date +%s%N)
        kill -9 "${pids[w]}" 2>/dev/null || true
        wait "${pids[w]}" 2>/dev/null || true
        start_worker "$w"
        done_fold_kills=$((done_fold_kills + 1))
        # Until a later generation holds the read side: publishing resumed.
        until [ "$(chq "SELECT max(generation) FROM ${run}.${vt}_read_side" 2>/dev/null || echo 0)" -gt "$gen" ]; do sleep 0.1; done
        read_side_back="$read_side_back $(( ($(date +%s%N) - killed_at) / 1000000 ))"
      done ;;
    clickhouse)
      if ((cluster)); then
        # One replica at a time (the one written through or the other, by chance).
        killed_replicas="${killed_replicas:-}${killed_replicas:+ }$(kill_one_node clickhouse 2)"
      else
        scripts/services.sh restart clickhouse >&2
      fi
      done_ch=$((done_ch + 1)) ;;
    zookeeper)
      # The replicated tables turn read-only until the servers reconnect: writes wait.
      scripts/services.sh restart zookeeper >&2
      done_zk=$((done_zk + 1)) ;;
    kafka)
      if ((cluster)); then
        # One broker at a time (the controller or a transaction coordinator among them, by chance).
        killed_brokers="${killed_brokers:-}${killed_brokers:+ }$(kill_one_node kafka 3)"
      else
        scripts/services.sh restart kafka >&2
      fi
      done_kafka=$((done_kafka + 1)) ;;
    connect)
      # Killed while it streams: Debezium sends again what it had not flushed.
      kill -9 "$(scripts/services.sh pid connect)" 2>/dev/null || true
      scripts/services.sh up connect >&2
      done_connect=$((done_connect + 1)) ;;
    postgres) scripts/services.sh restart postgres >&2; done_pg=$((done_pg + 1)) ;;
  esac
  if ((changes)); then revive_connector; fi
  tend_workers
done
if ((restate)) && [ -z "$v2_started_at" ]; then start_version_2; fi
wait "$loadgen_pid"; loadgen_pid=""

# verify on every replica readers read (one server, or each replica of the cluster).
# With --restate: version 2's, once it holds the job's view, against both versions' answers,
# and only once every worker of version 1 stopped by itself.
verify_args=(--config "$config")
if ((restate)); then verify_args=(--config "$dir/v2.toml" --earlier "$dir/v1.toml"); fi
# (A job of changes: verify compares version 2's windows with the table; --earlier is of manifests.)
if ((restate && changes)); then verify_args=(--config "$dir/v2.toml"); fi
verify_all() {
  local r
  for ((r = 0; r < ${#ch_urls[@]}; r++)); do
    TALLY_CLICKHOUSE__URL="${ch_urls[r]}" "$TALLY_BIN" verify "${verify_args[@]}" --manifest "$dir/manifest.json" \
      >"$dir/verify-$r.txt" 2>&1 || { cp "$dir/verify-$r.txt" "$dir/verify.txt"; return 1; }
    if ((restate)) && ! grep -c "holds the job's view" "$dir/verify-$r.txt" >/dev/null; then
      cp "$dir/verify-$r.txt" "$dir/verify.txt"; echo "verify: version 2 does not hold the job's view yet" >>"$dir/verify.txt"; return 1
    fi
  done
  cp "$dir/verify-0.txt" "$dir/verify.txt"
  if ((restate && v1_stopped < workers)); then echo "verify: $v1_stopped of $workers workers of version 1 stopped" >>"$dir/verify.txt"; return 1; fi
}
# Catch up: poll verify until it matches or the deadline passes.
deadline=$(( $(date +%s) + catch_up ))
until verify_all; do
  if [ "$(date +%s)" -ge "$deadline" ]; then break; fi
  if ((changes)); then revive_connector; fi
  tend_workers report
  sleep 5
done
for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
pids=()
for pid in "${probe_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
set +e
probe_status=0
for pid in "${probe_pids[@]}"; do wait "$pid" || probe_status=1; done
probe_pids=()
verify_all
verdict=$?
set -e

summary=$(grep '^verify-summary' "$dir/verify.txt" || true)
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$summary"; }
produced=$(sed -n 's/^produced \([0-9]*\) records.*/\1/p' "$dir/loadgen.log")
dups=$(sed -n 's/.* \([0-9]*\) duplicates,.*/\1/p' "$dir/loadgen.log")
poison=$(sed -n 's/.* \([0-9]*\) poison;.*/\1/p' "$dir/loadgen.log")
late=$(sed -n 's/.* \([0-9]*\) late,.*/\1/p' "$dir/loadgen.log")
printf '\n%-40s %s (%s build)\n' "chaos run" "$run" "$profile"
printf '%-40s %s\n' "job" "$config"
if ((changes)); then
  printf '%-40s %s\n' "changes made (rows inserted first)" "$(field changes_made) ($(grep -m1 -o '[0-9]* inserts' "$dir/loadgen.log"))"
  printf '%-40s %s\n' "new snapshots asked for" "$snapshots"
  printf '%-40s %s\n' "kafka connect SIGKILLs" "$done_connect"
  printf '%-40s %s\n' "postgresql restarts" "$done_pg"
  printf '%-40s %s\n' "connector tasks restarted after failing" "$connector_restarts"
else
  printf '%-40s %s\n' "events produced" "$produced"
  printf '%-40s %s\n' "duplicates injected" "$dups"
  printf '%-40s %s\n' "poison injected (+ late)" "$poison (+ $late)"
fi
printf '%-40s %s\n' "workers (replicas of the job)" "$workers"
if [ -n "$upgrade_from" ]; then
  printf '%-40s %s\n' "first starts by the earlier build" "$upgrade_from"
  printf '%-40s %s\n' "starts of this build on its state" "$upgraded"
fi
if ((tasks > 1)); then
  printf '%-40s %s\n' "tasks shared by the workers" "$tasks"
  printf '%-40s %s\n' "task starts (a worker given a task)" "$(cat "$dir"/worker-*.log | grep -c "starting task" || true)"
  printf '%-40s %s\n' "tasks moved away from a worker" "$(cat "$dir"/worker-*.log | grep -c "task moved to another worker" || true)"
fi
printf '%-40s %s\n' "worker SIGKILLs (of the running one)" "$done_kills"
# Takeovers: a warm standby catches up (only what was committed since its last round), a cold one
# or one that cannot be caught up restores whole; standby rounds restore whole once each.
caught_up=$(cat "$dir"/worker-*.log | grep -c "caught the state up with the changelog on taking the lease" || true)
whole=$(cat "$dir"/worker-*.log | grep -c "restored the job's state from the changelog" || true)
takeover_ms=$(cat "$dir"/worker-*.log | sed -n "s/.*millis=\([0-9]*\).*caught the state up with the changelog on taking the lease.*/\1/p; s/.*caught the state up with the changelog on taking the lease.*millis=\([0-9]*\).*/\1/p" | sort -n | tr '\n' ' ')
printf '%-40s %s\n' "zombies (SIGSTOP past the session timeout)" "$done_zombies"
printf '%-40s %s\n' "exits on a lost lease (started again)" "$zombie_exits"
printf '%-40s %s\n' "leaves (SIGTERM, then rejoin)" "$done_leaves"
printf '%-40s %s%s\n' "takeovers caught up from the changelog" "$caught_up" "${takeover_ms:+ (ms: ${takeover_ms% })}"
printf '%-40s %s\n' "whole restores from the changelog" "$whole"
if ((cluster)); then
  printf '%-40s %s\n' "clickhouse replicas SIGKILLed, one at a time" "$done_ch${killed_replicas:+ (${killed_replicas})}"
  printf '%-40s %s\n' "zookeeper restarts" "$done_zk"
  printf '%-40s %s\n' "writes moved to another replica" "$(cat "$dir"/worker-*.log | grep -c 'writing through another clickhouse replica' || true)"
else
  printf '%-40s %s\n' "clickhouse restarts" "$done_ch"
fi
if ((cluster)); then
  printf '%-40s %s\n' "kafka brokers SIGKILLed, one at a time" "$done_kafka${killed_brokers:+ (${killed_brokers})}"
else
  printf '%-40s %s\n' "kafka restarts" "$done_kafka"
fi
if ((changes)); then
  printf '%-40s %s / %s\n' "changes made / in the topic" "$(field changes_made)" "$(field changes_in_topic)"
  printf '%-40s %s\n' "snapshot reads" "$(field snapshot_reads)"
  printf '%-40s %s (%s duplicates, %s stale)\n' "changes sent again (counted, not applied)" "$(field repeated)" "$(field duplicates)" "$(field stale)"
  printf '%-40s %s applied, %s filtered, %s tombstones\n' "the job" "$(field applied)" "$(field filtered)" "$(field tombstones)"
  printf '%-40s %s\n' "dead letters (must be 0: nothing late)" "$(field dead_lettered)"
  printf '%-40s %s\n' "windows compared with the table" "$(field windows)"
  printf '%-40s %s\n' "windows differing from the table (must be 0)" "$(field windows_differ)"
else
  printf '%-40s %s / %s\n' "rows expected / found" "$(field rows_expected)" "$(field rows_found)"
  printf '%-40s %s / %s\n' "orders expected / found" "$(field orders_expected)" "$(field orders_found)"
  printf '%-40s %s\n' "orders double counted in sink (must be 0)" "$(field over_counted)"
  printf '%-40s %s\n' "orders lost (must be 0)" "$(field lost)"
  printf '%-40s %s / %s\n' "dead letters expected / found" "$(field dl_expected)" "$(field dl_found)"
  printf '%-40s %s\n' "dead letters repeated (must be 0)" "$(field dl_repeated)"
fi
pfield() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$probe"; }
folds=$(cat "$dir"/worker-*.log | grep -c 'fold step frontier=' || true)
printf '%-40s %s\n' "fold steps (frontier advanced)" "$folds ($(cat "$dir"/worker-*.log | grep 'fold step frontier=' | grep -vc 'folded_rows=0' || true))"
printf '%-40s %s\n' "fold kills (holder SIGKILLed mid-insert)" "$done_fold_kills${read_side_back:+ (read side back after ms:$read_side_back)}"
printf '%-40s %s\n' "publishes (snapshots swapped in)" "$(cat "$dir"/worker-*.log | grep -c ' published ' || true)"
printf '%-40s %s\n' "read side generations (claims)" "$(chq "SELECT countIf(event = 'claimed') FROM ${run}.${vt}_read_side" 2>/dev/null || echo '?')"
if ((restate)); then
  printf '%-40s %s\n' "version 2 (a column added) restating from" "$restate_from, started ${v2_started_at}s into the run"
  printf '%-40s %s\n' "version 2 SIGKILLed at takeover steps" "${fault_kills# }"
  printf '%-40s %s\n' "version 1 workers stopped by the takeover" "$v1_stopped of $workers (exit 0)"
  printf '%-40s %s\n' "windows kept from version 1 (_kept rows)" "$(chq "SELECT count() FROM ${run}.${vt}_kept" 2>/dev/null || echo '?')"
  # On every replica readers read.
  v1_left=0
  for url in "${ch_urls[@]}"; do
    n=$(chq "SELECT count() FROM system.tables WHERE database = '${run}' AND name IN ('${table}_data', '${table}_commits', '${table}_final', '${table}_live', '${table}_job')" "$url" 2>/dev/null || echo '?')
    if ! [[ $n =~ ^[0-9]+$ ]] || [ "$v1_left" = '?' ]; then v1_left='?'; else v1_left=$((v1_left + n)); fi
  done
  printf '%-40s %s\n' "version 1's tables left (must be 0)" "$v1_left"
fi
twice=0
kept=""; if ((restate)); then kept=" + (SELECT count() - uniqExact(window_start, $keys) FROM ${run}.${vt}_kept)"; fi
for url in "${ch_urls[@]}"; do
  n=$(chq "SELECT (SELECT count() - uniqExact(window_start, $keys) FROM ${run}.${vt}_final) + (SELECT count() - uniqExact(window_start, $keys) FROM ${run}.${vt}_live)$kept" "$url" 2>/dev/null || echo '?')
  if ! [[ $n =~ ^[0-9]+$ ]] || [ "$twice" = '?' ]; then twice='?'; else twice=$((twice + n)); fi
done
printf '%-40s %s\n' "keys twice in the folded, live or kept table (must be 0)" "$twice"
for ((r = 0; r < ${#ch_urls[@]}; r++)); do
  probe=$(grep '^probe-summary' "$dir/probe-$r.txt" || true)
  on=""; if ((${#ch_urls[@]} > 1)); then on=" on ${ch_urls[r]#http://}"; fi
  printf '%-40s %s (%s failed during restarts)\n' "reader polls of the view$on" "$(pfield reads)" "$(pfield errors)"
  printf '%-40s %s\n' "reader saw a key twice (must be 0)" "$(pfield duplicated)"
  if ((changes)); then
    printf '%-40s %s\n' "reader saw an emptied group (must be 0)" "$(pfield empty)"
  else
    printf '%-40s %s\n' "reader saw a window vanish (must be 0)" "$(pfield vanished)"
    printf '%-40s %s\n' "reader saw a count go down (must be 0)" "$(pfield decreased)"
  fi
done
printf '%-40s %ss\n' "wall time" "$(( $(date +%s) - started ))"
if ((restate)); then
  if [ "$v1_left" != 0 ]; then echo "chaos: FAILED (version 1's tables are still there: $v1_left)"; exit 1; fi
fi
if [ "$twice" != 0 ]; then
  echo "chaos: FAILED (a key is twice in a table readers read)"; exit 1
fi
if [ "$probe_status" -ne 0 ]; then
  echo "chaos: FAILED (the reader saw an inconsistent view)"; cat "$dir"/probe-*.txt; exit 1
fi
if [ "$verdict" -ne 0 ]; then
  echo "chaos: FAILED"; sed -n '1,40p' "$dir/verify.txt"; for f in "$dir"/worker-*.log; do echo "== $f"; tail -30 "$f"; done; exit 1
fi
echo "chaos: OK (exact match)"
