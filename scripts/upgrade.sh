#!/usr/bin/env bash
# An upgrade in place under kills: builds the release before the state and changelog formats
# changed (a9bc64c: state format 2, changelog format 1) from this repository's history, then runs
# the chaos table with each worker's first start on that build and every later start on this one.
#   scripts/upgrade.sh [--from COMMIT] [chaos.sh options]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh

from=a9bc64c
if [ "${1:-}" = --from ]; then from=$2; shift 2; fi
if ! commit=$(git rev-parse --verify --quiet "$from^{commit}"); then
  echo "upgrade: commit $from is not in this clone's history (a shallow clone?): clone without --depth" >&2
  exit 1
fi
old="$CARGO_TARGET_DIR/upgrade/tally-$commit"
if [ ! -x "$old" ]; then
  src=$(mktemp -d)
  trap 'rm -rf "$src"' EXIT
  git archive "$commit" | tar -x -C "$src"
  # The shared target directory keeps the dependencies' builds; only tally's crates compile.
  # Its binary lands where this checkout's does, so it is moved out and this one rebuilt.
  (cd "$src" && cargo build --locked -p tally >&2)
  mkdir -p "$(dirname "$old")"
  mv "$CARGO_TARGET_DIR/debug/tally" "$old"
fi
cargo build --locked -p tally >&2
current="$CARGO_TARGET_DIR/upgrade/tally-current"
cp "$CARGO_TARGET_DIR/debug/tally" "$current"
echo "upgrade: from $commit to $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with local changes)')"
TALLY_CHAOS_BIN="$current" exec scripts/chaos.sh --upgrade-from "$old" "$@"
