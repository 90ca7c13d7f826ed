"""The memory-manager seam (memory/interface.py): a manager written against the interface alone runs a Net and
trains exactly as baseline does, and hooks attached beside the manager see every step and each learnable
parameter's gradient once it is final."""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.memory.interface import MemoryManager, StepHooks
from superneurons.runtime.net import Net
from test_memory_modes import BACKEND, CONV_FAN, _graph, train
from test_recompute_resnet import RESNET
from test_tensor_layout import SHARED


class CountingManager(MemoryManager):
    """Everything placed at setup, as baseline does, through the Net's public services only; it counts the
    steps and records the pool's live bytes after each."""

    name = "counting"

    def setup(self) -> None:
        self.steps = {"forward": 0, "backward": 0}
        self.live_bytes: list[int] = []
        for t in self.net.tensors:  # views come after their bases in the layout
            self.net.materialize(t)

    def after_forward(self, i, step):
        self.steps["forward"] += 1
        self.live_bytes.append(self.net.pool.used_bytes)

    def after_backward(self, i, step):
        self.steps["backward"] += 1
        self.live_bytes.append(self.net.pool.used_bytes)


def test_a_new_manager_implementing_the_interface_trains_like_baseline():
    _, ref, ref_losses = train(CONV_FAN, "baseline")
    net, got, losses = train(CONV_FAN, CountingManager)
    assert (got, losses) == (ref, ref_losses)
    mm = net.memory
    assert mm.name == "counting" and net.hooks == [mm]
    iterations = 3
    assert mm.steps == {"forward": iterations * len(net.forward_steps),
                        "backward": iterations * len(net.backward_steps)}
    assert mm.live_bytes == [net.baseline_bytes()] * (iterations * (len(net.forward_steps) + len(net.backward_steps)))
    assert mm.stats()["total"]["bytes_offloaded"] == 0  # the counters every manager reports


def test_a_manager_must_say_where_memory_comes_from():
    class NoSetup(MemoryManager):
        name = "nothing"

    with pytest.raises(TypeError, match="setup"):
        Net(_graph(CONV_FAN), BACKEND, memory=NoSetup)


class Recorder(StepHooks):
    """Hooks beside the memory manager: the order of calls, and each gradient's value when reported final."""

    def __init__(self, net: Net):
        self.net = net
        self.calls: list[tuple[str, str]] = []
        self.reported: list[tuple[str, int]] = []  # (layer of the step, id of the decl)
        self.values: dict[int, np.ndarray] = {}
        self.resident_tops = True

    def before_forward(self, i, step):
        self.calls.append(("before_forward", step.node.name))

    def after_forward(self, i, step):
        self.calls.append(("after_forward", step.node.name))
        # The manager frees after us: what the step wrote is still there.
        self.resident_tops &= all(t.array is not None for t in step.tops)

    def before_backward(self, i, step):
        self.calls.append(("before_backward", step.node.name))

    def after_backward(self, i, step):
        self.calls.append(("after_backward", step.node.name))

    def gradients_ready(self, step, params):
        self.calls.append(("gradients_ready", step.node.name))
        for decl in params:
            self.reported.append((step.node.name, id(decl)))
            self.values[id(decl)] = np.array(decl.diff, copy=True)  # the device array (host arrays on the CPU)


@pytest.mark.parametrize("text", [SHARED, RESNET, CONV_FAN], ids=["shared", "resnet", "fan"])
@pytest.mark.parametrize("mode,streamed", [("baseline", False), ("liveness", False), ("recompute", True)])
def test_gradients_are_reported_once_when_final(text, mode, streamed, monkeypatch):
    if streamed:
        monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "1")
    net = Net(_graph(text), BACKEND, memory=mode, seed=3)
    assert net.params.offloaded == streamed
    rec = Recorder(net)
    net.add_hooks(rec)
    _inputs(net)
    net.clear_param_diffs()
    net.forward_backward()
    # Every learnable parameter once, with the value it ends the pass with.
    assert sorted(d for _s, d in rec.reported) == sorted(id(d) for d in net.learnable)
    for decl in net.learnable:
        np.testing.assert_array_equal(rec.values[id(decl)], net.backend.to_host(decl.diff))
        assert np.any(rec.values[id(decl)] != 0)
    # A gradient is final at the last step that writes it: no later backward step computes a layer using it.
    order = [s.node.name for s in net.backward_steps]
    for name, d in rec.reported:
        decl = next(x for x in net.learnable if id(x) == d)
        writers = [n.name for n in net.graph.nodes
                   if any(p is decl or p.owner is decl for p in n.layer.params) and n.name in order]
        writers = [net.graph.fusions.forward_owner(w) or w for w in writers]
        assert order.index(name) == max(order.index(w) for w in writers), (name, writers)
    # Hook order: the manager before a step, then us; us after it, then the manager.
    assert rec.resident_tops
    assert rec.calls[:2] == [("before_forward", net.forward_steps[0].node.name),
                             ("after_forward", net.forward_steps[0].node.name)]
    first = net.backward_steps[0].node.name
    assert rec.calls[len(net.forward_steps) * 2] == ("before_backward", first)


def _inputs(net: Net) -> None:
    rng = np.random.default_rng(0)
    net.data["data"].array[...] = rng.standard_normal(net.data["data"].shape).astype(np.float32)
    net.data["label"].array[...] = rng.integers(0, 3, net.data["label"].shape).astype(np.float32)


def test_shared_weights_are_reported_at_their_last_readers_step():
    net = Net(_graph(SHARED), BACKEND)
    rec = Recorder(net)
    net.add_hooks(rec)
    _inputs(net)
    net.forward_backward()
    w2 = net.layer("fb").params[0]
    assert net.layer("fc").params[0].owner is w2
    assert [s for s, d in rec.reported if d == id(w2)] == ["fb"]  # fc runs backward first, then fb adds in
    net.remove_hooks(rec)
    assert net.hooks == [net.memory]
