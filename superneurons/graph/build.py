"""From a NetParameter to a Graph: filtered by phase, splits inserted, layers built, route and shapes known.

The Graph is pure structure: layer objects that have seen their bottom shapes, the route, and
which blobs need gradients. It allocates nothing, so `summary` and `memory` use it without a
device; `runtime.Net` allocates and runs it.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable

from superneurons.errors import UserError
from superneurons.graph.fuse import fuse
from superneurons.graph.fusions import Fusions
from superneurons.graph.live_batch import LiveBatches, find_live_batches
from superneurons.graph.node import Node
from superneurons.graph.precision import Precision, resolve as resolve_precision
from superneurons.graph.route import build_route
from superneurons.graph.splits import insert_splits
from superneurons.graph.state import filter_net, make_state
from superneurons.io.prototxt_lines import layer_line
from superneurons.layers.base import Layer, Shape, count, layer_class
from superneurons.proto import superneurons_pb2 as pb
from superneurons.settings import MemoryPolicy, get as get_setting, memory_policy

RECURRENT_INPUTS = ("sequence", "step")  # the forms of a recurrent layer's input transform (layers/recurrent.py)


@dataclass
class Graph:
    name: str
    phase: int
    nodes: list[Node]  # in route order (Alg. 1)
    blob_shapes: dict[str, Shape]
    outputs: list[str]  # blobs no layer consumes: what the net reports
    source: str = ""  # file the net came from, for messages
    param: pb.NetParameter | None = None
    # Whether gradients may share memory (memory/aliases.py), so the planner and the Net agree.
    diff_alias: bool = True
    # Storage types of every blob's values and gradients, and the loss scaling (graph/precision.py).
    precision: Precision = field(default_factory=Precision)
    # What graph/fuse.py decided: the layer each node's steps run, the layers that run together.
    fusions: Fusions = field(default_factory=Fusions)
    # Blobs whose batch is the count a Filter keeps at each forward, and the layers on them (graph/live_batch.py).
    live: LiveBatches | None = None
    # The form the net's recurrent layers transform their input in, "sequence" or "step" (RECURRENT_INPUTS;
    # None: the net has none), and how to build the graph again in the other (`in_recurrent_input`).
    recurrent_input: str | None = None
    _rebuild: Callable[[str], "Graph"] | None = field(default=None, repr=False, compare=False)

    def in_recurrent_input(self, form: str) -> "Graph":
        """This net with its recurrent layers' input transforms in `form` ("sequence" or "step"): this graph
        when they already are (or it has none), else the net built again (with this graph's master type)."""
        if self.recurrent_input in (None, form) or self._rebuild is None:
            return self
        graph = self._rebuild(form)
        graph.precision.master = self.precision.master
        return graph

    @property
    def internal_blobs(self) -> dict[str, str]:
        """Blobs graph/fuse.py split off a blob of the prototxt (a fused BatchNorm's input): name -> that blob."""
        return self.fusions.internal_blobs

    def step_layer(self, node: Node) -> Layer:
        """What `node`'s steps compute: its layer, or the fused layer graph/fuse.py gave it."""
        return self.fusions.step_layer(node)

    def top_gradient_blobs(self, node: Node) -> list[str]:
        return self.fusions.top_gradient_blobs(node)

    def bottom_gradients_written(self, node: Node, propagate_down: list[bool]) -> list[bool]:
        return self.fusions.bottom_gradients_written(node, propagate_down)

    def use_concat_slices(self, on: bool) -> None:
        """Let the ReLUs in place on a Concat's bottoms read their slices of the Concat top gradients (on), or
        let the Concats copy every bottom's gradient out (off, the state after build). memory.make_manager
        decides by the Net's memory mode, before the manager plans and the Net builds its steps."""
        self.fusions.slices_on = on

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def loss_blobs(self) -> list[tuple[str, float]]:
        out = []
        for n in self.nodes:
            for t, w in zip(n.tops, n.loss_weights):
                if w:
                    out.append((t, w))
        return out


def build_graph(net: pb.NetParameter, phase: int = pb.TRAIN, level: int = 0, stages: tuple[str, ...] = (),
                source: str = "", policy: MemoryPolicy | None = None, recurrent_input: str | None = None) -> Graph:
    """`policy`: fusion and gradient aliasing (None: MemoryParameter's defaults and the environment's
    overrides, settings.memory_policy). `recurrent_input`: the form of the recurrent layers' input transform,
    "sequence" or "step" (layers/recurrent.py; None: SUPERNEURONS_RECURRENT_INPUT's, sequence under its
    `auto`: memory.recurrent_input gives a memory mode's). An error about a layer names the line of its
    `name:` in `source`."""
    if recurrent_input is None:
        recurrent_input = "step" if get_setting("SUPERNEURONS_RECURRENT_INPUT") == "step" else "sequence"
    if recurrent_input not in RECURRENT_INPUTS:
        raise ValueError(f"recurrent_input must be one of {RECURRENT_INPUTS}, got {recurrent_input!r}")
    try:
        graph = _build_graph(net, phase, level, stages, source, policy, recurrent_input)
    except UserError as e:
        raise _at_layer_line(e, source) from None
    if graph.recurrent_input is not None:
        kept = pb.NetParameter()
        kept.CopyFrom(net)  # the caller's may change after this (time's seed_outputs_as_loss)
        graph._rebuild = lambda form: build_graph(kept, phase, level, stages, source, policy, form)
    return graph


_LAYER_NAMED = re.compile(r"""^: layer (['"])(.+?)\1""")


def _at_layer_line(e: UserError, source: str) -> UserError:
    """`e` with `source:LINE` for `source` when its message starts `source: layer 'NAME'` and the file has it."""
    msg = str(e)
    m = _LAYER_NAMED.match(msg[len(source):]) if source and msg.startswith(source) else None
    line = layer_line(source, m.group(2)) if m is not None and os.path.isfile(source) else None
    return e if line is None else type(e)(f"{source}:{line}{msg[len(source):]}")


def _build_graph(net: pb.NetParameter, phase: int, level: int, stages: tuple[str, ...], source: str,
                 policy: MemoryPolicy | None, recurrent_input: str) -> Graph:
    policy = policy if policy is not None else memory_policy()
    where = source or net.name or "<net>"
    state = make_state(phase, level, tuple(stages) or tuple(net.state.stage))
    if not stages and net.state.HasField("level") and not level:
        state.level = net.state.level
    filtered = insert_splits(filter_net(net, state), where)
    if not filtered.layer:
        raise UserError(f"{where}: the net has no layers in phase {pb.Phase.Name(phase)}")
    filtered, parts = _unroll(filtered, phase, where, recurrent_input == "step")
    nodes = _instantiate(filtered, phase, where, parts)
    shapes = _infer_shapes(nodes, where)
    _set_loss_weights(nodes)
    _mark_backward(nodes, bool(net.force_backward))
    # The layers after a Filter run set up for each batch's count, each on its own (graph/live_batch.py).
    live = find_live_batches(nodes, shapes, where)
    apart = frozenset(live.node_filter) if live is not None else frozenset()
    # needs need_backward; may split blobs before any Net declares tensors
    fusions = fuse(nodes, shapes, apart) if policy.fuse_layers else Fusions()
    if any(fusions.step_layer(n) is not n.layer for n in nodes if n.name in apart):
        raise RuntimeError("a layer after a Filter was fused: runtime/live_batch.py runs each on its own")
    precision = resolve_precision(net, nodes, source)
    consumed = {b for n in nodes for b in n.bottoms}
    # The state an unrolled layer leaves unread (an LSTM's last c_t without expose_hidden) is no output of the net
    inner = {t for n in nodes if n.layer.part_of is not None for t in n.tops} - _unrolled_tops(nodes)
    outputs = []
    for n in nodes:
        for t in n.tops:
            if t not in consumed and t not in outputs and t not in inner:
                outputs.append(t)
    return Graph(net.name, phase, nodes, shapes, outputs, source, filtered, diff_alias=policy.diff_alias,
                 fusions=fusions, precision=precision, live=live, recurrent_input=recurrent_input if parts else None)


def _instantiate(net: pb.NetParameter, phase: int, where: str, parts: dict[int, "_Part"] | None = None) -> list[Node]:
    """The layers of `net` built in route order (Alg. 1), not yet set up; `parts`: the layers an unrolled
    layer became (`_unroll`), by position."""
    params = list(net.layer)
    parts = parts or {}
    names = unique_layer_names([p.name for p in params])
    route = build_route([list(p.bottom) for p in params], [list(p.top) for p in params])
    nodes: list[Node] = []
    for i in route:
        p = params[i]
        part = parts.get(i)
        cls = (part.cls if part is not None else None) or layer_class(p.type, f"{where}: layer {p.name!r}")
        if cls.is_loss and len(p.top) < cls.n_tops[0]:
            add_automatic_tops(p, cls.n_tops[0])
        layer = cls(p, phase)
        layer.name = names[i]  # the key the runtime uses; `layer.param.name` stays the prototxt's
        layer.layer_index = i
        if part is not None:
            layer.layer_index = part.index
            layer.part_of = part.part_of
            if part.prototxt_param is not None:
                layer.prototxt_param = part.prototxt_param
        nodes.append(Node(layer, list(p.bottom), list(p.top)))
    _mark_data_copies(nodes)
    return nodes


@dataclass
class _Part:
    """A layer of the net being built, for the layers an unrolled layer became: the class that builds it (None:
    its registered type), the position of the prototxt's layer it comes from, the name of the unrolled layer
    (None for the others), and, on the part that keeps the prototxt's name, the prototxt's LayerParameter."""

    cls: type[Layer] | None
    index: int
    unrolled: str | None = None
    prototxt_param: pb.LayerParameter | None = None

    @property
    def part_of(self) -> str | None:
        return self.unrolled if self.prototxt_param is None else None


def _unroll(net: pb.NetParameter, phase: int, where: str, per_step: bool) -> tuple[pb.NetParameter, dict[int, _Part]]:
    """`net` with every layer that runs as several (`Layer.unrolls`: RNN and LSTM over their time steps) replaced
    by its parts (`per_step`: `Layer.unroll`'s), splits inserted where the parts read a blob twice, and every
    layer's `_Part` by position (empty when no layer unrolls). The number of parts depends on the bottom
    shapes, so the net's shapes are inferred once as it is, first."""
    if not any(getattr(layer_class(p.type, f"{where}: layer {p.name!r}"), "unrolls", False) for p in net.layer):
        return net, {}
    nodes = _instantiate(net, phase, where)
    _infer_shapes(nodes, where)
    by_index = {n.layer.layer_index: n.layer for n in nodes}
    out = pb.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    parts: list[_Part] = []
    for i, p in enumerate(net.layer):
        layer = by_index[i]
        if not layer.unrolls:
            parts.append(_Part(None, i))
            out.layer.add().CopyFrom(p)
            continue
        for part, cls in layer.unroll(per_step):
            # The part that keeps the prototxt's name stands for the layer (caffemodels, pycaffe)
            parts.append(_Part(cls, i, layer.name, p if part.name == p.name else None))
            out.layer.add().CopyFrom(part)
    split = insert_splits(out, where)
    # insert_splits keeps the layers' order and puts each new Split right after the layer whose top it splits.
    final: dict[int, _Part] = {}
    j = 0
    for pos, p in enumerate(split.layer):
        if j < len(out.layer) and p.name == out.layer[j].name and p.type == out.layer[j].type:
            final[pos] = parts[j]
            j += 1
        else:
            before = parts[j - 1]
            final[pos] = _Part(None, before.index, before.unrolled)
    return split, final


def _unrolled_tops(nodes: list[Node]) -> set[str]:
    """The tops the prototxt gives the layers that were unrolled (their parts produce them)."""
    return {t for n in nodes if n.layer.prototxt_param is not n.layer.param for t in n.layer.prototxt_param.top}


def add_automatic_tops(p: pb.LayerParameter, wanted: int) -> None:
    """Caffe's AutoTopBlobs: a loss layer written without a top (old prototxts, e.g. V1 SOFTMAX_LOSS) gets
    anonymous ones, so its loss is still computed and counted; each is named after its layer."""
    while len(p.top) < wanted:
        p.top.append(f"{p.name} (automatic)" if len(p.top) == 0 else f"{p.name} (automatic {len(p.top)})")


def unique_layer_names(names: list[str]) -> list[str]:
    """Caffe accepts repeated layer names (its mnist_autoencoder has two layers named 'loss'); the runtime
    keys tensors, plans and snapshots by layer name, so a repeat becomes `name#2`, `name#3`, ... in
    prototxt order. The first keeps its name, which is what Caffe's weight loading matches (first layer of
    that name); saved models carry the prototxt's names."""
    taken = set(names)
    seen: set[str] = set()
    out = []
    for name in names:
        unique, k = name, 2
        while unique in seen or (unique != name and unique in taken):  # a layer really named `x#2` keeps it
            unique, k = f"{name}#{k}", k + 1
        seen.add(unique)
        out.append(unique)
    return out


def _mark_data_copies(nodes: list[Node]) -> None:
    """A Split top consumed by an in-place layer must own its data, or the layer would overwrite its siblings
    (`Layer.can_copy_data`)."""
    in_place_bottoms = {n.bottoms[0] for n in nodes if n.layer.in_place}
    for n in nodes:
        if n.layer.can_copy_data:
            n.layer.copy_data = any(t in in_place_bottoms for t in n.tops)


def _infer_shapes(nodes: list[Node], where: str) -> dict[str, Shape]:
    shapes: dict[str, Shape] = {}
    for n in nodes:
        layer = n.layer
        bottom_shapes = [shapes[b] for b in n.bottoms]
        try:
            layer.check_counts(len(n.bottoms), len(n.tops))
            top_shapes = layer.setup(bottom_shapes)
        except UserError as e:
            msg = str(e)
            if not msg.startswith(where):
                msg = f"{where}: {msg}"
            shown = f" (bottom shapes: {', '.join(_fmt(s) for s in bottom_shapes)})" if bottom_shapes else ""
            raise UserError(msg + shown) from None
        top_shapes = [tuple(int(d) for d in s) for s in top_shapes]
        if len(top_shapes) != len(n.tops):
            raise RuntimeError(f"{layer!r}.setup returned {len(top_shapes)} shapes for {len(n.tops)} tops")
        for t, s, in_place_of in zip(n.tops, top_shapes, n.bottoms + [None] * len(n.tops)):
            if t == in_place_of and shapes[t] != s:
                raise UserError(f"{where}: layer {layer.name!r} works in place on {t!r} but changes its shape "
                                f"from {_fmt(shapes[t])} to {_fmt(s)}")
            if any(d < 0 for d in s):
                raise UserError(f"{where}: layer {layer.name!r}: top {t!r} would have a negative dimension, shape "
                                f"{_fmt(s)}")
            if count(s) == 0 and len(s) > 0:
                raise UserError(f"{where}: layer {layer.name!r}: top {t!r} has an empty shape {_fmt(s)}")
            shapes[t] = s
        n.top_shapes = top_shapes
    return shapes


def _set_loss_weights(nodes: list[Node]) -> None:
    for n in nodes:
        given = list(n.layer.param.loss_weight)
        if given and len(given) != len(n.tops):
            raise UserError(f"layer {n.name!r}: {len(given)} loss_weight values for {len(n.tops)} tops")
        if not given:
            given = [1.0 if (n.layer.is_loss and j == 0) else 0.0 for j in range(len(n.tops))]
        n.loss_weights = [float(w) for w in given]


def _mark_backward(nodes: list[Node], force: bool) -> None:
    """Caffe's rule: a layer runs backward if it leads to a loss and has learnable params or gradient-needing bottoms;
    `force` (force_backward, in either phase) makes every layer but the data layers run backward, loss or not
    (a TEST net computes them only when its Net keeps gradients: the Python API's, for saliency maps)."""
    blob_needs: dict[str, bool] = {}
    for n in nodes:
        no_gradient = n.layer.label_bottoms + n.layer.order_bottoms
        pd = list(n.layer.param.propagate_down)
        if pd and len(pd) != len(n.bottoms):
            raise UserError(f"layer {n.name!r}: {len(pd)} propagate_down values for {len(n.bottoms)} bottoms")
        n.propagate_down = [
            (pd[j] if pd else True) and j not in no_gradient and blob_needs.get(b, False)
            for j, b in enumerate(n.bottoms)
        ]
        if force and not n.layer.is_data:
            n.propagate_down = [j not in no_gradient and (not pd or pd[j]) for j in range(len(n.bottoms))]
        learnable = any(_lr_mult(n.layer, k) != 0 for k in range(len(n.layer.params)))
        n.need_backward = n.layer.has_backward and not n.layer.is_data and (learnable or any(n.propagate_down))
        for t in n.tops:
            blob_needs[t] = n.need_backward
    # Only layers upstream of a loss do backward (unless forced).
    under_loss: set[str] = set()
    for n in reversed(nodes):
        contributes = any(w for w in n.loss_weights) or any(t in under_loss for t in n.tops)
        if not contributes and not force:
            n.need_backward = False
        else:
            under_loss.update(n.bottoms)
        n.propagate_down = [p and n.need_backward for p in n.propagate_down]


def _lr_mult(layer: Layer, k: int) -> float:
    if not layer.params[k].learnable:
        return 0.0  # running statistics (BatchNorm) never make a layer need backward
    specs = layer.param.param
    return specs[k].lr_mult if k < len(specs) else 1.0


def _fmt(shape: Shape) -> str:
    return "(" + " ".join(str(d) for d in shape) + ")"
