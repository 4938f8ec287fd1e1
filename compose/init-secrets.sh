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
#   peer-ca.pem, peer-ca-key.pem  a CA of its own for etcd's raft peers (the key is never
#                         mounted): a client certificate of ca.pem is no peer certificate
#   etcd-peer.pem, etcd-peer-key.pem  etcd's peer certificate (server and client), SANs:
#                         etcd, localhost, 127.0.0.1 (+ ETCD_PEER_SANS); etcd asks every
#                         peer for one (--peer-client-cert-auth): its peer port trusts what
#                         arrives, down to the user name inside a raft entry
#   etcd-root-password    etcd's root user: the init container and the service
#   agent-N-password      the etcd user of agent N (N = 1..AGENTS): that agent alone
#   job-password          the etcd user of compose/ddp.yaml's job: its members alone
#   tokens                the REST API's tokens (`submit` and `read`, and `exec` with
#                         EXEC_TOKEN=1): the service
#   signing-key           the service's Ed25519 key: it signs job records and assignments
#                         (the service alone)
#   signing-key.pub       its public half: agents run only assignments it verifies (agents)
#
# Settings (environment): AGENTS (3), ETCD_SANS (extra names, e.g. "DNS:etcd.example,IP:10.0.0.5"),
# ETCD_PEER_SANS (the same for the peer certificate), DAYS (825, the certificates' validity),
# EXEC_TOKEN (set: an `exec` token too, which runs any program on the agents).
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
command -v openssl >/dev/null || { echo "openssl is needed" >&2; exit 2; }

umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# etcd's peer CA and certificate (serverAuth and clientAuth: a peer is both). Also made
# alone for a folder an older version of this script wrote, which has none.
peer_secrets() {
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
    -keyout "$dir/peer-ca-key.pem" -out "$dir/peer-ca.pem" \
    -subj "/CN=etcd-coordinator etcd peer CA" 2>/dev/null
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$dir/etcd-peer-key.pem" -out "$work/etcd-peer.csr" -subj "/CN=etcd-peer" 2>/dev/null
  peer_sans="DNS:etcd,DNS:localhost,IP:127.0.0.1${ETCD_PEER_SANS:+,$ETCD_PEER_SANS}"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$peer_sans" \
    > "$work/etcd-peer.ext"
  openssl x509 -req -in "$work/etcd-peer.csr" -CA "$dir/peer-ca.pem" \
    -CAkey "$dir/peer-ca-key.pem" -CAcreateserial -CAserial "$work/peer-ca.srl" -days "$days" \
    -extfile "$work/etcd-peer.ext" -out "$dir/etcd-peer.pem" 2>/dev/null
  chmod 0444 "$dir/peer-ca.pem" "$dir/etcd-peer.pem"
  chmod 0400 "$dir/etcd-peer-key.pem"
  if [ "$(id -u)" = 0 ]; then chown "$etcd_uid:$etcd_uid" "$dir/etcd-peer-key.pem"; fi
}

if [ -e "$dir/etcd-root-password" ] && [ "$force" = no ]; then
  if [ ! -e "$dir/etcd-peer.pem" ]; then
    peer_secrets
    echo "$dir: made etcd's peer CA and certificate (it had none)" >&2
    [ "$(id -u)" = 0 ] || echo "  chown $etcd_uid $dir/etcd-peer-key.pem (see below)" >&2
  fi
  echo "$dir already holds secrets: keeping them (--force replaces every one)" >&2
  exit 0
fi

mkdir -p "$dir"
chmod 0700 "$dir"

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

peer_secrets

secret > "$dir/etcd-root-password"
i=1
while [ "$i" -le "$agents" ]; do
  secret > "$dir/agent-$i-password"
  i=$((i + 1))
done
secret > "$dir/job-password"
# The service signs what it writes to etcd; agents verify with the public half, which
# cannot sign (coordinator/signing.py).
openssl genpkey -algorithm ed25519 -out "$dir/signing-key" 2>/dev/null
openssl pkey -in "$dir/signing-key" -pubout -out "$dir/signing-key.pub" 2>/dev/null
{
  printf '# written by init-secrets.sh: <role> <token>\nsubmit %s\nread %s\n' "$(secret)" "$(secret)"
  # EXEC_TOKEN=1: an exec token too, for command jobs (docs/compose.md says what it may do)
  if [ -n "${EXEC_TOKEN:-}" ]; then printf 'exec %s\n' "$(secret)"; fi
} > "$dir/tokens"

# Readers: etcd (65532) its keys and certificates; uid 10001 the passwords and tokens.
# Certificates are public: 0444. The CA's key stays 0600, the invoker's, never mounted.
chmod 0444 "$dir/ca.pem" "$dir/etcd.pem" "$dir/client.pem" "$dir/signing-key.pub"
chmod 0400 "$dir/etcd-key.pem" "$dir/client-key.pem" "$dir/etcd-root-password" \
  "$dir"/agent-*-password "$dir/job-password" "$dir/tokens" "$dir/signing-key"
if [ "$(id -u)" = 0 ]; then
  chown "$etcd_uid:$etcd_uid" "$dir/etcd-key.pem"
  chown "$coordinator_uid:$coordinator_uid" "$dir/client-key.pem" "$dir/etcd-root-password" \
    "$dir"/agent-*-password "$dir/job-password" "$dir/tokens" "$dir/signing-key"
  echo "secrets in $dir (owners set for the containers' users)"
else
  cat >&2 <<EOF
secrets in $dir, owned by you: the containers' users cannot read them yet. Either
  sudo chown $etcd_uid $dir/etcd-key.pem $dir/etcd-peer-key.pem
  sudo chown $coordinator_uid $dir/client-key.pem $dir/etcd-root-password $dir/agent-*-password $dir/job-password $dir/tokens $dir/signing-key
or, with rootless podman (uids are mapped):
  podman unshare chown $etcd_uid $dir/etcd-key.pem $dir/etcd-peer-key.pem
  podman unshare chown $coordinator_uid $dir/client-key.pem $dir/etcd-root-password $dir/agent-*-password $dir/job-password $dir/tokens $dir/signing-key
EOF
fi
echo "API tokens: $dir/tokens (the 'submit' line is the one for coordinator submit)"
