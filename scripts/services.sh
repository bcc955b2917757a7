#!/usr/bin/env bash
# Local Kafka + ClickHouse for tally, without Docker (this project's machines have no Docker engine).
#
#   scripts/services.sh up      [kafka|clickhouse]   start (idempotent) and wait until answering
#   scripts/services.sh down    [--wipe] [kafka|clickhouse]   stop what this script started; --wipe deletes data
#   scripts/services.sh restart [kafka|clickhouse]   down + up, keeping data (used by chaos tests)
#   scripts/services.sh status  [kafka|clickhouse]   exit 0 only if every service answers
#   scripts/services.sh logs    [-f] [-n N] [kafka|clickhouse]
#   scripts/services.sh pid     kafka|clickhouse      the PID of a service this script started
#   scripts/services.sh kafka-cli CLASS [ARGS...]     run a Kafka CLI class, e.g.
#       scripts/services.sh kafka-cli org.apache.kafka.tools.TopicCommand --bootstrap-server 127.0.0.1:9092 --list
#
# Kafka: the real Apache Kafka 4.x broker, fetched as jars from Maven Central (scripts/kafka/pom.xml),
#        KRaft combined mode on 127.0.0.1:9092 (controller 9093).
# ClickHouse: Debian's clickhouse-server (18.16 on bookworm), HTTP 127.0.0.1:8123, native 127.0.0.1:9000.
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
# Environment:
#   TALLY_SERVICES_DIR   state (data, logs, PID files); default <repo>/.state/services
#   TALLY_CACHE_DIR      Kafka jars; default ~/.cache/tally (outside the clone so fresh clones start fast)
#   TALLY_SERVICES_TIMEOUT       seconds to wait for readiness (default 120)
#   TALLY_SERVICES_STOP_TIMEOUT  seconds between TERM and KILL (default 30)
#   TALLY_KAFKA_HEAP_OPTS        default "-Xms512m -Xmx1g"
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE_DIR="${TALLY_SERVICES_DIR:-$REPO_ROOT/.state/services}"
CACHE_DIR="${TALLY_CACHE_DIR:-$HOME/.cache/tally}"
READY_TIMEOUT="${TALLY_SERVICES_TIMEOUT:-120}"
STOP_TIMEOUT="${TALLY_SERVICES_STOP_TIMEOUT:-30}"
KAFKA_HEAP_OPTS="${TALLY_KAFKA_HEAP_OPTS:--Xms512m -Xmx1g}"

TLS_DIR="$STATE_DIR/tls"
# Test-only secrets, documented in the header above.
TLS_STORE_PASSWORD="tally-test"

KAFKA_SRC="$REPO_ROOT/scripts/kafka"
KAFKA_POM="$KAFKA_SRC/pom.xml"
KAFKA_LIBS="$CACHE_DIR/kafka-libs"
KAFKA_DIR="$STATE_DIR/kafka"
KAFKA_DATA="$KAFKA_DIR/data"
KAFKA_LOGS="$KAFKA_DIR/logs"
KAFKA_PROPS="$KAFKA_DIR/server.properties"
KAFKA_PIDFILE="$KAFKA_DIR/kafka.pid"
KAFKA_OUT="$KAFKA_LOGS/kafka.out"
KAFKA_BOOTSTRAP="127.0.0.1:9092"

CH_SRC="$REPO_ROOT/scripts/clickhouse"
CH_DIR="$STATE_DIR/clickhouse"
CH_CONF="$CH_DIR/etc/config.xml"
CH_PIDFILE="$CH_DIR/clickhouse.pid"
CH_LOGS="$CH_DIR/logs"
CH_OUT="$CH_LOGS/stdout.log"
CH_HTTP="http://127.0.0.1:8123"

ALL_SERVICES=(clickhouse kafka)

log() { printf '[services] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

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

pidfile_of() { case $1 in kafka) echo "$KAFKA_PIDFILE" ;; clickhouse) echo "$CH_PIDFILE" ;; esac; }
marker_of() { case $1 in kafka) echo "$KAFKA_PROPS" ;; clickhouse) echo "$CH_CONF" ;; esac; }
ports_of() { case $1 in kafka) echo "9092 9093 9094" ;; clickhouse) echo "8123 9000 8443" ;; esac; }

port_open() { timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# launch SVC DIR OUTFILE CMD... -- start CMD detached (own session, immune to the caller's
# Ctrl-C/hangup). The child writes its own PID before exec'ing, so the PID file holds the real
# server PID no matter whether setsid had to fork.
launch() {
  local svc="$1" dir="$2" out="$3" pidfile
  shift 3
  pidfile="$(pidfile_of "$svc")"
  rm -f "$pidfile"
  echo "==== $(date -u '+%Y-%m-%dT%H:%M:%SZ') services.sh starting $svc" >>"$out"
  (
    # fd 9 is the up/down lock: a long-lived child holding it would block every later up/down.
    exec 9>&-
    cd "$dir"
    # shellcheck disable=SC2016 # expanded by the child shell, on purpose
    nohup setsid bash -c 'echo $$ >"$0.tmp" && mv "$0.tmp" "$0" && exec "$@"' "$pidfile" "$@" \
      >>"$out" 2>&1 </dev/null &
  )
  local i
  for ((i = 0; i < 50; i++)); do
    [[ -s $pidfile ]] && return 0
    sleep 0.1
  done
  die "$svc: process did not start (no PID file); see $out"
}

# stop_svc SVC -- TERM the PID from our PID file, KILL after STOP_TIMEOUT. Never matches by name.
stop_svc() {
  local svc="$1" pid marker pidfile i
  pidfile="$(pidfile_of "$svc")"; marker="$(marker_of "$svc")"
  if ! pid="$(svc_pid "$svc")"; then
    log "$svc: not running"
    return 0
  fi
  log "$svc: stopping pid $pid"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < STOP_TIMEOUT * 10; i++)); do
    is_ours "$pid" "$marker" || break
    sleep 0.1
  done
  if is_ours "$pid" "$marker"; then
    log "$svc: still running after ${STOP_TIMEOUT}s, sending KILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      is_ours "$pid" "$marker" || break
      sleep 0.1
    done
    is_ours "$pid" "$marker" && die "$svc: pid $pid survived SIGKILL"
  fi
  rm -f "$pidfile"
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
    for svc in "${ALL_SERVICES[@]}"; do
      if svc_pid "$svc" >/dev/null 2>&1; then
        log "tls: $svc is running with the old certificate; 'services.sh restart $svc' to serve the new one"
      fi
    done
  fi
}

# --- Kafka --------------------------------------------------------------------------------------

kafka_version() { sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$KAFKA_POM"; }

# Fetch broker + tools jars once per pom content; the stamp makes warm runs skip Maven entirely.
kafka_fetch() {
  local want tmp
  want="kafka=$(kafka_version) pom=$(sha256sum "$KAFKA_POM" | cut -c1-16)"
  if [[ -f $KAFKA_LIBS/.stamp && "$(cat "$KAFKA_LIBS/.stamp")" == "$want" ]]; then
    return 0
  fi
  ensure_cmds java:openjdk-17-jre-headless mvn:maven
  log "kafka: fetching Apache Kafka $(kafka_version) jars with Maven into $KAFKA_LIBS"
  mkdir -p "$CACHE_DIR"
  # Copy into a temp dir and swap, so an interrupted download never looks complete and jars of
  # an older Kafka version never linger on the classpath.
  tmp="$KAFKA_LIBS.tmp.$$"
  rm -rf "$tmp"
  # Maven's output goes to a log (it prints colour codes even with -q); shown only on failure.
  if ! mvn -q -B -Dstyle.color=never -f "$KAFKA_POM" dependency:copy-dependencies \
    -DoutputDirectory="$tmp" -DincludeScope=runtime >"$CACHE_DIR/mvn.log" 2>&1; then
    cat "$CACHE_DIR/mvn.log" >&2
    rm -rf "$tmp"
    die "kafka: Maven could not fetch the Kafka jars"
  fi
  echo "$want" >"$tmp/.stamp"
  rm -rf "$KAFKA_LIBS"
  mv "$tmp" "$KAFKA_LIBS"
}

# kafka_cli CLASS ARGS... -- run a Kafka tool class with quiet (stderr, WARN) logging.
kafka_cli() {
  java -Dlog4j2.configurationFile="$KAFKA_SRC/tools-log4j2.xml" -cp "$KAFKA_LIBS/*" "$@"
}

kafka_prepare() {
  ensure_cmds java:openjdk-17-jre-headless
  check_java
  kafka_fetch
  tls_ensure
  mkdir -p "$KAFKA_DATA" "$KAFKA_LOGS"
  # Rendered on every start so template edits apply; node/cluster ids stay, so data stays valid.
  sed -e "s#@KAFKA_DATA_DIR@#$KAFKA_DATA#g" -e "s#@TLS_DIR@#$TLS_DIR#g" \
    "$KAFKA_SRC/server.properties.in" >"$KAFKA_PROPS.tmp"
  mv "$KAFKA_PROPS.tmp" "$KAFKA_PROPS"
  cp "$KAFKA_SRC/log4j2.xml" "$KAFKA_DIR/log4j2.xml"
  # KRaft log dirs must be formatted once with a cluster id; --standalone makes this node the
  # sole controller voter (dynamic quorum, matches controller.quorum.bootstrap.servers).
  if [[ ! -f $KAFKA_DATA/meta.properties ]]; then
    local cluster_id
    if [[ ! -s $KAFKA_DIR/cluster.id ]]; then
      kafka_cli kafka.tools.StorageTool random-uuid >"$KAFKA_DIR/cluster.id" ||
        die "kafka: cannot run Kafka's StorageTool; if the jar cache is broken, delete $KAFKA_LIBS"
    fi
    cluster_id="$(cat "$KAFKA_DIR/cluster.id")"
    log "kafka: formatting storage (cluster id $cluster_id)"
    if ! kafka_cli kafka.tools.StorageTool format -t "$cluster_id" -c "$KAFKA_PROPS" --standalone \
      >"$KAFKA_LOGS/format.log" 2>&1; then
      cat "$KAFKA_LOGS/format.log" >&2
      die "kafka: storage format failed"
    fi
  fi
}

kafka_launch() {
  # shellcheck disable=SC2086 # heap opts are intentionally word-split
  launch kafka "$KAFKA_DIR" "$KAFKA_OUT" \
    java $KAFKA_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent \
    -Djava.awt.headless=true \
    -Dkafka.logs.dir="$KAFKA_LOGS" -Dlog4j2.configurationFile="$KAFKA_DIR/log4j2.xml" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$KAFKA_PROPS"
}

# Ready = port open and an admin request (list topics) round-trips, i.e. broker + controller work.
kafka_ready() {
  port_open 9092 || return 1
  [[ -d $KAFKA_LIBS ]] || return 1
  # timeout: the admin client retries forever against a broker that accepts but doesn't answer.
  timeout 30 java -Dlog4j2.configurationFile="$KAFKA_SRC/tools-log4j2.xml" -cp "$KAFKA_LIBS/*" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" --list >/dev/null 2>&1
}

# Process stdout/stderr last: JVM/startup errors land there, and the last lines shown matter most.
kafka_logfiles() { echo "$KAFKA_LOGS/server.log $KAFKA_OUT"; }

# --- ClickHouse ---------------------------------------------------------------------------------

ch_bin() { command -v clickhouse-server 2>/dev/null || echo /usr/sbin/clickhouse-server; }

clickhouse_prepare() {
  ensure_cmds curl:curl clickhouse-server:clickhouse-server clickhouse-client:clickhouse-client
  tls_ensure
  mkdir -p "$CH_DIR/etc" "$CH_DIR/data" "$CH_DIR/tmp" "$CH_DIR/user_files" "$CH_DIR/format_schemas" "$CH_LOGS"
  # 18.16 can't take paths from env vars: render the template with the state dir substituted.
  sed -e "s#@CH_STATE_DIR@#$CH_DIR#g" -e "s#@TLS_DIR@#$TLS_DIR#g" "$CH_SRC/config.xml" >"$CH_CONF.tmp"
  mv "$CH_CONF.tmp" "$CH_CONF"
  cp "$CH_SRC/users.xml" "$CH_DIR/etc/users.xml"
}

# Run in the foreground of its own session instead of --daemon: --daemon sends early startup
# errors (e.g. a bad config) to /dev/null, and works as root either way on 18.16.
clickhouse_launch() {
  launch clickhouse "$CH_DIR" "$CH_OUT" "$(ch_bin)" --config-file="$CH_CONF"
}

clickhouse_ready() {
  [[ "$(curl -fsS --max-time 2 "$CH_HTTP/ping" 2>/dev/null)" == "Ok." ]] || return 1
  [[ "$(curl -fsS --max-time 5 "$CH_HTTP/" --data-binary 'SELECT 1' 2>/dev/null)" == "1" ]]
}

clickhouse_logfiles() { echo "$CH_LOGS/clickhouse-server.log $CH_LOGS/clickhouse-server.err.log $CH_OUT"; }

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

cmd_up() {
  local svc rc=0
  for svc in "$@"; do svc_prepare "$svc"; done
  for svc in "$@"; do svc_launch "$svc"; done
  for svc in "$@"; do svc_await "$svc" || rc=1; done
  return $rc
}

cmd_down() {
  local wipe="$1" svc
  shift
  for svc in "$@"; do
    stop_svc "$svc"
    if [[ $wipe == 1 ]]; then
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
      kafka | clickhouse) svc="$1" ;;
      *) usage ;;
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
    [[ $s == kafka || $s == clickhouse ]] || { log "unknown service: $s"; usage; }
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
  local cmd="${1:-}"
  [[ $# -gt 0 ]] && shift
  case $cmd in
    up)
      take_lock
      # shellcheck disable=SC2046
      cmd_up $(parse_services "$@")
      ;;
    down)
      local wipe=0
      if [[ ${1:-} == --wipe ]]; then wipe=1; shift; fi
      take_lock
      # shellcheck disable=SC2046
      cmd_down "$wipe" $(parse_services "$@")
      ;;
    restart)
      take_lock
      local svcs
      svcs="$(parse_services "$@")"
      # shellcheck disable=SC2086
      cmd_down 0 $svcs
      # shellcheck disable=SC2086
      cmd_up $svcs
      ;;
    status)
      # shellcheck disable=SC2046
      cmd_status $(parse_services "$@")
      ;;
    logs) cmd_logs "$@" ;;
    pid)
      [[ $# -eq 1 ]] || usage
      svc_pid "$(parse_services "$1")"
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
