"""SPP: spatial pyramid pooling (Caffe's layer): level l pools the bottom into a 2^l x 2^l grid of windows
and the levels' outputs, flattened, are joined along axis 1: top (N, C * (1 + 4 + ... + 4^(height-1))).
With pyramid_height 1 the top is the one level's (N, C, 1, 1) output, as in Caffe.

Level l's window is ceil(H / 2^l) high with that stride, padded by half the excess, which makes the grid
cover the bottom; each level is a Pooling layer of those numbers (its checks, output sizes and argmax
buffer), whose outputs are buffers of this layer. Backward routes the top gradient's slice of each level
through that level's pooling and sums the levels into the bottom gradient.
"""
from __future__ import annotations

import math

from superneurons.errors import UserError
from superneurons.layers.base import Layer, count, register
from superneurons.layers.pooling import Pooling
from superneurons.proto import superneurons_pb2 as pb

_POOL = {pb.SPPParameter.MAX: pb.PoolingParameter.MAX, pb.SPPParameter.AVE: pb.PoolingParameter.AVE,
         pb.SPPParameter.STOCHASTIC: pb.PoolingParameter.STOCHASTIC}


@register("SPP")
class SPP(Layer):
    def setup(self, bottom_shapes):
        p = self.param.spp_param
        shape = bottom_shapes[0]
        if len(shape) != 4:
            raise self.fail(f"needs a 4-D (N, C, H, W) bottom, got {len(shape)}-D {shape}")
        if self.in_place:
            raise self.fail("cannot work in place (its top must differ from its bottom)")
        if p.pyramid_height < 1:
            raise self.fail(f"spp_param.pyramid_height must be 1 or more, got {p.pyramid_height}")
        self.levels: list[Pooling] = []
        for level in range(p.pyramid_height):
            pool = Pooling(self._level_param(level, shape[2], shape[3]), self.phase)
            try:
                (out,) = pool.setup([shape])
            except UserError as e:
                raise self.fail(f"pyramid level {level} ({2 ** level} x {2 ** level} bins) on a {shape[2]} x "
                                f"{shape[3]} bottom: {str(e).split(': ', 1)[1]}") from None
            for name, buf in pool.buffers.items():
                self.buffers[f"{name}{level}"] = buf  # the runtime gives the level's pooling its memory
            pool.out = self.add_buffer(f"pooled{level}", out)  # also the level's gradient in backward
            self.levels.append(pool)
        if len(self.levels) == 1:
            return [self.levels[0].out.shape]
        self.widths = [count(pool.out.shape, 1) for pool in self.levels]
        self.bottom_diff_level = self.add_buffer("level_diff", shape)  # one level's gradient, before the sum
        return [(shape[0], sum(self.widths))]

    def _level_param(self, level: int, h: int, w: int) -> pb.LayerParameter:
        bins = 2 ** level
        kernel = [math.ceil(n / bins) for n in (h, w)]
        pad = [(k * bins - n + 1) // 2 for k, n in zip(kernel, (h, w))]
        pool = pb.PoolingParameter(pool=_POOL[self.param.spp_param.pool], kernel_h=kernel[0], kernel_w=kernel[1],
                                   stride_h=kernel[0], stride_w=kernel[1], pad_h=pad[0], pad_w=pad[1])
        return pb.LayerParameter(name=self.name, type="Pooling", bottom=["x"], top=["y"], pooling_param=pool)

    def backward_needs(self):
        return frozenset()  # each level's argmax (MAX) or window (AVE) routes its gradient

    def forward(self, bottom, top):
        for pool in self.levels:
            pool.ops, pool.ctx = self.ops, self.ctx
        if len(self.levels) == 1:
            self.levels[0].forward(bottom, top)
            return
        flat = []
        for pool in self.levels:
            pool.forward(bottom, [pool.out.array])
            flat.append(self.ops.reshape(pool.out.array, (pool.out.shape[0], -1)))
        self.ops.concat_forward(flat, top[0], 1)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if not propagate_down[0]:
            return
        for pool in self.levels:
            pool.ops, pool.ctx = self.ops, self.ctx
        if len(self.levels) == 1:
            self.levels[0].backward(top, top_diff, propagate_down, bottom, bottom_diff)
            return
        offset = 0
        for k, (pool, width) in enumerate(zip(self.levels, self.widths)):
            level_diff = pool.out.array
            self.ops.concat_backward(top_diff[0], self.ops.reshape(level_diff, (level_diff.shape[0], width)), 1,
                                     offset)
            offset += width
            into = bottom_diff[0] if k == 0 else self.bottom_diff_level.array
            pool.backward([level_diff], [level_diff], [True], bottom, [into])
            if k:
                self.ops.axpy(1.0, into, bottom_diff[0])
