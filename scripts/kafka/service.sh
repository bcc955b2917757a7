# Kafka for scripts/services.sh, which sources this file: its settings and its
# prepare/launch/ready/logfiles steps. Run services.sh, not this file.
#
# Kafka: the real Apache Kafka 4.x broker, fetched as jars from Maven Central (scripts/kafka/pom.xml),
#        KRaft combined mode on 127.0.0.1:9092 (controller 9093).

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

kafka_version() { sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$KAFKA_POM"; }

# Fetch broker + tools jars once per pom content.
kafka_fetch() {
  local want
  want="kafka=$(kafka_version) pom=$(sha256sum "$KAFKA_POM" | cut -c1-16)"
  mvn_fetch kafka "$KAFKA_LIBS" "$want" -f "$KAFKA_POM"
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

# kafka_start NAME DIR HEAP_OPTS -- a broker of DIR (its server.properties, log4j2.xml, logs/).
kafka_start() {
  local name="$1" dir="$2" heap="$3"
  # shellcheck disable=SC2086 # heap opts are intentionally word-split
  launch "$name" "$dir" "$dir/logs/kafka.out" \
    java $heap -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent \
    -Djava.awt.headless=true \
    -Dkafka.logs.dir="$dir/logs" -Dlog4j2.configurationFile="$dir/log4j2.xml" \
    -cp "$KAFKA_LIBS/*" kafka.Kafka "$dir/server.properties"
}

kafka_launch() { kafka_start kafka "$KAFKA_DIR" "$KAFKA_HEAP_OPTS"; }

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

# --- the three-broker cluster (services.sh up --cluster): kafka-1, kafka-2, kafka-3 -------------
# Broker N: PLAINTEXT 127.0.0.1:909(1+N), controller 127.0.0.1:1909(1+N); one cluster id for all.
KAFKA_CLUSTER_BOOTSTRAP="127.0.0.1:9092,127.0.0.1:9093,127.0.0.1:9094"
kafka_node_dir() { echo "$STATE_DIR/kafka-$1"; }
kafka_node_port() { echo $((9091 + $1)); }

kafka_node_prepare() {
  local n="$1" dir
  dir="$(kafka_node_dir "$n")"
  ensure_cmds java:openjdk-17-jre-headless
  check_java
  kafka_fetch
  mkdir -p "$dir/data" "$dir/logs"
  sed -e "s#@NODE_ID@#$n#g" -e "s#@PORT@#$(kafka_node_port "$n")#g" \
    -e "s#@CONTROLLER_PORT@#$((19091 + n))#g" -e "s#@KAFKA_DATA_DIR@#$dir/data#g" \
    "$KAFKA_SRC/cluster-node.properties.in" >"$dir/server.properties.tmp"
  mv "$dir/server.properties.tmp" "$dir/server.properties"
  cp "$KAFKA_SRC/log4j2.xml" "$dir/log4j2.xml"
  if [[ ! -f $dir/data/meta.properties ]]; then
    # One cluster id for the three, made once (a lock: the nodes are prepared one after another).
    if [[ ! -s $STATE_DIR/kafka-cluster.id ]]; then
      kafka_cli kafka.tools.StorageTool random-uuid >"$STATE_DIR/kafka-cluster.id" ||
        die "kafka-$n: cannot run Kafka's StorageTool; if the jar cache is broken, delete $KAFKA_LIBS"
    fi
    log "kafka-$n: formatting storage (cluster id $(cat "$STATE_DIR/kafka-cluster.id"))"
    if ! kafka_cli kafka.tools.StorageTool format -t "$(cat "$STATE_DIR/kafka-cluster.id")" \
      -c "$dir/server.properties" >"$dir/logs/format.log" 2>&1; then
      cat "$dir/logs/format.log" >&2
      die "kafka-$n: storage format failed"
    fi
  fi
}

kafka_node_launch() { kafka_start "kafka-$1" "$(kafka_node_dir "$1")" "$KAFKA_NODE_HEAP_OPTS"; }

# Ready = its port open and an admin request through it round-trips (a controller quorum answers).
kafka_node_ready() {
  local port
  port="$(kafka_node_port "$1")"
  port_open "$port" || return 1
  [[ -d $KAFKA_LIBS ]] || return 1
  timeout 30 java -Dlog4j2.configurationFile="$KAFKA_SRC/tools-log4j2.xml" -cp "$KAFKA_LIBS/*" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$port" --list >/dev/null 2>&1
}

kafka_node_logfiles() { echo "$(kafka_node_dir "$1")/logs/server.log $(kafka_node_dir "$1")/logs/kafka.out"; }
