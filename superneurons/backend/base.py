"""The interface a backend provides to the runtime.

`Backend` is everything the runtime (`runtime/net.py`, `memory/`, `solver/`) may ask of a backend;
nothing outside `superneurons/backend/` tests a backend's name or imports one. A backend also
hands out `Transfer`s (host memory and asynchronous host<->device copies, for the offload host
store and streamed parameters) and `Stream`s with `Event`s (work beside compute, ordered by events: the
data-parallel gradient reduction's), and accepts a `WorkspaceSource` (where convolutions take scratch
memory from: `memory/workspace.py` lends the Net's pool).
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Protocol

import numpy as np

# Bytes: each copy an op takes from its step's planned room starts on such a boundary (cuDNN's and the kernels'
# operands in the pool do too), so a layer declaring a room rounds every copy up to it (graph/layout.py).
COPY_ALIGN = 256


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


class CopyEvent(Protocol):
    """Completion of one asynchronous copy."""

    def query(self) -> bool:
        """Whether the copy has finished (never blocks)."""

    def synchronize(self) -> None:
        """Block the host until the copy has finished."""


class Transfer(Protocol):
    """Host memory and asynchronous copies between it and the device. `arena`/`view` are HeapPool's
    backend interface, so the host side is carved by the same pool as the device arena. A copy starts
    after all compute issued so far and runs beside the compute issued after it."""

    def arena(self, nbytes: int) -> Any:
        """One contiguous block of host memory (pinned on the GPU, so copies run at full speed)."""

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """A host array of `shape` over `arena` bytes [offset, offset + size)."""

    def to_host(self, src: Any, dst: np.ndarray) -> CopyEvent:
        """Start copying device array `src` into host array `dst`."""

    def to_device(self, src: np.ndarray, dst: Any) -> CopyEvent:
        """Start copying host array `src` into device array `dst`."""

    def join(self, event: CopyEvent) -> None:
        """Compute issued from now on waits for `event` (on the device; the host goes on)."""


class Event(Protocol):
    """A point in a stream's queue of device work (a `CopyEvent` that may also be timed)."""

    def query(self) -> bool:
        """Whether the work queued before it has finished (never blocks)."""

    def synchronize(self) -> None:
        """Block the host until the work queued before it has finished."""

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds of device time from `start` to this event, both timed and finished."""


class Stream(Protocol):
    """A queue of device work that runs beside the compute stream (a collective library's, say).
    Ordering against compute is explicit: `follow_compute` and `Backend.compute_waits`."""

    handle: int  # the native stream (a cudaStream_t) for libraries that queue work on it; 0 on the CPU

    def follow_compute(self) -> None:
        """Work queued on this stream from now on starts after the compute issued so far."""

    def record(self) -> Event:
        """An event after the work queued on this stream so far."""

    def synchronize(self) -> None:
        """Block the host until this stream's work has finished."""


class WorkspaceSource(Protocol):
    """Where a convolution gets its scratch memory. A convolution asks `available()`, picks the fastest
    algorithm that fits, then `acquire`s that many bytes (only when it needs any) and `release`s them
    when the call is queued. Measuring an accumulating direction once per shape also `borrow`s its output."""

    def available(self) -> int:
        """Bytes a convolution may use right now."""

    def acquire(self, nbytes: int) -> int:
        """Device address (16-byte aligned) of >= `nbytes`, valid until `release()`; 0 for an empty request."""

    def release(self) -> None:
        """The bytes last acquired are free again."""

    def borrow(self, nbytes: int) -> int | None:
        """Device address of `nbytes` beside the workspace until `give_back()`: where cuDNN measures a direction
        that accumulates (its own output, not the sum). None where the source cannot spare them now."""

    def give_back(self) -> None:
        """The bytes last borrowed are free again."""


class CaptureFailed(RuntimeError):
    """Recording work as a graph failed (`GraphRecorder.capture`): a call the graph cannot hold was queued (a host
    synchronization, an allocation), or the graph could not be instantiated."""


class Graph(Protocol):
    """Work recorded once (a training pass) and replayed by one launch."""

    nodes: int  # the work items recorded

    def launch(self) -> None:
        """Queue one replay after the compute queued so far."""


class GraphRecorder(Protocol):
    """What a backend that can record graphs returns from its optional `graph_recorder()` (the CUDA backend's;
    runtime/graph_replay.py looks the method up and runs every pass eagerly where there is none)."""

    def capture(self, fn: Callable[[], None]) -> Graph:
        """Record what `fn` queues, running none of it; raises CaptureFailed."""


class Backend(Protocol):
    name: str  # for messages and reports only: code asks the members below, never the name
    ops: Any  # namespace of operations: ops.relu_forward(...), ops.gemm(...), ...
    # True when ops return before the device has finished them: timers must `synchronize` around them.
    asynchronous: bool
    # The element types tensors may be stored in (superneurons.dtypes); a net storing others is refused when
    # it is built, in one line, rather than computed wrongly.
    storage_types: tuple[np.dtype, ...]

    def ops_for(self, storage: frozenset) -> Any:
        """The op namespace for a net whose tensors are stored in the `storage` types (a subset of
        `storage_types`): `ops` itself, or a leaner one where the net needs less (the CUDA backend's float32 nets
        skip the per-call check for half arrays)."""

    def arena(self, nbytes: int) -> Any:
        """One contiguous block of memory of `nbytes`; the pool carves every tensor out of it."""

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """An array of `shape` over `arena` bytes [offset, offset + size)."""

    def address(self, array: Any) -> int:
        """The address of `array`'s first byte (device memory on the GPU)."""

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        """Copy a host array into `dst` (same number of elements)."""

    def to_host(self, src: Any) -> np.ndarray:
        """A host copy of `src`."""

    def synchronize(self) -> None:
        """Wait until all queued work has finished."""

    def device_memory(self) -> tuple[int, int] | None:
        """(free, total) bytes of the device; None when arrays live in host memory (no device to size
        the pool from)."""

    def make_transfer(self) -> Transfer:
        """A new host<->device copier (its own copy streams on the GPU)."""

    def set_workspace_source(self, source: WorkspaceSource | None) -> None:
        """Where convolutions take workspace from from now on; None: the backend's own default."""

    def release_freed(self) -> None:
        """Return the memory of arrays dropped since the last call to the device now, not when the
        array library gets round to it (MallocPool measures per-tensor allocation with it)."""

    def make_stream(self, high_priority: bool = False) -> Stream:
        """A new stream beside the compute stream (non-blocking on the GPU: it overlaps compute).
        `high_priority`: the GPU starts its blocks before compute's when both wait for a multiprocessor."""

    def compute_waits(self, event: Event) -> None:
        """Compute issued from now on waits for `event` (on the device; the host goes on)."""

    def compute_event(self) -> Event:
        """A timed event after the compute issued so far (`elapsed_ms` between two of them)."""
