"""The activations' CPU ops: ReLU, Sigmoid, TanH, PReLU, ELU, AbsVal, BNLL, Exp, Log, Power, Threshold.

Each backward states what it reads. Those reading only the output `y` (ReLU, Sigmoid, TanH, ELU, BNLL, Exp)
let their layers declare NEEDS_TOP, run in place (then `x is y` in forward and `dx is dy` in backward) and
let liveness free the input. Scalars are cast to the array's dtype so float32 stays float32.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need

__all__ = ["relu_forward", "relu_backward", "sigmoid_forward", "sigmoid_backward", "tanh_forward", "tanh_backward",
           "prelu_forward", "prelu_backward", "elu_forward", "elu_backward", "absval_forward", "absval_backward",
           "bnll_forward", "bnll_backward", "exp_forward", "exp_backward", "log_forward", "log_backward",
           "power_forward", "power_backward", "threshold_forward", "clip_forward", "clip_backward",
           "swish_forward", "swish_backward"]


def relu_forward(x: np.ndarray, y: np.ndarray, slope: float) -> None:
    if slope == 0.0:
        np.maximum(x, 0, out=y)
    else:
        y[...] = np.where(x > 0, x, x * slope).astype(y.dtype, copy=False)


def relu_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray, slope: float) -> None:
    """Uses the output: y > 0 iff x > 0 for slope >= 0 (in-place safe)."""
    if slope == 0.0:
        np.multiply(dy, y > 0, out=dx)
    else:
        np.multiply(dy, np.where(y > 0, 1.0, slope).astype(dy.dtype, copy=False), out=dx)


def sigmoid_forward(x: np.ndarray, y: np.ndarray) -> None:
    """y = 1 / (1 + exp(-x)), computed as 0.5 * tanh(x / 2) + 0.5, which cannot overflow for large |x|."""
    np.multiply(x, 0.5, out=y)
    np.tanh(y, out=y)
    y *= 0.5
    y += 0.5


def sigmoid_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = dy * y * (1 - y)."""
    np.multiply(dy, y * (1 - y), out=dx)


def tanh_forward(x: np.ndarray, y: np.ndarray) -> None:
    np.tanh(x, out=y)


def tanh_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = dy * (1 - y^2)."""
    np.multiply(dy, 1 - y * y, out=dx)


def prelu_forward(x: np.ndarray, slope: np.ndarray, y: np.ndarray, outer: int, channels: int, inner: int) -> None:
    """y = x if x > 0 else slope[c] * x, x viewed as (outer, channels, inner); slope has `channels` or 1 value."""
    x3 = x.reshape(outer, channels, inner)
    s = slope.reshape(1, -1, 1)
    np.copyto(y.reshape(outer, channels, inner), np.where(x3 > 0, x3, x3 * s))


def prelu_backward(x: np.ndarray, slope: np.ndarray, dy: np.ndarray, dx: np.ndarray | None,
                   dslope: np.ndarray | None, outer: int, channels: int, inner: int, scratch: Any = None) -> None:
    """dslope += sum of dy * x where x <= 0 (per channel, or in total when shared); dx = dy * (1 or slope)."""
    need.check(scratch, need.row_sums(channels) if dslope is not None else 0, "prelu_backward")
    x3 = x.reshape(outer, channels, inner)
    dy3 = dy.reshape(outer, channels, inner)
    neg = x3 <= 0
    if dslope is not None:
        per_channel = np.where(neg, dy3 * x3, 0).sum(axis=(0, 2))
        dslope += (per_channel if dslope.size == channels else per_channel.sum()).reshape(dslope.shape)
    if dx is not None:
        s = slope.reshape(1, -1, 1)
        np.copyto(dx.reshape(outer, channels, inner), np.where(neg, dy3 * s, dy3))


def elu_forward(x: np.ndarray, y: np.ndarray, alpha: float) -> None:
    """y = x if x > 0 else alpha * (exp(x) - 1)."""
    np.copyto(y, np.where(x > 0, x, x.dtype.type(alpha) * np.expm1(np.minimum(x, 0))))


def elu_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray, alpha: float) -> None:
    """dx = dy if y > 0 else dy * (y + alpha); y > 0 iff x > 0 for alpha >= 0 (in-place safe)."""
    np.copyto(dx, np.where(y > 0, dy, dy * (y + y.dtype.type(alpha))))


def absval_forward(x: np.ndarray, y: np.ndarray) -> None:
    np.abs(x, out=y)


def absval_backward(x: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = sign(x) * dy (0 at x == 0, as Caffe)."""
    np.multiply(np.sign(x), dy, out=dx)


def bnll_forward(x: np.ndarray, y: np.ndarray) -> None:
    """y = log(1 + exp(x)), computed as max(x, 0) + log1p(exp(-|x|)) so it never overflows."""
    np.copyto(y, np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x))))


def bnll_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray) -> None:
    """dx = dy * sigmoid(x), and sigmoid(x) = 1 - exp(-y) = -expm1(-y) (reads the output only)."""
    np.multiply(dy, -np.expm1(-y), out=dx)


def exp_forward(x: np.ndarray, y: np.ndarray, log_base: float, scale: float, shift: float) -> None:
    """y = base ** (shift + scale * x) = exp(log_base * (shift + scale * x))."""
    t = x.dtype.type
    np.exp(t(log_base * shift) + t(log_base * scale) * x, out=y)


def exp_backward(y: np.ndarray, dy: np.ndarray, dx: np.ndarray, log_base: float, scale: float) -> None:
    """dx = dy * y * log_base * scale (reads the output only)."""
    np.multiply(dy, y * y.dtype.type(log_base * scale), out=dx)


def log_forward(x: np.ndarray, y: np.ndarray, log_base: float, scale: float, shift: float) -> None:
    """y = log_base(shift + scale * x) = ln(shift + scale * x) / ln(base)."""
    t = x.dtype.type
    np.log(t(shift) + t(scale) * x, out=y)
    if log_base != 1.0:
        y *= t(1.0 / log_base)


def log_backward(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, log_base: float, scale: float, shift: float) -> None:
    """dx = dy * scale / (ln(base) * (shift + scale * x))."""
    t = x.dtype.type
    np.divide(dy * t(scale / log_base), t(shift) + t(scale) * x, out=dx)


def power_forward(x: np.ndarray, y: np.ndarray, power: float, scale: float, shift: float) -> None:
    """y = (shift + scale * x) ** power."""
    t = x.dtype.type
    if power == 0.0 or scale == 0.0:
        y.fill(t(1.0) if power == 0.0 else t(shift) ** t(power))
        return
    np.power(t(shift) + t(scale) * x, t(power), out=y)


def power_backward(x: np.ndarray | None, dy: np.ndarray, dx: np.ndarray, power: float, scale: float,
                   shift: float) -> None:
    """dx = dy * power * scale * (shift + scale * x) ** (power - 1); x is not read when that is constant."""
    t = dx.dtype.type
    if power == 0.0 or scale == 0.0:
        dx.fill(0)
    elif power == 1.0:
        np.multiply(dy, t(scale), out=dx)
    elif power == 2.0:
        np.multiply(dy, t(2.0 * scale) * (t(shift) + t(scale) * x), out=dx)
    else:
        np.multiply(dy, t(power * scale) * np.power(t(shift) + t(scale) * x, t(power - 1.0)), out=dx)


def threshold_forward(x: np.ndarray, y: np.ndarray, threshold: float) -> None:
    """y = 1 where x > threshold, else 0."""
    np.copyto(y, x > x.dtype.type(threshold))


def clip_forward(x: np.ndarray, y: np.ndarray, low: float, high: float) -> None:
    """y = min(max(x, low), high)."""
    t = x.dtype.type
    np.clip(x, t(low), t(high), out=y)


def clip_backward(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, low: float, high: float) -> None:
    """dx = dy where low <= x <= high, else 0."""
    t = x.dtype.type
    np.multiply(dy, (x >= t(low)) & (x <= t(high)), out=dx)


def _sigmoid(v: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-v)) as 0.5 tanh(v / 2) + 0.5, which never overflows."""
    t = v.dtype.type
    return t(0.5) * np.tanh(t(0.5) * v) + t(0.5)


def swish_forward(x: np.ndarray, y: np.ndarray, beta: float) -> None:
    """y = x * sigmoid(beta * x)."""
    np.multiply(x, _sigmoid(x * x.dtype.type(beta)), out=y)


def swish_backward(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, beta: float) -> None:
    """dx = dy * (s + beta * x * s * (1 - s)) with s = sigmoid(beta * x)."""
    t = x.dtype.type
    bx = x * t(beta)
    s = _sigmoid(bx)
    np.multiply(dy, s + bx * s * (t(1) - s), out=dx)
