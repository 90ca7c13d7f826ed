"""Elementwise activations (numba kernels); backward reads the output, so in place is safe."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek

__all__ = ["relu_forward", "relu_backward", "sigmoid_forward", "sigmoid_backward", "tanh_forward", "tanh_backward"]


def _run(kernel, out, *args) -> None:
    if out.size:
        K.launch(kernel, out.size)(*[flat(a) if hasattr(a, "gpu_data") else a for a in args])


def relu_forward(x, y, slope: float) -> None:
    if y.size:
        K.launch_unrolled(ek.relu_forward, y.size)(flat(x), flat(y), scalar(y, slope))


def relu_backward(y, dy, dx, slope: float) -> None:
    if dx.size:
        K.launch_unrolled(ek.relu_backward, dx.size)(flat(y), flat(dy), flat(dx), scalar(dx, slope))


def sigmoid_forward(x, y) -> None:
    _run(ek.sigmoid_forward, y, x, y)


def sigmoid_backward(y, dy, dx) -> None:
    _run(ek.sigmoid_backward, dx, y, dy, dx)


def tanh_forward(x, y) -> None:
    _run(ek.tanh_forward, y, x, y)


def tanh_backward(y, dy, dx) -> None:
    _run(ek.tanh_backward, dx, y, dy, dx)
