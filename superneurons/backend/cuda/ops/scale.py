"""Per-channel multiply over (outer, dim, inner) views and the multiplier's gradient."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import elementwise as ek, reduce as rk

__all__ = ["channel_mul", "channel_mul_grad"]


def channel_mul(x, s, y, outer: int, dim: int, inner: int) -> None:
    if y.size:
        K.launch(ek.channel_mul, y.size)(flat(x), flat(s), flat(y), dim, inner)


def channel_mul_grad(x, dy, ds, outer: int, dim: int, inner: int, accumulate: bool) -> None:
    K.launch(rk.channel_dot, 0, blocks=dim)(flat(x), flat(dy), flat(ds), outer, dim, inner, bool(accumulate))
