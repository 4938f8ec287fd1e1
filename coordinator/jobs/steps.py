"""The `steps` job: iterative "training" steps paced by a step barrier on etcd.

Each worker loops: wait for its turn (the method's rule), do one step (a
sleep of `step_seconds`, `straggler_factor` times longer on `straggler_rank`),
publish its clock. It returns what it saw at every passage (its clock, the
slowest clock the decision relied on, the peers' clocks it read), so the
method's rule can be checked from recorded clocks.

Stop conditions mean what they say (seed 000: TensorFlow's per-worker
`num_steps` counted from a shared global step made late workers train longer):

- `last_step=T`: an absolute target on the worker's own clock; it stops when
  its clock reaches T, whenever it started or restarted.
- `num_steps=N`: exactly N steps per worker, counted on its own clock.

Each worker's progress is kept in `<job>/steps/progress/<rank>` (not leased):
`{"clock", "target"}`. A restarted worker resumes from its clock with the
target fixed at its first start, so a restart neither repeats nor adds steps.
Everyone passes a start barrier first, so all begin together; a finished
worker says so and stops constraining the others, so nobody hangs on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from coordinator.barriers.arguments import barrier_from_params
from coordinator.barriers.live import LiveBarrier, OnLoss
from coordinator.barriers.policy import BarrierSpec
from coordinator.events import Step, emit
from coordinator.jobs import catalog
from coordinator.jobs.params import check_known, float_param, int_param

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member

REPORT_SECONDS = 0.5  # at most this often a `step` event (progress) is printed
KNOWN = catalog.names(catalog.STEPS)


@dataclass(frozen=True)
class StepOptions:
    spec: BarrierSpec
    num_steps: int | None
    last_step: int | None
    step_seconds: float
    straggler_rank: int | None
    straggler_factor: float
    on_loss: OnLoss
    seed: int | None


def parse_barrier(job: str, params: dict[str, str]) -> tuple[BarrierSpec, OnLoss]:
    """The barrier method and what a lost peer does; a ValueError names the bad field."""
    try:
        return barrier_from_params(params)
    except ValueError as exc:
        raise ValueError(f"{job} job: {exc}") from None


def parse_stop(
    job: str, params: dict[str, str], *, required: bool = True
) -> tuple[int | None, ...]:
    """`num_steps` and `last_step`: exactly one (at most one unless `required`), >= 0."""
    num_steps, last_step = (
        int_param(job, params, "num_steps"),
        int_param(job, params, "last_step"),
    )
    if (num_steps is not None and last_step is not None) or (
        required and num_steps is None and last_step is None
    ):
        raise ValueError(f"{job} job: give exactly one of num_steps and last_step")
    for name, value in (("num_steps", num_steps), ("last_step", last_step)):
        if value is not None and value < 0:
            raise ValueError(f"{job} job: parameter {name} must be >= 0, got {value}")
    return num_steps, last_step


def parse_straggler(job: str, params: dict[str, str], ranks: range) -> tuple[int | None, float]:
    """Which rank is slowed down (it must be one that steps), and by what factor."""
    straggler = int_param(job, params, "straggler_rank")
    if straggler is not None and straggler not in ranks:
        raise ValueError(
            f"{job} job: parameter straggler_rank={straggler} is not a rank that steps "
            f"({ranks.start}..{ranks.stop - 1})"
        )
    if "straggler_factor" in params and straggler is None:
        raise ValueError(f"{job} job: parameter straggler_factor needs straggler_rank")
    factor = float_param(job, params, "straggler_factor", 1.0)
    if factor < 1:
        raise ValueError(f"{job} job: parameter straggler_factor must be >= 1, got {factor:g}")
    return straggler, factor


def parse(params: dict[str, str], world_size: int) -> StepOptions:
    """Check every parameter before any waiting; a ValueError names the bad field."""
    check_known("steps", params, KNOWN)
    spec, on_loss = parse_barrier("steps", params)
    num_steps, last_step = parse_stop("steps", params)
    straggler, factor = parse_straggler("steps", params, range(world_size))
    return StepOptions(
        spec=spec,
        num_steps=num_steps,
        last_step=last_step,
        step_seconds=float_param("steps", params, "step_seconds", 0.0),
        straggler_rank=straggler,
        straggler_factor=factor,
        on_loss=on_loss,
        seed=int_param("steps", params, "seed"),
    )


def run(member: Member, options: StepOptions) -> dict[str, object]:
    spec = options.spec
    key = member.keys.step_progress(member.rank)
    kv = member.etcd.get(key)
    saved = json.loads(kv.value) if kv is not None else None
    start = int(saved["clock"]) if saved else 0
    if saved:
        target = int(saved["target"])  # fixed at the first start: a restart adds nothing
    elif options.last_step is not None:
        target = options.last_step
    else:
        target = start + (options.num_steps or 0)
    step_seconds = options.step_seconds
    if options.straggler_rank == member.rank:
        step_seconds *= options.straggler_factor
    if options.on_loss == OnLoss.CONTINUE:
        member.carry_on_without_lost()
    barrier = LiveBarrier(
        member, spec, on_loss=options.on_loss, start_clock=start, seed=options.seed
    )
    passages: list[list[object]] = []
    waited = 0.0
    try:
        barrier.start()
        member.phase = "training"  # after the start barrier: failures name the phase
        began = time.time()
        first_step_at: float | None = None
        reported = 0.0
        while barrier.clock < target:
            passage = barrier.wait_turn()
            waited += passage.waited
            passages.append([passage.clock, passage.slowest, passage.observed])
            if first_step_at is None:
                first_step_at = time.time()
            time.sleep(step_seconds)  # the stand-in for one step's compute
            barrier.complete()
            member.etcd.put(key, json.dumps({"clock": barrier.clock, "target": target}))
            if time.monotonic() - reported > REPORT_SECONDS or barrier.clock >= target:
                reported = time.monotonic()  # for the service's progress and the dashboard
                emit(Step(rank=member.rank, clock=barrier.clock, target=target))
        barrier.finish()
    finally:
        barrier.close()
    return {
        "method": str(spec),
        "rank": member.rank,
        "start_clock": start,
        "final_clock": barrier.clock,
        "target": target,
        "steps": barrier.clock - start,
        "wait_seconds": round(waited, 6),
        "began": began,
        "first_step_at": first_step_at,
        "ended": time.time(),
        "passages": passages,
        "lost": barrier.counters.lost,
        "checks": barrier.counters.checks,
        "reads": barrier.counters.reads,
    }
