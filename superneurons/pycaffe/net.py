"""pycaffe's `Net`: a net from a prototxt whose blobs and parameters are NumPy arrays you read and write.

`net.blobs[name].data` and `.diff`, and `net.params[layer][i].data`/`.diff`, are the arrays the net
computes with on the CPU backend (views into its memory pool: writes go straight into the net). On the
GPU they are host copies, refreshed after every forward/backward/solver step and copied back to the
device before the next one, so the same code works on both (write into them between calls; an array
kept across a `reshape` is stale, as in Caffe).

Layer ranges (`forward(start=, end=)`) are in Caffe's layer order, the prototxt's with split layers
inserted (`_layer_names`); the layers of a range run in the route's order.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from superneurons.errors import UserError, UserTypeError
from superneurons.memory.interface import StepHooks
from superneurons.proto import superneurons_pb2 as pb
from superneurons.pycaffe import mode

TRAIN = pb.TRAIN
TEST = pb.TEST

# Tests set this to exercise on the CPU the host copies the GPU uses.
FORCE_HOST_COPIES = False


class HostArrays:
    """The NumPy arrays handed to Python for a net's backend arrays: the arrays themselves where they are
    host arrays, else host copies that `pull` refreshes from the device and `push` writes back. A copy is
    written back only when it differs from what was last pulled: a net and the nets sharing its weights
    (a solver's test nets) may all hold copies of one parameter, and an unchanged one must not undo an edit
    made through another."""

    def __init__(self, backend: Any):
        self.backend = backend
        # key -> (the array handed out, the values last pulled into it, how to find the backend array)
        self.copies: dict[tuple, tuple[np.ndarray, np.ndarray, Callable[[], Any]]] = {}
        self.placeholders: dict[tuple, np.ndarray] = {}

    def get(self, key: tuple, array_of: Callable[[], Any], shape: Sequence[int]) -> np.ndarray:
        array = array_of()
        if array is None:  # a blob without a gradient: zeros, as Caffe's unused diffs are
            held = self.placeholders.get(key)
            if held is None or held.shape != tuple(shape):
                held = self.placeholders[key] = np.zeros(tuple(shape), dtype=np.float32)
            return held
        if isinstance(array, np.ndarray) and not FORCE_HOST_COPIES:
            return array
        held = self.copies.get(key)
        if held is None or held[0].shape != tuple(shape):
            host = np.ascontiguousarray(self.backend.to_host(array)).reshape(tuple(shape))
            self.copies[key] = (host, host.copy(), array_of)
            return host
        return held[0]

    def push(self) -> None:
        """Write the host copies the user changed into the backend arrays."""
        for host, pulled, array_of in self.copies.values():
            array = array_of()
            if array is not None and not np.array_equal(host, pulled):
                self.backend.from_host(array, host)
                pulled[...] = host

    def pull(self) -> None:
        """Refresh the host copies from the backend arrays (after the net has run)."""
        for key, (host, pulled, array_of) in list(self.copies.items()):
            array = array_of()
            if array is not None and array.size != host.size:  # a Filter kept another count: copied anew on use
                del self.copies[key]
            elif array is not None:
                host[...] = np.asarray(self.backend.to_host(array)).reshape(host.shape)
                pulled[...] = host


class Blob:
    """One blob (or one learnable parameter): `.data`, `.diff`, `.shape`, `.count`, `.reshape(...)`."""

    def __init__(self, net: "Net", key: tuple, shape_of: Callable[[], tuple[int, ...]],
                 data_of: Callable[[], Any], diff_of: Callable[[], Any], reshape: Callable[[tuple], None] | None):
        self._net, self._key = net, key
        self._shape_of, self._data_of, self._diff_of, self._reshape = shape_of, data_of, diff_of, reshape

    @property
    def data(self) -> np.ndarray:
        staged = self._net._pending.get(self._key[-1]) if self._key[0] == "blob" else None
        if staged is not None:
            return staged
        return self._net._host.get(self._key + ("data",), self._data_of, self.shape)

    @property
    def diff(self) -> np.ndarray:
        return self._net._host.get(self._key + ("diff",), self._diff_of, self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        staged = self._net._pending.get(self._key[-1]) if self._key[0] == "blob" else None
        return staged.shape if staged is not None else tuple(self._shape_of())

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def _legacy(self, axis: int) -> int:
        shape = self.shape
        return shape[axis] if axis < len(shape) else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def reshape(self, *shape: int | Sequence[int]) -> None:
        """Give an input blob a new shape (its data then reads as zeros until written); the net is set up for
        it, weights kept, at the next `net.reshape()`, forward or backward, as in Caffe."""
        dims = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
        dims = tuple(int(d) for d in dims)
        if self._reshape is None:
            raise UserError(f"blob {self._key[-1]!r} cannot be reshaped: only a net's input blobs (Input layer "
                            "tops) take a new shape; the others follow from them")
        self._reshape(dims)

    def __repr__(self) -> str:
        return f"<Blob {self._key[-1]!r} {self.shape}>"


class LayerCallbacks(StepHooks):
    """Calls `fn(layer index)` at one point (`when`: before_forward, after_backward, ...) of every layer's step."""

    def __init__(self, when: str, fn: Callable[[int], Any]):
        self.when, self.fn = when, fn

    def _call(self, when: str, step: Any) -> None:
        if when == self.when:
            self.fn(step.node.layer.layer_index)

    def before_forward(self, i: int, step: Any) -> None:
        self._call("before_forward", step)

    def after_forward(self, i: int, step: Any) -> None:
        self._call("after_forward", step)

    def before_backward(self, i: int, step: Any) -> None:
        self._call("before_backward", step)

    def after_backward(self, i: int, step: Any) -> None:
        self._call("after_backward", step)


class Layer:
    """A layer as pycaffe shows it: `.type`, `.name`, `.blobs` (its parameters). A Python layer's other
    attributes are those of the user's object (pycaffe hands out the object itself)."""

    def __init__(self, name: str, type_name: str, blobs: list[Blob], python: Any = None):
        self.name, self.type, self.blobs = name, type_name, blobs
        self._python = python

    def __getattr__(self, name: str) -> Any:
        python = self.__dict__.get("_python")
        if python is None or name.startswith("__"):
            raise AttributeError(f"layer {self.__dict__.get('name')!r} has no attribute {name!r}")
        return getattr(python, name)

    def __repr__(self) -> str:
        return f"<Layer {self.name!r} ({self.type})>"


class Net:
    """`Net(model, phase)`, `Net(model, weights, phase)` or `Net(model, phase, weights=...)`, as pycaffe;
    `level`/`stages` pick the NetState rules. Ours: `memory` (`baseline` default, so every blob stays
    readable; `liveness`, `offload`, `recompute` or `auto`), `gpu_memory` (the pool's size, e.g. '12G'),
    `precision` ("fp32", "fp16", "bf16": the storage of activations and gradients, over the net's defaults)."""

    def __init__(self, network_file: str, *args: Any, phase: int | None = None, weights: str | None = None,
                 level: int = 0, stages: Iterable[str] | None = None, memory: str = "baseline",
                 gpu_memory: str | int | None = None, precision: str | None = None):
        from superneurons.memory.pool import parse_size
        from superneurons.graph.precision import override_defaults
        from superneurons.io.prototxt import read_net

        if len(args) == 1:
            phase = args[0]
        elif len(args) == 2:
            weights, phase = args
        elif len(args) > 2:
            raise TypeError("Net(model, phase), Net(model, weights, phase) or Net(model, phase, weights=...)")
        if phase not in (TRAIN, TEST):
            raise UserTypeError(f"Net({network_file!r}, ...): phase must be caffe.TRAIN or caffe.TEST, got {phase!r}")
        self._file = str(network_file)
        self._net_param = override_defaults(read_net(self._file), precision)  # "fp32", "fp16", "bf16"
        self._phase, self._level, self._stages = int(phase), int(level), tuple(stages or ())
        self._memory = memory
        self._pool_bytes = gpu_memory if isinstance(gpu_memory, int) else parse_size(gpu_memory)
        self._backend = mode.current_backend()
        self._standalone = True
        self._passes = 0
        self._pending: dict[str, np.ndarray] = {}
        self._shares: Any = None
        self._attach(self._build_runtime())
        if weights:
            self.copy_from(weights)

    @classmethod
    def _wrap(cls, runtime: Any, backend: Any) -> "Net":
        """The Python view of a Net someone else runs (a solver's train and test nets)."""
        self = cls.__new__(cls)
        self._file, self._net_param, self._backend, self._standalone = runtime.graph.source, None, backend, False
        self._phase, self._passes, self._pending = runtime.graph.phase, 0, {}
        _zero_blobs(runtime)
        self._attach(runtime)
        return self

    # -- building ------------------------------------------------------------------------------
    def _build_runtime(self, share: Any = None) -> Any:
        from superneurons.graph.build import build_graph
        from superneurons.runtime.net import Net as RuntimeNet

        graph = build_graph(self._net_param, self._phase, self._level, self._stages, source=self._file)
        # A TEST net keeps gradients only under force_backward (saliency maps, deep dream), as in Caffe.
        keeps_gradients = self._phase == TRAIN or bool(self._net_param.force_backward)
        # eager: forward and backward are called apart here, so passes never replay as CUDA graphs
        runtime = RuntimeNet(graph, self._backend, train=keeps_gradients, seed=mode.random_seed(),
                             memory=self._memory, pool_bytes=self._pool_bytes, share_params_with=share, eager=True)
        _zero_blobs(runtime)
        return runtime

    def _attach(self, runtime: Any) -> None:
        self._net = runtime
        self._callbacks: list[LayerCallbacks] = getattr(self, "_callbacks", [])
        for hooks in self._callbacks:  # a net set up again (reshape, share_with) keeps them
            runtime.add_hooks(hooks)
        self._host = HostArrays(runtime.backend)
        nodes = list(runtime.layers_in_prototxt_order())
        self._layer_names = [n.name for n in nodes]
        self._nodes = {n.name: n for n in nodes}
        # Blobs by the prototxt's names: one the runtime split off for a fused BatchNorm (graph/fuse.py) is
        # shown as the blob it came from, which holds the value Caffe's in-place blob ends with.
        public = runtime.graph.internal_blobs
        names = lambda blobs: [public.get(b, b) for b in blobs]  # noqa: E731
        self.blobs: OrderedDict[str, Blob] = OrderedDict()
        for n in nodes:
            for top in names(n.tops):
                if top not in self.blobs:
                    self.blobs[top] = self._blob(top)
        self.layer_dict: OrderedDict[str, Layer] = OrderedDict(
            (n.name, Layer(n.name, n.layer.type_name,
                           [self._param_blob(n.name, k) for k in range(len(n.layer.params))],
                           getattr(n.layer, "user", None)))
            for n in nodes)
        self.layers = list(self.layer_dict.values())
        self.params: OrderedDict[str, list[Blob]] = OrderedDict(
            (name, layer.blobs) for name, layer in self.layer_dict.items() if layer.blobs)
        self.top_names = OrderedDict((n.name, names(n.tops)) for n in nodes)
        self.bottom_names = OrderedDict((n.name, names(n.bottoms)) for n in nodes)
        self.inputs = [t for n in nodes if n.layer.type_name == "Input" for t in n.tops]
        self.outputs = list(runtime.graph.outputs)
        self.blob_loss_weights = OrderedDict((b, 0.0) for b in self.blobs)
        self.blob_loss_weights.update(runtime.graph.loss_blobs)

    def _blob(self, name: str) -> Blob:
        reshape = (lambda dims: self._reshape_input(name, dims)) if self._standalone else None
        return Blob(self, ("blob", name), lambda: _blob_shape(self._net, name),
                    lambda: self._resident(name), lambda: _blob_array(self._net, name, diff=True), reshape)

    def _param_blob(self, layer: str, k: int) -> Blob:
        decl_of = lambda: self._net.layer(layer).params[k]  # noqa: E731  (re-read: a reshape rebuilds the net)
        return Blob(self, ("param", layer, k), lambda: decl_of().shape, lambda: decl_of().data,
                    lambda: decl_of().diff, None)

    def _resident(self, name: str) -> Any:
        array = _blob_array(self._net, name)
        if array is None:
            raise UserError(f"blob {name!r} is not in memory: the net runs under memory mode "
                            f"{self._net.memory.name!r}, which frees it after its last use; build the Net with "
                            "memory='baseline' to read every blob")
        return array

    @property
    def _blob_names(self) -> list[str]:
        return list(self.blobs)

    # pycaffe's lower-level names, which scripts use: blobs and layers by index, ranges by index
    @property
    def _blobs(self) -> list[Blob]:
        return list(self.blobs.values())

    @property
    def _blob_loss_weights(self) -> list[float]:
        return list(self.blob_loss_weights.values())

    @property
    def _inputs(self) -> list[int]:
        return [self._blob_names.index(b) for b in self.inputs]

    @property
    def _outputs(self) -> list[int]:
        return [self._blob_names.index(b) for b in self.outputs]

    def _bottom_ids(self, i: int) -> list[int]:
        names = self._blob_names
        return [names.index(b) for b in self.bottom_names[self._layer_names[i]]]

    def _top_ids(self, i: int) -> list[int]:
        names = self._blob_names
        return [names.index(b) for b in self.top_names[self._layer_names[i]]]

    def _forward(self, start: int, end: int) -> float:
        """Caffe's ForwardFromTo: layers start..end by index; returns the weighted loss."""
        self.forward(start=self._layer_names[start], end=self._layer_names[end])
        return float(self._net.loss_value())

    def _backward(self, start: int, end: int) -> None:
        """Caffe's BackwardFromTo: layers start down to end by index."""
        self.backward(start=self._layer_names[start], end=self._layer_names[end])

    def _set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        self.set_input_arrays(data, labels)

    # pycaffe's per-layer callbacks: fn(layer index) around each layer's forward or backward
    def before_forward(self, fn: Callable[[int], Any]) -> None:
        self._add_callback("before_forward", fn)

    def after_forward(self, fn: Callable[[int], Any]) -> None:
        self._add_callback("after_forward", fn)

    def before_backward(self, fn: Callable[[int], Any]) -> None:
        self._add_callback("before_backward", fn)

    def after_backward(self, fn: Callable[[int], Any]) -> None:
        """`fn(layer index)` after each layer's backward; an NCCL object reduces each layer's gradients as
        soon as its backward is done (Caffe's layer-wise reduce)."""
        self._add_callback("after_backward", fn)

    def _add_callback(self, when: str, fn: Callable[[int], Any]) -> None:
        hooks = LayerCallbacks(when, fn)
        self._callbacks.append(hooks)
        self._net.add_hooks(hooks)

    @property
    def runtime(self) -> Any:
        """The superneurons.runtime Net underneath (memory manager, pool, graph)."""
        return self._net

    # -- running -------------------------------------------------------------------------------
    def _position(self, layer: str, what: str) -> int:
        if layer not in self._nodes:
            raise UserError(f"{what}={layer!r}: the net has no layer of that name")
        return self._net.layer(layer).layer_index  # Caffe's layer index (split layers included)

    def _blob_for(self, name: str) -> str:
        """`end=` names a layer; pycaffe returns the blob of the same name (else the layer's first top)."""
        if name in self.blobs or name not in self._nodes:
            return name
        return self.top_names[name][0]

    def forward(self, blobs: Iterable[str] | None = None, start: str | None = None, end: str | None = None,
                **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        """Run the net (or layers start..end) with the inputs given by name; returns {blob: data} for the
        outputs (or `end`'s blob) and `blobs`. The arrays are the net's: copy what you keep."""
        self.reshape()
        blobs = list(blobs or [])
        first = self._position(start, "start") if start is not None else 0
        last = self._position(end, "end") if end is not None else len(self._layer_names) - 1
        outputs = set([self._blob_for(end)] + blobs) if end is not None else set(self.outputs + blobs)
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise UserError(f"forward() got inputs {sorted(kwargs)}, the net's inputs are {self.inputs}")
            for name, value in kwargs.items():
                target = self.blobs[name]
                if np.shape(value)[:1] != target.shape[:1]:
                    raise UserError(f"forward(): input {name!r} has {np.shape(value)[0] if np.ndim(value) else 0} "
                                    f"items, the blob holds {target.shape[0]} (reshape it first)")
                target.data[...] = value
        self._run(lambda: self._net.forward(first, last), fresh_pass=first == 0)
        return {name: self.blobs[name].data for name in outputs}

    def backward(self, diffs: Iterable[str] | None = None, start: str | None = None, end: str | None = None,
                 **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        """Backpropagate (from layer `start` down to `end`), with the output gradients given by name; returns
        {blob: diff} for the inputs (or `end`'s blob) and `diffs`. Parameter gradients add up, as in Caffe."""
        self.reshape()
        diffs = list(diffs or [])
        first = self._position(end, "end") if end is not None else 0
        last = self._position(start, "start") if start is not None else len(self._layer_names) - 1
        # pycaffe returns the gradients of the end layer's bottoms (what the range computed last)
        outputs = set(self.bottom_names[end] + diffs) if end is not None else set(self.inputs + diffs)
        if kwargs and set(kwargs) != set(self.outputs):
            raise UserError(f"backward() got gradients for {sorted(kwargs)}, the net's outputs are {self.outputs}")
        if not self._net.backward_steps:
            raise UserError(f"backward(): net {self._net.name!r} ({_phase_name(self._phase)}) runs no layer backward: "
                            "a TEST net keeps gradients only with force_backward: true in its prototxt, and "
                            "otherwise only layers below a loss backpropagate")

        def run() -> None:
            if not kwargs and first == 0 and last == len(self._layer_names) - 1:
                self._net.backward()
                return
            self._net.seed_loss_diffs()
            for name, value in kwargs.items():
                array = _blob_array(self._net, name, diff=True)
                if array is not None:  # else no layer reads it (an input passed through): nothing to do
                    self._net.backend.from_host(array, np.asarray(value, dtype=np.float32).reshape(
                        self.blobs[name].shape))
            self._net.backward(first, last, seed_losses=False)

        self._run(run)
        return {name: self.blobs[name].diff for name in outputs}

    def _run(self, work: Callable[[], Any], fresh_pass: bool = False) -> Any:
        """Host copies to the device, run, host copies back. A standalone net's full forward is a new pass
        (Dropout draws a new mask each time, as Caffe's does)."""
        if fresh_pass and self._standalone:
            self._net.ctx.iteration = self._passes
            self._passes += 1
        self._host.push()
        try:
            return work()
        finally:
            self._host.pull()

    def forward_all(self, blobs: Iterable[str] | None = None, **kwargs: np.ndarray) -> dict[str, np.ndarray]:
        """`forward` over inputs of any length, batch by batch (the last batch padded); returns whole arrays."""
        blobs = list(blobs or [])
        wanted = set(self.outputs + blobs)
        collected: dict[str, list[np.ndarray]] = {name: [] for name in wanted}
        for batch in self._batch(kwargs):
            for name, value in self.forward(blobs=blobs, **batch).items():
                _collect(collected[name], value)
        n = len(next(iter(kwargs.values()))) if kwargs else 0
        return {name: _trim(values, n) for name, values in collected.items()}

    def forward_backward_all(self, blobs: Iterable[str] | None = None, diffs: Iterable[str] | None = None,
                             **kwargs: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """forward and backward over inputs (and output gradients) of any length, batch by batch."""
        blobs, diffs = list(blobs or []), list(diffs or [])
        forward_in = {k: v for k, v in kwargs.items() if k in self.inputs}
        backward_in = {k: v for k, v in kwargs.items() if k not in self.inputs}
        outs: dict[str, list[np.ndarray]] = {name: [] for name in set(self.outputs + blobs)}
        grads: dict[str, list[np.ndarray]] = {name: [] for name in set(self.inputs + diffs)}
        for fb, bb in zip(self._batch(forward_in), self._batch(backward_in)):
            for name, value in self.forward(blobs=blobs, **fb).items():
                _collect(outs[name], value)
            for name, value in self.backward(diffs=diffs, **bb).items():
                _collect(grads[name], value)
        n = len(next(iter(kwargs.values()))) if kwargs else 0
        return {k: _trim(v, n) for k, v in outs.items()}, {k: _trim(v, n) for k, v in grads.items()}

    def _batch(self, arrays: dict[str, np.ndarray]) -> Iterable[dict[str, np.ndarray]]:
        """pycaffe's batches of `arrays`, the last one padded with zeros."""
        if not arrays:
            yield {}
            return
        batch = self.blobs[next(iter(arrays))].shape[0]
        n = len(next(iter(arrays.values())))
        for start in range(0, n, batch):
            out = {}
            for name, values in arrays.items():
                chunk = np.asarray(values[start:start + batch])
                if len(chunk) < batch:  # pad the last batch, as pycaffe does
                    pad = np.zeros((batch - len(chunk),) + chunk.shape[1:], dtype=chunk.dtype)
                    chunk = np.concatenate([chunk, pad])
                out[name] = chunk
            yield out
        return

    # -- shapes, weights, sharing --------------------------------------------------------------
    def _reshape_input(self, name: str, dims: tuple[int, ...]) -> None:
        if name not in self.inputs:
            raise UserError(f"blob {name!r} cannot be reshaped: only input blobs take a new shape "
                            f"(this net's: {', '.join(self.inputs) or 'none'})")
        if not dims or min(dims) < 1:
            raise UserError(f"blob {name!r}: cannot reshape to {dims}; every dimension must be at least 1")
        if dims == tuple(self._net.graph.blob_shapes[name]):
            self._pending.pop(name, None)
        else:
            self._pending[name] = np.zeros(dims, dtype=np.float32)

    def reshape(self) -> None:
        """Set the net up again for the shapes its input blobs were given (`Blob.reshape`), keeping the
        weights and what was written into the reshaped inputs; forward and backward do this first."""
        if not self._pending:
            return
        for name, staged in self._pending.items():
            self._set_input_shape(name, staged.shape)
        staged, self._pending = self._pending, {}
        self._rebuild()
        for name, values in staged.items():
            self._net.backend.from_host(_blob_array(self._net, name), values)

    def _set_input_shape(self, name: str, dims: tuple[int, ...]) -> None:
        for lp in self._net_param.layer:
            if lp.type == "Input" and name in lp.top:
                shapes = list(lp.input_param.shape)
                if len(shapes) == 1 and len(lp.top) > 1:  # one shape for every top: give each its own
                    del lp.input_param.shape[:]
                    for _ in lp.top:
                        lp.input_param.shape.add().CopyFrom(shapes[0])
                shape = lp.input_param.shape[list(lp.top).index(name)]
                del shape.dim[:]
                shape.dim.extend(dims)

    def _rebuild(self, share: Any = None) -> None:
        """A new runtime Net for the changed shapes or sharing, keeping the weights (and our host copies in step)."""
        from superneurons.io.caffemodel import load_weights, net_to_proto

        self._host.push()
        weights = net_to_proto(self._net)
        runtime = self._build_runtime(share if share is not None else self._shares)
        # Layers whose weights are now another net's keep that net's values, not this net's old ones.
        borrowed = {n.name for n in runtime.graph.nodes
                    if n.layer.params and all(d.owner is not None for d in n.layer.params)}
        own = [layer for layer in weights.layer if layer.name not in borrowed]
        del weights.layer[:]
        weights.layer.extend(own)
        load_weights(runtime, weights)
        self._attach(runtime)

    def copy_from(self, weights: str) -> None:
        """Load weights from a .caffemodel (or .caffemodel.h5), layers matched by name; others keep theirs."""
        from superneurons.io.caffemodel import load_weights

        self._host.push()
        load_weights(self._net, str(weights))
        self._host.pull()

    def save(self, path: str) -> None:
        """Write the weights as a .caffemodel (`.h5`: Caffe's HDF5 layout)."""
        from superneurons.io.caffemodel import save_weights

        self._host.push()
        save_weights(self._net, str(path))

    def save_hdf5(self, path: str) -> None:
        """Write the weights in Caffe's HDF5 layout, whatever the file's name."""
        from superneurons.io.caffemodel import save_weights

        self._host.push()
        save_weights(self._net, str(path), hdf5=True)

    def load_hdf5(self, path: str) -> None:
        """Load weights from Caffe's HDF5 layout (`save_hdf5`'s), whatever the file's name."""
        from superneurons.io.caffemodel import load_weights, read_weights

        self._host.push()
        load_weights(self._net, read_weights(str(path), hdf5=True))
        self._host.pull()

    def clear_param_diffs(self) -> None:
        """Zero every learnable parameter's gradient (backward adds into them, as in Caffe)."""
        self._host.push()
        self._net.clear_param_diffs()
        self._host.pull()

    def share_with(self, other: "Net") -> None:
        """Use `other`'s weights for the layers both nets have (same name and shapes), as Caffe's
        ShareTrainedLayersWith: a change to one net's weights is seen by the other."""
        if not self._standalone:
            if getattr(self._net, "_shared_params", None) is other._net.params:
                return  # a solver's test net reads its train net's weights already (Caffe shares them here too)
            raise UserError("share_with: a solver's nets share their weights already; call it on a Net you built")
        other._host.push()
        self._shares = other._net
        self._rebuild(other._net)

    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray, layer: str | None = None) -> None:
        """Feed a MemoryData layer (the first one, or `layer`): `data` (n, C, H, W), `labels` n values, n a
        multiple of its batch_size; forward passes walk through them and wrap around."""
        names = [n for n in self._layer_names if self._nodes[n].layer.type_name == "MemoryData"]
        if layer is None:
            if not names:
                raise UserError("set_input_arrays: the net has no MemoryData layer")
            layer = names[0]
        elif layer not in names:
            raise UserError(f"set_input_arrays: {layer!r} is not a MemoryData layer of this net "
                            f"(those: {', '.join(names) or 'none'})")
        self._net.layer(layer).reset(np.asarray(data), np.asarray(labels).reshape(-1))

    # -- memory (ours) -------------------------------------------------------------------------
    @property
    def memory_mode(self) -> str:
        """The memory mode the net runs under (what `auto` chose, when it was asked to)."""
        return self._net.memory.name

    def memory_summary(self) -> str:
        """One line: the mode, its checkpoints or what auto weighed, and the pool's size."""
        from superneurons.solver.solver import memory_line

        return memory_line(self._net).removeprefix("Memory: ")

    def memory_plan(self) -> dict[str, Any]:
        """The static memory plan of this net (what `superneurons memory --json` prints): per step, the live
        bytes under every mode, each mode's peak, the parameters' bytes."""
        from superneurons.memory.plan import make_plan, to_json

        graph = self._net.graph
        plan = make_plan(graph, train=self._net.train, plan_backward=False)
        batch = next((shape[0] for shape in graph.blob_shapes.values() if shape), None)
        return to_json(plan, batch)


def _collect(into: list, value: np.ndarray) -> None:
    """Items of a batch's blob (a scalar blob, e.g. a loss, one value per batch)."""
    if np.ndim(value):
        into.extend(np.array(value, copy=True))
    else:
        into.append(np.array(value, copy=True))


def _trim(values: list, n: int) -> np.ndarray:
    """The collected items without the padding of the last batch (n: the number of real items, 0: all)."""
    return np.asarray(values[:n] if n and len(values) >= n and np.ndim(values[0]) else values)


def _phase_name(phase: int) -> str:
    return "TRAIN" if phase == TRAIN else "TEST"


def _blob_array(runtime: Any, name: str, diff: bool = False) -> Any:
    """The backend array that holds blob `name`'s data (`diff`: its gradient) now, not a copy; None when the
    net keeps no gradient for the blob or the memory mode has freed it. KeyError: no such blob."""
    if diff:
        t = runtime.diff.get(name)
        if name not in runtime.data:
            raise KeyError(name)
        array = None if t is None else t.array
    else:
        array = runtime.data[name].array
    live = getattr(runtime, "live", None)  # after a Filter: the items it kept (runtime/live_batch.py)
    return array if live is None else live.blob_rows(name, array)


def _blob_shape(runtime: Any, name: str) -> tuple[int, ...]:
    """Blob `name`'s shape now: as planned, or after a Filter, the count it kept along axis 0 (as Caffe's
    reshape at each forward gives it)."""
    shape = tuple(runtime.graph.blob_shapes[name])
    live = getattr(runtime, "live", None)
    source = live.live.blob_filter.get(name) if live is not None else None
    return shape if source is None else (live.count(source),) + shape[1:]


def _zero_blobs(runtime: Any) -> None:
    """Caffe's blobs start at zero, and pycaffe code reads (or runs on) inputs it has not written yet."""
    for name in runtime.graph.blob_shapes:
        array = _blob_array(runtime, name)
        if array is not None:
            runtime.ops.fill(array, 0.0)
