"""Parameter updates: one fused operation per solver type, plus weight-decay regularization.

Each `*_update` op follows Caffe's rule step by step (same operation order, so float32 rounding
matches Caffe's CPU path): it computes the update into `dw` (Caffe leaves the update in the diff)
and then applies `w -= dw`. Keeping a whole rule in one call lets the CUDA backend run it as
one kernel per parameter instead of a chain of elementwise launches.

`multi_sgd_update` and `multi_zero_grads` do the same for every parameter at once, on views of one flat
arena (the pool's) at per-parameter offsets: the CUDA backend runs each as one kernel for the whole net
(solver/fused_update.py builds the tables). Here they walk the parameters with the per-parameter ops, so the
CPU's results are those of the per-parameter path bit for bit.

Scalars arrive as Python floats and are cast to the arrays' dtype, so the ops run in float32 for
training and float64 in tests.
"""
from __future__ import annotations

import numpy as np

__all__ = ["regularize", "sgd_update", "nesterov_update", "adagrad_update", "rmsprop_update", "adadelta_update",
           "adam_update", "multi_sgd_update", "multi_zero_grads"]


def _s(x: np.ndarray, value: float):
    """`value` as a scalar of x's dtype (no silent promotion of float32 arrays to float64)."""
    return x.dtype.type(value)


def regularize(w: np.ndarray, dw: np.ndarray, decay: float, l1: bool = False) -> None:
    """dw += decay * w (L2) or dw += decay * sign(w) (L1)."""
    if decay == 0.0:
        return
    if l1:
        dw += _s(dw, decay) * np.sign(w)
    else:
        dw += _s(dw, decay) * w


def _apply(w: np.ndarray, dw: np.ndarray) -> None:
    w -= dw


def sgd_update(w: np.ndarray, dw: np.ndarray, hist: np.ndarray, lr: float, momentum: float) -> None:
    """h = lr * g + momentum * h; w -= h."""
    hist *= _s(hist, momentum)
    hist += _s(hist, lr) * dw
    dw[...] = hist
    _apply(w, dw)


def nesterov_update(w: np.ndarray, dw: np.ndarray, hist: np.ndarray, lr: float, momentum: float) -> None:
    """h' = lr * g + momentum * h; w -= (1 + momentum) * h' - momentum * h."""
    old = hist.copy()
    hist *= _s(hist, momentum)
    hist += _s(hist, lr) * dw
    np.multiply(hist, _s(hist, 1.0 + momentum), out=dw)
    dw -= _s(dw, momentum) * old
    _apply(w, dw)


def adagrad_update(w: np.ndarray, dw: np.ndarray, hist: np.ndarray, lr: float, delta: float) -> None:
    """h += g^2; w -= lr * g / (sqrt(h) + delta)."""
    hist += dw * dw
    denom = np.sqrt(hist)
    denom += _s(denom, delta)
    dw /= denom
    dw *= _s(dw, lr)
    _apply(w, dw)


def rmsprop_update(w: np.ndarray, dw: np.ndarray, hist: np.ndarray, lr: float, rms_decay: float,
                   delta: float) -> None:
    """h = rms_decay * h + (1 - rms_decay) * g^2; w -= lr * g / (sqrt(h) + delta)."""
    hist *= _s(hist, rms_decay)
    hist += _s(hist, 1.0 - rms_decay) * (dw * dw)
    denom = np.sqrt(hist)
    denom += _s(denom, delta)
    dw /= denom
    dw *= _s(dw, lr)
    _apply(w, dw)


def adadelta_update(w: np.ndarray, dw: np.ndarray, hist_g: np.ndarray, hist_dx: np.ndarray, lr: float,
                    momentum: float, delta: float) -> None:
    """Zeiler's AdaDelta as Caffe runs it: E[g^2] and E[dx^2] decay by `momentum`; dx is tracked before lr.

    E[g^2] = m E[g^2] + (1-m) g^2;  dx = g * sqrt((E[dx^2] + delta) / (E[g^2] + delta));
    E[dx^2] = m E[dx^2] + (1-m) dx^2;  w -= lr * dx.
    """
    hist_g *= _s(hist_g, momentum)
    hist_g += _s(hist_g, 1.0 - momentum) * (dw * dw)
    ratio = hist_dx + _s(hist_dx, delta)
    ratio /= hist_g + _s(hist_g, delta)
    np.sqrt(ratio, out=ratio)
    dw *= ratio
    hist_dx *= _s(hist_dx, momentum)
    hist_dx += _s(hist_dx, 1.0 - momentum) * (dw * dw)
    dw *= _s(dw, lr)
    _apply(w, dw)


def adam_update(w: np.ndarray, dw: np.ndarray, m: np.ndarray, v: np.ndarray, lr: float, beta1: float, beta2: float,
                eps: float, t: int) -> None:
    """Adam with Caffe's folded bias correction: w -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps).

    `t` is the 1-based step number (Caffe: iter + 1).
    """
    correction = np.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
    m *= _s(m, beta1)
    m += _s(m, 1.0 - beta1) * dw
    v *= _s(v, beta2)
    v += _s(v, 1.0 - beta2) * (dw * dw)
    denom = np.sqrt(v)
    denom += _s(denom, eps)
    np.divide(m, denom, out=dw)
    dw *= _s(dw, lr * correction)
    _apply(w, dw)


def multi_sgd_update(arena: np.ndarray, segments: np.ndarray, factors: np.ndarray, blocks: np.ndarray, rate: float,
                     momentum: float, clip_scale: float, iter_scale: float, l1: bool) -> None:
    """Caffe's ApplyUpdate with SGD for every segment of `arena` (1-D): scale the gradient by `clip_scale` and
    `iter_scale` (1/iter_size), add weight decay, then `sgd_update` with rate * lr_mult.

    `segments` (int64, a row per parameter): element offsets of its data, gradient and history, and its length.
    `factors` (float64, a row per parameter): lr_mult and weight decay. `blocks` is the GPU's split of the work
    into thread blocks; the CPU walks whole segments in order.
    """
    for (w, g, h, n), (lr_mult, decay) in zip(segments.tolist(), factors.tolist()):
        dw = arena[g:g + n]
        if clip_scale != 1.0:
            dw *= _s(dw, clip_scale)
        if iter_scale != 1.0:
            dw *= _s(dw, iter_scale)
        regularize(arena[w:w + n], dw, decay, l1)
        sgd_update(arena[w:w + n], dw, arena[h:h + n], rate * lr_mult, momentum)


def multi_zero_grads(arena: np.ndarray, segments: np.ndarray, blocks: np.ndarray) -> None:
    """Zero the gradient of every segment (see multi_sgd_update for the tables)."""
    for _w, g, _h, n in segments.tolist():
        arena[g:g + n] = 0
