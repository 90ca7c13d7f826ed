"""The extra elementwise neurons (backend/cpu/neuron_extra.py) as two shared kernels selected by an op code,
plus PReLU's per-channel slope kernels. The code is uniform across the grid, so the branch costs nothing
next to the memory traffic, and one kernel stands for eight near-identical ones.

Parameters p0..p3 are the op's scalars, already combined on the host (see ops/neuron_extra.py).
"""
from __future__ import annotations

import math

from numba import cuda

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
def neuron_forward(x, y, code, p0, p1, p2):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        y[i] = forward_value(code, x[i], p0, p1, p2)


@cuda.jit
def neuron_backward(v, dy, dx, code, p0, p1, p2, p3):
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        dx[i] = backward_value(code, v[i], dy[i], p0, p1, p2, p3)


@cuda.jit(device=True)
def slope_of(slope, i, channels, inner):
    """The slope of flat element i of an (outer, channels, inner) view: per channel, or the one shared value."""
    return slope[(i // inner) % channels] if slope.size > 1 else slope[0]


@cuda.jit
def prelu_forward(x, slope, y, channels, inner):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = x[i]
        y[i] = v if v > 0 else v * slope_of(slope, i, channels, inner)


@cuda.jit
def prelu_backward(x, slope, dy, dx, channels, inner):
    """dx = dy where x > 0, dy * slope where x <= 0 (dx may be dy)."""
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        g = dy[i]
        dx[i] = g if x[i] > 0 else g * slope_of(slope, i, channels, inner)
