#!/usr/bin/env bash
# The benchmark: starts private servers, runs lockbench (release build) on every backend, stops
# them. Extra arguments pick backends: scripts/bench.sh redis etcd
# LOCKBENCH_ITERS (default 2000) sets the number of measured iterations per row.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
env_file=$(scripts/servers.sh start)
trap 'scripts/servers.sh stop' EXIT
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
cargo bench --bench lockbench --all-features -- "$@"
