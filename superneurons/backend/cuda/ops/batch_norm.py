"""BatchNorm with Caffe's running sums (see backend/cpu/batch_norm.py), as numba kernels: the op split
(stats / running update / normalize / backward with inv_std) does not map onto cuDNN's fused calls."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import batch_norm as bk
from superneurons.backend.cuda.ops.scale import channel_partials, spread as rk_spread

__all__ = ["bn_batch_stats", "bn_running_update", "bn_global_stats", "bn_normalize", "bn_backward"]


def bn_batch_stats(x, mean, var, outer: int, channels: int, inner: int, scratch=None) -> None:
    if rk_spread():
        sums = channel_partials(x, None, None, None, outer, channels, inner, 0, scratch)
        K.launch(bk.stats_finish, channels)(sums, flat(mean), flat(var), float(outer * inner))
        return
    K.launch(bk.batch_stats, 0, blocks=channels)(flat(x), flat(mean), flat(var), outer, channels, inner)


def bn_running_update(mean_sum, var_sum, scale_factor, mean, var, moving_average_fraction: float,
                      var_correction: float) -> None:
    K.launch(bk.running_update, mean_sum.size)(flat(mean_sum), flat(var_sum), flat(scale_factor), flat(mean),
                                                flat(var), scalar(mean_sum, moving_average_fraction),
                                                scalar(mean_sum, var_correction))


def bn_global_stats(mean_sum, var_sum, scale_factor, mean, var) -> None:
    K.launch(bk.global_stats, mean.size)(flat(mean_sum), flat(var_sum), flat(scale_factor), flat(mean), flat(var))


def bn_normalize(x, mean, var, eps: float, inv_std, y, outer: int, channels: int, inner: int) -> None:
    if rk_spread():
        K.launch(bk.normalize_inv, y.size)(flat(x), flat(mean), flat(var), scalar(var, eps), flat(inv_std), flat(y),
                                           channels, inner)
        return
    K.launch(bk.inv_std, channels)(flat(var), scalar(var, eps), flat(inv_std))
    K.launch(bk.normalize, y.size)(flat(x), flat(mean), flat(inv_std), flat(y), channels, inner)


def bn_backward(x, mean, inv_std, dy, dx, outer: int, channels: int, inner: int, scratch=None) -> None:
    if rk_spread():
        sums = channel_partials(x, dy, mean, inv_std, outer, channels, inner, 3, scratch)
        K.launch(bk.backward_apply, dx.size)(flat(x), flat(mean), flat(inv_std), sums, flat(dy), flat(dx), channels,
                                             inner, float(outer * inner))
        return
    K.launch(bk.backward, 0, blocks=channels)(flat(x), flat(mean), flat(inv_std), flat(dy), flat(dx), outer,
                                               channels, inner)
