"""Elementwise combination of equally shaped blobs (the Eltwise layer); top may be bottoms[0].

A SUM fused with the ReLU in place on its top (graph/fuse.py) is one pass each way for two bottoms:
forward reads a and b and writes relu(sum); backward reads y and dy and writes both bottom gradients."""
from __future__ import annotations

from typing import Sequence

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek
from superneurons.backend.cuda.ops.activation import relu_forward
from superneurons.backend.cuda.ops.basic import axpy, copy, fill

__all__ = ["eltwise_sum", "eltwise_prod", "eltwise_max", "eltwise_prod_backward", "eltwise_max_backward",
           "scaled_copy", "eltwise_sum_relu", "eltwise_sum_relu_backward"]


def _run(kernel, out, *args) -> None:
    if out.size:
        K.launch(kernel, out.size)(*[flat(a) if hasattr(a, "gpu_data") else a for a in args])


def scaled_copy(alpha: float, x, y) -> None:
    """y = alpha * x."""
    if alpha == 1.0:
        copy(x, y)
    else:
        _run(ek.scale_copy, y, scalar(y, alpha), x, y)


def eltwise_sum(bottoms: Sequence, coeffs: Sequence[float], top) -> None:
    """top = sum_i coeffs[i] * bottoms[i]: the first two in one pass (ResNet's shortcuts, Split's diffs)."""
    if len(bottoms) == 1:
        scaled_copy(coeffs[0], bottoms[0], top)
        return
    if top.size:
        K.launch_unrolled(ek.weighted_sum2, top.size)(scalar(top, coeffs[0]), flat(bottoms[0]), scalar(top, coeffs[1]),
                                                      flat(bottoms[1]), flat(top))
    for b, c in zip(bottoms[2:], coeffs[2:]):
        axpy(c, b, top)


def eltwise_sum_relu(bottoms: Sequence, coeffs: Sequence[float], top, slope: float) -> None:
    """top = relu(sum_i coeffs[i] * bottoms[i]) (leaky slope): two bottoms in one pass (ResNet's joins)."""
    if len(bottoms) != 2:
        eltwise_sum(bottoms, coeffs, top)
        relu_forward(top, top, slope)
    elif top.size:
        K.launch_unrolled(ek.weighted_sum2_relu, top.size)(scalar(top, coeffs[0]), flat(bottoms[0]),
                                                           scalar(top, coeffs[1]), flat(bottoms[1]), flat(top),
                                                           scalar(top, slope))


def eltwise_sum_relu_backward(top, top_diff, coeffs: Sequence[float], bottom_diffs: Sequence, slope: float) -> None:
    """bottom_diffs[k] = coeffs[k] * (top_diff masked by top > 0), two outputs per pass. An output that is
    top_diff itself must come last (see the CPU op): it is then written by the last pass."""
    if not top_diff.size:
        return
    last = len(bottom_diffs) - 1
    for k in range(0, last + 1, 2):
        j = min(k + 1, last)  # an odd one out is passed twice
        K.launch_unrolled(ek.relu_backward_scaled2, top_diff.size)(
            flat(top), flat(top_diff), scalar(top_diff, slope), scalar(top_diff, coeffs[k]), flat(bottom_diffs[k]),
            scalar(top_diff, coeffs[j]), flat(bottom_diffs[j]))


def eltwise_prod(bottoms: Sequence, top) -> None:
    _run(ek.multiply, top, bottoms[0], bottoms[1], top)
    for b in bottoms[2:]:
        _run(ek.multiply, top, top, b, top)


def eltwise_max(bottoms: Sequence, top, argmax) -> None:
    """top = max_i bottoms[i]; argmax = the first bottom holding it."""
    fill(argmax, 0)
    copy(bottoms[0], top)
    for i, b in enumerate(bottoms[1:], start=1):
        _run(ek.max_into, top, b, i, top, argmax)


def eltwise_prod_backward(bottoms: Sequence, i: int, top, top_diff, bottom_diff, stable: bool) -> None:
    """bottom_diff = top_diff * d(prod)/d(bottoms[i]) (product of the others, or top / bottoms[i])."""
    if stable:
        others = [b for j, b in enumerate(bottoms) if j != i]
        _run(ek.multiply, bottom_diff, top_diff, others[0], bottom_diff)
        for b in others[1:]:
            _run(ek.multiply, bottom_diff, bottom_diff, b, bottom_diff)
    else:
        _run(ek.mul_div, bottom_diff, top_diff, top, bottoms[i], bottom_diff)


def eltwise_max_backward(top_diff, argmax, i: int, bottom_diff) -> None:
    _run(ek.select_eq, bottom_diff, top_diff, argmax, i, bottom_diff)
