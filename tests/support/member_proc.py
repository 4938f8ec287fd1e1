"""A rendezvous member for tests that need one to stall at a chosen phase.

It runs the same phases as `coordinator worker`, but stops before the phase
named by --stop-before and stays there until --resume-file appears (or until
it is killed), printing JSON lines so the test knows where it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from coordinator.etcd.client import Etcd
from coordinator.rendezvous.errors import RendezvousError
from coordinator.rendezvous.member import Member


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ttl", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--stop-before", default="")
    parser.add_argument("--resume-file", default="")
    args = parser.parse_args()

    etcd = Etcd(args.etcd, namespace=args.namespace)
    member = Member(etcd, args.job, args.world_size, ttl=args.ttl, timeout=args.timeout)
    steps = [
        ("leader_election", member.leader_election),
        ("ip_exchange", member.ip_exchange),
        ("connect", member.connect),
        ("training", lambda: member.barrier("training")),
        ("cleaner", member.cleaner),
    ]
    try:
        with member:
            for phase, step in steps:
                if phase == args.stop_before:
                    say(event="stopped", before=phase, rank=member.rank)
                    while not (args.resume_file and os.path.exists(args.resume_file)):
                        time.sleep(0.05)  # a stalled member: nothing to wait on but the test
                    say(event="resumed", before=phase, rank=member.rank)
                step()
                say(event="phase", phase=phase, rank=member.rank)
    except RendezvousError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    say(event="done", rank=member.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
