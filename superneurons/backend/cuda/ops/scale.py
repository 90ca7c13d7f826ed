"""Per-channel multiply over (outer, dim, inner) views and the multiplier's gradient."""
from __future__ import annotations

import numpy as np

from superneurons import settings
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import elementwise as ek, reduce as rk
from superneurons.backend.cuda.ops._rows import take
from superneurons.backend.scratch import row_sums

__all__ = ["channel_mul", "channel_mul_grad"]

# Per-channel reductions split over (channel, chunk of planes) blocks (kernels/reduce.py), their partial sums
# in the run's scratch region; SUPERNEURONS_CUDA_SPREAD=0 keeps the one-block-per-channel kernels.


def spread() -> bool:
    return settings.get("SUPERNEURONS_CUDA_SPREAD")


def channel_partials(x, y, mean, inv, outer: int, dim: int, inner: int, mode: int, scratch):
    """float64 sums[2 * dim] of x (and x*x), x*y, or BatchNorm backward's dy and dy*x_hat (see reduce.py), in
    the scratch region (backend/scratch.py: row_sums(dim) entries)."""
    sums = take(scratch, row_sums(dim))
    K.launch(ek.fill, sums.size)(sums, np.float64(0.0))
    chunk, blocks = rk.chunking(outer, dim)
    fx = flat(x)
    K.launch(rk.channel_partials, 0, blocks=blocks)(fx, flat(y) if y is not None else fx,
                                                     flat(mean) if mean is not None else fx,
                                                     flat(inv) if inv is not None else fx, sums, outer, dim, inner,
                                                     chunk, mode)
    return sums


def channel_sum(x, out, outer: int, dim: int, inner: int, accumulate: bool, scratch) -> None:
    sums = channel_partials(x, None, None, None, outer, dim, inner, 1, scratch)
    K.launch(rk.channel_finish, dim)(sums, flat(out), bool(accumulate))


def channel_mul(x, s, y, outer: int, dim: int, inner: int) -> None:
    if y.size:
        K.launch(ek.channel_mul, y.size)(flat(x), flat(s), flat(y), dim, inner)


def channel_mul_grad(x, dy, ds, outer: int, dim: int, inner: int, accumulate: bool, scratch=None) -> None:
    if spread():
        sums = channel_partials(x, dy, None, None, outer, dim, inner, 2, scratch)
        K.launch(rk.channel_finish, dim)(sums, flat(ds), bool(accumulate))
        return
    K.launch(rk.channel_dot, 0, blocks=dim)(flat(x), flat(dy), flat(ds), outer, dim, inner, bool(accumulate))
