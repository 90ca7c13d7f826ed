"""Which element type each blob's values and gradients are stored in: NVCaffe's per-layer types, resolved once.

A layer's `forward_type` is the storage type of its tops, its `backward_type` that of its tops' gradients
(NetParameter's `default_forward_type` / `default_backward_type` where the layer sets none); `forward_math`
and `backward_math` name what its kernels accumulate in. Storage in FLOAT16 or BFLOAT16 halves an activation
or gradient; the math stays float32 (on the CPU every op computes in float32 on half storage, see
backend/cpu/__init__.py; a math type of FLOAT16 is computed in float32 as well).

Some layers keep float32 whatever the types say, as PyTorch's autocast keeps its list (`Layer.float32_only`):
softmax, every loss, Reduction, Accuracy and ArgMax (their outputs are probabilities, losses, metrics and
indices that half precision would round); where such a layer reads half bottoms, it gets float32 copies of
them (and of their gradients) as planned buffers, which the runtime casts into (`Layer.use_float32_copies`).
LRN and MVN compute in float32 and store their tops in the layer's type, since a half convolution usually reads
them next. BatchNorm's running statistics are parameters, and
parameters (the master weights), their gradients and the solver's history are stored in the solver's
`solver_data_type` (float32 by default). A data layer writes its first top (the batch) in the net's forward
type and its other tops (labels) in float32: bfloat16 holds integers exactly only up to 256. For the same
reason every blob a layer reads as labels or indices (`Layer.label_bottoms`: losses' labels, Embed's indices)
is float32.

`override_defaults(net, "bf16")` is what `--precision` and the Python API's `precision=` do: set the net's
defaults, leaving the layers that name their own types alone; "fp16" also turns adaptive loss scaling on
where the net sets neither `global_grad_scale` nor `global_grad_scale_adaptive`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from superneurons.dtypes import BFLOAT16, FLOAT16, FLOAT32, PRECISIONS, dtype_name
from superneurons.errors import UserError
from superneurons.io.prototxt_lines import layer_line
from superneurons.proto import superneurons_pb2 as pb

STORAGE_TYPES: dict[int, np.dtype] = {pb.FLOAT: FLOAT32, pb.FLOAT16: FLOAT16, pb.BFLOAT16: BFLOAT16}
MATH_TYPES = (pb.DOUBLE, pb.FLOAT, pb.FLOAT16, pb.BFLOAT16)
PRECISION_TYPES = {"fp32": pb.FLOAT, "fp16": pb.FLOAT16, "bf16": pb.BFLOAT16}
HALF_MAX = {FLOAT16: float(np.finfo(np.float16).max)}  # bfloat16 spans float32's range


@dataclass(frozen=True)
class LayerPrecision:
    forward: np.dtype  # storage of the layer's tops
    backward: np.dtype  # storage of its tops' gradients
    forward_math: int  # pb.Type
    backward_math: int


@dataclass
class Precision:
    """The net's storage types: per layer, per blob (values and gradients), and its loss scaling."""

    layers: dict[str, LayerPrecision] = field(default_factory=dict)
    data: dict[str, np.dtype] = field(default_factory=dict)  # blob -> storage of its values
    diff: dict[str, np.dtype] = field(default_factory=dict)  # blob -> storage of its gradient
    grad_scale: float = 1.0  # global_grad_scale
    adaptive: bool = False  # global_grad_scale_adaptive
    # Storage of the master weights, their gradients and the solver's history: SolverParameter's
    # solver_data_type, which the solver sets before it builds the Net (float32 elsewhere).
    master: np.dtype = FLOAT32

    @property
    def half(self) -> bool:
        """Whether any blob is stored in a half type."""
        return any(d != FLOAT32 for d in (*self.data.values(), *self.diff.values()))

    @property
    def float16(self) -> bool:
        return any(d == FLOAT16 for d in (*self.data.values(), *self.diff.values()))

    def name(self) -> str:
        """What `superneurons memory` reports: the type most blobs are stored in."""
        kinds = list(self.data.values())
        if not kinds:
            return "float32"
        return dtype_name(max(set(kinds), key=kinds.count))


def override_defaults(net: pb.NetParameter, precision: str | None) -> pb.NetParameter:
    """Set `net`'s default forward and backward types to `precision` ("fp32", "fp16", "bf16"; None: leave)."""
    if precision is None:
        return net
    if precision not in PRECISION_TYPES:
        raise UserError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    net.default_forward_type = net.default_backward_type = PRECISION_TYPES[precision]
    if precision == "fp16" and not net.HasField("global_grad_scale") and not net.HasField("global_grad_scale_adaptive"):
        net.global_grad_scale_adaptive = True  # float16 gradients underflow unscaled: AMP's default, unless the net says
    return net


def _where(source: str, layer: str) -> str:
    line = layer_line(source, layer) if source else None
    return f"{source or '<net>'}{f':{line}' if line else ''}: layer {layer!r}"


def _storage(value: int, what: str, where: str) -> np.dtype:
    if value not in STORAGE_TYPES:
        raise UserError(f"{where}: {what}: {pb.Type.Name(value)} cannot store a layer's blobs; use FLOAT, "
                        f"FLOAT16 or BFLOAT16")
    return STORAGE_TYPES[value]


def _math(value: int, what: str, where: str) -> int:
    if value not in MATH_TYPES:
        raise UserError(f"{where}: {what}: {pb.Type.Name(value)} is no math type; use FLOAT, FLOAT16, BFLOAT16 "
                        f"or DOUBLE")
    return value


def layer_precision(net: pb.NetParameter, lp: pb.LayerParameter, where: str) -> LayerPrecision:
    def pick(name: str) -> int:
        return getattr(lp, name) if lp.HasField(name) else getattr(net, f"default_{name}")

    return LayerPrecision(_storage(pick("forward_type"), "forward_type", where),
                          _storage(pick("backward_type"), "backward_type", where),
                          _math(pick("forward_math"), "forward_math", where),
                          _math(pick("backward_math"), "backward_math", where))


def _check_fillers(layer, types: LayerPrecision, where: str) -> None:
    """A weight or DummyData filler whose values overflow the layer's half type fails at setup, not as Inf later."""
    limit = HALF_MAX.get(types.forward)
    if limit is None:
        return
    fillers = [(f"param {k}", decl.filler) for k, decl in enumerate(layer.params)]
    if layer.param.HasField("dummy_data_param"):
        fillers += [(f"data_filler {k}", f) for k, f in enumerate(layer.param.dummy_data_param.data_filler)]
    for what, f in fillers:
        big = max(abs(f.value) if f.type == "constant" else 0.0,
                  max(abs(f.min), abs(f.max)) if f.type == "uniform" else 0.0)
        if big > limit:
            raise UserError(f"{where}: {what}'s {f.type} filler reaches {big:g}, beyond {dtype_name(types.forward)}'s "
                            f"largest value {limit:g}; set the layer's forward_type: FLOAT or change the filler")


def resolve(net: pb.NetParameter, nodes, source: str) -> Precision:
    """The storage type of every blob of `nodes` (built layers, in route order), checked."""
    if net.global_grad_scale <= 0:
        raise UserError(f"{source or '<net>'}: global_grad_scale is {net.global_grad_scale:g}; it must be above 0")
    out = Precision(grad_scale=float(net.global_grad_scale), adaptive=bool(net.global_grad_scale_adaptive))
    # Labels, indices and sequence markers (a consumer's `label_bottoms`) stay float32 whoever produces them, and
    # so do the blobs they are views of: bfloat16 would round class 257 to 256.
    labels = {n.bottoms[j] for n in nodes for j in n.layer.label_bottoms if j < len(n.bottoms)}
    for n in reversed(nodes):
        if n.layer.views_bottom_data and n.bottoms and labels.intersection(n.tops):
            labels.add(n.bottoms[0])
    shapes: dict[str, tuple] = {}
    for n in nodes:
        layer = n.layer
        where = _where(source, n.name)
        types = layer_precision(net, layer.param, where)
        if layer.float32_only or layer.is_loss:
            types = LayerPrecision(FLOAT32, FLOAT32, types.forward_math, types.backward_math)
            if not layer.in_place:  # its half bottoms reach its ops as float32 copies the plan holds
                layer.use_float32_copies(
                    [(j, shapes[b]) for j, b in enumerate(n.bottoms) if out.data.get(b, FLOAT32) != FLOAT32],
                    [(j, shapes[b]) for j, b in enumerate(n.bottoms) if out.diff.get(b, FLOAT32) != FLOAT32
                     and j not in layer.label_bottoms])
        shapes.update(zip(n.tops, (tuple(s) for s in n.top_shapes)))
        out.layers[n.name] = types
        _check_fillers(layer, types, where)
        if types.forward != FLOAT32 and layer.data_typed_params:
            layer.use_working_copies(types.forward)
        for j, t in enumerate(n.tops):
            if t in out.data:
                continue  # in place: the bottom's tensor
            if layer.views_bottom_data and n.bottoms:
                out.data[t] = out.data[n.bottoms[0]]
                out.diff[t] = out.diff[n.bottoms[0]]
                continue
            label = t in labels or (layer.is_data and j > 0)
            out.data[t] = FLOAT32 if label else types.forward
            out.diff[t] = FLOAT32 if label else types.backward
    return out


def stored_types(graph) -> frozenset:
    """Every element type `graph`'s tensors are stored in: its blobs' values and gradients, and its masters."""
    return frozenset({*graph.precision.data.values(), *graph.precision.diff.values(), graph.precision.master})


def check_backend(graph, backend) -> None:
    """Refuse, in one line, a net storing a type the backend cannot compute on."""
    stored = stored_types(graph)
    missing = sorted(dtype_name(d) for d in stored if d not in backend.storage_types)
    if missing:
        raise UserError(f"{graph.source or graph.name or '<net>'}: the {backend.name} backend stores tensors in "
                        f"{', '.join(dtype_name(d) for d in backend.storage_types)} only, and this net asks for "
                        f"{', '.join(missing)}; run it with --precision fp32 (or precision='fp32'), or on the CPU")
