"""The Net: runs a Graph's route as explicit forward and backward steps over tensors from one pool.

Every array a layer touches (activations, their gradients, parameters, parameter gradients,
layer scratch buffers) is a `Tensor` whose memory comes from the Net's `HeapPool` through one
place, `_materialize`. The memory manager (`superneurons.memory`) is consulted before and after
each step; under `baseline` it has nothing to do because every tensor stays allocated for the
whole iteration.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from superneurons.errors import UserError
from superneurons.graph.build import Graph, Node
from superneurons.layers.base import ParamDecl
from superneurons.layers.fillers import fill as fill_host
from superneurons.memory.aliases import DiffAliases, diff_aliases
from superneurons.memory.aliases import install as install_aliases
from superneurons.memory.pool import make_pool, round_up
from superneurons.runtime.limits import check_fits

# The GPU pool's default size is the device's free memory minus this margin, which stays outside the
# pool for what is allocated elsewhere: cuDNN/cuBLAS handles and library scratch, numba's loaded
# kernels, the solver's history arena (sized below from the parameters), and test nets' own pools.
GPU_MARGIN_MIN = 1 << 30  # bytes
GPU_MARGIN_FRACTION = 1 / 16  # of the device's total memory, when that is more
GPU_WORKSPACE_ALLOWANCE = 1 << 30  # bytes a pool that fits keeps beyond baseline's need, for workspace
# ... or this many times the net's largest tensor, when more: cuDNN's tensor-core engines for a large
# convolution copy its input and output gradient to NHWC in their workspace. VGG16's conv1_2 weight
# gradient at batch 64 takes 3.2 ms with such an engine and 14 ms with the best that fits 1 GiB (H200,
# tools/bench/conv_algos.py).
GPU_WORKSPACE_TENSORS = 3


@dataclass
class RunContext:
    """Per-run state layers may read: Dropout hashes (seed, iteration, layer, index) into its mask."""

    seed: int = 0
    iteration: int = 0
    recomputing: bool = False  # True while the recompute manager replays a forward step


class Tensor:
    """A named array slot. `array` is the backend view while resident; `base` makes this a reshaped view."""

    __slots__ = ("key", "shape", "dtype", "nbytes", "array", "base", "kind", "zero_init", "_reshaped")

    def __init__(self, key: str, shape: tuple[int, ...], dtype=np.float32, kind: str = "data",
                 base: "Tensor | None" = None):
        self.key = key
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        n = 1
        for d in self.shape:
            n *= d
        self.nbytes = n * self.dtype.itemsize
        self.array: Any = None
        self.base = base
        self.kind = kind
        self.zero_init = kind in ("diff", "param_diff", "history")  # history starts at zero, as in Caffe
        self._reshaped: tuple[Any, Any] = (None, None)  # (base array, this view of it), see Net._materialize

    def __repr__(self) -> str:
        return f"Tensor({self.key!r}, {self.shape}, {self.kind})"


class HostAwareBackend:
    """The Net's backend, for code that reads or writes parameters between steps (weight files, snapshots,
    `net.backend.to_host(decl.data)`). A streamed parameter then lives in its host home (a NumPy array,
    pinned on the GPU), which the device backend's to_host/from_host need not accept: such arrays are read
    and written here directly, once the copies into them have landed. Everything else is the backend's."""

    def __init__(self, backend: Any, net: "Net"):
        self._backend = backend
        self._net = net

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @property
    def raw(self) -> Any:
        """The device backend itself."""
        return self._backend

    def _home_of(self, array: Any):
        for store in self._net._param_stores():
            key = store.home_key(array)
            if key is not None:
                store.settle()
                return store, key
        return None

    def to_host(self, src: Any) -> np.ndarray:
        if self._home_of(src) is not None:
            return np.array(src, copy=True)
        return self._backend.to_host(src)

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        home = self._home_of(dst)
        if home is None:
            self._backend.from_host(dst, src)
            return
        store, key = home
        store.write(store.by_key[key], src)


@dataclass
class Step:
    """One forward or backward step of the route, with the tensors it reads and writes."""

    node: Node
    bottoms: list[Tensor]
    tops: list[Tensor]
    bottom_diffs: list[Tensor | None]
    top_diffs: list[Tensor | None]


class Net:
    def __init__(self, graph: Graph, backend: Any, *, train: bool = True, seed: int = 0,
                 pool_bytes: int | None = None, share_params_with: "Net | None" = None,
                 memory: str | None = "baseline", checkpoint_types: Iterable[str] | None = None,
                 memory_param: Any = None, solver_history: int = 0):
        """`memory`: the mode (None: the solver's `memory_param.mode`, else auto, MemoryParameter's default).
        `pool_bytes`: the pool's size (None: `memory_param.pool_bytes` when set and this is not a test net
        borrowing another's parameters, else the default, see default_pool_bytes).
        `checkpoint_types` (None: `memory_param.checkpoint_type`, else Convolution, or under auto the set it
        picks; `self.checkpoint_types` says which, `self.memory.auto` why). `solver_history`: history
        sets per learnable parameter the solver keeps (momentum: 1); they are pool tensors like the rest."""
        self.graph = graph
        self.name = graph.name
        self.backend = HostAwareBackend(backend, self)
        self.ops = backend.ops
        self.train = train
        self.ctx = RunContext(seed=seed)
        self.tensors: list[Tensor] = []
        self.data: dict[str, Tensor] = {}
        self.diff: dict[str, Tensor] = {}
        self.learnable: list[ParamDecl] = []  # owned, learnable params in prototxt order (the solver's list)
        self._param_tensors: dict[int, tuple[Tensor, Tensor | None]] = {}
        self._declare_tensors(share_params_with)
        # The solver's history, one tensor per learnable parameter and set (Caffe's .solverstate order).
        self.history: list[list[Tensor]] = [
            [self._new(f"{decl.data_tensor.key}@history{j}", decl.shape, "history") for decl in self.learnable]
            for j in range(solver_history)]
        from superneurons.memory import make_manager, resolve_memory  # the modes live there

        # Checkpoint types left unset: `auto` weighs several sets (the manager reports the one it runs with).
        mode, types, param_pool = resolve_memory(memory, memory_param, checkpoint_types, unset_types=True)
        if pool_bytes is None:
            own_budget = param_pool is not None and share_params_with is None  # the budget is the train net's
            pool_bytes = param_pool if own_budget else self.default_pool_bytes(share_params_with)
        # Before any allocation: a shape typo must be an error naming the blob, not a MemoryError.
        check_fits(self.tensors, pool_bytes, backend, graph)
        self.pool = make_pool(pool_bytes, backend)
        self.memory = make_manager(mode, self, types)
        self.checkpoint_types: tuple[str, ...] = self.memory.checkpoint_types
        self.memory.setup()
        from superneurons.memory.params import ResidentParams

        self.params = getattr(self.memory, "param_store", None) or ResidentParams(self)
        # A test net reads the train net's weights, so it streams them through the train net's store.
        self._shared_params = share_params_with.params if share_params_with is not None else None
        self._sharers: list[weakref.ref] = []  # nets reading this net's parameters (re-pointed on compaction)
        if share_params_with is not None:
            share_params_with._sharers.append(weakref.ref(self))
        self._install_workspace()
        self._fill_params(seed, share_params_with)
        self._build_steps()

    def default_pool_bytes(self, share: "Net | None" = None) -> int:
        """On the GPU, a training net's pool is what baseline needs plus GPU_WORKSPACE_ALLOWANCE, or, when
        that does not fit, the free device memory minus a margin (GPU_MARGIN_*, plus room for two solver
        history sets), so the memory techniques and convolution workspace share what is there.
        Elsewhere, and for nets that borrow another's parameters (test nets), what baseline needs."""
        need = self.baseline_bytes() + 4096
        if getattr(self.backend, "name", "cpu") != "cuda" or not self.train or share is not None:
            return need
        from superneurons.backend.cuda.transfer import device_memory

        free, total = device_memory()
        params = sum(round_up(t.nbytes) for t in self.tensors if t.base is None and t.kind == "param")
        margin = max(GPU_MARGIN_MIN, int(total * GPU_MARGIN_FRACTION)) + 2 * params
        if free - margin <= 0:
            raise UserError(f"net {self.name!r}: only {free / 2**20:.0f} MiB of device memory is free, under the "
                            f"{margin / 2**20:.0f} MiB kept outside the pool; free the GPU or pass --gpu-memory SIZE")
        # A net that fits takes what baseline needs plus room for convolution workspace, not the whole
        # device: other nets in the process (a test net, a second run) need their own pools.
        largest = max((t.nbytes for t in self.tensors if t.base is None), default=0)
        return min(free - margin, need + max(GPU_WORKSPACE_ALLOWANCE, GPU_WORKSPACE_TENSORS * largest))

    def _install_workspace(self) -> None:
        """Convolutions borrow their workspace from the pool (when the backend supports it)."""
        if hasattr(self.backend, "set_workspace_source"):
            from superneurons.memory.workspace import PoolWorkspace

            self.workspace = PoolWorkspace(self.pool, getattr(self.memory, "reclaim", None))
        else:
            self.workspace = None

    def _use_workspace(self) -> None:
        # One backend serves the train net and its test nets: each pass borrows from its own Net's pool.
        if self.workspace is not None:
            self.backend.set_workspace_source(self.workspace)

    # -- construction -------------------------------------------------------------------------
    def _new(self, key: str, shape, kind: str, dtype=np.float32, base: Tensor | None = None) -> Tensor:
        t = Tensor(key, shape, dtype, kind, base)
        self.tensors.append(t)
        return t

    def _declare_tensors(self, share: "Net | None") -> None:
        by_name = {n.name: n for n in self.graph.nodes}
        shared_owner: dict[str, ParamDecl] = {}
        # Split and Eltwise SUM gradients that share memory (the planner asks the same question).
        aliases = DiffAliases()
        if self.train:
            graph = self.graph
            aliases = diff_aliases(graph, {n.name: n.need_backward for n in graph.nodes},
                                   {n.name: list(n.propagate_down) for n in graph.nodes},
                                   [t for t, _w in graph.loss_blobs])
        install_aliases(self.graph, aliases)
        for node in self.graph.nodes:
            layer = node.layer
            layer.ops = self.ops
            layer.ctx = self.ctx
            view_data = layer.shares_data and not getattr(layer, "copy_data", False)
            for j, (t, shape) in enumerate(zip(node.tops, node.top_shapes)):
                if t in self.data and node.bottoms and t == node.bottoms[0]:
                    continue  # in place: same tensor
                if view_data:
                    self.data[t] = self._new(t, shape, "data", base=self.data[node.bottoms[0]])
                else:
                    self.data[t] = self._new(t, shape, "data")
            # Bottom diffs first: a top diff that is a view (Flatten) needs its bottom's diff to exist,
            # which it does not yet when the bottom comes from a data layer under force_backward.
            if self.train:
                for b, pd in zip(node.bottoms, node.propagate_down):
                    if pd and b not in self.diff:
                        self.diff[b] = self._new(b + "@diff", self.data[b].shape, "diff")
            if self.train and node.need_backward:
                for j, (t, shape) in enumerate(zip(node.tops, node.top_shapes)):
                    if t not in self.diff:
                        base = self.diff.get(node.bottoms[0]) if layer.shares_diff else None
                        if t in aliases.views:
                            base = self.diff[aliases.views[t]]
                        self.diff[t] = self._new(t + "@diff", shape, "diff", base=base)
            for name, buf in layer.buffers.items():
                buf.tensor = self._new(f"{node.name}#{name}", buf.shape, "buffer", dtype=buf.dtype)
            specs = layer.param.param
            other = share.graph.node(node.name) if share is not None and node.name in _names(share) else None
            for k, decl in enumerate(layer.params):
                spec = specs[k] if k < len(specs) else None
                decl.lr_mult = spec.lr_mult if spec is not None and decl.learnable else (1.0 if decl.learnable else 0.0)
                decl.decay_mult = spec.decay_mult if spec is not None and decl.learnable else (
                    1.0 if decl.learnable else 0.0)
                decl.name = spec.name if spec is not None and spec.name else ""
                if other is not None and k < len(other.layer.params) and other.layer.params[k].shape == decl.shape:
                    decl.owner = other.layer.params[k]  # the test net reads the train net's weights
                    continue
                if decl.name and decl.name in shared_owner:
                    owner = shared_owner[decl.name]
                    if owner.shape != decl.shape:
                        raise UserError(f"layer {node.name!r}: shared param {decl.name!r} has shape {decl.shape}, "
                                        f"its owner has {owner.shape}")
                    decl.owner = owner
                    continue
                decl.owner = None
                if decl.name:
                    shared_owner[decl.name] = decl
                data = self._new(f"{node.name}.{k}", decl.shape, "param")
                diff = self._new(f"{node.name}.{k}@diff", decl.shape, "param_diff") if self.train else None
                decl.data_tensor, decl.diff_tensor = data, diff
                if decl.learnable and self.train:
                    self.learnable.append(decl)
        self._by_name = by_name

    def baseline_bytes(self) -> int:
        return sum(round_up(t.nbytes) for t in self.tensors if t.base is None)

    def _materialize(self, t: Tensor) -> None:
        """Give `t` memory from the pool (the one place tensors get memory)."""
        if t.base is not None:
            base_array, view = t._reshaped
            if base_array is not t.base.array:  # the base moved: a new view (else the same object, see pool.view)
                view = self.ops.reshape(t.base.array, t.shape)
                t._reshaped = (t.base.array, view)
            t.array = view
            return
        self.pool.alloc(t.key, t.nbytes)
        self._attach(t)
        if t.zero_init:
            self.ops.fill(t.array, 0.0)

    def _attach(self, t: Tensor) -> None:
        """Point `t` at the pool block it already owns (contents unchanged)."""
        t.array = self.pool.view(t.key, t.shape, t.dtype)

    def _release(self, t: Tensor) -> None:
        if t.base is None and self.pool.owns(t.key):
            self.pool.free(t.key)
        t.array = None

    def compact_pool(self) -> bool:
        """Defragment the pool: wait for the device (copies on other streams read and write pool blocks),
        slide every block down, and re-point what referred to the moved ones. False if nothing moved."""
        self.backend.synchronize()
        moved = set(self.pool.compact())
        if not moved:
            return False
        for t in self.tensors:  # roots first, then the views over them
            if t.base is None and t.key in moved and t.array is not None:
                self._attach(t)
        for t in self.tensors:
            if t.base is not None and t.array is not None:
                self._materialize(t)
        for net in [self] + [r() for r in self._sharers]:
            if net is not None:
                net.bind_params()
        return True

    def bind_params(self) -> None:
        """Point every layer's ParamDecl/BufferDecl at its tensors' current arrays (and tell the stores that
        stream parameters which ParamDecls to re-point when a tensor moves)."""
        for node in self.graph.nodes:
            for decl in node.layer.params:
                src = decl
                while getattr(src, "owner", None) is not None:
                    src = src.owner
                decl.data = src.data_tensor.array
                decl.diff = src.diff_tensor.array if getattr(src, "diff_tensor", None) is not None else None
                for store in self._param_stores():
                    store.register(decl)
            for buf in node.layer.buffers.values():
                buf.array = buf.tensor.array

    def _param_stores(self) -> list:
        stores = (getattr(self, "params", None), getattr(self, "_shared_params", None))
        return [s for s in stores if s is not None and s.offloaded]

    def _prefetch_params(self, streamed: list, i: int) -> None:
        """Start bringing step `i`'s streamed parameters in while the current step computes."""
        if i < len(streamed):
            for store, tensors, _changed in streamed[i]:
                store.prefetch(tensors)

    def _settle_params(self) -> None:
        """Wait for the parameter copies home still in flight, so host code may read the homes."""
        for store in self._param_stores():
            store.settle()

    def _fill_params(self, seed: int, share: "Net | None") -> None:
        rng = np.random.default_rng(seed)
        for node in sorted(self.graph.nodes, key=lambda n: n.layer.layer_index):
            for decl in node.layer.params:
                if decl.owner is None:
                    self.params.write(decl.data_tensor, fill_host(decl.filler, decl.shape, rng))
        self.bind_params()

    def _build_steps(self) -> None:
        self.forward_steps: list[Step] = []
        for node in self.graph.nodes:
            self.forward_steps.append(Step(
                node,
                [self.data[b] for b in node.bottoms],
                [self.data[t] for t in node.tops],
                [self.diff.get(b) if pd else None for b, pd in zip(node.bottoms, node.propagate_down)],
                [self.diff.get(t) for t in node.tops],
            ))
        self.backward_steps = [s for s in reversed(self.forward_steps) if self.train and s.node.need_backward]
        self.loss_blobs = [(self.data[t], self.diff.get(t), w) for t, w in self.graph.loss_blobs]
        # Streamed parameters: per step, (store, tensors it brings in); None when every parameter is resident.
        self._param_fwd: list[list] | None = None
        self._param_bwd: list[list] | None = None
        stores = self._param_stores()
        if stores:
            per_store = [s.step_lists(self.graph.nodes, self.train) for s in stores]
            self._param_fwd = [[(s, *f[i]) for s, (f, _b) in zip(stores, per_store) if f[i][0]]
                               for i in range(len(self.graph.nodes))]
            index = {id(n): i for i, n in enumerate(self.graph.nodes)}
            self._param_bwd = [[(s, *b[index[id(st.node)]]) for s, (_f, b) in zip(stores, per_store)
                                if b[index[id(st.node)]][0]] for st in self.backward_steps]

    # -- running ------------------------------------------------------------------------------
    def forward(self) -> float:
        """Run every forward step; returns the weighted sum of the losses."""
        mm = self.memory
        self._use_workspace()
        streamed = self._param_fwd
        for i, step in enumerate(self.forward_steps):
            mm.before_forward(i, step)
            if streamed is not None:
                for store, tensors, _changed in streamed[i]:
                    store.acquire(tensors)
                self._prefetch_params(streamed, i + 1)  # queued before this step's kernels, so it overlaps them
            step.node.layer.forward([t.array for t in step.bottoms], [t.array for t in step.tops])
            if streamed is not None:
                for store, tensors, changed in streamed[i]:
                    store.release(tensors, changed)  # weights are unchanged; running statistics go home
            mm.after_forward(i, step)
        if streamed is not None:
            self._settle_params()
        return self.loss_value()

    def loss_value(self) -> float:
        loss = 0.0
        for data, _diff, w in self.loss_blobs:
            loss += w * float(self.backend.to_host(data.array).sum())
        return loss

    def backward(self) -> None:
        mm = self.memory
        self._use_workspace()
        for _data, diff, w in self.loss_blobs:
            if diff is not None:
                mm.ensure(diff)
                self.ops.fill(diff.array, w)
        streamed = self._param_bwd
        for i, step in enumerate(self.backward_steps):
            mm.before_backward(i, step)
            if streamed is not None:
                for store, tensors, _changed in streamed[i]:
                    store.acquire(tensors)
                self._prefetch_params(streamed, i + 1)
            node = step.node
            node.layer.backward(
                [t.array for t in step.tops],
                [t.array if t is not None else None for t in step.top_diffs],
                node.propagate_down,
                [t.array for t in step.bottoms],
                [t.array if t is not None else None for t in step.bottom_diffs],
            )
            if streamed is not None:
                for store, tensors, changed in streamed[i]:  # the gradients accumulated: copy them home
                    store.release(tensors, changed)
            mm.after_backward(i, step)
        if streamed is not None:
            self._settle_params()

    def forward_backward(self) -> float:
        loss = self.forward()
        self.backward()
        return loss

    def clear_param_diffs(self, already_zero: bool = False) -> None:
        """Zero the learnable parameters' gradients (`already_zero`: the caller has, e.g. the solver's grouped
        clear). Each is marked cleared, so the first layer to write it may overwrite instead of adding
        (`layers.base.claim_cleared_diff`)."""
        if not already_zero:
            self.params.clear_diffs(self.learnable)
        for decl in self.learnable:  # owned decls: the roots that shared weights point to
            decl.diff_cleared = True

    # -- access -------------------------------------------------------------------------------
    def layer(self, name: str):
        return self._by_name[name].layer

    def blob(self, name: str) -> np.ndarray:
        """A host copy of blob `name`'s data."""
        t = self.data[name]
        if t.array is None:
            raise UserError(f"blob {name!r} is not resident under --memory {self.memory.name}: it was freed after "
                            f"its last use (net outputs and losses stay readable; use --memory baseline to keep all)")
        return self.backend.to_host(t.array)

    def outputs(self) -> dict[str, np.ndarray]:
        return {name: self.blob(name) for name in self.graph.outputs}

    def layers_in_prototxt_order(self) -> Iterable[Node]:
        return sorted(self.graph.nodes, key=lambda n: n.layer.layer_index)


def _names(net: Net) -> set[str]:
    return {n.name for n in net.graph.nodes}
