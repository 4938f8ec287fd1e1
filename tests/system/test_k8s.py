"""The Kubernetes manifests in `k8s/` and `coordinator k8s`, checked offline.

Every manifest, as shipped and as rendered, is validated against the Kubernetes
OpenAPI schemas that the `kubernetes-validate` wheel carries, in strict mode (an
unknown or misspelt field fails). The rendered worker pod is compared with what
the image (worker_image/Dockerfile) and the worker (its environment) expect.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from coordinator.deploy import k8s

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
DOCKERFILE = ROOT / "worker_image" / "Dockerfile"

# The oldest version the pinned `kubernetes-validate>=1.30` ships, and the newest installed.
K8S_VERSIONS = sorted({"1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])})

WORKER_ENV = {
    "COORDINATOR_JOB",
    "COORDINATOR_WORLD_SIZE",
    "COORDINATOR_ETCD",
    "COORDINATOR_KIND",
    "COORDINATOR_NAMESPACE",
    "COORDINATOR_ADVERTISE_ADDRESS",
    "COORDINATOR_PORT",
    "COORDINATOR_PARAMS",
}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dockerfile() -> dict[str, Any]:
    """ENTRYPOINT and CMD (JSON arrays), USER, EXPOSE and ENV of the final stage."""
    instructions: dict[str, Any] = {"ENV": {}}
    for line in DOCKERFILE.read_text().splitlines():
        word, _, rest = line.strip().partition(" ")
        if word in ("ENTRYPOINT", "CMD"):
            instructions[word] = json.loads(rest)
        elif word in ("USER", "EXPOSE"):
            instructions[word] = rest.strip()
        elif word == "ENV":
            instructions["ENV"].update(pair.split("=", 1) for pair in rest.split())
    return instructions


def only(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return only(docs, "Job")["spec"]["template"]["spec"]


def worker(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = (c for c in pod_spec(docs)["containers"] if c["name"] == "worker")
    return container


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in container.get("env", [])}


def validate_all(docs: list[dict[str, Any]], version: str) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def coordinator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_shipped_manifest_passes_strict_schema_validation(version: str) -> None:
    docs = k8s.load()
    validate_all(docs, version)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ConfigMap", "coordinator-manifests"),
        ("Deployment", "coordinator"),
        ("Job", "coordinator-etcd-init"),
        ("NetworkPolicy", "coordinator-agents"),
        ("NetworkPolicy", "coordinator-service"),
        ("NetworkPolicy", "coordinator-workers"),
        ("NetworkPolicy", "etcd"),
        ("PersistentVolumeClaim", "coordinator-artifacts"),
        ("Role", "coordinator-launcher"),
        ("RoleBinding", "coordinator-launcher"),
        ("Service", "agents"),
        ("Service", "coordinator"),
        ("Service", "etcd"),
        ("Service", "workers"),
        ("ServiceAccount", "coordinator"),
        ("StatefulSet", "coordinator-agent"),
        ("StatefulSet", "etcd"),
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_for_four_workers_pass_strict_schema_validation(version: str) -> None:
    validate_all(k8s.render(k8s.WorkerPods(4, "demo")), version)
    validate_all(
        k8s.render(k8s.WorkerPods(4, "Demo_1", etcd="etcd.infra:2379", kind="noop")), version
    )


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_an_mnist_job_renders_valid_manifests_with_its_kind_and_parameters(version: str) -> None:
    """The documented MNIST run: 3 pods (a parameter server and two trainers)."""
    docs = k8s.render(
        k8s.WorkerPods(3, "m", image="r/etcd-coordinator:mnist", kind="mnist", params="epochs=3")
    )
    validate_all(docs, version)
    assert only(docs, "Job")["spec"]["completions"] == 3
    values = {name: var.get("value") for name, var in env(worker(docs)).items()}
    assert values["COORDINATOR_KIND"] == "mnist"
    assert values["COORDINATOR_WORLD_SIZE"] == "3"
    assert values["COORDINATOR_PARAMS"] == "epochs=3"
    assert worker(docs)["image"] == "r/etcd-coordinator:mnist"


def test_the_validator_catches_a_misspelt_field_and_a_wrong_type() -> None:
    """The schema check above can fail: strict mode rejects what a cluster would ignore."""
    job = only(k8s.render(k8s.WorkerPods(4, "demo")), "Job")
    job["spec"]["parallelizm"] = job["spec"].pop("parallelism")
    with pytest.raises(kubernetes_validate.ValidationError, match="parallelizm"):
        kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)
    job = only(k8s.render(k8s.WorkerPods(4, "demo")), "Job")
    job["spec"]["completions"] = "4"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest_file() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    files = {p.name for p in K8S.glob("*.y*ml")} - {"kustomization.yaml"}
    # The Job template is no standing object: only in the ConfigMap the service reads.
    (generated,) = kustomization["configMapGenerator"]
    assert generated["files"] == [k8s.WORKERS_FILE]
    assert set(kustomization["resources"]) == files - {k8s.WORKERS_FILE}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_builds_the_same_objects_that_load_returns() -> None:
    """`kubectl apply -k k8s/` creates exactly what `render` starts from (no cluster needed)."""
    built = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert built.returncode == 0, built.stderr

    def key(doc: dict[str, Any]) -> tuple[str, str]:
        return doc["kind"], doc["metadata"]["name"]

    assert sorted(yaml.safe_load_all(built.stdout), key=key) == sorted(k8s.load(), key=key)


def test_the_shipped_job_is_consistent_on_its_own() -> None:
    """The template as it is (`kubectl apply -f k8s/job.yaml`): N matches WORLD_SIZE."""
    docs = k8s.job_manifests()
    spec = only(docs, "Job")["spec"]
    assert spec["parallelism"] == spec["completions"] == 4
    assert env(worker(docs))["COORDINATOR_WORLD_SIZE"]["value"] == "4"


def test_render_sets_the_worker_count_of_an_indexed_job() -> None:
    for n in (1, 4, 17):
        spec = only(k8s.render(k8s.WorkerPods(n, "demo")), "Job")["spec"]
        assert spec["parallelism"] == spec["completions"] == n
        assert spec["completionMode"] == "Indexed"
        # A failed member fails the job; a restarted pod would join a broken rendezvous.
        assert spec["backoffLimit"] == 0
        assert spec["template"]["spec"]["restartPolicy"] == "Never"


def test_render_gives_the_worker_the_environment_it_needs() -> None:
    docs = k8s.render(k8s.WorkerPods(4, "demo", namespace_prefix="/team-a", kind="noop"))
    variables = env(worker(docs))
    assert set(variables) >= WORKER_ENV
    values = {name: var.get("value") for name, var in variables.items()}
    assert values["COORDINATOR_JOB"] == "demo"
    assert values["COORDINATOR_WORLD_SIZE"] == "4"
    assert values["COORDINATOR_ETCD"] == "https://etcd:2379"
    assert values["COORDINATOR_KIND"] == "noop"
    assert values["COORDINATOR_NAMESPACE"] == "/team-a"
    assert values["COORDINATOR_PARAMS"] == ""
    # Every literal env value must be a string, or the API server rejects the pod.
    assert all(isinstance(v["value"], str) for v in variables.values() if "value" in v)
    advertise = variables["COORDINATOR_ADVERTISE_ADDRESS"]
    assert "value" not in advertise
    assert advertise["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # JOB_COMPLETION_INDEX comes from Kubernetes itself; a manifest must not shadow it.
    assert "JOB_COMPLETION_INDEX" not in variables


def test_the_worker_port_matches_the_image() -> None:
    image = dockerfile()
    container = worker(k8s.render(k8s.WorkerPods(4, "demo")))
    port = env(container)["COORDINATOR_PORT"]["value"]
    assert port == image["ENV"]["COORDINATOR_PORT"] == image["EXPOSE"]
    assert [p["containerPort"] for p in container["ports"]] == [int(port)]
    service = only(k8s.render(k8s.WorkerPods(4, "demo")), "Service", "workers")
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]


def test_image_and_command_match_the_dockerfile_entrypoint() -> None:
    image = dockerfile()
    assert image["ENTRYPOINT"] == ["coordinator"] and image["CMD"] == ["worker"]
    docs = k8s.render(k8s.WorkerPods(4, "demo", image="registry.example/etcd-coordinator:0.1.0"))
    container = worker(docs)
    assert container["image"] == "registry.example/etcd-coordinator:0.1.0"
    # No command means the image's ENTRYPOINT runs; a command would replace it.
    assert container.get("command", image["ENTRYPOINT"]) == image["ENTRYPOINT"]
    assert container["args"] == image["CMD"]
    # The init container runs the same image, so a pushed tag is needed only once.
    assert {c["image"] for c in pod_spec(docs)["initContainers"]} == {container["image"]}
    assert worker(k8s.job_manifests())["image"] == k8s.DEFAULT_IMAGE


def test_the_pod_runs_as_the_image_user() -> None:
    security = pod_spec(k8s.render(k8s.WorkerPods(4, "demo")))["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == dockerfile()["USER"] == "10001"


def test_worker_pods_get_stable_names_through_a_headless_service() -> None:
    docs = k8s.render(k8s.WorkerPods(4, "demo"))
    service = only(docs, "Service", "workers")
    assert service["spec"]["clusterIP"] == "None"
    template = only(docs, "Job")["spec"]["template"]
    assert template["spec"]["subdomain"] == service["metadata"]["name"]
    selector = service["spec"]["selector"].items()
    assert selector <= template["metadata"]["labels"].items()


def test_the_bundled_etcd_is_a_statefulset_with_a_volume_and_a_headless_service() -> None:
    docs = k8s.render(k8s.WorkerPods(4, "demo"))
    service = only(docs, "Service", "etcd")
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "client": 2379,
        "peer": 2380,
    }
    statefulset = only(docs, "StatefulSet", "etcd")
    spec = statefulset["spec"]
    assert spec["serviceName"] == "etcd" and spec["replicas"] == 1
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    (container,) = spec["template"]["spec"]["containers"]
    assert container["image"] == "quay.io/coreos/etcd:v3.5.17"
    assert container["command"] == ["/usr/local/bin/etcd"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/var/run/etcd"
    assert "--listen-client-urls=https://0.0.0.0:2379" in container["args"]
    # Health in plain HTTP on a port of its own, for the kubelet's probes.
    assert "--listen-metrics-urls=http://0.0.0.0:2381" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"client": 2379, "peer": 2380, "metrics": 2381}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
    # The workers' endpoint is this Service's client port, over TLS.
    scheme, host, port = env(worker(docs))["COORDINATOR_ETCD"]["value"].split(":")
    assert (scheme, host, int(port)) == ("https", "//" + service["metadata"]["name"], 2379)


def test_an_external_etcd_leaves_the_bundled_one_out() -> None:
    docs = k8s.render(k8s.WorkerPods(4, "demo", etcd="http://e1:2379, e2:2379"))
    assert not [d for d in docs if d["metadata"]["name"] == "etcd"]
    assert sorted(d["kind"] for d in docs) == ["Job", "PersistentVolumeClaim", "Service"]
    spec = pod_spec(docs)
    for container in [*spec["initContainers"], *spec["containers"]]:
        assert env(container)["COORDINATOR_ETCD"]["value"] == "e1:2379,e2:2379"


def test_render_does_not_change_what_load_returns() -> None:
    k8s.render(k8s.WorkerPods(9, "other", image="x:1", etcd="e:1"))
    docs = k8s.job_manifests()
    assert only(docs, "Job")["spec"]["parallelism"] == 4
    assert worker(docs)["image"] == k8s.DEFAULT_IMAGE


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"workers": 0}, "workers", "workers must be between 1 and 100000, not 0"),
        ({"workers": 100_001}, "workers", "workers must be between 1"),
        ({"job": "bad/id"}, "job", "job id 'bad/id' must be"),
        ({"job": ""}, "job", "job id '' must be"),
        ({"etcd": "nohost"}, "etcd", "'nohost' is not HOST:PORT"),
        ({"etcd": ","}, "etcd", "no etcd endpoint given"),
        (
            {"kind": "nope"},
            "kind",
            "kind 'nope' is not one of: command, mnist, noop, steps, xgboost",
        ),
        ({"params": "a=1\nb=2"}, "params", "params must be one line"),
        ({"image": "bad image"}, "image", "image 'bad image'"),
    ],
)
def test_render_rejects_bad_input_naming_the_field(
    kwargs: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(k8s.InvalidValue, match=re.escape(message)) as caught:
        k8s.render(k8s.WorkerPods(**{"workers": 4, "job": "demo", **kwargs}))
    assert caught.value.field == field
    assert isinstance(caught.value, ValueError)


def test_job_names_are_valid_distinct_and_short_enough_for_pod_hostnames() -> None:
    assert k8s.job_name("demo") == "coordinator-demo"
    ids = ["Demo", "demo", "de.mo", "de_mo", "de-mo", "x" * 128, "x" * 127 + "y"]
    names = [k8s.job_name(i) for i in ids]
    assert len(set(names)) == len(ids)
    for name in names:
        assert DNS_LABEL.match(name), name
        # Pod hostnames are <job-name>-<index>, index < 10^5, within 63 characters.
        assert len(f"{name}-{k8s.MAX_WORKERS - 1}") <= 63, name


def test_missing_manifests_raise_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(k8s, "MANIFEST_DIR", tmp_path / "k8s")
    with pytest.raises(FileNotFoundError, match=r"Kubernetes manifests not found at .*k8s"):
        k8s.render(k8s.WorkerPods(4, "demo"))


def test_a_kustomization_naming_a_missing_file_raises(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [gone.yaml]\n")
    with pytest.raises(FileNotFoundError, match=re.escape("gone.yaml")):
        k8s.load(tmp_path)


def test_dump_round_trips_as_multi_document_yaml() -> None:
    docs = k8s.render(k8s.WorkerPods(4, "demo"))
    text = k8s.dump(docs)
    assert list(yaml.safe_load_all(text)) == docs
    assert text.count("\n---\n") == len(docs) - 1


def test_the_wait_for_etcd_init_container_passes_once_etcd_listens() -> None:
    """Run its script for real: a dead first endpoint, then one that accepts connections."""
    (init,) = pod_spec(k8s.job_manifests())["initContainers"]
    assert init["command"][:2] == ["python3", "-c"]
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        endpoints = f"127.0.0.1:{dead.getsockname()[1]},127.0.0.1:{listener.getsockname()[1]}"
        result = subprocess.run(
            [sys.executable, "-c", init["command"][2]],
            env={"COORDINATOR_ETCD": endpoints},
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 0, result.stderr


def test_cli_prints_manifests_that_apply_as_they_are() -> None:
    result = coordinator("k8s", "--workers", "4", "--job", "demo", "--namespace", "/team-a")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert sorted(d["kind"] for d in docs) == [
        "Job",
        "PersistentVolumeClaim",
        "Service",
        "Service",
        "StatefulSet",
    ]
    spec = only(docs, "Job")["spec"]
    assert spec["parallelism"] == spec["completions"] == 4
    values = {name: var.get("value") for name, var in env(worker(docs)).items()}
    assert values["COORDINATOR_WORLD_SIZE"] == "4"
    assert values["COORDINATOR_JOB"] == "demo"
    assert values["COORDINATOR_NAMESPACE"] == "/team-a"
    validate_all(docs, K8S_VERSIONS[-1])


def test_cli_with_an_external_etcd_and_image() -> None:
    result = coordinator(
        "k8s", "--workers", "3", "--job", "j1", "--etcd", "etcd.infra:2379", "--image", "r/i:2"
    )
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert sorted(d["kind"] for d in docs) == ["Job", "PersistentVolumeClaim", "Service"]
    assert worker(docs)["image"] == "r/i:2"
    assert env(worker(docs))["COORDINATOR_ETCD"]["value"] == "etcd.infra:2379"


def test_cli_renders_an_mnist_job() -> None:
    result = coordinator("k8s", "--workers", "3", "--job", "m", "--kind", "mnist")
    assert result.returncode == 0, result.stderr
    docs = list(yaml.safe_load_all(result.stdout))
    assert env(worker(docs))["COORDINATOR_KIND"]["value"] == "mnist"
    assert only(docs, "Job")["spec"]["parallelism"] == 3
    validate_all(docs, K8S_VERSIONS[-1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0", "--job", "demo"], "Invalid value for --workers: workers must be"),
        (["--workers", "4", "--job", "bad/id"], "Invalid value for --job: job id 'bad/id'"),
        (["--workers", "4", "--job", "demo", "--etcd", "nohost"], "Invalid value for --etcd"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_field(args: list[str], message: str) -> None:
    result = coordinator("k8s", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    # Rich boxes and wraps the message; compare it with the box drawing removed.
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.stderr).split())
    assert message in text, result.stderr


# -- the standing product: service, agents, artifacts; security for every container ----

SECURE = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template (Job, Deployment, StatefulSet) by `<kind>/<name>`."""
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Job", "Deployment", "StatefulSet", "DaemonSet")
    }


def mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod.get("volumes", [])}


@pytest.mark.parametrize("source", ["shipped", "rendered"])
def test_every_container_runs_least_privileged_with_requests_and_limits(source: str) -> None:
    docs = (
        [*k8s.load(), k8s.job_template()]
        if source == "shipped"
        else k8s.render(k8s.WorkerPods(4, "demo"))
    )
    pods = pod_specs(docs)
    assert "Job/coordinator-demo" in pods
    if source == "shipped":
        expected = {"Deployment/coordinator", "StatefulSet/coordinator-agent", "StatefulSet/etcd"}
        assert expected | {"Job/coordinator-etcd-init"} <= set(pods)
    for where, pod in pods.items():
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == 10001, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        # Service links would put COORDINATOR_PORT=tcp://... from a `coordinator` Service.
        assert pod["enableServiceLinks"] is False, where
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            name = f"{where}/{container['name']}"
            assert container["securityContext"] == SECURE, name
            resources = container["resources"]
            assert set(resources["requests"]) == {"cpu", "memory"}, name
            assert set(resources["limits"]) == {"cpu", "memory"}, name
            # A read-only root: what is written goes to a volume, never the image.
            for path in mounts(container):
                assert path in (
                    "/tmp",
                    "/data",
                    "/artifacts",
                    "/var/run/etcd",
                    "/etc/etcd/tls",
                    "/etc/etcd/peer-tls",
                ) or path.startswith("/etc/coordinator/"), name


def test_the_image_runs_as_the_user_the_manifests_name() -> None:
    assert dockerfile()["USER"] == str(SECURE["runAsUser"])


def test_agents_workers_and_the_service_share_the_artifacts_volume() -> None:
    docs = k8s.load()
    claim = only(docs, "PersistentVolumeClaim", "coordinator-artifacts")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pods = pod_specs([*docs, k8s.job_template()])
    for where in (
        "Job/coordinator-demo",
        "StatefulSet/coordinator-agent",
        "Deployment/coordinator",
    ):
        pod = pods[where]
        (main,) = [c for c in pod["containers"]]
        volume = volumes(pod)[mounts(main)["/artifacts"]]
        assert volume["persistentVolumeClaim"] == {"claimName": "coordinator-artifacts"}, where
        assert volumes(pod)[mounts(main)["/tmp"]]["emptyDir"], where
    # The image's default artifacts folder is where the volume is mounted.
    assert dockerfile()["ENV"]["COORDINATOR_ARTIFACTS"] == "/artifacts"
    # A rendered job carries the claim, so `coordinator k8s | kubectl apply -f -` works alone.
    assert (
        only(k8s.render(k8s.WorkerPods(4, "demo")), "PersistentVolumeClaim")["metadata"]["name"]
        == (claim["metadata"]["name"])
    )


def test_the_role_grants_only_what_the_kubernetes_launcher_uses() -> None:
    docs = k8s.load()
    role = only(docs, "Role", "coordinator-launcher")
    rules = {
        (group, resource): sorted(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert rules == {
        ("batch", "jobs"): sorted(["create", "get", "list", "watch", "delete", "patch"]),
        ("", "pods"): ["get", "list", "watch"],
        ("", "pods/log"): ["get"],
        # Each Job's credentials Secret (owned by the Job); never get, list or delete.
        ("", "secrets"): ["create", "update"],
    }
    binding = only(docs, "RoleBinding", "coordinator-launcher")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "coordinator-launcher",
    }
    account = only(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    deployment = only(docs, "Deployment", "coordinator")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account
    # Nothing else talks to the Kubernetes API: no token is mounted in those pods.
    for where, pod in pod_specs(docs).items():
        if where != "Deployment/coordinator":
            assert pod["automountServiceAccountToken"] is False, where


def test_the_service_deployment_serves_with_tokens_from_a_secret() -> None:
    docs = k8s.load()
    deployment = only(docs, "Deployment", "coordinator")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert "command" not in container  # the image's entrypoint: `coordinator`
    assert args[0] == "serve"
    options = dict(zip(args[1::2], args[2::2], strict=True))
    assert options == {
        "--etcd": "https://etcd:2379",
        "--host": "0.0.0.0",
        "--port": "8080",
        "--token-file": options["--token-file"],
        "--default-launcher": "agents",
        "--data-dir": "/data",
        "--signing-key": "/etc/coordinator/signing-key/signing-key",  # one for every replica
        "--k8s-image": "etcd-coordinator:latest",  # the kubernetes launcher, in the namespace
        "--k8s-etcd": "https://etcd:2379",
    }
    folder, _, key = options["--token-file"].rpartition("/")
    tokens = volumes(pod)[mounts(container)[folder]]
    assert tokens["secret"]["secretName"] == "coordinator-tokens"
    # The file is the Secret's key `tokens` (service.yaml: --from-file=tokens=...).
    assert key == "tokens" and "items" not in tokens["secret"]
    assert "--from-file=tokens=" in (K8S / "init-secrets.sh").read_text()
    assert not [d for d in docs if d["kind"] == "Secret"]  # never shipped with a token in it
    assert volumes(pod)[mounts(container)["/data"]]["emptyDir"]
    # The Service reaches the container's port; the probes are the API's health routes.
    service = only(docs, "Service", "coordinator")
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    (port,) = service["spec"]["ports"]
    assert [p["containerPort"] for p in container["ports"]] == [int(options["--port"])]
    assert port["targetPort"] == container["ports"][0]["name"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_service_reads_the_job_template_from_a_configmap_of_workers_yaml(
    tmp_path: Path,
) -> None:
    """The image has no k8s/: the launcher's template is mounted from the kustomization's
    configMapGenerator, made of the very file `coordinator k8s` renders from."""
    docs = k8s.load()
    config_map = only(docs, "ConfigMap", "coordinator-manifests")
    assert config_map["data"] == {"job.yaml": (K8S / "job.yaml").read_text()}
    deployment = only(docs, "Deployment", "coordinator")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    folder = env(container)[k8s.MANIFESTS_ENV]["value"]
    assert volumes(pod)[mounts(container)[folder]]["configMap"]["name"] == "coordinator-manifests"
    (tmp_path / "job.yaml").write_text(config_map["data"]["job.yaml"])
    assert k8s.job_template(tmp_path) == only(k8s.job_manifests(), "Job")


def test_the_agents_are_a_statefulset_with_ids_and_addresses_from_the_downward_api() -> None:
    docs = k8s.load()
    statefulset = only(docs, "StatefulSet", "coordinator-agent")
    spec = statefulset["spec"]
    service = only(docs, "Service", spec["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "agent"
    options = dict(zip(args[1::2], args[2::2], strict=True))
    assert options["--etcd"] == "https://etcd:2379"
    assert options["--id"] == "$(POD_NAME)" and options["--advertise"] == "$(POD_IP)"
    assert options["--slots"] == "2" and options["--host"] == "0.0.0.0"
    assert options["--data-dir"] == "/data"
    variables = env(container)
    assert variables["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert variables["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Two members in one pod must not both take the image's port 29400.
    assert variables["COORDINATOR_PORT"]["value"] == "0"
    assert [p["containerPort"] for p in container["ports"]] == [int(options["--port"])]
    # Draining (30 s by default) fits in the grace before the kubelet's SIGKILL.
    assert pod["terminationGracePeriodSeconds"] > 30


def test_an_agent_pod_sees_only_its_own_password() -> None:
    """The Secret holds every agent's password; only the init container mounts it, and
    it copies the pod's own key into memory. The agent (and the programs it runs) mount
    that copy alone, so a member cannot read another agent's password."""
    pod = only(k8s.load(), "StatefulSet", "coordinator-agent")["spec"]["template"]["spec"]
    by_name = volumes(pod)
    every_password = {
        n
        for n, v in by_name.items()
        if v.get("secret", {}).get("secretName") == "coordinator-agents"
    }
    (init,) = pod["initContainers"]
    (agent,) = pod["containers"]
    assert every_password and not every_password & set(mounts(agent).values())
    assert every_password <= set(mounts(init).values())
    source, target = init["command"][-2:]
    assert source.endswith("/$(POD_NAME)") and init["command"][:3] == ["install", "-m", "0400"]
    own = by_name[mounts(agent)[str(Path(target).parent)]]
    assert own["emptyDir"]["medium"] == "Memory"
    assert env(agent)["COORDINATOR_ETCD_PASSWORD_FILE"]["value"] == target


def test_only_the_service_holds_the_signing_key_and_agents_its_public_half() -> None:
    """Every service replica signs with `coordinator-signing-key`; the agents verify with
    `coordinator-service-key`, which cannot sign, and never mount the private key."""
    docs = k8s.load()
    service = only(docs, "Deployment", "coordinator")["spec"]["template"]["spec"]
    agents = only(docs, "StatefulSet", "coordinator-agent")["spec"]["template"]["spec"]

    def key_file(pod: dict[str, Any], option: str) -> tuple[str, str, str]:
        """The Secret (its name and key) that `option` of the pod's container names."""
        (container,) = pod["containers"]
        path = container["args"][container["args"].index(option) + 1]
        folder, key = path.rsplit("/", 1)
        secret = volumes(pod)[mounts(container)[folder]]["secret"]
        return secret["secretName"], key, oct(secret["defaultMode"])

    assert key_file(service, "--signing-key") == ("coordinator-signing-key", "signing-key", "0o440")
    assert key_file(agents, "--service-key") == (
        "coordinator-service-key", "signing-key.pub", "0o444"
    )  # fmt: skip
    pods = [d["spec"]["template"]["spec"] for d in docs if "template" in d.get("spec", {})]
    holders = [
        pod
        for pod in pods
        if "coordinator-signing-key"
        in {v.get("secret", {}).get("secretName") for v in pod.get("volumes", [])}
    ]
    assert holders == [service]


def test_render_builds_its_job_with_the_function_the_launcher_uses() -> None:
    docs = k8s.render(
        k8s.WorkerPods(5, "demo", image="r/i:1", etcd="e:1", kind="steps", params="steps=3")
    )
    assert only(docs, "Job") == k8s.worker_job(
        k8s.WorkerPods(5, "demo", "r/i:1", "e:1", kind="steps", params="steps=3")
    )


@pytest.mark.parametrize("workers", [4, 64])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_pass_strict_validation_for_4_and_64(workers: int, version: str) -> None:
    docs = k8s.render(k8s.WorkerPods(workers, "demo"))
    validate_all(docs, version)
    assert only(docs, "Job")["spec"]["completions"] == workers


@pytest.mark.parametrize(
    ("kind", "name", "command"),
    [("Deployment", "coordinator", "serve"), ("StatefulSet", "coordinator-agent", "agent")],
)
def test_the_service_and_agent_arguments_parse_with_the_real_cli(
    kind: str, name: str, command: str
) -> None:
    """The manifests' arguments are options the commands have, with values they accept
    (parsed by the CLI, not run; `$(VAR)` as the kubelet would expand it)."""
    import typer.main

    from coordinator.cli import app

    (container,) = only(k8s.load(), kind, name)["spec"]["template"]["spec"]["containers"]
    args = [
        {"$(POD_NAME)": "coordinator-agent-0", "$(POD_IP)": "10.0.0.7"}.get(a, a)
        for a in container["args"]
    ]
    assert args[0] == command
    group = typer.main.get_command(app)
    sub = group.get_command(group.make_context("coordinator", [command, "--help"]), command)
    assert sub is not None
    context = sub.make_context(command, args[1:])
    given = {key: value for key, value in context.params.items() if value is not None}
    if command == "serve":
        assert str(given["default_launcher"]) == "agents" and given["port"] == 8080
        assert str(given["token_file"]) == "/etc/coordinator/tokens/tokens"
    else:
        assert given["agent_id"] == "coordinator-agent-0" and given["advertise"] == "10.0.0.7"
        assert given["slots"] == 2 and given["port"] == 8081


# -- etcd with TLS and auth; the one-time step's Secrets; NetworkPolicies ------------------


def secret_references(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Every Secret the pod templates read, and the keys they read from it (a volume
    without `items` reads them all: "*")."""
    found: dict[str, set[str]] = {}
    for pod in pod_specs(docs).values():
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                items = volume["secret"].get("items")
                keys = {i["key"] for i in items} if items else {"*"}
                found.setdefault(volume["secret"]["secretName"], set()).update(keys)
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            for var in container.get("env", []):
                reference = (var.get("valueFrom") or {}).get("secretKeyRef")
                if reference:
                    found.setdefault(reference["name"], set()).add(reference["key"])
    return found


TOKENS = "coordinator-tokens"  # the Secret of the API's tokens


def one_time_secrets(agents: int = 3, **settings: str) -> list[dict[str, Any]]:
    """What k8s/init-secrets.sh creates, as `kubectl create --dry-run=client` prints it."""
    env = {"PATH": os.environ["PATH"], "DRY_RUN": "1", "AGENTS": str(agents), "HOME": "/tmp"}
    result = subprocess.run(
        [str(K8S / "init-secrets.sh"), "team-a"],
        capture_output=True, text=True, timeout=120, env={**env, **settings},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_the_one_time_step_issues_an_exec_token_only_when_asked() -> None:
    def roles(**settings: str) -> list[str]:
        [tokens] = [d for d in one_time_secrets(**settings) if d["metadata"]["name"] == TOKENS]
        text = base64.b64decode(tokens["data"]["tokens"]).decode()
        return [line.split()[0] for line in text.splitlines() if not line.startswith("#")]

    assert roles() == ["submit", "read"]
    assert roles(EXEC_TOKEN="1") == ["submit", "read", "exec"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_the_one_time_step_makes_every_secret_the_manifests_read() -> None:
    """k8s/init-secrets.sh (dry run, offline): valid Secrets, exactly those the shipped
    pods mount, each with the keys they read; etcd's certificate names the Service and
    the pods (TLS is verified); one password per agent pod; nothing of it in the repo."""
    secrets = {doc["metadata"]["name"]: doc for doc in one_time_secrets()}
    for doc in secrets.values():
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        assert doc["metadata"]["namespace"] == "team-a"
    shipped = [*k8s.load(), k8s.job_template()]
    wanted = secret_references(shipped)
    # The job's credentials Secret is the launcher's (one per Job), not the one-time step's.
    wanted.pop(k8s.credentials_secret(k8s.job_template()["metadata"]["name"]))
    assert set(secrets) == set(wanted)
    for name, keys in wanted.items():
        assert keys - {"*"} <= set(secrets[name]["data"]), name
    statefulset = only(k8s.load(), "StatefulSet", "coordinator-agent")
    replicas = statefulset["spec"]["replicas"]
    assert set(secrets["coordinator-agents"]["data"]) == {
        f"coordinator-agent-{i}" for i in range(replicas)
    }
    passwords = {
        base64.b64decode(v).decode().strip() for v in secrets["coordinator-agents"]["data"].values()
    }
    assert len(passwords) == replicas and all(len(p) >= 32 for p in passwords)
    certificate = base64.b64decode(secrets["etcd-tls"]["data"]["tls.crt"])
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName"],
        input=certificate, capture_output=True, timeout=30, check=True,
    ).stdout.decode()  # fmt: skip
    for name in ("etcd", "*.etcd", "etcd.team-a.svc", "*.etcd.team-a.svc.cluster.local"):
        assert f"DNS:{name}" in text, text
    assert secrets["etcd-tls"]["type"] == "kubernetes.io/tls"
    assert not [d for d in shipped if d["kind"] == "Secret"]
    # The raft peers' certificate: signed by their own CA (not the clients'), for the pods.
    peer = {k: base64.b64decode(v) for k, v in secrets["etcd-peer-tls"]["data"].items()}
    client_ca = base64.b64decode(secrets["etcd-ca"]["data"]["ca.crt"])
    assert peer["ca.crt"] != client_ca
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName,extendedKeyUsage"],
        input=peer["tls.crt"], capture_output=True, timeout=30, check=True,
    ).stdout.decode()  # fmt: skip
    assert "DNS:*.etcd," in text and "Web Server" in text and "Web Client" in text, text
    with tempfile.TemporaryDirectory() as folder:
        for name, issuer in (("peer", peer["ca.crt"]), ("client", client_ca)):
            (Path(folder) / name).write_bytes(issuer)
        (Path(folder) / "cert").write_bytes(peer["tls.crt"])
        verify = ["openssl", "verify", "-CAfile"]
        signed = [subprocess.run([*verify, str(Path(folder) / ca), str(Path(folder) / "cert")],
                                 capture_output=True, timeout=30).returncode
                  for ca in ("peer", "client")]  # fmt: skip
    assert signed[0] == 0 and signed[1] != 0


def test_etcd_peers_speak_tls_and_present_a_certificate_of_their_own_ca() -> None:
    """etcd trusts what arrives on its peer port (down to the user inside a raft entry):
    every peer URL is https, a peer must present a certificate (--peer-client-cert-auth)
    of the peer CA, which is not the clients' CA, from the Secret `etcd-peer-tls`."""
    statefulset = only(k8s.load(), "StatefulSet", "etcd")
    pod = statefulset["spec"]["template"]["spec"]
    (etcd,) = pod["containers"]
    flags = dict(a.split("=", 1) for a in etcd["args"] if "=" in a)
    for flag in ("listen-peer-urls", "initial-advertise-peer-urls"):
        assert flags["--" + flag].startswith("https://"), flag
    assert all(url.split("=", 1)[1].startswith("https://") for url in [flags["--initial-cluster"]])
    assert "--peer-client-cert-auth" in etcd["args"]
    assert flags["--peer-trusted-ca-file"] != flags.get("--trusted-ca-file")
    folder = mounts(etcd)
    for flag in ("peer-cert-file", "peer-key-file", "peer-trusted-ca-file"):
        directory = flags["--" + flag].rsplit("/", 1)[0]
        assert volumes(pod)[folder[directory]]["secret"]["secretName"] == "etcd-peer-tls", flag
    assert not [a for a in etcd["args"] if "peer" in a and "http://" in a]


def test_etcd_serves_tls_only_and_every_client_trusts_its_ca_with_a_user_of_its_own() -> None:
    """No plain client URL; the service is etcd's root (it makes the users), each agent
    its own user (named after its pod), the jobs' pods their job's user; passwords are
    always files, never values; the init Job turns auth on with the same files."""
    docs = k8s.load()
    (etcd,) = only(docs, "StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"]
    args = etcd["args"]
    assert not [a for a in args if "client-urls=http://" in a]
    assert (
        "--cert-file=/etc/etcd/tls/tls.crt" in args and "--key-file=/etc/etcd/tls/tls.key" in args
    )
    clients = {
        "service": only(docs, "Deployment", "coordinator"),
        "agent": only(docs, "StatefulSet", "coordinator-agent"),
        "init": only(docs, "Job", "coordinator-etcd-init"),
        "worker": k8s.job_template(),
    }
    users = {}
    for role, doc in clients.items():
        pod = doc["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        variables = env(container)
        folder = mounts(container)
        ca = variables["COORDINATOR_ETCD_CA"]["value"]
        assert volumes(pod)[folder[ca.rsplit("/", 1)[0]]]["secret"]["secretName"] == "etcd-ca"
        assert "https://etcd:2379" in json.dumps(container), role  # TLS, by name
        if role == "init":
            assert "--root-password-file=/etc/coordinator/etcd-root/password" in container["args"]
            continue
        password = variables["COORDINATOR_ETCD_PASSWORD_FILE"]["value"]
        assert password.startswith("/etc/coordinator/"), role
        users[role] = variables["COORDINATOR_ETCD_USER"]
    assert users["service"]["value"] == "root"
    assert users["agent"]["value"] == "/coordinator/agents/$(POD_NAME)"
    assert "secretKeyRef" in users["worker"]["valueFrom"]
    # The init Job makes one user per agent pod, named as the agents connect.
    (init,) = clients["init"]["spec"]["template"]["spec"]["containers"]
    made = [a.split("=")[1] for a in init["args"] if a.startswith("--agent=")]
    replicas = clients["agent"]["spec"]["replicas"]
    assert made == [f"coordinator-agent-{i}" for i in range(replicas)]
    assert init["command"] == ["python3", "-m", "coordinator.deploy.etcd_init"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values")
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def pod_labels() -> dict[str, dict[str, str]]:
    """The labels of every kind of pod: the shipped ones, and a Job's pods as the
    kubernetes launcher makes them (its template plus its own labels)."""
    docs = k8s.load()
    launched = k8s.worker_job(
        k8s.WorkerPods(2, "demo"),
        labels={"etcd-coordinator/launcher": "kubernetes", "etcd-coordinator/run": "x"},
    )
    return {
        "etcd": only(docs, "StatefulSet", "etcd")["spec"]["template"]["metadata"]["labels"],
        "service": only(docs, "Deployment", "coordinator")["spec"]["template"]["metadata"][
            "labels"
        ],
        "agent": only(docs, "StatefulSet", "coordinator-agent")["spec"]["template"]["metadata"][
            "labels"
        ],
        "init": only(docs, "Job", "coordinator-etcd-init")["spec"]["template"]["metadata"][
            "labels"
        ],
        "worker": launched["spec"]["template"]["metadata"]["labels"],
        "rendered worker": only(k8s.render(k8s.WorkerPods(2, "demo")), "Job")["spec"]["template"][
            "metadata"
        ]["labels"],
    }


def allowed(policy: dict[str, Any], labels: dict[str, dict[str, str]]) -> dict[str, set[str]]:
    """Which kinds of pod each ingress rule admits, by the port it names ("*": any)."""
    admitted: dict[str, set[str]] = {}
    for rule in policy["spec"].get("ingress", []):
        ports = {str(p["port"]) for p in rule.get("ports", [])} or {"*"}
        sources = rule.get("from")
        for kind, pod in labels.items():
            if sources is None or any(
                "podSelector" in s and selects(s["podSelector"], pod) for s in sources
            ):
                for port in ports:
                    admitted.setdefault(port, set()).add(kind)
    return admitted


def test_network_policies_admit_exactly_the_pods_that_need_each_port() -> None:
    """By the pods' real labels (the launcher's Jobs included): etcd's client port from the
    service, the agents, the init Job and the jobs' pods, its peer port from etcd; the
    agents' output port from the service, and any port from other agents (one job's
    members on several agents); job pods from job pods only; the API from anywhere. Each
    policy selects exactly its kind of pod, and names ports the pods have."""
    docs = k8s.load()
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    labels = pod_labels()
    selected = {
        name: {kind for kind, pod in labels.items() if selects(p["spec"]["podSelector"], pod)}
        for name, p in policies.items()
    }
    assert selected == {
        "etcd": {"etcd"},
        "coordinator-agents": {"agent"},
        "coordinator-workers": {"worker", "rendered worker"},
        "coordinator-service": {"service"},
    }
    everyone = set(labels)
    assert allowed(policies["etcd"], labels) == {
        "client": {"service", "agent", "init", "worker", "rendered worker"},
        "peer": {"etcd"},
    }
    assert allowed(policies["coordinator-agents"], labels) == {
        "output": {"service"},
        "*": {"agent"},
    }
    assert allowed(policies["coordinator-workers"], labels) == {"*": {"worker", "rendered worker"}}
    assert allowed(policies["coordinator-service"], labels) == {"http": everyone}
    for policy in policies.values():
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    # The named ports exist on the pods the policies select.
    port_names = {
        "etcd": only(docs, "StatefulSet", "etcd"),
        "coordinator-agents": only(docs, "StatefulSet", "coordinator-agent"),
        "coordinator-service": only(docs, "Deployment", "coordinator"),
    }
    for name, workload in port_names.items():
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        named = {
            str(p["port"]) for r in policies[name]["spec"]["ingress"] for p in r.get("ports", [])
        }
        assert named <= names, name
