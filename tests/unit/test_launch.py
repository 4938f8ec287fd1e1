"""The launch package: one typed worker command, rendered and read back the same, and
whole GPUs placed on agents (pure parts; the GPU acceptance test is in test_gpus.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coordinator.context import etcd_wait_from
from coordinator.jobs.environment import program_environment
from coordinator.launch import WorkerCommand, parse_gpus
from coordinator.rendezvous.roster import Roster
from coordinator.service.placement.gang import AgentRoom, capacity, place

SECRETS = {"API_TOKEN": "s3cr3t-value"}


def full_command() -> WorkerCommand:
    return WorkerCommand(
        job_id="train", world_size=4, etcd="10.0.0.1:2379,10.0.0.2:2379", namespace="/team",
        kind="command", ttl=7, timeout=60.0, connect_timeout=3.5,
        params={"artifacts": "out", "odd": "a=b,c"}, program=("python", "x.py", "--", "a b"),
        program_env=SECRETS, working_dir="/srv/work", gpus=(2, 0),
        etcd_user="job-train", etcd_password_file="/run/pw", etcd_ca="/ca.pem",
    )  # fmt: skip


def test_a_worker_command_renders_argv_and_env_and_reads_back_equal() -> None:
    command = full_command()
    argv, env = command.argv(), command.env()
    assert WorkerCommand.from_argv(argv, env) == command
    assert argv[argv.index("--") + 1 :] == ["python", "x.py", "--", "a b"]  # one list
    public = " ".join(argv)
    for secret in ("s3cr3t-value", "API_TOKEN", "/run/pw", "job-train", "/srv/work"):
        assert secret not in public
    assert env["COORDINATOR_GPUS"] == "2,0" and env["COORDINATOR_ETCD_PASSWORD_FILE"] == "/run/pw"
    bare = WorkerCommand(job_id="j", world_size=1)
    assert bare.argv() == ["--job", "j", "--world-size", "1"] and bare.env() == {}
    assert WorkerCommand.from_argv(bare.argv(), {}) == bare


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "2"], "--job is missing"),
        (["--job", "j"], "--world-size is missing"),
        (["--job", "j", "--world-size"], "no value"),
        (["--job", "j", "--job", "k", "--world-size", "1"], "more than once"),
        (["--job", "j", "--world-size", "1", "--etcd-password-file", "/x"], "not an option"),
        (["--job", "j", "--world-size", "1", "--param", "novalue"], "KEY=VALUE"),
        (["--job", "j", "--world-size", "1", "--kind", "rm"], "not a job kind"),
        (["--job", "j", "--world-size", "0"], "world_size"),
    ],
)
def test_bad_worker_argv_is_refused_naming_the_option(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerCommand.from_argv(argv)


def test_gpu_ids_are_small_non_negative_and_unique() -> None:
    assert parse_gpus("0,1, 3") == (0, 1, 3) and parse_gpus("") == ()
    for bad, message in [("0,0", "more than once"), ("-1", "not a whole"), ("x", "not a whole"),
                         ("5000", "not a whole")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_gpus(bad)
    with pytest.raises(ValueError, match="more than once"):
        WorkerCommand(job_id="j", world_size=1, gpus=(1, 1))


def test_placement_gives_whole_gpus_never_one_held_and_needs_them_all() -> None:
    rooms = [AgentRoom("a", 4, gpus=(0, 1)), AgentRoom("b", 4, used=1, gpus=(0, 1, 2),
                                                     gpus_used=frozenset({1}))]  # fmt: skip
    placed = place(rooms, 4, {}, gpus_per_worker=1)
    assert placed is not None
    by_agent: dict[str, list[int]] = {}
    for agent_id, gpus in placed:
        by_agent.setdefault(agent_id, []).extend(gpus)
    assert sorted(by_agent["a"]) == [0, 1] and sorted(by_agent["b"]) == [0, 2]  # 1 is held
    assert place(rooms, 5, {}, gpus_per_worker=1) is None  # 4 free GPUs: nothing is placed
    assert place(rooms, 2, {}, gpus_per_worker=2) == [("a", (0, 1)), ("b", (0, 2))]
    assert capacity(rooms, {}, gpus_per_worker=2) == 2  # all free: a's pair, b's one pair
    assert place([AgentRoom("cpu", 8)], 1, {}, gpus_per_worker=1) is None


def environment_of(base: dict[str, str], **extra: Any) -> dict[str, str]:
    """A one-member job's program environment over `base`."""
    roster = Roster.model_validate(
        {"job_id": "j", "round": 1, "world_size": 1, "secret": "0" * 64,
         "members": [{"rank": 0, "member_id": "m", "host": "127.0.0.1", "port": 1,
                      "hostname": "h", "pid": 1}]}
    )  # fmt: skip
    return program_environment(
        base, roster=roster, rank=0, ports={0: 2}, roster_file=Path("/r"),
        artifacts=Path("/a"), etcd_endpoints="e", namespace="/n", **extra,
    )  # fmt: skip


def test_a_members_gpus_become_its_programs_cuda_visible_devices() -> None:
    env = environment_of({"COORDINATOR_GPUS": "1,3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "CUDA_VISIBLE_DEVICES" not in environment_of({})


def test_a_program_waits_for_etcd_as_long_as_its_member() -> None:
    # never what the member's own environment says
    env = environment_of({"COORDINATOR_ETCD_WAIT": "9999"}, etcd_wait=65.0)
    assert env["COORDINATOR_ETCD_WAIT"] == "65"
    assert etcd_wait_from(env) == 65.0
    for untrusted in ("", "soon", "0", "nan", "1e9", "-5"):
        assert etcd_wait_from({"COORDINATOR_ETCD_WAIT": untrusted}) is None, untrusted
