"""float16 and bfloat16 storage on the GPU: whole nets against the CPU backend, which ops compute on half arrays
themselves, memory modes bit for bit, and training in the CLI. The op-by-op checks are the float32 op tests
run with `pytest --storage bf16` / `--storage fp16` (tests/gpu_harness.py).

Tolerances: both backends read the same half inputs and compute in float32, but sum in different orders, so a
result may round to the neighbouring half value; through a net the differences compound, so a loss is compared
at 2e-2 (bfloat16, 8 bits of mantissa) or 5e-3 (float16, 11 bits) of its value and parameter gradients at 6e-2
or 2e-2 of their largest entry (measured on an H200: 4.3e-2 and 1.4e-2).
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
from superneurons.backend.cuda import half_math
from superneurons.dtypes import BFLOAT16
from superneurons.graph.build import build_graph
from superneurons.graph.precision import override_defaults
from superneurons.io.caffemodel import blob_to_array
from superneurons.io.prototxt import read_binary
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

pytestmark = GPU_ONLY

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = {"bf16": (2e-2, 6e-2), "fp16": (5e-3, 2e-2)}  # (loss, parameter gradient), relative

# Every layer family the zoo's nets train with: convolution (+ReLU fused), BatchNorm+Scale+ReLU fused, Eltwise SUM
# (+ReLU fused), max and average pooling, Concat, Dropout, LRN, InnerProduct, SoftmaxWithLoss.
ZOO_BLOCKS = 'name: "zoo_blocks"\n' + dummy_images(32, 3, 32, 32) + """layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "msra" } bias_term: false } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param { num_output: 32 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "relu3" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "pool1" type: "Pooling" bottom: "sum" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 5 } }
layer { name: "conv3" type: "Convolution" bottom: "norm1" top: "conv3"
  convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "cat" type: "Concat" bottom: "conv3" bottom: "pool1" top: "cat" }
layer { name: "pool2" type: "Pooling" bottom: "cat" top: "pool2" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "pool2" top: "fc1"
  inner_product_param { num_output: 64 weight_filler { type: "xavier" } } }
layer { name: "relu4" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "drop" type: "Dropout" bottom: "fc1" top: "fc1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
"""


# Caffe's recurrent layers, unrolled into the runtime's steps: an RNN feeding an LSTM, the `cont` input restarting
# a stream half-way, a Euclidean loss against a target.
RECURRENT = """name: "recurrent"
layer { name: "in" type: "Input" top: "x" top: "cont" top: "target"
  input_param { shape { dim: 6 dim: 4 dim: 8 } shape { dim: 6 dim: 4 } shape { dim: 6 dim: 4 dim: 12 } } }
layer { name: "rnn" type: "RNN" bottom: "x" bottom: "cont" top: "r"
  recurrent_param { num_output: 10 weight_filler { type: "uniform" min: -0.3 max: 0.3 }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "lstm" type: "LSTM" bottom: "r" bottom: "cont" top: "h"
  recurrent_param { num_output: 12 weight_filler { type: "uniform" min: -0.3 max: 0.3 }
    bias_filler { type: "constant" value: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "target" top: "loss" }
"""
NETS = {"zoo_blocks": ZOO_BLOCKS, "recurrent": RECURRENT}


def _nets(gpu, precision: str, text: str = ZOO_BLOCKS) -> dict[str, Net]:
    net = override_defaults(text_format.Parse(text, pb.NetParameter()), precision)
    nets = {b.name: Net(build_graph(net, pb.TRAIN), b, seed=11) for b in (CPU, gpu)}
    if text is RECURRENT:  # the same inputs on both backends, in the storage type of the net's inputs
        rng = np.random.default_rng(5)
        cont = np.ones((6, 4))
        cont[0] = cont[3, :2] = 0  # every stream starts at t=0; two restart at t=3
        inputs = {"x": rng.standard_normal((6, 4, 8)), "cont": cont, "target": rng.uniform(-0.5, 0.5, (6, 4, 12))}
        for n in nets.values():
            for blob, values in inputs.items():
                n.backend.from_host(n.data[blob].array, values.astype(n.data[blob].dtype))
    return nets


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(NETS))
def test_a_half_net_computes_what_the_cpu_computes(gpu, precision, name):
    nets = _nets(gpu, precision, NETS[name])
    first = "conv1" if name == "zoo_blocks" else "h"
    assert str(nets["cuda"].data[first].dtype) == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    losses = {k: n.forward_backward() for k, n in nets.items()}
    loss_tol, grad_tol = TOLERANCE[precision]
    assert np.isfinite(losses["cuda"]) and abs(losses["cuda"] - losses["cpu"]) <= loss_tol * abs(losses["cpu"]), losses
    worst = 0.0
    for dc, dg in zip(nets["cpu"].learnable, nets["cuda"].learnable):
        want = CPU.to_host(dc.diff).astype(np.float64)
        got = gpu.to_host(dg.diff).astype(np.float64)
        assert dg.diff.dtype == np.float32  # master gradients stay float32
        err = float(np.abs(got - want).max()) / max(1e-3, float(np.abs(want).max()))
        worst = max(worst, err)
        assert err < grad_tol, (dc.name, err)
    print(f"{name} {precision}: loss cpu {losses['cpu']:.6f} gpu {losses['cuda']:.6f}; worst param-grad error {worst:.2e}")


def test_the_hot_ops_take_half_arrays_themselves(gpu):
    """Convolutions, GEMMs (the recurrent layers' included), BatchNorm, pooling, eltwise, LRN, Dropout, LSTM's unit
    and the activations run on half arrays
    directly, whatever the reason one would not (a kernel that does not compile, a mix of types). A float32 layer
    reading a half bottom (the loss reads fc2) computes on the float32 copies the Net makes in planned buffers
    (Layer.use_float32_copies), so its ops see one type and none of them runs on half_math's copies either."""
    for precision in ("bf16", "fp16"):
        for text in NETS.values():
            _nets(gpu, precision, text)["cuda"].forward_backward()
    print("ops on float32 copies:", sorted(half_math.refused().items()))
    refused = {op for op, _types in half_math.refused()}
    hot = {"conv_forward", "conv_backward", "conv_relu_forward", "gemm", "pool_forward", "pool_backward",
           "relu_forward", "relu_backward", "eltwise_sum", "eltwise_sum_relu", "eltwise_sum_relu_backward",
           "bn_affine_forward", "bn_affine_backward", "dropout_apply", "lrn_forward", "lrn_backward", "copy", "axpy",
           "add_bias", "bias_backward", "concat_forward", "concat_backward", "lstm_unit_forward",
           "lstm_unit_backward", "tanh_forward", "tanh_backward"}
    assert hot <= set(vars(gpu.ops))  # the names are the backend's
    assert not refused & hot, refused & hot
    losses = {"softmax_forward", "softmax_loss_forward", "softmax_loss_backward", "euclidean_loss_forward",
              "euclidean_loss_backward"}
    assert not refused & losses, refused & losses


ITERATIONS = 4
MODES = ("baseline", "liveness", "offload", "recompute", "auto")


def _train(where: Path, precision: str, mode: str, solver_extra: str = "",
           env_extra: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    (where / "net.prototxt").write_text(ZOO_BLOCKS)
    name = f"{precision}-{mode}" + ("-streamed" if env_extra else "") + ("-master" if solver_extra else "")
    (where / f"{name}.prototxt").write_text(
        f'net: "net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
        f'display: 1\nmax_iter: {ITERATIONS}\nsnapshot: {ITERATIONS}\nsnapshot_prefix: "{name}/m"\nrandom_seed: 3\n'
        + solver_extra)
    env = dict(os.environ, PYTHONPATH=str(ROOT), SUPERNEURONS_CUDNN_DETERMINISTIC="1", **(env_extra or {}))
    r = subprocess.run([sys.executable, "-m", "superneurons", "train", "--solver", f"{name}.prototxt", "--gpu", "0",
                        "--no-progress", "--memory", mode, "--precision", precision],
                       capture_output=True, text=True, env=env, cwd=where, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    model = read_binary(str(where / name / f"m_iter_{ITERATIONS}.caffemodel"), pb.NetParameter())
    return {f"{l.name}.{k}": blob_to_array(b, l.name) for l in model.layer for k, b in enumerate(l.blobs)}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_memory_mode_trains_to_the_baseline_weights_bit_for_bit(tmp_path, precision):
    """With SUPERNEURONS_CUDNN_DETERMINISTIC=1 nothing sums in a varying order: offload, recomputation and auto
    must reproduce baseline's half-precision run exactly."""
    reference = _train(tmp_path, precision, "baseline")
    for mode in MODES[1:]:
        got = _train(tmp_path, precision, mode)
        assert set(got) == set(reference)
        differing = [k for k in reference if not np.array_equal(got[k], reference[k])]
        assert not differing, f"{mode}: {differing}"


def test_bfloat16_master_weights_stream_from_the_host_to_the_resident_runs_bits(tmp_path):
    """solver_data_type: BFLOAT16 (the deepest-ResNet lever: weights, gradients and momentum in bfloat16 on the
    host): the GPU update ops take bfloat16 masters, and streaming them from the host changes no bit."""
    master = "solver_data_type: BFLOAT16\n"
    reference = _train(tmp_path, "bf16", "baseline", master)
    got = _train(tmp_path, "bf16", "recompute", master, {"SUPERNEURONS_PARAM_OFFLOAD": "1"})
    assert set(got) == set(reference)
    differing = [k for k in reference if not np.array_equal(got[k], reference[k])]
    assert not differing, differing
    # the masters are bfloat16: every saved weight is a bfloat16 value
    for k, w in reference.items():
        assert np.array_equal(w, w.astype(BFLOAT16).astype(np.float32)), k
    float32_master = _train(tmp_path, "bf16", "baseline")
    assert any(not np.array_equal(float32_master[k], reference[k]) for k in reference)


def test_bfloat16_conversions_in_kernels_round_as_ml_dtypes():
    """The kernels' bfloat16 casts, which every bfloat16 load and store in a kernel goes through, against the CPU
    backend's (ml_dtypes): widening every one of the 65,536 bit patterns is exact; narrowing float32 (random bit patterns, halfway cases, subnormals, infinities) and
    float64 (rounded once, directly: 1 + 2^-8 + 2^-30 goes up, where rounding through float32 would tie down to
    1) gives ml_dtypes' round-to-nearest-even bits; NaN stays NaN."""
    from numba import cuda

    from superneurons.backend.cuda import kernels as K
    from superneurons.backend.cuda.device import bits, make
    from superneurons.backend.cuda.kernels import elementwise as ek

    def bf16_array(n):
        buf = cuda.device_array(2 * n, np.uint8)
        return make(buf.gpu_data, (n,), BFLOAT16), buf

    rng = np.random.default_rng()
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    src, keep = bf16_array(patterns.size)
    bits(src).copy_to_device(patterns)
    wide = cuda.device_array(patterns.size, np.float32)
    K.launch(ek.scale_copy, wide.size)(np.float32(1.0), src, wide)
    want = patterns.view(BFLOAT16).astype(np.float32)
    got = wide.copy_to_host()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))

    f32 = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    halfway = (rng.integers(0, 1 << 16, 4096, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    tiny = np.array([1e-40, -3e-39, 1e-45, np.inf, -np.inf, 3.4e38, 0.0, -0.0], np.float32)
    f64 = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096), [1 + 2 ** -8 + 2 ** -30]])
    for values, alpha in ((np.concatenate([f32, halfway, tiny]), np.float32(1.0)), (f64, np.float64(1.0))):
        dst, keep = bf16_array(values.size)
        K.launch(ek.scale_copy, values.size)(alpha, cuda.to_device(values), dst)
        got = bits(dst).copy_to_host().view(BFLOAT16).astype(np.float32)
        want = values.astype(BFLOAT16).astype(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert got[-1] == np.float32(1 + 2 ** -7)
