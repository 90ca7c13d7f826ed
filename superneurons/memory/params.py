"""Parameters are tensors too: their values, gradients and solver history live in the Net's
pool, and when the budget cannot hold all of them beside the activations, they live on the host and come
to the device only for the steps that use them.

- A layer's weights are needed in its forward step and its backward step; its gradients in its
  backward step (they accumulate there, `+=`, over `iter_size` passes) and at the update; the solver's
  history only at the update.
- `ResidentParams`: everything placed once at setup (the memory manager does it); nothing moves.
- `OffloadedParams`: every parameter tensor has a host copy (its home), carved from one arena of the
  host transfer (`Backend.make_transfer`: pinned memory on the GPU, so copies run at PCIe speed). Before
  a step the tensors it uses are given pool blocks and copied in; after it, weights are simply dropped
  (the step did not change them) and gradients are copied home. The solver updates one parameter at a
  time (`Solver._update_streamed`), so only one parameter's data, gradient and history are on the
  device at once. Between steps a tensor's `array` is its home, so snapshots, weight files and the tests
  read and write the current values (after `settle()`; the Net's `HostAwareBackend` does it).

Copies are asynchronous, on the transfer's copy streams, ordered against the compute with events as the
host store's are (`backend/cuda/transfer.py`): while a step computes, the next step's tensors are copied in
(`prefetch`, only into free pool room: it never evicts), and the step that uses them makes the compute
wait for the copy on the device (`join`). A gradient copied home keeps its device block until the copy
has completed (`outgoing`); the blocks come back when later copies are polled, or at once when an
allocation needs the room (`make_room`, which also drops prefetched blocks). A gradient the solver has
zeroed is not copied in: the pool block is zero-filled instead. On the CPU the same code runs with
NumPy copies, which SUPERNEURONS_TRANSFER_LAG=N delays, so CI catches a home read before its copy ended.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable, Literal

import numpy as np

from superneurons.memory.pool import BLOCK, HeapPool, round_up


def param_root(decl: Any) -> Any:
    """The ParamDecl that owns the tensors of `decl` (shared params and test nets point at it)."""
    while decl.owner is not None:
        decl = decl.owner
    return decl


def layers_computed_by(graph: Any) -> list[list[Any]]:
    """Per node of `graph`, the layers whose parameters its forward and backward read: its own layer, plus
    the layers graph/fuse.py folded into it (a fused BatchNorm applies its Scale's weights); a folded layer's
    own steps read none (they pass through)."""
    return graph.fusions.layers_computed_by(graph.nodes)


class ResidentParams:
    """Parameters placed once at setup by the memory manager; the hooks do nothing."""

    offloaded: ClassVar[Literal[False]] = False  # a literal: testing it tells a type checker which store it is

    def __init__(self, net: Any):
        self.net = net

    def write(self, tensor: Any, values: np.ndarray) -> None:
        self.net.backend.from_host(tensor.array, values)

    def clear_diffs(self, decls: Iterable[Any]) -> None:
        for decl in decls:
            self.net.ops.fill(decl.diff, 0.0)

    def register(self, decl: Any) -> None:
        pass

    def settle(self) -> None:
        pass

    def make_room(self) -> bool:
        return False

    def home_key(self, array: Any) -> str | None:
        return None


class OffloadedParams:
    """Host homes for the parameter tensors of `net`; the device holds only what a step uses (and what
    the next step will use, when there is room)."""

    offloaded: ClassVar[Literal[True]] = True

    def __init__(self, net: Any, tensors: list[Any]):
        self.net = net
        self.transfer = net.backend.make_transfer()
        self.host = HeapPool(sum(round_up(t.nbytes) for t in tensors) + BLOCK, self.transfer)
        self.home: dict[str, np.ndarray] = {}
        self.by_key = {t.key: t for t in tensors}
        self.zero: set[str] = set()  # gradients whose value is all zeros (fill instead of copying in)
        self.decls: dict[str, dict[int, tuple[Any, str]]] = {}  # tensor key -> {id: (decl, "data"/"diff")}
        self.on: set[str] = set()  # tensors with a device block holding their current value
        self.incoming: dict[str, Any] = {}  # key -> event of a copy in the compute has not waited for yet
        self.outgoing: dict[str, Any] = {}  # key -> event of its copy home; the device block is held till then
        self._home_ids: dict[int, str] = {}
        for t in tensors:
            self.host.alloc(t.key, t.nbytes)
            home = self.host.view(t.key, t.shape, t.dtype)
            home.fill(0)
            self.home[t.key] = home
            self._home_ids[id(home)] = t.key
            t.array = home
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
        self.settle()
        self.home[tensor.key][...] = np.asarray(values, dtype=tensor.dtype).reshape(tensor.shape)
        self.zero.discard(tensor.key)

    def clear_diffs(self, decls: Iterable[Any]) -> None:
        self.settle()  # a gradient still on its way home would land over the zeros
        for decl in decls:
            t = decl.diff_tensor
            self.home[t.key].fill(0)
            self.zero.add(t.key)

    def home_key(self, array: Any) -> str | None:
        """The key of the tensor whose home `array` is (None: not a home)."""
        key = self._home_ids.get(id(array))
        return key if key is not None and self.home[key] is array else None

    def settle(self) -> None:
        """Wait for every copy home: the homes then hold the current values (host code may read them)."""
        self._reclaim(wait=True)

    # -- moving ------------------------------------------------------------------------------------
    def acquire(self, tensors: Iterable[Any]) -> None:
        """Give each tensor a pool block holding its current value, before the compute that reads it."""
        tensors = list(tensors)
        self._reclaim()
        need = sum(round_up(t.nbytes) for t in tensors if t.key not in self.on and t.key not in self.outgoing)
        if self.outgoing and self.net.pool.largest_free() < need:
            self._reclaim(wait=True)  # place the blocks in one extent rather than around blocks about to go
        for t in tensors:
            if t.key not in self.on:
                self._bring(t)
            event = self.incoming.pop(t.key, None)
            if event is not None:
                self.transfer.join(event)  # the compute waits for the copy on the device; the host goes on

    def prefetch(self, tensors: Iterable[Any]) -> None:
        """Start copying the next step's tensors in while this step computes. Only into ample free room:
        what they take must leave as much contiguous room again, so the allocations before their use (the
        next step's activations, or the rest of an update) do not meet a pool they fragmented."""
        pool = self.net.pool
        wanted = [t for t in tensors if t.key not in self.on and t.key not in self.outgoing]
        if not wanted or pool.largest_free() < 2 * sum(round_up(t.nbytes) for t in wanted):
            return
        for t in wanted:
            self._bring(t)

    def release(self, tensors: Iterable[Any], changed: Iterable[Any] = ()) -> None:
        """Give the pool blocks back; the values of `changed` are copied home first (asynchronously: their
        blocks return when the copy has completed)."""
        changed_keys = {t.key for t in changed}
        for t in tensors:
            if t.key not in self.on:
                continue
            event = None
            if t.key in changed_keys:
                event = self.transfer.to_host(t.array, self.home[t.key])
                self.zero.discard(t.key)
            if event is None or event.query():
                self.net.pool.free(t.key)
            else:
                self.outgoing[t.key] = event
            t.array = self.home[t.key]
            self.on.discard(t.key)
            self._rebind(t)

    def make_room(self) -> bool:
        """An allocation failed: return the blocks of finished or pending copies home, else drop the
        prefetched blocks. Whether anything was freed."""
        if self.outgoing:
            self._reclaim(wait=True)
            return True
        dropped = [k for k in self.incoming]
        for k in dropped:
            self.incoming.pop(k).synchronize()  # the copy in must not write a block given to someone else
            t = self.by_key[k]
            self.net.pool.free(k)
            t.array = self.home[k]
            self.on.discard(k)
            self._rebind(t)
        return bool(dropped)

    def _bring(self, t: Any) -> None:
        """Device block for `t` with its current value: the one still held by its copy home, or a new one
        filled with zeros or copied in (the event goes to `incoming`)."""
        net = self.net
        pending = self.outgoing.pop(t.key, None)
        if pending is not None:
            pending.synchronize()  # the block still holds the value; the copy home must not race a write
        else:
            # From the top of the pool, away from the activations; may evict cached ones (offload, recompute).
            net.memory.alloc_block(t.key, t.nbytes, high=True)
        net.attach(t)
        if pending is None:
            if t.key in self.zero:
                net.ops.fill(t.array, 0.0)
            else:
                self.incoming[t.key] = self.transfer.to_device(self.home[t.key], t.array)
        self.on.add(t.key)
        self._rebind(t)

    def _reclaim(self, wait: bool = False) -> None:
        """Free the device blocks whose copy home has completed (all of them, waiting, with `wait`)."""
        for key, event in list(self.outgoing.items()):
            if wait:
                event.synchronize()
            elif not event.query():
                break  # copies complete in issue order
            del self.outgoing[key]
            self.net.pool.free(key)

    def step_lists(self, graph: Any, train: bool) -> tuple[list[tuple[list, list]], list[tuple[list, list]]]:
        """Per node, for its forward and its backward step: (parameter tensors it uses, those it changes).
        Forward changes only statistics a layer keeps itself (BatchNorm's running sums, not learnable);
        backward accumulates into the gradients."""
        fwd, bwd = [], []
        for layers in layers_computed_by(graph):
            decls = [d for layer in layers for d in layer.params]
            roots = list({id(r): r for r in (param_root(d) for d in decls)}.values())
            mine = [r for r in roots if r.data_tensor.key in self.by_key]
            data = [r.data_tensor for r in mine]
            stats = [r.data_tensor for r in mine if not r.learnable]
            diffs = [r.diff_tensor for r in mine if train and getattr(r, "diff_tensor", None) is not None]
            fwd.append((data, stats))
            bwd.append((data + diffs, diffs))
        return fwd, bwd
