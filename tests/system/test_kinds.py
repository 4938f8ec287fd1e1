"""The job kinds' registry (`coordinator.jobs.kinds`) and `GET /v1/kinds` through a real
`coordinator serve`: each kind's parameters, checks, roles, charts and retries."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from coordinator.jobs import JOB_KINDS, MEMBER_KINDS, make_job
from coordinator.jobs.kinds import KINDS, KindInfo, kind_of
from coordinator.service.model import JobSpec
from tests.support.service import READ_TOKEN, SUBMIT_TOKEN, ServiceProc

ALL = ["noop", "steps", "xgboost", "mnist", "command"]
#: The fewest parameters each kind's check accepts (beside any one parameter at its default).
BASE: dict[str, dict[str, str]] = {name: {} for name in KINDS}
BASE["steps"] = {"method": "bsp", "num_steps": "1"}
COMPANIONS = {"straggler_factor": {"straggler_rank": "1"}}  # meaningless alone


def test_the_registry_holds_every_kind_and_the_old_names_still_work() -> None:
    assert list(KINDS) == ALL
    assert MEMBER_KINDS == ALL
    assert list(JOB_KINDS) == ALL[:-1]  # the command kind runs a program, not parameters
    for name, kind in KINDS.items():
        assert kind.name == name and kind.description
        assert kind.needs_exec == kind.takes_command == (name == "command")
    with pytest.raises(ValueError, match=r"unknown job kind 'nope'.*noop"):
        kind_of("nope")
    with pytest.raises(ValueError, match="only with kind command, not noop"):
        make_job("noop", {}, 1, ["true"])


def test_each_kinds_roles_by_rank() -> None:
    mnist, steps = KINDS["mnist"], KINDS["steps"]
    assert [mnist.role({}, rank) for rank in range(3)] == ["server", "trainer", "trainer"]
    assert [mnist.role({"ps": "2"}, rank) for rank in range(4)] == [
        "server", "server", "trainer", "trainer",
    ]  # fmt: skip
    assert mnist.role({"ps": "x"}, 1) == "trainer"  # not a number: its default count
    for name in ("noop", "steps", "xgboost", "command"):
        assert {KINDS[name].role({"ps": "3"}, rank) for rank in range(4)} == {"worker"}
    slowed = {"straggler_rank": "2", "straggler_factor": "3"}
    assert [mnist.role(slowed, rank) for rank in (1, 2)] == ["trainer", "trainer, straggler 3x"]
    assert steps.role({"straggler_rank": "0"}, 0) == "worker, straggler 1x"  # its default
    assert steps.barrier_params({"staleness": "2"}) == {"staleness": "2"}  # no default method
    assert mnist.barrier_params({}) == {"method": "bsp"}
    assert mnist.barrier_params({"method": "ssp"}) == {"method": "ssp"}
    assert KINDS["noop"].barrier_params({"method": "ssp"}) is None


def test_each_kinds_charts() -> None:
    charts = {name: list(kind.charts) for name, kind in KINDS.items()}
    assert charts == {
        "noop": [], "steps": ["clocks"], "xgboost": ["curve"],
        "mnist": ["curve", "clocks"], "command": [],
    }  # fmt: skip


def test_a_retry_of_mnist_resumes_and_other_kinds_retry_as_they_were() -> None:
    mnist = KINDS["mnist"]
    params = {"epochs": "2"}
    assert mnist.retry_params(params, 1) == params
    assert mnist.retry_params(params, 2) == {"epochs": "2", "resume": "true"}
    assert mnist.retry_params({"resume": "false"}, 3) == {"resume": "false"}  # the user's say
    assert params == {"epochs": "2"}  # not changed in place
    for name in ("noop", "steps", "xgboost", "command"):
        assert KINDS[name].retry_params({"a": "1"}, 2) == {"a": "1"}


def test_the_catalog_is_what_each_kind_checks_and_every_default_passes() -> None:
    """A parameter the catalog lists is one the kind accepts, at its default; one it does
    not list is refused by name; a bad value is refused naming the parameter."""
    for name, kind in KINDS.items():
        defaults = {p.name: p.default for p in kind.params if p.default is not None}
        for param in list(defaults):
            defaults.update(COMPANIONS.get(param, {}))
        kind.check({**BASE[name], **defaults}, 3)  # all at once: XGBoost's check trains
        for param in kind.params:
            assert not param.choices or param.default in (None, *param.choices)
        kind.check({**BASE[name], **kind.example}, 3)  # the form's example passes too
        with pytest.raises(ValueError, match="colour"):
            kind.check({**BASE[name], "colour": "red"}, 3)
    bad = {"noop": "seconds", "steps": "staleness", "xgboost": "rounds", "mnist": "ps"}
    bad["command"] = "grace_seconds"
    for name, param in bad.items():
        with pytest.raises(ValueError, match=param):
            KINDS[name].check({**BASE[name], param: "many"}, 3)


def test_the_cli_and_the_registry_import_no_heavy_library() -> None:
    """Every member, agent and service process imports the CLI: numpy and scipy alone
    would cost each about half a second of CPU at start, the service's HTTP client a
    fifth."""
    code = (
        "import sys; import coordinator.cli; from coordinator.jobs.kinds import KINDS; "
        "info = [kind.describe() for kind in KINDS.values()]; "
        "assert 'lr' in [p.name for p in info[3].params]; "
        "heavy = ('torch', 'xgboost', 'numpy', 'scipy', 'sklearn', 'httpx'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_spec_describes_the_kind_field_without_naming_kinds() -> None:
    assert "/v1/kinds" in str(JobSpec.model_fields["kind"].description)


@pytest.mark.one_etcd
def test_get_kinds_through_the_service(
    serve: Callable[..., ServiceProc],
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"read {READ_TOKEN}\nsubmit {SUBMIT_TOKEN}\n")
    tokens.chmod(0o600)
    service = serve("--token-file", str(tokens))
    assert service.http.get("/v1/kinds").status_code == 401  # no token
    answer = service.http.get("/v1/kinds", headers={"Authorization": f"Bearer {READ_TOKEN}"})
    assert answer.status_code == 200, answer.text
    described = {k["name"]: KindInfo.model_validate(k) for k in answer.json()["kinds"]}
    assert list(described) == ALL
    assert described == {name: kind.describe() for name, kind in KINDS.items()}
    mnist = described["mnist"]
    assert [(r.role, r.count_param) for r in mnist.roles] == [("server", "ps"), ("trainer", None)]
    assert mnist.barrier is not None and mnist.barrier.default_method == "bsp"
    ps = next(p for p in mnist.params if p.name == "ps")
    assert (ps.type, ps.default) == ("integer", "1")
    command = described["command"]
    assert command.needs_exec and command.takes_command
    assert [f.name for f in command.spec_fields] == ["command", "env", "working_dir"]
    assert not described["noop"].spec_fields and not described["noop"].needs_exec
    # Every kind's parameter list is the one the service checks against at submit.
    refused = service.http.post(
        "/v1/jobs",
        json={"kind": "noop", "workers": 1, "params": {"colour": "red"}},
        headers={"Authorization": f"Bearer {SUBMIT_TOKEN}"},
    )
    assert refused.status_code == 422
    assert "seconds" in refused.text  # the known list, from the same catalog
