#!/usr/bin/env bash
# Installs, from Debian's packages, every server and build tool the test suite needs.
# Idempotent: packages already present are not reinstalled. Needs root (or sudo).
set -euo pipefail

pkgs=(
  redis-server redis-tools            # lockkit-redis
  etcd-server etcd-client             # lockkit-etcd
  protobuf-compiler libprotobuf-dev   # build of etcd-client (tonic/prost)
  zookeeper netcat-openbsd            # lockkit-zk
  postgresql pgbouncer                # lockkit-postgres
  procps iproute2                     # ps/pkill for the test harness
  openssl                             # scripts/certs.sh: test certificates for the TLS servers
)

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The downloaded .deb files (a few hundred MB, ZooKeeper's Java among them) are not needed again:
# a small CI disk keeps the room for the build.
$SUDO apt-get clean
echo "install-deps: done"
