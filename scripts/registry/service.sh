# the schema registry (Apicurio) for scripts/services.sh, which sources this file: its settings and its
# prepare/launch/ready/logfiles steps. Run services.sh, not this file.
#
# Schema registry: Apicurio Registry 3.3.3 (scripts/registry/pom.xml: its Quarkus distribution
#        io.apicurio:apicurio-registry-app:tar.gz:all from Maven Central, unpacked once into
#        <cache>/registry-app, run with `java -jar quarkus-run.jar`). Needs Java 21+: the first of
#        $JAVA_HOME/bin/java, /usr/lib/jvm/temurin-25-jdk-amd64, the newest /usr/lib/jvm/* and the
#        java on PATH that is 21 or newer (Debian bookworm's default java is 17, and its apt has no
#        21). HTTP on http://127.0.0.1:8081, no auth: Confluent-compatible API under
#        /apis/ccompat/v7 (what Confluent serializers use as schema.registry.url:
#        http://127.0.0.1:8081/apis/ccompat/v7), Apicurio's own under /apis/registry/v3; health and
#        metrics on the management port 127.0.0.1:9081 (not Quarkus' 9000: ClickHouse's). Storage: H2
#        in files under <state>/registry/data, so schemas and their ids survive restarts;
#        'down --wipe registry' deletes them. Settings: scripts/registry/registry.properties.in;
#        what the API answers: scripts/registry/NOTES.md.
#

REGISTRY_SRC="$REPO_ROOT/scripts/registry"
REGISTRY_POM="$REGISTRY_SRC/pom.xml"
REGISTRY_APP="$CACHE_DIR/registry-app"
REGISTRY_DIR="$STATE_DIR/registry"
REGISTRY_DATA="$REGISTRY_DIR/data"
REGISTRY_LOGS="$REGISTRY_DIR/logs"
REGISTRY_PROPS="$REGISTRY_DIR/registry.properties"
REGISTRY_PIDFILE="$REGISTRY_DIR/registry.pid"
REGISTRY_OUT="$REGISTRY_LOGS/registry.out"
REGISTRY_URL="http://127.0.0.1:8081"
# Apicurio Registry 3.x is Java 21 bytecode. The JDK this project's machines carry besides Debian's 17:
REGISTRY_JAVA_MIN=21
REGISTRY_JDK="/usr/lib/jvm/temurin-25-jdk-amd64"
REGISTRY_JAVA=""

# java_major JAVA -- the major version of a java binary (8 for 1.8.x), nothing if it doesn't run.
java_major() {
  local v
  v="$("$1" -version 2>&1 | sed -n 's/.* version "\([0-9][0-9.]*\).*/\1/p' | head -n1)"
  [[ $v == 1.* ]] && v="${v#1.}"
  echo "${v%%.*}"
}

# registry_java -- set REGISTRY_JAVA to a java of version REGISTRY_JAVA_MIN+: $JAVA_HOME's, the
# Temurin JDK of REGISTRY_JDK, the newest one under /usr/lib/jvm, the one on PATH, in that order.
registry_java() {
  local c v best="" best_v=0 tried=()
  if [[ -n ${JAVA_HOME:-} ]]; then
    v="$(java_major "$JAVA_HOME/bin/java" 2>/dev/null || true)"
    if [[ -n $v && $v -ge $REGISTRY_JAVA_MIN ]]; then
      REGISTRY_JAVA="$JAVA_HOME/bin/java"
      return 0
    fi
    log "registry: JAVA_HOME=$JAVA_HOME is not a Java $REGISTRY_JAVA_MIN+ (${v:-no bin/java}); looking further"
    tried+=("$JAVA_HOME/bin/java (${v:-none})")
  fi
  if [[ -x $REGISTRY_JDK/bin/java ]]; then
    v="$(java_major "$REGISTRY_JDK/bin/java")"
    if [[ -n $v && $v -ge $REGISTRY_JAVA_MIN ]]; then
      REGISTRY_JAVA="$REGISTRY_JDK/bin/java"
      return 0
    fi
    tried+=("$REGISTRY_JDK/bin/java (${v:-?})")
  fi
  for c in /usr/lib/jvm/*/bin/java; do
    [[ -x $c ]] || continue
    v="$(java_major "$c")"
    tried+=("$c (${v:-?})")
    if [[ -n $v && $v -ge $REGISTRY_JAVA_MIN && $v -gt $best_v ]]; then best="$c"; best_v=$v; fi
  done
  if [[ -z $best ]] && c="$(command -v java 2>/dev/null)"; then
    v="$(java_major "$c")"
    tried+=("$c (${v:-?})")
    [[ -n $v && $v -ge $REGISTRY_JAVA_MIN ]] && best="$c"
  fi
  if [[ -z $best ]]; then
    local list
    printf -v list '%s, ' "${tried[@]}"
    die "registry: Apicurio Registry needs Java $REGISTRY_JAVA_MIN or newer, found none (tried:" \
      "${list%, }). Set JAVA_HOME to a Java $REGISTRY_JAVA_MIN+ JDK/JRE, e.g. a Temurin unpacked under" \
      "/usr/lib/jvm ($REGISTRY_JDK on this project's machines); Debian bookworm's apt has no Java $REGISTRY_JAVA_MIN."
  fi
  REGISTRY_JAVA="$best"
}

registry_version() { sed -n 's:.*<registry.version>\(.*\)</registry.version>.*:\1:p' "$REGISTRY_POM"; }

# The registry's own distribution (a Quarkus fast-jar tree), unpacked once per pom content.
registry_fetch() {
  local want
  want="registry=$(registry_version) pom=$(sha256sum "$REGISTRY_POM" | cut -c1-16)"
  mvn_fetch --unpack registry "$REGISTRY_APP" "$want" -f "$REGISTRY_POM"
  [[ -f $REGISTRY_APP/quarkus-run.jar ]] ||
    die "registry: no quarkus-run.jar in $REGISTRY_APP; delete that directory to fetch it again"
}

registry_prepare() {
  ensure_cmds curl:curl
  registry_java
  registry_fetch
  mkdir -p "$REGISTRY_DATA/tmp" "$REGISTRY_LOGS"
  # Rendered on every start so template edits apply; the schemas stay in $REGISTRY_DATA.
  sed -e "s#@REGISTRY_DATA@#$REGISTRY_DATA#g" "$REGISTRY_SRC/registry.properties.in" >"$REGISTRY_PROPS.tmp"
  mv "$REGISTRY_PROPS.tmp" "$REGISTRY_PROPS"
}

# Our settings file goes in through quarkus.config.locations (and is the is_ours marker).
registry_launch() {
  log "registry: java $REGISTRY_JAVA (Java $(java_major "$REGISTRY_JAVA"))"
  # shellcheck disable=SC2086 # heap opts are intentionally word-split
  launch registry "$REGISTRY_DIR" "$REGISTRY_OUT" \
    "$REGISTRY_JAVA" $REGISTRY_HEAP_OPTS -XX:+UseG1GC -Djava.awt.headless=true \
    -Djava.io.tmpdir="$REGISTRY_DATA/tmp" -Dquarkus.config.locations="$REGISTRY_PROPS" \
    -jar "$REGISTRY_APP/quarkus-run.jar"
}

# Ready = the Confluent-compatible API answers: GET /apis/ccompat/v7/subjects is 200 with a JSON array.
registry_ready() {
  local out
  out="$(curl -sS --max-time 5 -w '\n%{http_code}' "$REGISTRY_URL/apis/ccompat/v7/subjects" 2>/dev/null)" ||
    return 1
  [[ ${out##*$'\n'} == 200 && ${out%$'\n'*} == \[*\] ]]
}

registry_logfiles() { echo "$REGISTRY_OUT"; }
