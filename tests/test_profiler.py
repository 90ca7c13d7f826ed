"""`superneurons time` and its profiler: layer times that add up, memory actions per step, every --memory mode."""
from __future__ import annotations

import json

import pytest

from superneurons.backend import get_backend
from superneurons.cli import main
from superneurons.errors import PoolExhausted
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.memory.plan import make_plan
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from superneurons.runtime.profiler import MEMORY_COUNTERS, Profiler, read_counters

# A small conv net whose Scale -> ReLU chain is droppable under recompute (a MAX pool's mask buffer
# would pin it), so the recompute manager really replays forward steps.
SMALL_CONV = """name: "smallconv"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 }
    shape { dim: 16 dim: 1 dim: 28 dim: 28 } shape { dim: 16 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "scale0" type: "Scale" bottom: "conv1" top: "c1" scale_param { bias_term: false } }
layer { name: "pool1" type: "Pooling" bottom: "c1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "scale1" type: "Scale" bottom: "pool1" top: "s1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "s1" top: "r1" }
layer { name: "conv2" type: "Convolution" bottom: "r1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
  inner_product_param { num_output: 32 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "smallconv.prototxt"
    p.write_text(SMALL_CONV)
    return str(p)


def make_net(model: str, memory: str, pool_bytes: int | None = None) -> Net:
    graph = build_graph(read_net(model), pb.TRAIN, source=model)
    return Net(graph, get_backend("cpu"), train=True, seed=1, memory=memory, pool_bytes=pool_bytes)


def test_layer_times_add_up_to_the_iteration(model):
    profile = Profiler(make_net(model, "baseline")).run(3)
    # How close the two are is a figure (`superneurons time` prints it), not a test: wall-clock ratios
    # flake on loaded CI cores. What must hold is that every layer's time lies inside its iteration.
    s = profile.summary()
    assert 0 < s["layer_sum_median_ms"] <= s["iteration_median_ms"]
    for layer_ms, memory_ms, it_ms in zip(profile.layer_iter_ms, profile.memory_iter_ms, profile.iteration_ms):
        assert 0 < layer_ms + memory_ms <= it_ms  # both measured inside the iteration, never overlapping
    assert all(len(t.forward_ms) == 3 for t in profile.layers)


def test_recompute_replays_are_memory_runtime_not_layer_forwards(model):
    net = make_net(model, "recompute")
    extra = make_plan(net.graph, train=True, modes=("recompute",),
                      plan_backward=False).schedules["recompute"].info["extra_forward_steps"]
    assert extra > 0  # the net is built so that recompute has something to replay
    profile = Profiler(net).run(2)
    by_name = {t.name: t for t in profile.layers}
    # Every layer ran forward exactly once per iteration; the replays were timed apart.
    assert all(len(t.forward_ms) == 2 for t in profile.layers)
    assert sum(t.backward_actions["replays"] for t in profile.layers) == 2 * extra
    assert sum(t.forward_actions["replays"] for t in profile.layers) == 0
    assert by_name["conv2"].backward_actions["replays"] == 2 * extra  # conv2's backward needs r1 rebuilt
    replayed = [t.name for t in profile.layers if t.replay_ms > 0]
    assert "relu1" in replayed and "conv2" not in replayed
    assert by_name["conv2"].backward_memory_ms and min(by_name["conv2"].backward_memory_ms) > 0
    assert profile.summary()["memory_actions_per_iteration"]["replays"] == extra


def test_time_cli_with_recompute(model, capsys):
    assert main(["time", "--model", model, "--iterations", "2", "--memory", "recompute"]) == 0
    out = capsys.readouterr().out
    for line in ("Average Forward pass: ", "Average Backward pass: ", "Average Forward-Backward: ",
                 "Total Time: ", "Sum of layer times: ", "Memory runtime (--memory recompute", "Peak memory in use: "):
        assert line in out, line
    assert "memory actions" in out.splitlines()[0]
    conv2 = next(line for line in out.splitlines() if line.startswith("conv2 "))
    assert "B: " in conv2 and "recompute " in conv2

    assert main(["time", "--model", model, "--iterations", "2", "--memory", "recompute", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["memory_mode"] == "recompute"
    layers = {layer["name"]: layer for layer in rec["layers"]}
    assert layers["conv2"]["backward_actions"]["replays"] > 0
    assert set(layers["conv1"]["forward_actions"]) == set(MEMORY_COUNTERS)
    s = rec["summary"]
    assert s["layer_sum_ms"] + s["memory_runtime_ms"] <= s["forward_backward_ms"] * 1.001


def test_offload_counters_per_step_add_up_to_the_managers(model):
    # A pool too small for liveness's peak: the Tensor Cache has to evict and fetch back.
    for kib in (1100, 1150, 1050, 1200, 1000, 900):  # compaction lets larger pools fit without moves
        try:
            net = make_net(model, "offload", pool_bytes=kib << 10)
            before = read_counters(net.memory)
            profile = Profiler(net).run(2, warmup=0)
        except PoolExhausted:
            continue
        if net.memory.bytes_offloaded:
            break
    else:
        pytest.fail("no pool size made offload move anything")
    after = dict(zip(MEMORY_COUNTERS, read_counters(net.memory)))
    start = dict(zip(MEMORY_COUNTERS, before))
    steps = {k: sum(t.forward_actions[k] + t.backward_actions[k] for t in profile.layers) for k in MEMORY_COUNTERS}
    for k in ("frees", "bytes_offloaded", "bytes_prefetched", "hits", "misses", "replays"):
        assert steps[k] == after[k] - start[k], k
    # The loss gradient Net.backward seeds is allocated outside any step's hooks.
    assert 0 < steps["allocs"] <= after["allocs"] - start["allocs"]
    assert steps["bytes_offloaded"] > 0 and steps["bytes_prefetched"] > 0


def test_iterations_must_be_positive(model, capsys):
    assert main(["time", "--model", model, "--iterations", "0"]) == 1
    assert "--iterations must be positive" in capsys.readouterr().err


def test_layers_told_to_add_into_a_summed_gradient_are_timed(tmp_path):
    """Two convolutions reading one blob write their bottom gradients into the one summed gradient (the runtime
    passes `accumulate`); the profiler's timing wrapper must hand that on."""
    split = SMALL_CONV.replace(
        'layer { name: "pool2"',
        'layer { name: "conv2b" type: "Convolution" bottom: "r1" top: "conv2b"\n'
        '  convolution_param { num_output: 16 kernel_size: 5 weight_filler { type: "xavier" } } }\n'
        'layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "conv2b" top: "conv2s" }\n'
        'layer { name: "pool2"').replace('bottom: "conv2" top: "pool2"', 'bottom: "conv2s" top: "pool2"')
    path = tmp_path / "split.prototxt"
    path.write_text(split)
    net = make_net(str(path), "baseline")
    calls = []

    def spy(backward):
        def run(*args, **kwargs):
            calls.append(kwargs.get("accumulate", frozenset()))
            return backward(*args, **kwargs)
        return run

    for name in ("conv2", "conv2b"):
        net.layer(name).backward = spy(net.layer(name).backward)
    profile = Profiler(net).run(2)
    assert any(0 in acc for acc in calls), calls  # the summed gradient was added into, through the wrapper
    assert all(len(t.backward_ms) == 2 for t in profile.layers if t.name.startswith("conv2"))
