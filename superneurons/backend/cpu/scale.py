"""Per-channel multiply: a blob viewed as (outer, dim, inner) times a vector of `dim` (Scale, BatchNorm)."""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need

__all__ = ["channel_mul", "channel_mul_grad"]


def channel_mul(x: np.ndarray, s: np.ndarray, y: np.ndarray, outer: int, dim: int, inner: int) -> None:
    """y = x * s[dim] broadcast over outer and inner. `y` may be `x` (in place)."""
    np.multiply(x.reshape(outer, dim, inner), s.reshape(1, dim, 1), out=y.reshape(outer, dim, inner))


def channel_mul_grad(x: np.ndarray, dy: np.ndarray, ds: np.ndarray, outer: int, dim: int, inner: int,
                     accumulate: bool, scratch: Any = None) -> None:
    """ds[dim] (+)= sum over outer and inner of x * dy: the gradient of the multiplier.

    `accumulate` is True for a learned parameter (param diffs add up, as in Caffe) and False
    when the multiplier is a bottom blob (bottom diffs are overwritten).
    """
    need.check(scratch, need.row_sums(dim), "channel_mul_grad")
    prod = x.reshape(outer, dim, inner) * dy.reshape(outer, dim, inner)
    total = prod.sum(axis=(0, 2)).reshape(ds.shape)
    if accumulate:
        ds += total
    else:
        np.copyto(ds, total)
