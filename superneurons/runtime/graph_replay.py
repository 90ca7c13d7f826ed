"""Training passes replayed as CUDA graphs (backend/cuda/graphs.py): the host issues two launches per pass, not
a thousand.

A pass is recorded once its kind has run WARMUP times eagerly (kernels compiled, convolution algorithms
picked, every launch's arguments recorded), then replayed. The data layers stay outside the graph and run on
the host each pass (they fetch the next batch), in front of it: they read no blob, and under baseline their tops
share memory with nothing, so running them before the steps the route puts ahead of them changes nothing. The
recording is two graphs, one of the other forward steps and one of the loss gradients' seeds and backward (the
loss is copied to the host between them, so the host reads it, and queues the solver's update, while the device
runs backward). A graph holds the arrays, pointers and scalars of its recording, so:

- only a net whose tensors never move qualifies (a memory manager with `static_placement`: baseline), with no
  parameters streamed, no Filter, no hooks but the memory manager's (a profiler or a gradient reducer runs per
  step), every layer `replayable` (not Python); a layer whose kernels read a per-pass value writes it to the
  device before each launch (`prepare_replay`: Dropout's pass key);
- a pass's kind is what its recorded scalars depend on: the loss scale and which parameter gradients were just
  cleared (a first micro-batch overwrites them, a later one of `iter_size` adds); each kind has its own graphs;
- a pass whose arrays are not the ones recorded (a compaction, a reshape) runs eagerly and records again.

A recording that fails (a layer's op synchronized with the host or allocated) leaves the net eager for the rest
of the run, with one log line naming the error; SUPERNEURONS_CUDA_GRAPH=0 keeps every net eager.
"""
from __future__ import annotations

from typing import Any

from superneurons import settings
from superneurons.backend.base import CaptureFailed
from superneurons.backend.log_line import log_line
from superneurons.layers.base import Layer

WARMUP = 2  # eager passes of a kind before it is recorded: the first compiles and measures, the second records launches
KEPT = 4  # kinds whose graphs a net keeps (adaptive loss scaling makes a kind per scale): the oldest goes


def replay_for(net: Any) -> "GraphReplay | None":
    """A GraphReplay for `net`, or None where passes cannot be replayed (logged once, with the reason, when
    the backend could record them)."""
    if not settings.get("SUPERNEURONS_CUDA_GRAPH") or not net.train:
        return None
    recorder = getattr(net._device_backend, "graph_recorder", None)
    if recorder is None:
        return None
    reason = _why_not(net)
    if reason is not None:
        log_line("I", "graph_replay.py", f"Net {net.name or 'net'}: passes run eagerly, not as a CUDA graph: {reason}")
        return None
    return GraphReplay(net, recorder())


def expected(graph: Any, memory: str, *, train: bool, recorder: bool, eager: bool = False) -> bool:
    """Whether a Net of `graph` under the memory mode `memory` will replay its training passes, as far as its
    setup can tell: what `replay_for` checks of the built Net (the setting, a backend that records, baseline, no
    Filter, every layer replayable), with `auto` counted as baseline (a layout that rests on replay is kept only
    where auto picks baseline: runtime/net.py); `eager`: the caller runs the passes eagerly (Net's `eager`).
    graph/layout.py's `auto` weighs it."""
    if not (settings.get("SUPERNEURONS_CUDA_GRAPH") and train and recorder) or eager:
        return False
    if memory not in ("baseline", "auto") or getattr(graph, "live", None) is not None:
        return False
    return all(graph.step_layer(node).replayable for node in graph.nodes)


def _why_not(net: Any) -> str | None:
    if not net.memory.static_placement:
        return f"--memory {net.memory.name} moves tensors during a pass"
    if net.streaming is not None:
        return "parameters are streamed from the host"
    if net.live is not None:
        return "a Filter changes the batch the layers after it see"
    for step in net.forward_steps:
        layer = net._step_layers[id(step.node)]
        if not layer.replayable:
            return f"layer {step.node.name!r} ({layer.type_name}) {_REASONS.get(layer.type_name, 'is not replayable')}"
    return None


_REASONS = {"Python": "runs host code every pass"}


def data_steps(net: Any) -> tuple[list[int], list[int]]:
    """The forward steps (indexes) of the data layers, run eagerly in front of the graph, and the others."""
    data, rest = [], []
    for i, step in enumerate(net.forward_steps):
        (data if net._step_layers[id(step.node)].is_data else rest).append(i)
    return data, rest


class GraphReplay:
    def __init__(self, net: Any, recorder: Any):
        self.net = net
        self.recorder = recorder
        self.data_steps, self.rest = data_steps(net)
        layers = [net._step_layers[id(net.forward_steps[i].node)] for i in self.rest]
        self._preparing = [layer for layer in layers if type(layer).prepare_replay is not Layer.prepare_replay]
        self.failed = False
        self._hooks_said = False
        self.replays = 0  # passes run as a graph (the recording pass's launch included)
        self._passes: dict[tuple, int] = {}  # eager passes seen per kind
        self._graphs: dict[tuple, _Recorded] = {}

    def _kind(self) -> tuple:
        net = self.net
        return (net.loss_scale, tuple(decl.diff_cleared for decl in net.learnable))

    def forward_backward(self) -> float | None:
        """Run one training pass through a graph (recording it first if due) and return its loss; None: the
        caller runs this pass eagerly."""
        net = self.net
        if self.failed:
            return None
        if len(net.hooks) != 1:  # hooks beside the memory manager's run at every step: a graph would skip them
            if not self._hooks_said:
                self._hooks_said = True
                log_line("I", "graph_replay.py", f"Net {net.name or 'net'}: passes run eagerly while per-step hooks "
                         f"watch them (a profiler, the float16 Inf/NaN watch, a gradient reducer)")
            return None
        kind = self._kind()
        recorded = self._graphs.get(kind)
        if recorded is not None and not recorded.in_place(net):
            del self._graphs[kind]
            self._passes.pop(kind, None)
            recorded = None
        if recorded is None:
            seen = self._passes[kind] = self._passes.get(kind, 0) + 1
            if seen <= WARMUP:
                return None
        self._run_data_layers()
        if recorded is None:
            recorded = self._record(kind)
            if recorded is None:  # the rest of this pass, eagerly
                return net.finish_pass(self.rest)
            if len(self._graphs) >= KEPT:
                del self._graphs[next(iter(self._graphs))]
            self._graphs[kind] = recorded
        for layer in self._preparing:
            layer.prepare_replay()
        recorded.forward.launch()
        # The loss is copied out between the two graphs, so the host reads it while the device runs backward and
        # queues the solver's update meanwhile (runtime/loss_read.py), as an eager pass does.
        loss = net._loss_reader.start(net.loss_blobs)
        recorded.backward.launch()
        self.replays += 1
        for check in recorded.checks:
            check.rearm()
        net.ctx.deferred_checks.extend(recorded.checks)
        for decl, cleared in zip(net.learnable, recorded.cleared_after):
            decl.diff_cleared = cleared
        value = loss()
        net.ctx.run_deferred_checks()
        return value

    def _run_data_layers(self) -> None:
        self.net._queue_forward(steps=self.data_steps)

    def _run_forward(self) -> None:
        """The forward graph: the forward steps but the data layers'."""
        self.net._queue_forward(steps=self.rest)

    def _record(self, kind: tuple) -> "_Recorded | None":
        net = self.net
        checks_before = list(net.ctx.deferred_checks)
        net.ctx.deferred_checks = []
        try:
            forward = self.recorder.capture(self._run_forward)
            backward = self.recorder.capture(self.net.backward)  # the loss gradients' seeds, then backward
            checks = net.ctx.deferred_checks
            if not all(hasattr(c, "rearm") for c in checks):
                raise CaptureFailed("a layer queued a host check a replay cannot repeat")
        except CaptureFailed as e:
            self.failed = True
            net.ctx.deferred_checks = checks_before
            for decl, cleared in zip(net.learnable, kind[1]):  # as before the attempt: the pass runs again
                decl.diff_cleared = cleared
            log_line("W", "graph_replay.py", f"Net {net.name or 'net'}: recording a pass as a CUDA graph failed, "
                     f"passes run eagerly from now on: {e}")
            return None
        net.ctx.deferred_checks = checks_before
        cleared_after = tuple(decl.diff_cleared for decl in net.learnable)
        if not self._graphs:
            log_line("I", "graph_replay.py", f"Net {net.name or 'net'}: passes replay as CUDA graphs of "
                     f"{forward.nodes} (forward) and {backward.nodes} (backward) nodes ({len(self.data_steps)} data "
                     f"layer(s) run on the host in front; SUPERNEURONS_CUDA_GRAPH=0 issues every kernel from the host)")
        return _Recorded(forward, backward, checks, cleared_after, [t.array for t in net.tensors])

class _Recorded:
    __slots__ = ("forward", "backward", "checks", "cleared_after", "arrays")

    def __init__(self, forward: Any, backward: Any, checks: list, cleared_after: tuple, arrays: list):
        self.forward, self.backward, self.checks = forward, backward, checks
        self.cleared_after, self.arrays = cleared_after, arrays

    def in_place(self, net: Any) -> bool:
        """Whether every tensor of `net` still has the array the graph was recorded with."""
        return all(a is b for a, b in zip(self.arrays, [t.array for t in net.tensors]))
