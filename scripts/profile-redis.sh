#!/usr/bin/env bash
# Where an uncontended lockkit acquire + release on one Redis server spends its time, next to the
# benchmark's floor (SET NX PX + Lua compare-and-delete) and rslock, on the same server in the
# same run (issue #11: the cause of the uncontended and one-client misses). Per sequence:
#   - client CPU per cycle: `perf stat` task-clock of a long run minus a short one (connects and
#     warm-up cancel out), repeated;
#   - the server's µs per call of every command, scripts included (`INFO commandstats`);
#   - client instructions per cycle (`valgrind --tool=callgrind`, a long run minus a short one):
#     unlike CPU time, the same on a loaded machine;
#   - the client's top symbols (`perf record`, self time, no call graph).
# Starts its own Redis (scripts/servers.sh), builds lockbench in release, writes
# docs/profile-redis.md (PROFILE_REPORT to change). PROFILE_REPS (3), PROFILE_ITERS (5000).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
-h | --help)
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
  ;;
esac

scripts/install-deps.sh
for tool in perf:linux-perf valgrind:valgrind; do
  if ! command -v "${tool%%:*}" >/dev/null; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -qq --no-install-recommends "${tool#*:}" >/dev/null
  fi
done
report="${PROFILE_REPORT:-$PWD/docs/profile-redis.md}"
reps="${PROFILE_REPS:-3}"
iters="${PROFILE_ITERS:-5000}"
short=200

dir=$(mktemp -d)
export LOCKKIT_SERVERS=redis
env_file=$(scripts/servers.sh start "$dir/servers")
trap 'scripts/servers.sh stop "$dir/servers"; rm -rf "$dir"' EXIT
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a
unset LOCKKIT_REDLOCK_URL LOCKKIT_REDIS_CLUSTER_URL
port=${LOCKKIT_REDIS_URL##*:}

# Line tables for perf's symbols; the bench profile is otherwise the benchmark's own.
export CARGO_PROFILE_BENCH_DEBUG=line-tables-only
bin=$(cargo bench -p lockbench --bench lockbench --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)

run() { # run ONLY ITERS: the bench's uncontended rows, only those whose name contains ONLY
  LOCKBENCH_ONLY="$1" LOCKBENCH_NO_SCENARIOS=1 LOCKBENCH_ITERS="$2" "$bin" redis
}
instructions() { # instructions callgrind counted in one run
  LOCKBENCH_ONLY="$1" LOCKBENCH_NO_SCENARIOS=1 LOCKBENCH_ITERS="$2" \
    valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "$bin" redis 2>&1 |
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
cpu_ms() { # task-clock in ms of one run
  LOCKBENCH_ONLY="$1" LOCKBENCH_NO_SCENARIOS=1 LOCKBENCH_ITERS="$2" \
    perf stat -x, -e task-clock "$bin" redis 2>&1 >/dev/null | awk -F, '/task-clock/ {print $1}'
}

sequences=("floor:" "lockkit acquire" "rslock")
{
  echo "# Profile: one uncontended acquire + release on one Redis server"
  echo
  echo "Written by \`scripts/profile-redis.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start, redis-server $(redis-server --version | sed 's/.*v=\([^ ]*\).*/\1/')."
  echo "Each sequence runs alone (\`LOCKBENCH_ONLY\`), $iters cycles, $reps times; the benchmark's ratios come from interleaved runs instead (docs/benchmarks.md)."
  echo
  echo "## Client CPU per cycle (µs, each repetition)"
  echo
  echo "| sequence | µs per acquire + release |"
  echo "|---|---|"
  for s in "${sequences[@]}"; do
    vals=()
    for _ in $(seq "$reps"); do
      a=$(cpu_ms "$s" "$short")
      b=$(cpu_ms "$s" "$iters")
      # Warm-up is a tenth of the iterations (lockbench's `interleaved`).
      vals+=("$(awk -v a="$a" -v b="$b" -v n="$iters" -v m="$short" \
        'BEGIN { printf "%.0f", (b - a) * 1000 / ((n - m) * 1.1) }')")
    done
    echo "| $s | ${vals[*]} |"
  done
  echo
  echo "## Client instructions per cycle (callgrind, user space only)"
  echo
  echo "| sequence | instructions per acquire + release |"
  echo "|---|---|"
  for s in "${sequences[@]}"; do
    a=$(instructions "$s" 100)
    b=$(instructions "$s" 1100)
    echo "| $s | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.0f", (b - a) / 1100 }') |"
  done
  echo
  echo "## Server time per call (\`INFO commandstats\`, one run of each)"
  echo
  echo "Scripts (\`evalsha\`) include the commands they run; those are listed too."
  for s in "${sequences[@]}"; do
    redis-cli -p "$port" CONFIG RESETSTAT >/dev/null
    median=$(run "$s" "$iters" 2>/dev/null | awk '/^redis/ {print $(NF-4), $(NF-3)}')
    echo
    echo "### $s (median cycle $median)"
    echo
    echo "| command | calls per cycle | µs per call |"
    echo "|---|---|---|"
    redis-cli -p "$port" INFO commandstats | tr -d '\r' |
      awk -F'[:,=]' -v n="$iters" '/^cmdstat_/ && $3 + 0 >= n / 2 {
        printf "| %s | %.2f | %s |\n", substr($1, 9), $3 / (n * 1.1), $7 }'
  done
  echo
  echo "## Client's top symbols (self time, lockkit acquire + release)"
  echo
  echo '```text'
  perf record -q -F 5000 -o "$dir/perf.data" -- env LOCKBENCH_ONLY="lockkit acquire" \
    LOCKBENCH_NO_SCENARIOS=1 LOCKBENCH_ITERS="$iters" "$bin" redis >/dev/null 2>&1
  perf report -i "$dir/perf.data" --no-children --sort dso --stdio 2>/dev/null |
    grep '%' | grep -v '^#' | sed 's/  */ /g' | head -5
  echo
  perf report -i "$dir/perf.data" --no-children --sort symbol --stdio 2>/dev/null |
    grep '%' | grep -v '^#' | sed 's/  */ /g' | cut -c1-120 | head -25
  echo '```'
} | tee "$report"
echo "profile-redis: wrote $report"
