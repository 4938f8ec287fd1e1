"""What an agent writes under its lease: its registration (`agents/<id>`) and its
members' reports (`reports/<id>/<member>`). The service reads them back through the
models of `placement.protocol`.

A registration is created only if the key is absent, so a second agent with a live id
is refused (`AgentTaken`) and two hosts never share an identity; only the agent's own
registration (same token), left under a lease it gave up on, is replaced.
"""

from __future__ import annotations

import json
import os
import socket
import time
from importlib.metadata import version
from typing import Any

from pydantic import ValidationError

from coordinator.etcd.client import Etcd
from coordinator.etcd.session import Session
from coordinator.etcd.values import json_object
from coordinator.service.model import Member
from coordinator.signing import SignatureError

EXIT_REFUSED = 2  # the exit code reported for an assignment refused: bad arguments


class AgentTaken(RuntimeError):
    """Another live agent holds this id."""


def registration_record(
    slots: int, labels: dict[str, str], address: str, token: str, gpus: tuple[int, ...]
) -> dict[str, Any]:
    """The agent's registration (`placement.protocol.AgentRecord`): its room, where its output
    server is and the token it asks for, and which process on which host it is."""
    record: dict[str, Any] = {
        "slots": slots,
        "labels": labels,
        "address": address,
        "token": token,
        "version": version("etcd-coordinator"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
    }
    if gpus:
        record["gpus"] = list(gpus)
    return record


def register(etcd: Etcd, session: Session, key: str, record: dict[str, Any], agent_id: str) -> int:
    """Write `record` at `key` under `session`'s lease; the registration's create
    revision. AgentTaken (and `session` closed) if another live agent holds the key."""
    created, current, _ = etcd.create(key, json.dumps(record), session.lease_id)
    if not created and json_object(current.value).get("token") == record["token"]:
        # Our own registration, under the lease we gave up on but etcd still keeps.
        etcd.delete_if(key, current.mod_revision)
        created, current, _ = etcd.create(key, json.dumps(record), session.lease_id)
    if not created:
        session.close()
        holder = json_object(current.value)
        raise AgentTaken(
            f"agent id {agent_id!r} is registered by another live agent "
            f"(host {holder.get('host')}, pid {holder.get('pid')}); choose another --id"
        )
    return current.create_revision


def member_report(agent_id: str, member: Member, code: int | None) -> str:
    """A member's report: `running`, or `exited` with its code; `at` when it was so."""
    return json.dumps(
        {
            "agent": agent_id,
            "pid": member.pid,
            "state": "running" if code is None else "exited",
            "exit_code": code,
            "at": time.time(),
        }
    )


def refusal_report(agent_id: str, reason: str) -> str:
    """The report of an assignment that will never run, and why."""
    report = {
        "agent": agent_id,
        "state": "refused",
        "exit_code": EXIT_REFUSED,
        "reason": reason[:2000],
        "at": time.time(),
    }
    return json.dumps(report)


def refusal_reason(name: str, exc: Exception) -> str:
    """Why assignment `name` is refused, in one line: for a validation error, the field
    and what is wrong with it."""
    if isinstance(exc, SignatureError):
        return f"assignment {name} refused: signature: {exc}"
    if isinstance(exc, ValidationError):
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "value"
        return f"assignment {name} refused: {where}: {error['msg']}"
    return f"assignment {name} refused: {exc}"
