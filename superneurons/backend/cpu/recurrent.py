"""The LSTM cell of one time step (Caffe's LSTMUnit), over (1, N, H) cells and (1, N, 4H) gate inputs.

The gate input of each stream holds the pre-activations [i', f', o', g'] in that order; with
i, f, o = sigmoid(i', f', o'), g = tanh(g') and cont the stream's continuation flag:

    c = cont * f * c_prev + i * g,        h = o * tanh(c)

Backward recomputes the gates and c from the bottoms (no scratch kept between the passes). The forget
gate's gradient is cont * f * (1 - f), the derivative of the formula above, which is Caffe's value for the
0/1 flags it accepts.
"""
from __future__ import annotations

import numpy as np

__all__ = ["lstm_unit_forward", "lstm_unit_backward"]


def _gates(x: np.ndarray, cont: np.ndarray, hidden: int):
    x2 = x.reshape(-1, 4 * hidden)
    sig = 1.0 / (1.0 + np.exp(-x2[:, :3 * hidden]))
    i, f, o = sig[:, :hidden], sig[:, hidden:2 * hidden], sig[:, 2 * hidden:]
    g = np.tanh(x2[:, 3 * hidden:])
    return i, f, o, g, cont.reshape(-1, 1)


def lstm_unit_forward(c_prev: np.ndarray, x: np.ndarray, cont: np.ndarray, c: np.ndarray, h: np.ndarray) -> None:
    """c = cont * f * c_prev + i * g; h = o * tanh(c) (c_prev, c, h: (1, N, H); x: (1, N, 4H); cont: (1, N))."""
    hidden = c_prev.shape[-1]
    i, f, o, g, k = _gates(x, cont, hidden)
    c2 = (k * f) * c_prev.reshape(-1, hidden) + i * g
    c[...] = c2.reshape(c.shape)
    h[...] = (o * np.tanh(c2)).reshape(h.shape)


def lstm_unit_backward(c_prev: np.ndarray, x: np.ndarray, cont: np.ndarray, dc: np.ndarray, dh: np.ndarray,
                       dc_prev: np.ndarray | None, dx: np.ndarray | None) -> None:
    """dc_prev and dx (overwritten; None skips one) from the gradients dc, dh of the unit's two tops."""
    hidden = c_prev.shape[-1]
    i, f, o, g, k = _gates(x, cont, hidden)
    cp = c_prev.reshape(-1, hidden)
    tanh_c = np.tanh((k * f) * cp + i * g)
    dh2 = dh.reshape(-1, hidden)
    dcell = dc.reshape(-1, hidden) + dh2 * o * (1 - tanh_c * tanh_c)
    if dc_prev is not None:
        dc_prev[...] = (dcell * (k * f)).reshape(dc_prev.shape)
    if dx is not None:
        dx2 = dx.reshape(-1, 4 * hidden)
        dx2[:, :hidden] = dcell * g * i * (1 - i)
        dx2[:, hidden:2 * hidden] = dcell * cp * k * f * (1 - f)
        dx2[:, 2 * hidden:3 * hidden] = dh2 * tanh_c * o * (1 - o)
        dx2[:, 3 * hidden:] = dcell * i * (1 - g * g)
