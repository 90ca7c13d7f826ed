"""Training passes replayed as CUDA graphs (runtime/graph_replay.py) against the same passes issued kernel by
kernel: with cuDNN's deterministic algorithms both run the same kernels on the same arrays, so losses, gradients
and trained weights must be equal bit for bit, in float32 and bfloat16, NCHW and NHWC. The label check a
SoftmaxWithLoss queues still stops a replayed pass, and Dropout's masks change from pass to pass as eagerly."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from gpu_harness import GPU_ONLY
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.caffemodel import blob_to_array
from superneurons.io.prototxt import read_binary
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

pytestmark = GPU_ONLY

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8

BODY = """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" } bias_term: false } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "pool1" type: "Pooling" bottom: "sum" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool1" top: "fc1"
  inner_product_param { num_output: 32 weight_filler { type: "xavier" } } }
layer { name: "relu3" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
"""
INPUTS = f"""name: "replayed"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {BATCH} dim: 3 dim: 16 dim: 16 }} }} }}
layer {{ name: "label" type: "Input" top: "label" input_param {{ shape {{ dim: {BATCH} }} }} }}
"""
DUMMY = f"""name: "replayed"
layer {{ name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param {{ shape {{ dim: {BATCH} dim: 3 dim: 16 dim: 16 }} shape {{ dim: {BATCH} }}
    data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "uniform" min: 0 max: 9.99 }} }} }}
"""


def _net(gpu, replay: bool, monkeypatch) -> Net:
    monkeypatch.setenv("SUPERNEURONS_CUDA_GRAPH", "1" if replay else "0")
    net = Net(build_graph(text_format.Parse(INPUTS + BODY, pb.NetParameter()), pb.TRAIN), gpu, seed=5)
    assert (net._replay is not None) == replay  # decided now, under this setting
    return net


def _pass(net: Net, images: np.ndarray, labels: np.ndarray, clear: bool = True) -> float:
    net.backend.from_host(net.data["data"].array, images)
    net.backend.from_host(net.data["label"].array, labels)
    if clear:
        net.clear_param_diffs()
    return net.forward_backward()


def _step(net: Net, lr: float = 0.05) -> None:
    for decl in net.learnable:  # plain SGD, issued eagerly after the pass as the solver's update is
        net.ops.axpy(-lr, decl.diff, decl.data)


def _state(net: Net) -> dict[str, np.ndarray]:
    out = {}
    for k, decl in enumerate(net.learnable):
        out[f"{k}.data"] = net.backend.to_host(decl.data)
        out[f"{k}.diff"] = net.backend.to_host(decl.diff)
    return out


def test_replayed_passes_equal_eager_passes_bit_for_bit(gpu, monkeypatch, rng):
    """Passes with an update between them: after the two warm-up passes the graph is recorded and replayed; every
    loss, gradient and weight equals the eager net's. From pass 5 on, every other pass adds into the gradients
    instead of clearing them first (as iter_size does): a second kind of pass, with a graph of its own."""
    monkeypatch.setenv("SUPERNEURONS_CUDNN_DETERMINISTIC", "1")
    eager, replayed = _net(gpu, False, monkeypatch), _net(gpu, True, monkeypatch)
    for it in range(12):
        images = rng.standard_normal((BATCH, 3, 16, 16)).astype(np.float32)
        labels = rng.integers(0, 10, BATCH).astype(np.float32)
        clear = it < 5 or it % 2 == 0  # from pass 5 on, pairs of passes: the second adds into the gradients
        want = _pass(eager, images, labels, clear)
        got = _pass(replayed, images, labels, clear)
        assert got == want, (it, got, want)
        a, b = _state(eager), _state(replayed)
        differing = [k for k in a if not np.array_equal(a[k], b[k])]
        assert not differing, (it, differing)
        if it < 5 or it % 2 == 1:
            _step(eager)
            _step(replayed)
    replay = replayed._replay
    assert replay is not None and not replay.failed
    assert len(replay._graphs) == 2  # the clearing pass and the accumulating one
    assert replay.replays >= 4
    assert eager._replay is None


def test_a_bad_label_stops_a_replayed_pass(gpu, monkeypatch, rng):
    """The labels' check is queued inside the graph: a replayed pass with a label outside the classes raises the
    same error an eager pass does."""
    net = _net(gpu, True, monkeypatch)
    images = rng.standard_normal((BATCH, 3, 16, 16)).astype(np.float32)
    labels = rng.integers(0, 10, BATCH).astype(np.float32)
    for _ in range(4):
        _pass(net, images, labels)
    assert net._replay is not None and net._replay.replays >= 1
    labels[3] = 12
    with pytest.raises(UserError, match="12"):
        _pass(net, images, labels)


def _train(where: Path, name: str, prototxt: str, precision: str, layout: str, replay: bool) -> tuple:
    (where / f"{name}.net.prototxt").write_text(prototxt)
    (where / f"{name}.prototxt").write_text(
        f'net: "{name}.net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "step"\n'
        f'gamma: 0.5\nstepsize: 2\ndisplay: 1\nmax_iter: 6\nsnapshot: 6\nsnapshot_prefix: "{name}/m"\nrandom_seed: 3\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT), SUPERNEURONS_CUDNN_DETERMINISTIC="1", SUPERNEURONS_LAYOUT=layout,
               SUPERNEURONS_CUDA_GRAPH="1" if replay else "0")
    r = subprocess.run([sys.executable, "-m", "superneurons", "train", "--solver", f"{name}.prototxt", "--gpu", "0",
                        "--no-progress", "--precision", precision], capture_output=True, text=True, env=env,
                       cwd=where, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    model = read_binary(str(where / name / "m_iter_6.caffemodel"), pb.NetParameter())
    weights = {f"{l.name}.{k}": blob_to_array(b, l.name) for l in model.layer for k, b in enumerate(l.blobs)}
    return weights, r.stderr


@pytest.mark.parametrize("precision,layout", [("fp32", "nchw"), ("bf16", "nhwc"), ("fp16", "nchw")])
def test_training_with_replay_writes_the_eager_weights(tmp_path, precision, layout):
    """`superneurons train` with a DummyData net (the data layer runs on the host in front of the graph, drawing
    fresh values each pass), a stepped learning rate and momentum: the snapshot equals the eager run's."""
    eager, _ = _train(tmp_path, f"eager-{precision}", DUMMY + BODY, precision, layout, False)
    replayed, log = _train(tmp_path, f"graph-{precision}", DUMMY + BODY, precision, layout, True)
    assert "replay as CUDA graphs" in log, log[-3000:]
    assert set(eager) == set(replayed)
    differing = [k for k in eager if not np.array_equal(eager[k], replayed[k])]
    assert not differing, differing


def test_a_net_with_dropout_replays_each_pass_mask(tmp_path):
    """Dropout's kernels read the pass's key from the device, written before each launch: the masks of replayed
    passes are the eager passes' (the weights would differ from the first replay on otherwise)."""
    dropout = BODY.replace('layer { name: "fc2"', 'layer { name: "drop" type: "Dropout" bottom: "fc1" top: "fc1" }\n'
                           'layer { name: "fc2"')
    eager, _ = _train(tmp_path, "dropout-eager", DUMMY + dropout, "fp32", "nchw", False)
    replayed, log = _train(tmp_path, "dropout-graph", DUMMY + dropout, "fp32", "nchw", True)
    assert "replay as CUDA graphs" in log, log[-3000:]
    differing = [k for k in eager if not np.array_equal(eager[k], replayed[k])]
    assert not differing, differing
