"""BatchNorm + Scale (+ ReLU) as one op: the ResNet pattern the graph pass in graph/fuse.py fuses.

    x_hat = (x - mean) * inv_std                 (batch or global statistics, Caffe's BatchNorm)
    y     = relu(gamma * x_hat + beta)           (Scale with bias; the ReLU is optional)

Backward needs x_hat (the pre-ReLU value, hence the ReLU mask, is recomputed from it): the layer keeps
either x_hat itself (in place, where x is overwritten by y) or x, from which backward recomputes x_hat
with the forward's own arithmetic (`mean` given), so both give the same bits.

This NumPy version performs exactly the operations of the unfused BatchNorm, Scale and ReLU ops in the
same order, so on the CPU a fused net trains bit-identically to the unfused one; the CUDA version
(backend/cuda/ops/fused.py) makes two passes each way and agrees to rounding.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need
from superneurons.backend.cpu.activation import relu_backward, relu_forward
from superneurons.backend.cpu.basic import add_bias, bias_backward
from superneurons.backend.cpu.batch_norm import (backward_from_x_hat, bn_batch_stats, bn_global_stats,
                                                 bn_normalize, bn_normalized, bn_running_update)
from superneurons.backend.cpu.scale import channel_mul, channel_mul_grad

__all__ = ["bn_affine_forward", "bn_affine_backward"]


def bn_affine_forward(x: np.ndarray, y: np.ndarray, x_hat: np.ndarray | None, mean: np.ndarray, var: np.ndarray,
                      inv_std: np.ndarray, gamma: np.ndarray, beta: np.ndarray, mean_sum: np.ndarray,
                      var_sum: np.ndarray, scale_factor: np.ndarray, outer: int, channels: int, inner: int,
                      eps: float, use_global_stats: bool, update_running: bool, moving_average_fraction: float,
                      var_correction: float, relu_slope: float | None, scratch: Any = None) -> None:
    """y = relu(gamma * x_hat + beta) with x_hat saved (None: not kept); `y` may be `x`.

    With batch statistics mean/var are the batch's and, if `update_running`, folded into the running
    sums; with global statistics they come from the running sums. relu_slope None: no ReLU.
    """
    need.check(scratch, need.row_sums(channels), "bn_affine_forward")
    dims = (outer, channels, inner)
    if use_global_stats:
        bn_global_stats(mean_sum, var_sum, scale_factor, mean, var)
    else:
        bn_batch_stats(x, mean, var, *dims)
        if update_running:
            bn_running_update(mean_sum, var_sum, scale_factor, mean, var, moving_average_fraction, var_correction)
    normalized = x_hat if x_hat is not None else y
    bn_normalize(x, mean, var, eps, inv_std, normalized, *dims)
    channel_mul(normalized, gamma, y, *dims)
    add_bias(y, beta, *dims)
    if relu_slope is not None:
        relu_forward(y, y, relu_slope)


def bn_affine_backward(kept: np.ndarray, mean: np.ndarray | None, inv_std: np.ndarray, gamma: np.ndarray,
                       beta: np.ndarray, dy: np.ndarray, dx: np.ndarray | None, dgamma: np.ndarray | None,
                       dbeta: np.ndarray | None, outer: int, channels: int, inner: int, use_global_stats: bool,
                       relu_slope: float | None, scratch: Any = None) -> None:
    """dx = the gradient through ReLU, Scale and BatchNorm (overwritten; may be `dy`; None: skipped);
    dgamma, dbeta += Scale's parameter gradients (None: skipped). `kept` is x_hat (`mean` None) or the
    forward's input x (`mean` the forward's mean)."""
    need.check(scratch, need.row_sums(channels), "bn_affine_backward")
    dims = (outer, channels, inner)
    x_hat = kept
    if mean is not None:
        x_hat = np.empty_like(kept)
        bn_normalized(kept, mean, inv_std, x_hat, *dims)
    g = dx if dx is not None else np.empty_like(dy)  # dy', then d x_hat, then dx, in place
    if relu_slope is not None:
        pre_relu = np.empty_like(x_hat)
        channel_mul(x_hat, gamma, pre_relu, *dims)
        add_bias(pre_relu, beta, *dims)
        relu_backward(pre_relu, dy, g, relu_slope)
    elif g is not dy:
        np.copyto(g, dy)
    if dbeta is not None:
        bias_backward(g, dbeta, *dims)
    if dgamma is not None:
        channel_mul_grad(x_hat, g, dgamma, *dims, accumulate=True)
    if dx is None:
        return
    channel_mul(g, gamma, g, *dims)
    if use_global_stats:  # mean and std are constants: dx = d x_hat / std
        channel_mul(g, inv_std, dx, *dims)
    else:
        backward_from_x_hat(x_hat, inv_std, g, dx, *dims)
