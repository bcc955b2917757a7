# Kafka Connect (Debezium) for scripts/services.sh, which sources this file: its settings and its
# prepare/launch/ready/logfiles steps. Run services.sh, not this file.
#
# Kafka Connect: Apache Kafka's connect-runtime of the broker's version (scripts/connect/pom.xml,
#        jars in <cache>/connect-libs), distributed mode, one worker, REST on http://127.0.0.1:8083,
#        group.id tally-connect, configs/offsets/status in the topics tally-connect-configs|offsets|status
#        (RF 1), so source offsets survive a kill -9 of the JVM; offsets flushed every 1 s. JsonConverter
#        for keys and values, schemas.enable=false unless a connector overrides it. Plugins from
#        <cache>/connect-plugins/ (plugin.path): debezium-postgres/ holds Debezium's PostgreSQL
#        connector (io.debezium.connector.postgresql.PostgresConnector) and its dependencies.
#        scripts/connect/README.md shows how to register a connector. 'down --wipe connect' also
#        deletes the three internal topics (if kafka answers), i.e. every connector and its offsets.

CONNECT_SRC="$REPO_ROOT/scripts/connect"
CONNECT_POM="$CONNECT_SRC/pom.xml"
CONNECT_LIBS="$CACHE_DIR/connect-libs"
CONNECT_PLUGINS="$CACHE_DIR/connect-plugins"
DEBEZIUM_PG_PLUGIN="$CONNECT_PLUGINS/debezium-postgres"
DEBEZIUM_PG_CLASS="io.debezium.connector.postgresql.PostgresConnector"
CONNECT_DIR="$STATE_DIR/connect"
CONNECT_LOGS="$CONNECT_DIR/logs"
CONNECT_PROPS="$CONNECT_DIR/connect-distributed.properties"
CONNECT_PIDFILE="$CONNECT_DIR/connect.pid"
CONNECT_OUT="$CONNECT_LOGS/connect.out"
CONNECT_URL="http://127.0.0.1:8083"
CONNECT_TOPICS=(tally-connect-configs tally-connect-offsets tally-connect-status)

debezium_version() { sed -n 's:.*<debezium.version>\(.*\)</debezium.version>.*:\1:p' "$CONNECT_POM"; }

# The worker's classpath, always of the broker's Kafka version, and the Debezium plugin directory.
connect_fetch() {
  local pom kv
  pom="$(sha256sum "$CONNECT_POM" | cut -c1-16)"
  kv="$(kafka_version)"
  mvn_fetch connect "$CONNECT_LIBS" "kafka=$kv pom=$pom" \
    -f "$CONNECT_POM" -P worker -Dkafka.version="$kv"
  mvn_fetch connect "$DEBEZIUM_PG_PLUGIN" "debezium=$(debezium_version) pom=$pom" \
    -f "$CONNECT_POM" -P debezium-postgres
}

connect_prepare() {
  ensure_cmds java:openjdk-17-jre-headless curl:curl
  check_java
  connect_fetch
  mkdir -p "$CONNECT_LOGS"
  # Rendered on every start so template edits apply; the worker's state is in Kafka topics.
  # The brokers and the internal topics' replication of the set that runs (services.sh set_mode).
  sed -e "s#@PLUGIN_PATH@#$CONNECT_PLUGINS#g" \
    -e "s#^bootstrap.servers=.*#bootstrap.servers=$KAFKA_BOOTSTRAP#" \
    -e "s#replication.factor=1#replication.factor=$CONNECT_REPLICATION#" \
    "$CONNECT_SRC/connect-distributed.properties.in" >"$CONNECT_PROPS.tmp"
  mv "$CONNECT_PROPS.tmp" "$CONNECT_PROPS"
  cp "$CONNECT_SRC/log4j2.xml" "$CONNECT_DIR/log4j2.xml"
}

connect_launch() {
  # shellcheck disable=SC2086 # heap opts are intentionally word-split
  launch connect "$CONNECT_DIR" "$CONNECT_OUT" \
    java $CONNECT_HEAP_OPTS -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    -XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent \
    -Djava.awt.headless=true \
    -Dconnect.logs.dir="$CONNECT_LOGS" -Dlog4j2.configurationFile="$CONNECT_DIR/log4j2.xml" \
    -cp "$CONNECT_LIBS/*" org.apache.kafka.connect.cli.ConnectDistributed "$CONNECT_PROPS"
}

# Ready = the worker reports healthy (startup done: joined its group, read the config topic; KIP-1017)
# and Debezium's PostgreSQL connector is among its plugins.
connect_ready() {
  curl -fsS --max-time 5 "$CONNECT_URL/health" >/dev/null 2>&1 || return 1
  curl -fsS --max-time 5 "$CONNECT_URL/connector-plugins" 2>/dev/null | grep -qF "\"$DEBEZIUM_PG_CLASS\""
}

connect_logfiles() { echo "$CONNECT_LOGS/connect.log $CONNECT_OUT"; }

# Connectors, their configs and source offsets live in Kafka: wiping connect deletes its topics.
connect_wipe() {
  local t existing
  if ! kafka_ready; then
    log "connect: kafka is not answering; its topics ${CONNECT_TOPICS[*]} stay (wipe again with kafka up)"
    return 0
  fi
  existing="$(kafka_cli org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" --list)"
  for t in "${CONNECT_TOPICS[@]}"; do
    grep -qx "$t" <<<"$existing" || continue
    log "connect: deleting topic $t"
    kafka_cli org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" --delete --topic "$t"
  done
  # Deletion completes asynchronously; a worker started meanwhile couldn't create its topics again.
  local i left
  for ((i = 0; i < 30; i++)); do
    existing="$(kafka_cli org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BOOTSTRAP" --list)"
    left=0
    for t in "${CONNECT_TOPICS[@]}"; do grep -qx "$t" <<<"$existing" && left=1; done
    [[ $left == 0 ]] && return 0
    sleep 1
  done
  log "connect: its topics are still listed after 30 tries"
}
