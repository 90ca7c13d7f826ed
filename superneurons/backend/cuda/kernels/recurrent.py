"""The LSTM cell of one time step (backend/cpu/recurrent.py has the equations): one thread per (stream, unit)."""
from __future__ import annotations

import math

from numba import cuda


@cuda.jit(device=True)
def sigmoid(v):
    return 1.0 / (1.0 + math.exp(-v))


@cuda.jit
def lstm_unit_forward(c_prev, x, cont, c, h, hidden):
    for e in range(cuda.grid(1), c.size, cuda.gridsize(1)):
        n = e // hidden
        base = n * 4 * hidden + e - n * hidden
        i = sigmoid(x[base])
        f = cont[n] * sigmoid(x[base + hidden])
        o = sigmoid(x[base + 2 * hidden])
        g = math.tanh(x[base + 3 * hidden])
        cell = f * c_prev[e] + i * g
        c[e] = cell
        h[e] = o * math.tanh(cell)


@cuda.jit
def lstm_unit_backward(c_prev, x, cont, dc, dh, dc_prev, dx, hidden, want_dc_prev, want_dx):
    for e in range(cuda.grid(1), c_prev.size, cuda.gridsize(1)):
        n = e // hidden
        base = n * 4 * hidden + e - n * hidden
        i = sigmoid(x[base])
        sf = sigmoid(x[base + hidden])
        k = cont[n]
        o = sigmoid(x[base + 2 * hidden])
        g = math.tanh(x[base + 3 * hidden])
        cp = c_prev[e]
        tanh_c = math.tanh(k * sf * cp + i * g)
        dcell = dc[e] + dh[e] * o * (1.0 - tanh_c * tanh_c)
        if want_dc_prev:
            dc_prev[e] = dcell * k * sf
        if want_dx:
            dx[base] = dcell * g * i * (1.0 - i)
            dx[base + hidden] = dcell * cp * k * sf * (1.0 - sf)
            dx[base + 2 * hidden] = dh[e] * tanh_c * o * (1.0 - o)
            dx[base + 3 * hidden] = dcell * i * (1.0 - g * g)
