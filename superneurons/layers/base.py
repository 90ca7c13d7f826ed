"""The layer contract every layer module implements, and the registry that maps a prototxt `type` to a class.

A layer is told its bottom shapes once (`setup`), declares its top shapes, its learnable
parameters and any scratch buffers it keeps from forward to backward, and states which tensors
its backward reads (`backward_needs`). The runtime owns every array: it allocates them from the
memory pool and hands them to `forward`/`backward`, which only compute, through `self.ops`
(the backend's operations), never through NumPy or cuDNN directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from superneurons.errors import UserError
from superneurons.layers.fillers import filler_problem
from superneurons.proto import superneurons_pb2 as pb

Shape = tuple[int, ...]
FLOAT_BYTES = 4  # float32: what the cost model assumes every activation is

# What a layer's backward reads besides the top diffs. Liveness keeps exactly these alive.
NEEDS_BOTTOM = "bottom"
NEEDS_TOP = "top"

_REGISTRY: dict[str, type["Layer"]] = {}


def register(*type_names: str):
    """Class decorator: `@register("ReLU")` makes `type: "ReLU"` build this class."""

    def wrap(cls):
        for name in type_names:
            if name in _REGISTRY and _REGISTRY[name] is not cls:
                raise RuntimeError(f"layer type {name!r} registered twice")
            _REGISTRY[name] = cls
        cls.type_name = type_names[0]
        return cls

    return wrap


def known_types() -> list[str]:
    from superneurons import layers  # noqa: F401  (importing the package registers every layer)

    return sorted(_REGISTRY)


def layer_class(type_name: str, where: str = "") -> type["Layer"]:
    from superneurons import layers  # noqa: F401

    cls = _REGISTRY.get(type_name)
    if cls is None:
        prefix = f"{where}: " if where else ""
        raise UserError(f"{prefix}unknown layer type {type_name!r}; known types: {', '.join(known_types())}")
    return cls


@dataclass
class ParamDecl:
    """A learnable blob a layer declares in `setup`: shape and how to fill it."""

    shape: Shape
    filler: pb.FillerParameter
    # Filled by the runtime:
    data: Any = None
    diff: Any = None
    lr_mult: float = 1.0
    decay_mult: float = 1.0
    name: str = ""
    # False for statistics a layer updates itself (BatchNorm's running mean): the solver never touches them.
    learnable: bool = True
    # The decl whose tensors this one uses (shared parameters, a test net reading the train net's weights);
    # set by the runtime, None for the owner itself.
    owner: "ParamDecl | None" = None
    # Values the layer set in setup (a Python layer's blobs), used instead of the filler.
    initial: Any = None
    # True while `diff` holds the zeros the parameter store cleared it to (set on the root decl of shared
    # parameters): the first writer may then overwrite it instead of adding (`claim_cleared_diff`).
    diff_cleared: bool = False


def claim_cleared_diff(decl: ParamDecl) -> bool:
    """Whether `decl`'s gradient still holds the zeros it was cleared to; later writers (a layer sharing the
    weights, the next pass of iter_size) then add. A convolution overwriting a zero dw runs cuDNN's faster
    beta = 0 engines and gives the same values as adding into the zeros."""
    root = decl
    while root.owner is not None:
        root = root.owner
    cleared, root.diff_cleared = root.diff_cleared, False
    return cleared


@dataclass
class BufferDecl:
    """Scratch state a layer keeps between its forward and backward (e.g. a max-pooling argmax)."""

    shape: Shape
    dtype: Any = np.float32
    array: Any = None
    # True when backward reads it: liveness keeps it alive until this layer's backward.
    for_backward: bool = True
    # False for scratch of the backward step alone (with for_backward True): no forward step uses it, so it
    # lives only during that step.
    in_forward: bool = True


# The float32 copies of a float32 layer's half bottoms (`use_float32_copies`): the forward's, the backward's, and
# the backward's of the bottom's gradient.
FLOAT32_COPIES = ("forward", "backward", "diff")


def _float32_copy_name(j: int, kind: str) -> str:
    return f"bottom{j}_{kind}_float32"


# The buffers a layer's ops take their layout-converted copies from (`use_layout_copies`), per step.
_LAYOUT_COPIES = {"forward": "layout_copies", "backward": "layout_copies_bw"}


def _copy_name(k: int, backward: bool) -> str:
    """The buffer name of parameter k's half working copy for the forward or the backward step."""
    return f"param{k}_copy_bw" if backward else f"param{k}_copy"


class Layer:
    """Base class. Subclasses set `type_name` through `@register` and override what they need."""

    type_name: ClassVar[str] = ""
    # Layers with no bottoms that produce data (they run first and never backpropagate).
    is_data: ClassVar[bool] = False
    # Loss layers get loss_weight 1 on their first top unless the prototxt says otherwise.
    is_loss: ClassVar[bool] = False
    # Stores its tops and their gradients in float32 whatever the net's precision (graph/precision.py): outputs
    # that half precision would round too coarsely (probabilities, metrics, indices, normalized sums).
    float32_only: ClassVar[bool] = False
    # Bottom indexes that never receive a gradient (labels); they stay float32 in a half net (graph/precision.py).
    label_bottoms: ClassVar[tuple[int, ...]] = ()
    # Bottom indexes it does not read: they only place it in the route after their producer (the recurrent
    # layers' step transforms). They get no gradient, and keep the type their producer gives them.
    order_bottoms: ClassVar[tuple[int, ...]] = ()
    # Tops are views of bottom 0's data (Flatten, Reshape, Split) / its diff (Flatten, Reshape).
    shares_data: ClassVar[bool] = False
    shares_diff: ClassVar[bool] = False
    # The tops can own a copy of bottom 0's data instead of viewing it (Split): graph.build then sets
    # `copy_data` when an in-place consumer of one top would otherwise overwrite what its siblings read.
    can_copy_data: ClassVar[bool] = False
    # Layer computes nothing backward (Accuracy, Silence-like sinks).
    has_backward: ClassVar[bool] = True
    # Backward can add a bottom's gradient into what its memory already holds instead of overwriting it
    # (Convolution: cuDNN's beta = 1). memory/aliases.py then lets the consumers of a split blob write into
    # the one summed gradient; the runtime says which bottoms through backward's `accumulate` argument.
    can_accumulate_bottom_diff: ClassVar[bool] = False
    # Backward writes bottom 0's gradient as the plain sum of the top gradients (Split): memory/aliases.py
    # may then make the bottom gradient one top gradient's memory and add the others into it (the runtime
    # then passes the bottom gradient's array for those tops, as an in-place layer's are one array).
    sums_top_diffs: ClassVar[bool] = False
    # Parameters the layer's math reads as operands of its data's type (a convolution's and an inner product's
    # weights: cuDNN and cuBLAS take operands of one type). When the layer stores its data in a half type,
    # graph/precision.py gives it working copies (`use_working_copies`): one its forward rounds the float32
    # master into, one its backward does, each a buffer of that step alone, so the plan counts them and no copy
    # is held from forward to backward (a deep net's copies would add up to half its weights).
    data_typed_params: ClassVar[tuple[int, ...]] = ()
    # Of those, the ones whose gradient the math writes in the data's type too (cuDNN's filter gradient). It goes
    # into the backward's copy once the backward has read the copy, then is added into the float32 master
    # gradient: no third buffer.
    data_typed_grads: ClassVar[tuple[int, ...]] = ()
    # The backend ops this layer calls take its 4-D blobs, buffers and weight copies stored channels last (NHWC)
    # as they take NCHW ones (graph/layout.py keeps a blob NHWC only where its producer and readers all do; an op
    # given arguments it has no such path for converts them on the device).
    channels_last: ClassVar[bool] = False
    # Given the same arrays, forward and backward queue the same device work with the same arguments on every
    # pass (or `prepare_replay` puts what changes on the device), so a CUDA graph recorded once can replay them
    # (runtime/graph_replay.py). Not so for a layer that runs the user's host code (Python).
    replayable: ClassVar[bool] = True
    # Top counts allowed: (min, max); None means unbounded.
    n_bottoms: ClassVar[tuple[int, int | None]] = (1, 1)
    n_tops: ClassVar[tuple[int, int | None]] = (1, 1)

    def __init__(self, param: pb.LayerParameter, phase: int):
        self.param = param
        self.name = param.name
        self.phase = phase  # pb.TRAIN or pb.TEST
        self.params: list[ParamDecl] = []
        self.buffers: dict[str, BufferDecl] = {}
        self.ops: Any = None  # set by the runtime: the backend's operation namespace
        self.in_place = len(param.top) > 0 and len(param.bottom) > 0 and param.top[0] == param.bottom[0]
        self.ctx: Any = None  # set by the runtime: RunContext (iteration, seed, recomputing flag)
        self.layer_index = 0  # position in the prototxt; part of Dropout's mask hash
        # Set by graph.build on the layers a layer that `unrolls` became: `part_of` on every part but the one that
        # keeps the prototxt's name, the name of the prototxt's layer they compute (caffemodels and pycaffe's layer
        # lists leave them out); `prototxt_param` on that one, the prototxt's own LayerParameter (what a caffemodel
        # saves).
        self.part_of: str | None = None
        self.prototxt_param = param
        # Set by graph.build on a layer that `can_copy_data`: its tops hold copies, not views, of bottom 0.
        self.copy_data = False

    # ---- declared by subclasses -------------------------------------------------------------
    def setup(self, bottom_shapes: Sequence[Shape]) -> list[Shape]:
        """Check bottoms, declare params and buffers, return the top shapes."""
        raise NotImplementedError

    def scratch_entries(self) -> int:
        """The float64 entries this layer's ops sum into at once, in forward or backward (backend/scratch.py, one
        function per kind of sum, from the layer's shapes). The Net plans one scratch region of the largest need
        of its layers (memory/tensors.py: `#scratch`) and the layers pass it to those ops (`scratch=`, from
        `self.ctx.scratch`). Default: none."""
        return 0

    def backward_needs(self) -> frozenset[str]:
        """Which of NEEDS_BOTTOM / NEEDS_TOP the backward reads. Default: both (always safe)."""
        return frozenset({NEEDS_BOTTOM, NEEDS_TOP})

    def identity_diff_bottoms(self) -> tuple[int, ...]:
        """Bottoms whose gradient backward may write straight into top 0's gradient memory, because it is
        that gradient (Eltwise SUM with coefficient 1): memory/aliases.py may then share the memory, and the
        runtime passes such a bottom the top gradient's array itself."""
        return ()

    def diff_in_place_bottoms(self) -> tuple[int, ...]:
        """Bottoms whose gradient backward may compute over top 0's gradient, reading each element of it
        before writing that element (the fused BatchNorm out of place): memory/aliases.py may then share
        the memory, as an in-place layer's gradients do (the runtime passes the one array for both)."""
        return ()

    # The layer runs as several layers of other types (a recurrent layer unrolled over its time steps): graph.build
    # sets it up once to learn its shapes, then puts the parts `unroll()` returns in its place.
    unrolls: ClassVar[bool] = False

    def unroll(self, per_step: bool = False) -> list[tuple[pb.LayerParameter, "type[Layer] | None"]]:
        """The layers to run instead of this one (after `setup`), in order, each with the class that builds it
        (None: its registered type); one keeps this layer's name and owns its weights, and the others read them
        from it by parameter name. `per_step`: every time step computes its own share of the work the layer
        could do at once for all of them (graph.build says when: layers/recurrent.py)."""
        raise NotImplementedError

    @property
    def views_bottom_data(self) -> bool:
        """Whether the tops are views of bottom 0's data: the step then computes and copies nothing."""
        return self.shares_data and not self.copy_data

    @property
    def algo_name(self) -> str:
        """The backend's algorithm for this layer's shapes (what `superneurons time` shows); "" for none."""
        return ""

    def forward_flops(self) -> int:
        """Floating-point operations of one forward pass (a multiply-add counts 2), for `auto`'s time model
        (memory/cost.py). Layers whose time is arithmetic (convolutions, matrix products) override this;
        the default 0 leaves the step's cost to its memory traffic (`forward_bytes`)."""
        return 0

    def forward_bytes(self, bottom_shapes: Sequence[Shape], top_shapes: Sequence[Shape]) -> int:
        """Bytes one forward pass moves through device memory, for `auto`'s time model: every bottom read and
        every top written once, in float32; nothing for a view."""
        if self.views_bottom_data:
            return 0
        return FLOAT_BYTES * (sum(count(s) for s in bottom_shapes) + sum(count(s) for s in top_shapes))

    def forward(self, bottom: list, top: list) -> None:
        raise NotImplementedError

    def backward(self, top: list, top_diff: list, propagate_down: list[bool], bottom: list, bottom_diff: list) -> None:
        """Write bottom diffs (overwrite) and accumulate into param diffs (+=), as Caffe does. A layer that
        `can_accumulate_bottom_diff` also takes `accumulate`, the bottom indexes whose diff to add into."""
        raise NotImplementedError

    def prepare_replay(self) -> None:
        """Before each replay of a CUDA graph that holds this layer's steps (runtime/graph_replay.py): queue on the
        device what this pass's host-side values are (Dropout: its pass's key), since the graph repeats the
        recording pass's kernel arguments. Most layers have nothing to do."""

    # ---- helpers for subclasses ---------------------------------------------------------------
    def add_param(self, shape: Shape, filler: pb.FillerParameter | None, learnable: bool = True) -> ParamDecl:
        problem = filler_problem(filler, tuple(shape)) if filler is not None else None
        if problem:
            raise self.fail(f"parameter {len(self.params)}: {problem}")
        decl = ParamDecl(tuple(int(d) for d in shape), filler if filler is not None else pb.FillerParameter(),
                         learnable=learnable)
        self.params.append(decl)
        return decl

    def add_buffer(self, name: str, shape: Shape, dtype=np.float32, for_backward: bool = True,
                   in_forward: bool = True) -> BufferDecl:
        decl = BufferDecl(tuple(int(d) for d in shape), dtype, for_backward=for_backward, in_forward=in_forward)
        self.buffers[name] = decl
        return decl

    # ---- half-precision working copies of the parameters (data_typed_params) ------------------------
    def use_working_copies(self, data_type) -> None:
        """Declare the working copies of `data_typed_params` in the layer's storage type: the forward's, and the
        backward's where the layer trains."""
        for k in self.data_typed_params:
            if k < len(self.params):
                self.add_buffer(_copy_name(k, False), self.params[k].shape, data_type, for_backward=False)
                if self.phase == pb.TRAIN:
                    self.add_buffer(_copy_name(k, True), self.params[k].shape, data_type, in_forward=False)

    # ---- float32 copies of half bottoms (float32_only layers and losses in a half net) ----------------------
    def use_float32_copies(self, bottoms, diffs) -> None:
        """Declare float32 copies of the half bottoms (`bottoms`: (index, shape)) and bottom gradients (`diffs`)
        of a layer that computes on float32 (`float32_only`, the losses): its ops take operands of one type, so
        the runtime casts the half arrays into these planned buffers and hands the layer the copies (and rounds a
        gradient copy back into its half array), instead of the backend making copies outside the pool. Each
        buffer is of its step alone: the forward's bottoms, the backward's bottoms where it reads them, and the
        backward's gradients."""
        for j, shape in bottoms:
            self.add_buffer(_float32_copy_name(j, "forward"), shape, np.float32, for_backward=False)
            if self.phase == pb.TRAIN and self.has_backward and self.backward_reads_bottom(j):
                self.add_buffer(_float32_copy_name(j, "backward"), shape, np.float32, in_forward=False)
        if self.phase == pb.TRAIN and self.has_backward:
            for j, shape in diffs:
                self.add_buffer(_float32_copy_name(j, "diff"), shape, np.float32, in_forward=False)

    # ---- room for the layout conversions of a layer whose blobs mix NCHW and NHWC (graph/layout.py) -------------
    def use_layout_copies(self, forward_bytes: int, backward_bytes: int) -> None:
        """Declare the bytes this layer's ops convert at once in its forward and its backward step (its NCHW 4-D
        blobs, and their gradients, beside NHWC ones: the first convolution reading the data layer's batch, the
        pooling writing the blob an InnerProduct flattens). Each is a buffer of that step alone, which the Net hands
        the ops as the room their copies come from (backend/cuda/copy_room.py), so the plan counts them."""
        if forward_bytes:
            self.add_buffer(_LAYOUT_COPIES["forward"], (int(forward_bytes),), np.uint8, for_backward=False)
        if backward_bytes and self.phase == pb.TRAIN and self.has_backward:
            self.add_buffer(_LAYOUT_COPIES["backward"], (int(backward_bytes),), np.uint8, in_forward=False)

    def layout_copies(self, kind: str) -> BufferDecl | None:
        """The room of step `kind` ("forward", "backward") for layout-converted copies, if declared."""
        return self.buffers.get(_LAYOUT_COPIES[kind])

    def backward_reads_bottom(self, j: int) -> bool:
        """Whether backward reads bottom j's values (a finer `backward_needs`, for the float32 copies)."""
        return NEEDS_BOTTOM in self.backward_needs()

    def float32_copies(self, kind: str) -> list[tuple[int, BufferDecl]]:
        """(bottom index, buffer) of the float32 copies of `kind` (FLOAT32_COPIES) the layer declared."""
        return [(j, buf) for j in range(len(self.param.bottom))
                if (buf := self.buffers.get(_float32_copy_name(j, kind))) is not None]

    def _copy(self, k: int, backward: bool) -> BufferDecl | None:
        return self.buffers.get(_copy_name(k, backward))

    def refresh_working_copies(self, backward: bool = False) -> None:
        """Round each master into this step's working copy (forward and backward each call it first)."""
        for k in self.data_typed_params:
            buf = self._copy(k, backward)
            if buf is not None:
                self.ops.copy(self.params[k].data, buf.array)

    def param_operand(self, k: int, backward: bool = False) -> Any:
        """Parameter k as this step's math reads it: its working copy where it has one, else the master."""
        buf = self._copy(k, backward)
        return self.params[k].data if buf is None else buf.array

    def gradient_in_copy(self, k: int) -> bool:
        """Whether parameter k's gradient is written into the backward's copy (read everything else of it first)."""
        return k in self.data_typed_grads and self._copy(k, True) is not None and self.params[k].diff is not None

    def param_gradient(self, k: int) -> tuple[Any, bool]:
        """(array, overwrite): where the math writes parameter k's gradient and whether it may overwrite it: the
        master gradient (overwritten while it still holds the zeros it was cleared to), or the backward's copy
        (`gradient_in_copy`; overwritten, then added into the master by `add_param_gradient`). (None, False): the
        parameter takes no gradient."""
        decl = self.params[k]
        if decl.diff is None:
            return None, False
        copy = self._copy(k, True)
        if copy is not None and self.gradient_in_copy(k):
            return copy.array, True
        return decl.diff, claim_cleared_diff(decl)

    def add_param_gradient(self, k: int) -> None:
        """Add the half gradient left in parameter k's backward copy into its float32 master gradient."""
        copy = self._copy(k, True)
        if copy is None or not self.gradient_in_copy(k):
            return
        decl = self.params[k]
        if claim_cleared_diff(decl):
            self.ops.copy(copy.array, decl.diff)
        else:
            self.ops.axpy(1.0, copy.array, decl.diff)

    def fail(self, msg: str) -> UserError:
        """An error naming this layer; `raise self.fail(...)`."""
        return UserError(f"layer {self.name!r} ({self.type_name}): {msg}")

    def require_axes(self, shape: Sequence[int], at_least: int, what: str = "bottom") -> None:
        """A clean error when `shape` has fewer axes than this layer indexes (a Reduction's 0-D top read
        where an N x ... blob is expected)."""
        if len(shape) < at_least:
            raise self.fail(f"its {what} must have at least {at_least} axis/axes, got a {len(shape)}-D blob "
                            f"({' '.join(str(int(d)) for d in shape) or 'a scalar'})")

    def check_counts(self, n_bottom: int, n_top: int) -> None:
        for what, n, (lo, hi) in (("bottom", n_bottom, self.n_bottoms), ("top", n_top, self.n_tops)):
            if n < lo or (hi is not None and n > hi):
                want = f"{lo}" if lo == hi else f"{lo}..{hi if hi is not None else 'n'}"
                raise self.fail(f"takes {want} {what} blob(s), got {n}")

    def __repr__(self) -> str:
        return f"<{self.type_name} {self.name!r}>"


def canonical_axis(axis: int, ndim: int, layer: Layer) -> int:
    if not -ndim <= axis < ndim:
        raise layer.fail(f"axis {axis} out of range for a {ndim}-D blob")
    return axis % ndim


def count(shape: Sequence[int], start: int = 0, end: int | None = None) -> int:
    n = 1
    for d in shape[start:end]:
        n *= int(d)
    return n
