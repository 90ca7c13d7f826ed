"""Refuse, before any allocation, a net whose memory cannot exist on this machine.

Shapes come from the user's prototxt, so a typo (`dim: 100000000`) can ask for petabytes. Left to the
allocator that ends as a MemoryError, NumPy's "Maximum allowed dimension exceeded", or, where the
kernel overcommits, a process killed later when the pages are touched. The check compares the pool
the Net is about to create, and its largest single tensor, with the memory of the device that holds
them (host RAM on the CPU backend, or less under a cgroup or ulimit; the GPU's total memory on CUDA)
and names the tensor. `summary` and `memory` allocate nothing and so accept such a net: they are how a
user sees what it would need.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Protocol

from superneurons.errors import UserError
from superneurons.graph.build import Graph
from superneurons.memory.pool import format_bytes


class SizedTensor(Protocol):
    key: str
    shape: tuple[int, ...]
    nbytes: int
    base: Any
    kind: str


def machine_bytes(backend: Any) -> tuple[int, str]:
    """(bytes, what they are) of the memory the backend's pool lives in."""
    device = backend.device_memory()
    if device is not None:
        return device[1], "the device's memory"
    limits = [(1 << 62, "memory")]  # no sysconf (not POSIX): nothing to compare against
    try:
        limits.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"))
    except (ValueError, OSError, AttributeError):
        pass
    # A container's or a shell's limit is the memory this process can really have.
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            value = f.read().strip()
        if value.isdigit():
            limits.append((int(value), "this container's memory limit (cgroup memory.max)"))
    except OSError:
        pass
    try:
        import resource

        for name in ("RLIMIT_AS", "RLIMIT_DATA"):
            soft = resource.getrlimit(getattr(resource, name))[0]
            if soft != resource.RLIM_INFINITY:
                limits.append((soft, f"this process's {name} limit (ulimit)"))
    except (ImportError, AttributeError, ValueError, OSError):
        pass
    return min(limits)


def describe(t: SizedTensor, producers: dict[str, str]) -> str:
    """`blob 'conv1' (top of layer 'conv1', shape 64x96x55x55)` and the like, for a tensor key."""
    shape = "x".join(str(d) for d in t.shape) or "scalar"
    if t.kind in ("data", "diff"):
        blob = t.key.removesuffix("@diff")
        what = "gradient of blob" if t.kind == "diff" else "blob"
        layer = producers.get(blob)
        return f"{what} {blob!r} ({'top of layer ' + repr(layer) + ', ' if layer else ''}shape {shape})"
    return f"{t.kind} {t.key!r} (shape {shape})"


def check_fits(tensors: Iterable[SizedTensor], pool_bytes: int, backend: Any, graph: Graph) -> None:
    """Raise a UserError when the pool or the largest tensor exceeds the memory that would hold it, naming
    the graph's file and the tensor (for a blob, the layer that first writes it)."""
    where = graph.source or f"net {graph.name!r}"
    producers: dict[str, str] = {}
    for node in graph.nodes:
        for top in node.tops:
            producers.setdefault(top, node.name)
    capacity, what = machine_bytes(backend)
    roots = [t for t in tensors if t.base is None]
    largest = max(roots, key=lambda t: t.nbytes, default=None)
    if largest is not None and largest.nbytes > capacity:
        raise UserError(f"{where}: {describe(largest, producers)} needs {largest.nbytes} bytes "
                        f"({format_bytes(largest.nbytes)}); {what} is {format_bytes(capacity)}")
    if pool_bytes > capacity:
        hint = f"; the largest tensor is {describe(largest, producers)}, {format_bytes(largest.nbytes)}" \
            if largest is not None else ""
        raise UserError(f"{where}: the memory pool needs {pool_bytes} bytes ({format_bytes(pool_bytes)}); "
                        f"{what} is {format_bytes(capacity)}{hint}")
