# Sourced by the scripts: one build cache for every clone on this machine, outside the clone,
# so RocksDB's and librdkafka's C/C++ are compiled once (a cold build takes ~15-25 minutes).
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/tally/target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
TALLY_BIN="$CARGO_TARGET_DIR/debug/tally"
