"""MVN: subtract the mean (and divide by the standard deviation) per channel of each sample, or per sample
across channels. The backward reads only the output and the saved standard deviations (in-place safe)."""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import NEEDS_TOP, Layer, count, register


@register("MVN")
class MVN(Layer):
    # Computes in float32 (the CPU's ops and the GPU's kernels) but stores its top in the layer's type, as a
    # half convolution usually reads it next (a float32 top there ran that convolution on float32 copies).

    def setup(self, bottom_shapes):
        p = self.param.mvn_param
        shape = bottom_shapes[0]
        if len(shape) < 2 and not p.across_channels:
            raise self.fail(f"needs a bottom with at least 2 axes (N, C, ...) to normalize per channel, got {shape}")
        self.normalize = bool(p.normalize_variance)
        self.eps = float(p.eps)
        rows = shape[0] if p.across_channels else shape[0] * shape[1]
        self.dims = (rows, count(shape) // rows if rows else 0)
        self.sigma = self.add_buffer("sigma", (rows,)) if self.normalize else None
        return [shape]

    def backward_needs(self):
        return frozenset({NEEDS_TOP}) if self.normalize else frozenset()

    def scratch_entries(self):
        return need.row_sums(self.dims[0])

    def forward(self, bottom, top):
        self.ops.mvn_forward(bottom[0], top[0], self.sigma.array if self.sigma is not None else None, *self.dims,
                             self.eps, scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.mvn_backward(top[0] if self.normalize else None, top_diff[0], bottom_diff[0],
                                  self.sigma.array if self.sigma is not None else None, *self.dims,
                                  scratch=self.ctx.scratch)
