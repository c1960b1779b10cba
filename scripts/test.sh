#!/usr/bin/env bash
# The whole test suite: installs what is missing (Debian packages), starts private Redis, etcd,
# ZooKeeper and PostgreSQL instances on loopback, runs every test against them, stops them.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -- contract_name_filter).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
env_file=$(scripts/servers.sh start)
trap 'scripts/servers.sh stop' EXIT
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a

if ! cargo test --workspace --all-features "$@"; then
  echo "---- server logs ----"
  scripts/servers.sh logs || true
  exit 1
fi
