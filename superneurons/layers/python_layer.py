"""Python: a layer computed by the user's own Python class, pycaffe's `caffe.Layer`.

    layer { type: "Python" name: "loss" bottom: "ip" bottom: "label" top: "loss" loss_weight: 1
            python_param { module: "pyloss" layer: "EuclideanLossLayer" param_str: "..." } }

`module` is imported from `sys.path` (the working directory under `python -m`, and `PYTHONPATH`), as
Caffe's embedded interpreter finds it, and `layer` names a subclass of `UserLayer` (`caffe.Layer`) in it.
The instance gets `param_str`, `phase` (caffe.TRAIN or caffe.TEST) and `blobs`, then Caffe's calls:
`setup(bottom, top)` and `reshape(bottom, top)` once the bottom shapes are known (the tops take their
shapes from `top[i].reshape(...)`), then `reshape` and `forward(bottom, top)` on every forward pass and
`backward(top, propagate_down, bottom)` on every backward pass. Each blob shows `.data` and `.diff` as
NumPy arrays: the net's own memory on the CPU; on the GPU host copies of the device arrays, refreshed
before the call and written back after it (the tops and blobs after forward, the bottom gradients and
blobs after backward).

Blobs added in `setup` with `self.blobs.add_blob(*shape)` are the layer's parameters: their values after
setup are their initial values, the solver updates them (with the `param { lr_mult }` of the prototxt),
and caffemodels hold them. A layer without bottoms is a data layer (pascal-multilabel's batch loader): it
never runs backward and its tops stay in memory. Shapes are fixed once set up: a `reshape` that changes a
top's shape during a run is refused (reshape the net's inputs from pycaffe instead, which sets the net up
again). What the user's code raises propagates unchanged, with a note naming the layer and the call.
Under the recompute memory mode a layer with bottoms may run forward again during backward to rebuild its
top, as any layer may: its forward should depend only on its bottoms and blobs (a data layer never does).
"""
from __future__ import annotations

import importlib
from typing import Any, Sequence

import numpy as np

from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP, Layer, Shape, register

# Tests set this to run on the CPU the host copies the GPU takes (download before the call, upload after).
COPY_HOST_ARRAYS = False


class LayerBlob:
    """A blob as a Python layer sees it: `.data`, `.diff`, `.shape`, `.count`, `.num`/`.channels`/`.height`/
    `.width`, `.reshape(*shape)`."""

    def __init__(self, shape: Shape | None, what: str = "a Python layer's blob"):
        self._shape = shape
        self._data: np.ndarray | None = None
        self._diff: np.ndarray | None = None
        self._what = what  # for errors: "layer 'loss' (Python): top 0"
        self._fixed = False  # True once bound to the net's arrays (or a bottom): the shape may not change

    def bind(self, data: np.ndarray | None, diff: np.ndarray | None) -> "LayerBlob":
        self._data, self._diff, self._fixed = data, diff, True
        return self

    def _array(self, which: str) -> np.ndarray:
        current = self._data if which == "data" else self._diff
        if current is None:
            if self._shape is None:
                raise UserError(f"{self._what}: read before its shape was set: call reshape(...) on it in setup or "
                                "reshape")
            current = np.zeros(self._shape, dtype=np.float32)
            if which == "data":
                self._data = current
            else:
                self._diff = current
        return current

    @property
    def data(self) -> np.ndarray:
        return self._array("data")

    @property
    def diff(self) -> np.ndarray:
        return self._array("diff")

    @property
    def shape(self) -> Shape:
        return tuple(self._shape or ())

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def _legacy(self, axis: int) -> int:
        return self.shape[axis] if axis < len(self.shape) else 1

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def reshape(self, *shape: int) -> None:
        dims = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)) else shape
        dims = tuple(int(d) for d in dims)
        if any(d < 0 for d in dims):
            raise UserError(f"{self._what}: reshape{dims}: a dimension is negative")
        if self._fixed:
            if dims != self.shape:
                raise UserError(f"{self._what}: reshape to {dims} while the net runs with {self.shape}; shapes "
                                "are set up once (reshape the net's input blobs from Python to set the net up again)")
            return
        self._shape, self._data, self._diff = dims, None, None

    def __repr__(self) -> str:
        return f"<LayerBlob {self.shape}>"


class BlobVec(list):
    """A Python layer's `self.blobs`: a list of LayerBlobs, grown in `setup` with `add_blob(*shape)`."""

    def __init__(self) -> None:
        super().__init__()
        self.open = True  # until setup ends

    def add_blob(self, *shape: int) -> None:
        if not self.open:
            raise UserError("blobs.add_blob: a Python layer adds its blobs in setup, before the net is set up")
        self.append(LayerBlob(tuple(int(d) for d in shape), f"blobs[{len(self)}]"))


class UserLayer:
    """pycaffe's `caffe.Layer`: subclass it and override `setup`, `reshape`, `forward` and `backward`.
    `self.param_str` (python_param.param_str), `self.phase` and `self.blobs` are set before `setup`."""

    param_str: str = ""
    phase: int = 0
    blobs: BlobVec

    def setup(self, bottom: list[LayerBlob], top: list[LayerBlob]) -> None:
        """Read param_str, add blobs, check the bottoms (once)."""

    def reshape(self, bottom: list[LayerBlob], top: list[LayerBlob]) -> None:
        """Give every top its shape with `top[i].reshape(...)` (before setup's end and each forward)."""

    def forward(self, bottom: list[LayerBlob], top: list[LayerBlob]) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines no forward(self, bottom, top)")

    def backward(self, top: list[LayerBlob], propagate_down: list[bool], bottom: list[LayerBlob]) -> None:
        raise NotImplementedError(f"{type(self).__name__} defines no backward(self, top, propagate_down, bottom)")


def _user_class(param: Any, where: str) -> type:
    p = param.python_param
    if not p.module or not p.layer:
        raise UserError(f"{where}: python_param needs module and layer (the Python module on sys.path or "
                        "PYTHONPATH, and the class in it)")
    try:
        module = importlib.import_module(p.module)
    except ModuleNotFoundError as e:
        if e.name != p.module.split(".")[0] and e.name != p.module:
            raise  # the module itself failed to import something: the user's own traceback says what
        raise UserError(f"{where}: python_param.module {p.module!r}: no such module on sys.path (put its folder in "
                        "PYTHONPATH, or run from it)") from None
    cls = getattr(module, p.layer, None)
    if not isinstance(cls, type):
        raise UserError(f"{where}: python_param.layer {p.layer!r}: module {p.module!r} ({module.__file__}) has no "
                        "such class")
    return cls


@register("Python")
class Python(Layer):
    replayable = False  # the user's host code runs in forward and backward
    n_bottoms = (0, None)
    n_tops = (0, None)
    # Its setup runs the user's code on the user's object: a copy set up again for another batch (the layers
    # after a Filter, graph/live_batch.py) would run it twice on one object.
    setup_repeatable = False

    def __init__(self, param, phase):
        super().__init__(param, phase)
        # No bottoms: it produces data (runs first, never backward, its tops stay in memory).
        self.is_data = not len(param.bottom)  # type: ignore[misc]
        where = f"layer {param.name!r} (Python)"
        self.user = _user_class(param, where)()
        self.user.param_str = param.python_param.param_str
        self.user.phase = int(phase)
        self.user.blobs = BlobVec()
        self.source = f"{param.python_param.module}.{param.python_param.layer}"

    def backward_needs(self) -> frozenset[str]:
        """The user's backward may read any bottom and top: the memory planner keeps them all for it (and every
        array of the step is resident while the user's code runs, on the host side of the copies above)."""
        return frozenset({NEEDS_BOTTOM, NEEDS_TOP})

    def _call(self, method: str, *args: Any) -> None:
        try:
            getattr(self.user, method)(*args)
        except UserError:
            raise
        except Exception as e:  # the user's own exception and traceback, plus which layer ran it
            e.add_note(f"in Python layer {self.name!r} ({self.source}), {method}()")
            raise

    def _blobs(self, role: str, shapes: Sequence[Shape | None]) -> list[LayerBlob]:
        return [LayerBlob(None if s is None else tuple(s), f"layer {self.name!r} (Python): {role} {i}")
                for i, s in enumerate(shapes)]

    def setup(self, bottom_shapes: Sequence[Shape]) -> list[Shape]:
        bottom = [b.bind(None, None) for b in self._blobs("bottom", bottom_shapes)]  # shaped by the net
        top = self._blobs("top", [None] * len(self.param.top))
        self._call("setup", bottom, top)
        self._call("reshape", bottom, top)
        blobs = self.user.blobs
        blobs.open = False
        for blob in blobs:
            decl = self.add_param(blob.shape, None)
            decl.initial = np.array(blob.data, dtype=np.float32)
        for i, t in enumerate(top):
            if t._shape is None:
                raise self.fail(f"top {i} ({self.param.top[i]!r}) has no shape: call top[{i}].reshape(...) in "
                                "setup or reshape")
        self.bottom_shapes, self.top_shapes = [b.shape for b in bottom], [t.shape for t in top]
        return self.top_shapes

    # -- running: the net's arrays as host arrays around each call ----------------------------------
    def _host(self, array: Any, shape: Shape) -> np.ndarray | None:
        if array is None:
            return None
        if _in_place(array):
            return array.reshape(shape)  # the CPU backend's memory itself: writes go straight in
        return np.ascontiguousarray(self.ops.download(array)).reshape(shape)

    def _write_back(self, pairs: list[tuple[Any, np.ndarray | None]]) -> None:
        for array, host in pairs:
            if array is not None and host is not None and not _in_place(array):
                self.ops.upload(array, host)

    def _bind_blobs(self, diffs: bool) -> list[tuple[Any, np.ndarray | None]]:
        """Point `self.blobs` at the parameters' arrays; returns what to write back after the call."""
        back = []
        for blob, decl in zip(self.user.blobs, self.params):
            data, diff = self._host(decl.data, decl.shape), self._host(decl.diff, decl.shape) if diffs else None
            blob.bind(data, diff)
            back.append((decl.data, data))
            if diffs:
                back.append((decl.diff, diff))
        return back

    def forward(self, bottom: list, top: list) -> None:
        b = [blob.bind(self._host(a, blob.shape), None)
             for a, blob in zip(bottom, self._blobs("bottom", self.bottom_shapes))]
        t = [blob.bind(self._host(a, blob.shape), None) for a, blob in zip(top, self._blobs("top", self.top_shapes))]
        back = self._bind_blobs(diffs=False)
        self._call("reshape", b, t)
        self._call("forward", b, t)
        self._write_back([(a, blob._data) for a, blob in zip(top, t)] + back)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff) -> None:
        t = [blob.bind(self._host(a, blob.shape), self._host(d, blob.shape))
             for a, d, blob in zip(top, top_diff, self._blobs("top", self.top_shapes))]
        b = [blob.bind(self._host(a, blob.shape), self._host(d, blob.shape))
             for a, d, blob in zip(bottom, bottom_diff, self._blobs("bottom", self.bottom_shapes))]
        back = self._bind_blobs(diffs=True)
        self._call("backward", t, list(propagate_down), b)
        self._write_back([(d, blob._diff) for d, blob in zip(bottom_diff, b)] + back)


def _in_place(array: Any) -> bool:
    """Whether the user's code may work on `array` itself (the CPU backend's), not a host copy."""
    return isinstance(array, np.ndarray) and not COPY_HOST_ARRAYS
