"""BatchNorm -> Scale (-> ReLU), ResNet's chain after almost every convolution: run apart they make 6-8 passes
over the activation each way and copy it twice for backward; fused (ops `bn_affine_forward/backward`) two each
way, writing relu(gamma * x_hat + beta), and one copy kept: the BatchNorm's input x, from which backward
normalizes x_hat again. In place, where y overwrites x, the layer keeps x_hat instead (one more pass forward);
graph/fuse.py takes the BatchNorm out of place where the blob has a producer to split from. The Scale's
parameter gradients accumulate here and stay owned by the Scale layer; the Scale's and ReLU's steps pass
through (`Absorbed`). A forward the memory runtime replays (`ctx.recomputing`) leaves the running statistics
alone, so recomputation keeps them bit-identical.
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, BufferDecl
from superneurons.layers.batch_norm import BatchNorm
from superneurons.layers.fused import FusedLayer
from superneurons.layers.activations import ReLU
from superneurons.layers.scale import Scale


class BatchNormScaleReLU(FusedLayer):
    """`keep_for_backward` False (a net without backward) keeps nothing for backward; `in_place` False: the
    BatchNorm reads a blob of its own (graph/fuse.py split it off), so backward reads that input x."""

    type_name = "BatchNorm+Scale+ReLU"

    def __init__(self, bn: BatchNorm, scale: Scale, relu: ReLU | None, keep_for_backward: bool, in_place: bool):
        super().__init__(bn)
        self.bn = bn
        self.scale = scale
        self.relu_slope = relu.slope if relu is not None else None
        self.in_place = in_place
        self.keeps_input = keep_for_backward and not in_place  # backward reads the bottom, not x_hat
        self.mean = self._buffer("mean", bn.mean, self.keeps_input)
        self.var = self._buffer("var", bn.var, False)
        self.inv_std = self._buffer("inv_std", bn.inv_std, keep_for_backward)
        self.x_hat = self._buffer("x_hat", BufferDecl(bn.shape), True) if keep_for_backward and in_place else None

    def _buffer(self, name: str, like: BufferDecl, for_backward: bool) -> BufferDecl:
        decl = self.buffers[name] = BufferDecl(like.shape, like.dtype, for_backward=for_backward)
        return decl

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM}) if self.keeps_input else frozenset()

    def scratch_entries(self):
        return need.row_sums(self.bn.channels)

    def diff_in_place_bottoms(self):
        """Out of place, backward may still write dx over dy (the kernels read each element of dy before
        writing that element of dx), as it does in place."""
        return (0,) if not self.in_place else ()

    def forward(self, bottom, top):
        bn, scale = self.bn, self.scale
        self.ops.bn_affine_forward(
            bottom[0], top[0], self.x_hat.array if self.x_hat is not None else None, self.mean.array,
            self.var.array, self.inv_std.array, scale.scale.data, scale.bias.data, bn.mean_sum.data,
            bn.var_sum.data, bn.scale_factor.data, bn.outer, bn.channels, bn.inner, bn.eps, bn.use_global_stats,
            not self.ctx.recomputing,  # a replayed forward has folded this batch in already
            bn.maf, bn.var_correction, self.relu_slope, scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if self.keeps_input:
            kept, mean = bottom[0], self.mean.array
        elif self.x_hat is not None:
            kept, mean = self.x_hat.array, None
        else:
            raise RuntimeError(f"{self!r} was fused for a net without backward (phase TEST); it keeps nothing")
        bn, scale = self.bn, self.scale
        self.ops.bn_affine_backward(kept, mean, self.inv_std.array, scale.scale.data, scale.bias.data,
                                    top_diff[0], bottom_diff[0] if propagate_down[0] else None, scale.scale.diff,
                                    scale.bias.diff, bn.outer, bn.channels, bn.inner, bn.use_global_stats,
                                    self.relu_slope, scratch=self.ctx.scratch)
