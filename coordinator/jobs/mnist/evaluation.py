"""Server 0's evaluation of the `mnist` model on the test set while it trains.

Every `eval_seconds` it scores the whole model and writes `<job>/mnist/metrics/<n>`; the
last evaluation, on the final weights, is the job's test accuracy.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

import torch
from torch.nn import functional

from coordinator.datasets.mnist import Images
from coordinator.events import Metrics, emit
from coordinator.jobs.mnist.members import server_peers
from coordinator.jobs.mnist.options import CLASSES, MnistOptions
from coordinator.ps import api as ps
from coordinator.ps.model import MnistNet

if TYPE_CHECKING:
    from coordinator.rendezvous.member import Member


class Evaluator:
    """Server 0's view of the whole model: every `eval_seconds` it reads every server's
    share (its own from memory, the others' as a reader) and scores the test set."""

    def __init__(
        self,
        options: MnistOptions,
        member: Member,
        server: ps.Server,
        test: Images,
        began: float,
    ) -> None:
        self.options, self.member, self.server, self.began = options, member, server, began
        self.model = MnistNet(options.data.rows, options.data.cols, CLASSES)
        # Its own share from memory; the other servers' through a reader.
        others = range(1, options.servers)
        peers = server_peers(member, options.servers)
        self.reader = ps.reader(self.model, peers, timeout=member.timeout, only=others)
        self.flat = self.reader.flat
        self.links: ps.Trainer | None = self.reader if options.servers > 1 else None
        self.x, self.y = torch.from_numpy(test.x), torch.from_numpy(test.y)
        self.history: list[dict[str, float]] = []
        self.final: dict[str, float] = {}
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mnist-eval")
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.options.eval_seconds):
                self._evaluate()
        except BaseException as exc:  # reported by stop()
            self._failure = exc

    def _evaluate(self) -> dict[str, float]:
        at = time.time()  # the accuracy is the weights' at this time, not when it is known
        share, version = self.server.snapshot()
        self.flat.params[self.flat.slices[0]].copy_(share)
        versions = [version]
        if self.links is not None:
            versions += self.links.pull()
        with torch.no_grad():
            logits = self.model(self.x)
            loss = functional.cross_entropy(logits, self.y).item()
            accuracy = (logits.argmax(1) == self.y).float().mean().item()
        samples = len(self.server.log) * self.options.batch_size  # about: last batches
        record = {
            "n": len(self.history),
            "t": round(at - self.began, 3),
            "version": sum(versions),
            "samples": samples,
            "accuracy": accuracy,
            "loss": loss,
        }
        self.history.append(record)
        self.member.etcd.put(self.member.keys.mnist_metrics(record["n"]), json.dumps(record))
        emit(Metrics(rank=0, **record))
        return record

    def stop(self) -> None:
        """The last evaluation, on the final weights; then stop reading the other servers."""
        self._stop.set()
        self._thread.join()
        if self._failure is not None:
            raise self._failure
        self.final = self._evaluate()
        if self.links is not None:
            self.links.close()

    def close(self) -> None:
        self._stop.set()
        if self.links is not None:
            self.links.abort()
