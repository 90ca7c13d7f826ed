"""The heap-based memory pool (paper section 4.1): one arena allocated once, carved in 1 KiB blocks.

Allocation is first fit over an offset-ordered free list; freeing coalesces with both
neighbours. An id-to-node map finds a tensor's block in O(1). On the GPU this replaces
cudaMalloc/cudaFree in the training loop; on the CPU the arena is host memory with the same
allocator, so everything above it behaves identically in CI.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

import numpy as np

from superneurons.errors import PoolExhausted, UserError

_MAX_CACHED_VIEWS = 1 << 16  # distinct (offset, shape, dtype) views kept; cleared past this

BLOCK = 1024


def backend_view(backend: Any, arena: Any, offset: int, shape: tuple[int, ...], dtype, layout: str) -> Any:
    """backend.view over `arena`; a layout other than NCHW goes as the keyword only backends storing it take
    (`Backend.layouts`, graph/layout.py)."""
    if layout == "NCHW":
        return backend.view(arena, offset, shape, dtype)
    return backend.view(arena, offset, shape, dtype, layout=layout)


def round_up(nbytes: int) -> int:
    return max(BLOCK, (nbytes + BLOCK - 1) // BLOCK * BLOCK)


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str | None) -> int | None:
    """'12G', '512M', '1.5GiB' or a byte count -> bytes (binary units, as the pool counts); None stays None."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise UserError(f"cannot read memory size {text!r}; use a number with an optional unit, e.g. 12G or 512M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Block:
    offset: int
    size: int


class HeapPool:
    def __init__(self, nbytes: int, backend: Any):
        self.capacity = nbytes // BLOCK * BLOCK
        self.backend = backend
        self.arena = backend.arena(self.capacity)
        self._free_offsets: list[int] = [0]  # sorted offsets of free blocks
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self._used: dict[Hashable, Block] = {}
        self._views: dict[tuple, Any] = {}  # (offset, shape, dtype) -> array, see view()
        self._watched: set[Hashable] = set()
        self.watched_moves = 0  # counts moves of watched blocks, see watch()
        self.used_bytes = 0
        self.high_water = 0
        self.n_allocs = 0
        self.n_frees = 0

    # -- allocation -----------------------------------------------------------------------
    def alloc(self, key: Hashable, nbytes: int, high: bool = False) -> int:
        """Reserve `nbytes` for `key`; returns the byte offset into the arena. First fit from the bottom;
        with `high`, last fit from the top, so that short-lived blocks of another kind (streamed
        parameters) do not split the extents the activations are carved from."""
        if key in self._used:
            raise KeyError(f"{key!r} is already allocated")
        size = round_up(nbytes)
        order = reversed(range(len(self._free_offsets))) if high else range(len(self._free_offsets))
        for i in order:
            off = self._free_offsets[i]
            free = self._free_sizes[off]
            if free >= size:
                if free == size:
                    del self._free_sizes[off]
                    del self._free_offsets[i]
                elif high:  # take the top of the extent; the bottom stays free
                    self._free_sizes[off] = free - size
                    off += free - size
                else:
                    del self._free_sizes[off]
                    self._free_offsets[i] = off + size
                    self._free_sizes[off + size] = free - size
                self._used[key] = Block(off, size)
                self.used_bytes += size
                self.high_water = max(self.high_water, self.used_bytes)
                self.n_allocs += 1
                return off
        raise PoolExhausted(
            f"memory pool exhausted: need {format_bytes(size)} for {key!r}, "
            f"{format_bytes(self.capacity - self.used_bytes)} free of {format_bytes(self.capacity)} "
            f"(largest free block {format_bytes(self.largest_free())})")

    def free(self, key: Hashable) -> None:
        block = self._used.pop(key)
        if key in self._watched:
            self.watched_moves += 1
        self.used_bytes -= block.size
        self.n_frees += 1
        off, size = block.offset, block.size
        i = bisect.bisect_left(self._free_offsets, off)
        # coalesce with the following free block
        if i < len(self._free_offsets) and self._free_offsets[i] == off + size:
            size += self._free_sizes.pop(self._free_offsets[i])
            del self._free_offsets[i]
        # coalesce with the preceding free block
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == off:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, off)
        self._free_sizes[off] = size

    def compact(self) -> list[Hashable]:
        """Slide every used block down to the bottom of the arena, in address order, leaving one free
        extent at the top; returns the keys whose block moved (their arrays must be re-pointed).

        The plan counts bytes, first fit can still leave them in pieces too small for the next tensor;
        compaction is what the managers do then, instead of failing or evicting more. The caller makes
        sure nothing reads or writes a block meanwhile (copies on other streams finished)."""
        moved, top = [], 0
        for key, block in sorted(self._used.items(), key=lambda kv: kv[1].offset):
            if block.offset != top:
                self._move_down(block.offset, top, block.size)
                self._used[key] = Block(top, block.size)
                moved.append(key)
            top += block.size
        if not self._watched.isdisjoint(moved):
            self.watched_moves += 1
        self._free_offsets = [top] if top < self.capacity else []
        self._free_sizes = {top: self.capacity - top} if top < self.capacity else {}
        self._views.clear()
        return moved

    def _move_down(self, src: int, dst: int, size: int) -> None:
        """Copy [src, src+size) to [dst, dst+size), dst < src, in chunks no longer than the shift, in
        ascending order: no chunk's destination overlaps bytes that have not been copied yet."""
        step = src - dst
        for done in range(0, size, step):
            n = min(step, size - done)
            a = self.backend.view(self.arena, src + done, (n,), np.uint8)
            b = self.backend.view(self.arena, dst + done, (n,), np.uint8)
            self.backend.ops.copy(a, b)

    def rename(self, key: Hashable, new_key: Hashable) -> None:
        """Keep `key`'s block, under `new_key` (a block whose owner has gone but which a copy still reads)."""
        if new_key in self._used:
            raise KeyError(f"{new_key!r} is already allocated")
        self._used[new_key] = self._used.pop(key)
        if key in self._watched:
            self.watched_moves += 1

    def view(self, key: Hashable, shape: tuple[int, ...], dtype, layout: str = "NCHW") -> Any:
        """The array over `key`'s block (`layout`: its memory layout, memory/tensors.py; backend_view says how
        it reaches the backend). Views are cached by (offset, shape, dtype, layout): the memory schedule puts
        a tensor at the same offset every iteration, so handing back the same array object lets the
        backend's per-array caches (flat views, kernel argument blocks, cuDNN argument sets) hit instead
        of rebuilding them for every tensor at every step."""
        where = (self._used[key].offset, tuple(shape), np.dtype(dtype).str, layout)
        array = self._views.get(where)
        if array is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            array = self._views[where] = backend_view(self.backend, self.arena, where[0], shape, dtype, layout)
        return array

    def owns(self, key: Hashable) -> bool:
        return key in self._used

    def offset(self, key: Hashable) -> int:
        """The byte offset of `key`'s block in the arena."""
        return self._used[key].offset

    def watch(self, keys: Iterable[Hashable]) -> int:
        """From now on, count in `watched_moves` every compaction that moves, and every free or rename of, a
        block of `keys`; returns the count. Offsets read after this call stay right while the count does not
        change: one comparison per use for whoever keeps a table of them (solver/fused_update.py)."""
        self._watched.update(keys)
        return self.watched_moves

    # -- counters ---------------------------------------------------------------------------
    def largest_free(self) -> int:
        return max(self._free_sizes.values(), default=0)

    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def fragmentation(self) -> float:
        """1 - largest free block / all free bytes: 0 when the free space is one block."""
        free = self.free_bytes()
        return 0.0 if free == 0 else 1.0 - self.largest_free() / free

    def reset_high_water(self) -> None:
        self.high_water = self.used_bytes


class MallocPool:
    """HeapPool's interface, but every tensor is its own backend allocation, returned on free.

    On the GPU that is cudaMalloc/cudaFree per tensor: the allocator the paper's Table 2 compares the
    heap pool with (`SUPERNEURONS_ALLOCATOR=malloc`). The budget is enforced the same way (whole
    blocks, `PoolExhausted`), so the memory modes behave identically; only the cost differs.
    """

    def __init__(self, nbytes: int, backend: Any):
        self.capacity = nbytes // BLOCK * BLOCK
        self.backend = backend
        self._arrays: dict[Hashable, Any] = {}
        self._sizes: dict[Hashable, int] = {}
        self.used_bytes = 0
        self.high_water = 0
        self.n_allocs = 0
        self.n_frees = 0

    def alloc(self, key: Hashable, nbytes: int, high: bool = False) -> int:
        if key in self._arrays:
            raise KeyError(f"{key!r} is already allocated")
        size = round_up(nbytes)
        if self.used_bytes + size > self.capacity:
            raise PoolExhausted(
                f"memory pool exhausted: need {format_bytes(size)} for {key!r}, "
                f"{format_bytes(self.capacity - self.used_bytes)} free of {format_bytes(self.capacity)}")
        self._arrays[key] = self.backend.arena(size)
        self._sizes[key] = size
        self.used_bytes += size
        self.high_water = max(self.high_water, self.used_bytes)
        self.n_allocs += 1
        return 0

    def free(self, key: Hashable) -> None:
        del self._arrays[key]
        self.used_bytes -= self._sizes.pop(key)
        self.n_frees += 1
        self.backend.release_freed()  # numba defers cudaFree: run it now, so the cost is measured where it is paid

    def rename(self, key: Hashable, new_key: Hashable) -> None:
        if new_key in self._arrays:
            raise KeyError(f"{new_key!r} is already allocated")
        self._arrays[new_key] = self._arrays.pop(key)
        self._sizes[new_key] = self._sizes.pop(key)

    def compact(self) -> list:
        return []  # separate allocations: the device allocator's fragmentation is not ours to fix

    def view(self, key: Hashable, shape: tuple[int, ...], dtype, layout: str = "NCHW") -> Any:
        return backend_view(self.backend, self._arrays[key], 0, shape, dtype, layout)

    def owns(self, key: Hashable) -> bool:
        return key in self._arrays

    def largest_free(self) -> int:
        return self.capacity - self.used_bytes  # the device allocator's fragmentation is not ours to see

    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def fragmentation(self) -> float:
        return 0.0

    def reset_high_water(self) -> None:
        self.high_water = self.used_bytes


ALLOCATORS: dict[str, type[HeapPool] | type[MallocPool]] = {"pool": HeapPool, "malloc": MallocPool}


def make_pool(nbytes: int, backend: Any, allocator: str = "pool") -> "HeapPool | MallocPool":
    """The Net's allocator: the heap pool, or per-tensor allocations (memory_param allocator MALLOC)."""
    return ALLOCATORS[allocator](nbytes, backend)
