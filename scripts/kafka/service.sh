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
