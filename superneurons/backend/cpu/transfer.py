"""Host<->device transfers on the CPU backend: the synchronous twin of `backend/cuda/transfer.py`.

The memory manager's offload path is written against one small interface (`arena`/`view` for the
host pool, `to_host`/`to_device` returning events, `join`), so CI runs the same code as the GPU.
Here "device" arrays are NumPy arrays too, so a copy is `np.copyto`.

`lag` simulates asynchrony: with lag N > 0 a copy is queued on its stream and runs only when its
event has been polled N times, synchronized, or joined -- the moments a copy on a real stream may
have finished. Streams are FIFO, as CUDA streams are. A manager that frees a block before its copy
has finished, or reads a prefetched tensor without joining, then trains to different weights, so the
CPU tests catch the races the GPU would have. With lag 0 (the default) every copy runs at once.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

import numpy as np

from superneurons.backend.cpu.arena import host_arena, host_view


class CpuStream:
    """A FIFO of pending copies."""

    def __init__(self) -> None:
        self._queue: deque[tuple["CpuEvent", Callable[[], None]]] = deque()

    def submit(self, copy: Callable[[], None], lag: int) -> "CpuEvent":
        event = CpuEvent(self, lag)
        if lag <= 0 and not self._queue:
            copy()
            event.complete = True
        else:
            self._queue.append((event, copy))
        return event

    def run_through(self, event: "CpuEvent") -> None:
        """Run every queued copy up to and including `event`'s (a stream completes in order)."""
        while not event.complete and self._queue:
            ev, copy = self._queue.popleft()
            copy()
            ev.complete = True


class CpuEvent:
    __slots__ = ("stream", "polls_left", "complete")

    def __init__(self, stream: CpuStream, lag: int):
        self.stream = stream
        self.polls_left = lag
        self.complete = False

    def query(self) -> bool:
        """Has the copy finished? Under a lag, the N-th poll finishes it."""
        if not self.complete:
            self.polls_left -= 1
            if self.polls_left <= 0:
                self.stream.run_through(self)
        return self.complete

    def synchronize(self) -> None:
        self.stream.run_through(self)


class CpuTransfer:
    """Copies between "device" (pool) arrays and a host arena, with events that complete at once (lag 0)."""

    name = "cpu"

    def __init__(self, lag: int = 0):
        self.lag = int(lag)
        self._d2h = CpuStream()
        self._h2d = CpuStream()

    # -- the host arena (HeapPool's backend interface) -------------------------------------------
    def arena(self, nbytes: int) -> np.ndarray:
        return host_arena(nbytes)  # carved exactly as the CPU pool's arena is

    def view(self, arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        return host_view(arena, offset, shape, dtype)

    # -- copies ------------------------------------------------------------------------------------
    def to_host(self, src: np.ndarray, dst: np.ndarray) -> CpuEvent:
        """Copy device `src` into host `dst` after all compute issued so far; returns its event."""
        return self._d2h.submit(lambda: np.copyto(dst, src.reshape(dst.shape)), self.lag)

    def to_device(self, src: np.ndarray, dst: np.ndarray) -> CpuEvent:
        """Copy host `src` into device `dst` after all compute issued so far; returns its event."""
        return self._h2d.submit(lambda: np.copyto(dst, src.reshape(dst.shape)), self.lag)

    def join(self, event: CpuEvent) -> None:
        """Compute issued from now on waits for `event` (on the CPU, compute runs now: finish the copy)."""
        event.synchronize()


class ClockEvent:
    """An event of the CPU backend: the work before it has finished when it is made; timed by the host
    clock (the time between two of them is the host's time between their making)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_ms(self, start: "ClockEvent") -> float:
        return (self.at - start.at) * 1e3


class DoneStream:
    """The Backend's `make_stream` on the CPU: what is queued on it ran when it was called."""

    handle = 0

    def follow_compute(self) -> None:
        pass

    def record(self) -> ClockEvent:
        return ClockEvent()

    def synchronize(self) -> None:
        pass
