"""The random stream of one pBSP/pSSP sample: the same in every member, and cheap to create.

A pBSP/pSSP worker needs every peer's sample at each step (to know who may
wait for it), so P samples a step: seeding a Mersenne Twister costs about
10 µs, and `Random.sample` about 4. Here a SplitMix64 stream (Steele, Lea and
Flood) and a partial Fisher-Yates shuffle (`positions`): about 2 µs.
"""

from __future__ import annotations

import random
from typing import Any

_MASK64 = (1 << 64) - 1


class StepRandom(random.Random):
    """The generator of one sample, seeded by (seed, rank, clock); see the module."""

    def seed(self, a: Any = None, version: int = 2) -> None:
        self._state = int(a or 0) & _MASK64

    def getrandbits(self, k: int) -> int:
        bits, have = 0, 0
        while have < k:
            self._state, value = _splitmix(self._state)
            bits, have = (bits << 64) | value, have + 64
        return bits >> (have - k)

    def random(self) -> float:
        return self.getrandbits(53) * 2.0**-53

    def sample(self, population: Any, k: int, *, counts: Any = None) -> list[Any]:
        """`k` of `population`, uniformly without replacement (`counts` is not supported)."""
        if counts is not None or not 0 <= k <= len(population):
            raise ValueError("sample larger than population, or counts given")
        picked = [population[i] for i in positions(self._state, len(population), k)]
        self._state = (self._state + k * 0x9E3779B97F4A7C15) & _MASK64
        return picked


def positions(state: int, n: int, k: int) -> list[int]:
    """`k` of `range(n)` without replacement, from a SplitMix64 stream at `state`."""
    moved: dict[int, int] = {}
    picked = []
    for i in range(k):  # a partial Fisher-Yates shuffle: swap a later position into i
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        j = i + (z ^ (z >> 31)) % (n - i)  # the modulo's bias is below n / 2**64
        picked.append(moved.get(j, j))
        moved[j] = moved.get(i, i)
    return picked


def _splitmix(state: int) -> tuple[int, int]:
    """SplitMix64: the next state and its 64-bit output."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)
