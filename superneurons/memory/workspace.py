"""Convolution workspace from the Net's pool (paper section 3.5: dynamic workspace).

The CUDA backend asks, at each convolution step, how many bytes it may use (`available`) and picks
the fastest algorithm whose workspace fits; it then borrows that much (`acquire`) and gives it back
when the call has been issued (`release`). Taking it from the pool, rather than from a fixed
scratch buffer, lets a convolution use whatever the activations leave free at that step. The
workspace lives only inside one step, so the per-step bytes the plan predicts exclude it.

This implements the backend's `WorkspaceSource` protocol (superneurons/backend/base.py):
    available() -> int; acquire(nbytes) -> int (device address); release() -> None
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from superneurons.memory.pool import round_up

WORKSPACE_KEY = "#workspace"


class PoolWorkspace:
    def __init__(self, pool: Any, reclaim: Callable[[], None] | None = None):
        """`reclaim` (the memory manager's) returns device blocks whose offload has completed first."""
        self.pool = pool
        self.reclaim = reclaim
        self._held = 0
        self.acquires = 0
        self.peak_bytes = 0  # largest workspace handed out
        # A pool with one arena (HeapPool) returns arena offsets from alloc: the workspace's address is then
        # the arena's plus the offset, with no array view built per convolution call (a numba view costs
        # tens of microseconds). Other pools (MallocPool: one allocation per key) go through a view.
        self._address = pool.backend.address
        arena = getattr(pool, "arena", None)
        self._base = self._address(arena) if arena is not None else None

    def available(self) -> int:
        """Bytes a convolution may use right now: the largest free contiguous extent of the pool."""
        if self.reclaim is not None:
            self.reclaim()
        return self.pool.largest_free()

    def acquire(self, nbytes: int) -> int:
        """A device pointer to >= nbytes from the pool, valid until release(); 0 for an empty request."""
        self.release()
        if nbytes <= 0:
            return 0
        offset = self.pool.alloc(WORKSPACE_KEY, nbytes)
        self._held = round_up(nbytes)
        self.acquires += 1
        if self._held > self.peak_bytes:
            self.peak_bytes = self._held
        if self._base is not None:
            return self._base + offset
        return self._address(self.pool.view(WORKSPACE_KEY, (self._held,), np.uint8))

    def release(self) -> None:
        if self._held:
            self.pool.free(WORKSPACE_KEY)
            self._held = 0
