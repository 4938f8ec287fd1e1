"""Which Kubernetes API and namespace the kubernetes launcher uses when the service is
given none: in a pod, its service account's; elsewhere the kubeconfig's (what kubectl
would use).
"""

from __future__ import annotations

import os
from pathlib import Path

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

#: Where a pod finds its own namespace (with its service account's token).
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def current_namespace(in_cluster_file: Path = SERVICE_ACCOUNT_NAMESPACE) -> str:
    """The namespace to launch in when none is given: the pod's own, else the kubeconfig's
    current context's, else "default" (what kubectl would use)."""
    try:
        return in_cluster_file.read_text().strip() or "default"
    except OSError:
        pass
    try:
        _, context = k8s_config.list_kube_config_contexts(_kubeconfig())
        return str((context or {}).get("context", {}).get("namespace") or "default")
    except (k8s_config.ConfigException, OSError):
        return "default"


def _kubeconfig() -> str | None:
    """$KUBECONFIG as it is now (the client reads it once, when it is imported)."""
    return os.environ.get("KUBECONFIG") or None


def default_client() -> k8s_client.ApiClient:
    """In a pod, its service account; elsewhere the kubeconfig."""
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config(_kubeconfig(), client_configuration=configuration)
        except (k8s_config.ConfigException, OSError) as exc:
            raise RuntimeError(
                "no Kubernetes API: not in a pod with a service account, and no usable "
                f"kubeconfig (KUBECONFIG or ~/.kube/config): {exc}"
            ) from None
    return k8s_client.ApiClient(configuration)
