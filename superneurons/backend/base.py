"""The interface a backend provides to the runtime."""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType, SimpleNamespace
from typing import Any, Protocol

import numpy as np


def collect_ops(package: ModuleType) -> SimpleNamespace:
    """Gather the functions each module of `package` lists in `__all__` into one `ops` namespace.

    Both backends build their ops this way, so a new op is one function in one family module.
    """
    ns: dict[str, Any] = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for fn_name in getattr(module, "__all__", ()):
            if fn_name in ns:
                raise RuntimeError(f"op {fn_name} defined twice in {package.__name__} ({info.name})")
            ns[fn_name] = getattr(module, fn_name)
    return SimpleNamespace(**ns)


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
