"""The profiler behind `superneurons time`: per-layer forward/backward times and live memory per step.

It times a Net without touching its hot loop: while profiling, each layer's `forward` and
`backward` are shadowed by timed wrappers on the instance, so an unprofiled run pays nothing.
On a GPU backend the wrappers synchronize around each layer so the times are device times.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class LayerTiming:
    name: str
    type: str
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    forward_live_bytes: int = 0
    backward_live_bytes: int = 0
    algo: str = ""

    @property
    def forward_avg(self) -> float:
        return float(np.mean(self.forward_ms)) if self.forward_ms else 0.0

    @property
    def backward_avg(self) -> float:
        return float(np.mean(self.backward_ms)) if self.backward_ms else 0.0


@dataclass
class Profile:
    layers: list[LayerTiming]
    forward_ms: list[float]
    backward_ms: list[float]
    iteration_ms: list[float]
    peak_bytes: int
    pool_bytes: int

    def summary(self) -> dict[str, float]:
        fwd, bwd, it = np.mean(self.forward_ms), np.mean(self.backward_ms), np.mean(self.iteration_ms)
        layer_sum = sum(t.forward_avg + t.backward_avg for t in self.layers)
        return {"forward_ms": float(fwd), "backward_ms": float(bwd), "forward_backward_ms": float(it),
                "total_ms": float(np.sum(self.iteration_ms)), "layer_sum_ms": float(layer_sum),
                "bookkeeping_share": float(max(0.0, 1.0 - layer_sum / it)) if it > 0 else 0.0}


class Profiler:
    def __init__(self, net: Any):
        self.net = net
        self.sync = net.backend.synchronize if net.backend.name != "cpu" else None
        self.timings = {n.name: LayerTiming(n.name, n.layer.type_name) for n in net.graph.nodes}

    def _wrap(self, layer: Any, timing: LayerTiming) -> None:
        pool, sync = self.net.pool, self.sync
        fwd, bwd = layer.forward, layer.backward
        clock = time.perf_counter

        def forward(bottom, top):
            if sync:
                sync()
            t0 = clock()
            fwd(bottom, top)
            if sync:
                sync()
            timing.forward_ms.append((clock() - t0) * 1e3)
            timing.forward_live_bytes = max(timing.forward_live_bytes, pool.used_bytes)

        def backward(top, top_diff, propagate_down, bottom, bottom_diff):
            if sync:
                sync()
            t0 = clock()
            bwd(top, top_diff, propagate_down, bottom, bottom_diff)
            if sync:
                sync()
            timing.backward_ms.append((clock() - t0) * 1e3)
            timing.backward_live_bytes = max(timing.backward_live_bytes, pool.used_bytes)

        layer.forward, layer.backward = forward, backward

    def run(self, iterations: int, warmup: int = 1) -> Profile:
        net = self.net
        for it in range(warmup):  # first iteration pays one-time costs (numba compile, algorithm search)
            net.ctx.iteration = it
            net.forward_backward()
        for node in net.graph.nodes:
            self._wrap(node.layer, self.timings[node.name])
        fwd_ms, bwd_ms, it_ms = [], [], []
        net.pool.reset_high_water()
        try:
            for it in range(iterations):
                net.ctx.iteration = warmup + it
                t0 = time.perf_counter()
                net.forward()
                if self.sync:
                    self.sync()
                t1 = time.perf_counter()
                net.backward()
                if self.sync:
                    self.sync()
                t2 = time.perf_counter()
                fwd_ms.append((t1 - t0) * 1e3)
                bwd_ms.append((t2 - t1) * 1e3)
                it_ms.append((t2 - t0) * 1e3)
        finally:
            for node in net.graph.nodes:  # drop the instance wrappers: the class methods show through again
                node.layer.__dict__.pop("forward", None)
                node.layer.__dict__.pop("backward", None)
        for node in net.graph.nodes:
            self.timings[node.name].algo = str(getattr(node.layer, "algo_name", "") or "")
        return Profile([self.timings[n.name] for n in net.graph.nodes], fwd_ms, bwd_ms, it_ms,
                       net.pool.high_water, net.pool.capacity)
