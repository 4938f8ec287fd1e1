"""The Kubernetes manifests in `k8s/` and `coordinator k8s`, checked offline.

Every manifest, as shipped and as rendered, is validated against the Kubernetes
OpenAPI schemas that the `kubernetes-validate` wheel carries, in strict mode (an
unknown or misspelt field fails). The rendered worker pod is compared with what
the image (worker_image/Dockerfile) and the worker (its environment) expect.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from coordinator.deploy import k8s

ROOT = Path(__file__).resolve().parents[1]
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
        ("Job", "coordinator-demo"),
        ("Service", "etcd"),
        ("Service", "workers"),
        ("StatefulSet", "etcd"),
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_for_four_workers_pass_strict_schema_validation(version: str) -> None:
    validate_all(k8s.render(4, "demo"), version)
    validate_all(k8s.render(4, "Demo_1", etcd="etcd.infra:2379", kind="noop"), version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_an_mnist_job_renders_valid_manifests_with_its_kind_and_parameters(version: str) -> None:
    """The documented MNIST run: 3 pods (a parameter server and two trainers)."""
    docs = k8s.render(3, "m", image="r/etcd-coordinator:mnist", kind="mnist", params="epochs=3")
    validate_all(docs, version)
    assert only(docs, "Job")["spec"]["completions"] == 3
    values = {name: var.get("value") for name, var in env(worker(docs)).items()}
    assert values["COORDINATOR_KIND"] == "mnist"
    assert values["COORDINATOR_WORLD_SIZE"] == "3"
    assert values["COORDINATOR_PARAMS"] == "epochs=3"
    assert worker(docs)["image"] == "r/etcd-coordinator:mnist"


def test_the_validator_catches_a_misspelt_field_and_a_wrong_type() -> None:
    """The schema check above can fail: strict mode rejects what a cluster would ignore."""
    job = only(k8s.render(4, "demo"), "Job")
    job["spec"]["parallelizm"] = job["spec"].pop("parallelism")
    with pytest.raises(kubernetes_validate.ValidationError, match="parallelizm"):
        kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)
    job = only(k8s.render(4, "demo"), "Job")
    job["spec"]["completions"] = "4"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSIONS[-1], strict=True)


def test_the_kustomization_lists_every_manifest_file() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    files = {p.name for p in K8S.glob("*.y*ml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


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
    """`kubectl apply -k k8s/` without rendering: N in the Job matches WORLD_SIZE."""
    docs = k8s.load()
    spec = only(docs, "Job")["spec"]
    assert spec["parallelism"] == spec["completions"] == 4
    assert env(worker(docs))["COORDINATOR_WORLD_SIZE"]["value"] == "4"


def test_render_sets_the_worker_count_of_an_indexed_job() -> None:
    for n in (1, 4, 17):
        spec = only(k8s.render(n, "demo"), "Job")["spec"]
        assert spec["parallelism"] == spec["completions"] == n
        assert spec["completionMode"] == "Indexed"
        # A failed member fails the job; a restarted pod would join a broken rendezvous.
        assert spec["backoffLimit"] == 0
        assert spec["template"]["spec"]["restartPolicy"] == "Never"


def test_render_gives_the_worker_the_environment_it_needs() -> None:
    docs = k8s.render(4, "demo", namespace_prefix="/team-a", kind="noop")
    variables = env(worker(docs))
    assert set(variables) >= WORKER_ENV
    values = {name: var.get("value") for name, var in variables.items()}
    assert values["COORDINATOR_JOB"] == "demo"
    assert values["COORDINATOR_WORLD_SIZE"] == "4"
    assert values["COORDINATOR_ETCD"] == "etcd:2379"
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
    container = worker(k8s.render(4, "demo"))
    port = env(container)["COORDINATOR_PORT"]["value"]
    assert port == image["ENV"]["COORDINATOR_PORT"] == image["EXPOSE"]
    assert [p["containerPort"] for p in container["ports"]] == [int(port)]
    service = only(k8s.render(4, "demo"), "Service", "workers")
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]


def test_image_and_command_match_the_dockerfile_entrypoint() -> None:
    image = dockerfile()
    assert image["ENTRYPOINT"] == ["coordinator"] and image["CMD"] == ["worker"]
    docs = k8s.render(4, "demo", image="registry.example/etcd-coordinator:0.1.0")
    container = worker(docs)
    assert container["image"] == "registry.example/etcd-coordinator:0.1.0"
    # No command means the image's ENTRYPOINT runs; a command would replace it.
    assert container.get("command", image["ENTRYPOINT"]) == image["ENTRYPOINT"]
    assert container["args"] == image["CMD"]
    # The init container runs the same image, so a pushed tag is needed only once.
    assert {c["image"] for c in pod_spec(docs)["initContainers"]} == {container["image"]}
    assert worker(k8s.load())["image"] == k8s.DEFAULT_IMAGE


def test_the_pod_runs_as_the_image_user() -> None:
    security = pod_spec(k8s.render(4, "demo"))["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == dockerfile()["USER"] == "10001"


def test_worker_pods_get_stable_names_through_a_headless_service() -> None:
    docs = k8s.render(4, "demo")
    service = only(docs, "Service", "workers")
    assert service["spec"]["clusterIP"] == "None"
    template = only(docs, "Job")["spec"]["template"]
    assert template["spec"]["subdomain"] == service["metadata"]["name"]
    selector = service["spec"]["selector"].items()
    assert selector <= template["metadata"]["labels"].items()


def test_the_bundled_etcd_is_a_statefulset_with_a_volume_and_a_headless_service() -> None:
    docs = k8s.render(4, "demo")
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
    assert "--listen-client-urls=http://0.0.0.0:2379" in container["args"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "client"}
    # The workers' endpoint is this Service's client port.
    host, port = env(worker(docs))["COORDINATOR_ETCD"]["value"].split(":")
    assert (host, int(port)) == (service["metadata"]["name"], 2379)


def test_an_external_etcd_leaves_the_bundled_one_out() -> None:
    docs = k8s.render(4, "demo", etcd="http://e1:2379, e2:2379")
    assert not [d for d in docs if d["metadata"]["name"] == "etcd"]
    assert sorted(d["kind"] for d in docs) == ["Job", "Service"]
    spec = pod_spec(docs)
    for container in [*spec["initContainers"], *spec["containers"]]:
        assert env(container)["COORDINATOR_ETCD"]["value"] == "e1:2379,e2:2379"


def test_render_does_not_change_what_load_returns() -> None:
    k8s.render(9, "other", image="x:1", etcd="e:1")
    docs = k8s.load()
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
        ({"kind": "nope"}, "kind", "kind 'nope' is not one of: mnist, noop, steps, xgboost"),
        ({"params": "a=1\nb=2"}, "params", "params must be one line"),
        ({"image": "bad image"}, "image", "image 'bad image'"),
    ],
)
def test_render_rejects_bad_input_naming_the_field(
    kwargs: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(k8s.InvalidValue, match=re.escape(message)) as caught:
        k8s.render(**{"workers": 4, "job": "demo", **kwargs})
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
        k8s.render(4, "demo")


def test_a_kustomization_naming_a_missing_file_raises(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: [gone.yaml]\n")
    with pytest.raises(FileNotFoundError, match=re.escape("gone.yaml")):
        k8s.load(tmp_path)


def test_dump_round_trips_as_multi_document_yaml() -> None:
    docs = k8s.render(4, "demo")
    text = k8s.dump(docs)
    assert list(yaml.safe_load_all(text)) == docs
    assert text.count("\n---\n") == len(docs) - 1


def test_the_wait_for_etcd_init_container_passes_once_etcd_listens() -> None:
    """Run its script for real: a dead first endpoint, then one that accepts connections."""
    (init,) = pod_spec(k8s.load())["initContainers"]
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
    assert sorted(d["kind"] for d in docs) == ["Job", "Service", "Service", "StatefulSet"]
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
    assert sorted(d["kind"] for d in docs) == ["Job", "Service"]
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
