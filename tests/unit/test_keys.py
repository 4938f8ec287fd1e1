"""Every key's exact spelling, and each parse undoing its compose (pure: no etcd).

The strings are pinned by hand: a key that changes breaks a running deployment's
members, agents and records, whatever this module's own functions agree on.
"""

from __future__ import annotations

from coordinator.keys import (
    JobKeys,
    Keys,
    ProgramKeys,
    StepKeys,
    assignments_path,
    job_path,
    leaf,
    member_name,
    new_placement,
    of_run,
    placements_of,
    rank_of,
    step_clock_rank,
)

NS = "/coordinator"
JOB = JobKeys(NS, "j1")


def test_rendezvous_keys() -> None:
    assert JOB.job == "/coordinator/jobs/j1/"
    assert JOB.rendezvous == "/coordinator/jobs/j1/rendezvous/"
    assert JOB.arrivals == "/coordinator/jobs/j1/rendezvous/arrivals/"
    assert JOB.arrival("host-1-ab") == "/coordinator/jobs/j1/rendezvous/arrivals/host-1-ab"
    assert JOB.members == "/coordinator/jobs/j1/rendezvous/members/"
    assert JOB.member(3) == "/coordinator/jobs/j1/rendezvous/members/000003"
    assert JOB.address(12) == "/coordinator/jobs/j1/rendezvous/addresses/000012"
    assert JOB.elected == "/coordinator/jobs/j1/rendezvous/elected"
    assert JOB.roster == "/coordinator/jobs/j1/rendezvous/roster"
    barrier = JOB.barrier(41, "training", 2)
    assert barrier.base == "/coordinator/jobs/j1/rendezvous/barriers/41/training/2/"
    assert barrier.arrived == "/coordinator/jobs/j1/rendezvous/barriers/41/training/2/arrived/"
    assert barrier.arrival(7) == (
        "/coordinator/jobs/j1/rendezvous/barriers/41/training/2/arrived/000007"
    )
    assert barrier.ready == "/coordinator/jobs/j1/rendezvous/barriers/41/training/2/ready"
    program = ProgramKeys(NS, "j1").barrier(41, "training", 0)
    assert program.base == "/coordinator/jobs/j1/rendezvous/program/barriers/41/training/0/"
    assert ProgramKeys(NS, "j1").members == JOB.members  # the same members as the job's


def test_what_a_job_keeps() -> None:
    assert JOB.steps == "/coordinator/jobs/j1/steps/"
    assert JOB.step_progress(1) == "/coordinator/jobs/j1/steps/progress/000001"
    assert JOB.program_rounds == "/coordinator/jobs/j1/program/rounds/"
    assert JOB.program_round(41) == "/coordinator/jobs/j1/program/rounds/00000000000000000041"
    assert JOB.program_steps(2) == "/coordinator/jobs/j1/program/steps/2/"
    assert JOB.failure(4) == "/coordinator/jobs/j1/failures/000004"
    assert JOB.command_ports(41) == "/coordinator/jobs/j1/command/41/ports/"
    assert JOB.command_port(41, 2) == "/coordinator/jobs/j1/command/41/ports/000002"
    assert JOB.command_failures(41) == "/coordinator/jobs/j1/command/41/failed/"
    assert JOB.command_failure(41, 2) == "/coordinator/jobs/j1/command/41/failed/000002"
    assert JOB.xgboost_tracker(41) == "/coordinator/jobs/j1/xgboost/41/tracker"
    assert JOB.xgboost_shard(1) == "/coordinator/jobs/j1/xgboost/shards/000001"
    assert JOB.xgboost_metrics(10) == "/coordinator/jobs/j1/xgboost/metrics/000010"
    assert JOB.xgboost_summary == "/coordinator/jobs/j1/xgboost/summary"
    assert JOB.mnist_server(0) == "/coordinator/jobs/j1/mnist/servers/000000"
    assert JOB.mnist_step_time(2) == "/coordinator/jobs/j1/mnist/step-times/000002"
    assert JOB.mnist_metrics(5) == "/coordinator/jobs/j1/mnist/metrics/000005"
    assert JOB.mnist_summary == "/coordinator/jobs/j1/mnist/summary"
    assert JOB.mnist_servers == "/coordinator/jobs/j1/mnist/servers/"
    assert JOB.mnist_step_times == "/coordinator/jobs/j1/mnist/step-times/"


def test_step_barrier_keys() -> None:
    steps = StepKeys(JOB.steps, 41)
    assert steps.clocks == "/coordinator/jobs/j1/steps/41/clocks/"
    assert steps.clock(3) == "/coordinator/jobs/j1/steps/41/clocks/000003"
    assert steps.order == "/coordinator/jobs/j1/steps/41/order/"
    assert steps.level(7) == "/coordinator/jobs/j1/steps/41/order/000000000007/"
    assert steps.ordered(7, 3) == "/coordinator/jobs/j1/steps/41/order/000000000007/000003"
    assert steps.slowest == "/coordinator/jobs/j1/steps/41/slowest"
    assert steps.at(3) == "/coordinator/jobs/j1/steps/41/at/000003"
    assert steps.mailbox(3) == "/coordinator/jobs/j1/steps/41/mail/000003/"
    assert steps.mail(3, 5) == "/coordinator/jobs/j1/steps/41/mail/000003/000005"
    assert steps.credit(3) == "/coordinator/jobs/j1/steps/dssp/000003"  # not per round
    program = StepKeys(JOB.program_steps(2), 41)
    assert program.clock(0) == "/coordinator/jobs/j1/program/steps/2/41/clocks/000000"


def test_namespace_keys() -> None:
    keys = Keys(NS)
    assert keys.job("j1") == JOB
    assert keys.jobs == "/coordinator/jobs/"
    assert keys.records == "/coordinator/api/jobs/"
    assert keys.record("j1") == "/coordinator/api/jobs/j1"
    assert keys.credentials == "/coordinator/api/credentials/"
    assert keys.credential("j1") == "/coordinator/api/credentials/j1"
    assert keys.leader == "/coordinator/api/leader"
    assert keys.agents == "/coordinator/agents/"
    assert keys.agent("host-a") == "/coordinator/agents/host-a"
    assert keys.assignments() == "/coordinator/assignments/"
    assert keys.assignments("host-a") == "/coordinator/assignments/host-a/"
    member = member_name("job-0a1b", 2, 3)
    assert member == "job-0a1b-a2-m3"
    assert keys.assignment("host-a", member) == "/coordinator/assignments/host-a/job-0a1b-a2-m3"
    assert keys.reports() == "/coordinator/reports/"
    assert keys.reports("host-a") == "/coordinator/reports/host-a/"
    assert keys.report("host-a", member) == "/coordinator/reports/host-a/job-0a1b-a2-m3"
    assert keys.placements == "/coordinator/placements/"
    placement = f"job-0a1b-a2-{'0' * 16}"
    assert keys.placement(placement) == f"/coordinator/placements/{placement}"


def test_relative_paths_and_the_empty_namespace() -> None:
    assert job_path("j1") == "jobs/j1/"
    assert assignments_path("host-a") == "assignments/host-a/"
    assert JobKeys("", "j1").member(0) == "/jobs/j1/rendezvous/members/000000"
    assert Keys("").leader == "/api/leader"
    assert Keys("/a/b").agent("x") == "/a/b/agents/x"


def test_parses_undo_composes() -> None:
    keys = Keys(NS)
    assert keys.record_id(keys.record("j1")) == "j1"
    assert keys.credential_id(keys.credential("j-2")) == "j-2"
    assert keys.assigned(keys.assignment("host-a", "r-a1-m0")) == ("host-a", "r-a1-m0")
    assert keys.placement_id(keys.placement("r-a1-abc")) == "r-a1-abc"
    assert leaf(keys.agent("host-a")) == "host-a"
    assert leaf(keys.report("host-a", "r-a1-m0")) == "r-a1-m0"
    for rank in (0, 7, 999_999):
        assert rank_of(JOB.member(rank)) == rank
        assert rank_of(JOB.barrier(1, "b", 0).arrival(rank)) == rank
        assert rank_of(StepKeys(JOB.steps, 1).mail(2, rank)) == rank
    steps = StepKeys(JOB.steps, 41)
    assert steps.level_of(steps.ordered(7, 3)) == 7
    assert steps.level_of(steps.ordered(10**12 - 1, 3)) == 10**12 - 1


def test_step_clock_rank_knows_the_clock_keys_only() -> None:
    steps = StepKeys(JOB.steps, 12)
    assert step_clock_rank(steps.clock(3)) == 3
    assert step_clock_rank(steps.ordered(7, 1)) == 1
    for other in (steps.slowest, steps.at(3), steps.mail(3, 1), steps.credit(3)):
        assert step_clock_rank(other) is None
    assert step_clock_rank(JOB.step_progress(1)) is None
    # A program's own step barriers are not the job's (they are one level deeper).
    assert step_clock_rank(StepKeys(JOB.program_steps(1), 12).clock(3)) is None


def test_member_names_and_placements() -> None:
    placement = new_placement("job-0a1b", 2)
    assert placements_of("job-0a1b", 2).fullmatch(placement)
    assert placements_of("job-0a1b").fullmatch(placement)
    assert not placements_of("job-0a1b", 1).fullmatch(placement)
    assert new_placement("job-0a1b", 2) != placement
    assert of_run(member_name("job-0a1b", 2, 0), "job-0a1b")
    assert of_run(placement, "job-0a1b")
    assert not of_run(member_name("job-0a1bc", 2, 0), "job-0a1b")
