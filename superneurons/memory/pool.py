"""The heap-based memory pool (paper section 4.1): one arena allocated once, carved in 1 KiB blocks.

Allocation is first fit over an offset-ordered free list; freeing coalesces with both
neighbours. An id-to-node map finds a tensor's block in O(1). On the GPU this replaces
cudaMalloc/cudaFree in the training loop; on the CPU the arena is host memory with the same
allocator, so everything above it behaves identically in CI.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Hashable

from superneurons.errors import PoolExhausted

BLOCK = 1024


def round_up(nbytes: int) -> int:
    return max(BLOCK, (nbytes + BLOCK - 1) // BLOCK * BLOCK)


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
        self.used_bytes = 0
        self.high_water = 0
        self.n_allocs = 0
        self.n_frees = 0

    # -- allocation -----------------------------------------------------------------------
    def alloc(self, key: Hashable, nbytes: int) -> int:
        """Reserve `nbytes` for `key`; returns the byte offset into the arena."""
        if key in self._used:
            raise KeyError(f"{key!r} is already allocated")
        size = round_up(nbytes)
        for i, off in enumerate(self._free_offsets):
            free = self._free_sizes[off]
            if free >= size:
                del self._free_sizes[off]
                if free == size:
                    del self._free_offsets[i]
                else:
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

    def view(self, key: Hashable, shape: tuple[int, ...], dtype) -> Any:
        return self.backend.view(self.arena, self._used[key].offset, shape, dtype)

    def owns(self, key: Hashable) -> bool:
        return key in self._used

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
