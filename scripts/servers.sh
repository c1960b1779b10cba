#!/usr/bin/env bash
# Starts (or stops) private test instances of Redis, etcd, ZooKeeper and PostgreSQL on loopback,
# each on its own free port with its own temp data dir, and writes the URLs to an env file.
#
#   scripts/servers.sh start [DIR]   # DIR defaults to target/lockkit-servers; prints the env file path
#   scripts/servers.sh stop  [DIR]   # stops only the processes this script started (by PID)
#   scripts/servers.sh logs  [DIR]   # tails every server's log
#
# The env file defines LOCKKIT_REDIS_URL, LOCKKIT_ETCD_URL, LOCKKIT_ZK_URL, LOCKKIT_POSTGRES_URL,
# and for the TLS tests LOCKKIT_TLS_DIR (certificates made by scripts/certs.sh at start),
# LOCKKIT_REDIS_TLS_URL (a TLS-only redis-server that requires client certificates),
# LOCKKIT_ETCD_TLS_URL (etcd with an https client port and --client-cert-auth),
# LOCKKIT_ZK_TLS_URL (ZooKeeper's secureClientPort, ssl.clientAuth=need),
# LOCKKIT_ZK_SASL_URL (a ZooKeeper that requires SASL DIGEST-MD5, user app / password secret) and
# LOCKKIT_POSTGRES_TLS_URL (a PostgreSQL that accepts only TLS with a client certificate).
# The server name `sentinel` starts a Redis Sentinel topology: a primary, a replica and three
# sentinels watching service `lockkit` (LOCKKIT_REDIS_SENTINEL_URL). Tests that kill a primary
# start their own topology; this one is for the contract suite.
# The server name `redlock` starts five independent redis-servers (no persistence) for Redlock
# (LOCKKIT_REDLOCK_URL, redlock://h:p,…); they are declared fresh (REDLOCK_BOOT_KEY set to 0, see
# the lockkit-redis docs, "Redlock") so that they vote at once instead of after one max_ttl.
# The server name `cluster` starts a Redis Cluster: three masters, each with one replica, on
# loopback (LOCKKIT_REDIS_CLUSTER_URL, the three masters as seeds), ready when every node says
# cluster_state:ok. Tests that migrate slots or fail a master over start their own cluster.
# Set LOCKKIT_SERVERS="redis etcd" to start a subset.
set -euo pipefail

cmd=${1:-start}
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${2:-$root/target/lockkit-servers}
servers=${LOCKKIT_SERVERS:-redis sentinel cluster redlock etcd zk postgres}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

# A free port P below 55536 whose cluster bus port P+10000 is free too (Redis Cluster).
cluster_port() {
  python3 -c '
import random, socket
while True:
    p = random.randint(20000, 45000)
    try:
        for q in (p, p + 10000):
            s = socket.socket(); s.bind(("127.0.0.1", q)); s.close()
        print(p); break
    except OSError:
        pass'
}

wait_for() { # name, tries(0.1s), command...
  local name=$1 tries=$2; shift 2
  for _ in $(seq "$tries"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  echo "servers: $name did not become ready; log:" >&2
  tail -n 30 "$dir/$name.log" >&2 || true
  return 1
}

stop_pid() { # pidfile
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    st=$(ps -o stat= -p "$pid" 2>/dev/null || true)
    case "$st" in ""|Z*) break;; esac
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$f"
}

pg_bin() { echo "/usr/lib/postgresql/$(ls /usr/lib/postgresql | sort -V | tail -n1)/bin"; }

start_redis() {
  local p; p=$(free_port)
  mkdir -p "$dir/redis"
  redis-server --bind 127.0.0.1 --port "$p" --dir "$dir/redis" --save '' --appendonly no \
    --daemonize no --logfile "$dir/redis.log" >/dev/null 2>&1 &
  echo $! > "$dir/redis.pid"
  wait_for redis 100 redis-cli -p "$p" ping
  echo "export LOCKKIT_REDIS_URL=redis://127.0.0.1:$p" >> "$dir/env"
  # TLS only (no plain port), client certificates required.
  local t="$dir/tls" tp; tp=$(free_port)
  mkdir -p "$dir/redis-tls"
  redis-server --bind 127.0.0.1 --port 0 --tls-port "$tp" --tls-cert-file "$t/server.pem" \
    --tls-key-file "$t/server.key" --tls-ca-cert-file "$t/ca.pem" --tls-auth-clients yes \
    --dir "$dir/redis-tls" --save '' --appendonly no --daemonize no \
    --logfile "$dir/redis-tls.log" >/dev/null 2>&1 &
  echo $! > "$dir/redis-tls.pid"
  wait_for redis-tls 100 redis-cli --tls --cacert "$t/ca.pem" --cert "$t/client.pem" \
    --key "$t/client.key" -h 127.0.0.1 -p "$tp" ping
  echo "export LOCKKIT_REDIS_TLS_URL='rediss://127.0.0.1:$tp?tls_ca=$t/ca.pem&tls_cert=$t/client.pem&tls_key=$t/client.key'" >> "$dir/env"
}

# Three masters and three replicas in one Redis Cluster (cluster-node-timeout 2 s).
start_cluster() {
  local ports=() p i
  for i in 1 2 3 4 5 6; do
    p=$(cluster_port); ports+=("$p")
    mkdir -p "$dir/cluster-$i"
    redis-server --bind 127.0.0.1 --port "$p" --dir "$dir/cluster-$i" --save '' --appendonly no \
      --cluster-enabled yes --cluster-config-file "$dir/cluster-$i/nodes.conf" \
      --cluster-node-timeout 2000 --daemonize no --logfile "$dir/cluster-$i.log" >/dev/null 2>&1 &
    echo $! > "$dir/cluster-$i.pid"
  done
  for i in 1 2 3 4 5 6; do wait_for "cluster-$i" 100 redis-cli -p "${ports[$((i-1))]}" ping; done
  local nodes=() seeds=""
  for p in "${ports[@]}"; do nodes+=("127.0.0.1:$p"); done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes \
    > "$dir/cluster-create.log" 2>&1 || { cat "$dir/cluster-create.log" >&2; return 1; }
  for i in 1 2 3 4 5 6; do
    wait_for "cluster-$i" 100 bash -c "redis-cli -p ${ports[$((i-1))]} cluster info | grep -q cluster_state:ok"
  done
  # The masters (create makes the first three masters), as seeds.
  for i in 0 1 2; do seeds="$seeds${seeds:+,}127.0.0.1:${ports[$i]}"; done
  echo "export LOCKKIT_REDIS_CLUSTER_URL=redis+cluster://$seeds" >> "$dir/env"
}

# A primary, its replica and three sentinels (quorum 2) on loopback, for service `lockkit`.
start_sentinel() {
  local m r; m=$(free_port); r=$(free_port)
  mkdir -p "$dir/sentinel-primary" "$dir/sentinel-replica"
  redis-server --bind 127.0.0.1 --port "$m" --dir "$dir/sentinel-primary" --save '' \
    --appendonly no --repl-diskless-sync-delay 0 --daemonize no \
    --logfile "$dir/sentinel-primary.log" >/dev/null 2>&1 &
  echo $! > "$dir/sentinel-primary.pid"
  wait_for sentinel-primary 100 redis-cli -p "$m" ping
  redis-server --bind 127.0.0.1 --port "$r" --dir "$dir/sentinel-replica" --save '' \
    --appendonly no --repl-diskless-sync-delay 0 --replicaof 127.0.0.1 "$m" --daemonize no \
    --logfile "$dir/sentinel-replica.log" >/dev/null 2>&1 &
  echo $! > "$dir/sentinel-replica.pid"
  wait_for sentinel-replica 100 bash -c "redis-cli -p $r info replication | grep -q master_link_status:up"
  local hosts="" i s
  for i in 1 2 3; do
    s=$(free_port)
    mkdir -p "$dir/sentinel-$i"
    # A fresh writable config per run: sentinel rewrites its file.
    cat > "$dir/sentinel-$i/sentinel.conf" <<CONF
port $s
bind 127.0.0.1
dir $dir/sentinel-$i
logfile $dir/sentinel-$i.log
sentinel monitor lockkit 127.0.0.1 $m 2
sentinel down-after-milliseconds lockkit 1000
sentinel failover-timeout lockkit 2000
sentinel known-replica lockkit 127.0.0.1 $r
CONF
    redis-server "$dir/sentinel-$i/sentinel.conf" --sentinel --daemonize no >/dev/null 2>&1 &
    echo $! > "$dir/sentinel-$i.pid"
    wait_for "sentinel-$i" 100 bash -c "redis-cli -p $s sentinel get-master-addr-by-name lockkit | grep -q $m"
    hosts="$hosts${hosts:+,}127.0.0.1:$s"
  done
  echo "export LOCKKIT_REDIS_SENTINEL_URL=redis+sentinel://$hosts/lockkit" >> "$dir/env"
}

start_redlock() {
  local hosts="" i p
  for i in 1 2 3 4 5; do
    p=$(free_port)
    mkdir -p "$dir/redlock-$i"
    redis-server --bind 127.0.0.1 --port "$p" --dir "$dir/redlock-$i" --save '' --appendonly no \
      --daemonize no --logfile "$dir/redlock-$i.log" >/dev/null 2>&1 &
    echo $! > "$dir/redlock-$i.pid"
    wait_for "redlock-$i" 100 redis-cli -p "$p" ping
    # A brand-new node with no leases on it: it may vote at once (no delayed restart).
    redis-cli -p "$p" set lockkit-redlock:boot 0 >/dev/null
    hosts="$hosts${hosts:+,}127.0.0.1:$p"
  done
  echo "export LOCKKIT_REDLOCK_URL=redlock://$hosts" >> "$dir/env"
}

start_etcd() {
  local c pp; c=$(free_port); pp=$(free_port)
  # tmpfs-backed data dir where available: etcd fsyncs every write.
  local data="$dir/etcd-data"
  [ -d /dev/shm ] && data=$(mktemp -d /dev/shm/lockkit-etcd.XXXXXX) && echo "$data" > "$dir/etcd.datadir"
  etcd --name n1 --data-dir "$data" \
    --listen-client-urls "http://127.0.0.1:$c" --advertise-client-urls "http://127.0.0.1:$c" \
    --listen-peer-urls "http://127.0.0.1:$pp" --initial-advertise-peer-urls "http://127.0.0.1:$pp" \
    --initial-cluster "n1=http://127.0.0.1:$pp" --initial-cluster-state new \
    --heartbeat-interval 10 --election-timeout 100 \
    --logger zap --log-outputs stderr --log-level warn > "$dir/etcd.log" 2>&1 &
  echo $! > "$dir/etcd.pid"
  wait_for etcd 150 env ETCDCTL_API=3 etcdctl --endpoints="http://127.0.0.1:$c" endpoint health
  echo "export LOCKKIT_ETCD_URL=etcd://127.0.0.1:$c" >> "$dir/env"
  # TLS client port, client certificates required (--client-cert-auth).
  local t="$dir/tls" tc tpp; tc=$(free_port); tpp=$(free_port)
  local tdata="$dir/etcd-tls-data"
  [ -d /dev/shm ] && tdata=$(mktemp -d /dev/shm/lockkit-etcd-tls.XXXXXX) && echo "$tdata" > "$dir/etcd-tls.datadir"
  etcd --name t1 --data-dir "$tdata" \
    --listen-client-urls "https://127.0.0.1:$tc" --advertise-client-urls "https://127.0.0.1:$tc" \
    --cert-file "$t/server.pem" --key-file "$t/server.key" --client-cert-auth --trusted-ca-file "$t/ca.pem" \
    --listen-peer-urls "http://127.0.0.1:$tpp" --initial-advertise-peer-urls "http://127.0.0.1:$tpp" \
    --initial-cluster "t1=http://127.0.0.1:$tpp" --initial-cluster-state new \
    --heartbeat-interval 10 --election-timeout 100 \
    --logger zap --log-outputs stderr --log-level warn > "$dir/etcd-tls.log" 2>&1 &
  echo $! > "$dir/etcd-tls.pid"
  wait_for etcd-tls 150 env ETCDCTL_API=3 etcdctl --endpoints="https://127.0.0.1:$tc" \
    --cacert "$t/ca.pem" --cert "$t/client.pem" --key "$t/client.key" endpoint health
  echo "export LOCKKIT_ETCD_TLS_URL='etcds://127.0.0.1:$tc?tls_ca=$t/ca.pem&tls_cert=$t/client.pem&tls_key=$t/client.key'" >> "$dir/env"
}

# A ZooKeeper that requires SASL DIGEST-MD5 (enforce.auth.schemes=sasl: a client without it,
# or with a wrong password, is refused). Launched first, awaited by wait_zk_sasl, so that its JVM
# starts while the others do.
launch_zk_sasl() {
  local p; p=$(free_port)
  mkdir -p "$dir/zk-sasl-data"
  cat > "$dir/zk-sasl-jaas.conf" <<JAAS
Server {
  org.apache.zookeeper.server.auth.DigestLoginModule required
  user_app="secret";
};
JAAS
  cat > "$dir/zoo-sasl.cfg" <<CFG
tickTime=500
minSessionTimeout=1000
maxSessionTimeout=60000
dataDir=$dir/zk-sasl-data
clientPortAddress=127.0.0.1
clientPort=$p
admin.enableServer=false
4lw.commands.whitelist=ruok
forceSync=no
authProvider.1=org.apache.zookeeper.server.auth.SASLAuthenticationProvider
enforce.auth.enabled=true
enforce.auth.schemes=sasl
CFG
  ZOO_LOG_DIR="$dir" ZOO_LOG4J_PROP="WARN,CONSOLE" \
    SERVER_JVMFLAGS="-Djava.security.auth.login.config=$dir/zk-sasl-jaas.conf" \
    /usr/share/zookeeper/bin/zkServer.sh start-foreground "$dir/zoo-sasl.cfg" > "$dir/zk-sasl.log" 2>&1 &
  echo $! > "$dir/zk-sasl.pid"
  echo "$p" > "$dir/zk-sasl.port"
}

wait_zk_sasl() {
  local p; p=$(cat "$dir/zk-sasl.port")
  wait_for zk-sasl 300 bash -c "[ \"\$(echo ruok | timeout 2 nc -w 2 -q 1 127.0.0.1 $p)\" = imok ]"
  echo "export LOCKKIT_ZK_SASL_URL='zk://app:secret@127.0.0.1:$p?sasl=digest-md5'" >> "$dir/env"
}

start_zk() {
  launch_zk_sasl
  local p; p=$(free_port)
  mkdir -p "$dir/zk-data"
  cat > "$dir/zoo.cfg" <<CFG
tickTime=500
minSessionTimeout=1000
maxSessionTimeout=60000
dataDir=$dir/zk-data
clientPortAddress=127.0.0.1
clientPort=$p
admin.enableServer=false
4lw.commands.whitelist=ruok,srvr,stat,mntr,conf,cons,wchc,wchs
forceSync=no
CFG
  ZOO_LOG_DIR="$dir" ZOO_LOG4J_PROP="WARN,CONSOLE" \
    /usr/share/zookeeper/bin/zkServer.sh start-foreground "$dir/zoo.cfg" > "$dir/zk.log" 2>&1 &
  echo $! > "$dir/zk.pid"
  wait_for zk 300 bash -c "[ \"\$(echo ruok | timeout 2 nc -w 2 -q 1 127.0.0.1 $p)\" = imok ]"
  echo "export LOCKKIT_ZK_URL=zk://127.0.0.1:$p" >> "$dir/env"
  # TLS: a secureClientPort served by Netty, client certificates required. Started with java
  # directly: Debian's zkServer.sh classpath lacks the Netty codec jars.
  local t="$dir/tls" tp sp j=/usr/share/java; tp=$(free_port); sp=$(free_port)
  mkdir -p "$dir/zk-tls-data"
  cat "$t/server.pem" "$t/server.key" > "$dir/zk-tls-keystore.pem"
  cat > "$dir/zoo-tls.cfg" <<CFG
tickTime=500
minSessionTimeout=1000
maxSessionTimeout=60000
dataDir=$dir/zk-tls-data
clientPortAddress=127.0.0.1
clientPort=$tp
secureClientPortAddress=127.0.0.1
secureClientPort=$sp
serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory
ssl.keyStore.location=$dir/zk-tls-keystore.pem
ssl.keyStore.type=PEM
ssl.trustStore.location=$t/ca.pem
ssl.trustStore.type=PEM
ssl.clientAuth=need
admin.enableServer=false
4lw.commands.whitelist=ruok
forceSync=no
CFG
  local cp=/etc/zookeeper/conf
  for jar in zookeeper netty-codec netty-handler netty-transport netty-buffer netty-common \
    netty-resolver netty-transport-native-unix-common netty-transport-native-epoll slf4j-api \
    log4j-1.2 slf4j-log4j12 jackson-databind jackson-core jackson-annotations; do
    cp="$cp:$j/$jar.jar"
  done
  java -cp "$cp" org.apache.zookeeper.server.quorum.QuorumPeerMain "$dir/zoo-tls.cfg" \
    > "$dir/zk-tls.log" 2>&1 &
  echo $! > "$dir/zk-tls.pid"
  wait_for zk-tls 300 bash -c "timeout 2 openssl s_client -connect 127.0.0.1:$sp -CAfile $t/ca.pem -cert $t/client.pem -key $t/client.key </dev/null 2>/dev/null | grep -q 'Verify return code: 0'"
  echo "export LOCKKIT_ZK_TLS_URL='zk://127.0.0.1:$sp?tls_ca=$t/ca.pem&tls_cert=$t/client.pem&tls_key=$t/client.key'" >> "$dir/env"
  wait_zk_sasl
}

start_postgres() {
  local p bin; p=$(free_port); bin=$(pg_bin)
  local r="$dir/pg"
  install -d -o postgres -g postgres "$r"
  runuser -u postgres -- "$bin/initdb" -D "$r/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
  runuser -u postgres -- "$bin/pg_ctl" -D "$r/data" -l "$r/postgres.log" -w \
    -o "-c listen_addresses=127.0.0.1 -p $p -k $r -c fsync=off -c max_connections=300" start >/dev/null
  ln -sf "$r/postgres.log" "$dir/postgres.log"
  echo "$p" > "$dir/postgres.port"
  wait_for postgres 100 pg_isready -h 127.0.0.1 -p "$p"
  echo "export LOCKKIT_POSTGRES_URL=postgres://postgres@127.0.0.1:$p/postgres" >> "$dir/env"
  # A second cluster that takes TLS connections with a client certificate only
  # (hostssl … clientcert=verify-full; plain TCP is rejected).
  local t="$dir/tls" tr="$dir/pg-tls" tp; tp=$(free_port)
  install -d -o postgres -g postgres "$tr"
  runuser -u postgres -- "$bin/initdb" -D "$tr/data" -U postgres -A trust -E UTF8 --no-sync >/dev/null
  install -o postgres -g postgres -m 600 "$t/server.pem" "$t/server.key" "$t/ca.pem" "$tr/data/"
  cat > "$tr/data/pg_hba.conf" <<HBA
local all all trust
hostssl all all 127.0.0.1/32 trust clientcert=verify-full
hostnossl all all 127.0.0.1/32 reject
HBA
  runuser -u postgres -- "$bin/pg_ctl" -D "$tr/data" -l "$tr/postgres.log" -w \
    -o "-c listen_addresses=127.0.0.1 -p $tp -k $tr -c fsync=off -c max_connections=100 -c ssl=on -c ssl_cert_file=server.pem -c ssl_key_file=server.key -c ssl_ca_file=ca.pem" start >/dev/null
  ln -sf "$tr/postgres.log" "$dir/postgres-tls.log"
  wait_for postgres-tls 100 pg_isready -h 127.0.0.1 -p "$tp"
  echo "export LOCKKIT_POSTGRES_TLS_URL='postgres://postgres@127.0.0.1:$tp/postgres?sslmode=verify-full&tls_ca=$t/ca.pem&tls_cert=$t/client.pem&tls_key=$t/client.key'" >> "$dir/env"
}

stop_postgres() {
  for d in "$dir/pg/data" "$dir/pg-tls/data"; do
    [ -d "$d" ] || continue
    runuser -u postgres -- "$(pg_bin)/pg_ctl" -D "$d" -m immediate -w stop >/dev/null 2>&1 || true
  done
}

case "$cmd" in
  start)
    "$0" stop "$dir" >/dev/null 2>&1 || true
    rm -rf "$dir"; mkdir -p "$dir"; chmod 755 "$dir"; : > "$dir/env"
    "$root/scripts/certs.sh" "$dir/tls"
    echo "export LOCKKIT_TLS_DIR=$dir/tls" >> "$dir/env"
    for s in $servers; do
      case "$s" in
        redis) start_redis;; sentinel) start_sentinel;; cluster) start_cluster;; redlock) start_redlock;; etcd) start_etcd;; zk) start_zk;; postgres) start_postgres;;
        *) echo "servers: unknown server $s" >&2; exit 2;;
      esac
    done
    echo "$dir/env"
    ;;
  stop)
    [ -d "$dir" ] || exit 0
    for s in redis redis-tls sentinel-1 sentinel-2 sentinel-3 sentinel-replica sentinel-primary \
      cluster-1 cluster-2 cluster-3 cluster-4 cluster-5 cluster-6 \
      redlock-1 redlock-2 redlock-3 redlock-4 redlock-5 etcd etcd-tls zk zk-tls zk-sasl; do stop_pid "$dir/$s.pid"; done
    stop_postgres
    for f in "$dir/etcd.datadir" "$dir/etcd-tls.datadir"; do
      if [ -f "$f" ]; then rm -rf "$(cat "$f")"; fi
    done
    ;;
  logs)
    for f in "$dir"/*.log; do [ -e "$f" ] || continue; echo "==> $f <=="; tail -n 40 "$f"; done
    ;;
  *) echo "usage: $0 start|stop|logs [DIR]" >&2; exit 2;;
esac
