# ClickHouse for scripts/services.sh, which sources this file: its settings and its
# prepare/launch/ready/logfiles steps. Run services.sh, not this file.
#
# ClickHouse: Debian's clickhouse-server (18.16 on bookworm), HTTP 127.0.0.1:8123, native 127.0.0.1:9000.

CH_SRC="$REPO_ROOT/scripts/clickhouse"
CH_DIR="$STATE_DIR/clickhouse"
CH_CONF="$CH_DIR/etc/config.xml"
CH_PIDFILE="$CH_DIR/clickhouse.pid"
CH_LOGS="$CH_DIR/logs"
CH_OUT="$CH_LOGS/stdout.log"
CH_HTTP="http://127.0.0.1:8123"

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

# --- two replicas of one shard (services.sh up --cluster): clickhouse-1, clickhouse-2 ------------
# Replica N: HTTP 127.0.0.1:812(2+N), native 901N, interserver 902N; no HTTPS (single-node only).
ch_node_dir() { echo "$STATE_DIR/clickhouse-$1"; }
ch_node_http() { echo "http://127.0.0.1:$((8122 + $1))"; }

ch_node_prepare() {
  local n="$1" dir
  dir="$(ch_node_dir "$n")"
  ensure_cmds curl:curl clickhouse-server:clickhouse-server clickhouse-client:clickhouse-client
  mkdir -p "$dir/etc/config.d" "$dir/data" "$dir/tmp" "$dir/user_files" "$dir/format_schemas" "$dir/logs"
  # The single node's config with this replica's ports and paths, and no HTTPS port.
  sed -e "s#@CH_STATE_DIR@#$dir#g" -e "s#@TLS_DIR@#$TLS_DIR#g" \
    -e "s#<http_port>8123</http_port>#<http_port>$((8122 + n))</http_port>#" \
    -e "s#<tcp_port>9000</tcp_port>#<tcp_port>$((9010 + n))</tcp_port>#" \
    -e "/<https_port>/d" "$CH_SRC/config.xml" >"$dir/etc/config.xml.tmp"
  mv "$dir/etc/config.xml.tmp" "$dir/etc/config.xml"
  sed -e "s#@REPLICA@#$n#g" -e "s#@INTERSERVER_PORT@#$((9020 + n))#g" \
    "$CH_SRC/cluster.xml.in" >"$dir/etc/config.d/cluster.xml"
  cp "$CH_SRC/users.xml" "$dir/etc/users.xml"
}

ch_node_launch() {
  local dir
  dir="$(ch_node_dir "$1")"
  launch "clickhouse-$1" "$dir" "$dir/logs/stdout.log" "$(ch_bin)" --config-file="$dir/etc/config.xml"
}

# Ready = it answers a query and sees ZooKeeper (system.zookeeper reads the root).
ch_node_ready() {
  local http
  http="$(ch_node_http "$1")"
  [[ "$(curl -fsS --max-time 2 "$http/ping" 2>/dev/null)" == "Ok." ]] || return 1
  [[ "$(curl -fsS --max-time 5 "$http/" --data-binary "SELECT count() > 0 FROM system.zookeeper WHERE path = '/'" 2>/dev/null)" == "1" ]]
}

ch_node_logfiles() {
  local dir
  dir="$(ch_node_dir "$1")"
  echo "$dir/logs/clickhouse-server.log $dir/logs/clickhouse-server.err.log $dir/logs/stdout.log"
}
