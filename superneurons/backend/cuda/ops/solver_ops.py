"""Parameter updates: one fused kernel per solver rule (see backend/cpu/solver_ops.py for the rules), and the
multi-tensor ops: one kernel for every parameter's update or gradient clearing."""
from __future__ import annotations

import math

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import solver as sk

__all__ = ["regularize", "sgd_update", "nesterov_update", "adagrad_update", "rmsprop_update", "adadelta_update",
           "adam_update", "multi_sgd_update", "multi_zero_grads"]


def _run(kernel, w, *arrays_then_scalars) -> None:
    if w.size:
        K.launch(kernel, w.size)(*[flat(a) if hasattr(a, "gpu_data") else scalar(w, a)
                                   for a in arrays_then_scalars])


def regularize(w, dw, decay: float, l1: bool = False) -> None:
    if decay != 0.0 and w.size:
        K.launch(sk.regularize, w.size)(flat(w), flat(dw), scalar(w, decay), bool(l1))


def sgd_update(w, dw, hist, lr: float, momentum: float) -> None:
    _run(sk.sgd, w, w, dw, hist, lr, momentum)


def nesterov_update(w, dw, hist, lr: float, momentum: float) -> None:
    _run(sk.nesterov, w, w, dw, hist, lr, momentum)


def adagrad_update(w, dw, hist, lr: float, delta: float) -> None:
    _run(sk.adagrad, w, w, dw, hist, lr, delta)


def rmsprop_update(w, dw, hist, lr: float, rms_decay: float, delta: float) -> None:
    _run(sk.rmsprop, w, w, dw, hist, lr, rms_decay, delta)


def adadelta_update(w, dw, hist_g, hist_dx, lr: float, momentum: float, delta: float) -> None:
    _run(sk.adadelta, w, w, dw, hist_g, hist_dx, lr, momentum, delta)


def adam_update(w, dw, m, v, lr: float, beta1: float, beta2: float, eps: float, t: int) -> None:
    correction = math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
    _run(sk.adam, w, w, dw, m, v, lr * correction, beta1, beta2, eps)


def multi_sgd_update(arena, segments, factors, blocks, rate: float, momentum: float, clip_scale: float,
                     iter_scale: float, l1: bool) -> None:
    """One launch, a thread block per row of `blocks` (see the CPU op for the tables). The rate goes in as a
    float64 scalar: it may change every iteration, the tables stay on the device."""
    if blocks.shape[0]:
        K.launch(sk.multi_sgd, 0, blocks=blocks.shape[0])(
            arena, segments, factors, blocks, float(rate), scalar(arena, momentum), scalar(arena, clip_scale),
            scalar(arena, iter_scale), bool(l1))


def multi_zero_grads(arena, segments, blocks) -> None:
    if blocks.shape[0]:
        K.launch(sk.multi_zero_grads, 0, blocks=blocks.shape[0])(arena, segments, blocks)
