"""pycaffe's `caffe.coord_map`: how the spatial coordinates of two tops of a NetSpec relate, and `crop`.

Every layer that keeps the spatial layout maps a coordinate x of its bottom to `a * x + b` of its top, on
the axes after `axis` (the channel axis): a Convolution or Pooling with kernel k, stride s and pad p puts
the centre of its window at x = s * y - p + (k - 1) / 2, so y = x / s + (p - (k - 1) / 2) / s; a
Deconvolution is the inverse; a Crop with offset o gives y = x - o; element-wise layers (ReLU, BatchNorm,
Eltwise, ...) give y = x. `coord_map_from_to(top_from, top_to)` composes these maps through the nearest
top both come from and returns `(axis, a, b)` with coordinate `a * x + b` of `top_to` for coordinate x of
`top_from` (a and b arrays, one per spatial axis, when a layer's kernel, stride or pad differ per axis).
`crop(top_from, top_to)` is the Crop layer that cuts `top_from` to `top_to`'s extent at the aligned offset
(FCN's upsampled score maps).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.errors import UserError
from superneurons.io.net_spec import Top, layers as L

# Layers whose top has the bottom's spatial layout, coordinate for coordinate.
PASS_THROUGH = frozenset({"AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Exp", "Log",
                          "LRN", "MVN", "Power", "PReLU", "ReLU", "Scale", "Sigmoid", "Split", "Swish", "TanH",
                          "Threshold", "Clip"})


class UnconnectedError(UserError, RuntimeError):
    """The two tops share no spatially connected ancestor (pycaffe raises RuntimeError)."""


class MisalignedError(UserError, AssertionError):
    """`crop` cannot cut one top to the other (pycaffe asserts)."""


def _field(fn: Any, name: str, message: str, default: Any) -> Any:
    """A layer parameter given as a keyword (`kernel_size=3`) or inside its message (`convolution_param=`)."""
    if name in fn.params:
        return fn.params[name]
    return fn.params.get(message, {}).get(name, default)


def _per_axis(value: Any) -> Any:
    """A scalar stays one; a list of one value is that value; a longer list is an array, one per axis."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else np.array(value, dtype=np.float64)
    return value


def _window(fn: Any, message: str) -> tuple[Any, Any, Any]:
    """Kernel, stride and pad of a Convolution/Deconvolution/Pooling (an effective kernel under dilation)."""
    kernel = _per_axis(_field(fn, "kernel_size", message, 1))
    if isinstance(kernel, (list, tuple)) and not len(kernel):
        kernel = 1
    stride = _per_axis(_field(fn, "stride", message, 1) or 1)
    pad = _per_axis(_field(fn, "pad", message, 0) or 0)
    dilation = _per_axis(_field(fn, "dilation", message, 1) or 1) if message == "convolution_param" else 1
    return (np.asarray(kernel) - 1) * dilation + 1, stride, pad


def layer_map(fn: Any) -> tuple[int | None, Any, Any]:
    """(axis, a, b): the layer maps bottom coordinate x to a * x + b of its top (axis None: any)."""
    kind = fn.type_name
    if kind in ("Convolution", "Pooling", "Deconvolution"):
        message = "pooling_param" if kind == "Pooling" else "convolution_param"
        axis = int(_field(fn, "axis", message, 1)) if kind != "Pooling" else 1
        kernel, stride, pad = _window(fn, message)
        if kind == "Deconvolution":
            return axis, _scalar(np.asarray(stride, dtype=np.float64)), _scalar((kernel - 1) / 2.0 - pad)
        return axis, _scalar(1.0 / np.asarray(stride, dtype=np.float64)), _scalar((pad - (kernel - 1) / 2.0) / stride)
    if kind == "Crop":
        axis = int(_field(fn, "axis", "crop_param", 2))
        offset = _per_axis(_field(fn, "offset", "crop_param", 0))
        return axis - 1, 1, _scalar(-np.asarray(offset, dtype=np.float64))
    if kind in PASS_THROUGH:
        return None, 1, 0
    raise UnconnectedError(f"coord_map: layer type {kind} does not keep the spatial layout (no coordinate map)")


def _scalar(value: Any) -> Any:
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array


def _followed_bottoms(top: Top) -> list[Top]:
    """The bottoms whose coordinates `top`'s map starts from: bottom i for top i of a multi-input
    Convolution, only the cropped bottom of a Crop, every bottom of an element-wise layer."""
    fn = top.fn
    if fn.type_name in ("Convolution", "Deconvolution", "Pooling"):
        return [fn.inputs[top.n]] if top.n < len(fn.inputs) else []
    if fn.type_name == "Crop":
        return list(fn.inputs[:1])
    return list(fn.inputs)


def _compose(first: tuple, then: tuple) -> tuple:
    """The map x -> then(first(x))."""
    ax1, a1, b1 = first
    ax2, a2, b2 = then
    if ax1 is not None and ax2 is not None and ax1 != ax2:
        raise UnconnectedError(f"coord_map: the layers map different axes ({ax1} and {ax2})")
    return (ax1 if ax1 is not None else ax2), a2 * a1, a2 * b1 + b2


def _ancestors(top: Top) -> dict[Top, tuple]:
    """Every top that `top` depends on spatially, with the map from it to `top`, nearest first."""
    out: dict[Top, tuple] = {top: (None, 1, 0)}
    frontier = [top]
    while frontier:
        nxt = []
        for t in frontier:
            if t.fn.type_name not in PASS_THROUGH and t.fn.type_name not in ("Convolution", "Deconvolution",
                                                                              "Pooling", "Crop"):
                continue  # a layer without a map (InnerProduct, data layers): nothing above it connects
            step = layer_map(t.fn)
            for bottom in _followed_bottoms(t):
                if bottom not in out:
                    out[bottom] = _compose(step, out[t])
                    nxt.append(bottom)
        frontier = nxt
    return out


def coord_map_from_to(top_from: Top, top_to: Top) -> tuple[int | None, Any, Any]:
    """(axis, a, b): coordinate x of `top_from` is coordinate a * x + b of `top_to` (see the module)."""
    from_maps, to_maps = _ancestors(top_from), _ancestors(top_to)
    common = next((t for t in to_maps if t in from_maps), None)
    if common is None:
        raise UnconnectedError("coord_map: the two tops share no spatially connected ancestor (a layer between "
                               "them, e.g. InnerProduct, has no coordinate map)")
    ax_f, a_f, b_f = from_maps[common]  # common -> top_from
    ax_t, a_t, b_t = to_maps[common]  # common -> top_to
    # invert common -> top_from, then go common -> top_to
    inverse = (1.0 / np.asarray(a_f, dtype=np.float64), -np.asarray(b_f, dtype=np.float64) / a_f)
    ax, a, b = _compose((ax_f, _scalar(inverse[0]), _scalar(inverse[1])), (ax_t, a_t, b_t))
    return ax, _scalar(a), _scalar(b)


def crop(top_from: Top, top_to: Top) -> Top:
    """A Crop layer that cuts `top_from` to `top_to`'s spatial extent, aligned by their coordinate map."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    if not np.all(np.asarray(a) == 1):
        raise MisalignedError(f"crop: the tops have different scales (coordinate map a = {a}); only a "
                              "same-scale top can be cut to another")
    offset = -np.asarray(b, dtype=np.float64)
    if np.any(offset < 0) or not np.all(offset == np.round(offset)):
        raise MisalignedError(f"crop: the offset {offset.tolist()} is negative or fractional: {top_from!r} does "
                              "not cover the other top at whole pixels")
    return L.Crop(top_from, top_to, crop_param=dict(axis=(ax if ax is not None else 1) + 1,
                                                    offset=[int(o) for o in np.ravel(offset)]))
