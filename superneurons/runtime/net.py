"""The Net: runs a Graph's route as explicit forward and backward steps over tensors from one pool.

Every array a layer touches (activations, their gradients, parameters, parameter gradients,
layer scratch buffers, solver history) is a `Tensor`, one per entry of the layout `memory/tensors.py`
declares (`runtime/wiring.py` makes them), whose memory comes from the Net's `HeapPool` through one place,
`materialize`. The memory manager (`memory/interface.py`: `MemoryManager`) decides when: its hooks run
before and after each step (`runtime/hook_dispatch.py`), and it uses the Net's public services
(`NetServices`). Under `baseline` it has nothing to do per step, because every tensor stays allocated for
the whole run. The rest lives beside this module: the pool's default size (`pool_size.py`), parameters
streamed from the host (`param_streaming.py`), runs over part of the net (`ranges.py`).
"""
from __future__ import annotations

import weakref
from functools import cached_property
from typing import Any, Iterable, Sequence

import numpy as np

from superneurons.backend.log_line import log_line
from superneurons.dtypes import FLOAT32, tensor_bytes
from superneurons.errors import UserError
from superneurons.graph.build import Graph
from superneurons.graph.layout import NCHW, choose as choose_layouts, release as release_layouts
from superneurons.graph.node import Node
from superneurons.graph.precision import check_backend, stored_types
from superneurons.layers.base import FLOAT32_COPIES, ParamDecl
from superneurons.layers.fillers import fill as fill_host
from superneurons.memory.interface import MemoryManager, StepHooks
from superneurons.memory.pool import BLOCK, format_bytes, make_pool
from superneurons.memory.steps import RunContext, Step, Tensor
from superneurons.memory.tensors import declare_tensors
from superneurons.runtime.graph_replay import GraphReplay, replay_for
from superneurons.runtime.graph_replay import expected as expected_replay
from superneurons.runtime.hook_dispatch import HookList, final_gradient_writers
from superneurons.runtime.limits import check_fits
from superneurons.runtime.live_batch import LiveRun
from superneurons.runtime.loss_read import LossReader, weighted_loss
from superneurons.runtime.param_streaming import HostAwareBackend, ParamStreaming
from superneurons.runtime.pool_size import baseline_bytes, default_pool_bytes
from superneurons.runtime.ranges import check_range
from superneurons.runtime.wiring import bind_arrays, read_param_specs, wire_tensors
from superneurons.settings import memory_policy


class Net:
    def __init__(self, graph: Graph, backend: Any, *, train: bool = True, seed: int = 0,
                 pool_bytes: int | None = None, share_params_with: "Net | None" = None,
                 memory: str | type[MemoryManager] | None = "baseline",
                 checkpoint_types: Iterable[str] | None = None, memory_param: Any = None, solver_history: int = 0,
                 data_workers: int | None = None, update_chunk: int = 0, reduce_type: Any = None,
                 eager: bool = False):
        """`memory`: the mode (None: the solver's `memory_param.mode`, else auto, MemoryParameter's default),
        or a MemoryManager class to run instead of the modes' (memory/interface.py).
        `pool_bytes`: the pool's size (None: `memory_param.pool_bytes` when set and this is not a test net
        borrowing another's parameters, else the default, runtime/pool_size.py).
        `checkpoint_types` (None: `memory_param.checkpoint_type`, else Convolution, or under auto the set it
        picks; `self.checkpoint_types` says which, `self.memory.auto` why). `solver_history`: history
        sets per learnable parameter the solver keeps (momentum: 1); they are pool tensors like the rest.
        `update_chunk`: the solver may update every parameter in one launch over blocks of that many elements
        (solver/fused_update.py), whose tables are then a pool tensor too (`update_table`); 0: it does not.
        `data_workers`: decode worker processes of every data layer (--data-workers; None: each layer's own).
        `reduce_type`: the half type a data-parallel training net reduces its gradients in (parallel/reducer.py),
        whose buffer the layout declares and the plan holds (None: none). `eager`: the caller runs this Net's
        passes eagerly, never replayed as CUDA graphs (it adds hooks that run every step, such as a gradient
        reducer, or calls forward and backward apart, as pycaffe's Net does), which SUPERNEURONS_LAYOUT=auto
        weighs (graph/layout.py)."""
        self.backend = HostAwareBackend(backend, self)
        self._device_backend = backend
        self.train = train
        self.ctx = RunContext(seed=seed, data_workers=data_workers)
        self.loss_scale = 1.0  # the solver's loss scale (solver/loss_scale.py): backward seeds weight x scale
        # The parameter stores, once the memory manager has decided (below): this net's, and for a test net the
        # train net's, through which it streams the train net's weights.
        self.params: Any = None
        self._shared_params: Any = None
        from superneurons.memory import (auto_recurrent_inputs, make_manager, pick_mode, recurrent_input,  # the modes
                                         resolve_memory)

        # Checkpoint types left unset: `auto` weighs several sets (the manager reports the one it runs with).
        custom = memory if isinstance(memory, type) else None
        mode, types, param_pool = resolve_memory(None if custom else memory, memory_param, checkpoint_types,
                                                 unset_types=True)
        # Recurrent layers transform their input in the form this mode runs (memory.recurrent_input); auto weighs
        # the forms in turn (below).
        forms = (auto_recurrent_inputs() if mode == "auto" else (recurrent_input(mode),)) if custom is None else ()
        if forms:
            graph = graph.in_recurrent_input(forms[0])
        # Whether training passes will replay as CUDA graphs: auto's layout rule weighs it (graph/layout.py)
        replayed = expected_replay(graph, "custom" if custom else mode, train=train, eager=eager,
                                   recorder=getattr(backend, "graph_recorder", None) is not None)
        declare = (share_params_with, solver_history, update_chunk, reduce_type, replayed)
        self._declare_graph(graph, *declare)
        given_pool = pool_bytes
        pool_bytes = self._pool_bytes(given_pool, param_pool, share_params_with)
        self.policy = memory_policy(memory_param)  # the tensor cache, the allocator, parameter streaming
        # Before any allocation: a shape typo must be an error naming the blob, not a MemoryError.
        check_backend(graph, backend)  # storage types it cannot compute on
        choice = None
        if self.blob_layouts.automatic and mode == "auto" and custom is None:
            choice = self._resident_choice(pool_bytes, types)
            if choice is None:
                # Channels last costs memory (KRSC filter copies, conversion rooms: 2.3 GiB for ResNet-50 at
                # batch 1304): a net that needs the memory runtime's help, or that fits only so, runs NCHW.
                replay_only = self.blob_layouts.replay_only
                release_layouts(self.blob_layouts)
                self._declare_graph(graph, *declare, layouts=(NCHW,))
                pool_bytes = self._pool_bytes(given_pool, param_pool, share_params_with)
                where = " under baseline, where passes replay as CUDA graphs," if replay_only else ""
                log_line("I", "net.py", f"Net {self.name or 'net'}: NCHW (SUPERNEURONS_LAYOUT=auto): channels last "
                         f"would not keep every tensor resident{where} in {format_bytes(pool_bytes)}")
        if self.blob_layouts.automatic:
            log_line("I", "net.py", f"Net {self.name or 'net'}: channels last for {len(self.blob_layouts.blobs)} 4-D "
                     f"blobs (SUPERNEURONS_LAYOUT=auto; nchw keeps Caffe's layout)")
        check_fits(self.tensors, pool_bytes, backend, graph)
        if len(forms) > 1 and graph.recurrent_input is not None:
            # auto runs the sequence form where a plan of it fits; where none does, the step form, whose
            # checkpointing plans keep only the recurrent state per step. Decided before the pool exists: a GPU
            # pool that does not fit takes the device's free memory, which only one pool can have.
            try:
                choice = pick_mode(self, types, capacity=pool_bytes // BLOCK * BLOCK)
            except UserError:
                graph = graph.in_recurrent_input(forms[1])
                self._declare_graph(graph, *declare)
                pool_bytes = self._pool_bytes(given_pool, param_pool, share_params_with)
                check_fits(self.tensors, pool_bytes, backend, graph)
        self.pool = make_pool(pool_bytes, backend, self.policy.allocator)
        self.memory: MemoryManager = make_manager(custom or mode, self, types, choice)
        self.checkpoint_types: tuple[str, ...] = self.memory.checkpoint_types
        self.hooks = HookList([self.memory])  # called around every step (add_hooks)
        self.memory.setup()
        from superneurons.memory.params import ResidentParams

        self.params = self.memory.param_store or ResidentParams(self)
        self._shared_params = share_params_with.params if share_params_with is not None else None
        self._sharers: list[weakref.ref] = []  # nets reading this net's parameters (re-pointed on compaction)
        if share_params_with is not None:
            share_params_with._sharers.append(weakref.ref(self))
        from superneurons.memory.workspace import PoolWorkspace

        # Convolutions borrow their workspace from this net's pool, through the layers' run context (one
        # backend serves the train net and its test nets: each borrows from its own pool).
        self.ctx.workspace = PoolWorkspace(self.pool, self.memory.reclaim)
        self._fill_params(seed)
        self._build_steps()

    # -- construction -------------------------------------------------------------------------
    def _declare_graph(self, graph: Graph, share: "Net | None", solver_history: int, update_chunk: int,
                       reduce_type: Any, replayed: bool, layouts: tuple[str, ...] | None = None) -> None:
        """Run `graph`: its blobs' layouts (`layouts`: those it may store, None: the backend's; `replayed`: its
        training passes will replay as CUDA graphs), the ops for its storage types, its tensors."""
        self.graph = graph
        self.name = graph.name
        backend = self._device_backend
        # Which 4-D blobs this backend keeps channels last (graph/layout.py; before the tensors are declared:
        # a float32 convolution may get working copies for its KRSC filter)
        self.blob_layouts = choose_layouts(graph, layouts or getattr(backend, "layouts", ("NCHW",)), replayed=replayed)
        storage = stored_types(graph)
        # A net with NHWC tensors gets ops that convert where an op has no channels-last path for its arguments
        self.ops = backend.ops_for(storage, channels_last=True) if self.blob_layouts.any else backend.ops_for(storage)
        self._declare_tensors(share, solver_history, update_chunk, reduce_type)

    def _resident_choice(self, pool_bytes: int, types) -> Any:
        """`auto`'s choice for this declaration in `pool_bytes` where it keeps auto's layout (every tensor resident,
        in baseline where the layout rests on replayed passes: memory/cost.keeps_auto_layout), else None."""
        from superneurons.memory import pick_mode
        from superneurons.memory.cost import keeps_auto_layout

        try:
            choice = pick_mode(self, types, capacity=pool_bytes // BLOCK * BLOCK)
        except UserError:
            return None
        return choice if keeps_auto_layout(choice, self.blob_layouts) else None

    def _pool_bytes(self, given: int | None, param_pool: int | None, share: "Net | None") -> int:
        """The pool's size: `given`; else the solver's budget (`param_pool`) for a net of its own parameters; else
        the default for the tensors declared (runtime/pool_size.py)."""
        if given is not None:
            return given
        if param_pool is not None and share is None:  # a test net's budget is the train net's
            return param_pool
        return default_pool_bytes(self.name, self.tensors, self.backend, self.train, share is not None)

    def _declare_tensors(self, share: "Net | None", solver_history: int, update_chunk: int,
                         reduce_type: Any = None) -> None:
        """The layout (`memory.tensors`, the planner's too) and one Tensor per entry, in its order."""
        for node in self.graph.nodes:
            node.layer.ops = self.ops
            node.layer.ctx = self.ctx
        borrowed = read_param_specs(self.graph, share.graph if share is not None else None)
        self.layout = declare_tensors(self.graph, train=self.train, borrowed=borrowed, history=solver_history,
                                      layouts=self.blob_layouts, update_chunk=update_chunk,
                                      reduce_type=reduce_type)
        wired = wire_tensors(self.graph, self.layout)
        self.tensors: list[Tensor] = wired.tensors
        self.data: dict[str, Tensor] = wired.data
        self.diff: dict[str, Tensor] = wired.diff
        self.learnable: list[ParamDecl] = wired.learnable  # the solver's list
        self.history: list[list[Tensor]] = wired.history  # per solver history set, one per learnable param
        self._by_name = {n.name: n for n in self.graph.nodes}
        # The ops that sum take their float64 scratch from this pool tensor (placed at setup, planned).
        by_key = {t.key: t for t in self.tensors}
        self.ctx.scratch_tensor = by_key[self.layout.scratch] if self.layout.scratch is not None else None
        # The grouped solver update's tables (placed at setup, planned), or None.
        self.update_table: Tensor | None = by_key[self.layout.update] if self.layout.update is not None else None
        # The half gradient run of a data-parallel net (`reduce_type`), or None.
        self.reduce_tensor: Tensor | None = by_key[self.layout.reduce] if self.layout.reduce is not None else None

    def baseline_bytes(self) -> int:
        return baseline_bytes(self.tensors)

    def _fill_params(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for node in self.layers_in_prototxt_order():
            for decl in node.layer.params:
                if decl.owner is None:
                    try:
                        values = decl.initial if decl.initial is not None else fill_host(decl.filler, decl.shape, rng)
                    except MemoryError:  # the pool fitted (check_fits); the host copy being filled did not
                        nbytes = tensor_bytes(decl.shape, FLOAT32)
                        raise UserError(f"layer {node.name!r}: no host memory left to fill its parameter of shape "
                                        f"{tuple(decl.shape)} ({format_bytes(nbytes)})") from None
                    except UserError as e:  # a filler's field out of range: say whose
                        raise UserError(f"layer {node.name!r}: parameter of shape {tuple(decl.shape)}: {e}") from None
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
        # The layers after a Filter run on the items it kept (runtime/live_batch.py).
        self.live = LiveRun(graph, graph.live, self.ops) if graph.live is not None else None
        self.backward_steps = [s for s in reversed(self.forward_steps) if self.train and s.node.need_backward]
        self._gradient_sharing = [self._shared_gradients(s) for s in self.backward_steps]
        # A float32 layer's float32 copies of its half bottoms and their gradients (Layer.use_float32_copies), per
        # kind; empty for every other layer.
        self._float32_copies = {kind: {id(n): copies for n in graph.nodes
                                       if (copies := self._step_layers[id(n)].float32_copies(kind))}
                                for kind in FLOAT32_COPIES}
        # Where a step's GPU ops take the copies they make of arguments whose types or layouts they refuse
        # (backend/cuda/copy_room.py): the layer's planned room for its layout conversions, else the net's reserve
        # `#copies`; installed around each step of a net that may make such copies (half types or NHWC tensors).
        install = getattr(self._device_backend, "install_copy_room", None)
        mixed = self.blob_layouts.any or stored_types(graph) != {FLOAT32}
        self._install_room = install if mixed else None
        reserve = next((t for t in self.tensors if t.key == self.layout.copies), None)
        self._rooms = {kind: {id(n): buf if (buf := self._step_layers[id(n)].layout_copies(kind)) is not None
                              else reserve for n in graph.nodes} for kind in ("forward", "backward")}
        self.loss_blobs = [(self.data[t], self.diff.get(t), w) for t, w in graph.loss_blobs]
        stores = self.param_stores()
        self.streaming = ParamStreaming(stores, graph, self.train, self.backward_steps) if stores else None
        self._gradients_ready = final_gradient_writers(graph, self.backward_steps, self.learnable)

    def _shared_gradients(self, step: Step) -> tuple[tuple[tuple[int, int], ...], frozenset[int]]:
        """For backward step `step`: (top index, bottom index) of the top gradients that are a bottom
        gradient's memory (memory/aliases.py), and the bottoms whose gradient the layer adds into."""
        aliases, node = self.layout.aliases, step.node
        shared = tuple((k, node.bottoms.index(aliases.views[t])) for k, t in enumerate(node.tops)
                       if aliases.views.get(t) in node.bottoms)
        return shared, aliases.accumulate.get(node.name, frozenset())

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
        t.array = self.pool.view(t.key, t.shape, t.dtype, t.layout)

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
        """Point the layers' parameter and buffer declarations at their tensors' current arrays."""
        bind_arrays(self.graph, self.param_stores())

    def param_stores(self) -> list:
        """The stores streaming this net's parameters from the host (its own, and the train net's for a
        test net); empty while every parameter is resident."""
        return [s for s in (self.params, self._shared_params) if s is not None and s.offloaded]

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

    def _queue_forward(self, first: int = 0, last: int | None = None, steps: Sequence[int] | None = None) -> None:
        """Queue the forward steps of the layers at prototxt positions `first`..`last`, or the steps `steps`
        (indexes into `forward_steps`)."""
        partial = check_range(self, first, last, "forward over part of the net")
        forward = self.forward_steps
        for i in steps if steps is not None else range(len(forward)):
            step = forward[i]
            if partial and not first <= step.node.layer.layer_index <= last:
                continue
            self.hooks.before_forward(i, step)
            self.run_forward_step(i)
            self.hooks.after_forward(i, step)
        if self.streaming is not None:
            self.streaming.settle()

    def run_forward_step(self, i: int, replay: bool = False) -> None:
        """Run forward step `i` on its tensors' current arrays, its streamed parameters brought in for it.
        `replay`: a recomputation (memory/recompute_manager.py): `ctx.recomputing` is set meanwhile, so
        BatchNorm keeps its running sums and no parameter goes home changed; nothing is prefetched."""
        step = self.forward_steps[i]
        streaming = self.streaming
        if streaming is not None:
            streaming.bring_in(streaming.forward, i, prefetch_next=not replay)
        ctx = self.ctx
        outer = ctx.recomputing
        ctx.recomputing = outer or replay
        try:
            layer, bottoms, tops = self._step_layers[id(step.node)], [t.array for t in step.bottoms], \
                [t.array for t in step.tops]
            if self.live is not None:
                layer, bottoms, tops = self.live.forward_args(step.node, layer, bottoms, tops)
            copies = self._float32_copies["forward"].get(id(step.node))
            if copies:
                bottoms = self._as_float32(copies, bottoms)
            if self._install_room is not None:
                self._enter_room("forward", step)
            layer.forward(bottoms, tops)
        finally:
            ctx.recomputing = outer
            if self._install_room is not None:
                self._device_backend.leave_copy_room()
            if streaming is not None:  # weights are unchanged; running statistics go home
                streaming.send_home(streaming.forward, i, changed=not replay)

    @cached_property
    def _loss_reader(self) -> LossReader:
        return LossReader(self.backend)  # made at the first training pass: a net that only tests needs no stream

    def loss_value(self) -> float:
        return weighted_loss(self.backend, self.loss_blobs)

    def backward(self, first: int = 0, last: int | None = None, seed_losses: bool = True) -> None:
        """Run the backward steps. `first`/`last`: only the layers at those prototxt positions (Caffe's
        Net::BackwardFromTo); `seed_losses=False`: start from the gradients the blobs hold now instead of
        setting each loss blob's gradient to its weight (`seed_loss_diffs`), so a caller may set any top's."""
        partial = check_range(self, first, last, "backward over part of the net", backward=True)
        hooks, streaming, ready = self.hooks, self.streaming, self._gradients_ready
        if seed_losses:
            self.seed_loss_diffs()
        for i, step in enumerate(self.backward_steps):
            if partial and not first <= step.node.layer.layer_index <= last:
                continue
            hooks.before_backward(i, step)
            if streaming is not None:
                streaming.bring_in(streaming.backward, i)
            self._run_backward_step(i, step)
            if ready[i]:
                hooks.gradients_ready(step, ready[i])
            if streaming is not None:  # the gradients accumulated: copy them home
                streaming.send_home(streaming.backward, i)
            hooks.after_backward(i, step)
        if streaming is not None:
            streaming.settle()

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
        layer, tops, bottoms = self._step_layers[id(step.node)], [t.array for t in step.tops], \
            [t.array for t in step.bottoms]
        if self.live is not None:
            layer, tops, top_diffs, bottoms, bottom_diffs = self.live.backward_args(
                step.node, layer, tops, top_diffs, bottoms, bottom_diffs)
        copies = self._float32_copies["backward"].get(id(step.node))
        if copies:
            bottoms = self._as_float32(copies, bottoms)
        rounded = ()
        copies = self._float32_copies["diff"].get(id(step.node))
        if copies:
            bottom_diffs, rounded = self._float32_gradients(copies, bottom_diffs, top_diffs, accumulate)
        if self._install_room is not None:
            self._enter_room("backward", step)
        try:
            layer.backward(tops, top_diffs, step.node.propagate_down, bottoms, bottom_diffs, **extra)
        finally:
            if self._install_room is not None:
                self._device_backend.leave_copy_room()
        for copy, gradient in rounded:  # the float32 gradients rounded into their half tensors
            self.ops.copy(copy, gradient)

    def _enter_room(self, kind: str, step: Step) -> None:
        """Install step `step`'s room (`kind`: forward or backward) for its ops' fallback copies."""
        room = self._rooms[kind][id(step.node)]
        assert self._install_room is not None
        self._install_room(room.array if room is not None else None, step.node.name)

    def _as_float32(self, copies: list, arrays: list) -> list:
        """`arrays` with each half array that has a planned float32 copy (bottom j: `copies`) cast into it."""
        arrays = list(arrays)
        for j, buf in copies:
            a = arrays[j]
            if a is not None and buf.array is not None and a.size == buf.array.size:  # (a live batch's rows: not)
                self.ops.copy(a, buf.array)
                arrays[j] = buf.array
        return arrays

    def _float32_gradients(self, copies: list, bottom_diffs: list, top_diffs: list, accumulate) -> tuple:
        """`bottom_diffs` with each half gradient that has a planned float32 copy replaced by it (holding the
        gradient's values where the layer adds into it), and the (copy, gradient) pairs to round back after the
        layer's backward. A gradient that is also another argument (shared memory) stays as it is."""
        bottom_diffs = list(bottom_diffs)
        rounded = []
        for j, buf in copies:
            d = bottom_diffs[j]
            if d is None or buf.array is None or d.size != buf.array.size or \
                    sum(x is d for x in (*bottom_diffs, *top_diffs)) > 1:
                continue
            if j in accumulate:
                self.ops.copy(d, buf.array)
            bottom_diffs[j] = buf.array
            rounded.append((buf.array, d))
        return bottom_diffs, rounded

    @cached_property
    def _replay(self) -> GraphReplay | None:
        return replay_for(self)  # decided at the first training pass, once the net is set up

    @property
    def replayed_passes(self) -> int:
        """Training passes run as CUDA graphs so far (runtime/graph_replay.py); 0 where passes run eagerly."""
        replay = self.__dict__.get("_replay")  # not decided before the first pass
        return replay.replays if replay is not None else 0

    def forward_backward(self) -> float:
        """One training pass, replayed as a CUDA graph where runtime/graph_replay.py can; the loss is read while
        the device runs backward (runtime/loss_read.py)."""
        replay = self._replay
        if replay is not None:
            value = replay.forward_backward()
            if value is not None:
                return value
        return self.finish_pass(range(len(self.forward_steps)))

    def finish_pass(self, steps: Sequence[int]) -> float:
        """The training pass from the forward steps `steps` (indexes, in order; the others have run) on: the rest
        of forward, backward; returns the loss."""
        self._queue_forward(steps=steps)
        loss = self._loss_reader.start(self.loss_blobs)
        self.backward()
        value = loss()
        self.ctx.run_deferred_checks()  # bad labels stop the run here, before the solver applies the gradients
        return value

    def seed_loss_diffs(self) -> None:
        """Set each loss blob's gradient to its loss weight, as `backward` does first."""
        for _data, diff, w in self.loss_blobs:
            if diff is not None:
                self.memory.ensure(diff)
                self.ops.fill(diff.array, w * self.loss_scale)

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
        """A host copy of blob `name`'s data (after a Filter, of the items it kept)."""
        t = self.data[name]
        if t.array is None:
            raise UserError(f"blob {name!r} is not resident under --memory {self.memory.name}: it was freed after "
                            f"its last use (net outputs and losses stay readable; use --memory baseline to keep all)")
        return self.backend.to_host(t.array if self.live is None else self.live.blob_rows(name, t.array))

    def outputs(self) -> dict[str, np.ndarray]:
        return {name: self.blob(name) for name in self.graph.outputs}

    def layers_in_prototxt_order(self) -> Iterable[Node]:
        return sorted(self.graph.nodes, key=lambda n: n.layer.layer_index)
