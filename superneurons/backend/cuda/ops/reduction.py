"""GPU twins of backend/cpu/reduction.py: row sums (kernels/rows.py) scaled into the top, a broadcast
backward, and ArgMax as a per-column top-k selection."""
from __future__ import annotations

from superneurons.backend.cpu.reduction import REDUCTIONS
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import reduction as rdk, rows as rk, shape_ops as sk
from superneurons.backend.cuda.ops._rows import row_sums

__all__ = ["reduction_forward", "reduction_backward", "argmax_forward"]

_MODES = {"SUM": rk.SUM, "ASUM": rk.ASUM, "SUMSQ": rk.SUMSQ, "MEAN": rk.SUM}
_DERIVATIVES = {"SUM": rdk.CONSTANT, "MEAN": rdk.CONSTANT, "ASUM": rdk.SIGN, "SUMSQ": rdk.LINEAR}


def _check(op: str) -> None:
    if op not in _MODES:
        raise ValueError(f"unknown reduction {op!r}; one of {', '.join(REDUCTIONS)}")


def reduction_forward(x, y, op: str, coeff: float, outer: int, inner: int, scratch=None) -> None:
    """y[outer] = coeff * reduce(x viewed as (outer, inner)) over inner."""
    _check(op)
    if not y.size:
        return
    sums = row_sums(x, None, 1, outer, inner, _MODES[op], scratch)
    scale = coeff / inner if op == "MEAN" else coeff
    K.launch(rk.scaled_rows, outer)(sums, flat(y), float(scale), False)


def reduction_backward(x, dy, dx, op: str, coeff: float, outer: int, inner: int) -> None:
    """dx = coeff * dy[outer] * d(reduce)/dx; x is read only by ASUM and SUMSQ."""
    _check(op)
    if not dx.size:
        return
    scale = {"SUM": coeff, "MEAN": coeff / inner, "ASUM": coeff, "SUMSQ": 2.0 * coeff}[op]
    xs = flat(x) if x is not None else flat(dx)
    K.launch(rdk.reduction_backward, dx.size)(xs, flat(dy), flat(dx), inner, _DERIVATIVES[op], scalar(dx, scale))


def argmax_forward(x, y, top_k: int, out_max_val: bool, by_axis: bool) -> None:
    """Caffe's ArgMax on x viewed as (outer, dim, inner); see the CPU op for the layouts."""
    outer, dim, inner = x.shape
    if outer * inner and y.size:
        K.launch(sk.argmax, outer * inner)(flat(x), flat(y), outer, dim, inner, int(top_k), bool(out_max_val),
                                            bool(by_axis))
