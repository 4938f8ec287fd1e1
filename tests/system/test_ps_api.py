"""The public parameter-server API (`coordinator.ps`) with a model of the user's own.

Real sockets and the real handshake: an MLP trained by two trainer threads under
aggregate BSP ends where one process with the whole batch ends; a wrong secret is
refused before any PS frame; gradients given to `push` are checked; outside a job
`program_peers` says how to run; and `examples/ps_custom.py` under `coordinator run`
reaches its documented accuracy under SSP with a straggler, and through the service
resumes after its server is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from coordinator import ps
from coordinator.etcd.client import Etcd
from coordinator.etcd.server import EmbeddedEtcd
from coordinator.ps.model import FlatModel
from coordinator.rendezvous.handshake import HandshakeError
from tests.support.service import ServiceProc, wait_state
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"s" * 32


def mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def listening(servers: int, trainers: int, **options: object) -> tuple[list[ps.Server], ps.Peers]:
    """`servers` servers of `mlp()` on loopback, each behind its own handshake endpoint."""
    ids = [ps.ServerAddress(i, "127.0.0.1", 0, f"m{i}/ps") for i in range(servers)]
    unbound = ps.Peers("job", 1, ids, SECRET)
    started = []
    for index in range(servers):
        server = ps.serve(mlp(), index=index, servers=servers, trainers=trainers,
                          peers=unbound, **options)  # type: ignore[arg-type]  # fmt: skip
        server.listen("127.0.0.1", 0, unbound)
        started.append(server)
    bound = [
        ps.ServerAddress(i, "127.0.0.1", s.endpoint.port, f"m{i}/ps")  # type: ignore[union-attr]
        for i, s in enumerate(started)
    ]
    return started, ps.Peers("job", 1, bound, SECRET)


@pytest.mark.parametrize("fused", [False, True], ids=["step", "push-pull"])
def test_aggregate_bsp_over_two_servers_equals_one_process_with_the_whole_batch(
    fused: bool,
) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    spec = ps.optimizer("sgd", 0.1, momentum=0.9)
    servers, peers = listening(2, 2, optimizer=spec, update_rule="plain", aggregate=True)
    failures: list[BaseException] = []

    def train(index: int) -> None:
        try:
            with ps.trainer(mlp(), peers, index=index, timeout=10) as client:
                part = slice(4 * index, 4 * index + 4)
                if fused:  # one pull, then each step's push brings the next step's weights
                    client.pull()
                for _ in range(3):
                    if fused:
                        client.zero_grad()
                        functional.cross_entropy(client.model(x[part]), y[part]).backward()
                        assert client.push(pull=True) == [0, 0]
                        assert client.versions == [client.clock] * 2
                    else:
                        client.step(lambda m: functional.cross_entropy(m(x[part]), y[part]))
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        for server in servers:
            server.wait(timeout=10)
    finally:
        for server in servers:
            server.close()
    assert not failures, failures
    assert [s.version for s in servers] == [3, 3]

    reference = mlp()
    optimiser = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimiser.zero_grad()
        functional.cross_entropy(reference(x), y).backward()
        optimiser.step()
    final = mlp()
    flat = FlatModel.build(final, 2)
    for index, server in enumerate(servers):
        flat.params[flat.slices[index]].copy_(server.snapshot()[0])
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(final.named_parameters())[name], param)


def test_push_with_pull_is_sgd_step_for_step_and_reads_its_own_update() -> None:
    """One trainer, no aggregation: each push(pull=True) returns the weights with its own
    gradient applied, so the trainer runs exactly the one-process SGD."""
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    servers, peers = listening(2, 1, optimizer=ps.optimizer("sgd", 0.1, momentum=0.9))
    reference = mlp()
    optimiser = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    try:
        with ps.trainer(mlp(), peers, index=0, timeout=10) as client:
            client.pull()
            for step in range(1, 4):
                client.zero_grad()
                functional.cross_entropy(client.model(x), y).backward()
                assert client.push(pull=True) == [0, 0]
                assert client.versions == [step, step]
                optimiser.zero_grad()
                functional.cross_entropy(reference(x), y).backward()
                optimiser.step()
                for ours, theirs in zip(
                    client.model.parameters(), reference.parameters(), strict=True
                ):
                    torch.testing.assert_close(ours, theirs)
        for server in servers:
            server.wait(timeout=10)
    finally:
        for server in servers:
            server.close()


def test_dc_compensates_each_gradient_against_the_weights_its_trainer_pulled() -> None:
    """A live server under `dc` (SGD without momentum, 2 trainers: each gradient at half
    the lr) by hand: a gradient pulled at W is applied as g + lambda g g (W_now - W). The
    server keeps the pulled weights without a copy, so B's third gradient, pulled at the
    first weights two updates ago, checks that no update wrote them meanwhile."""
    lr, lam = 0.1, 2.0
    servers, peers = listening(
        1, 2, optimizer=ps.optimizer("sgd", lr), update_rule="dc", compensation=lam
    )
    size = sum(p.numel() for p in mlp().parameters())
    grads = [torch.randn(size, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def push(client: ps.Trainer, grad: torch.Tensor) -> list[int]:
        shapes = [p.shape for p in client.model.parameters()]
        pieces = torch.split(grad, [s.numel() for s in shapes])
        return client.push([g.reshape(s) for g, s in zip(pieces, shapes, strict=True)])

    def applied(grad: torch.Tensor, now: torch.Tensor, pulled: torch.Tensor) -> torch.Tensor:
        return now - lr / 2 * (grad + lam * grad * grad * (now - pulled))

    try:
        with (
            ps.trainer(mlp(), peers, index=0, timeout=10) as a,
            ps.trainer(mlp(), peers, index=1, timeout=10) as b,
        ):
            a.pull(), b.pull()
            w0, _ = servers[0].snapshot()
            assert push(b, grads[0]) == [0]  # B: fresh, nothing to compensate
            w1 = w0 - lr / 2 * grads[0]
            assert push(a, grads[1]) == [1]  # A: pulled w0, one update since
            w2 = applied(grads[1], w1, w0)
            a.pull()  # A now holds w2; B still w0
            assert push(b, grads[2]) == [2]
            w3 = applied(grads[2], w2, w0)
            torch.testing.assert_close(servers[0].snapshot()[0], w3)
        servers[0].wait(timeout=10)
    finally:
        for server in servers:
            server.close()


def test_a_trainer_without_the_rounds_secret_is_refused_and_given_grads_are_checked() -> None:
    servers, peers = listening(1, 1, checkpoint_every=0)
    try:
        wrong = ps.Peers(peers.job_id, peers.round, peers.servers, b"x" * 32)
        with pytest.raises(HandshakeError):
            ps.trainer(mlp(), wrong, index=0, timeout=5)
        model = mlp()
        with ps.trainer(model, peers, index=0, timeout=5) as client:
            with pytest.raises(ValueError, match="2 gradients for 4 parameters"):
                client.push([torch.zeros(1), torch.zeros(1)])
            with pytest.raises(ValueError, match=r"shape \[2\] for a parameter of shape \[16, 6\]"):
                client.push([torch.zeros(2), None, None, None])
            client.pull()
            before = servers[0].snapshot()[0]
            client.push([torch.ones_like(p) for p in model.parameters()])
            assert client.clock == 1
            # The server acknowledges a push before it applies it (the trainer never waits
            # for the optimizer): the update lands a moment later.
            wait_until(lambda: servers[0].version == 1, 10, "the server to apply the push")
            torch.testing.assert_close(servers[0].snapshot()[0], before - 0.02)
        servers[0].wait(timeout=5)
    finally:
        servers[0].close()


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="optimizer must be sgd or adam"):
        ps.optimizer("rmsprop")
    with pytest.raises(ValueError, match="lr must be > 0"):
        ps.optimizer("adam", -1.0)
    with pytest.raises(ValueError, match="index 2 is not one of the 2 servers"):
        ps.serve(mlp(), index=2, servers=2, trainers=1)
    with pytest.raises(ValueError, match="ps=5 servers but the model has only 4 tensors"):
        ps.serve(mlp(), index=0, servers=5, trainers=1)
    with pytest.raises(ValueError, match="index order"):
        ps.Peers("job", 1, [ps.ServerAddress(1, "127.0.0.1", 1, "m")], SECRET)
    with pytest.raises(RuntimeError, match="coordinator run --workers N"):
        ps.program_peers(1, environ={})


@pytest.mark.one_etcd
def test_the_custom_example_reaches_its_accuracy_under_ssp_with_a_straggler(
    etcd_server: EmbeddedEtcd, etcd: Etcd, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "coordinator", "run", "--workers", "3",
               "--etcd", etcd_server.endpoint, "--namespace", etcd.namespace, "--job", "psx",
               "--", sys.executable, str(ROOT / "examples/ps_custom.py"),
               "--ps", "1", "--straggler", "2", "--factor", "3"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    results = role_lines(done.stdout)
    assert sorted(results) == [0, 1, 2]
    assert results[0]["version"] == 2 * 189  # every step of both trainers applied
    assert all(results[r]["accuracy"] >= 0.85 for r in (1, 2)), results
    assert (tmp_path / "artifacts" / "psx" / "ps" / "server-0.pt").exists()


def role_lines(text: str) -> dict[int, dict[str, Any]]:
    """Each rank's result line (`{"rank": r, "role": ...}`) in `run`'s or `/logs`' output."""
    results = {}
    for line in text.splitlines():
        body = line.split("] ", 1)[-1]
        if body.startswith("{") and '"role"' in body:
            record = json.loads(body)
            results[record["rank"]] = record
    return results


@pytest.mark.slow  # ~60 s: two attempts of the example through a real service
def test_the_custom_example_resumes_after_its_server_is_killed_through_the_service(
    serve: Callable[..., ServiceProc],
) -> None:
    """`max_restarts=1`: the server's member is SIGKILLed after its first checkpoint; the
    second attempt's server resumes from it, the trainers from their clocks there, and
    they reach the documented accuracy."""
    service = serve()
    spec = {"id": "psresume", "kind": "command", "workers": 3, "max_restarts": 1,
            "command": [sys.executable, str(ROOT / "examples/ps_custom.py"), "--ps", "1",
                        "--straggler", "2", "--epochs", "6"]}  # fmt: skip
    assert service.http.post("/v1/jobs", json=spec).status_code == 201
    checkpoint = service.data / "artifacts" / "psresume" / "ps" / "server-0.pt"
    wait_until(checkpoint.exists, 90, "the server's first checkpoint")
    record = service.http.get("/v1/jobs/psresume").json()
    server = next(m for m in record["attempts"][0]["members"] if m["rank"] == 0)
    os.kill(server["pid"], signal.SIGKILL)

    record = wait_state(service, "psresume", {"SUCCEEDED", "FAILED"}, timeout=180)
    assert record["state"] == "SUCCEEDED", record["conditions"]
    assert len(record["attempts"]) == 2 and "rank 0" in record["attempts"][0]["outcome"]
    results = role_lines(service.http.get("/v1/jobs/psresume/logs").text)
    assert sorted(results) == [0, 1, 2], results
    resumed = results[0]["resumed_from"]
    assert resumed and resumed % 50 == 0, results[0]  # a checkpoint every 50 updates
    # Each trainer took up at its checkpointed clock: every step applied exactly once more.
    assert results[0]["version"] == 2 * 378  # 6 epochs of 63 steps, both trainers
    assert all(results[r]["accuracy"] >= 0.85 for r in (1, 2)), results
