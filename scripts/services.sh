#!/usr/bin/env bash
# Local Kafka + ClickHouse + PostgreSQL + Kafka Connect (Debezium) + a schema registry (Apicurio) for
# tally, without Docker (this project's machines have no Docker engine).
#
#   scripts/services.sh up      [--cluster] [SERVICE...]  start (idempotent) and wait until answering
#       --cluster: the cluster set in place of the single-node one (below); `up` with no flag and no
#       SERVICE brings the single-node set back. The set chosen last is the one the other commands see.
#   scripts/services.sh down    [--wipe] [SERVICE...] stop what this script started; --wipe deletes data
#   scripts/services.sh restart [SERVICE...]          down + up, keeping data (used by chaos tests)
#   scripts/services.sh status  [SERVICE...]          exit 0 only if every service answers
#   scripts/services.sh logs    [-f] [-n N] [SERVICE]
#   scripts/services.sh pid     SERVICE               the PID of a service this script started
#   scripts/services.sh kafka-cli CLASS [ARGS...]     run a Kafka CLI class, e.g.
#       scripts/services.sh kafka-cli org.apache.kafka.tools.TopicCommand --bootstrap-server 127.0.0.1:9092 --list
#
# SERVICE is kafka, clickhouse, postgres, registry or connect; none means all of them. `up` starts
# connect only once kafka answers (`up connect` brings kafka up too); the others start in parallel.
# `down` stops connect before kafka.
#
# The cluster set (`up --cluster`), as production runs: three Kafka brokers in KRaft (kafka-1,
# kafka-2, kafka-3 on 127.0.0.1:9092, :9093, :9094, controllers on :19092-19094;
# default.replication.factor=3, min.insync.replicas=2, the offsets and transaction topics at RF 3 /
# min ISR 2), ZooKeeper (zookeeper, 127.0.0.1:2181, Debian's package) and two ClickHouse servers as
# two replicas of one shard in the cluster `tally` (clickhouse-1 and clickhouse-2: HTTP :8123 and
# :8124, native :9011 and :9012, interserver :9021 and :9022), with postgres, registry and connect
# as in the single-node set (connect pointed at the three brokers). Every command names its nodes:
# `status`, `logs clickhouse-2`, `pid kafka-3`, `restart zookeeper`. No TLS endpoints on it.
#
# Each service, its settings and how it is run: scripts/<service>/service.sh (kafka, clickhouse,
# postgres, connect, registry), sourced below.
#
# TLS endpoints (beside the plaintext ones above, for tests of TLS and passwords):
#   Kafka      SASL_SSL://127.0.0.1:9094, SASL mechanism PLAIN, user tally / password tally-secret
#              (librdkafka: security.protocol=sasl_ssl sasl.mechanism=PLAIN sasl.username=tally
#               sasl.password=tally-secret ssl.ca.location=<tls>/ca.pem; Java CLI: --command-config
#               <tls>/kafka-client.properties)
#   ClickHouse https://127.0.0.1:8443 (and https://localhost:8443), user tally_secure / tally-secret
#   Material in <state>/tls/, made once per state dir with openssl before the first start:
#     ca.pem, ca.key                  self-signed test CA (10 years)
#     server.pem, server.key          server cert signed by it, SAN IP:127.0.0.1, DNS:localhost
#     server.p12                      the same as a PKCS12 keystore for Kafka, password tally-test
#     other-ca.pem                    an unrelated CA that signed nothing, for "wrong CA" tests
#     kafka-client.properties         Java client settings for the SASL_SSL listener
#   All of these are test-only secrets. Delete <state>/tls and restart both services to regenerate;
#   'down --wipe' keeps it (it is not service data).
#
# Ports (all on 127.0.0.1): kafka 9092 9093 9094, clickhouse 8123 9000 8443, postgres 5432, connect 8083,
# registry 8081 9081.
# Root: apt-get installs and PostgreSQL (run as the postgres user) need root; a non-root caller needs
# sudo for those (the server is then started and signalled through sudo).
#
# Environment:
#   TALLY_SERVICES_DIR   state (data, logs, PID files); default <repo>/.state/services
#   TALLY_CACHE_DIR      Kafka/Connect jars, the registry app; default ~/.cache/tally (outside the clone so
#                        fresh clones start fast)
#   TALLY_SERVICES_TIMEOUT       seconds to wait for readiness (default 120)
#   TALLY_SERVICES_STOP_TIMEOUT  seconds between TERM (postgres: INT, fast shutdown) and KILL (default 30)
#   TALLY_KAFKA_HEAP_OPTS        default "-Xms512m -Xmx1g"
#   TALLY_CONNECT_HEAP_OPTS      default "-Xms256m -Xmx768m"
#   TALLY_REGISTRY_HEAP_OPTS     default "-Xms128m -Xmx512m"
#   JAVA_HOME            tried first for the registry's Java 21+ (ignored, with a note, if older)
#   TALLY_POSTGRES_ROOT          the pg root described above (its parents must be traversable by the
#                                postgres user); default /var/lib/postgresql/tally-<hash of state dir>
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE_DIR="${TALLY_SERVICES_DIR:-$REPO_ROOT/.state/services}"
CACHE_DIR="${TALLY_CACHE_DIR:-$HOME/.cache/tally}"
READY_TIMEOUT="${TALLY_SERVICES_TIMEOUT:-120}"
STOP_TIMEOUT="${TALLY_SERVICES_STOP_TIMEOUT:-30}"
KAFKA_HEAP_OPTS="${TALLY_KAFKA_HEAP_OPTS:--Xms512m -Xmx1g}"
KAFKA_NODE_HEAP_OPTS="${TALLY_KAFKA_NODE_HEAP_OPTS:--Xms256m -Xmx768m}"
CONNECT_HEAP_OPTS="${TALLY_CONNECT_HEAP_OPTS:--Xms256m -Xmx768m}"
REGISTRY_HEAP_OPTS="${TALLY_REGISTRY_HEAP_OPTS:--Xms128m -Xmx512m}"

TLS_DIR="$STATE_DIR/tls"
# Test-only secrets, documented in the header above.
TLS_STORE_PASSWORD="tally-test"

# Which set runs: `single` (default) or `cluster` (`up --cluster`), kept in the state dir.
MODE_FILE="$STATE_DIR/mode"
MODE="$(cat "$MODE_FILE" 2>/dev/null || echo single)"
SINGLE_NODES=(clickhouse kafka)
CLUSTER_NODES=(zookeeper clickhouse-1 clickhouse-2 kafka-1 kafka-2 kafka-3)
# set_mode MODE -- the services, their order and dependencies of that set.
set_mode() {
  MODE="$1"
  # Start order for `up`/`status`; `down` walks it backwards (connect before kafka).
  # `up` launches a service of DEPENDS_ON only once every service it names answers.
  if [[ $MODE == cluster ]]; then
    ALL_SERVICES=("${CLUSTER_NODES[@]}" postgres registry connect)
    DEPENDS_ON=([connect]="kafka-1 kafka-2 kafka-3" [clickhouse-1]=zookeeper [clickhouse-2]=zookeeper)
    KAFKA_BOOTSTRAP="$KAFKA_CLUSTER_BOOTSTRAP"
    CONNECT_REPLICATION=3
  else
    ALL_SERVICES=("${SINGLE_NODES[@]}" postgres registry connect)
    DEPENDS_ON=([connect]=kafka)
    KAFKA_BOOTSTRAP="127.0.0.1:9092"
    CONNECT_REPLICATION=1
  fi
}
declare -A DEPENDS_ON=()
# The services that serve the TLS material of tls_ensure.
TLS_SERVICES=(clickhouse kafka)

# Each service's settings and steps (<service>_prepare, _launch, _ready, _logfiles, ...).
for svc_file in kafka clickhouse postgres connect registry zookeeper; do
  # shellcheck source=/dev/null
  source "$REPO_ROOT/scripts/$svc_file/service.sh"
done
# The cluster's nodes: kafka-N and clickhouse-N are steps of one node kind with its number.
for n in 1 2 3; do
  for step in prepare launch ready logfiles; do
    eval "kafka-${n}_${step}() { kafka_node_${step} $n; }"
    ((n <= 2)) && eval "clickhouse-${n}_${step}() { ch_node_${step} $n; }"
  done
done
set_mode "$MODE"

log() { printf '[services] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# in_list WORD LIST... -- true if WORD is one of LIST.
in_list() {
  local w="$1" x
  shift
  for x in "$@"; do [[ $x == "$w" ]] && return 0; done
  return 1
}

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

# --- prerequisites ----------------------------------------------------------------------------

as_root() {
  if [[ $EUID -eq 0 ]]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else die "need root to run: $*"
  fi
}

# ensure_cmds CMD:PACKAGE... -- apt-get install the packages whose command is missing.
# Fresh machines/CI don't keep hand-installed packages, so the script installs what it needs.
APT_UPDATED=0
ensure_cmds() {
  local pair cmd pkgs=()
  for pair in "$@"; do
    cmd="${pair%%:*}"
    command -v "$cmd" >/dev/null 2>&1 || [[ -x "/usr/sbin/$cmd" ]] || pkgs+=("${pair#*:}")
  done
  [[ ${#pkgs[@]} -eq 0 ]] && return 0
  log "installing ${pkgs[*]} with apt-get"
  if [[ $APT_UPDATED -eq 0 ]]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
}

# Kafka 4 brokers and tools require Java 17+.
check_java() {
  local v
  v="$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)"
  [[ -n $v && $v -ge 17 ]] || die "Kafka 4 needs Java 17+, found: $(java -version 2>&1 | head -n1)"
}

# --- process helpers --------------------------------------------------------------------------

# is_ours PID MARKER -- true if PID is alive and its command line contains MARKER (a path inside
# this state dir). Guards against PID reuse after a reboot/crash and ignores zombies (empty cmdline).
is_ours() {
  local cmdline
  [[ $1 =~ ^[0-9]+$ ]] || return 1
  cmdline="$(tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline")" || return 1
  [[ $cmdline == *"$2"* ]]
}

# svc_pid SVC -- print the PID of the service this script started, if it is still running.
# A PID file whose process is gone (or is someone else's now) is stale: remove it.
svc_pid() {
  local pidfile marker pid
  pidfile="$(pidfile_of "$1")"; marker="$(marker_of "$1")"
  [[ -f $pidfile ]] || return 1
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  if is_ours "$pid" "$marker"; then
    echo "$pid"
    return 0
  fi
  # A process in the middle of exec reads with an empty command line for a moment: look again.
  if [[ -d /proc/$pid ]]; then
    sleep 0.5
    if is_ours "$pid" "$marker"; then
      echo "$pid"
      return 0
    fi
  fi
  log "$1: removing stale PID file (pid ${pid:-?} is not running)"
  rm -f "$pidfile"
  return 1
}

pidfile_of() {
  case $1 in
    kafka) echo "$KAFKA_PIDFILE" ;; clickhouse) echo "$CH_PIDFILE" ;;
    postgres) echo "$PG_PIDFILE" ;; connect) echo "$CONNECT_PIDFILE" ;;
    registry) echo "$REGISTRY_PIDFILE" ;; zookeeper) echo "$ZK_PIDFILE" ;;
    kafka-*) echo "$(kafka_node_dir "${1#kafka-}")/kafka.pid" ;;
    clickhouse-*) echo "$(ch_node_dir "${1#clickhouse-}")/clickhouse.pid" ;;
  esac
}
# A path on the service's command line that is unique to this state dir (postgres: its config file,
# in the pg root named after the state dir; the postmaster keeps its original command line).
marker_of() {
  case $1 in
    kafka) echo "$KAFKA_PROPS" ;; clickhouse) echo "$CH_CONF" ;;
    postgres) echo "$PG_CONF" ;; connect) echo "$CONNECT_PROPS" ;;
    registry) echo "$REGISTRY_PROPS" ;; zookeeper) echo "$ZK_CONF" ;;
    kafka-*) echo "$(kafka_node_dir "${1#kafka-}")/server.properties" ;;
    clickhouse-*) echo "$(ch_node_dir "${1#clickhouse-}")/etc/config.xml" ;;
  esac
}
ports_of() {
  case $1 in
    kafka) echo "9092 9093 9094" ;; clickhouse) echo "8123 9000 8443" ;;
    postgres) echo "5432" ;; connect) echo "8083" ;;
    registry) echo "8081 9081" ;; zookeeper) echo "2181" ;;
    kafka-*) echo "$(kafka_node_port "${1#kafka-}") $((19091 + ${1#kafka-}))" ;;
    clickhouse-*) echo "$((8122 + ${1#clickhouse-})) $((9010 + ${1#clickhouse-})) $((9020 + ${1#clickhouse-}))" ;;
  esac
}
# Signals stop_svc sends in turn. PostgreSQL: SIGINT is a fast shutdown (a clean checkpoint; open
# sessions, e.g. Debezium's, are ended), SIGTERM would wait for every client to disconnect; SIGQUIT
# (immediate shutdown) before SIGKILL, which would leave its backends behind.
stop_signals_of() { case $1 in postgres) echo "INT QUIT KILL" ;; *) echo "TERM KILL" ;; esac; }

# signal_pid SIG PID -- also for a server that runs as another user (postgres) when we aren't root.
signal_pid() {
  kill -s "$1" "$2" 2>/dev/null && return 0
  [[ $EUID -ne 0 ]] && as_root kill -s "$1" "$2" 2>/dev/null
  return 0
}

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# launch [--as-root] SVC DIR OUTFILE CMD... -- start CMD detached (own session, immune to the caller's
# Ctrl-C/hangup). The child writes its own PID before exec'ing, so the PID file holds the real
# server PID no matter whether setsid had to fork. --as-root: CMD needs root (it drops to another
# user itself); a non-root caller goes through sudo, in the foreground so it can ask for a password,
# and sudo exits once the server is detached.
launch() {
  local root=0
  if [[ $1 == --as-root ]]; then root=1; shift; fi
  local svc="$1" dir="$2" out="$3" pidfile
  shift 3
  pidfile="$(pidfile_of "$svc")"
  rm -f "$pidfile"
  echo "==== $(date -u '+%Y-%m-%dT%H:%M:%SZ') services.sh starting $svc" >>"$out"
  # shellcheck disable=SC2016 # expanded by the child shells, on purpose
  local wrapper='echo $$ >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' \
    detach='out="$1"; shift; nohup setsid bash -c "$0" "$@" >>"$out" 2>&1 </dev/null &'
  (
    # fd 9 is the up/down lock: a long-lived child holding it would block every later up/down.
    exec 9>&-
    cd "$dir"
    if [[ $root == 1 ]]; then
      as_root bash -c "$detach" "$wrapper" "$out" "$pidfile" "$@"
    else
      nohup setsid bash -c "$wrapper" "$pidfile" "$@" >>"$out" 2>&1 </dev/null &
    fi
  )
  local i
  for ((i = 0; i < 50; i++)); do
    [[ -s $pidfile ]] && return 0
    sleep 0.1
  done
  die "$svc: process did not start (no PID file); see $out"
}

# stop_svc SVC -- TERM (see stop_signals_of) the PID from our PID file, KILL after STOP_TIMEOUT.
# Never matches by name.
stop_svc() {
  local svc="$1" pid marker pidfile i sig wait=$STOP_TIMEOUT
  pidfile="$(pidfile_of "$svc")"; marker="$(marker_of "$svc")"
  if ! pid="$(svc_pid "$svc")"; then
    log "$svc: not running"
    return 0
  fi
  log "$svc: stopping pid $pid"
  for sig in $(stop_signals_of "$svc"); do
    signal_pid "$sig" "$pid"
    for ((i = 0; i < wait * 10; i++)); do
      is_ours "$pid" "$marker" || break
      sleep 0.1
    done
    is_ours "$pid" "$marker" || break
    [[ $sig == KILL ]] && die "$svc: pid $pid survived SIGKILL"
    log "$svc: still running ${wait}s after SIG$sig, sending the next signal"
    wait=10
  done
  rm -f "$pidfile"
  # An exiting process can hold its ports a moment after it stops being listed (a JVM closing
  # them last): a start right after must not find them taken.
  local p
  for p in $(ports_of "$svc"); do
    for ((i = 0; i < 100; i++)); do port_open "$p" || break; sleep 0.1; done
  done
  log "$svc: stopped"
}

# --- TLS material -------------------------------------------------------------------------------

TLS_FILES=(ca.pem ca.key server.pem server.key server.p12 keystore.password other-ca.pem
  kafka-client.properties)

# tls_pair_ok DIR -- DIR holds a CA and a server key+cert it signed, the cert valid 30+ more days.
tls_pair_ok() {
  local d="$1" f
  for f in ca.pem ca.key server.pem server.key; do [[ -s $d/$f ]] || return 1; done
  openssl verify -CAfile "$d/ca.pem" "$d/server.pem" >/dev/null 2>&1 || return 1
  openssl x509 -checkend $((30 * 86400)) -noout -in "$d/server.pem" >/dev/null 2>&1 || return 1
  [[ "$(openssl x509 -noout -pubkey -in "$d/server.pem" 2>/dev/null)" == \
    "$(openssl pkey -pubout -in "$d/server.key" 2>/dev/null)" ]]
}

tls_complete() {
  local f
  for f in "${TLS_FILES[@]}"; do [[ -s $TLS_DIR/$f ]] || return 1; done
  tls_pair_ok "$TLS_DIR"
}

# tls_new_ca KEY CERT CN -- a self-signed CA, 10 years.
tls_new_ca() {
  openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout "$1" -out "$2" \
    -subj "/O=tally/CN=$3" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}

# tls_ensure -- the test CA, the server key+cert it signed, Kafka's keystore and an unrelated second
# CA, once per state dir. Called from each service's prepare step, i.e. before either starts and
# under the up/down lock. Only missing or unusable pieces are made (a valid CA + server cert is kept,
# so a service still running keeps matching it); the set is built in a temp dir and swapped in, so an
# interrupted run never leaves a half-made set that looks complete.
tls_ensure() {
  tls_complete && return 0
  ensure_cmds openssl:openssl
  local tmp="$TLS_DIR.tmp.$$" new_pair=0 svc
  tls_pair_ok "$TLS_DIR" || new_pair=1
  mkdir -p "$STATE_DIR"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  if [[ -d $TLS_DIR ]]; then cp -pR "$TLS_DIR"/. "$tmp"/; fi
  if [[ $new_pair == 1 ]]; then
    log "tls: generating a test CA and server certificate in $TLS_DIR"
    rm -f "$tmp/server.p12"
  else
    log "tls: completing $TLS_DIR"
  fi
  (
    set -e
    cd "$tmp"
    umask 077
    if [[ $new_pair == 1 ]]; then
      tls_new_ca ca.key ca.pem "tally test CA"
      openssl req -new -newkey rsa:2048 -nodes -sha256 \
        -keyout server.key -out server.csr -subj "/O=tally/CN=localhost"
      printf '%s\n' "basicConstraints=critical,CA:FALSE" \
        "keyUsage=critical,digitalSignature,keyEncipherment" "extendedKeyUsage=serverAuth" \
        "subjectAltName=IP:127.0.0.1,DNS:localhost" >server.ext
      openssl x509 -req -sha256 -days 3650 -in server.csr -CA ca.pem -CAkey ca.key \
        -set_serial "0x$(openssl rand -hex 16)" -extfile server.ext -out server.pem
      rm -f server.csr server.ext
      openssl verify -CAfile ca.pem server.pem
    fi
    printf '%s\n' "$TLS_STORE_PASSWORD" >keystore.password
    if [[ ! -s server.p12 ]]; then
      openssl pkcs12 -export -name tally -in server.pem -inkey server.key -certfile ca.pem \
        -passout "pass:$TLS_STORE_PASSWORD" -out server.p12
    fi
    # Unrelated CA: signs nothing; its key is thrown away.
    if [[ ! -s other-ca.pem ]]; then
      tls_new_ca other-ca.key other-ca.pem "tally unrelated test CA"
      rm -f other-ca.key
    fi
    cat >kafka-client.properties <<PROPS
# Java client settings for the local broker's SASL_SSL listener (127.0.0.1:9094). Test-only secrets.
security.protocol=SASL_SSL
sasl.mechanism=PLAIN
sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="tally" password="tally-secret";
ssl.truststore.type=PEM
ssl.truststore.location=$TLS_DIR/ca.pem
PROPS
    # Certificates are public; keys and the keystore stay owner-only.
    chmod 644 ca.pem server.pem other-ca.pem kafka-client.properties
  ) >"$tmp.log" 2>&1 || {
    cat "$tmp.log" >&2
    rm -rf "$tmp" "$tmp.log"
    die "tls: generating certificates failed"
  }
  rm -f "$tmp.log"
  chmod 755 "$tmp"
  if [[ -d $TLS_DIR ]]; then mv "$TLS_DIR" "$TLS_DIR.old.$$"; fi
  mv "$tmp" "$TLS_DIR"
  rm -rf "$TLS_DIR.old.$$"
  if [[ $new_pair == 1 ]]; then
    for svc in "${TLS_SERVICES[@]}"; do
      if svc_pid "$svc" >/dev/null 2>&1; then
        log "tls: $svc is running with the old certificate; 'services.sh restart $svc' to serve the new one"
      fi
    done
  fi
}

# --- shared by the services ---------------------------------------------------------------

# mvn_fetch [--unpack] LABEL DEST STAMP MVN-ARGS... -- copy the runtime dependencies of a
# dependency-list POM into DEST with Maven, unless DEST/.stamp already says STAMP (warm runs skip
# Maven entirely). --unpack: unpack them (archives, e.g. the registry's tar.gz) instead of copying.
# Copied into a temp dir (outside DEST's parent, which may be Connect's plugin.path) and swapped in,
# so an interrupted download never looks complete and jars of an older version never linger.
mvn_fetch() {
  local goal=(dependency:copy-dependencies)
  if [[ $1 == --unpack ]]; then goal=(dependency:unpack-dependencies); shift; fi
  local label="$1" dest="$2" want="$3" tmp
  shift 3
  if [[ -f $dest/.stamp && "$(cat "$dest/.stamp")" == "$want" ]]; then
    return 0
  fi
  ensure_cmds java:openjdk-17-jre-headless mvn:maven
  log "$label: fetching jars ($want) with Maven into $dest"
  mkdir -p "$CACHE_DIR" "$(dirname "$dest")"
  tmp="$CACHE_DIR/.fetch.$(basename "$dest").$$"
  rm -rf "$tmp" "$tmp.markers"
  # unpack-dependencies skips an archive whose marker file says it was unpacked before, and keeps
  # those markers in <pom dir>/target by default: keep them with this attempt, and drop them after.
  [[ ${goal[0]} == dependency:unpack-dependencies ]] && goal+=(-DmarkersDirectory="$tmp.markers")
  # Maven's output goes to a log (it prints colour codes even with -q); shown only on failure.
  if ! mvn -q -B -Dstyle.color=never "$@" "${goal[@]}" \
    -DoutputDirectory="$tmp" -DincludeScope=runtime >"$CACHE_DIR/mvn.log" 2>&1; then
    cat "$CACHE_DIR/mvn.log" >&2
    rm -rf "$tmp" "$tmp.markers"
    die "$label: Maven could not fetch the jars for $dest"
  fi
  rm -rf "$tmp.markers"
  echo "$want" >"$tmp/.stamp"
  rm -rf "$dest"
  mv "$tmp" "$dest"
}

# --- commands -----------------------------------------------------------------------------------

show_log_tail() {
  local f
  for f in $("$1"_logfiles); do
    [[ -s $f ]] || continue
    log "---- last 30 lines of $f ----"
    tail -n 30 "$f" >&2
  done
}

declare -A STARTED=() FOREIGN=() TO_LAUNCH=()

# Phase 1: prepare (install, fetch, render config, format) whatever isn't running.
svc_prepare() {
  local svc="$1" p
  svc_pid "$svc" >/dev/null && return 0
  for p in $(ports_of "$svc"); do
    port_open "$p" || continue
    # Someone else (e.g. docker compose) already serves it: use it, but never manage it.
    if [[ $p == "$(ports_of "$svc" | cut -d' ' -f1)" ]] && "$svc"_ready; then
      FOREIGN[$svc]=1
      return 0
    fi
    [[ $svc == postgres ]] && log "postgres: is it Debian's own cluster? pg_lsclusters; pg_ctlcluster 15 main stop"
    die "$svc: port $p is in use by a process this script did not start"
  done
  "$svc"_prepare
  TO_LAUNCH[$svc]=1
}

# Phase 2: launch them together, so both boot in parallel.
svc_launch() {
  [[ -n ${TO_LAUNCH[$1]:-} ]] || return 0
  log "$1: starting"
  "$1"_launch
  STARTED[$1]=$SECONDS
}

# Phase 3: wait until answering; on failure show the log tail.
svc_await() {
  local svc="$1" pid deadline
  if [[ -n ${FOREIGN[$svc]:-} ]]; then
    log "$svc: already answering, but not started by this script (leaving it alone)"
    return 0
  fi
  if ! pid="$(svc_pid "$svc")"; then
    log "$svc: exited during startup"
    show_log_tail "$svc"
    return 1
  fi
  if [[ -z ${STARTED[$svc]:-} ]] && "$svc"_ready; then
    log "$svc: already running (pid $pid)"
    return 0
  fi
  deadline=$((SECONDS + READY_TIMEOUT))
  while ((SECONDS < deadline)); do
    if ! is_ours "$pid" "$(marker_of "$svc")" && ! { sleep 0.5; is_ours "$pid" "$(marker_of "$svc")"; }; then
      rm -f "$(pidfile_of "$svc")"
      log "$svc: exited during startup"
      show_log_tail "$svc"
      return 1
    fi
    if "$svc"_ready; then
      log "$svc: up (pid $pid${STARTED[$svc]:+, ready after $((SECONDS - STARTED[$svc]))s})"
      return 0
    fi
    sleep 1
  done
  log "$svc: not answering after ${READY_TIMEOUT}s (pid $pid left running; 'services.sh down $svc' stops it)"
  show_log_tail "$svc"
  return 1
}

# Services without dependencies (and the dependencies of the requested ones, e.g. kafka for `up
# connect`) are launched together; the others once what they depend on answers.
cmd_up() {
  local svc dep rc=0 first=() later=() down=() missing
  for svc in "$@"; do
    if [[ -n ${DEPENDS_ON[$svc]:-} ]]; then
      later+=("$svc")
      for dep in ${DEPENDS_ON[$svc]}; do
        in_list "$dep" "$@" || in_list "$dep" "${first[@]}" || first+=("$dep")
      done
    else
      in_list "$svc" "${first[@]}" || first+=("$svc")
    fi
  done
  for svc in "${first[@]}" "${later[@]}"; do svc_prepare "$svc"; done
  for svc in "${first[@]}"; do svc_launch "$svc"; done
  for svc in "${first[@]}"; do svc_await "$svc" || { rc=1; down+=("$svc"); }; done
  # The later ones in turn (a ClickHouse replica once ZooKeeper serves sessions).
  for svc in "${later[@]}"; do
    missing=""
    for dep in ${DEPENDS_ON[$svc]}; do
      in_list "$dep" "${down[@]}" && missing+=" $dep"
    done
    if [[ -n $missing ]]; then
      log "$svc: not started, not up:$missing"
      rc=1
      down+=("$svc")
      continue
    fi
    svc_launch "$svc"
    svc_await "$svc" || { rc=1; down+=("$svc"); }
  done
  return $rc
}

# switch_to MODE -- stops the other set's nodes (they hold the same ports) and Kafka Connect (its
# brokers change), then makes MODE the set every command sees.
switch_to() {
  local other=("${SINGLE_NODES[@]}")
  [[ $1 == single ]] && other=("${CLUSTER_NODES[@]}")
  if [[ $1 != "$MODE" ]]; then
    log "switching to the $1 set"
    set_mode "$MODE"
    cmd_down 0 connect "${other[@]}"
  fi
  mkdir -p "$STATE_DIR"
  echo "$1" >"$MODE_FILE"
  set_mode "$1"
}

cmd_down() {
  local wipe="$1" svc i
  shift
  # Walk ALL_SERVICES backwards, so dependents stop first (connect before kafka).
  for ((i = ${#ALL_SERVICES[@]} - 1; i >= 0; i--)); do
    svc="${ALL_SERVICES[i]}"
    in_list "$svc" "$@" || continue
    stop_svc "$svc"
    if [[ $wipe == 1 ]]; then
      if declare -F "${svc}_wipe" >/dev/null; then "${svc}_wipe"; fi
      log "$svc: wiping $STATE_DIR/$svc"
      rm -rf "${STATE_DIR:?}/$svc"
    fi
  done
}

cmd_status() {
  local svc pid rc=0
  for svc in "$@"; do
    if pid="$(svc_pid "$svc")"; then
      if "$svc"_ready; then
        echo "$svc: up (pid $pid)"
      else
        echo "$svc: running (pid $pid) but NOT answering"
        rc=1
      fi
    elif "$svc"_ready; then
      echo "$svc: up (not started by this script)"
    else
      echo "$svc: down"
      rc=1
    fi
  done
  return $rc
}

cmd_logs() {
  local follow=0 lines=50 svc files=()
  while [[ $# -gt 0 ]]; do
    case $1 in
      -f) follow=1 ;;
      -n) lines="$2"; shift ;;
      -*) usage ;;
      *) in_list "$1" "${ALL_SERVICES[@]}" || usage; svc="$1" ;;
    esac
    shift
  done
  local s f
  for s in ${svc:-${ALL_SERVICES[*]}}; do
    for f in $("$s"_logfiles); do [[ -f $f ]] && files+=("$f"); done
  done
  [[ ${#files[@]} -gt 0 ]] || die "no log files yet under $STATE_DIR"
  if [[ $follow == 1 ]]; then exec tail -n "$lines" -F "${files[@]}"; fi
  tail -n "$lines" "${files[@]}"
}

# parse_services ARGS... -- validate service names; none means all.
parse_services() {
  local s
  [[ $# -eq 0 ]] && { echo "${ALL_SERVICES[*]}"; return; }
  for s in "$@"; do
    in_list "$s" "${ALL_SERVICES[@]}" || { log "unknown service: $s"; usage; }
  done
  echo "$*"
}

# up/down/restart take a lock so concurrent callers (a test harness and a developer) don't race.
take_lock() {
  mkdir -p "$STATE_DIR"
  exec 9>"$STATE_DIR/.lock"
  flock -w 300 9 || die "timed out waiting for $STATE_DIR/.lock"
}

main() {
  local cmd="${1:-}" svcs
  [[ $# -gt 0 ]] && shift
  case $cmd in
    up)
      local mode="$MODE"
      if [[ ${1:-} == --cluster ]]; then
        mode=cluster
        shift
      elif [[ $# -eq 0 ]]; then
        mode=single
      fi
      take_lock
      switch_to "$mode"
      # (parse_services runs in a subshell: its usage exit must end this script too)
      svcs="$(parse_services "$@")" || exit 2
      # shellcheck disable=SC2086
      cmd_up $svcs
      ;;
    down)
      local wipe=0
      if [[ ${1:-} == --wipe ]]; then wipe=1; shift; fi
      svcs="$(parse_services "$@")" || exit 2
      take_lock
      # shellcheck disable=SC2086
      cmd_down "$wipe" $svcs
      ;;
    restart)
      svcs="$(parse_services "$@")" || exit 2
      take_lock
      # shellcheck disable=SC2086
      cmd_down 0 $svcs
      # shellcheck disable=SC2086
      cmd_up $svcs
      ;;
    status)
      svcs="$(parse_services "$@")" || exit 2
      # shellcheck disable=SC2086
      cmd_status $svcs
      ;;
    logs) cmd_logs "$@" ;;
    pid)
      [[ $# -eq 1 ]] || usage
      svcs="$(parse_services "$1")" || exit 2
      svc_pid "$svcs"
      ;;
    kafka-cli)
      [[ $# -ge 1 ]] || usage
      kafka_fetch
      kafka_cli "$@"
      ;;
    -h | --help | help | "") usage ;;
    *) log "unknown command: $cmd"; usage ;;
  esac
}

main "$@"
