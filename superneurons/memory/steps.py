"""What the Net runs and its memory managers see: `Tensor` (a named array slot), `Step` (one forward or
backward step with the tensors it reads and writes) and `RunContext` (per-run state layers read).

They live below `runtime` so the managers (`interface.py`, `liveness_manager.py`) and the Net share
them without `memory` importing the Net; `runtime/net.py` builds and runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from superneurons.dtypes import tensor_bytes
from superneurons.graph.node import Node


@dataclass
class RunContext:
    """Per-run state layers may read: Dropout hashes (seed, iteration, layer, index) into its mask."""

    seed: int = 0
    iteration: int = 0
    recomputing: bool = False  # True while the recompute manager replays a forward step
    rank: int = 0  # data parallelism: this process is rank `rank` of `ranks` (data layers shard by it)
    ranks: int = 1
    # Decode worker processes of every data layer of the run (--data-workers), over their decode_workers;
    # None: each layer's own (data/workers.py, choose_workers).
    data_workers: int | None = None
    # Where convolutions borrow their workspace (memory/workspace.py: the Net's pool, so the plan holds it);
    # None: the backend's own buffer.
    workspace: Any = None
    # The net's float64 scratch region (memory/tensors.py: `#scratch`): a pool tensor, placed at setup, whose array
    # the layers and the solver pass to the ops that sum (`scratch=`, backend/scratch.py); None outside a Net (the
    # ops then take memory of their own).
    scratch_tensor: "Tensor | None" = None
    # Checks of the input a layer queued without waiting for the device (SoftmaxWithLoss' labels on the GPU):
    # the Net runs them once it has read the loss, each raising the UserError its layer would have raised.
    deferred_checks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def scratch(self) -> Any:
        """The scratch region's array as it is now (a compaction may have moved it), or None."""
        t = self.scratch_tensor
        return t.array if t is not None else None

    def defer(self, check: Callable[[], None]) -> None:
        self.deferred_checks.append(check)

    def run_deferred_checks(self) -> None:
        checks, self.deferred_checks = self.deferred_checks, []
        for check in checks:
            check()


class Tensor:
    """A named array slot. `array` is the backend view while resident; `base` makes this a reshaped view."""

    __slots__ = ("key", "shape", "dtype", "nbytes", "array", "base", "kind", "zero_init", "_reshaped", "layout")

    def __init__(self, key: str, shape: tuple[int, ...], dtype=np.float32, kind: str = "data",
                 base: "Tensor | None" = None, layout: str = "NCHW"):
        self.key = key
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = tensor_bytes(self.shape, self.dtype)
        self.array: Any = None
        self.base = base
        self.kind = kind
        self.zero_init = kind in ("diff", "param_diff", "history")  # history starts at zero, as in Caffe
        self._reshaped: tuple[Any, Any] = (None, None)  # (base array, this view of it), see Net.materialize
        self.layout = layout  # memory layout of its array (memory/tensors.py; the shape stays N, C, H, W)

    def __repr__(self) -> str:
        return f"Tensor({self.key!r}, {self.shape}, {self.kind})"


@dataclass
class Step:
    """One forward or backward step of the route, with the tensors it reads and writes."""

    node: Node
    bottoms: list[Tensor]
    tops: list[Tensor]
    bottom_diffs: list[Tensor | None]
    top_diffs: list[Tensor | None]
