"""GPU twin of backend/cpu/mvn.py: float64 row sums (kernels/rows.py), then one elementwise pass."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import mvn as mk, rows as rk
from superneurons.backend.cuda.ops._rows import row_sums

__all__ = ["mvn_forward", "mvn_backward"]


def mvn_forward(x, y, sigma, rows: int, n: int, eps: float, scratch=None) -> None:
    """y = x - mean(x) per row; with `sigma` given, sigma = sqrt(E[x^2] - E[x]^2) + eps and y /= sigma."""
    if not y.size:
        return
    normalize = sigma is not None
    sums = row_sums(x, None, 1, rows, n, rk.MOMENTS if normalize else rk.SUM, scratch)
    if normalize:
        K.launch(mk.sigma, rows)(sums, flat(sigma), float(n), scalar(sigma, eps))
    K.launch(mk.forward, y.size)(flat(x), flat(y), sums, flat(sigma) if normalize else flat(x), n, normalize)


def mvn_backward(y, dy, dx, sigma, rows: int, n: int, scratch=None) -> None:
    """dx = dy - mean(dy); normalized: dx = (dy - mean(dy) - y * mean(dy * y)) / sigma (reads y, not x)."""
    if not dx.size:
        return
    normalize = sigma is not None
    if normalize:
        sums = row_sums(y, dy, 1, rows, n, rk.DOT, scratch)
    else:
        sums = row_sums(dy, None, 1, rows, n, rk.SUM, scratch)
    ys = flat(y) if normalize else flat(dy)
    K.launch(mk.backward, dx.size)(ys, flat(dy), flat(dx), sums, flat(sigma) if normalize else flat(dy), n,
                                   normalize)
