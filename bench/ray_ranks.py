"""The entrypoint bench/command.py submits to Ray: N actors, one process each, that print
their first line (as a Ray Train worker group would start). Run by Ray's Python."""

import sys

import ray


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int) -> None:
        print("first line of rank", rank, flush=True)

    def ready(self) -> bool:
        return True


n, address = int(sys.argv[1]), sys.argv[2]
ray.init(address=address)
ranks = [Rank.remote(r) for r in range(n)]
ray.get([r.ready.remote() for r in ranks])
