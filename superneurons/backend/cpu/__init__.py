"""The NumPy reference backend: correct and readable; the backend CI tests on.

Operations live in one module per layer family; each module lists its public functions in
`__all__` and they are gathered into one `ops` namespace here.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from superneurons import settings
from superneurons.backend.base import collect_ops
from superneurons.backend.cpu.arena import host_arena, host_view
from superneurons.backend.cpu.half_storage import with_float32_math
from superneurons.backend.cpu.transfer import ClockEvent, CpuTransfer, DoneStream
from superneurons.dtypes import BFLOAT16, FLOAT16, FLOAT32


class CpuBackend:
    name = "cpu"
    asynchronous = False  # every op has finished when it returns
    storage_types = (FLOAT32, FLOAT16, BFLOAT16)  # what tensors may be stored in

    def __init__(self) -> None:
        # float16 and bfloat16 arrays are storage: ops compute in float32 on them (half_storage.py)
        self.ops = with_float32_math(collect_ops(sys.modules[__name__]))
        self.workspace_source: Any = None  # accepted for the Backend interface; NumPy convolutions need none

    def ops_for(self, storage: frozenset) -> Any:
        return self.ops  # the float32-math wrapper passes float32 arrays straight through

    def arena(self, nbytes: int) -> np.ndarray:
        return host_arena(nbytes)

    def view(self, arena: np.ndarray, offset: int, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        return host_view(arena, offset, shape, dtype)

    def from_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = np.asarray(src, dtype=dst.dtype).reshape(dst.shape)

    def to_host(self, src: np.ndarray) -> np.ndarray:
        return np.array(src, copy=True)

    def address(self, array: np.ndarray) -> int:
        return int(array.ctypes.data)

    def synchronize(self) -> None:
        pass

    def device_memory(self) -> None:
        return None  # arrays live in host memory: the pool is sized from the net, not from a device

    def make_transfer(self) -> Any:
        """NumPy copies; SUPERNEURONS_TRANSFER_LAG=N makes them lag, to exercise the asynchronous paths in CI."""
        return CpuTransfer(lag=settings.get("SUPERNEURONS_TRANSFER_LAG"))

    def set_workspace_source(self, source: Any) -> None:
        self.workspace_source = source

    def release_freed(self) -> None:
        pass  # NumPy frees an array when its last reference goes

    def make_stream(self, high_priority: bool = False) -> Any:
        """Work "on" a CPU stream has finished when it returns, as every op here has (so no priorities)."""
        return DoneStream()

    def compute_waits(self, event: Any) -> None:
        pass  # compute runs in program order already

    def compute_event(self) -> Any:
        return ClockEvent()
