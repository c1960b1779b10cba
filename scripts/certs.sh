#!/usr/bin/env bash
# Makes throwaway TLS material for the test servers with the openssl CLI, in DIR (made fresh):
#   ca.pem                      the test CA (its key ca.key signs the rest)
#   server.pem, server.key      server certificate for IP:127.0.0.1 only (so "localhost" is a
#                               name mismatch), serverAuth
#   client.pem, client.key      client certificate (CN=postgres, the PostgreSQL user), clientAuth
#   expired.pem, expired.key    server certificate for IP:127.0.0.1 that expired in 2001
#   other-ca.pem                another CA nobody trusts
#   other-client.pem/.key       client certificate signed by other-ca
# Keys are ECDSA P-256, unencrypted. Nothing here may be used outside tests.
#
#   scripts/certs.sh DIR
set -euo pipefail
d=${1:?usage: $0 DIR}
rm -rf "$d"; mkdir -p "$d"; cd "$d"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

ca() { # name, cn
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -subj "/CN=$2" -days 2 -out "$1.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
}

leaf() { # name, ca, cn, extensions
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$3" -out "$1.csr"
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

server_ext=$'basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1'
client_ext=$'basicConstraints=critical,CA:FALSE\nextendedKeyUsage=clientAuth'

ca ca "lockkit test CA"
ca other-ca "lockkit untrusted CA"
leaf server ca 127.0.0.1 "$server_ext"
leaf client ca postgres "$client_ext"
leaf other-client other-ca postgres "$client_ext"

# Expired: `openssl ca` is the CLI's way to set both validity dates.
key expired.key
openssl req -new -key expired.key -subj "/CN=127.0.0.1" -out expired.csr
mkdir -p ca-db; : > ca-db/index.txt; echo 1000 > ca-db/serial
cat > ca-db/ca.cnf <<CNF
[ca]
default_ca = test
[test]
database = ca-db/index.txt
serial = ca-db/serial
new_certs_dir = ca-db
default_md = sha256
policy = any
copy_extensions = none
[any]
commonName = supplied
[server]
$server_ext
CNF
openssl ca -batch -config ca-db/ca.cnf -cert ca.pem -keyfile ca.key -in expired.csr \
  -startdate 20000101000000Z -enddate 20010101000000Z -extensions server -out expired.pem \
  -notext 2>/dev/null
rm -rf ca-db expired.csr ./*.srl
chmod 644 ./*
