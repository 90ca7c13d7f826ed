"""The Net's tensors, wired to the layers: one `Tensor` per entry of the layout `memory/tensors.py` declares.

Before the layout is declared, each layer's parameters read their prototxt `param` specs (lr_mult,
decay_mult, a shared name) and a test net's parameters point at the train net's of the same layer name and
shape. After it, the layers' parameter and buffer declarations point at their tensors, and `bind_arrays`
points them at the tensors' current arrays whenever those move.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superneurons.layers.base import ParamDecl
from superneurons.memory.steps import Tensor
from superneurons.memory.tensors import TensorLayout


def read_param_specs(graph: Any, share: Any | None) -> set[tuple[str, int]]:
    """Copy each parameter's lr_mult, decay_mult and name from its prototxt spec (statistics a layer keeps
    itself, not learnable, get 0); with `share` (the train net's graph), point a test net's parameters at
    the train net's. Returns (layer, index) of those borrowed."""
    borrowed = set()
    shared_names = {n.name for n in share.nodes} if share is not None else set()
    for node in graph.nodes:
        layer = node.layer
        specs = layer.param.param
        other = share.node(node.name) if node.name in shared_names else None
        for k, decl in enumerate(layer.params):
            spec = specs[k] if k < len(specs) else None
            default = 1.0 if decl.learnable else 0.0
            decl.lr_mult = spec.lr_mult if spec is not None and decl.learnable else default
            decl.decay_mult = spec.decay_mult if spec is not None and decl.learnable else default
            decl.name = spec.name if spec is not None and spec.name else ""
            if other is not None and k < len(other.layer.params) and other.layer.params[k].shape == decl.shape:
                decl.owner = other.layer.params[k]  # the test net reads the train net's weights
                borrowed.add((node.name, k))
    return borrowed


@dataclass
class NetTensors:
    tensors: list[Tensor]  # in layout order: views after their bases
    data: dict[str, Tensor]  # blob -> its data
    diff: dict[str, Tensor]  # blob -> its gradient (training)
    learnable: list[ParamDecl]  # owned, learnable params in route order (the solver's list)
    history: list[list[Tensor]]  # per solver history set, one tensor per learnable param (.solverstate order)


def wire_tensors(graph: Any, layout: TensorLayout) -> NetTensors:
    """One Tensor per TensorSpec of `layout`, in its order; the layers' buffers (of the layers the steps
    run) and parameters pointed at theirs."""
    by_key: dict[str, Tensor] = {}
    tensors = []
    for spec in layout.specs:
        base = by_key[spec.base] if spec.base is not None else None  # declared before its views
        t = by_key[spec.key] = Tensor(spec.key, spec.shape, spec.dtype, spec.kind, base, spec.layout)
        tensors.append(t)
    for node in graph.nodes:
        for key, name, _for_backward in layout.buffer_keys[node.name]:
            graph.step_layer(node).buffers[name].tensor = by_key[key]
    decls = {(n.name, k): decl for n in graph.nodes for k, decl in enumerate(n.layer.params)}
    for slot in layout.params:
        decl = decls[slot.node, slot.index]
        if slot.borrowed:
            continue
        if slot.shared_with is not None:
            decl.owner = decls[slot.shared_with]
            continue
        decl.owner = None
        decl.data_tensor = by_key[slot.data]
        decl.diff_tensor = by_key[slot.diff] if slot.diff is not None else None
    return NetTensors(tensors,
                      {blob: by_key[key] for blob, key in layout.data_key.items()},
                      {blob: by_key[key] for blob, key in layout.diff_key.items()},
                      [decls[slot.node, slot.index] for slot in layout.learnable()],
                      [[by_key[key] for key in keys] for keys in layout.history])


def bind_arrays(graph: Any, stores: list[Any]) -> None:
    """Point every layer's ParamDecl/BufferDecl at its tensors' current arrays (and tell the `stores` that
    stream parameters which ParamDecls to re-point when a tensor moves)."""
    for node in graph.nodes:
        for decl in node.layer.params:
            src = decl
            while getattr(src, "owner", None) is not None:
                src = src.owner
            decl.data = src.data_tensor.array
            decl.diff = src.diff_tensor.array if getattr(src, "diff_tensor", None) is not None else None
            for store in stores:
                store.register(decl)
        for buf in graph.step_layer(node).buffers.values():
            buf.array = buf.tensor.array
