"""Unified Tensor Pool (paper section 3.3): offloading checkpoint outputs and prefetching them back.

Two halves:
- the *plan* (`plan_offload`): which tensors leave the device and when. Checkpoint layers are
  CONV by default (compute-heavy, so the copy hides under their compute); data-layer outputs are
  checkpoints too, as in the paper's implementation. A checkpoint output that backward needs is
  modelled as leaving the device right after the step following its production (or its last
  forward use, if later), and as coming back when backward reaches the next checkpoint in forward
  order ("one checkpoint ahead"), or at its first backward use if that comes sooner.
- the *host side* (`HostStore`): the external pool. On the CPU backend it is a second `HeapPool`
  arena with the same allocator; on the GPU it will be pinned host memory behind the same calls.
"""
from __future__ import annotations

from typing import Any, Iterable

from superneurons.memory.liveness import OFFLOAD, PREFETCH, Liveness, Program, Schedule
from superneurons.memory.pool import HeapPool

DEFAULT_CHECKPOINTS: tuple[str, ...] = ("Convolution",)


def checkpoint_steps(program: Program, types: Iterable[str]) -> list[int]:
    """Forward indices of checkpoint layers (the given types, plus data layers)."""
    types = set(types)
    return [i for i, n in enumerate(program.graph.nodes) if n.layer.type_name in types or n.layer.is_data]


def checkpoint_tensors(program: Program, types: Iterable[str]) -> set[str]:
    """Roots first written by a checkpoint layer: what offload may move and recompute never drops."""
    cps = set(checkpoint_steps(program, types))
    return {k for k, ws in program.writers.items() if ws[0] in cps}


def plan_offload(program: Program, live: Liveness, types: Iterable[str],
                 needed_by: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
    """key -> (step after which it leaves the device, step before which it is back).

    `needed_by` lets recomputation ask for a tensor earlier than its own backward use (a replayed
    forward step reads it).
    """
    cps = checkpoint_steps(program, types)
    bstep = program.backward_step_of()
    nf = program.n_forward
    needed_by = needed_by or {}
    out: dict[str, tuple[int, int]] = {}
    for k in sorted(checkpoint_tensors(program, types)):
        if k not in live.backward_first or k in program.pinned:
            continue  # backward never reads it: liveness frees it anyway
        prod = program.writers[k][0]
        off = max(prod + 1, live.forward_last.get(k, prod))
        nxt = [c for c in cps if c > prod and c in bstep]
        back = bstep[nxt[0]] if nxt else nf
        back = min(back, live.backward_first[k], needed_by.get(k, back))
        if back > off + 1:  # at least one step spent off the device, or it is not worth moving
            out[k] = (off, back)
    return out


def apply_offload(schedule: Schedule, moves: dict[str, tuple[int, int]]) -> None:
    for k, (off, back) in moves.items():
        schedule.after[off].append((OFFLOAD, k))
        schedule.before[back].insert(0, (PREFETCH, k))


class HostStore:
    """The external pool: host copies of evicted tensors, carved from one arena."""

    def __init__(self, nbytes: int, backend: Any):
        self.pool = HeapPool(nbytes, backend)
        self.ops = backend.ops

    def __contains__(self, key: str) -> bool:
        return self.pool.owns(key)

    def save(self, key: str, device_array: Any) -> None:
        self.pool.alloc(key, device_array.nbytes)
        self.ops.copy(device_array, self.pool.view(key, device_array.shape, device_array.dtype))

    def load(self, key: str, device_array: Any) -> None:
        self.ops.copy(self.pool.view(key, device_array.shape, device_array.dtype), device_array)
        self.pool.free(key)

    def drop(self, key: str) -> None:
        if self.pool.owns(key):
            self.pool.free(key)
