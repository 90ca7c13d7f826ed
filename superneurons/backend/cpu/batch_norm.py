"""Batch normalization over a blob viewed as (outer, channels, inner): statistics per channel.

Caffe's BatchNorm only normalizes; the learned scale and shift are a following Scale layer.
Its running statistics are sums with a scale factor: mean = mean_sum / scale_factor.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need

__all__ = ["bn_batch_stats", "bn_running_update", "bn_global_stats", "bn_normalize", "bn_backward"]


def _view(x: np.ndarray, outer: int, channels: int, inner: int) -> np.ndarray:
    return x.reshape(outer, channels, inner)


def bn_batch_stats(x: np.ndarray, mean: np.ndarray, var: np.ndarray, outer: int, channels: int, inner: int,
                   scratch: Any = None) -> None:
    """mean, var[channels] = mean and biased variance of x over outer and inner."""
    need.check(scratch, need.row_sums(channels), "bn_batch_stats")
    x3 = _view(x, outer, channels, inner)
    np.mean(x3, axis=(0, 2), out=mean)
    centered = x3 - mean.reshape(1, channels, 1)
    np.mean(centered * centered, axis=(0, 2), out=var)


def bn_running_update(mean_sum: np.ndarray, var_sum: np.ndarray, scale_factor: np.ndarray, mean: np.ndarray,
                      var: np.ndarray, moving_average_fraction: float, var_correction: float) -> None:
    """Decay the running sums by `moving_average_fraction` and add this batch (variance made unbiased)."""
    dt = mean_sum.dtype.type
    maf = dt(moving_average_fraction)
    scale_factor *= maf
    scale_factor += dt(1)
    mean_sum *= maf
    mean_sum += mean
    var_sum *= maf
    var_sum += dt(var_correction) * var


def bn_global_stats(mean_sum: np.ndarray, var_sum: np.ndarray, scale_factor: np.ndarray, mean: np.ndarray,
                    var: np.ndarray) -> None:
    """mean, var = the running sums divided by the scale factor (0 while nothing was accumulated)."""
    factor = scale_factor.reshape(())
    inv = mean.dtype.type(0) if factor == 0 else mean.dtype.type(1) / factor
    np.multiply(mean_sum, inv, out=mean)
    np.multiply(var_sum, inv, out=var)


def bn_normalize(x: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float, inv_std: np.ndarray, y: np.ndarray,
                 outer: int, channels: int, inner: int) -> None:
    """inv_std = 1 / sqrt(var + eps); y = (x - mean) * inv_std. `y` may be `x`."""
    np.add(var, var.dtype.type(eps), out=inv_std)
    np.sqrt(inv_std, out=inv_std)
    np.reciprocal(inv_std, out=inv_std)
    bn_normalized(x, mean, inv_std, y, outer, channels, inner)


def bn_normalized(x: np.ndarray, mean: np.ndarray, inv_std: np.ndarray, y: np.ndarray, outer: int, channels: int,
                  inner: int) -> None:
    """y = (x - mean) * inv_std (x_hat); `y` may be `x`."""
    y3 = _view(y, outer, channels, inner)
    np.subtract(_view(x, outer, channels, inner), mean.reshape(1, channels, 1), out=y3)
    y3 *= inv_std.reshape(1, channels, 1)


def bn_backward(x: np.ndarray, mean: np.ndarray, inv_std: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                outer: int, channels: int, inner: int, scratch: Any = None) -> None:
    """Gradient through batch statistics, with x_hat = (x - mean) * inv_std and averages over outer, inner:

    dx = inv_std * (dy - avg(dy) - x_hat * avg(dy * x_hat)).  `dx` may be `dy` (in place).
    """
    need.check(scratch, need.row_sums(channels), "bn_backward")
    per_channel = (1, channels, 1)
    x_hat = (_view(x, outer, channels, inner) - mean.reshape(per_channel)) * inv_std.reshape(per_channel)
    backward_from_x_hat(x_hat, inv_std, dy, dx, outer, channels, inner)


def backward_from_x_hat(x_hat: np.ndarray, inv_std: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                        outer: int, channels: int, inner: int) -> None:
    """bn_backward's formula given x_hat itself (the fused BatchNorm+Scale op keeps x_hat, not x)."""
    x_hat = _view(x_hat, outer, channels, inner)
    dy3 = _view(dy, outer, channels, inner)
    avg_dy = dy3.mean(axis=(0, 2), keepdims=True)
    avg_dy_xhat = (dy3 * x_hat).mean(axis=(0, 2), keepdims=True)
    result = (dy3 - avg_dy - x_hat * avg_dy_xhat) * inv_std.reshape(1, channels, 1)
    np.copyto(_view(dx, outer, channels, inner), result)
