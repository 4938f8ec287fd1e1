"""Step-duration models: `sample(worker, step, rng) -> seconds`.

The engine gives every worker its own RNG stream and asks for its steps in
order, so the k-th step of worker w lasts the same under every barrier
method: comparisons between methods use common random numbers.
"""

from __future__ import annotations

import csv
import math
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


class DelayModel(Protocol):
    def sample(self, worker: int, step: int, rng: random.Random) -> float:
        """Seconds that `worker` spends computing its `step` (1-based)."""
        ...


@dataclass(frozen=True)
class ShiftedExponential:
    """shift + Exp(mean): the PSP reference experiment uses 1 s + Exp(mean 1 s)."""

    shift: float = 1.0
    mean: float = 1.0

    def __post_init__(self) -> None:
        _check_nonneg("shift", self.shift)
        _check_nonneg("mean", self.mean)

    def sample(self, worker: int, step: int, rng: random.Random) -> float:
        if self.mean == 0:
            return self.shift
        return self.shift + rng.expovariate(1.0 / self.mean)


@dataclass(frozen=True)
class Gamma:
    """Gamma(shape, scale): heavier or lighter tails than the exponential."""

    shape: float
    scale: float

    def __post_init__(self) -> None:
        _check_pos("shape", self.shape)
        _check_pos("scale", self.scale)

    def sample(self, worker: int, step: int, rng: random.Random) -> float:
        return rng.gammavariate(self.shape, self.scale)


@dataclass(frozen=True)
class Stragglers:
    """A fixed `fraction` of workers run `factor` times slower than `base`.

    Stragglers are spread evenly over worker ids (w is one when
    floor((w+1)·f) > floor(w·f)), so exactly round-down(P·f) of P workers are
    slow, independent of the seed: persistent slowness, not noise.
    """

    fraction: float
    factor: float
    base: DelayModel = field(default_factory=ShiftedExponential)

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"straggler fraction must be in [0, 1], got {self.fraction}")
        _check_pos("factor", self.factor)

    def is_straggler(self, worker: int) -> bool:
        return math.floor((worker + 1) * self.fraction) > math.floor(worker * self.fraction)

    def sample(self, worker: int, step: int, rng: random.Random) -> float:
        seconds = self.base.sample(worker, step, rng)
        return seconds * self.factor if self.is_straggler(worker) else seconds


class Trace:
    """Replay of recorded step durations: CSV with columns worker,step,seconds.

    Steps of a worker must be 1..n with no gaps; a simulation that needs more
    steps than recorded wraps around (step k uses recorded step ((k-1) mod n)+1),
    and worker w beyond the recorded workers replays worker w mod W.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.steps = _read_trace(self.path)

    def sample(self, worker: int, step: int, rng: random.Random) -> float:
        durations = self.steps[worker % len(self.steps)]
        return durations[(step - 1) % len(durations)]


BATCH = 16  # steps drawn at once per worker; a power of two


def sampler(model: DelayModel, rngs: Sequence[random.Random]) -> Callable[[int, int], float]:
    """`draw(worker, step)`: `model.sample(worker, step, rngs[worker])`, the same numbers.

    Each worker's steps must be asked in order 1, 2, ... (the engine does). A
    shifted exponential (alone or as a straggler's base) is inlined and drawn
    `BATCH` steps of a worker at a time, from the same stream in the same order:
    at 100,000 workers, touching one worker's generator once per step is what
    costs (its 2.5 kB state falls out of the cache between two of its steps).
    """
    if isinstance(model, ShiftedExponential) and model.mean != 0:
        shift, rate, log = model.shift, 1.0 / model.mean, math.log
        uniform = [rng.random for rng in rngs]
        # worker w's next steps at [w * BATCH, (w + 1) * BATCH): one flat array of
        # doubles, one cache line per step instead of a list and a float object
        ahead = array("d", bytes(8 * BATCH * len(rngs)))
        mask, shift_bits = BATCH - 1, BATCH.bit_length() - 1

        def exponential(worker: int, step: int) -> float:
            i = (step - 1) & mask
            at = (worker << shift_bits) | i
            if i == 0:
                u = uniform[worker]  # as random.expovariate(rate): -log(1 - U) / rate
                batch = [shift + -log(1.0 - u()) / rate for _ in range(BATCH)]
                ahead[at : at + BATCH] = array("d", batch)
            return ahead[at]

        return exponential
    if isinstance(model, Stragglers):
        base, factor = sampler(model.base, rngs), model.factor
        slow = [model.is_straggler(w) for w in range(len(rngs))]

        def straggling(worker: int, step: int) -> float:
            seconds = base(worker, step)
            return seconds * factor if slow[worker] else seconds

        return straggling
    sample = model.sample

    def generic(worker: int, step: int) -> float:
        return sample(worker, step, rngs[worker])

    return generic


def _read_trace(path: Path) -> list[list[float]]:
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise ValueError(f"trace {path}: cannot open ({exc.strerror})") from None
    by_worker: dict[int, dict[int, float]] = {}
    with handle:
        reader = csv.DictReader(handle)
        missing = {"worker", "step", "seconds"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"trace {path}: missing column(s) {', '.join(sorted(missing))}")
        for row in reader:
            where = f"trace {path} row {reader.line_num}"
            try:
                worker, step = int(row["worker"]), int(row["step"])
                seconds = float(row["seconds"])
            except (TypeError, ValueError):
                raise ValueError(
                    f"{where}: worker and step must be integers and seconds a number"
                ) from None
            if worker < 0 or step < 1:
                raise ValueError(f"{where}: worker must be >= 0 and step >= 1")
            if not (seconds >= 0 and math.isfinite(seconds)):
                raise ValueError(f"{where}: seconds must be a finite number >= 0, got {seconds}")
            steps = by_worker.setdefault(worker, {})
            if step in steps:
                raise ValueError(f"{where}: duplicate step {step} for worker {worker}")
            steps[step] = seconds
    if not by_worker:
        raise ValueError(f"trace {path}: no rows")
    ids = sorted(by_worker)
    if ids != list(range(len(ids))):
        raise ValueError(f"trace {path}: workers must be numbered 0..{len(ids) - 1}, got {ids}")
    result = []
    for worker in ids:
        steps = by_worker[worker]
        if sorted(steps) != list(range(1, len(steps) + 1)):
            raise ValueError(f"trace {path}: worker {worker} steps must be 1..{len(steps)}")
        result.append([steps[k] for k in range(1, len(steps) + 1)])
    return result


def _check_nonneg(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_pos(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _numbers(kind: str, text: str, names: tuple[str, ...]) -> list[float]:
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    if len(parts) != len(names):
        raise ValueError(f"delay {kind}: expected {','.join(names)}, got {text!r}")
    values = []
    for name, part in zip(names, parts, strict=True):
        try:
            values.append(float(part))
        except ValueError:
            raise ValueError(f"delay {kind}: {name} must be a number, got {part!r}") from None
    return values


def parse_delay(spec: str) -> DelayModel:
    """Parse a CLI delay: exp:SHIFT,MEAN | gamma:SHAPE,SCALE | straggler:FRACTION,FACTOR[,BASE]
    | trace:PATH. A straggler's base is another spec after the second comma (default exp:1,1)."""
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    if not sep:
        raise ValueError(f"delay {spec!r}: expected KIND:ARGS (exp, gamma, straggler, trace)")
    try:
        if kind == "exp":
            shift, mean = _numbers(kind, rest, ("shift", "mean"))
            return ShiftedExponential(shift, mean)
        if kind == "gamma":
            shape, scale = _numbers(kind, rest, ("shape", "scale"))
            return Gamma(shape, scale)
        if kind == "straggler":
            head = rest.split(",", 2)
            base: DelayModel = ShiftedExponential()
            if len(head) == 3:
                base = parse_delay(head[2])
            fraction, factor = _numbers(kind, ",".join(head[:2]), ("fraction", "factor"))
            return Stragglers(fraction, factor, base)
        if kind == "trace":
            if not rest.strip():
                raise ValueError("delay trace: expected trace:PATH")
            return Trace(rest.strip())
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(("delay", "trace")):
            message = f"delay {kind}: {message}"
        raise ValueError(message) from None
    raise ValueError(f"delay kind {kind!r} unknown: use exp, gamma, straggler or trace")
