# PostgreSQL for scripts/services.sh, which sources this file: its settings and its
# prepare/launch/ready/logfiles steps. Run services.sh, not this file.
#
# PostgreSQL: Debian's postgresql-15, its own cluster (not Debian's "main"), 127.0.0.1:5432 only,
#        wal_level=logical, 16 replication slots / WAL senders (scripts/postgres/postgresql.conf.in).
#        Role tally / password tally-secret (LOGIN REPLICATION, scram-sha-256 over TCP, also for
#        replication connections), owner of database tally:
#          psql "host=127.0.0.1 port=5432 dbname=tally user=tally password=tally-secret"
#          jdbc:postgresql://127.0.0.1:5432/tally
#        The superuser postgres has no password: peer login on a private Unix socket, for this script.
#        PostgreSQL refuses to run as root, so initdb and the server run as the postgres OS user
#        (setpriv; the package creates that user). The postgres user can't reach a state dir inside a
#        0700 home (/root, or a bookworm user's home), and a non-root caller couldn't delete files the
#        postgres user owns, so the cluster lives outside the state dir, in a directory owned by
#        postgres: /var/lib/postgresql/tally-<first 12 hex of sha256(state dir path)>/ ("pg root":
#        data/, run/ (socket), postgresql.conf, pg_hba.conf, cluster.id). <state>/postgres holds the
#        log, the PID file and cluster.id, which must match the pg root's or the cluster is re-created
#        (so deleting the state dir also means a fresh database). 'down --wipe postgres' deletes both.
#        When this script installs postgresql-15 itself it first drops
#        /etc/postgresql-common/createcluster.d/tally.conf (create_main_cluster = false), so Debian's
#        own "main" cluster, which would take port 5432, is not created. If one already runs on 5432:
#        pg_ctlcluster 15 main stop.

PG_SRC="$REPO_ROOT/scripts/postgres"
PG_BIN="/usr/lib/postgresql/15/bin"
PG_DIR="$STATE_DIR/postgres"
PG_LOGS="$PG_DIR/logs"
PG_OUT="$PG_LOGS/postgres.log"
PG_PIDFILE="$PG_DIR/postgres.pid"
# The cluster itself, owned by the postgres OS user, outside the state dir (see the header).
PG_ROOT="${TALLY_POSTGRES_ROOT:-/var/lib/postgresql/tally-$(realpath -m "$STATE_DIR" | tr -d '\n' | sha256sum | cut -c1-12)}"
PG_DATA="$PG_ROOT/data"
PG_RUN="$PG_ROOT/run"
PG_CONF="$PG_ROOT/postgresql.conf"
# Test-only secret, documented in the header above.
PG_CONNINFO="host=127.0.0.1 port=5432 dbname=tally user=tally password=tally-secret connect_timeout=2"

# as_postgres CMD... -- run CMD as the postgres OS user (exec, no extra process), from / so it never
# starts in a directory it can't enter.
as_postgres() {
  (cd / && as_root setpriv --reuid=postgres --regid=postgres --init-groups --reset-env -- "$@")
}

# as_root_write FILE [MODE] -- stdin into FILE (which may be inside the pg root), owned by postgres.
as_root_write() {
  local tmp
  tmp="$(mktemp "$PG_DIR/.write.XXXXXX")"
  cat >"$tmp"
  as_root install -o postgres -g postgres -m "${2:-600}" "$tmp" "$1"
  rm -f "$tmp"
}

# pg_root_ours -- the pg root is absent, empty or made by this script (so it may be deleted).
pg_root_ours() {
  as_root test -e "$PG_ROOT" || return 0
  as_root test -e "$PG_ROOT/.made-by-tally-services" && return 0
  [[ -z "$(as_root ls -A "$PG_ROOT")" ]]
}

postgres_wipe() {
  as_root test -e "$PG_ROOT" || return 0
  pg_root_ours || die "postgres: $PG_ROOT was not made by services.sh; not deleting it"
  log "postgres: wiping $PG_ROOT"
  as_root rm -rf "$PG_ROOT"
}

# pg_cluster_ensure -- initdb once, plus role and database tally. The pg root is paired with the state
# dir by a random id written into both, the pg root's copy last: a cluster from a deleted state dir
# at the same path, or from an interrupted initdb, doesn't match and is made again.
pg_cluster_ensure() {
  local want have id
  want="$(cat "$PG_DIR/cluster.id" 2>/dev/null || true)"
  have="$(as_root cat "$PG_ROOT/cluster.id" 2>/dev/null || true)"
  if [[ -n $want && $want == "$have" ]] && as_root test -s "$PG_DATA/PG_VERSION"; then
    return 0
  fi
  if as_root test -e "$PG_ROOT"; then
    pg_root_ours || die "postgres: $PG_ROOT exists but was not made by services.sh; move it away or set TALLY_POSTGRES_ROOT"
    log "postgres: $PG_ROOT is not this state dir's cluster (id ${have:-none}, want ${want:-none}): re-creating it"
    as_root rm -rf "$PG_ROOT"
  fi
  log "postgres: creating a cluster in $PG_ROOT (initdb; role tally, database tally)"
  as_root install -d -o postgres -g postgres -m 700 "$PG_ROOT" "$PG_RUN"
  as_root touch "$PG_ROOT/.made-by-tally-services"
  rm -f "$PG_DIR/cluster.id"
  # No password for the superuser: peer login on the private socket only (pg_hba.conf).
  if ! as_postgres "$PG_BIN/initdb" -D "$PG_DATA" -U postgres -E UTF8 --no-locale \
    --auth-local=peer --auth-host=scram-sha-256 >"$PG_LOGS/initdb.log" 2>&1; then
    cat "$PG_LOGS/initdb.log" >&2
    die "postgres: initdb failed"
  fi
  # Role and database in single-user mode, before the server ever listens. One statement per line.
  # scram-sha-256 is PostgreSQL 15's default password_encryption.
  if ! printf '%s\n' "CREATE ROLE tally LOGIN REPLICATION PASSWORD 'tally-secret';" \
    "CREATE DATABASE tally OWNER tally;" |
    as_postgres "$PG_BIN/postgres" --single -D "$PG_DATA" postgres >>"$PG_LOGS/initdb.log" 2>&1 ||
    grep -qE '(ERROR|FATAL|PANIC): ' "$PG_LOGS/initdb.log"; then
    cat "$PG_LOGS/initdb.log" >&2
    die "postgres: creating role and database tally failed"
  fi
  id="$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
  printf '%s\n' "$id" | as_root_write "$PG_ROOT/cluster.id" 644
  printf '%s\n' "$id" >"$PG_DIR/cluster.id"
}

postgres_prepare() {
  if [[ ! -x $PG_BIN/postgres ]]; then
    # Debian's package would create (and on a systemd machine start) a cluster "main" on port 5432.
    as_root mkdir -p /etc/postgresql-common/createcluster.d
    printf '%s\n' "# scripts/services.sh (tally): no default cluster, tally runs its own on 5432." \
      "create_main_cluster = false" | as_root tee /etc/postgresql-common/createcluster.d/tally.conf >/dev/null
    ensure_cmds "$PG_BIN/postgres:postgresql-15"
  fi
  ensure_cmds setpriv:util-linux
  getent passwd postgres >/dev/null || die "postgres: no 'postgres' OS user (the postgresql-15 package makes it)"
  mkdir -p "$PG_LOGS"
  pg_cluster_ensure
  # Rendered on every start so template edits apply (the cluster stays).
  sed -e "s#@PG_DATA@#$PG_DATA#g" -e "s#@PG_RUN@#$PG_RUN#g" -e "s#@PG_ROOT@#$PG_ROOT#g" \
    "$PG_SRC/postgresql.conf.in" | as_root_write "$PG_CONF"
  as_root_write "$PG_ROOT/pg_hba.conf" <"$PG_SRC/pg_hba.conf"
  # The socket directory may be gone (e.g. an older pg root); the server doesn't create it.
  as_root install -d -o postgres -g postgres -m 700 "$PG_RUN"
}

# The postmaster itself as the postgres user, in the foreground of its own session (setpriv execs,
# so the PID file holds the postmaster's PID); its stderr log goes to $PG_OUT.
postgres_launch() {
  launch --as-root postgres "$PG_DIR" "$PG_OUT" \
    setpriv --reuid=postgres --regid=postgres --init-groups --reset-env -- \
    "$PG_BIN/postgres" -D "$PG_DATA" -c config_file="$PG_CONF"
}

# Ready = the application role logs in over TCP with its password and runs a query.
postgres_ready() {
  [[ -x $PG_BIN/psql ]] || return 1
  [[ "$(timeout 10 "$PG_BIN/psql" -X "$PG_CONNINFO" -tAc 'SELECT 1' 2>/dev/null)" == "1" ]]
}

postgres_logfiles() { echo "$PG_OUT"; }
