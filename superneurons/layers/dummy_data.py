"""DummyData: tops filled by FillerParameters, for benchmarks and tests without a dataset.

Shapes come from `shape` (once, or once per top) or the legacy num/channels/height/width lists.
Fillers: none means constant 0; one is used for every top; otherwise one per top. A random
filler produces fresh values on every forward, drawn from a generator keyed by (seed, phase,
iteration, layer, top), so a run resumed from a snapshot, or a forward replayed by the
recompute manager, sees exactly the batch the uninterrupted run saw.
"""
from __future__ import annotations

import numpy as np

from superneurons.layers.base import Layer, register
from superneurons.layers.fillers import fill
from superneurons.proto import superneurons_pb2 as pb

_LEGACY = ("num", "channels", "height", "width")


@register("DummyData")
class DummyData(Layer):
    is_data = True
    has_backward = False
    n_bottoms = (0, 0)
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
        return shapes

    def forward(self, bottom, top):
        for j, (f, out) in enumerate(zip(self.fillers, top)):
            if (f.type or "constant") == "constant":
                # A device-side fill is as cheap as checking a flag, and stays right when a memory
                # mode frees this top between iterations.
                self.ops.fill(out, f.value)
            else:
                self.ops.upload(out, fill(f, self.shapes[j], self._rng(j)))

    def _rng(self, top_index: int) -> np.random.Generator:
        seed = int(self.ctx.seed) % (1 << 63)
        key = [seed, int(self.phase), int(self.ctx.iteration), int(self.layer_index), top_index]
        return np.random.default_rng(np.random.SeedSequence(key))

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        pass
