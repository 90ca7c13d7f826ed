"""The tensors of one iteration, declared once: their keys, shapes, kinds, and which are views of which.

`declare_tensors(graph, ...)` walks the route and returns a `TensorLayout`; `tensor_key` is the only
place a tensor's key is spelled. Both sides of the memory runtime read the same layout:
- the planner (`liveness.Program`) takes its root activations, gradients and buffers and their per-step uses;
- the runtime (`runtime.net.Net`) builds one `Tensor` per `TensorSpec`, in layout order, and points the
  layers' parameter and buffer declarations at them.
So the plan and the pool talk about the same objects by construction.

Views: a Flatten/Reshape/Split top is a reshaped view of its bottom (`Layer.shares_data`), the top
gradient of a `shares_diff` layer a view of its bottom gradient, and gradients that `aliases.py` lets
share memory (Split, Eltwise SUM) views of one bottom gradient. A view has no memory of its own: it
follows its `base`, and the planner counts only roots.

Parameters (values, gradients, the solver's history) are declared here too, once per owner: a parameter
that names another's (`param { name: ... }`) reads the first one's tensors, and a test net reads the train
net's (`borrowed`), so neither declares any. Parameter gradients are declared after every activation, side
by side in backward's order, so the managers, which place tensors in declaration order, keep them
adjacent in the pool.

A `TensorSpec` is the one description of a tensor: key, shape, element type (`dtype`), memory layout,
role (activation, gradient, parameter, history, scratch, workspace) and owner (the layer that declares
it: the producer of an activation, the first layer whose backward writes a gradient, the layer of a
buffer or parameter; none for the net's float64 scratch region `#scratch`, which the ops that sum share, and for
the grouped solver update's tables `#update`).
Its byte count is `superneurons.dtypes.tensor_bytes`, which everything that sizes memory calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, cast

import numpy as np

from superneurons import settings
from superneurons.backend import scratch as need
from superneurons.dtypes import FLOAT32, element_count, tensor_bytes
from superneurons.errors import UserError
from superneurons.graph.build import Graph
from superneurons.graph.precision import stored_types
from superneurons.memory.aliases import DiffAliases, diff_aliases
from superneurons.memory.pool import round_up

DATA, DIFF, BUFFER = "data", "diff", "buffer"  # activations, their gradients, layer scratch kept for backward
PARAM, PARAM_DIFF, HISTORY = "param", "param_diff", "history"  # parameters, their gradients, solver history
PARAM_KINDS = (PARAM, PARAM_DIFF, HISTORY)

# Roles: what a tensor is for, whatever the key spells. Workspace (a convolution's, memory/workspace.py) is
# borrowed from the pool per call and declares no spec; the role names it in the plan and the docs.
ACTIVATION, GRADIENT, PARAMETER, SCRATCH, WORKSPACE = "activation", "gradient", "parameter", "scratch", "workspace"
ROLES = (ACTIVATION, GRADIENT, PARAMETER, HISTORY, SCRATCH, WORKSPACE)
ROLE_OF_KIND = {DATA: ACTIVATION, DIFF: GRADIENT, BUFFER: SCRATCH, PARAM: PARAMETER, PARAM_DIFF: GRADIENT,
                HISTORY: HISTORY}
# Memory layouts (graph/layout.py): NCHW is Caffe's order (2-D and 1-D blobs are its leading dimensions); a 4-D
# tensor a backend keeps channels last is NHWC, its shape still (N, C, H, W).
NCHW, NHWC = "NCHW", "NHWC"
# The net's float64 scratch region (backend/scratch.py): a buffer no layer owns, spelled `#scratch`; and the grouped
# solver update's tables (solver/fused_update.py), `#update`.
SCRATCH_OWNER, SCRATCH_NAME, UPDATE_NAME = "", "scratch", "update"
# A data-parallel training net's half copy of its gradient run (parallel/reducer.py), spelled `#reduce`.
REDUCE_NAME = "reduce"
# The reserve the GPU ops' fallback copies come from (backend/cuda/copy_room.py), spelled `#copies`.
COPIES_NAME = "copies"


def tensor_key(kind: str, owner: str, index: int | str = 0) -> str:
    """The key of a tensor, for the runtime, the planner, `superneurons memory` and the pool alike.
    `owner`: the blob (DATA, DIFF), the layer (BUFFER: `index` is the buffer's name; PARAM, PARAM_DIFF:
    the parameter's index), or the parameter's key (HISTORY: `index` is the history set)."""
    if kind == DATA:
        return owner
    if kind == DIFF:
        return f"{owner}@diff"
    if kind == BUFFER:
        return f"{owner}#{index}"
    if kind == PARAM:
        return f"{owner}.{index}"
    if kind == PARAM_DIFF:
        return f"{owner}.{index}@diff"
    if kind == HISTORY:
        return f"{owner}@history{index}"
    raise ValueError(f"unknown tensor kind {kind!r}")


@dataclass(frozen=True)
class TensorSpec:
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype  # storage type: what the pool holds
    kind: str  # how the key is spelled (DATA, DIFF, BUFFER, PARAM, PARAM_DIFF, HISTORY)
    base: str | None = None  # the key of the tensor this one is a reshaped view of
    owner: str | None = None  # the layer that declares it (see the module's docstring)
    layout: str = NCHW

    @property
    def role(self) -> str:
        return ROLE_OF_KIND[self.kind]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.shape, self.dtype)


@dataclass(frozen=True)
class ParamSlot:
    """Parameter `index` of layer `node`: the keys of its tensors, or where it reads them from."""

    node: str
    index: int
    data: str | None  # None when it reads another parameter's tensors (`shared_with`, or `borrowed`)
    diff: str | None  # None also when not training
    learnable: bool
    shared_with: tuple[str, int] | None = None  # (layer, index) of the parameter of the same name declared first
    borrowed: bool = False  # a test net's parameter that reads the train net's


@dataclass
class TensorLayout:
    specs: list[TensorSpec] = field(default_factory=list)  # declaration order: the Net builds its tensors in it
    by_key: dict[str, TensorSpec] = field(default_factory=dict)
    data_key: dict[str, str] = field(default_factory=dict)  # blob -> key of its data tensor
    diff_key: dict[str, str] = field(default_factory=dict)  # blob -> key of its gradient (training only)
    # layer -> [(key, buffer name, whether backward reads it)]
    buffer_keys: dict[str, list[tuple[str, str, bool]]] = field(default_factory=dict)
    # buffers only the layer's backward uses (scratch of that step: no forward writes them, nothing is kept)
    backward_only: set[str] = field(default_factory=set)
    params: list[ParamSlot] = field(default_factory=list)  # every layer's parameters, in route order
    history: list[list[str]] = field(default_factory=list)  # per solver history set, per learnable owned parameter
    aliases: DiffAliases = field(default_factory=DiffAliases)
    scratch: str | None = None  # the key of the net's scratch region (`scratch_entries`)
    update: str | None = None  # the key of the grouped solver update's tables (`declare_tensors(update_chunk=)`)
    reduce: str | None = None  # the key of the half gradient run a data-parallel net reduces in (`reduce_entries`)
    copies: str | None = None  # the key of the reserve for the GPU ops' fallback copies (`copies_reserve`)

    def root(self, key: str) -> str:
        """The key of the tensor that owns `key`'s memory (itself unless it is a view)."""
        base = self.by_key[key].base
        while base is not None:
            key, base = base, self.by_key[base].base
        return key

    def roots(self, kinds: Iterable[str]) -> list[TensorSpec]:
        kinds = set(kinds)
        return [s for s in self.specs if s.base is None and s.kind in kinds]

    def learnable(self) -> list[ParamSlot]:
        """The owned, learnable parameters (the solver's list), in route order."""
        return [p for p in self.params if p.learnable and p.data is not None and p.diff is not None]

    def add(self, kind: str, owner: str, index: int | str, shape, dtype=FLOAT32, base: str | None = None,
            layer: str | None = None, layout: str = NCHW) -> str:
        """Declare one more tensor (after its base, if it is a view, whose type it takes); returns its key.
        `layer`: its owner. A view of the same shape takes its base's layout; a reshaping view needs an NCHW base."""
        shape = tuple(int(d) for d in shape)
        if base is not None:
            dtype = self.by_key[base].dtype
            base_spec = self.by_key[base]
            if base_spec.shape == shape:
                layout = base_spec.layout
            elif base_spec.layout != NCHW:
                raise ValueError(f"{tensor_key(kind, owner, index)}: a reshaped view of {base}, which is "
                                 f"{base_spec.layout}")
        spec = TensorSpec(tensor_key(kind, owner, index), shape, np.dtype(dtype), kind, base, layer, layout)
        self.specs.append(spec)
        self.by_key[spec.key] = spec
        return spec.key


def top_is_view(layer) -> bool:
    """Whether `layer`'s tops are reshaped views of its bottom 0 rather than tensors of their own."""
    return layer.views_bottom_data


def scratch_entries(graph: Graph) -> int:
    """The float64 entries of the net's scratch region: the most any step's layer sums into at once
    (`Layer.scratch_entries`), and at least the one sum the solver's norms and checks take. One region serves
    every op that sums, one op after the other on the device, so the plan holds it for the whole run."""
    return max([need.total()] + [graph.step_layer(n).scratch_entries() for n in graph.nodes])


def reduce_entries(layout: TensorLayout) -> int:
    """The elements of the half buffer a data-parallel net reduces its gradients in (`reduce_type`): one per
    element of the learnable gradients' pool blocks, padding included (pool.round_up), so that each bucket's
    flat view, which spans its blocks, has a run of the buffer of its own, and so does each gradient when the
    ranks reduce tensor by tensor."""
    return sum(round_up(layout.by_key[p.diff].nbytes) // layout.by_key[p.diff].dtype.itemsize
               for p in layout.learnable() if p.diff is not None)


def copies_reserve(graph: Graph, layouts=None) -> int:
    """The bytes of the net's reserve `#copies` for the copies a GPU op makes when it refuses its arguments' types
    or layouts (backend/cuda/copy_room.py): SUPERNEURONS_COPY_RESERVE, for a net that stores half types or NHWC
    tensors (a float32 NCHW net's ops take every argument they are given). Which op refuses is known only when it
    does, so no layer can declare it: the reserve bounds it, and a call past it is refused in one line."""
    mixed = bool(layouts is not None and layouts.any) or stored_types(graph) != {FLOAT32}
    return int(settings.get("SUPERNEURONS_COPY_RESERVE")) if mixed else 0


def update_table_entries(lengths, chunk: int) -> int:
    """The 8-byte entries of the grouped solver update's tables (solver/fused_update.py) for parameters of
    `lengths` elements: its work split's rows (3 each, one per block of at most `chunk` elements), then per
    parameter its factors (2 float64) and its segment (4 int64)."""
    lengths = np.asarray(lengths, np.int64)
    return 3 * int((-(-lengths // chunk)).sum()) + 6 * len(lengths)


def declare_tensors(graph: Graph, *, train: bool, need_backward: dict[str, bool] | None = None,
                    propagate_down: dict[str, list[bool]] | None = None, seeds: Iterable[str] | None = None,
                    borrowed: Iterable[tuple[str, int]] = (), history: int = 0, layouts=None,
                    update_chunk: int = 0, reduce_type=None) -> TensorLayout:
    """Every tensor of one iteration of `graph`. `need_backward`/`propagate_down`: the backward flags
    (default: the graph's own, as its Net runs them); `seeds`: blobs whose gradients the loss fills (default:
    the loss blobs); `borrowed`: (layer, index) of parameters read from another net; `history`: solver
    history sets per learnable parameter; `layouts`: a graph.layout.BlobLayouts (default: every tensor NCHW);
    `update_chunk`: the solver updates the learnable parameters in one launch (solver/fused_update.py) over blocks
    of that many elements, and `#update` holds its tables (`update_table_entries`); 0: it does not;
    `reduce_type`: a half type in which a data-parallel training net reduces its gradients (None: in their own
    type, in place), which declares the resident buffer `#reduce` of that type (`reduce_entries`)."""
    nodes = graph.nodes
    blob_layout = layouts.blob if layouts is not None else (lambda _b: NCHW)
    buffer_layout = layouts.buffer if layouts is not None else (lambda _layer, _shape: NCHW)
    if need_backward is None:
        need_backward = {n.name: n.need_backward for n in nodes}
    if propagate_down is None:
        propagate_down = {n.name: list(n.propagate_down) for n in nodes}
    seeds = [t for t, _w in graph.loss_blobs] if seeds is None else list(seeds)
    out = TensorLayout()
    out.aliases = diff_aliases(graph, need_backward, propagate_down, seeds) if train else DiffAliases()
    data, diff = out.data_key, out.diff_key
    data_type, diff_type = graph.precision.data, graph.precision.diff  # storage types (graph/precision.py)
    master = graph.precision.master  # the weights', their gradients' and the history's

    def bottom_diff(b: str, layer: str) -> str:
        if b not in diff:
            diff[b] = out.add(DIFF, b, 0, graph.blob_shapes[b], diff_type.get(b, FLOAT32), layer=layer,
                              layout=blob_layout(b))
        return diff[b]

    borrowed = set(borrowed)
    gradients: list[tuple[bool, str, int, tuple]] = []  # (learnable, layer, index, shape), route order
    named: dict[str, tuple[str, int, tuple]] = {}  # parameter name -> (layer, index, shape) of its owner
    for node in nodes:
        layer = node.layer
        view = top_is_view(layer)
        for t, shape in zip(node.tops, node.top_shapes):
            if t in data and node.bottoms and t == node.bottoms[0]:
                continue  # in place: the bottom's tensor
            data[t] = out.add(DATA, t, 0, shape, data_type.get(t, FLOAT32), base=data[node.bottoms[0]] if view else None,
                              layer=node.name, layout=blob_layout(t))
        if train:
            # Bottom gradients first: a top gradient that is a view (Flatten) needs its bottom's gradient,
            # which does not exist yet when the bottom comes from a layer without backward (force_backward).
            for b, pd in zip(node.bottoms, propagate_down[node.name]):
                if pd:
                    bottom_diff(b, node.name)
            if need_backward[node.name]:
                for t, shape in zip(node.tops, node.top_shapes):
                    if t in diff:
                        continue
                    base = diff.get(node.bottoms[0]) if layer.shares_diff and node.bottoms else None
                    if t in out.aliases.views:
                        base = bottom_diff(out.aliases.views[t], node.name)
                    diff[t] = out.add(DIFF, t, 0, shape, diff_type.get(t, FLOAT32), base=base, layer=node.name,
                                      layout=blob_layout(t))
        out.buffer_keys[node.name] = [(out.add(BUFFER, node.name, name, buf.shape, buf.dtype, layer=node.name,
                                               layout=buffer_layout(node.name, buf.shape)), name,
                                       bool(buf.for_backward))
                                      for name, buf in graph.step_layer(node).buffers.items()]
        out.backward_only.update(key for key, name, _fb in out.buffer_keys[node.name]
                                 if not graph.step_layer(node).buffers[name].in_forward)
        specs = layer.param.param
        for k, decl in enumerate(layer.params):
            name = specs[k].name if k < len(specs) and specs[k].name else ""
            if (node.name, k) in borrowed:
                out.params.append(ParamSlot(node.name, k, None, None, decl.learnable, borrowed=True))
                if name and name not in named:  # a later layer of this net sharing the name reads it too (a
                    named[name] = (node.name, k, tuple(decl.shape))  # time step the train net's unrolling lacks)
                continue
            if name in named:
                owner, j, shape = named[name]
                if shape != tuple(decl.shape):
                    raise UserError(f"layer {node.name!r}: shared param {name!r} has shape {tuple(decl.shape)}, "
                                    f"its owner has {shape}")
                out.params.append(ParamSlot(node.name, k, None, None, decl.learnable, shared_with=(owner, j)))
                continue
            if name:
                named[name] = (node.name, k, tuple(decl.shape))
            value = out.add(PARAM, node.name, k, decl.shape, master, layer=node.name)
            grad = tensor_key(PARAM_DIFF, node.name, k) if train else None
            out.params.append(ParamSlot(node.name, k, value, grad, decl.learnable))
            if train:
                gradients.append((decl.learnable, node.name, k, decl.shape))
    out.scratch = out.add(BUFFER, SCRATCH_OWNER, SCRATCH_NAME, (scratch_entries(graph),), need.DTYPE)
    # Parameter gradients side by side, learnable ones first, in the order backward finishes them (the
    # reverse of the route): placed in this order, the gradients a data-parallel bucket reduces are one
    # run of pool memory, reduced in place by one call (parallel/reducer.py).
    for _learnable, owner, k, shape in sorted(reversed(gradients), key=lambda g: not g[0]):
        out.add(PARAM_DIFF, owner, k, shape, master, layer=owner)
    learnable = [(p, cast(str, p.data)) for p in out.learnable()]  # learnable parameters own their tensors
    out.history = [[out.add(HISTORY, data, j, out.by_key[data].shape, master, layer=p.node) for p, data in learnable]
                   for j in range(history)]
    if train and update_chunk > 0 and history and learnable:
        entries = update_table_entries([element_count(out.by_key[data].shape) for _p, data in learnable], update_chunk)
        out.update = out.add(BUFFER, SCRATCH_OWNER, UPDATE_NAME, (entries,), np.int64)
    reserve = copies_reserve(graph, layouts)
    if reserve > 0:
        out.copies = out.add(BUFFER, SCRATCH_OWNER, COPIES_NAME, (reserve,), np.uint8)
    if train and reduce_type is not None and learnable:
        out.reduce = out.add(BUFFER, SCRATCH_OWNER, REDUCE_NAME, (reduce_entries(out),), reduce_type)
    return out
