"""Scale: y = x * s (+ b), s broadcast over the axes it does not cover.

s is a learned param of shape bottom.shape[axis:axis + num_axes], or, with two bottoms, the
second bottom itself (which then gets a gradient). Usually follows BatchNorm to learn its
per-channel scale and shift (graph/fuse.py may then fuse them).
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_BOTTOM, Layer, canonical_axis, count, register
from superneurons.proto import superneurons_pb2 as pb


@register("Scale")
class Scale(Layer):
    channels_last = True
    n_bottoms = (1, 2)

    def setup(self, bottom_shapes):
        p = self.param.scale_param
        shape = bottom_shapes[0]
        if len(bottom_shapes) == 2:
            scale_shape = tuple(bottom_shapes[1])
            # A scalar multiplier needs no axis (Caffe's rule), so any axis value is accepted then.
            axis = 0 if not scale_shape else canonical_axis(p.axis, len(shape), self)
            if tuple(shape[axis:axis + len(scale_shape)]) != scale_shape:
                raise self.fail(f"the scale bottom's shape {scale_shape} does not match the first bottom's "
                                f"shape {shape} from axis {axis} on")
        else:
            axis = canonical_axis(p.axis, len(shape), self)
            if p.num_axes < -1:
                raise self.fail(f"scale_param.num_axes must be -1 or more, got {p.num_axes}")
            end = len(shape) if p.num_axes == -1 else axis + p.num_axes
            if end > len(shape):
                raise self.fail(f"scale_param axis {axis} with num_axes {p.num_axes} goes past the "
                                f"{len(shape)} axes of the bottom {shape}")
            scale_shape = tuple(shape[axis:end])
        self.outer = count(shape, 0, axis)
        self.dim = count(scale_shape)
        self.inner = count(shape, axis + len(scale_shape))
        if len(bottom_shapes) == 1:
            filler = p.filler if p.HasField("filler") else pb.FillerParameter(type="constant", value=1.0)
            self.scale = self.add_param(scale_shape, filler)
        else:
            self.scale = None
        self.bias = self.add_param(scale_shape, p.bias_filler) if p.bias_term else None
        # In place, x is overwritten by y but the scale's gradient needs x: keep a copy (as Caffe does).
        self.saved_x = self.add_buffer("x", shape) if self.in_place and self.phase == pb.TRAIN else None
        return [shape]

    def scratch_entries(self):
        return need.row_sums(self.dim)  # the bias's and the multiplier's per-channel sums, one after the other

    def backward_needs(self):
        if self.scale is None:
            return frozenset({NEEDS_BOTTOM})  # the scale bottom multiplies the top diff
        return frozenset() if self.saved_x is not None else frozenset({NEEDS_BOTTOM})

    def _multiplier(self, bottom):
        return self.scale.data if self.scale is not None else bottom[1]

    def forward(self, bottom, top):
        ops = self.ops
        if self.saved_x is not None:
            ops.copy(bottom[0], self.saved_x.array)
        ops.channel_mul(bottom[0], self._multiplier(bottom), top[0], self.outer, self.dim, self.inner)
        if self.bias is not None:
            ops.add_bias(top[0], self.bias.data, self.outer, self.dim, self.inner)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        dims = (self.outer, self.dim, self.inner)
        dy = top_diff[0]
        x = self.saved_x.array if self.saved_x is not None else bottom[0]
        # Param and scale-bottom gradients first: in place, bottom_diff[0] is dy and is overwritten last.
        if self.bias is not None:
            ops.bias_backward(dy, self.bias.diff, *dims, scratch=self.ctx.scratch)
        if self.scale is not None:
            ops.channel_mul_grad(x, dy, self.scale.diff, *dims, accumulate=True, scratch=self.ctx.scratch)
        elif propagate_down[1]:
            ops.channel_mul_grad(x, dy, bottom_diff[1], *dims, accumulate=False, scratch=self.ctx.scratch)
        if propagate_down[0]:
            ops.channel_mul(dy, self._multiplier(bottom), bottom_diff[0], *dims)
