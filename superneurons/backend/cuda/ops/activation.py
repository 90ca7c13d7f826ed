"""The activations' GPU ops (twins of backend/cpu/activation.py), each beside the numba kernels it launches.

The kernels import only numba.cuda and math, so they also run under the CUDA simulator
(NUMBA_ENABLE_CUDASIM=1, tests/test_cuda_zoo_ops_sim.py). ReLU's kernels live in kernels/elementwise.py, which
the fused ReLU paths share. Sigmoid, TanH, ELU, BNLL and Exp read the output in backward, so they work in place.

ELU, AbsVal, BNLL, Exp, Log, Power and Threshold are two shared kernels selected by an op code
(`forward_value`, `backward_value`): the code is uniform across the grid, so the branch costs nothing next to
the memory traffic, and one kernel stands for seven near-identical ones. Their parameters p0..p3 are the op's
scalars, already combined on the host.
"""
from __future__ import annotations

import math

from numba import cuda

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek, rows as rk
from superneurons.backend.cuda.ops._rows import row_sums

__all__ = ["relu_forward", "relu_backward", "sigmoid_forward", "sigmoid_backward", "tanh_forward", "tanh_backward",
           "prelu_forward", "prelu_backward", "elu_forward", "elu_backward", "absval_forward", "absval_backward",
           "bnll_forward", "bnll_backward", "exp_forward", "exp_backward", "log_forward", "log_backward",
           "power_forward", "power_backward", "threshold_forward", "clip_forward", "clip_backward",
           "swish_forward", "swish_backward"]


def _run(kernel, out, *arrays) -> None:
    """`kernel` over the flat views of `arrays`, one thread per element of `out`."""
    if out.size:
        K.launch(kernel, out.size)(*[flat(a) for a in arrays])


# -- ReLU ------------------------------------------------------------------------------------------------------

def relu_forward(x, y, slope: float) -> None:
    if y.size:
        K.launch_unrolled(ek.relu_forward, y.size)(flat(x), flat(y), scalar(y, slope))


def relu_backward(y, dy, dx, slope: float) -> None:
    if dx.size:
        K.launch_unrolled(ek.relu_backward, dx.size)(flat(y), flat(dy), flat(dx), scalar(dx, slope))


# -- Sigmoid and TanH ------------------------------------------------------------------------------------------

@cuda.jit
def sigmoid_forward_kernel(x, y):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = 0.5 * math.tanh(0.5 * x[i]) + 0.5


@cuda.jit
def sigmoid_backward_kernel(y, dy, dx):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        v = y[i]
        dx[i] = dy[i] * (v * (1 - v))


def sigmoid_forward(x, y) -> None:
    _run(sigmoid_forward_kernel, y, x, y)


def sigmoid_backward(y, dy, dx) -> None:
    _run(sigmoid_backward_kernel, dx, y, dy, dx)


@cuda.jit
def tanh_forward_kernel(x, y):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = math.tanh(x[i])


@cuda.jit
def tanh_backward_kernel(y, dy, dx):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        v = y[i]
        dx[i] = dy[i] * (1 - v * v)


def tanh_forward(x, y) -> None:
    _run(tanh_forward_kernel, y, x, y)


def tanh_backward(y, dy, dx) -> None:
    _run(tanh_backward_kernel, dx, y, dy, dx)


# -- ELU, AbsVal, BNLL, Exp, Log, Power, Threshold (shared kernels) and PReLU ------------------------------------

ELU, ABSVAL, BNLL, EXP, LOG, POWER, THRESHOLD = range(7)


@cuda.jit(device=True)
def forward_value(code, v, p0, p1, p2):
    if code == ELU:  # p0 = alpha
        return v if v > 0 else p0 * math.expm1(min(v, 0.0))
    if code == ABSVAL:
        return abs(v)
    if code == BNLL:  # max(x, 0) + log1p(exp(-|x|)): never overflows
        return max(v, 0.0) + math.log1p(math.exp(-abs(v)))
    if code == EXP:  # p0 = ln(base) shift, p1 = ln(base) scale
        return math.exp(p0 + p1 * v)
    if code == LOG:  # p0 = shift, p1 = scale, p2 = 1 / ln(base)
        return math.log(p0 + p1 * v) * p2
    if code == POWER:  # p0 = shift, p1 = scale, p2 = power
        return (p0 + p1 * v) ** p2
    return 1.0 if v > p0 else 0.0  # THRESHOLD: p0 = threshold


@cuda.jit(device=True)
def backward_value(code, v, g, p0, p1, p2, p3):
    """d/dx times the top diff g; v is the output (ELU, BNLL, EXP) or the input (ABSVAL, LOG, POWER)."""
    if code == ELU:  # p0 = alpha
        return g if v > 0 else g * (v + p0)
    if code == ABSVAL:
        return g if v > 0 else (-g if v < 0 else 0.0 * g)
    if code == BNLL:  # sigmoid(x) = 1 - exp(-y)
        return g * -math.expm1(-v)
    if code == EXP:  # p0 = ln(base) scale
        return g * (v * p0)
    if code == LOG:  # p0 = scale / ln(base), p1 = shift, p2 = scale
        return (g * p0) / (p1 + p2 * v)
    # POWER: p0 = power scale, p1 = shift, p2 = scale, p3 = power - 1
    return g * (p0 * (p1 + p2 * v) ** p3)


@cuda.jit
def neuron_forward_kernel(x, y, code, p0, p1, p2):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = forward_value(code, x[i], p0, p1, p2)


@cuda.jit
def neuron_backward_kernel(v, dy, dx, code, p0, p1, p2, p3):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        dx[i] = backward_value(code, v[i], dy[i], p0, p1, p2, p3)


@cuda.jit(device=True)
def slope_of(slope, i, channels, inner):
    """The slope of flat element i of an (outer, channels, inner) view: per channel, or the one shared value."""
    return slope[(i // inner) % channels] if slope.size > 1 else slope[0]


@cuda.jit
def prelu_forward_kernel(x, slope, y, channels, inner):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = x[i]
        y[i] = v if v > 0 else v * slope_of(slope, i, channels, inner)


@cuda.jit
def prelu_backward_kernel(x, slope, dy, dx, channels, inner):
    """dx = dy where x > 0, dy * slope where x <= 0 (dx may be dy)."""
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        g = dy[i]
        dx[i] = g if x[i] > 0 else g * slope_of(slope, i, channels, inner)


def _forward(code: int, x, y, p0: float = 0.0, p1: float = 0.0, p2: float = 0.0) -> None:
    if y.size:
        K.launch(neuron_forward_kernel, y.size)(flat(x), flat(y), code, scalar(y, p0), scalar(y, p1), scalar(y, p2))


def _backward(code: int, v, dy, dx, p0: float = 0.0, p1: float = 0.0, p2: float = 0.0, p3: float = 0.0) -> None:
    if dx.size:
        K.launch(neuron_backward_kernel, dx.size)(flat(v), flat(dy), flat(dx), code, scalar(dx, p0), scalar(dx, p1),
                                              scalar(dx, p2), scalar(dx, p3))


def prelu_forward(x, slope, y, outer: int, channels: int, inner: int) -> None:
    if y.size:
        K.launch(prelu_forward_kernel, y.size)(flat(x), flat(slope), flat(y), channels, inner)


def prelu_backward(x, slope, dy, dx, dslope, outer: int, channels: int, inner: int, scratch=None) -> None:
    """dslope += per-channel (or total) sum of dy * x where x <= 0; dx = dy * (1 or slope). None skips one."""
    if dslope is not None:
        sums = row_sums(x, dy, outer, channels, inner, rk.NEG_DOT, scratch)
        finish = rk.scaled_rows if dslope.size == channels else rk.total_into
        K.launch(finish, dslope.size)(sums, flat(dslope), 1.0, True)
    if dx is not None and dx.size:
        K.launch(prelu_backward_kernel, dx.size)(flat(x), flat(slope), flat(dy), flat(dx), channels, inner)


def elu_forward(x, y, alpha: float) -> None:
    _forward(ELU, x, y, alpha)


def elu_backward(y, dy, dx, alpha: float) -> None:
    _backward(ELU, y, dy, dx, alpha)


def absval_forward(x, y) -> None:
    _forward(ABSVAL, x, y)


def absval_backward(x, dy, dx) -> None:
    _backward(ABSVAL, x, dy, dx)


def bnll_forward(x, y) -> None:
    _forward(BNLL, x, y)


def bnll_backward(y, dy, dx) -> None:
    _backward(BNLL, y, dy, dx)


def exp_forward(x, y, log_base: float, scale: float, shift: float) -> None:
    _forward(EXP, x, y, log_base * shift, log_base * scale)


def exp_backward(y, dy, dx, log_base: float, scale: float) -> None:
    _backward(EXP, y, dy, dx, log_base * scale)


def log_forward(x, y, log_base: float, scale: float, shift: float) -> None:
    _forward(LOG, x, y, shift, scale, 1.0 / log_base)


def log_backward(x, dy, dx, log_base: float, scale: float, shift: float) -> None:
    _backward(LOG, x, dy, dx, scale / log_base, shift, scale)


def power_forward(x, y, power: float, scale: float, shift: float) -> None:
    if power == 0.0 or scale == 0.0:
        if y.size:  # a constant, as on the CPU
            K.launch(ek.fill, y.size)(flat(y), scalar(y, 1.0) if power == 0.0 else scalar(y, shift) ** scalar(y, power))
        return
    _forward(POWER, x, y, shift, scale, power)


def power_backward(x, dy, dx, power: float, scale: float, shift: float) -> None:
    """dx = dy * power * scale * (shift + scale * x) ** (power - 1); x is not read when that is constant."""
    if not dx.size:
        return
    if power == 0.0 or scale == 0.0:
        K.launch(ek.fill, dx.size)(flat(dx), scalar(dx, 0.0))
    elif power == 1.0:
        K.launch(ek.scale_copy, dx.size)(scalar(dx, scale), flat(dy), flat(dx))
    else:
        _backward(POWER, x, dy, dx, power * scale, shift, scale, power - 1.0)


def threshold_forward(x, y, threshold: float) -> None:
    _forward(THRESHOLD, x, y, threshold)


# -- Clip --------------------------------------------------------------------------------------------------------

@cuda.jit
def clip_forward_kernel(x, y, low, high):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = max(low, min(x[i], high))


@cuda.jit
def clip_backward_kernel(x, dy, dx, low, high):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        v = x[i]
        dx[i] = dy[i] if low <= v <= high else 0.0 * dy[i]


def clip_forward(x, y, low: float, high: float) -> None:
    if y.size:
        K.launch(clip_forward_kernel, y.size)(flat(x), flat(y), scalar(y, low), scalar(y, high))


def clip_backward(x, dy, dx, low: float, high: float) -> None:
    if dx.size:
        K.launch(clip_backward_kernel, dx.size)(flat(x), flat(dy), flat(dx), scalar(dx, low), scalar(dx, high))


# -- Swish -------------------------------------------------------------------------------------------------------

@cuda.jit
def swish_forward_kernel(x, y, beta):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = x[i]
        y[i] = v * (0.5 * math.tanh(0.5 * beta * v) + 0.5)


@cuda.jit
def swish_backward_kernel(x, dy, dx, beta):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        bx = beta * x[i]
        s = 0.5 * math.tanh(0.5 * bx) + 0.5
        dx[i] = dy[i] * (s + bx * s * (1 - s))


def swish_forward(x, y, beta: float) -> None:
    if y.size:
        K.launch(swish_forward_kernel, y.size)(flat(x), flat(y), scalar(y, beta))


def swish_backward(x, dy, dx, beta: float) -> None:
    if dx.size:
        K.launch(swish_backward_kernel, dx.size)(flat(x), flat(dy), flat(dx), scalar(dx, beta))
