"""GPU twins of backend/cpu/neuron_extra.py: the shared neuron kernels of kernels/neuron_extra.py, selected by
op code, and PReLU (its slope gradient is a per-channel row sum, kernels/rows.py)."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek, neuron_extra as nk, rows as rk
from superneurons.backend.cuda.ops._rows import row_sums

__all__ = ["prelu_forward", "prelu_backward", "elu_forward", "elu_backward", "absval_forward", "absval_backward",
           "bnll_forward", "bnll_backward", "exp_forward", "exp_backward", "log_forward", "log_backward",
           "power_forward", "power_backward", "threshold_forward"]


def _forward(code: int, x, y, p0: float = 0.0, p1: float = 0.0, p2: float = 0.0) -> None:
    if y.size:
        K.launch(nk.neuron_forward, y.size)(flat(x), flat(y), code, scalar(y, p0), scalar(y, p1), scalar(y, p2))


def _backward(code: int, v, dy, dx, p0: float = 0.0, p1: float = 0.0, p2: float = 0.0, p3: float = 0.0) -> None:
    if dx.size:
        K.launch(nk.neuron_backward, dx.size)(flat(v), flat(dy), flat(dx), code, scalar(dx, p0), scalar(dx, p1),
                                              scalar(dx, p2), scalar(dx, p3))


def prelu_forward(x, slope, y, outer: int, channels: int, inner: int) -> None:
    if y.size:
        K.launch(nk.prelu_forward, y.size)(flat(x), flat(slope), flat(y), channels, inner)


def prelu_backward(x, slope, dy, dx, dslope, outer: int, channels: int, inner: int) -> None:
    """dslope += per-channel (or total) sum of dy * x where x <= 0; dx = dy * (1 or slope). None skips one."""
    if dslope is not None:
        sums = row_sums(x, dy, outer, channels, inner, rk.NEG_DOT, "prelu")
        finish = rk.scaled_rows if dslope.size == channels else rk.total_into
        K.launch(finish, dslope.size)(sums, flat(dslope), 1.0, True)
    if dx is not None and dx.size:
        K.launch(nk.prelu_backward, dx.size)(flat(x), flat(slope), flat(dy), flat(dx), channels, inner)


def elu_forward(x, y, alpha: float) -> None:
    _forward(nk.ELU, x, y, alpha)


def elu_backward(y, dy, dx, alpha: float) -> None:
    _backward(nk.ELU, y, dy, dx, alpha)


def absval_forward(x, y) -> None:
    _forward(nk.ABSVAL, x, y)


def absval_backward(x, dy, dx) -> None:
    _backward(nk.ABSVAL, x, dy, dx)


def bnll_forward(x, y) -> None:
    _forward(nk.BNLL, x, y)


def bnll_backward(y, dy, dx) -> None:
    _backward(nk.BNLL, y, dy, dx)


def exp_forward(x, y, log_base: float, scale: float, shift: float) -> None:
    _forward(nk.EXP, x, y, log_base * shift, log_base * scale)


def exp_backward(y, dy, dx, log_base: float, scale: float) -> None:
    _backward(nk.EXP, y, dy, dx, log_base * scale)


def log_forward(x, y, log_base: float, scale: float, shift: float) -> None:
    _forward(nk.LOG, x, y, shift, scale, 1.0 / log_base)


def log_backward(x, dy, dx, log_base: float, scale: float, shift: float) -> None:
    _backward(nk.LOG, x, dy, dx, scale / log_base, shift, scale)


def power_forward(x, y, power: float, scale: float, shift: float) -> None:
    if power == 0.0 or scale == 0.0:
        if y.size:  # a constant, as on the CPU
            K.launch(ek.fill, y.size)(flat(y), scalar(y, 1.0) if power == 0.0 else scalar(y, shift) ** scalar(y, power))
        return
    _forward(nk.POWER, x, y, shift, scale, power)


def power_backward(x, dy, dx, power: float, scale: float, shift: float) -> None:
    """dx = dy * power * scale * (shift + scale * x) ** (power - 1); x is not read when that is constant."""
    if not dx.size:
        return
    if power == 0.0 or scale == 0.0:
        K.launch(ek.fill, dx.size)(flat(dx), scalar(dx, 0.0))
    elif power == 1.0:
        K.launch(ek.scale_copy, dx.size)(scalar(dx, scale), flat(dy), flat(dx))
    else:
        _backward(nk.POWER, x, dy, dx, power * scale, shift, scale, power - 1.0)


def threshold_forward(x, y, threshold: float) -> None:
    _forward(nk.THRESHOLD, x, y, threshold)
