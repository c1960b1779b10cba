#!/usr/bin/env bash
# The benchmark: starts private servers, runs lockbench (release build) on every backend, stops
# them. Extra arguments pick backends: scripts/bench.sh redis etcd
# LOCKBENCH_ITERS (default 2000) sets the number of measured iterations per row.
# Redis scenarios: LOCKBENCH_ROUNDS (windows per variant, default 3), LOCKBENCH_WINDOW_MS (1000),
# LOCKBENCH_HANDOFFS (samples per hand-off run, 300); LOCKBENCH_NO_SCENARIOS=1 skips them.
# LOCKBENCH_LOCKKIT_PARAMS adds URL parameters to lockkit's Redis clients (A/B runs, e.g.
# notifications=off).
# The Redis part takes about 2-3 minutes. -h or --help prints this and starts nothing.
set -euo pipefail
for arg in "$@"; do
  case $arg in
    -h | --help)
      # The comment block above, without its "# ".
      awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
      exit 0
      ;;
  esac
done
cd "$(dirname "$0")/.."

scripts/install-deps.sh
env_file=$(scripts/servers.sh start)
trap 'scripts/servers.sh stop' EXIT
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
# The scenarios (issues #11, #14) write their tables and plots here.
export LOCKBENCH_REPORT="${LOCKBENCH_REPORT:-$PWD/docs/benchmarks.md}"
# The report names the run: when it started and the commit it measured ("+ uncommitted changes"
# if the working tree differs from it).
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit + uncommitted changes"
export LOCKBENCH_RUN="started $(date -u '+%Y-%m-%d %H:%M UTC') at commit $commit"
# lockbench is a workspace package of its own (benches/lockbench), every backend on by default.
cargo bench -p lockbench --bench lockbench -- "$@"
