"""How much float64 scratch the ops that sum take: one function per kind of sum, read by the layers (which
declare what their steps need, `Layer.scratch_entries`) and by the GPU ops (which carve their sums out of it).

A reduction on the GPU sums into float64 entries on the device (partial sums of many blocks, a loss's
counts) before the result is finished into the output. Those entries are not allocated by the ops: the Net
plans one region for them (`memory/tensors.py`: the `#scratch` tensor, as many entries as the largest need
of its layers and the solver), keeps it in its pool from setup on, and passes it to every op call that sums
(`scratch=`, from `RunContext.scratch`). Every op runs on one stream in order, so the next op may reuse the
region as soon as the last one is queued. The CPU ops sum in NumPy and need none; they check the region
they are given against the same numbers (`check`), so a layer that declares too little fails in CI.
"""
from __future__ import annotations

from typing import Any

import numpy as np

DTYPE = np.dtype(np.float64)


def row_sums(rows: int) -> int:
    """Per-row (per-channel) partial sums of a reduction over `rows` rows: two running sums each (a sum and
    a second moment or a dot product)."""
    return 2 * max(int(rows), 0)


def total() -> int:
    """One sum over a whole array (asum, sumsq, dot, all_finite; a count of bad indices)."""
    return 1


def loss_stats() -> int:
    """A loss's running sums: the loss, the valid count, and the count, position and value of the first label
    outside the classes."""
    return 5


def accuracy_sums(channels: int) -> int:
    """Accuracy's correct, valid and bad counts, then hits and items seen per class."""
    return 3 + 2 * max(int(channels), 0)


def check(scratch: Any, entries: int, op: str) -> None:
    """Refuse a region smaller than `entries` (None: the op allocates its own, for calls outside a Net)."""
    if scratch is not None and scratch.size < entries:
        raise RuntimeError(f"{op} needs {entries} float64 scratch entries, the net planned {scratch.size}: the "
                           f"calling layer's scratch_entries() declares too few")


def contrastive_loss(pairs: int) -> int:
    """ContrastiveLoss: each pair's squared distance (row sums), then the loss's sums after them."""
    return row_sums(pairs) + loss_stats()


def infogain_loss(channels: int) -> int:
    """InfogainLoss: the loss's sums, then the row sums of the infogain matrix after them (backward)."""
    return loss_stats() + row_sums(channels)
