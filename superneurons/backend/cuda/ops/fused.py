"""BatchNorm + Scale (+ ReLU) fused (see backend/cpu/fused.py): two passes over the activation forward
(statistics; y, and x_hat where the layer keeps it) and two backward (sums of dy' and dy' x_hat; dx, with
x_hat read or normalized again from x), on numba kernels: in one launch
each way where a block per channel fills the GPU (`one_block_per_channel`), else spread over several
blocks per channel with partial sums between launches."""
from __future__ import annotations

import numpy as np

from superneurons import settings
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import elementwise as ek, fused as fk, reduce as rk
from superneurons.backend.cuda.ops._rows import take
from superneurons.backend.scratch import row_sums

__all__ = ["bn_affine_forward", "bn_affine_backward"]

# Planes of at least SUPERNEURONS_BN_ROWS_MIN elements (1024, four blocks) take the plain-sweep kernels
# (kernels/fused.py says why); on shorter planes a thread's sweep ends after one or two loads, and the general
# walk, which runs on across planes, keeps four in flight. SUPERNEURONS_BN_ROWS=0 keeps the general walk
# everywhere (for benchmarks).
# Blocks take SUPERNEURONS_BN_MIN_BLOCK elements at least, where the planes allow (kernels/reduce.py:
# chunking). Measured on an H200 (tools/bench/bn_kernels.py, ResNet-50 batch 64): with 8192 the 7x7 and 14x14
# layers' passes take 20-40% less time than with the plain 4096-block chunking, and the whole fused BatchNorm
# goes from 6.84 + 7.34 to 5.99 + 6.25 ms per iteration together with the plain sweep of planes of 1024
# elements or more.


def _min_block() -> int:
    return settings.get("SUPERNEURONS_BN_MIN_BLOCK")


def one_block_per_channel(outer: int, channels: int, inner: int) -> bool:
    """Whether the one-launch kernels (kernels/fused.py: forward_channel, backward_channel) take this shape:
    enough channels to fill the GPU with one block each, few enough elements per channel for one block to
    sweep twice, and planes short of the plain-sweep kernels' (SUPERNEURONS_BN_CHANNEL_MIN, _MAX)."""
    least = settings.get("SUPERNEURONS_BN_CHANNEL_MIN")
    if not least or channels < least or outer * inner > settings.get("SUPERNEURONS_BN_CHANNEL_MAX"):
        return False
    return not (settings.get("SUPERNEURONS_BN_ROWS") and inner >= settings.get("SUPERNEURONS_BN_ROWS_MIN"))


def _kernels(inner: int):
    """(stats, apply, backward sums, backward apply) kernels for planes of `inner` elements."""
    if settings.get("SUPERNEURONS_BN_ROWS") and inner >= settings.get("SUPERNEURONS_BN_ROWS_MIN"):
        return fk.stats_partials_rows, fk.forward_apply_rows, fk.backward_partials_rows, fk.backward_apply_rows
    return fk.stats_partials, fk.forward_apply, fk.backward_partials, fk.backward_apply


def _zeroed_sums(channels: int, scratch):
    """The 2 * channels float64 partial sums of the spread passes, in the run's scratch region, zeroed."""
    sums = take(scratch, row_sums(channels))
    K.launch(ek.fill, sums.size)(sums, np.float64(0.0))
    return sums


def _slope(relu_slope: float | None, like) -> tuple[bool, object]:
    return relu_slope is not None, scalar(like, relu_slope or 0.0)


def bn_affine_forward(x, y, x_hat, mean, var, inv_std, gamma, beta, mean_sum, var_sum, scale_factor, outer: int,
                      channels: int, inner: int, eps: float, use_global_stats: bool, update_running: bool,
                      moving_average_fraction: float, var_correction: float, relu_slope: float | None,
                      scratch=None) -> None:
    if not y.size:
        return
    mode = fk.GLOBAL if use_global_stats else fk.BATCH_UPDATE if update_running else fk.BATCH
    relu, slope = _slope(relu_slope, y)
    fy = flat(y)
    fh = flat(x_hat) if x_hat is not None else fy
    stats = (flat(mean_sum), flat(var_sum), flat(scale_factor), flat(mean), flat(var), flat(inv_std))
    constants = (float(outer * inner), float(eps), float(moving_average_fraction), float(var_correction), mode)
    if one_block_per_channel(outer, channels, inner):
        K.launch(fk.forward_channel, 0, blocks=channels)(flat(x), *stats, flat(gamma), flat(beta), fh, fy, outer,
                                                         channels, inner, *constants, x_hat is not None, relu,
                                                         slope)
        return
    chunk, blocks = rk.chunking(outer, channels, inner, _min_block())
    stats_kernel, apply_kernel, _, _ = _kernels(inner)
    if use_global_stats:
        sums = mean_sum  # unused
    else:
        sums = _zeroed_sums(channels, scratch)
        K.launch(stats_kernel, 0, blocks=blocks)(flat(x), sums, outer, channels, inner, chunk)
    K.launch(fk.channel_stats, channels)(sums, *stats, *constants)
    K.launch(apply_kernel, 0, blocks=blocks)(flat(x), flat(mean), flat(inv_std), flat(gamma), flat(beta), fh, fy,
                                             outer, channels, inner, chunk, x_hat is not None, relu, slope)


def bn_affine_backward(kept, mean, inv_std, gamma, beta, dy, dx, dgamma, dbeta, outer: int, channels: int,
                       inner: int, use_global_stats: bool, relu_slope: float | None, scratch=None) -> None:
    """`kept`: x_hat (`mean` None) or the forward's input x (backend/cpu/fused.py)."""
    if not dy.size:
        return
    relu, slope = _slope(relu_slope, dy)
    fkept, fdy, finv = flat(kept), flat(dy), flat(inv_std)
    from_x = mean is not None
    kept_args = (fkept, flat(mean) if from_x else finv, finv, from_x)  # the placeholder mean is never read
    grads = dgamma is not None and dbeta is not None
    fg, fb = (flat(dgamma), flat(dbeta)) if grads else (finv, finv)
    if dx is not None and one_block_per_channel(outer, channels, inner):
        K.launch(fk.backward_channel, 0, blocks=channels)(*kept_args, flat(gamma), flat(beta), fdy, flat(dx), fg, fb,
                                                          outer, channels, inner, float(outer * inner),
                                                          not use_global_stats, relu, slope, grads)
        return
    chunk, blocks = rk.chunking(outer, channels, inner, _min_block())
    _, _, sums_kernel, apply_kernel = _kernels(inner)
    sums = _zeroed_sums(channels, scratch)
    K.launch(sums_kernel, 0, blocks=blocks)(*kept_args, flat(gamma), flat(beta), fdy, sums, outer, channels, inner,
                                            chunk, relu, slope)
    if dx is None:
        if grads:
            K.launch(fk.param_grads, channels)(sums, fg, fb)
        return
    K.launch(apply_kernel, 0, blocks=blocks)(*kept_args, flat(gamma), flat(beta), sums, fdy, flat(dx), fg, fb, outer,
                                             channels, inner, chunk, float(outer * inner), not use_global_stats,
                                             relu, slope, grads)
