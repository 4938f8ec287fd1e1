"""The API's simulator runs: priced before they start, and run apart from the service.

A request's cost is the number of steps it simulates: workers x seconds / the delay
model's mean step time, once per method. Above `MAX_SIMULATED_STEPS` it is refused,
naming the fields (the CLI's `coordinator simulate` has no such bound). An accepted
run gets a fresh spawned process of its own (never the service's threads, which the
other endpoints need), at most `MAX_RUNNING` at once and `MAX_WAITING` more queued
(beyond those: 429), killed at `TIMEOUT_SECONDS` from its start (the wait in the
queue does not count), when its client goes away, or when the service stops (503:
`stop` is called as SIGTERM arrives, before the server cancels what still runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from coordinator.simulator.delays import DelayModel, Gamma, ShiftedExponential, Stragglers

#: Steps over all methods; the slowest method (pbsp) simulates some 200,000-300,000 a
#: second here, so a run at the bound takes about 10 s (killed at TIMEOUT_SECONDS).
MAX_SIMULATED_STEPS = 2_000_000
MAX_RUNNING = 1
MAX_WAITING = 2
TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.05


class Unaffordable(ValueError):
    """A request refused before it runs; `fields` are the ones that set its size."""

    def __init__(self, fields: list[str], message: str) -> None:
        super().__init__(message)
        self.fields = fields


class Busy(RuntimeError):
    """Every place to run or to wait is taken: try again later (429)."""


class Abandoned(RuntimeError):
    """The client went away, or the service is stopping: the run was killed."""


class TimedOut(RuntimeError):
    pass


class Stopping(RuntimeError):
    """The service is stopping: the run was killed, or never started (503)."""


def parse_api_delay(text: str) -> DelayModel:
    """The delay model of an API request: any but `trace:`, which would read a server file."""
    from coordinator.simulator.delays import parse_delay

    if text.strip().lower().startswith("trace"):
        raise ValueError(
            "delay trace: reads a file on the server, so only `coordinator simulate` takes it"
        )
    return parse_delay(text)


def shortest_mean_step(model: DelayModel) -> float:
    """The smallest mean step time any worker has under `model`, in seconds."""
    if isinstance(model, ShiftedExponential):
        return model.shift + model.mean
    if isinstance(model, Gamma):
        return model.shape * model.scale
    if isinstance(model, Stragglers):
        base = shortest_mean_step(model.base)
        return base * min(1.0, model.factor) if model.fraction > 0 else base
    raise ValueError(f"delay: {type(model).__name__} is not offered here")


def estimated_steps(workers: int, seconds: float, methods: int, model: DelayModel) -> float:
    mean = shortest_mean_step(model)
    if not mean > 0 or not math.isfinite(mean):
        return math.inf
    return workers * seconds / mean * methods


def check_affordable(workers: int, seconds: float, methods: int, model: DelayModel) -> None:
    steps = estimated_steps(workers, seconds, methods, model)
    if steps > MAX_SIMULATED_STEPS:
        raise Unaffordable(
            ["workers", "seconds", "delay", "barrier"],
            f"about {steps:,.0f} simulated steps (workers x seconds / mean step "
            f"{shortest_mean_step(model):g}s x {methods} methods); at most "
            f"{MAX_SIMULATED_STEPS:,} here: run `coordinator simulate` for more",
        )


def simulate_methods(request: dict[str, Any]) -> dict[str, Any]:
    """The work of one request (in the spawned process): each method's summary and final
    steps, as plain data."""
    from coordinator.barriers.arguments import barrier_list
    from coordinator.simulator import engine, report

    model = parse_api_delay(request["delay"])
    methods = []
    for spec in barrier_list(request["barrier"], None, None, None):
        result = engine.simulate(
            spec, request["workers"], request["seconds"], model, seed=request["seed"]
        )
        methods.append(
            {
                "label": result.label,
                "summary": report.summary(result),
                "final_steps": sorted(result.final_step),
            }
        )
    return {"methods": methods}


def _child(work: Callable[[Any], Any], argument: Any, pipe: Connection) -> None:
    """The spawned process: dies with the service, yields the CPU to it, sends one answer."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive it
    os.nice(10)  # the service's own endpoints come first
    try:
        pipe.send(("ok", work(argument)))
    except ValueError as exc:
        pipe.send(("invalid", str(exc)))
    finally:
        pipe.close()


class Runner:
    """Runs simulations in spawned processes, a bounded number at a time."""

    def __init__(
        self,
        running: int = MAX_RUNNING,
        waiting: int = MAX_WAITING,
        timeout: float = TIMEOUT_SECONDS,
    ) -> None:
        self._slots = asyncio.Semaphore(running)
        self._admitted = 0
        self._limit = running + waiting
        self.timeout = timeout
        self._processes: set[BaseProcess] = set()
        self._context = multiprocessing.get_context("spawn")
        self._stopping = False

    async def run(
        self, work: Callable[[Any], Any], argument: Any, gone: Callable[[], Awaitable[bool]]
    ) -> Any:
        """`work(argument)` in a process of its own; `gone` says the client has left.
        Raises Busy, TimedOut, Abandoned, Stopping, or ValueError (the work's own refusal).
        The timeout counts from the run's start, not from its place in the queue."""
        if self._stopping:
            raise Stopping("the service is stopping")
        if self._admitted >= self._limit:
            raise Busy("the simulator is busy: try again in a few seconds")
        self._admitted += 1
        try:
            async with self._slots:
                if self._stopping:
                    raise Stopping("the service is stopping")
                deadline = time.monotonic() + self.timeout
                return await self._in_process(work, argument, gone, deadline)
        finally:
            self._admitted -= 1

    async def _in_process(
        self,
        work: Callable[[Any], Any],
        argument: Any,
        gone: Callable[[], Awaitable[bool]],
        deadline: float,
    ) -> Any:
        receiving, sending = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_child, args=(work, argument, sending), daemon=True)
        process.start()
        sending.close()
        self._processes.add(process)
        try:
            while True:
                if receiving.poll():
                    status, value = receiving.recv()
                    if status == "invalid":
                        raise ValueError(value)
                    return value
                if self._stopping:
                    raise Stopping("the service is stopping: the simulation was stopped")
                if not process.is_alive() and not receiving.poll():
                    raise RuntimeError(f"the simulation ended with code {process.exitcode}")
                if time.monotonic() > deadline:
                    raise TimedOut(f"the simulation took more than {self.timeout:g}s")
                if await gone():
                    raise Abandoned("the client went away")
                await asyncio.sleep(POLL_SECONDS)
        finally:
            self._processes.discard(process)
            _kill(process)
            receiving.close()

    def stop(self) -> None:
        """The service is stopping: every run and every queued request ends with Stopping
        at its next poll, and nothing new starts. Only sets a flag: safe in a signal
        handler."""
        self._stopping = True

    def close(self) -> None:
        """Kill every run (the service has stopped)."""
        self._stopping = True
        for process in list(self._processes):
            _kill(process)


def _kill(process: BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join(1)
