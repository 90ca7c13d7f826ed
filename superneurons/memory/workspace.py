"""Convolution workspace from the Net's pool (paper section 3.5: dynamic workspace).

The CUDA backend asks, at each convolution step, how many bytes it may use (`available`) and picks
the fastest algorithm whose workspace fits; it then borrows that much (`acquire`) and gives it back
when the call has been issued (`release`). Taking it from the pool, rather than from a fixed
scratch buffer, lets a convolution use whatever the activations leave free at that step. The
workspace lives only inside one step, so the per-step bytes the plan predicts exclude it.

This implements the backend's `WorkspaceSource` protocol (superneurons/backend/base.py):
    available() -> int; acquire(nbytes) -> int (device address); release() -> None
and lends cuDNN the output it measures a direction that accumulates into, once per shape (`borrow`/`give_back`:
pool memory too, outside the plan like the workspace, for the same reason).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from superneurons.memory.pool import round_up

WORKSPACE_KEY = "#workspace"
MEASURE_KEY = "#measure"  # cuDNN's output of its own when it first measures a direction that accumulates


class PoolWorkspace:
    def __init__(self, pool: Any, reclaim: Callable[[], None] | None = None):
        """`reclaim` (the memory manager's) returns device blocks whose offload has completed first."""
        self.pool = pool
        self.reclaim = reclaim
        self._held = 0
        self.acquires = 0
        self.peak_bytes = 0  # largest workspace handed out
        self.measure_bytes = 0  # largest measuring output lent (`borrow`)
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

    def borrow(self, nbytes: int) -> int | None:
        """A device pointer to `nbytes` from the pool beside the workspace, until `give_back()`, for cuDNN's first
        measuring of a direction that accumulates (backend/cuda/cudnn.py); None where the pool's largest free
        extent is smaller (the direction is then ranked without measuring)."""
        if self.reclaim is not None:
            self.reclaim()
        if nbytes <= 0 or self.pool.largest_free() < round_up(nbytes):
            return None
        offset = self.pool.alloc(MEASURE_KEY, nbytes)
        self.measure_bytes = max(self.measure_bytes, round_up(nbytes))
        if self._base is not None:
            return self._base + offset
        return self._address(self.pool.view(MEASURE_KEY, (round_up(nbytes),), np.uint8))

    def give_back(self) -> None:
        self.pool.free(MEASURE_KEY)
