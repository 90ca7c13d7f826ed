"""The Net: runs a Graph's route as explicit forward and backward steps over tensors from one pool.

Every array a layer touches (activations, their gradients, parameters, parameter gradients,
layer scratch buffers, solver history) is a `Tensor`, one per entry of the layout `memory/tensors.py`
declares, whose memory comes from the Net's `HeapPool` through one place, `materialize`. The memory
manager (`memory/interface.py`: `MemoryManager`) decides when: its hooks run before and after each
step, and it uses the Net's public services (`NetServices`). Under `baseline` it has nothing to do
per step, because every tensor stays allocated for the whole run.
"""
from __future__ import annotations

import weakref
from functools import cached_property
from typing import Any, Iterable

import numpy as np

from superneurons.dtypes import FLOAT32, tensor_bytes
from superneurons.errors import UserError
from superneurons.graph.build import Graph
from superneurons.graph.node import Node
from superneurons.graph.precision import check_backend
from superneurons.layers.base import ParamDecl
from superneurons.layers.fillers import fill as fill_host
from superneurons.memory.interface import MemoryManager, StepHooks
from superneurons.memory.params import layers_computed_by, param_root
from superneurons.memory.pool import format_bytes, make_pool, round_up
from superneurons.memory.steps import RunContext, Step, Tensor
from superneurons.memory.tensors import declare_tensors
from superneurons.runtime.limits import check_fits
from superneurons.runtime.loss_read import LossReader, weighted_loss
from superneurons.settings import memory_policy

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
        for store in self._net.param_stores():
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


class Net:
    def __init__(self, graph: Graph, backend: Any, *, train: bool = True, seed: int = 0,
                 pool_bytes: int | None = None, share_params_with: "Net | None" = None,
                 memory: str | type[MemoryManager] | None = "baseline",
                 checkpoint_types: Iterable[str] | None = None, memory_param: Any = None, solver_history: int = 0):
        """`memory`: the mode (None: the solver's `memory_param.mode`, else auto, MemoryParameter's default),
        or a MemoryManager class to run instead of the modes' (memory/interface.py).
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
        self.loss_scale = 1.0  # the solver's loss scale (solver/loss_scale.py): backward seeds weight x scale
        self.tensors: list[Tensor] = []
        self.data: dict[str, Tensor] = {}
        self.diff: dict[str, Tensor] = {}
        self.learnable: list[ParamDecl] = []  # owned, learnable params in route order (the solver's list)
        self.history: list[list[Tensor]] = []  # per solver history set, one tensor per learnable param
        self._declare_tensors(share_params_with, solver_history)
        from superneurons.memory import make_manager, resolve_memory  # the modes live there

        # Checkpoint types left unset: `auto` weighs several sets (the manager reports the one it runs with).
        custom = memory if isinstance(memory, type) else None
        mode, types, param_pool = resolve_memory(None if custom else memory, memory_param, checkpoint_types,
                                                 unset_types=True)
        if pool_bytes is None:
            own_budget = param_pool is not None and share_params_with is None  # the budget is the train net's
            pool_bytes = param_pool if own_budget else self.default_pool_bytes(share_params_with)
        self.policy = memory_policy(memory_param)  # the tensor cache, the allocator, parameter streaming
        # Before any allocation: a shape typo must be an error naming the blob, not a MemoryError.
        check_backend(graph, backend)  # storage types it cannot compute on
        check_fits(self.tensors, pool_bytes, backend, graph)
        self.pool = make_pool(pool_bytes, backend, self.policy.allocator)
        self.memory: MemoryManager = make_manager(custom or mode, self, types)
        self.checkpoint_types: tuple[str, ...] = self.memory.checkpoint_types
        self.hooks: list[StepHooks] = [self.memory]  # called around every step (add_hooks)
        self.memory.setup()
        from superneurons.memory.params import ResidentParams

        self.params = self.memory.param_store or ResidentParams(self)
        # A test net reads the train net's weights, so it streams them through the train net's store.
        self._shared_params = share_params_with.params if share_params_with is not None else None
        self._sharers: list[weakref.ref] = []  # nets reading this net's parameters (re-pointed on compaction)
        if share_params_with is not None:
            share_params_with._sharers.append(weakref.ref(self))
        self._install_workspace()
        self._fill_params(seed, share_params_with)
        self._build_steps()
        # Called with i after backward step i (data parallelism starts reducing the gradients that step
        # finished while backward goes on; superneurons/parallel/reducer.py). None: nothing to call.

    def default_pool_bytes(self, share: "Net | None" = None) -> int:
        """On the GPU, a training net's pool is what baseline needs plus GPU_WORKSPACE_ALLOWANCE, or, when
        that does not fit, the free device memory minus a margin (GPU_MARGIN_*, plus room for two solver
        history sets), so the memory techniques and convolution workspace share what is there.
        Elsewhere, and for nets that borrow another's parameters (test nets), what baseline needs."""
        need = self.baseline_bytes() + 4096
        device = self.backend.device_memory()
        if device is None or not self.train or share is not None:
            return need
        free, total = device
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
        """Convolutions borrow their workspace from the pool."""
        from superneurons.memory.workspace import PoolWorkspace

        self.workspace = PoolWorkspace(self.pool, self.memory.reclaim)

    def _use_workspace(self) -> None:
        # One backend serves the train net and its test nets: each pass borrows from its own Net's pool.
        self.backend.set_workspace_source(self.workspace)

    # -- construction -------------------------------------------------------------------------
    def _declare_tensors(self, share: "Net | None", solver_history: int) -> None:
        """One Tensor per TensorSpec of the layout (`memory.tensors`, the planner's too), in its order."""
        graph = self.graph
        borrowed = set()
        for node in graph.nodes:
            layer = node.layer
            layer.ops = self.ops
            layer.ctx = self.ctx
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
                    borrowed.add((node.name, k))
        self.layout = declare_tensors(graph, train=self.train, borrowed=borrowed, history=solver_history)
        by_key: dict[str, Tensor] = {}
        for spec in self.layout.specs:
            base = by_key[spec.base] if spec.base is not None else None  # declared before its views
            t = by_key[spec.key] = Tensor(spec.key, spec.shape, spec.dtype, spec.kind, base)
            self.tensors.append(t)
        self.data = {blob: by_key[key] for blob, key in self.layout.data_key.items()}
        self.diff = {blob: by_key[key] for blob, key in self.layout.diff_key.items()}
        for node in graph.nodes:
            for key, name, _for_backward in self.layout.buffer_keys[node.name]:
                graph.step_layer(node).buffers[name].tensor = by_key[key]
        decls = {(n.name, k): decl for n in graph.nodes for k, decl in enumerate(n.layer.params)}
        for slot in self.layout.params:
            decl = decls[slot.node, slot.index]
            if slot.borrowed:
                continue
            if slot.shared_with is not None:
                decl.owner = decls[slot.shared_with]
                continue
            decl.owner = None
            decl.data_tensor = by_key[slot.data]
            decl.diff_tensor = by_key[slot.diff] if slot.diff is not None else None
        self.learnable = [decls[slot.node, slot.index] for slot in self.layout.learnable()]
        # The solver's history, one tensor per learnable parameter and set (Caffe's .solverstate order).
        self.history = [[by_key[key] for key in keys] for keys in self.layout.history]
        self._by_name = {n.name: n for n in graph.nodes}

    def baseline_bytes(self) -> int:
        return sum(round_up(t.nbytes) for t in self.tensors if t.base is None)

    # -- services to the memory manager (memory/interface.py: NetServices) ---------------------------
    def materialize(self, t: Tensor) -> None:
        """Give `t` memory from the pool (the one place tensors get memory); a view follows its base."""
        if t.base is not None:
            base_array, view = t._reshaped
            if base_array is not t.base.array:  # the base moved: a new view (else the same object, see pool.view)
                view = self.ops.reshape(t.base.array, t.shape)
                t._reshaped = (t.base.array, view)
            t.array = view
            return
        self.pool.alloc(t.key, t.nbytes)
        self.attach(t)
        if t.zero_init:
            self.ops.fill(t.array, 0.0)

    def attach(self, t: Tensor) -> None:
        """Point `t` at the pool block it already owns (contents unchanged)."""
        t.array = self.pool.view(t.key, t.shape, t.dtype)

    def release(self, t: Tensor) -> None:
        """Give `t`'s pool block back (a view just lets go of its array)."""
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
                self.attach(t)
        for t in self.tensors:
            if t.base is not None and t.array is not None:
                self.materialize(t)
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
                for store in self.param_stores():
                    store.register(decl)
            for buf in self.graph.step_layer(node).buffers.values():
                buf.array = buf.tensor.array

    def param_stores(self) -> list:
        """The stores streaming this net's parameters from the host (its own, and the train net's for a
        test net); empty while every parameter is resident."""
        stores = (getattr(self, "params", None), getattr(self, "_shared_params", None))
        return [s for s in stores if s is not None and s.offloaded]

    def _prefetch_params(self, streamed: list, i: int) -> None:
        """Start bringing step `i`'s streamed parameters in while the current step computes."""
        if i < len(streamed):
            for store, tensors, _changed in streamed[i]:
                store.prefetch(tensors)

    def _settle_params(self) -> None:
        """Wait for the parameter copies home still in flight, so host code may read the homes."""
        for store in self.param_stores():
            store.settle()

    def _fill_params(self, seed: int, share: "Net | None") -> None:
        rng = np.random.default_rng(seed)
        for node in sorted(self.graph.nodes, key=lambda n: n.layer.layer_index):
            for decl in node.layer.params:
                if decl.owner is None:
                    try:
                        values = decl.initial if decl.initial is not None else fill_host(decl.filler, decl.shape, rng)
                    except MemoryError:  # the pool fitted (check_fits); the host copy being filled did not
                        nbytes = tensor_bytes(decl.shape, FLOAT32)
                        raise UserError(f"layer {node.name!r}: no host memory left to fill its parameter of shape "
                                        f"{tuple(decl.shape)} ({format_bytes(nbytes)})") from None
                    self.params.write(decl.data_tensor, values)
        self.bind_params()

    def _build_steps(self) -> None:
        graph = self.graph
        self.forward_steps: list[Step] = []
        for node in graph.nodes:
            self.forward_steps.append(Step(
                node,
                [self.data[b] for b in node.bottoms],
                [self.data[t] for t in node.tops],
                [self.diff.get(b) if w else None
                 for b, w in zip(node.bottoms, graph.bottom_gradients_written(node, node.propagate_down))],
                [self.diff.get(t) for t in graph.top_gradient_blobs(node)],
            ))
        # What each step runs: the node's layer, or the fused layer graph/fuse.py gave it.
        self._step_layers = {id(n): graph.step_layer(n) for n in graph.nodes}
        self.backward_steps = [s for s in reversed(self.forward_steps) if self.train and s.node.need_backward]
        self._gradient_sharing = [self._shared_gradients(s) for s in self.backward_steps]
        self.loss_blobs = [(self.data[t], self.diff.get(t), w) for t, w in self.graph.loss_blobs]
        # Streamed parameters: per step, (store, tensors it brings in); None when every parameter is resident.
        self._param_fwd: list[list] | None = None
        self._param_bwd: list[list] | None = None
        stores = self.param_stores()
        if stores:
            per_store = [s.step_lists(self.graph, self.train) for s in stores]
            self._param_fwd = [[(s, *f[i]) for s, (f, _b) in zip(stores, per_store) if f[i][0]]
                               for i in range(len(self.graph.nodes))]
            index = {id(n): i for i, n in enumerate(self.graph.nodes)}
            self._param_bwd = [[(s, *b[index[id(st.node)]]) for s, (_f, b) in zip(stores, per_store)
                                if b[index[id(st.node)]][0]] for st in self.backward_steps]
        self._gradients_ready = self._final_gradient_writers()

    def _final_gradient_writers(self) -> list[list[ParamDecl]]:
        """Per backward step, the learnable parameters whose gradients no later step of the pass writes
        (see StepHooks.gradients_ready); those no step writes come with the last step."""
        ready: list[list[ParamDecl]] = [[] for _ in self.backward_steps]
        if not ready:
            return ready
        computed_by = layers_computed_by(self.graph)
        index = {id(n): i for i, n in enumerate(self.graph.nodes)}
        last: dict[int, int] = {}  # id(learnable decl) -> the last backward step writing its gradient
        for b, step in enumerate(self.backward_steps):
            for layer in computed_by[index[id(step.node)]]:
                for decl in layer.params:
                    last[id(param_root(decl))] = b
        for decl in self.learnable:
            ready[last.get(id(decl), len(ready) - 1)].append(decl)
        return ready

    def _shared_gradients(self, step: Step) -> tuple[tuple[tuple[int, int], ...], frozenset[int]]:
        """For backward step `step`: (top index, bottom index) of the top gradients that are a bottom
        gradient's memory (memory/aliases.py), and the bottoms whose gradient the layer adds into."""
        aliases, node = self.layout.aliases, step.node
        shared = tuple((k, node.bottoms.index(aliases.views[t])) for k, t in enumerate(node.tops)
                       if aliases.views.get(t) in node.bottoms)
        return shared, aliases.accumulate.get(node.name, frozenset())

    # -- running ------------------------------------------------------------------------------
    def add_hooks(self, hooks: StepHooks) -> None:
        """Call `hooks` around every step from now on, after the memory manager's before a step and before
        its after one (memory/interface.py)."""
        self.hooks.append(hooks)

    def remove_hooks(self, hooks: StepHooks) -> None:
        self.hooks.remove(hooks)

    def forward(self, first: int = 0, last: int | None = None) -> float:
        """Run the forward steps, in the route's order; returns the weighted sum of the losses. `first`/`last`:
        only the layers at those prototxt positions (both included), Caffe's Net::ForwardFromTo."""
        self._queue_forward(first, last)
        loss = self.loss_value()
        self.ctx.run_deferred_checks()
        return loss

    def _queue_forward(self, first: int = 0, last: int | None = None) -> None:
        partial = self._partial(first, last, "forward over part of the net")
        hooks = self.hooks
        self._use_workspace()
        for i, step in enumerate(self.forward_steps):
            if partial and not first <= step.node.layer.layer_index <= last:
                continue
            for h in hooks:
                h.before_forward(i, step)
            self.run_forward_step(i)
            for h in reversed(hooks):
                h.after_forward(i, step)
        if self._param_fwd is not None:
            self._settle_params()

    def run_forward_step(self, i: int, replay: bool = False) -> None:
        """Run forward step `i` on its tensors' current arrays, its streamed parameters brought in for it.
        `replay`: a recomputation (memory/recompute_manager.py): `ctx.recomputing` is set meanwhile, so
        BatchNorm keeps its running sums and no parameter goes home changed; nothing is prefetched."""
        step = self.forward_steps[i]
        per_step = self._param_fwd
        streamed = per_step[i] if per_step is not None else ()
        for store, tensors, _changed in streamed:
            store.acquire(tensors)
        if per_step is not None and not replay:
            self._prefetch_params(per_step, i + 1)  # queued before this step's kernels, so it overlaps them
        ctx = self.ctx
        outer = ctx.recomputing
        ctx.recomputing = outer or replay
        try:
            self._step_layers[id(step.node)].forward([t.array for t in step.bottoms], [t.array for t in step.tops])
        finally:
            ctx.recomputing = outer
            for store, tensors, changed in streamed:
                store.release(tensors, () if replay else changed)  # weights are unchanged; running statistics go home

    @cached_property
    def _loss_reader(self) -> LossReader:
        return LossReader(self.backend)  # made at the first training pass: a net that only tests needs no stream

    def loss_value(self) -> float:
        return weighted_loss(self.backend, self.loss_blobs)

    def backward(self, first: int = 0, last: int | None = None, seed_losses: bool = True) -> None:
        """Run the backward steps. `first`/`last`: only the layers at those prototxt positions (Caffe's
        Net::BackwardFromTo); `seed_losses=False`: start from the gradients the blobs hold now instead of
        setting each loss blob's gradient to its weight (`seed_loss_diffs`), so a caller may set any top's."""
        partial = self._partial(first, last, "backward over part of the net", backward=True)
        hooks = self.hooks
        self._use_workspace()
        if seed_losses:
            self.seed_loss_diffs()
        streamed = self._param_bwd
        ready = self._gradients_ready
        for i, step in enumerate(self.backward_steps):
            if partial and not first <= step.node.layer.layer_index <= last:
                continue
            for h in hooks:
                h.before_backward(i, step)
            if streamed is not None:
                for store, tensors, _changed in streamed[i]:
                    store.acquire(tensors)
                self._prefetch_params(streamed, i + 1)
            self._run_backward_step(i, step)
            if ready[i]:
                for h in hooks:
                    h.gradients_ready(step, ready[i])
            if streamed is not None:
                for store, tensors, changed in streamed[i]:  # the gradients accumulated: copy them home
                    store.release(tensors, changed)
            for h in reversed(hooks):
                h.after_backward(i, step)
        if streamed is not None:
            self._settle_params()

    def _run_backward_step(self, i: int, step: Step) -> None:
        """Call the step's layer. A top gradient that shares a bottom gradient's memory is passed as that
        bottom gradient's array, so the layer sees one array, as in place; a layer that adds into bottom
        gradients is told which (`accumulate`)."""
        top_diffs = [t.array if t is not None else None for t in step.top_diffs]
        bottom_diffs = [t.array if t is not None else None for t in step.bottom_diffs]
        shared, accumulate = self._gradient_sharing[i]
        for k, j in shared:
            if bottom_diffs[j] is not None:
                top_diffs[k] = bottom_diffs[j]
        extra = {"accumulate": accumulate} if accumulate else {}
        self._step_layers[id(step.node)].backward([t.array for t in step.tops], top_diffs, step.node.propagate_down,
                                                  [t.array for t in step.bottoms], bottom_diffs, **extra)

    def forward_backward(self) -> float:
        """One training pass; the loss is read while the device runs backward (runtime/loss_read.py)."""
        self._queue_forward()
        loss = self._loss_reader.start(self.loss_blobs)
        self.backward()
        value = loss()
        self.ctx.run_deferred_checks()  # bad labels stop the run here, before the solver applies the gradients
        return value

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

    # -- for the Python API (superneurons.pycaffe): blobs by name, runs over part of the net -----------
    # pycaffe reads and writes any blob between calls and runs a slice of the layers, so these need every
    # tensor resident: slices and unseeded backward passes are refused under the memory modes that free
    # or move tensors between steps.
    def blob_array(self, name: str, diff: bool = False) -> Any:
        """The backend array that holds blob `name`'s data (`diff`: its gradient) now, not a copy; None
        when the net keeps no gradient for the blob or the memory mode has freed it. KeyError: no such blob."""
        if diff:
            t = self.diff.get(name)
            if name not in self.data:
                raise KeyError(name)
            return None if t is None else t.array
        return self.data[name].array

    def runs_backward(self) -> bool:
        """Whether `backward` runs any layer (not for a test net, nor for a net without a loss)."""
        return bool(self.backward_steps)

    def layer_position(self, name: str) -> int:
        """Layer `name`'s position in the prototxt (split layers included), Caffe's layer index."""
        return self._by_name[name].layer.layer_index

    def seed_loss_diffs(self) -> None:
        """Set each loss blob's gradient to its loss weight, as `backward` does first."""
        for _data, diff, w in self.loss_blobs:
            if diff is not None:
                self.memory.ensure(diff)
                self.ops.fill(diff.array, w * self.loss_scale)

    def _partial(self, first: int, last: int | None, what: str, backward: bool = False) -> bool:
        """Whether first..last leaves out some layer; such a run needs every tensor resident."""
        partial = first > 0 or (last is not None and last < max(n.layer.layer_index for n in self.graph.nodes))
        if partial:
            self._require_resident(what)
            self._refuse_split_fusion(first, last, what, backward)
        return partial

    def _refuse_split_fusion(self, first: int, last: int | None, what: str, backward: bool) -> None:
        """A range that holds a fused layer (graph/fuse.py) without the layer computing it, or the other way
        round, would run the pair's work whole or not at all: e.g. a Convolution fused with its ReLU ends a
        range at the convolution with the ReLU applied, where Caffe's blob is still before it. The graph's
        `Fusions.joined` says which layers run together forward and which backward."""
        positions = {n.name: n.layer.layer_index for n in self.graph.nodes}
        types = {n.name: n.layer.type_name for n in self.graph.nodes}

        def inside(name: str) -> bool:
            return first <= positions[name] and (last is None or positions[name] <= last)

        for a, b, why in self.graph.fusions.joined(self.graph.nodes, backward):
            if inside(a) != inside(b):
                raise UserError(f"net {self.name!r}: {what} from layer {first} to "
                                f"{last if last is not None else 'the end'} separates {a!r} ({types[a]}) from "
                                f"{b!r} ({types[b]}), {why}; include both, or build the net with "
                                f"SUPERNEURONS_FUSE=0 to run every layer on its own")

    def _require_resident(self, what: str) -> None:
        if self.memory.name != "baseline" or self._param_fwd is not None:
            raise UserError(f"net {self.name!r}: {what} needs every tensor resident; it runs under memory mode "
                            f"{self.memory.name!r} (build the net with memory='baseline')")


def _names(net: Net) -> set[str]:
    return {n.name for n in net.graph.nodes}
