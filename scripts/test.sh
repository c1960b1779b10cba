#!/usr/bin/env bash
# The whole test suite: installs what is missing (Debian packages), starts private Redis (also
# Sentinel, Cluster and Redlock topologies and a TLS server), etcd, ZooKeeper and PostgreSQL
# instances (also with TLS and SASL) on loopback, runs every test against them, the fencing and
# election demos on every backend and the fault matrix (scripts/faults.sh), stops them.
# Extra arguments go to `cargo test` (e.g. scripts/test.sh -- contract_name_filter); the demos and
# the fault matrix still run in full (about 4.5 minutes) and rewrite docs/faults.md.
# -h or --help prints this and starts nothing.
set -euo pipefail
for arg in "$@"; do
  case $arg in
    --) break ;;
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
log=$(mktemp)
trap 'scripts/servers.sh stop; rm -f "$log"' EXIT
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a

fail() {
  echo "---- server logs ----"
  scripts/servers.sh logs || true
  # Last, so a log that keeps only the tail still names what failed.
  echo "---- what failed ----"
  # A panic's message follows its "panicked at" line: keep its first three lines too.
  awk '/panicked at/ { after = 4 }
       /FAILED|^---- .* stdout ----$|^error(\[|:)/ || after-- > 0 { if (!seen[$0]++) print substr($0, 1, 400) }' \
    "$log" | head -n 80 || true
  exit 1
}

# Every step has a time limit well inside CI's 90 minutes, so a hang (a server stuck on a full
# disk, say) is reported with the server logs instead of killing the whole job silently.
# --no-fail-fast: one failing test binary does not hide the others' results.
failed=0
timeout -k 10 50m cargo test --workspace --all-features --no-fail-fast "$@" 2>&1 | tee "$log" || failed=1

# The examples as `cargo test --workspace --all-features` built them (a `cargo run` without
# `--workspace` resolves features differently and would rebuild lockkit for minutes).
cargo build -q --workspace --all-features --examples || failed=1
examples="${CARGO_TARGET_DIR:-target}/debug/examples"

# The fencing demo, on the embedded default and on every real server: the stale write and the
# write with another lock's token must be rejected.
for url in memory:// "$LOCKKIT_REDIS_URL" "$LOCKKIT_REDIS_SENTINEL_URL" "$LOCKKIT_REDLOCK_URL" "$LOCKKIT_REDIS_CLUSTER_URL" "$LOCKKIT_ETCD_URL" "$LOCKKIT_ZK_URL" "$LOCKKIT_POSTGRES_URL"; do
  if ! out=$(timeout -k 5 120 "$examples/fencing" --backend "$url" 2>&1); then
    echo "$out"; echo "fencing demo on ${url%%://*}: FAILED" | tee -a "$log"; failed=1; continue
  fi
  if grep -q "REJECTED A's write" <<<"$out" && grep -q "REJECTED C's write" <<<"$out"; then
    echo "fencing demo on ${url%%://*}: stale and foreign writes rejected"
  else
    echo "$out"; echo "fencing demo on ${url%%://*}: stale or foreign write not rejected, FAILED" | tee -a "$log"; failed=1
  fi
done

# The election and semaphore example of the README, on every backend.
for url in memory:// "$LOCKKIT_POSTGRES_URL" "$LOCKKIT_ETCD_URL" "$LOCKKIT_REDIS_URL" "$LOCKKIT_REDIS_SENTINEL_URL" "$LOCKKIT_ZK_URL"; do
  if ! out=$(timeout -k 5 120 "$examples/election" --backend "$url" 2>&1); then
    echo "$out"; echo "election example on ${url%%://*}: FAILED" | tee -a "$log"; failed=1
  fi
done

# The fault matrix (its own private servers; writes docs/faults.md): a failing cell fails the run.
LOCKKIT_FAULTS_BUILT=1 timeout -k 10 25m scripts/faults.sh || { echo "fault matrix (scripts/faults.sh): FAILED" | tee -a "$log"; failed=1; }

if [ "$failed" != 0 ]; then
  echo "scripts/test.sh: FAILED (see above)"
  fail
fi

echo "scripts/test.sh: all tests passed; the fencing demo rejected the stale and foreign writes on every backend"
