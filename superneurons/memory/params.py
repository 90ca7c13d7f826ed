"""Parameters are tensors too (issue #4): their values, gradients and solver history live in the Net's
pool, and when the budget cannot hold all of them beside the activations, they live on the host and come
to the device only for the steps that use them.

- A layer's weights are needed in its forward step and its backward step; its gradients in its
  backward step (they accumulate there, `+=`, over `iter_size` passes) and at the update; the solver's
  history only at the update.
- `ResidentParams`: everything placed once at setup (the memory manager does it); nothing moves.
- `OffloadedParams`: every parameter tensor has a host copy (its home). Before a step the tensors it
  uses are given pool blocks and copied in; after it, weights are simply dropped (the step did not
  change them) and gradients are copied home. The solver updates one parameter at a time
  (`Solver._update_streamed`), so only one parameter's data, gradient and history are on the device at
  once. Between steps a tensor's `array` is its host copy, so snapshots, weight files and the tests
  read and write the current values with no special path.

A gradient the solver has zeroed is not copied in: the pool block is zero-filled instead.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

PARAM_KINDS = ("param", "param_diff", "history")


def param_root(decl: Any) -> Any:
    """The ParamDecl that owns the tensors of `decl` (shared params and test nets point at it)."""
    while getattr(decl, "owner", None) is not None:
        decl = decl.owner
    return decl


class ResidentParams:
    """Parameters placed once at setup by the memory manager; the hooks do nothing."""

    offloaded = False

    def __init__(self, net: Any):
        self.net = net

    def write(self, tensor: Any, values: np.ndarray) -> None:
        self.net.backend.from_host(tensor.array, values)

    def clear_diffs(self, decls: Iterable[Any]) -> None:
        for decl in decls:
            self.net.ops.fill(decl.diff, 0.0)

    def register(self, decl: Any) -> None:
        pass


class OffloadedParams:
    """Host homes for the parameter tensors of `net`; the device holds only what a step uses."""

    offloaded = True

    def __init__(self, net: Any, tensors: list[Any]):
        self.net = net
        self.home: dict[str, np.ndarray] = {}
        self.by_key = {t.key: t for t in tensors}
        self.zero: set[str] = set()  # gradients whose value is all zeros (fill instead of copying in)
        self.decls: dict[str, dict[int, tuple[Any, str]]] = {}  # tensor key -> {id: (decl, "data"/"diff")}
        self.on: set[str] = set()
        for t in tensors:
            self.home[t.key] = np.zeros(t.shape, t.dtype)
            t.array = self.home[t.key]
            if t.kind == "param_diff":
                self.zero.add(t.key)

    # -- binding -----------------------------------------------------------------------------------
    def register(self, decl: Any) -> None:
        """`decl` (of this net or of a test net sharing its weights) reads the arrays of its root's tensors."""
        root = param_root(decl)
        data, diff = root.data_tensor, getattr(root, "diff_tensor", None)
        for t, attr in ((data, "data"), (diff, "diff")):
            if t is not None and t.key in self.by_key:
                self.decls.setdefault(t.key, {})[id(decl)] = (decl, attr)

    def _rebind(self, t: Any) -> None:
        for decl, attr in self.decls.get(t.key, {}).values():
            setattr(decl, attr, t.array)

    # -- values outside the step loop ----------------------------------------------------------------
    def write(self, tensor: Any, values: np.ndarray) -> None:
        self.home[tensor.key][...] = np.asarray(values, dtype=tensor.dtype).reshape(tensor.shape)
        self.zero.discard(tensor.key)

    def clear_diffs(self, decls: Iterable[Any]) -> None:
        for decl in decls:
            t = decl.diff_tensor
            self.home[t.key].fill(0)
            self.zero.add(t.key)

    # -- moving ------------------------------------------------------------------------------------
    def acquire(self, tensors: Iterable[Any]) -> None:
        """Give each tensor a pool block holding its current value."""
        net = self.net
        for t in tensors:
            if t.key in self.on:
                continue
            net.memory.alloc_block(t.key, t.nbytes)  # may evict cached activations (offload, recompute)
            net._attach(t)
            if t.key in self.zero:
                net.ops.fill(t.array, 0.0)
            else:
                net.backend.from_host(t.array, self.home[t.key])
            self.on.add(t.key)
            self._rebind(t)

    def release(self, tensors: Iterable[Any], changed: Iterable[Any] = ()) -> None:
        """Give the pool blocks back; the values of `changed` are copied home first."""
        net = self.net
        changed_keys = {t.key for t in changed}
        for t in tensors:
            if t.key not in self.on:
                continue
            if t.key in changed_keys:
                self.home[t.key][...] = net.backend.to_host(t.array)
                self.zero.discard(t.key)
            net.pool.free(t.key)
            t.array = self.home[t.key]
            self.on.discard(t.key)
            self._rebind(t)

    def step_lists(self, nodes: list[Any], train: bool) -> tuple[list[tuple[list, list]], list[tuple[list, list]]]:
        """Per node, for its forward and its backward step: (parameter tensors it uses, those it changes).
        Forward changes only statistics a layer keeps itself (BatchNorm's running sums, not learnable);
        backward accumulates into the gradients."""
        fwd, bwd = [], []
        for node in nodes:
            roots = list({id(r): r for r in (param_root(d) for d in node.layer.params)}.values())
            mine = [r for r in roots if r.data_tensor.key in self.by_key]
            data = [r.data_tensor for r in mine]
            stats = [r.data_tensor for r in mine if not r.learnable]
            diffs = [r.diff_tensor for r in mine if train and getattr(r, "diff_tensor", None) is not None]
            fwd.append((data, stats))
            bwd.append((data + diffs, diffs))
        return fwd, bwd
