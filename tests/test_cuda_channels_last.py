"""Channels-last (NHWC) tensors on the GPU (SUPERNEURONS_LAYOUT=nhwc, graph/layout.py): whole nets against the
CPU's NCHW reference in float32 and bfloat16 (loss, every parameter gradient, a blob read back), training a few
iterations to the CPU's weights, which ops convert layouts, and that the user-facing reads stay N,C,H,W.

Tolerances as tests/test_cuda_half.py's: float32 with FMA convolutions (the `gpu` fixture) at 1e-4 of the loss
and 1e-3 of a gradient's largest entry; bfloat16 at 2e-2 and 6e-2.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from gpu_harness import GPU_ONLY, NET_CPU as CPU, dummy_images
from superneurons.graph.build import build_graph
from superneurons.graph.precision import override_defaults
from superneurons.io.caffemodel import blob_to_array
from superneurons.io.prototxt import read_binary
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

pytestmark = GPU_ONLY

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (2e-2, 6e-2)}

# ResNet's and VGG's layer families: convolution (+ReLU fused, with and without bias, 3x3 and 1x1, a stride),
# BatchNorm+Scale+ReLU fused, Eltwise SUM+ReLU fused, max pooling (3x3 s2 padded, and 2x2 s2 with the ReLU's
# backward), a Concat (its ReLU'd bottom reading its slice of the gradient: the baseline's fusion) cut again by a
# Slice, average pooling, an InnerProduct flattening a 4-D blob, Dropout, SoftmaxWithLoss.
NET = 'name: "channels_last"\n' + dummy_images(8, 3, 20, 20) + """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 stride: 2 weight_filler { type: "msra" } bias_term: false } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "msra" } bias_term: false } }
layer { name: "bn3" type: "BatchNorm" bottom: "conv3" top: "conv3" }
layer { name: "scale3" type: "Scale" bottom: "conv3" top: "conv3" scale_param { bias_term: true } }
layer { name: "sum" type: "Eltwise" bottom: "pool1" bottom: "conv3" top: "sum" }
layer { name: "relu3" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "conv4" type: "Convolution" bottom: "sum" top: "conv4"
  convolution_param { num_output: 24 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu4" type: "ReLU" bottom: "conv4" top: "conv4" }
layer { name: "cat" type: "Concat" bottom: "conv4" bottom: "sum" top: "cat" }
layer { name: "cut" type: "Slice" bottom: "cat" top: "cut1" top: "cut2" slice_param { axis: 1 slice_point: 20 } }
layer { name: "join" type: "Eltwise" bottom: "cut1" bottom: "cut2" top: "join" }
layer { name: "pool2" type: "Pooling" bottom: "join" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "pool3" type: "Pooling" bottom: "pool2" top: "pool3" pooling_param { pool: AVE kernel_size: 2 stride: 1 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool3" top: "fc1"
  inner_product_param { num_output: 32 weight_filler { type: "xavier" } } }
layer { name: "relu5" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "drop" type: "Dropout" bottom: "fc1" top: "fc1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
"""


@pytest.fixture
def nhwc(monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")


def _nets(gpu, precision: str) -> dict[str, Net]:
    net = override_defaults(text_format.Parse(NET, pb.NetParameter()), precision)
    return {b.name: Net(build_graph(net, pb.TRAIN), b, seed=11) for b in (CPU, gpu)}


def _nchw_gpu_net(gpu, precision: str, monkeypatch) -> Net:
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nchw")
    try:
        net = override_defaults(text_format.Parse(NET, pb.NetParameter()), precision)
        return Net(build_graph(net, pb.TRAIN), gpu, seed=11)
    finally:
        monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_nhwc_net_computes_what_the_cpu_computes(gpu, nhwc, precision, monkeypatch):
    """Every parameter gradient within the tolerance of the CPU's, or (bfloat16, whose roundings compound through
    the net) no further from it than 1.5 times the NCHW GPU net's."""
    from superneurons.backend.cuda.device import channels_last

    nets = _nets(gpu, precision)
    g = nets["cuda"]
    nhwc_keys = {s.key for s in g.layout.specs if s.layout == "NHWC"}
    assert {"conv2", "sum", "conv4", "cat", "cut1", "pool2", "conv2@diff", "cat@diff", "conv4#param0_copy"} <= nhwc_keys, sorted(nhwc_keys)
    assert {"data", "pool3"}.isdisjoint(nhwc_keys)
    assert {s.key for s in nets["cpu"].layout.specs if s.layout == "NHWC"} == set()
    losses = {k: n.forward_backward() for k, n in nets.items()}
    assert channels_last(g.data["conv4"].array) and g.data["conv4"].array.shape == (8, 24, 6, 6)
    loss_tol, grad_tol = TOLERANCE[precision]
    assert np.isfinite(losses["cuda"]) and abs(losses["cuda"] - losses["cpu"]) <= loss_tol * abs(losses["cpu"]), losses
    # an NHWC blob reads back N,C,H,W
    want = CPU.to_host(nets["cpu"].data["conv4"].array).astype(np.float64)
    got = gpu.to_host(g.data["conv4"].array).astype(np.float64)
    assert got.shape == want.shape == (8, 24, 6, 6)
    assert float(np.abs(got - want).max()) <= 20 * loss_tol * max(1.0, float(np.abs(want).max()))
    plain = _nchw_gpu_net(gpu, precision, monkeypatch)
    plain.forward_backward()
    worst = 0.0
    for k, (dc, dg, dp) in enumerate(zip(nets["cpu"].learnable, g.learnable, plain.learnable)):
        want = CPU.to_host(dc.diff).astype(np.float64)
        got = gpu.to_host(dg.diff).astype(np.float64)
        assert got.shape == want.shape  # master gradients stay KCRS
        scale = max(1e-3, float(np.abs(want).max()))
        err = float(np.abs(got - want).max()) / scale
        err_nchw = float(np.abs(gpu.to_host(dp.diff).astype(np.float64) - want).max()) / scale
        worst = max(worst, err)
        assert err < grad_tol or err <= 1.5 * err_nchw, (k, err, err_nchw)
    print(f"{precision}: loss cpu {losses['cpu']:.6f} gpu {losses['cuda']:.6f}; worst param-grad error {worst:.2e}")


def test_which_ops_convert_layouts(gpu, nhwc):
    """Only where the layout changes: the first convolution reads the data layer's NCHW batch, and the pooling
    whose top the InnerProduct flattens writes NCHW. Everything else runs on NHWC arrays as they are (a weight
    gradient left in its KRSC copy goes into the KCRS master gradient in one pass, channels_last_ops.copy / axpy)."""
    from superneurons.backend.cuda import layout_conversion

    before = layout_conversion.conversions()
    for precision in ("fp32", "bf16"):
        _nets(gpu, precision)["cuda"].forward_backward()
    after = layout_conversion.conversions()
    converted = {op for op in after if after[op] > before.get(op, 0)}
    print("ops that converted:", {op: after[op] - before.get(op, 0) for op in converted})
    assert converted <= {"conv_forward", "conv_relu_forward", "conv_backward", "pool_forward", "pool_backward"}, converted


def _train(where: Path, layout: str, gpu: bool, precision: str) -> dict[str, np.ndarray]:
    (where / "net.prototxt").write_text(NET)
    name = f"{layout}-{precision}-{'gpu' if gpu else 'cpu'}"
    (where / f"{name}.prototxt").write_text(
        f'net: "net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
        f'display: 1\nmax_iter: 3\nsnapshot: 3\nsnapshot_prefix: "{name}/m"\nrandom_seed: 3\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT), SUPERNEURONS_LAYOUT=layout, SUPERNEURONS_TF32="0")
    command = [sys.executable, "-m", "superneurons", "train", "--solver", f"{name}.prototxt", "--no-progress",
               "--precision", precision] + (["--gpu", "0"] if gpu else [])
    r = subprocess.run(command, capture_output=True, text=True, env=env, cwd=where, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    model = read_binary(str(where / name / "m_iter_3.caffemodel"), pb.NetParameter())
    return {f"{l.name}.{k}": blob_to_array(b, l.name) for l in model.layer for k, b in enumerate(l.blobs)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_reaches_the_cpu_weights(tmp_path, precision):
    """Three SGD iterations with NHWC on the GPU end at the CPU's weights (the caffemodel, written KCRS), as
    closely as NCHW on the GPU does."""
    cpu = _train(tmp_path, "nchw", False, precision)
    nhwc_gpu = _train(tmp_path, "nhwc", True, precision)
    nchw_gpu = _train(tmp_path, "nchw", True, precision)
    assert set(cpu) == set(nhwc_gpu) == set(nchw_gpu)
    tol = 1e-3 if precision == "fp32" else 3e-2
    for key, want in cpu.items():
        scale = max(1e-2, float(np.abs(want).max()))
        assert nhwc_gpu[key].shape == want.shape
        err_nhwc = float(np.abs(nhwc_gpu[key] - want).max()) / scale
        err_nchw = float(np.abs(nchw_gpu[key] - want).max()) / scale
        assert err_nhwc <= max(tol, 2 * err_nchw), (key, err_nhwc, err_nchw)


def test_pycaffe_reads_and_writes_nchw(tmp_path, nhwc, rng):
    """pycaffe's blobs of an NHWC net are N,C,H,W: a write into a channels-last blob reaches the device in that
    order (the next layer reads it), reads match the CPU net's, and the caffemodel the GPU net saves holds the
    CPU net's KCRS weights."""
    import superneurons as caffe

    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    caffe.set_mode_cpu()
    cpu = caffe.Net(str(path), caffe.TRAIN)
    cpu.save(str(tmp_path / "w.caffemodel"))
    caffe.set_mode_gpu()
    caffe.set_device(0)
    try:
        gpu = caffe.Net(str(path), str(tmp_path / "w.caffemodel"), caffe.TRAIN)
        assert gpu._net.layout.by_key["sum"].layout == "NHWC" and gpu._net.layout.by_key["conv4"].layout == "NHWC"
        x = rng.standard_normal(gpu.blobs["sum"].data.shape).astype(np.float32)
        for net in (cpu, gpu):  # conv4 reads sum: run from there on the values written
            net.blobs["sum"].data[...] = x
            net.forward(start="conv4", end="pool3")
        np.testing.assert_array_equal(gpu.blobs["sum"].data, x)
        for blob in ("conv4", "pool2", "pool3"):  # TF32 convolutions on the GPU: ~1e-3 of the values
            np.testing.assert_allclose(gpu.blobs[blob].data, cpu.blobs[blob].data, rtol=2e-2, atol=2e-2, err_msg=blob)
        gpu.save(str(tmp_path / "g.caffemodel"))
        caffe.set_mode_cpu()
        back = caffe.Net(str(path), str(tmp_path / "g.caffemodel"), caffe.TRAIN)
        for name in ("conv1", "conv2", "conv4"):
            np.testing.assert_array_equal(back.params[name][0].data, cpu.params[name][0].data)  # KCRS kept
    finally:
        caffe.set_mode_cpu()
