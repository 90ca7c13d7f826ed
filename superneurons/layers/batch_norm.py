"""BatchNorm (Caffe's): normalize each channel to zero mean and unit variance; no scale or shift.

Params are three running-statistic blobs the solver never touches: [mean_sum (C), var_sum (C),
scale_factor (1)]; the running mean is mean_sum / scale_factor. With batch statistics (TRAIN by
default) every forward folds the batch into them, except a forward the memory runtime replays
(`ctx.recomputing`), so recomputation leaves them bit-identical.

graph/fuse.py may fuse it with the Scale (and ReLU) after it: layers/fused/batch_norm_scale_relu.py.
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, Layer, count, register
from superneurons.proto import superneurons_pb2 as pb


@register("BatchNorm")
class BatchNorm(Layer):
    channels_last = True
    def setup(self, bottom_shapes):
        p = self.param.batch_norm_param
        shape = bottom_shapes[0]
        self.use_global_stats = p.use_global_stats if p.HasField("use_global_stats") else self.phase == pb.TEST
        self.maf = float(p.moving_average_fraction)
        self.eps = float(p.eps)
        if self.eps <= 0:
            raise self.fail(f"batch_norm_param.eps must be positive, got {self.eps}")
        self.require_axes(shape, 1)  # N, and C when there is a second axis
        self.outer = int(shape[0])
        self.channels = int(shape[1]) if len(shape) > 1 else 1
        self.inner = count(shape, 2)
        m = self.outer * self.inner  # values per channel
        self.var_correction = m / (m - 1) if m > 1 else 1.0  # biased batch variance -> unbiased running one
        zero = pb.FillerParameter(type="constant", value=0.0)
        c = (self.channels,)
        self.mean_sum = self.add_param(c, zero, learnable=False)
        self.var_sum = self.add_param(c, zero, learnable=False)
        self.scale_factor = self.add_param((1,), zero, learnable=False)

        train = self.phase == pb.TRAIN
        batch = not self.use_global_stats
        # Backward with batch statistics recomputes x_hat from x, the mean and inv_std; with global
        # statistics it only divides by the std. In place the bottom is overwritten (and later
        # in-place layers, e.g. Scale, overwrite the top too), so x is copied first, as Caffe does.
        self.mean = self.add_buffer("mean", c, for_backward=train and batch)
        self.var = self.add_buffer("var", c, for_backward=False)
        self.inv_std = self.add_buffer("inv_std", c, for_backward=train)
        self.saved_x = self.add_buffer("x", shape) if train and batch and self.in_place else None
        self.shape = tuple(shape)
        return [shape]

    def scratch_entries(self):
        return need.row_sums(self.channels)  # the batch statistics' and the backward's per-channel sums

    def backward_needs(self):
        if self.use_global_stats or self.saved_x is not None:
            return frozenset()
        return frozenset({NEEDS_BOTTOM})

    def forward(self, bottom, top):
        ops = self.ops
        x, y = bottom[0], top[0]
        dims = (self.outer, self.channels, self.inner)
        mean, var = self.mean.array, self.var.array
        if self.use_global_stats:
            ops.bn_global_stats(self.mean_sum.data, self.var_sum.data, self.scale_factor.data, mean, var)
        else:
            if self.saved_x is not None:
                ops.copy(x, self.saved_x.array)
            ops.bn_batch_stats(x, mean, var, *dims, scratch=self.ctx.scratch)
            if not self.ctx.recomputing:  # a replayed forward has folded this batch in already
                ops.bn_running_update(self.mean_sum.data, self.var_sum.data, self.scale_factor.data, mean, var,
                                      self.maf, self.var_correction)
        ops.bn_normalize(x, mean, var, self.eps, self.inv_std.array, y, *dims)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if not propagate_down[0]:
            return  # the running statistics get no gradient
        ops = self.ops
        dims = (self.outer, self.channels, self.inner)
        if self.use_global_stats:  # mean and std are constants: dx = dy / std
            ops.channel_mul(top_diff[0], self.inv_std.array, bottom_diff[0], *dims)
        else:
            x = self.saved_x.array if self.saved_x is not None else bottom[0]
            ops.bn_backward(x, self.mean.array, self.inv_std.array, top_diff[0], bottom_diff[0], *dims,
                            scratch=self.ctx.scratch)
