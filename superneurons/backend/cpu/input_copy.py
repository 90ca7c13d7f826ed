"""How a data layer hands a host batch to the device (here plain copies; the CUDA twin goes through
pinned memory on a copy stream so the host does not wait).

`upload_async` takes any host array, which is free again when it returns. `pin_host` + `upload_pinned`
are for memory the layer keeps (the decode workers' slot ring): the copy reads it straight, and the
returned event says when it may be rewritten. The CPU computes synchronously, so the copy happens at
once; the event models when a real copy stream would let go of the host memory: with
SUPERNEURONS_TRANSFER_LAG=N it completes only on its N-th poll or a synchronize, so CI runs a
consumer that must wait before reusing the memory, as on the GPU.
"""
from __future__ import annotations

import numpy as np

from superneurons import settings
from superneurons.backend.cpu.basic import upload
from superneurons.backend.cpu.transfer import CpuEvent, CpuStream

__all__ = ["upload_async", "pin_host", "upload_pinned"]

_released = CpuStream()  # one FIFO of copies, as on the GPU: events complete in the order issued


def upload_async(dst: np.ndarray, host: np.ndarray) -> None:
    """Copy `host` into `dst`; `host` may be reused as soon as this returns, and work queued after
    this call sees the new values."""
    upload(dst, host)


class HostPin:
    """Host memory `upload_pinned` may read from, until `release()` (nothing to lock on the CPU)."""

    def __init__(self, memory: np.ndarray):
        self.nbytes = int(memory.nbytes)

    def release(self) -> None:
        pass


def pin_host(memory: np.ndarray) -> HostPin:
    """Make `memory` (a contiguous host array the caller keeps) a source for `upload_pinned`, until the
    returned pin's `release()`; raises MemoryError when the memory cannot be locked."""
    return HostPin(memory)


def upload_pinned(dst: np.ndarray, host: np.ndarray) -> CpuEvent:
    """Copy `host` (inside pinned memory) into `dst`; work queued after this call sees the new values.
    `host` must not change until the returned event has completed; events complete in issue order."""
    upload(dst, host)
    return _released.submit(lambda: None, settings.get("SUPERNEURONS_TRANSFER_LAG"))
