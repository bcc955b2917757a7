# ZooKeeper for scripts/services.sh (the cluster set: `up --cluster`), which sources this file: its
# settings and its prepare/launch/ready/logfiles steps. Run services.sh, not this file.
#
# ZooKeeper: Debian's `zookeeper` package, one standalone server on 127.0.0.1:2181, for the
# replicated ClickHouse (ReplicatedMergeTree and ON CLUSTER DDL). ../shared notes: a ClickHouse
# started before ZooKeeper accepts sessions crashed on its first ON CLUSTER query, so `ready` waits
# for `srvr` to report a mode, not for `ruok`.

ZK_SRC="$REPO_ROOT/scripts/zookeeper"
ZK_DIR="$STATE_DIR/zookeeper"
ZK_CONF="$ZK_DIR/zoo.cfg"
ZK_PIDFILE="$ZK_DIR/zookeeper.pid"
ZK_LOGS="$ZK_DIR/logs"
ZK_OUT="$ZK_LOGS/zookeeper.out"
ZK_PORT=2181
ZK_HEAP_OPTS="${TALLY_ZOOKEEPER_HEAP_OPTS:--Xms64m -Xmx256m}"

zookeeper_prepare() {
  ensure_cmds java:openjdk-17-jre-headless
  [[ -f /usr/share/java/zookeeper.jar ]] || {
    log "installing zookeeper with apt-get"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends zookeeper >/dev/null
  }
  mkdir -p "$ZK_DIR/data" "$ZK_LOGS"
  sed -e "s#@ZK_DATA@#$ZK_DIR/data#g" -e "s#@ZK_PORT@#$ZK_PORT#g" "$ZK_SRC/zoo.cfg.in" >"$ZK_CONF.tmp"
  mv "$ZK_CONF.tmp" "$ZK_CONF"
  cp "$ZK_SRC/log4j.properties" "$ZK_DIR/log4j.properties"
}

zookeeper_launch() {
  # shellcheck disable=SC2086 # heap opts are intentionally word-split
  launch zookeeper "$ZK_DIR" "$ZK_OUT" \
    java $ZK_HEAP_OPTS -Dzookeeper.log.dir="$ZK_LOGS" -Dlog4j.configuration="file:$ZK_DIR/log4j.properties" \
    -cp "$ZK_DIR:/usr/share/java/zookeeper.jar:/usr/share/java/slf4j-log4j12.jar:/usr/share/java/log4j-1.2.jar" org.apache.zookeeper.server.ZooKeeperServerMain "$ZK_CONF"
}

# Ready once it serves sessions: `srvr` names its mode (standalone).
zookeeper_ready() {
  port_open "$ZK_PORT" || return 1
  local answer
  answer="$(timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$ZK_PORT; printf srvr >&3; cat <&3" 2>/dev/null)" || return 1
  [[ $answer == *"Mode:"* ]]
}

zookeeper_logfiles() { echo "$ZK_LOGS/zookeeper.log $ZK_OUT"; }
