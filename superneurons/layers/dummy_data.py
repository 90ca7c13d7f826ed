"""DummyData: tops filled by FillerParameters, for benchmarks and tests without a dataset.

Shapes come from `shape` (once, or once per top) or the legacy num/channels/height/width lists.
Fillers: none means constant 0; one is used for every top; otherwise one per top.

As in Caffe, a random filler produces fresh values on every forward, and a deterministic one (constant,
bilinear) fills its top once and is not refilled. The random values come from the backend's `random_fill`
op on the device: a counter-based hash of (seed, iteration, layer, phase and top, element index), so batch k
is a pure function of k on the CPU and the GPU alike, and a run resumed from a snapshot, or a forward
replayed by the recompute manager, sees exactly the batch the uninterrupted run saw. "Once" means once per
top array: when a memory mode frees the top between iterations it comes back as a new array, refilled.
"""
from __future__ import annotations

import numpy as np

from superneurons.backend import scratch as need
from superneurons.errors import UserError
from superneurons.layers.base import register
from superneurons.layers.fillers import fill, random_spec
from superneurons.layers.source import SourceLayer
from superneurons.proto import superneurons_pb2 as pb

_LEGACY = ("num", "channels", "height", "width")


@register("DummyData")
class DummyData(SourceLayer):
    n_tops = (1, None)

    def setup(self, bottom_shapes):
        p = self.param.dummy_data_param
        n_top = len(self.param.top)
        fillers = list(p.data_filler)
        if len(fillers) not in (0, 1, n_top):
            raise self.fail(f"{len(fillers)} data_filler(s) for {n_top} top(s); give 0, 1 or {n_top}")
        if not fillers:
            fillers = [pb.FillerParameter(type="constant", value=0.0)]
        self.fillers = fillers * n_top if len(fillers) == 1 else fillers
        legacy = [list(getattr(p, f)) for f in _LEGACY]
        if any(legacy):
            if len(p.shape):
                raise self.fail("give either shape or the legacy num/channels/height/width, not both")
            for name, values in zip(_LEGACY, legacy):
                if len(values) not in (1, n_top):
                    raise self.fail(f"{len(values)} {name} value(s) for {n_top} top(s); give 1 or {n_top}")
            shapes = [tuple(int(v[i] if len(v) > 1 else v[0]) for v in legacy) for i in range(n_top)]
        else:
            if len(p.shape) not in (1, n_top):
                raise self.fail(f"{len(p.shape)} shape(s) for {n_top} top(s); give shape once or once per top")
            given = [tuple(int(d) for d in s.dim) for s in p.shape]
            shapes = given * n_top if len(given) == 1 else given
        self.shapes = shapes
        self._plan_fills()
        return shapes

    def _plan_fills(self) -> None:
        """Per top: a RandomSpec (refilled each forward) or a fixed host value (filled once)."""
        try:
            self.specs = [random_spec(f, shape) for f, shape in zip(self.fillers, self.shapes)]
            self.fixed = [None if spec is not None else self._fixed_value(f, shape)
                          for f, spec, shape in zip(self.fillers, self.specs, self.shapes)]
        except UserError as e:
            raise self.fail(str(e)) from None
        # positive_unitball: per-row sums, inverted, scale the rows (backend ops, so it runs on the device).
        self.row_sums = {j: self.add_buffer(f"row_sums{j}", (shape[0],), for_backward=False)
                         for j, (spec, shape) in enumerate(zip(self.specs, self.shapes))
                         if spec is not None and spec.unit_rows and shape and shape[0]}
        self._filled: list = [None] * len(self.shapes)

    @staticmethod
    def _fixed_value(f: pb.FillerParameter, shape) -> float | np.ndarray:
        if (f.type or "constant") == "constant":
            return float(f.value)
        return fill(f, shape, np.random.default_rng(0))  # bilinear: no randomness drawn

    def forward(self, bottom, top):
        ops, ctx = self.ops, self.ctx
        for j, (spec, out) in enumerate(zip(self.specs, top)):
            if spec is None:
                if self._filled[j] is not out:
                    value = self.fixed[j]
                    if isinstance(value, float):
                        ops.fill(out, value)
                    else:
                        ops.upload(out, value)
                    self._filled[j] = out
                continue
            # Stream: which top, and the phase, so a TEST net's batches differ from the TRAIN net's.
            ops.random_fill(out, spec.kind, spec.a, spec.b, spec.keep, int(ctx.seed), int(ctx.iteration),
                            int(self.layer_index), 2 * j + int(self.phase))
            if j in self.row_sums:
                self._unit_rows(out, self.row_sums[j].array)

    def scratch_entries(self):
        return max((need.row_sums(buf.shape[0]) for buf in self.row_sums.values()), default=0)

    def _unit_rows(self, out, sums) -> None:
        """Scale each row (axis 0) of `out` to sum 1, as Caffe's positive_unitball filler does."""
        ops = self.ops
        rows = sums.size
        inner = out.size // rows
        ops.reduction_forward(out, sums, "SUM", 1.0, rows, inner, scratch=self.ctx.scratch)
        ops.power_forward(sums, sums, -1.0, 1.0, 0.0)
        ops.channel_mul(out, sums, out, 1, rows, inner)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass
