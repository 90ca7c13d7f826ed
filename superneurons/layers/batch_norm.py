"""BatchNorm (Caffe's): normalize each channel to zero mean and unit variance; no scale or shift.

Params are three running-statistic blobs the solver never touches: [mean_sum (C), var_sum (C),
scale_factor (1)]; the running mean is mean_sum / scale_factor. With batch statistics (TRAIN by
default) every forward folds the batch into them, except a forward the memory runtime replays
(`ctx.recomputing`), so recomputation leaves them bit-identical.

The graph pass in graph/fuse.py may fuse the Scale (and ReLU) that follow in place into this layer
(`fuse_affine`): it then writes relu(gamma * x_hat + beta) itself and accumulates the Scale's parameter
gradients, which stay owned by the Scale layer. For backward it keeps its input x (and the mean), from which
backward normalizes x_hat again; in place, where y overwrites x, it keeps x_hat instead, one more pass over
the activation forward. The pass takes the layer out of place where it can (it gives the producer's top a
blob of its own), so only a BatchNorm whose bottom has no single producer keeps x_hat.
"""
from __future__ import annotations

from superneurons.layers.base import NEEDS_BOTTOM, Layer, count, register
from superneurons.proto import superneurons_pb2 as pb


@register("BatchNorm")
class BatchNorm(Layer):
    def setup(self, bottom_shapes):
        p = self.param.batch_norm_param
        shape = bottom_shapes[0]
        self.use_global_stats = p.use_global_stats if p.HasField("use_global_stats") else self.phase == pb.TEST
        self.maf = float(p.moving_average_fraction)
        self.eps = float(p.eps)
        if self.eps <= 0:
            raise self.fail(f"batch_norm_param.eps must be positive, got {self.eps}")
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
        self.affine = None  # the absorbed Scale layer, once fused
        self.relu_slope = None  # the absorbed ReLU's negative_slope, or None
        self.x_hat = None
        self.keeps_input = False  # fused, out of place: backward reads the bottom, not x_hat
        return [shape]

    def fuse_affine(self, scale, relu, keep_for_backward: bool, separate_bottom: bool = False) -> None:
        """Take over `scale` (a per-channel Scale with bias, in place on our top) and optionally `relu`.

        Called by graph/fuse.py after setup: the buffers change here, before the Net declares tensors.
        `separate_bottom`: graph/fuse.py gave the bottom a blob of its own, so the layer is no longer in
        place. Backward keeps the bottom x, the mean and inv_std, or in place x_hat and inv_std;
        `keep_for_backward` False (no backward) keeps none.
        """
        if separate_bottom:
            self.in_place = False
        self.affine = scale
        self.relu_slope = relu.slope if relu is not None else None
        self.buffers.pop("x", None)
        self.saved_x = None
        self.keeps_input = keep_for_backward and not self.in_place
        self.mean.for_backward = self.keeps_input
        self.inv_std.for_backward = keep_for_backward
        self.x_hat = self.add_buffer("x_hat", self.shape) if keep_for_backward and self.in_place else None
        scale.absorb_into(self)
        if relu is not None:
            relu.absorb_into(self)

    def backward_needs(self):
        if self.keeps_input:
            return frozenset({NEEDS_BOTTOM})
        if self.use_global_stats or self.saved_x is not None or self.affine is not None:
            return frozenset()
        return frozenset({NEEDS_BOTTOM})

    def diff_in_place_bottoms(self):
        """Fused, out of place: backward may write dx over dy (the kernels read each element of dy before
        writing that element of dx), as it does in place."""
        return (0,) if self.affine is not None and not self.in_place else ()

    def forward(self, bottom, top):
        if self.affine is not None:
            self._forward_fused(bottom[0], top[0])
            return
        ops = self.ops
        x, y = bottom[0], top[0]
        dims = (self.outer, self.channels, self.inner)
        mean, var = self.mean.array, self.var.array
        if self.use_global_stats:
            ops.bn_global_stats(self.mean_sum.data, self.var_sum.data, self.scale_factor.data, mean, var)
        else:
            if self.saved_x is not None:
                ops.copy(x, self.saved_x.array)
            ops.bn_batch_stats(x, mean, var, *dims)
            if not self.ctx.recomputing:  # a replayed forward has folded this batch in already
                ops.bn_running_update(self.mean_sum.data, self.var_sum.data, self.scale_factor.data, mean, var,
                                      self.maf, self.var_correction)
        ops.bn_normalize(x, mean, var, self.eps, self.inv_std.array, y, *dims)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if self.affine is not None:
            self._backward_fused(bottom[0], top_diff[0], bottom_diff[0] if propagate_down[0] else None)
            return
        if not propagate_down[0]:
            return  # the running statistics get no gradient
        ops = self.ops
        dims = (self.outer, self.channels, self.inner)
        if self.use_global_stats:  # mean and std are constants: dx = dy / std
            ops.channel_mul(top_diff[0], self.inv_std.array, bottom_diff[0], *dims)
        else:
            x = self.saved_x.array if self.saved_x is not None else bottom[0]
            ops.bn_backward(x, self.mean.array, self.inv_std.array, top_diff[0], bottom_diff[0], *dims)

    # -- fused with the following Scale (+ ReLU) ---------------------------------------------------
    def _forward_fused(self, x, y) -> None:
        scale = self.affine
        self.ops.bn_affine_forward(
            x, y, self.x_hat.array if self.x_hat is not None else None, self.mean.array, self.var.array,
            self.inv_std.array, scale.scale.data, scale.bias.data, self.mean_sum.data, self.var_sum.data,
            self.scale_factor.data, self.outer, self.channels, self.inner, self.eps, self.use_global_stats,
            not self.ctx.recomputing,  # a replayed forward has folded this batch in already
            self.maf, self.var_correction, self.relu_slope)

    def _backward_fused(self, x, dy, dx) -> None:
        if self.keeps_input:
            kept, mean = x, self.mean.array
        elif self.x_hat is not None:
            kept, mean = self.x_hat.array, None
        else:
            raise RuntimeError(f"{self!r} was fused for a net without backward (phase TEST); it keeps nothing")
        scale = self.affine
        self.ops.bn_affine_backward(kept, mean, self.inv_std.array, scale.scale.data, scale.bias.data, dy, dx,
                                    scale.scale.diff, scale.bias.diff, self.outer, self.channels, self.inner,
                                    self.use_global_stats, self.relu_slope)
