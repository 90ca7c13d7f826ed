"""The whole parameter update in one launch, and the clearing of every gradient in another.

Caffe's ApplyUpdate is a few tiny ops per learnable parameter (scale, weight decay, the rule) and clearing
the gradients one fill each: for ResNet-50's 161 parameters that is hundreds of launches per iteration, each
costing more host time than the GPU spends on it. But every parameter, gradient and history tensor is a
block of the Net's pool, one arena, so one kernel reaches all of them through a flat float32 view of the
arena and a table of per-parameter element offsets (the `multi_*` ops of backend/*/solver_ops.py).

The offsets are those of the blocks when the table was built; a block moves when the pool compacts or a
tensor is freed and re-allocated. The pool counts such moves of the blocks it was asked to watch
(`HeapPool.watch`), so each call compares one counter with its value at the last build and rebuilds the
table when it changed: stale offsets are never used, and the check costs the same for 10 or 1000 tensors.

The tables (the thread blocks' work split, each parameter's rate and decay factors, the segment offsets) are
one pool tensor of the Net, `#update` (memory/tensors.py; the Solver passes its Net the block size, `update_chunk`,
where `wanted` says it may run), resident and in the plan like the ops' scratch region: the update allocates
nothing on the device. The Net plans it for a training net whose solver may take this path; where the path turns
out not to apply (streamed parameters, the malloc allocator) the few bytes stay unused.

The grouped path serves resident float32 parameters in a pool with one arena, under a rule with a
multi-tensor op (SGD). `unsupported` names why it does not apply otherwise (streamed parameters,
the malloc allocator, another rule, SUPERNEURONS_MULTI_UPDATE=0); the Solver then keeps the
per-parameter ops. The CPU backend runs the grouped ops too, with the per-parameter ops' arithmetic.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons import settings
from superneurons.dtypes import element_count
from superneurons.memory.tensors import update_table_entries
from superneurons.proto import superneurons_pb2 as pb

ENV = "SUPERNEURONS_MULTI_UPDATE"  # 0: always the per-parameter ops (for comparisons and benchmarks)
RULES = ("SGD",)  # the rules with a multi-tensor op
CHUNK = 4096  # elements per thread block: 16 per thread, and a block of its own for every small tensor


def wanted(rule: str | None) -> bool:
    """Whether a training net's solver may run the grouped update under `rule` (None: not known; `superneurons
    memory` plans as the default SGD solver does), so its Net plans the tables."""
    return bool(settings.get(ENV)) and (rule is None or rule in RULES)


def table_entries(lengths, chunk: int | None = None) -> int:
    """The 8-byte entries of the tables for parameters of `lengths` elements, in blocks of `chunk` (default CHUNK,
    read when called: what the Solver passes its Net as `update_chunk`)."""
    return update_table_entries(lengths, CHUNK if chunk is None else chunk)


def unsupported(net: Any, rule: str) -> str | None:
    """Why the grouped update cannot serve `net`'s learnable parameters under `rule` (None: it can)."""
    if not settings.get(ENV):
        return f"{ENV}=0"
    if rule not in RULES:
        return f"no multi-tensor op for the {rule} rule"
    if not net.learnable or not net.history:
        return "no learnable parameters or no solver history"
    if getattr(net, "update_table", None) is None:
        return "the net planned no update tables (Net(update_chunk=0))"
    if net.params.offloaded:
        return "the parameters are streamed from the host"
    if getattr(net.pool, "arena", None) is None or not hasattr(net.pool, "watch"):
        return "the pool has no single arena (allocator malloc)"
    if any(t.dtype != np.float32 for t in _tensors(net)):
        return "a parameter tensor is not float32"
    return None


def work_split(lengths: np.ndarray, chunk: int = CHUNK) -> np.ndarray:
    """Thread blocks covering every segment in pieces of at most `chunk` elements: int64 rows of
    (segment, first element, end element), segment by segment."""
    lengths = np.asarray(lengths, np.int64)
    counts = -(-lengths // chunk)
    segment = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    piece = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    start = piece * chunk
    return np.column_stack([segment, start, np.minimum(start + chunk, lengths[segment])])


def _tensors(net: Any) -> list[Any]:
    """Data, then gradients, then history (the segment table's columns), each in `net.learnable` order."""
    decls = net.learnable
    history = net.history[0] if net.history else []
    return [d.data_tensor for d in decls] + [d.diff_tensor for d in decls] + list(history)


class GroupedUpdate:
    """The segment tables of one training net's learnable parameters, and the calls that use them. `update`
    and `clear_grads` return False, having done nothing, when a tensor has no pool block: the caller then
    runs the per-parameter ops."""

    def __init__(self, net: Any, param: pb.SolverParameter, chunk: int = CHUNK):
        self.net, self.ops = net, net.ops
        self.momentum = float(param.momentum)
        self.l1 = param.regularization_type == "L1"
        pool, backend = net.pool, net.backend
        self._arena = backend.view(pool.arena, 0, (pool.capacity // 4,), np.float32)
        self._tensors = _tensors(net)
        decls = net.learnable
        lengths = np.array([element_count(t.shape) for t in self._tensors[:len(decls)]], np.int64)
        self._lengths = lengths
        # What does not depend on where the tensors are, kept on the host and written with the segments.
        self._blocks = work_split(lengths, chunk)
        self._factors = np.array([(d.lr_mult, float(param.weight_decay) * d.decay_mult) for d in decls],
                                 np.float64).reshape(-1, 2)
        self._table = net.update_table  # the planned pool tensor `#update` (int64 entries)
        if self._table.shape[0] < table_entries(lengths, chunk):
            raise RuntimeError(f"the net planned {self._table.shape[0]} update table entries, the grouped update "
                               f"needs {table_entries(lengths, chunk)}")
        self._segments: Any = None
        self._built_at: int | None = None  # the pool's watched_moves when the table was built (None: not built)
        self.rebuilds = 0  # how often the table was built (tests, diagnostics)

    def update(self, rate: float, clip_scale: float, iter_size: int, loss_scale: float = 1.0) -> bool:
        """Caffe's ApplyUpdate for every learnable parameter: the gradients scaled by `clip_scale` and
        1/iter_size (and 1/loss_scale: the solver's loss scaling divided out), weight decay, then the rule with
        local rate `rate` * lr_mult (on the device)."""
        if not self._current():
            return False
        # the per-parameter update's factor, computed the same way, so both paths give the same bits
        self.ops.multi_sgd_update(self._arena, self._segments, self._factors_view, self._blocks_view, rate,
                                  self.momentum, clip_scale, 1.0 / iter_size / loss_scale, self.l1)
        return True

    def clear_grads(self) -> bool:
        """Zero every learnable parameter's gradient."""
        if not self._current():
            return False
        self.ops.multi_zero_grads(self._arena, self._segments, self._blocks_view)
        return True

    def _current(self) -> bool:
        """Whether the table holds the tensors' present offsets, rebuilding it when a block moved (the table's own
        included: it is watched with them, so its views follow it)."""
        return self.net.pool.watched_moves == self._built_at or self._rebuild()

    def _rebuild(self) -> bool:
        pool, table = self.net.pool, self._table
        self._built_at = None
        if not all(pool.owns(t.key) for t in self._tensors) or not pool.owns(table.key) or table.array is None:
            return False
        built_at = pool.watch([t.key for t in self._tensors] + [table.key])
        # Pool blocks start on 1 KiB boundaries, so byte offsets are whole float32 elements.
        offsets = np.array([pool.offset(t.key) for t in self._tensors], np.int64).reshape(3, -1) // 4
        segments = np.column_stack([offsets[0], offsets[1], offsets[2], self._lengths])
        host = np.zeros(table.shape, np.int64)
        parts = (self._blocks, self._factors.view(np.int64), segments)
        at = 0
        views = []
        for part in parts:
            host[at:at + part.size] = part.ravel()
            views.append((at, part.shape))
            at += part.size
        # In place (the copy is ordered after the launches that read the old table): no allocation.
        self.net.backend.from_host(table.array, host)
        (b_at, b_shape), (f_at, f_shape), (s_at, s_shape) = views
        region = table.array
        self._blocks_view = region[b_at:b_at + self._blocks.size].reshape(b_shape)
        self._factors_view = region[f_at:f_at + self._factors.size].view(np.float64).reshape(f_shape)
        self._segments = region[s_at:s_at + segments.size].reshape(s_shape)
        self._built_at = built_at
        self.rebuilds += 1
        return True


def grouped_update(net: Any, rule: str, param: pb.SolverParameter) -> GroupedUpdate | None:
    """The grouped update for `net`, or None when `unsupported` (the per-parameter ops then run)."""
    return None if unsupported(net, rule) else GroupedUpdate(net, param)
