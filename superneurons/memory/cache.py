"""The Tensor Cache (paper section 3.3, Alg. 2): device-resident offloadable tensors in LRU order, with locks.

The cache does not move bytes itself; it answers the two questions the offloader asks:
`check(key)` (is it resident? -- a hit moves it to the front) and `victims()` / `victim()` (which unlocked
tensors to evict, least recently used first). A step locks every tensor it computes on, so an
eviction triggered by that step's own allocations can never take them away.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class TensorCache:
    def __init__(self) -> None:
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> bytes; first = least recently used
        self._locks: dict[str, int] = {}
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def insert(self, key: str, nbytes: int) -> None:
        """LRU.in: a tensor became device resident; it is the most recently used."""
        self._lru[key] = nbytes
        self._lru.move_to_end(key)

    def remove(self, key: str) -> None:
        self._lru.pop(key, None)

    def check(self, key: str) -> bool:
        """Count a hit (and refresh) when `key` is resident, a miss when it is not."""
        if key in self._lru:
            self._lru.move_to_end(key)
            self.hits += 1
            return True
        self.misses += 1
        return False

    def lock(self, key: str) -> None:
        self._locks[key] = self._locks.get(key, 0) + 1

    def unlock(self, key: str) -> None:
        n = self._locks.get(key, 0) - 1
        if n <= 0:
            self._locks.pop(key, None)
        else:
            self._locks[key] = n

    def locked(self, key: str) -> bool:
        return key in self._locks

    def victims(self) -> Iterator[str]:
        """LRU.out's order: unlocked resident tensors, least recently used first (a snapshot)."""
        return iter([k for k in self._lru if k not in self._locks])

    def victim(self) -> str | None:
        """The first of `victims()`, found without listing them all: an allocation evicts one at a time, and a
        snapshot per eviction made a long unrolled net's iteration quadratic in its time steps."""
        return next((k for k in self._lru if k not in self._locks), None)
