"""Every command the README shows is run by a test: a few here, as written, and each of
the others by the test named beside it. A command added to the README without a test,
or a test renamed away from its command, fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from coordinator.etcd.security import ENV
from tests.support.service import free_port, stop_service_etcd
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SYSTEM = "tests/system"

#: Each README command (its text before the comment; `a; b` counts as two) -> what runs
#: it: `file::test`, or a file that runs it (CI runs `.ci/run`).
# fmt: off
RUN_BY = {
    "pip install -e . && coordinator run xgboost --workers 2":
        f"{SYSTEM}/test_cli.py::test_the_readmes_first_command_trains_xgboost_end_to_end",
    "pip install -e '.[test]' && python -m pytest":
        ".ci/run",
    "python -m pytest tests/unit":
        ".ci/run",
    "pip install -e '.[mnist]'":
        ".ci/run",
    "coordinator run --workers 3 -- python examples/ddp_mnist.py --steps 5":
        f"{SYSTEM}/test_command_kind.py::test_the_ddp_example_trains_as_under_torchrun",
    "coordinator run --workers 3 -- python examples/xgboost_collective.py":
        f"{SYSTEM}/test_command_kind.py::test_the_xgboost_example_trains_one_model_through_the_collective",
    "coordinator run --workers 3 -- python examples/roster.py":
        f"{SYSTEM}/test_command_kind.py::test_the_roster_example_shows_every_member_to_every_member",
    "coordinator run --workers 3 -- python examples/ssp_loop.py":
        f"{SYSTEM}/test_context.py::test_the_ssp_loop_example_trains_and_reports_its_loss",
    "coordinator run --workers 3 -- python examples/ps_custom.py --ps 1":
        f"{SYSTEM}/test_ps_api.py::test_the_custom_example_reaches_its_accuracy_under_ssp_with_a_straggler",
    "coordinator etcd":
        f"{SYSTEM}/test_cli.py::test_ctrl_c_stops_the_embedded_etcd",
    "coordinator worker --job demo --world-size 3 --etcd https://127.0.0.1:PORT -- python train.py":
        f"{SYSTEM}/test_etcd_auth.py::test_members_started_by_hand_run_as_a_job_user_made_by_the_credentials_command",
    "coordinator serve":
        f"{SYSTEM}/test_service.py::test_the_cli_submits_waits_and_mirrors_the_outcome",
    "coordinator submit xgboost --workers 3 --param rounds=5 --wait":
        f"{SYSTEM}/test_readme.py::test_the_service_commands_run_a_job_through_the_service",
    "coordinator jobs":
        f"{SYSTEM}/test_readme.py::test_the_service_commands_run_a_job_through_the_service",
    "coordinator status ID":
        f"{SYSTEM}/test_readme.py::test_the_service_commands_run_a_job_through_the_service",
    "coordinator logs ID --rank 0":
        f"{SYSTEM}/test_readme.py::test_the_service_commands_run_a_job_through_the_service",
    "coordinator cancel ID":
        f"{SYSTEM}/test_readme.py::test_the_service_commands_run_a_job_through_the_service",
    "coordinator credentials token exec":
        f"{SYSTEM}/test_command_service.py::test_a_newcomer_makes_an_exec_token_and_submits_a_program_with_it",
    "coordinator serve --token-file coordinator-data/api-token":
        f"{SYSTEM}/test_command_service.py::test_a_newcomer_makes_an_exec_token_and_submits_a_program_with_it",
    "coordinator submit --workers 3 --wait -- python train.py":
        f"{SYSTEM}/test_command_service.py::test_a_newcomer_makes_an_exec_token_and_submits_a_program_with_it",
    "coordinator credentials agent h1 --out h1.password --data-dir coordinator-data":
        f"{SYSTEM}/test_etcd_auth.py::test_a_local_user_without_credentials_gets_nothing",
    "coordinator serve --etcd HOST:PORT --default-launcher agents":
        f"{SYSTEM}/test_agents_launcher.py::test_jobs_share_three_agents_wait_for_room_and_never_over_fill_one",
    "coordinator run xgboost --workers 2":
        f"{SYSTEM}/test_cli.py::test_the_readmes_first_command_trains_xgboost_end_to_end",
    "coordinator run mnist --workers 3 --epochs 1":
        f"{SYSTEM}/test_readme.py::test_the_readmes_own_commands_run_as_written",
    "sudo compose/init-secrets.sh":
        f"{SYSTEM}/containers/test_compose.py::test_compose_product_with_tls_and_auth_runs_a_job_and_refuses_others_in_etcd",
    "docker compose -f compose/compose.yaml up -d --build":
        f"{SYSTEM}/containers/test_compose.py::test_compose_product_with_tls_and_auth_runs_a_job_and_refuses_others_in_etcd",
    "docker compose -f compose/compose.yaml down -v":
        f"{SYSTEM}/containers/test_compose.py::test_compose_product_with_tls_and_auth_runs_a_job_and_refuses_others_in_etcd",
    "bash .ci/run":
        ".ci/run",
    "python -m pytest -m slow":
        ".ci/run",
    "coordinator agent --id h1 --etcd HOST:PORT --etcd-user /coordinator/agents/h1 --etcd-password-file h1.password --service-key coordinator-data/signing-key.pub --slots 2":  # noqa: E501
        f"{SYSTEM}/test_etcd_auth.py::test_an_agent_as_its_own_user_runs_a_committed_placement_and_one_that_cannot_read_refuses",
    "coordinator simulate --workers 200 --seconds 200 --barrier bsp,asp,ssp:4,pbsp:10,pssp:4:10 --out sim/":  # noqa: E501
        f"{SYSTEM}/test_readme.py::test_the_readmes_own_commands_run_as_written",
    "coordinator submit xgboost --workers 3 --server http://localhost:8080 --token <submit token> --wait":  # noqa: E501
        f"{SYSTEM}/containers/test_compose.py::test_compose_product_with_tls_and_auth_runs_a_job_and_refuses_others_in_etcd",
}
# fmt: on


def readme_commands() -> list[str]:
    """The commands of the README's `sh` blocks: continuation lines joined, comments cut,
    `a; b` split."""
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            text = re.split(r"\s+#\s", " " + line, maxsplit=1)[0].strip()
            commands += [" ".join(part.split()) for part in text.split("; ") if part.strip()]
    return commands


def test_every_command_of_the_readme_is_run_by_a_test() -> None:
    shown = readme_commands()
    assert shown, "no command found in the README"
    assert sorted(set(shown) - set(RUN_BY)) == [], "README commands no test runs"
    assert sorted(set(RUN_BY) - set(shown)) == [], "commands the README no longer shows"
    for command, where in RUN_BY.items():
        path, _, test = where.partition("::")
        assert (REPO / path).is_file(), f"{command}: {path} is gone"
        if test:
            assert f"def {test}(" in (REPO / path).read_text(), f"{command}: {where} is gone"


def fresh_user_env(tmp_path: Path) -> dict[str, str]:
    """A new user's environment: no etcd settings of the tests', no token, no artifacts."""
    unset = {*ENV.values(), "COORDINATOR_ARTIFACTS", "COORDINATOR_TOKEN", "COORDINATOR_DATA"}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, "COLUMNS": "200"}


def coordinator(
    args: str, cwd: Path, env: dict[str, str], timeout: float = 300, codes: tuple[int, ...] = (0,)
) -> str:
    """`args` as a shell would split it (the README's have no quotes), run as a user
    would; what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", *args.split()[1:]],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode in codes, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


@pytest.mark.one_etcd
def test_the_readmes_own_commands_run_as_written(tmp_path: Path) -> None:
    env = fresh_user_env(tmp_path)
    simulate = "coordinator simulate --workers 200 --seconds 200 "
    simulate += "--barrier bsp,asp,ssp:4,pbsp:10,pssp:4:10 --out sim/"
    coordinator(simulate, tmp_path, env)
    assert (tmp_path / "sim" / "steps.csv").is_file()
    said = coordinator("coordinator run mnist --workers 3 --epochs 1", tmp_path, env)
    assert "all 3 workers passed every phase" in said
    assert len(list(tmp_path.glob("artifacts/*/model.pt"))) == 1


@pytest.mark.one_etcd
def test_the_service_commands_run_a_job_through_the_service(tmp_path: Path) -> None:
    """`coordinator serve` in a folder of its own (its own etcd and token there), then the
    README's client commands from that folder."""
    env = fresh_user_env(tmp_path)
    port = str(free_port())
    serve = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "serve", "--port", port, "--grace", "3"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    env["COORDINATOR_SERVER"] = f"http://127.0.0.1:{port}"
    try:
        ready = f"http://127.0.0.1:{port}/readyz"
        wait_until(lambda: _answers(ready), 60, "the service ready")
        said = coordinator("coordinator submit xgboost --workers 3 --param rounds=5 --wait",
                           tmp_path, env)  # fmt: skip
        job = re.search(r"^(\S+): SUCCEEDED", said, re.M)
        assert job, said
        assert job[1] in coordinator("coordinator jobs", tmp_path, env)
        assert "every member exited 0" in coordinator(f"coordinator status {job[1]}", tmp_path, env)
        assert "[rank 0]" in coordinator(f"coordinator logs {job[1]} --rank 0", tmp_path, env)
        long = coordinator("coordinator submit noop --workers 1 --param seconds=60", tmp_path, env)
        other = long.split(":")[0].strip()
        assert "cancel requested" in coordinator(f"coordinator cancel {other}", tmp_path, env)
        wait_until(
            lambda: "CANCELLED" in coordinator(f"coordinator status {other}", tmp_path, env,
                                               codes=(0, 130)),
            60, "the cancelled job to end",
        )  # fmt: skip
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        stop_service_etcd(tmp_path / "coordinator-data")  # if a job kept it up


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
