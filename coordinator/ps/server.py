"""One parameter server: its share of the model, updated by the trainers' gradients.

Each trainer holds one connection to each server (a thread here per
connection). A gradient is applied as it arrives, under one lock, with the
chosen optimizer; its staleness (server version at apply minus the version the
trainer computed it from) is logged. With `aggregate`, the gradients of one
step from every live trainer are averaged, in trainer order, into one update,
and each trainer's ACK waits for it: synchronous SGD. A PUSH_PULL is a PUSH answered
by the weights with that gradient applied (WEIGHTS, b = the staleness) instead of the
ACK: a trainer's push and next pull in one round trip.

Published weights are never written again: an update reads them and writes
the next weights into a free buffer (`optim.FlatOptimizer`), which it then
publishes (`published.PublishedWeights`). A pull takes the published buffer
under the lock and sends it without the lock and without a copy, while further
updates go on, and no trainer ever reads weights an update is half-way through.

Every `checkpoints.every` updates the server writes its share, the optimizer
state, its version and the trainers' clocks to a file (`checkpoints.py`), from
which a rerun that resumes continues.

A connection reaches `handle` only after the member endpoint's handshake, so
HELLO's fields are read from a peer that proved the round's secret; still every
field and header is checked: HELLO strictly typed, a trainer index in range and
claimed once, no payload where none belongs, a gradient exactly the layout's
size (checked before reading it), a version no later than the job can reach,
and a PULL waits for a version no longer than the connection's idle timeout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from coordinator.ps import wire
from coordinator.ps.checkpoints import Checkpoints, Saved
from coordinator.ps.optim import FlatOptimizer, OptimizerSpec
from coordinator.ps.published import PublishedWeights
from coordinator.ps.rules import UpdateRule, Updates, default_rule
from coordinator.ps.wire import Dtype, Hello, Kind, PeerClosed, ProtocolError

MAX_CLOCK = 1 << 40  # a trainer's clock in a PUSH: far beyond any job, far below overflow


@dataclass(frozen=True)
class Applied:
    """One gradient as the server applied it: the staleness log's row."""

    trainer: int  # trainer index (0-based)
    clock: int  # the trainer's clock after the step this gradient came from
    computed_from: int  # the server version the trainer pulled
    applied_at: int  # the server version just before this update
    t: float  # seconds since the server started serving

    @property
    def staleness(self) -> int:
        return self.applied_at - self.computed_from


@dataclass
class _Trainer:
    clock: int = 0
    connected: bool = False
    finished: bool = False
    gone: str = ""  # why its connection ended before it said BYE


@dataclass
class _Step:
    """Gradients of one step waiting to be averaged (aggregate mode)."""

    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    applied: bool = False


class ParameterServer:
    """Serve one share of the parameters to `trainers` trainers (see the module docstring)."""

    def __init__(
        self,
        *,
        job_id: str,
        round_: int,
        index: int,
        tensors: Sequence[tuple[str, torch.Tensor]],
        trainers: int,
        optimizer: OptimizerSpec,
        rule: UpdateRule | None = None,
        aggregate: bool = False,
        checkpoints: Checkpoints | None = None,
        max_updates: int | None = None,
    ) -> None:
        """`rule`: the update rule (`coordinator.ps.rules`; default: the optimizer's);
        `max_updates`: the most updates this run can apply (None: no bound); a PULL
        for a later version is refused instead of waiting for ever."""
        self.job_id, self.round, self.index = job_id, round_, index
        self.layout = [(name, list(t.shape)) for name, t in tensors]
        self.digest = wire.layout_digest(self.layout)
        # The whole share as one flat tensor: SGD and Adam are elementwise, so this is
        # the same update as per tensor, in one call instead of one per tensor.
        self.size = sum(t.numel() for _, t in tensors)
        self.weights = PublishedWeights(torch.cat([t.detach().reshape(-1) for _, t in tensors]))
        self.optimizer = FlatOptimizer(optimizer, self.size)
        self.rule = Updates(
            rule or default_rule(optimizer.name, aggregate),
            trainers=trainers,
            aggregate=aggregate,
            momentum=optimizer.momentum,
        )
        #: dc: per trainer, (version, the weights it last pulled: a borrowed buffer).
        self.pulled: dict[int, tuple[int, torch.Tensor]] = {}
        self.aggregate = aggregate
        self.version = 0
        self.trainers = {t: _Trainer() for t in range(trainers)}
        self.excused: set[int] = set()  # trainers the job goes on without
        self.log: list[Applied] = []
        self.checkpoints = checkpoints
        self.resumed_from: int | None = None
        self.started = time.monotonic()
        self.changed = threading.Condition()
        self._steps: dict[int, _Step] = {}
        self._closed = False
        saved = checkpoints.to_resume(self.digest, trainers, self.size) if checkpoints else None
        if saved is not None:
            self._restore(saved)
        self.start_clocks = {t: s.clock for t, s in self.trainers.items()}
        self.last_version = None if max_updates is None else self.version + max_updates

    # -- the protocol, one thread per connection ---------------------------

    def handle(self, sock: socket.socket) -> None:
        """Serve one connection until BYE or until it breaks (the endpoint's handler)."""
        wire.tune(sock)
        try:
            header = wire.receive_header(sock)
        except (PeerClosed, ProtocolError):
            return  # a probe: it closed after the handshake
        trainer: int | None = None
        try:
            if header.kind != Kind.HELLO:
                raise ProtocolError(f"expected HELLO, got {header.kind.name}")
            hello = wire.read_hello(wire.receive_json(sock, header))
            trainer = self._welcome(sock, hello)
            self._serve(sock, trainer)
        except (PeerClosed, ProtocolError) as exc:
            if trainer is not None:
                self._gone(trainer, str(exc))
            elif not isinstance(exc, PeerClosed):
                with contextlib.suppress(OSError):  # it may be gone already
                    wire.send_json(sock, Kind.ERROR, {"message": str(exc)})

    def _welcome(self, sock: socket.socket, hello: Hello) -> int | None:
        """Check who is calling; returns its trainer index (None for a reader). A refusal
        states the caller's mistake, never this server's job, round or layout."""
        if (hello.job, hello.round) != (self.job_id, self.round):
            raise ProtocolError("HELLO names another job or round than this server's")
        if hello.layout != self.digest:
            raise ProtocolError(
                f"HELLO's model layout differs from server {self.index}'s: members run "
                "different model code"
            )
        trainer = hello.trainer
        with self.changed:
            if trainer is not None:
                if trainer not in self.trainers:
                    raise ProtocolError(
                        f"trainer {trainer} is not one of the {len(self.trainers)} trainers"
                    )
                if self.trainers[trainer].connected:
                    raise ProtocolError(f"trainer {trainer} is already connected")
                self.trainers[trainer].connected = True
            clock = self.trainers[trainer].clock if trainer is not None else 0
            wire.send_json(sock, Kind.WELCOME, {"server": self.index}, a=self.version, b=clock)
        return trainer

    def _serve(self, sock: socket.socket, trainer: int | None) -> None:
        grad = torch.empty(self.size)
        while True:
            header = wire.expect(sock, Kind.PULL, Kind.PUSH, Kind.PUSH_PULL, Kind.BYE)
            if header.kind == Kind.PULL:
                wire.expect_no_payload(header)
                weights, version = self._borrow_at_least(header.a, sock.gettimeout(), trainer)
                self._send(sock, weights, version, 0)
            elif header.kind in (Kind.PUSH, Kind.PUSH_PULL):
                if trainer is None:
                    raise ProtocolError("a reader cannot push gradients")
                if header.a > self.version:  # versions only grow: checked before reading
                    raise ProtocolError(
                        f"PUSH computed from version {header.a}, which the server has not reached"
                    )
                if not 0 < header.b <= MAX_CLOCK:
                    raise ProtocolError(f"PUSH clock {header.b} is out of range")
                wire.receive_tensor(sock, header, _view(grad))
                if self.aggregate:
                    version, staleness = self._aggregate(trainer, header.b, header.a, grad)
                    grad = torch.empty(self.size)  # the step keeps the old buffer
                    if header.kind == Kind.PUSH:
                        wire.send(sock, Kind.ACK, version, staleness)
                    else:  # the step's weights (or later ones), in the same round trip
                        self._send(sock, *self._borrow_at_least(version, None), staleness)
                else:
                    weights_back = header.kind == Kind.PUSH_PULL
                    self._apply(sock, trainer, header.b, header.a, grad, weights_back)
            else:
                wire.expect_no_payload(header)
                with self.changed:
                    if trainer is not None:
                        self.trainers[trainer].finished = True
                        self._release_pulled(trainer)
                    self._aggregate_ready()
                    self.changed.notify_all()
                wire.send(sock, Kind.ACK, self.version, 0)
                return

    def _send(self, sock: socket.socket, weights: torch.Tensor, version: int, b: int) -> None:
        """WEIGHTS: a borrowed buffer, sent without the lock and without a copy, then given
        back; `b` is 0 after a PULL, the staleness after a PUSH_PULL."""
        try:
            wire.send(sock, Kind.WEIGHTS, version, b, [_view(weights)], Dtype.FLOAT32)
        finally:
            with self.changed:
                self.weights.give_back(weights)

    def _borrow_at_least(
        self, least: int, timeout: float | None, trainer: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """The published weights once at `least` versions, waiting at most `timeout`,
        borrowed for `trainer` (`_borrow`)."""
        if self.last_version is not None and least > self.last_version:
            raise ProtocolError(
                f"PULL asks for version {least}, beyond the last this run can reach"
            )
        with self.changed:
            if not self.changed.wait_for(lambda: self.version >= least or self._closed, timeout):
                raise ProtocolError(f"PULL waited {timeout:g}s for version {least} in vain")
            return self._borrow(trainer)

    # -- updates ----------------------------------------------------------

    def _apply(
        self,
        sock: socket.socket,
        trainer: int,
        clock: int,
        computed_from: int,
        grad: torch.Tensor,
        weights_back: bool = False,
    ) -> None:
        """A PUSH: ACK first, then update, under the lock: the trainer goes on at once, and
        any pull (taking the lock) still sees every gradient acknowledged before it. The
        ACK is 32 bytes to a trainer that waits for it, so sending it never blocks.
        A PUSH_PULL (`weights_back`): update, then send the weights just published (this
        gradient applied: read-your-writes), without the lock."""
        with self.changed:
            applied = Applied(trainer, clock, computed_from, self.version, self._now())
            if not weights_back:
                wire.send(sock, Kind.ACK, self.version + 1, applied.staleness)
            self.trainers[trainer].clock = clock  # before the update: its checkpoint has it
            kept = self.pulled.get(trainer)
            pulled = kept[1] if kept is not None and kept[0] == computed_from else None
            self._update(grad, [applied], applied.staleness, pulled)
            if not weights_back:
                return
            weights, version = self._borrow(trainer)
        self._send(sock, weights, version, applied.staleness)

    def _borrow(self, trainer: int | None) -> tuple[torch.Tensor, int]:
        """The published weights, borrowed to be sent to `trainer` (under the lock). Under
        dc they stay borrowed for it too, so that no update writes them, until its next
        pull: its next gradient is compensated against them, without a copy."""
        weights = self.weights.borrow()
        if trainer is not None and self.rule.keeps_pulled_weights:
            self.weights.borrow_again(weights)
            self._release_pulled(trainer)
            self.pulled[trainer] = (self.version, weights)
        return weights, self.version

    def _release_pulled(self, trainer: int) -> None:
        """dc: give back the weights `trainer` last pulled (under the lock)."""
        kept = self.pulled.pop(trainer, None)
        if kept is not None:
            self.weights.give_back(kept[1])

    def _aggregate(
        self, trainer: int, clock: int, computed_from: int, grad: torch.Tensor
    ) -> tuple[int, int]:
        """Keep this step's gradient until every live trainer's is in; the ACK waits."""
        with self.changed:
            step = self._steps.setdefault(clock, _Step())
            step.grads[trainer], step.versions[trainer] = grad, computed_from
            self._aggregate_ready()
            self.changed.wait_for(lambda: step.applied or self._closed)
            if not step.applied:
                raise PeerClosed("the server is shutting down")
            return self.version, self.version - 1 - computed_from

    def _aggregate_ready(self) -> None:
        """Apply every waiting step that all live, unfinished trainers have pushed."""
        expected = {
            t for t, state in self.trainers.items()
            if not state.finished and not state.gone and t not in self.excused
        }  # fmt: skip
        for clock in sorted(self._steps):
            step = self._steps[clock]
            if step.applied or not expected <= set(step.grads):
                continue
            order = sorted(step.grads)
            mean = step.grads[order[0]].clone()
            for t in order[1:]:
                mean += step.grads[t]
            mean /= len(order)
            now = self._now()
            rows = [Applied(t, clock, step.versions[t], self.version, now) for t in order]
            for t in order:
                self.trainers[t].clock = clock
            self._update(mean, rows, 0)
            step.applied = True
            del self._steps[clock]
            self.changed.notify_all()

    def _update(
        self,
        grad: torch.Tensor,
        rows: list[Applied],
        staleness: int,
        pulled: torch.Tensor | None = None,
    ) -> None:
        """One optimizer step with `grad`, sized by the update rule (under the lock)."""
        updated = self.weights.writable()
        scale, momentum = self.rule.prepare(grad, staleness, self.weights.current, pulled)
        self.optimizer.step(self.weights.current, grad, updated, scale, momentum)
        self.weights.publish(updated)
        self.version += 1
        self.log.extend(rows)
        if self.checkpoints is not None and self.checkpoints.due(self.version):
            self._save_checkpoint()
        self.changed.notify_all()

    def _now(self) -> float:
        return time.monotonic() - self.started

    # -- trainers coming and going ------------------------------------------

    def _gone(self, trainer: int, reason: str) -> None:
        with self.changed:
            self._release_pulled(trainer)
            state = self.trainers[trainer]
            if not state.finished:
                state.gone = reason
                self._aggregate_ready()
            self.changed.notify_all()

    def excuse(self, trainer: int) -> None:
        """Go on without a lost trainer (`on_loss=continue`)."""
        with self.changed:
            self.excused.add(trainer)
            self._aggregate_ready()
            self.changed.notify_all()

    def broken(self) -> dict[int, str]:
        """Trainers whose connection ended without BYE and that are not excused."""
        return {t: s.gone for t, s in self.trainers.items() if s.gone and t not in self.excused}

    def done(self) -> bool:
        """Every trainer finished, or was excused after it was lost."""
        return all(s.finished or t in self.excused for t, s in self.trainers.items())

    def close(self) -> None:
        with self.changed:
            self._closed = True
            self.changed.notify_all()

    # -- checkpoints --------------------------------------------------------

    def _save_checkpoint(self) -> None:
        assert self.checkpoints is not None
        self.checkpoints.save(
            Saved(
                version=self.version,
                clocks={t: s.clock for t, s in self.trainers.items()},
                params=self.weights.current,  # published: never written again
                optimizer=self.optimizer.state_dict(),
                layout=self.digest,
            )
        )

    def save_checkpoint(self) -> None:
        with self.changed:
            if self.checkpoints is not None:
                self._save_checkpoint()

    def _restore(self, saved: Saved) -> None:
        self.weights.current.copy_(saved.params.reshape(-1))
        self.optimizer.load_state_dict(saved.optimizer)
        self.version = self.resumed_from = saved.version
        for t, clock in saved.clocks.items():
            self.trainers[t].clock = clock

    # -- reading it ---------------------------------------------------------

    def snapshot(self) -> tuple[torch.Tensor, int]:
        with self.changed:
            return self.weights.current.clone(), self.version

    def staleness_histogram(self) -> dict[int, int]:
        with self.changed:
            histogram: dict[int, int] = {}
            for row in self.log:
                histogram[row.staleness] = histogram.get(row.staleness, 0) + 1
            return dict(sorted(histogram.items()))


def _view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy())
