"""A trainer's (or a reader's) links to every parameter server.

Requests go to all servers first and the answers are read after, so with
several servers their work overlaps. Weights are received straight into the
flat parameter buffer of the model, and gradients sent straight from the flat
gradient buffer (`FlatModel`): no copy on this side.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

import torch

from coordinator.ps import wire
from coordinator.ps.model import FlatModel
from coordinator.ps.wire import Dtype, Kind
from coordinator.rendezvous.endpoint import open_channel
from coordinator.rendezvous.handshake import key_for


@dataclass(frozen=True)
class ServerAddress:
    rank: int  # the server's member rank, which is also its index (servers are ranks 0..ps-1)
    host: str
    port: int
    member_id: str


class ServerLinks:
    """One connection per server; `pull` and `push` talk to all of them.

    Each connection first proves `secret` (the round's, from the roster) to the
    server's member endpoint and checks the server's proof. `secret=None` skips
    that, for a server that is not behind a member endpoint (the bench's baseline).
    """

    def __init__(
        self,
        flat: FlatModel,
        servers: list[ServerAddress],
        *,
        job_id: str,
        round_: int,
        trainer: int | None,
        timeout: float,
        secret: bytes | None,
    ) -> None:
        self.flat, self.servers = flat, servers
        self.socks: list[socket.socket] = []
        self.versions = [0] * len(servers)
        self.clocks = [0] * len(servers)
        try:
            for server in servers:
                if secret is None:
                    sock = socket.create_connection((server.host, server.port), timeout)
                    sock.settimeout(None)
                else:
                    key = key_for(secret, job_id, round_, server.member_id)
                    sock = open_channel(server.host, server.port, key, timeout)
                self.socks.append(sock)
                wire.tune(sock)
                digest = wire.layout_digest(flat.layouts[server.rank])
                hello = {"job": job_id, "round": round_, "trainer": trainer, "layout": digest}
                wire.send_json(sock, Kind.HELLO, hello)
            for index, sock in enumerate(self.socks):
                header = wire.expect(sock, Kind.WELCOME)
                wire.receive_json(sock, header)
                self.versions[index], self.clocks[index] = header.a, header.b
        except BaseException:
            self.close()
            raise

    def pull(self, least: list[int] | None = None) -> list[int]:
        """The current weights (at least these versions) into the model; their versions."""
        for index, sock in enumerate(self.socks):
            wire.send(sock, Kind.PULL, least[index] if least else 0)
        for index, sock in enumerate(self.socks):
            header = wire.expect(sock, Kind.WEIGHTS)
            wire.receive_tensor(sock, header, self._share(self.flat.params, self.servers[index]))
            self.versions[index] = header.a
        return list(self.versions)

    def push(self, clock: int) -> list[int]:
        """This step's gradients, tagged with the versions they were computed from and the
        trainer's new clock; returns the staleness each server recorded."""
        for index, sock in enumerate(self.socks):
            share = self._share(self.flat.grads, self.servers[index])
            wire.send(sock, Kind.PUSH, self.versions[index], clock, [share], Dtype.FLOAT32)
        staleness = []
        for sock in self.socks:
            staleness.append(wire.expect(sock, Kind.ACK).b)
        return staleness

    def push_pull(self, clock: int) -> list[int]:
        """`push`, then `pull` in the same round trip: each server applies the gradient and
        answers with its weights, this gradient included; returns the staleness each
        server recorded (the versions are in `versions`)."""
        for index, sock in enumerate(self.socks):
            share = self._share(self.flat.grads, self.servers[index])
            wire.send(sock, Kind.PUSH_PULL, self.versions[index], clock, [share], Dtype.FLOAT32)
        staleness = []
        for index, sock in enumerate(self.socks):
            header = wire.expect(sock, Kind.WEIGHTS)
            wire.receive_tensor(sock, header, self._share(self.flat.params, self.servers[index]))
            self.versions[index] = header.a
            staleness.append(header.b)
        return staleness

    def bye(self) -> None:
        for sock in self.socks:
            wire.send(sock, Kind.BYE)
        for sock in self.socks:
            wire.expect(sock, Kind.ACK)

    def _share(self, buffer: torch.Tensor, server: ServerAddress) -> memoryview:
        return memoryview(buffer[self.flat.slices[server.rank]].numpy())

    def close(self) -> None:
        for sock in self.socks:
            with contextlib.suppress(OSError):
                sock.close()
        self.socks = []
