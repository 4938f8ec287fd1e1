#!/bin/sh
# The one-time step before `docker compose -f compose/compose.yaml up` (docs/compose.md):
# writes compose/secrets/ (or DIR), which git ignores and which is never built into an
# image. Run it again only to replace every secret (--force); `up` then needs `down -v`
# first, since etcd keeps the old root password in its volume.
#
#   compose/init-secrets.sh [--force] [DIR]
#
# What it writes (each file mounted into only the containers that need it):
#   ca.pem, ca-key.pem    the CA that signs etcd's certificate (the key is never mounted)
#   etcd.pem, etcd-key.pem  etcd's certificate, SANs: etcd, localhost, 127.0.0.1 (+ ETCD_SANS)
#   client.pem, client-key.pem  a client certificate for the coordinator containers, used
#                         only with compose.client-certs.yaml (etcd's --client-cert-auth)
#   etcd-root-password    etcd's root user: the init container and the service
#   agent-N-password      the etcd user of agent N (N = 1..AGENTS): that agent alone
#   job-password          the etcd user of compose/ddp.yaml's job: its members alone
#   tokens                the REST API's tokens (`submit` and `read`): the service
#
# Settings (environment): AGENTS (3), ETCD_SANS (extra names, e.g. "DNS:etcd.example,IP:10.0.0.5"),
# DAYS (825, the certificates' validity).
#
# Owners: compose mounts the files as they are, so each must be readable by the user of
# the containers that mount it: etcd runs as 65532, the coordinator containers as 10001.
# Run as root (or with sudo), the script gives each file to its reader with mode 0400.
# Otherwise it leaves them to you and says how (rootless podman: `podman unshare chown`).
set -eu

force=no
if [ "${1:-}" = "--force" ]; then force=yes; shift; fi
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/secrets}
agents=${AGENTS:-3}
days=${DAYS:-825}
etcd_uid=65532
coordinator_uid=10001

case $agents in
  ''|*[!0-9]*) echo "AGENTS must be a number, not '$agents'" >&2; exit 2 ;;
esac
if [ -e "$dir/etcd-root-password" ] && [ "$force" = no ]; then
  echo "$dir already holds secrets: keeping them (--force replaces every one)" >&2
  exit 0
fi
command -v openssl >/dev/null || { echo "openssl is needed" >&2; exit 2; }

umask 077
mkdir -p "$dir"
chmod 0700 "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Random secrets: 32 bytes each, hex (no character a shell or YAML would mangle).
secret() { openssl rand -hex 32; }

# The CA, then etcd's certificate (serverAuth for clients; clientAuth so etcdctl in the
# etcd container can use it for its health check).
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
  -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" -subj "/CN=etcd-coordinator compose CA" 2>/dev/null
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$dir/etcd-key.pem" -out "$work/etcd.csr" -subj "/CN=etcd" 2>/dev/null
sans="DNS:etcd,DNS:localhost,IP:127.0.0.1${ETCD_SANS:+,$ETCD_SANS}"
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$sans" > "$work/etcd.ext"
openssl x509 -req -in "$work/etcd.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
  -CAcreateserial -CAserial "$work/ca.srl" -days "$days" -extfile "$work/etcd.ext" \
  -out "$dir/etcd.pem" 2>/dev/null

# A client certificate (clientAuth) for etcd's --client-cert-auth (compose.client-certs.yaml).
openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout "$dir/client-key.pem" -out "$work/client.csr" -subj "/CN=etcd-coordinator" 2>/dev/null
printf 'extendedKeyUsage=clientAuth\n' > "$work/client.ext"
openssl x509 -req -in "$work/client.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
  -CAserial "$work/ca.srl" -days "$days" -extfile "$work/client.ext" \
  -out "$dir/client.pem" 2>/dev/null

secret > "$dir/etcd-root-password"
i=1
while [ "$i" -le "$agents" ]; do
  secret > "$dir/agent-$i-password"
  i=$((i + 1))
done
secret > "$dir/job-password"
printf '# written by init-secrets.sh: <role> <token>\nsubmit %s\nread %s\n' "$(secret)" "$(secret)" \
  > "$dir/tokens"

# Readers: etcd (65532) its key and certificate; uid 10001 the passwords and tokens.
# Certificates are public: 0444. The CA's key stays 0600, the invoker's, never mounted.
chmod 0444 "$dir/ca.pem" "$dir/etcd.pem" "$dir/client.pem"
chmod 0400 "$dir/etcd-key.pem" "$dir/client-key.pem" "$dir/etcd-root-password" \
  "$dir"/agent-*-password "$dir/job-password" "$dir/tokens"
if [ "$(id -u)" = 0 ]; then
  chown "$etcd_uid:$etcd_uid" "$dir/etcd-key.pem"
  chown "$coordinator_uid:$coordinator_uid" "$dir/client-key.pem" "$dir/etcd-root-password" \
    "$dir"/agent-*-password "$dir/job-password" "$dir/tokens"
  echo "secrets in $dir (owners set for the containers' users)"
else
  cat >&2 <<EOF
secrets in $dir, owned by you: the containers' users cannot read them yet. Either
  sudo chown $etcd_uid $dir/etcd-key.pem
  sudo chown $coordinator_uid $dir/client-key.pem $dir/etcd-root-password $dir/agent-*-password $dir/job-password $dir/tokens
or, with rootless podman (uids are mapped):
  podman unshare chown $etcd_uid $dir/etcd-key.pem
  podman unshare chown $coordinator_uid $dir/client-key.pem $dir/etcd-root-password $dir/agent-*-password $dir/job-password $dir/tokens
EOF
fi
echo "API tokens: $dir/tokens (the 'submit' line is the one for coordinator submit)"
