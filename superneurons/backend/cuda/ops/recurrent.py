"""GPU twin of backend/cpu/recurrent.py: the LSTM cell of one time step, one kernel each way."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import recurrent as rk

__all__ = ["lstm_unit_forward", "lstm_unit_backward"]


def lstm_unit_forward(c_prev, x, cont, c, h) -> None:
    """c = cont * f * c_prev + i * g; h = o * tanh(c) (c_prev, c, h: (1, N, H); x: (1, N, 4H); cont: (1, N))."""
    if c.size:
        K.launch(rk.lstm_unit_forward, c.size)(flat(c_prev), flat(x), flat(cont), flat(c), flat(h),
                                               c_prev.shape[2])


def lstm_unit_backward(c_prev, x, cont, dc, dh, dc_prev, dx) -> None:
    """dc_prev and dx (overwritten; None skips one) from the gradients dc, dh of the unit's two tops."""
    if not c_prev.size or (dc_prev is None and dx is None):
        return
    K.launch(rk.lstm_unit_backward, c_prev.size)(
        flat(c_prev), flat(x), flat(cont), flat(dc), flat(dh), flat(dc_prev if dc_prev is not None else c_prev),
        flat(dx if dx is not None else x), c_prev.shape[2], dc_prev is not None, dx is not None)
