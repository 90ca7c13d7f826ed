"""Per-iteration and cumulative data-movement counters, read the same way from every memory manager.

`net.memory.stats()` is the one place benchmarks read them:
    {"iteration": {bytes_offloaded, bytes_prefetched, hits, misses, host_pinned_bytes},  # since this iteration began
     "total":     {...same keys...}}                                                    # since the Net was built
Bytes are pool bytes (whole 1 KiB blocks) actually copied device->host and host->device; hits and
misses are the Tensor Cache's checks of offloadable tensors a step reads (Alg. 2). host_pinned_bytes
is the host memory the offload host store has pinned (it only grows: chunks are kept), so "total" is
what it holds now and "iteration" what this iteration added. The managers that move nothing report zeros.
"""
from __future__ import annotations

COUNTERS = ("bytes_offloaded", "bytes_prefetched", "hits", "misses", "host_pinned_bytes")


class MovementCounters:
    # Counted by the manager as it copies.
    bytes_offloaded = 0
    bytes_prefetched = 0

    # Read from what keeps them (the Tensor Cache, the host store): read-only, zero where there is none.
    @property
    def hits(self) -> int:
        return 0

    @property
    def misses(self) -> int:
        return 0

    @property
    def host_pinned_bytes(self) -> int:
        return 0
    _iteration_start: tuple[int, ...] = (0,) * len(COUNTERS)

    def _totals(self) -> tuple[int, ...]:
        return tuple(int(getattr(self, name)) for name in COUNTERS)

    def _mark_iteration(self) -> None:
        """A new iteration starts: the per-iteration counters restart from zero."""
        self._iteration_start = self._totals()

    def stats(self) -> dict[str, dict[str, int]]:
        total = self._totals()
        return {"iteration": {n: t - s for n, t, s in zip(COUNTERS, total, self._iteration_start)},
                "total": dict(zip(COUNTERS, total))}
