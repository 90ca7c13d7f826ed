"""The profiler behind `superneurons time`: per-layer forward/backward times, live memory and memory actions per step.

It times a Net without touching its hot loop: while profiling, each layer's `forward` and
`backward` are shadowed by timed wrappers on the instance, and so are the memory manager's four
step hooks, so an unprofiled run pays nothing. On a GPU backend the wrappers synchronize around
each layer so the times are device times.

Per step it records what the memory manager did there: the difference of the manager's counters
(`MEMORY_COUNTERS`) from the start of the step's `before_*` hook to the end of its `after_*` hook,
and the time spent in those hooks. A forward step the recompute manager replays inside a backward
hook is timed as that hook's work (and, per layer, as `replay_ms`), never as the layer's forward.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Counters a memory manager may keep (cumulative); a manager without one reads as 0.
MEMORY_COUNTERS = ("allocs", "frees", "bytes_offloaded", "bytes_prefetched", "replays", "hits", "misses")


def read_counters(manager: Any) -> tuple[int, ...]:
    return tuple(int(getattr(manager, name, 0) or 0) for name in MEMORY_COUNTERS)


@dataclass
class LayerTiming:
    name: str
    type: str
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    forward_live_bytes: int = 0
    backward_live_bytes: int = 0
    algo: str = ""
    # Memory runtime of this layer's steps, per timed iteration: time in the manager's hooks ...
    forward_memory_ms: list[float] = field(default_factory=list)
    backward_memory_ms: list[float] = field(default_factory=list)
    # ... and the counters' increase, summed over the timed iterations.
    forward_actions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEMORY_COUNTERS, 0))
    backward_actions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEMORY_COUNTERS, 0))
    replay_ms: float = 0.0  # total time this layer's forward ran as a recomputation replay
    # Op calls of this layer's steps that converted arrays between memory layouts (graph/layout.py), summed over
    # the timed iterations (0 on a backend that keeps one layout).
    layout_conversions: int = 0

    @property
    def forward_avg(self) -> float:
        return float(np.mean(self.forward_ms)) if self.forward_ms else 0.0

    @property
    def backward_avg(self) -> float:
        return float(np.mean(self.backward_ms)) if self.backward_ms else 0.0

    @property
    def memory_avg(self) -> float:
        """Mean time per iteration in the manager's hooks around this layer's steps."""
        f = float(np.mean(self.forward_memory_ms)) if self.forward_memory_ms else 0.0
        b = float(np.mean(self.backward_memory_ms)) if self.backward_memory_ms else 0.0
        return f + b


@dataclass
class Profile:
    layers: list[LayerTiming]
    forward_ms: list[float]
    backward_ms: list[float]
    iteration_ms: list[float]
    peak_bytes: int
    pool_bytes: int
    layer_iter_ms: list[float] = field(default_factory=list)   # per iteration: sum of the layer calls
    memory_iter_ms: list[float] = field(default_factory=list)  # per iteration: time in the manager's hooks
    memory_mode: str = "baseline"

    @property
    def iterations(self) -> int:
        return len(self.iteration_ms)

    def summary(self) -> dict[str, float]:
        fwd, bwd, it = np.mean(self.forward_ms), np.mean(self.backward_ms), np.mean(self.iteration_ms)
        layer_sum = sum(t.forward_avg + t.backward_avg for t in self.layers)
        mem = float(np.mean(self.memory_iter_ms)) if self.memory_iter_ms else 0.0
        med = lambda xs: float(statistics.median(xs)) if xs else 0.0  # noqa: E731
        totals = {k: sum(t.forward_actions[k] + t.backward_actions[k] for t in self.layers) for k in MEMORY_COUNTERS}
        n = max(1, self.iterations)
        return {"forward_ms": float(fwd), "backward_ms": float(bwd), "forward_backward_ms": float(it),
                "total_ms": float(np.sum(self.iteration_ms)), "layer_sum_ms": float(layer_sum),
                "bookkeeping_share": float(max(0.0, 1.0 - layer_sum / it)) if it > 0 else 0.0,
                "memory_runtime_ms": mem, "memory_share": float(mem / it) if it > 0 else 0.0,
                "iteration_median_ms": med(self.iteration_ms), "layer_sum_median_ms": med(self.layer_iter_ms),
                "memory_runtime_median_ms": med(self.memory_iter_ms),
                "memory_actions_per_iteration": {k: v / n for k, v in totals.items()}}


class Profiler:
    def __init__(self, net: Any):
        self.net = net
        self.sync = net.backend.synchronize if net.backend.asynchronous else None
        self.timings = {n.name: LayerTiming(n.name, n.layer.type_name) for n in net.graph.nodes}
        self._layer_ms = 0.0   # the current iteration's sums
        # The backend's count of layout conversions so far, where it has one (channels-last tensors on the GPU).
        self._conversions = getattr(net.backend, "layout_conversions", None)
        self._memory_ms = 0.0

    def _wrap(self, layer: Any, timing: LayerTiming) -> None:
        pool, sync, ctx = self.net.pool, self.sync, self.net.ctx
        fwd, bwd = layer.forward, layer.backward
        clock = time.perf_counter
        conversions = self._conversions or (lambda: 0)

        def forward(bottom, top):
            if sync:
                sync()
            c0 = conversions()
            t0 = clock()
            fwd(bottom, top)
            timing.layout_conversions += conversions() - c0
            if sync:
                sync()
            ms = (clock() - t0) * 1e3
            if ctx.recomputing:  # a replay inside a backward step's hook: memory runtime, not this layer's forward
                timing.replay_ms += ms
                return
            timing.forward_ms.append(ms)
            self._layer_ms += ms
            timing.forward_live_bytes = max(timing.forward_live_bytes, pool.used_bytes)

        def backward(top, top_diff, propagate_down, bottom, bottom_diff, **kwargs):
            if sync:
                sync()
            c0 = conversions()
            t0 = clock()
            bwd(top, top_diff, propagate_down, bottom, bottom_diff, **kwargs)  # e.g. `accumulate` (a split blob)
            timing.layout_conversions += conversions() - c0
            if sync:
                sync()
            ms = (clock() - t0) * 1e3
            timing.backward_ms.append(ms)
            self._layer_ms += ms
            timing.backward_live_bytes = max(timing.backward_live_bytes, pool.used_bytes)

        layer.forward, layer.backward = forward, backward

    def _wrap_manager(self, mm: Any) -> None:
        """Time the manager's step hooks and take its counters' increase over each step."""
        sync, clock, timings = self.sync, time.perf_counter, self.timings
        state: dict[str, Any] = {}

        def make(phase: str, hook: Any, opening: bool):
            def wrapped(i, step):
                if opening:
                    state["counters"] = read_counters(mm)
                if sync:
                    sync()
                t0 = clock()
                hook(i, step)
                if sync:
                    sync()
                ms = (clock() - t0) * 1e3
                self._memory_ms += ms
                if opening:
                    state["ms"] = ms
                    return
                t = timings[step.node.name]
                (t.forward_memory_ms if phase == "forward" else t.backward_memory_ms).append(state["ms"] + ms)
                actions = t.forward_actions if phase == "forward" else t.backward_actions
                for k, a, b in zip(MEMORY_COUNTERS, state["counters"], read_counters(mm)):
                    actions[k] += b - a
            return wrapped

        mm.before_forward = make("forward", mm.before_forward, True)
        mm.after_forward = make("forward", mm.after_forward, False)
        mm.before_backward = make("backward", mm.before_backward, True)
        mm.after_backward = make("backward", mm.after_backward, False)

    def run(self, iterations: int, warmup: int = 1) -> Profile:
        net = self.net
        mm = net.memory
        for it in range(warmup):  # first iteration pays one-time costs (numba compile, algorithm search)
            net.ctx.iteration = it
            net.forward_backward()
        for node in net.graph.nodes:
            self._wrap(node.layer, self.timings[node.name])
        self._wrap_manager(mm)
        fwd_ms, bwd_ms, it_ms, layer_ms, memory_ms = [], [], [], [], []
        net.pool.reset_high_water()
        try:
            for it in range(iterations):
                net.ctx.iteration = warmup + it
                self._layer_ms = self._memory_ms = 0.0
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
                layer_ms.append(self._layer_ms)
                memory_ms.append(self._memory_ms)
        finally:
            # Drop the instance wrappers: the class methods show through again.
            for node in net.graph.nodes:
                node.layer.__dict__.pop("forward", None)
                node.layer.__dict__.pop("backward", None)
            for hook in ("before_forward", "after_forward", "before_backward", "after_backward"):
                mm.__dict__.pop(hook, None)
        for node in net.graph.nodes:
            self.timings[node.name].algo = str(node.layer.algo_name or "")
        return Profile([self.timings[n.name] for n in net.graph.nodes], fwd_ms, bwd_ms, it_ms,
                       net.pool.high_water, net.pool.capacity, layer_ms, memory_ms,
                       memory_mode=mm.name)
