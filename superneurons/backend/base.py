"""The interface a backend provides to the runtime."""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    name: str
    ops: Any  # namespace of operations: ops.relu_forward(...), ops.gemm(...), ...

    def arena(self, nbytes: int) -> Any:
        """One contiguous block of memory of `nbytes`; the pool carves every tensor out of it."""

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """An array of `shape` over `arena` bytes [offset, offset + size)."""

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        """Copy a host array into `dst` (same number of elements)."""

    def to_host(self, src: Any) -> np.ndarray:
        """A host copy of `src`."""

    def synchronize(self) -> None:
        """Wait until all queued work has finished."""
