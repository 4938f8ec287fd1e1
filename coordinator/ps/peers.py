"""Who the parties of one job's parameter server are, and how a `command` program finds out.

Explicit, simple inputs: the job id and round, the servers' addresses (`ServerAddress`) and
the round's secret, which every connection proves through the member endpoint's handshake
(`coordinator.rendezvous.handshake`). Inside a member (the `mnist` kind) they come from the
`Member`; a program gets them from `program_peers()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from coordinator.ps.client import ServerAddress


@dataclass(frozen=True)
class Peers:
    """Who the parties of one job's parameter server are, and what proves it."""

    job_id: str
    round: int
    servers: list[ServerAddress]  # by server index (= rank: servers are ranks 0..ps-1)
    secret: bytes | None  # the round's secret; None only for a server behind no handshake

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("peers: at least one server address is needed")
        if [s.rank for s in self.servers] != list(range(len(self.servers))):
            raise ValueError("peers: servers must be given in index order 0..ps-1")


@dataclass(frozen=True)
class ProgramPeers:
    """What a `command` program needs for the parameter server, from its environment."""

    rank: int
    world_size: int
    peers: Peers
    bind: tuple[str, int]  # this member's address and reserved port (a server listens there)
    checkpoint_dir: Path  # <artifacts>/<job>/ps: private, kept across attempts


def program_peers(servers: int, *, environ: dict[str, str] | None = None) -> ProgramPeers:
    """The PS peers of a program run by `coordinator run` (ranks < `servers` serve): the
    servers' addresses and reserved ports from the roster file (COORDINATOR_ROSTER), the
    round's secret from the job's roster in etcd, read with the member's own etcd user
    (COORDINATOR_ETCD, COORDINATOR_NAMESPACE and the COORDINATOR_ETCD_* settings). Each
    server's handshake identity is its member's id with "/ps" appended, so a PS key never
    opens the member's own endpoint."""
    from coordinator.etcd.client import Etcd
    from coordinator.keys import JobKeys, job_path
    from coordinator.rendezvous.member import read_roster
    from coordinator.rendezvous.roster import RosterFile

    env = dict(os.environ if environ is None else environ)
    missing = [v for v in ("COORDINATOR_ROSTER", "COORDINATOR_RANK", "COORDINATOR_ETCD")
               if not env.get(v)]  # fmt: skip
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: run this program under `coordinator run "
            "--workers N -- PROGRAM` (the command kind)"
        )
    document = RosterFile.model_validate_json(Path(env["COORDINATOR_ROSTER"]).read_bytes())
    job_id, round_, members = document.job_id, document.round, document.members
    if not 1 <= servers < len(members):
        raise ValueError(f"ps={servers}: {len(members)} members need 1..{len(members) - 1}")
    etcd = Etcd(
        env["COORDINATOR_ETCD"],
        namespace=env.get("COORDINATOR_NAMESPACE", "/coordinator"),
        probe=job_path(job_id),
    )
    try:
        kv = etcd.get(JobKeys(etcd.namespace, job_id).roster)
    finally:
        etcd.close()
    if kv is None:
        raise RuntimeError(f"job {job_id}'s roster is not in etcd (the job ended?)")
    roster = read_roster(kv.value)
    if (roster.job_id, roster.round) != (job_id, round_):
        raise RuntimeError("the roster in etcd is of another round than the roster file")
    addresses = [
        ServerAddress(
            rank,
            members[rank].address,
            members[rank].reserved_ports[0],
            f"{roster.members[rank].member_id}/ps",
        )
        for rank in range(servers)
    ]
    rank = int(env["COORDINATOR_RANK"])
    me = members[rank]
    artifacts = Path(env.get("COORDINATOR_ARTIFACTS", "artifacts"))
    return ProgramPeers(
        rank=rank,
        world_size=len(members),
        peers=Peers(job_id, round_, addresses, roster.secret_bytes),
        bind=(me.address, me.reserved_ports[0]),
        checkpoint_dir=artifacts / "ps",
    )
