"""Pooling (Caffe semantics): MAX, AVE, and STOCHASTIC at TEST time; global pooling; CEIL/FLOOR rounding."""
from __future__ import annotations

import numpy as np

from superneurons.backend.geometry import PoolGeometry
from superneurons.layers.base import Layer, register
from superneurons.layers.convolution import spatial_pair
from superneurons.proto import superneurons_pb2 as pb

P = pb.PoolingParameter
_METHODS = {P.MAX: "max", P.AVE: "ave", P.STOCHASTIC: "stochastic"}


@register("Pooling")
class Pooling(Layer):
    channels_last = True
    n_tops = (1, 2)  # MAX may emit its argmax mask as a second top, as in Caffe

    def setup(self, bottom_shapes):
        p = self.param.pooling_param
        shape = bottom_shapes[0]
        if len(shape) != 4:
            raise self.fail(f"needs a 4-D (N, C, H, W) bottom, got {len(shape)}-D {shape}")
        if self.in_place:
            raise self.fail("cannot work in place (its top must differ from its bottom)")
        method = _METHODS[p.pool]
        if len(self.param.top) == 2 and method != "max":
            raise self.fail(f"a second (mask) top is only produced by MAX pooling, not {P.PoolMethod.Name(p.pool)}")
        if method == "stochastic" and self.phase == pb.TRAIN:
            raise self.fail("STOCHASTIC pooling is supported only in the TEST phase (its random training "
                            "sampling is not implemented); use MAX or AVE for training")
        h, w = shape[2], shape[3]

        def given(field: str) -> list[int]:  # Pooling's kernel_size/stride/pad are scalars, not repeated
            return [getattr(p, field)] if p.HasField(field) else []

        if p.global_pooling:
            if given("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
                raise self.fail("global_pooling takes its kernel from the bottom; do not give a kernel size")
            kernel = (h, w)
        else:
            kernel = spatial_pair(self, p, "kernel", given("kernel_size"), None, 1)
        stride = spatial_pair(self, p, "stride", given("stride"), 1, 1)
        pad = spatial_pair(self, p, "pad", given("pad"), 0, 0)
        if p.global_pooling and (stride != (1, 1) or pad != (0, 0)):
            raise self.fail(f"global_pooling needs stride 1 and pad 0, got stride {stride} and pad {pad}")
        if pad != (0, 0) and method == "stochastic":
            raise self.fail(f"padding {pad} is only implemented for MAX and AVE pooling")
        self.geom = PoolGeometry(method, kernel, stride, pad)
        out = tuple(self._out_size(n, k, s, d, pad != (0, 0), side)
                    for n, k, s, d, side in zip((h, w), kernel, stride, pad, ("height", "width")))
        top = (shape[0], shape[1]) + out
        if method == "max":
            # The argmax is all max pooling's backward reads; a TEST net never reads it back.
            self.mask = self.add_buffer("mask", top, np.int32, for_backward=self.phase == pb.TRAIN)
        return [top] * len(self.param.top)

    def _out_size(self, n: int, k: int, s: int, pad: int, padded: bool, side: str) -> int:
        p = self.param.pooling_param
        if pad >= k:
            raise self.fail(f"pad {pad} must be smaller than the kernel {k} ({side})")
        span = n + 2 * pad - k
        out = (span // s if p.round_mode == P.FLOOR else -(-span // s)) + 1
        if out < 1:
            # Ceil rounding lets a kernel overhang a small input (one clipped window); floor does not.
            raise self.fail(f"kernel {k} is larger than the padded input {side} {n} + 2*{pad} = {n + 2 * pad}")
        # Caffe: with padding, the last window must start inside the image (or its left/top padding).
        if padded and (out - 1) * s >= n + pad:
            out -= 1
        if (out - 1) * s - pad >= n:
            # Without padding, ceil rounding with a stride above the kernel can start a window past the
            # image; Caffe would emit -FLT_MAX there. Refuse rather than produce garbage.
            raise self.fail(f"the last {side} window starts at {(out - 1) * s - pad}, past the input {side} {n} "
                            f"(kernel {k}, stride {s}); use round_mode: FLOOR or a kernel >= stride")
        return out

    def backward_needs(self):
        # AVE's gradient depends on nothing but dy; MAX's on its argmax buffer only.
        return frozenset()

    def forward(self, bottom, top):
        mask = self.mask.array if self.geom.method == "max" else None
        self.ops.pool_forward(bottom[0], top[0], mask, self.geom, top[1] if len(top) > 1 else None)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if self.geom.method == "stochastic":
            raise self.fail("STOCHASTIC pooling has no backward (TEST phase only)")
        if propagate_down[0]:
            mask = self.mask.array if self.geom.method == "max" else None
            self.ops.pool_backward(top_diff[0], mask, bottom_diff[0], self.geom)
