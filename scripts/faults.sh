#!/usr/bin/env bash
# The fault matrix (issue #15): the same faults on every backend, on private servers the harness
# starts itself (and SIGKILLs, SIGSTOPs and restarts), with holder processes and a fence service.
# Prints the backend × scenario table and writes it to docs/faults.md; exits non-zero if any cell
# fails. Needs the Debian packages of scripts/install-deps.sh and root (PostgreSQL runs as the
# `postgres` user).
#
#   scripts/faults.sh                         # every backend: redis, redis-sentinel,
#                                             # redis-cluster, redlock, etcd, zk, postgres
#   scripts/faults.sh --backends redis,etcd   # a subset: its table goes to target/faults-subset.md,
#                                             # docs/faults.md keeps the whole matrix
#   scripts/faults.sh --help                  # TTL, stress size, parallel backends
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh >/dev/null
# --workspace --all-features: the same build as scripts/test.sh's (which sets
# LOCKKIT_FAULTS_BUILT once it has built the examples), so running both builds once.
if [ -z "${LOCKKIT_FAULTS_BUILT:-}" ]; then
  cargo build -q --workspace --all-features --example faults
fi
# A subset's table would replace the whole matrix in docs/faults.md: it goes next to the build.
# An --out of the caller's wins.
out=(--out docs/faults.md)
for arg in "$@"; do
  case $arg in
    --out | --out=*)
      out=()
      break
      ;;
    --backends | --backends=*) out=(--out "${CARGO_TARGET_DIR:-target}/faults-subset.md") ;;
  esac
done
exec "${CARGO_TARGET_DIR:-target}/debug/examples/faults" run "${out[@]}" "$@"
