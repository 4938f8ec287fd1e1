#!/bin/sh
# The one-time step before `kubectl apply -k k8s/` (docs/kubernetes.md): makes the
# certificates and passwords (with compose/init-secrets.sh, in a private temporary
# folder that is removed afterwards) and creates the Secrets the manifests mount:
#
#   etcd-tls            tls.crt, tls.key   etcd's certificate (SANs: etcd, *.etcd, and
#                                          their .NAMESPACE.svc[.cluster.local] forms)
#   etcd-ca             ca.crt             the CA every client trusts
#   etcd-peer-tls       tls.crt, tls.key, ca.crt  etcd's raft peer certificate (same SANs)
#                                          and the peers' own CA (--peer-client-cert-auth)
#   etcd-root           password           etcd's root user: the service, the init Job
#   coordinator-agents  coordinator-agent-<i>  each agent pod's etcd password
#   coordinator-tokens  tokens             the REST API's tokens (`submit`, `read`; `exec`
#                                          with EXEC_TOKEN=1)
#   coordinator-signing-key  signing-key   the service's Ed25519 key (it signs job
#                                          records and assignments): the service alone
#   coordinator-service-key  signing-key.pub  its public half: the agents
#
#   k8s/init-secrets.sh [NAMESPACE]       # AGENTS=3 (the StatefulSet's replicas)
#   DRY_RUN=1 k8s/init-secrets.sh NS      # print the Secrets as YAML instead
#   EXEC_TOKEN=1 k8s/init-secrets.sh      # an exec token too (command jobs)
#
# Nothing is committed and nothing lands in the repository. The CA's key is not kept:
# to rotate, delete the Secrets, run this again, and restart etcd, the init Job, the
# service and the agents. The API tokens:
#   kubectl get secret coordinator-tokens -o jsonpath='{.data.tokens}' | base64 -d
set -eu

here=$(cd "$(dirname "$0")" && pwd)
namespace=${1:-$(kubectl config view --minify -o 'jsonpath={..namespace}' 2>/dev/null || true)}
namespace=${namespace:-default}
agents=${AGENTS:-3}
case $agents in
  ''|*[!0-9]*) echo "AGENTS must be a number, not '$agents'" >&2; exit 2 ;;
esac

umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
svc="etcd.$namespace.svc"
sans="DNS:*.etcd,DNS:etcd.$namespace,DNS:$svc,DNS:*.$svc,DNS:$svc.cluster.local,DNS:*.$svc.cluster.local"
ETCD_SANS=$sans ETCD_PEER_SANS=$sans AGENTS=$agents EXEC_TOKEN=${EXEC_TOKEN:-} \
  "$here/../compose/init-secrets.sh" "$work/s" >/dev/null 2>&1
s=$work/s

create() {
  if [ -n "${DRY_RUN:-}" ]; then
    echo "---"
    kubectl create --namespace "$namespace" --dry-run=client -o yaml "$@"
  else
    kubectl create --namespace "$namespace" "$@"
  fi
}

create secret tls etcd-tls --cert="$s/etcd.pem" --key="$s/etcd-key.pem"
create secret generic etcd-ca --from-file=ca.crt="$s/ca.pem"
create secret generic etcd-peer-tls --from-file=tls.crt="$s/etcd-peer.pem" \
  --from-file=tls.key="$s/etcd-peer-key.pem" --from-file=ca.crt="$s/peer-ca.pem"
create secret generic etcd-root --from-file=password="$s/etcd-root-password"
set --
i=0
while [ "$i" -lt "$agents" ]; do
  set -- "$@" --from-file="coordinator-agent-$i=$s/agent-$((i + 1))-password"
  i=$((i + 1))
done
create secret generic coordinator-agents "$@"
create secret generic coordinator-tokens --from-file=tokens="$s/tokens"
create secret generic coordinator-signing-key --from-file=signing-key="$s/signing-key"
create secret generic coordinator-service-key --from-file=signing-key.pub="$s/signing-key.pub"
