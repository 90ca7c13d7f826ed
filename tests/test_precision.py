"""Half-precision storage (docs/PRECISION.md): NVCaffe's fields, per-blob storage types, each layer family's half
result against float64, every memory mode in bfloat16, loss scaling, the errors, and bit-exact resumes."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

from harness import load_tool, make_layer
from superneurons.backend.cpu import CpuBackend
from superneurons.dtypes import BFLOAT16, FLOAT16, FLOAT32
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.graph.precision import check_backend, override_defaults
from superneurons.io.caffemodel import blob_to_array, load_weights
from superneurons.memory.plan import make_plan
from superneurons.memory.pool import round_up
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from superneurons.solver import loss_scale
from superneurons.solver.evaluate import evaluate
from test_memory_modes import CONV_FAN, _input
from test_solver import Quiet, solver_param
from superneurons.solver import Solver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = CpuBackend()
HALVES = {"fp16": FLOAT16, "bf16": BFLOAT16}
# Unit roundoff of each storage type: one rounding of a float32 result into it errs by at most this, relative.
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def _graph(text: str, precision: str | None = None, phase=pb.TRAIN):
    net = override_defaults(text_format.Parse('name: "t"\n' + text, pb.NetParameter()), precision)
    return build_graph(net, phase, source="net.prototxt")


# -- the schema ----------------------------------------------------------------------------------------------
NVCAFFE_NET = """
default_forward_type: FLOAT16 default_backward_type: FLOAT16
default_forward_math: FLOAT default_backward_math: FLOAT
global_grad_scale: 8 global_grad_scale_adaptive: true
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 }
    shape { dim: 8 dim: 6 } shape { dim: 8 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" forward_type: BFLOAT16 backward_type: FLOAT
  cudnn_math_override: 1 forward_math: FLOAT16
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "flat" type: "Flatten" bottom: "ip1" top: "flat" }
layer { name: "ip2" type: "InnerProduct" bottom: "flat" top: "ip2"
  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def test_nvcaffe_fields_parse_and_give_each_blob_its_storage_type():
    graph = _graph(NVCAFFE_NET)
    p = graph.precision
    assert (p.grad_scale, p.adaptive) == (8.0, True)
    # The data layer's batch in the net's forward type, its labels in float32; a layer's own types win;
    # in place and views follow the tensor they write or view; the loss stays float32.
    assert p.data == {"data": FLOAT16, "label": FLOAT32, "ip1": BFLOAT16, "flat": BFLOAT16, "ip2": FLOAT16,
                      "loss": FLOAT32}
    assert p.diff["ip1"] == FLOAT32 and p.diff["ip2"] == FLOAT16
    net = Net(graph, BACKEND)
    assert net.data["ip1"].dtype == BFLOAT16 and net.diff["ip2"].dtype == FLOAT16
    assert all(t.dtype == FLOAT32 for t in net.tensors if t.kind in ("param", "param_diff"))
    solver = text_format.Parse("solver_data_type: FLOAT16", pb.SolverParameter())
    assert solver.solver_data_type == pb.FLOAT16
    # --precision and precision= set the defaults only: ip1 keeps its own forward type.
    assert _graph(NVCAFFE_NET, "bf16").precision.data["ip2"] == BFLOAT16
    assert _graph(NVCAFFE_NET, "bf16").precision.data["ip1"] == BFLOAT16


def test_float16_raw_blobs_of_an_nvcaffe_model_load(tmp_path, rng):
    graph = _graph(NVCAFFE_NET)
    net = Net(graph, BACKEND)
    model = pb.NetParameter(name="t")
    expect = {}
    for name, kind, dtype in (("ip1", pb.FLOAT16, np.dtype("<f2")), ("ip2", pb.BFLOAT16, BFLOAT16)):
        lp = model.layer.add(name=name, type="InnerProduct")
        for decl in net.layer(name).params:
            values = rng.standard_normal(decl.shape).astype(dtype)
            blob = lp.blobs.add(raw_data_type=kind, raw_data=values.tobytes())
            blob.shape.dim.extend(decl.shape)
            expect.setdefault(name, []).append(values.astype(np.float64))
    path = tmp_path / "nv.caffemodel"
    path.write_bytes(model.SerializeToString())
    load_weights(net, str(path))
    for name, arrays in expect.items():
        for decl, want in zip(net.layer(name).params, arrays):
            np.testing.assert_array_equal(BACKEND.to_host(decl.data).astype(np.float64), want)
    short = pb.BlobProto(raw_data_type=pb.FLOAT16, raw_data=b"\0" * 6)
    short.shape.dim.extend([4])
    with pytest.raises(UserError, match=r"m\.caffemodel: the blob's shape \(4\) needs 4 FLOAT16 values \(8 bytes\).*6"):
        blob_to_array(short, "m.caffemodel")


# -- each layer family: half storage, float32 math, against float64 ------------------------------------------
FAMILIES = {
    "conv": ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 pad: 1 }', [(2, 3, 6, 6)]),
    "deconv": ('type: "Deconvolution" convolution_param { num_output: 3 kernel_size: 2 stride: 2 }', [(2, 3, 4, 4)]),
    "inner_product": ('type: "InnerProduct" inner_product_param { num_output: 5 }', [(3, 4, 2, 2)]),
    "max_pool": ('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', [(2, 3, 6, 6)]),
    "ave_pool": ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 }', [(2, 3, 7, 7)]),
    "relu": ('type: "ReLU" relu_param { negative_slope: 0.1 }', [(3, 5, 4)]),
    "sigmoid": ('type: "Sigmoid"', [(3, 5, 4)]),
    "tanh": ('type: "TanH"', [(3, 5, 4)]),
    "eltwise_sum": ('type: "Eltwise" eltwise_param { operation: SUM coeff: 0.5 coeff: -2 }', [(2, 3, 4), (2, 3, 4)]),
    "eltwise_prod": ('type: "Eltwise" eltwise_param { operation: PROD }', [(2, 3, 4), (2, 3, 4)]),
    "concat": ('type: "Concat"', [(2, 3, 4), (2, 2, 4)]),
    "batch_norm": ('type: "BatchNorm"', [(4, 3, 5, 5)]),
    "scale": ('type: "Scale" scale_param { bias_term: true }', [(2, 3, 4, 4)]),
    "lrn": ('type: "LRN" lrn_param { local_size: 3 }', [(2, 5, 4, 4)]),
    "softmax": ('type: "Softmax"', [(3, 7)]),
    "power": ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', [(3, 5)]),
    "prelu": ('type: "PReLU"', [(2, 3, 4)]),
    "elu": ('type: "ELU"', [(3, 5)]),
    "absval": ('type: "AbsVal"', [(3, 5)]),
    "exp": ('type: "Exp" exp_param { scale: 0.5 }', [(3, 5)]),
    "bias": ('type: "Bias"', [(2, 3, 4)]),
    "mvn": ('type: "MVN"', [(2, 3, 4, 5)]),
    "reduction": ('type: "Reduction" reduction_param { operation: SUMSQ axis: 1 }', [(3, 4, 5)]),
    "slice": ('type: "Slice" slice_param { axis: 1 slice_point: 2 } top: "a" top: "b"', [(2, 5, 3)]),
    "tile": ('type: "Tile" tile_param { axis: 1 tiles: 3 }', [(2, 2, 3)]),
    "crop": ('type: "Crop" crop_param { axis: 2 offset: 1 }', [(2, 3, 6, 6), (2, 3, 4, 4)]),
    "dropout": ('type: "Dropout" dropout_param { dropout_ratio: 0.4 }', [(4, 50)]),
}


def _round(a: np.ndarray, dtype) -> np.ndarray:
    return a.astype(dtype).astype(np.float64)


@pytest.mark.parametrize("precision", list(HALVES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_layer_family_stores_half_and_computes_in_float32(family, precision, rng):
    """Inputs and top gradients given in half; the reference is the float64 layer on the same (rounded) values.
    Tolerance: |half - ref| <= 2u|ref| + 4u max|ref| (u: the type's unit roundoff), one rounding into storage
    plus float32 math."""
    half = HALVES[precision]
    text, shapes = FAMILIES[family]
    bottoms = [_round(rng.standard_normal(s), half) for s in shapes]
    seed = int(rng.integers(1 << 30))
    ref_layer, top_shapes = make_layer(text, shapes, rng=np.random.default_rng(seed))
    top_diffs = [_round(rng.standard_normal(s), half) for s in top_shapes]
    layer, _ = make_layer(text, shapes, rng=np.random.default_rng(seed), dtype=np.float32)
    for decl, ref in zip(layer.params, ref_layer.params):  # float32 masters, the reference reads the same values
        ref.data[...] = decl.data
    for buf in layer.buffers.values():
        if buf.array.dtype == np.float64:
            buf.array = buf.array.astype(np.float32)

    def run(lay, dtype):
        bs = [b.astype(dtype) for b in bottoms]
        tops = [np.zeros(s, dtype) for s in top_shapes]
        lay.forward(bs, tops)
        bdiffs = [np.zeros(b.shape, dtype) for b in bs]
        lay.backward(tops, [d.astype(dtype) for d in top_diffs], [True] * len(bs), bs, bdiffs)
        return tops, bdiffs, [np.array(d.diff, np.float64) for d in lay.params]

    want = run(ref_layer, np.float64)
    got = run(layer, half)
    u = UNIT[precision]
    for what, gs, ws in zip(("top", "bottom gradient", "param gradient"), got, want):
        for g, w in zip(gs, ws):
            if what != "param gradient":
                assert g.dtype == half
            g = g.astype(np.float64)
            bound = 2 * u * np.abs(w) + 4 * u * np.abs(w).max()
            if what == "param gradient":  # float32 storage, from half inputs: float32 rounding
                bound = 1e-5 * (np.abs(w) + np.abs(w).max())
            assert np.all(np.abs(g - w) <= bound), f"{family} {what}: max error {np.abs(g - w).max():.3g}"


# -- the memory runtime ----------------------------------------------------------------------------------------
def _train(text: str, memory: str, precision: str, iters: int = 3):
    net = Net(_graph(text, precision), BACKEND, train=True, seed=7, memory=memory)
    rng = np.random.default_rng(1)
    losses = []
    for it in range(iters):
        net.ctx.iteration = it
        net.data["data"].array[...] = rng.standard_normal(net.data["data"].shape)
        net.data["label"].array[...] = rng.integers(0, 3, net.data["label"].shape)
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for decl in net.learnable:
            decl.data -= np.float32(0.1) * decl.diff
    return [t.array.tobytes() for t in net.tensors if t.kind == "param"], losses, net


def test_every_memory_mode_trains_bf16_to_baseline_bf16_weights_bit_for_bit():
    ref, ref_losses, net = _train(CONV_FAN, "baseline", "bf16")
    assert net.data["conv1"].dtype == BFLOAT16 and net.diff["sum"].dtype == BFLOAT16
    fp32, _, _ = _train(CONV_FAN, "baseline", "fp32")
    assert fp32 != ref  # half storage is really in play
    for mode in ("liveness", "offload", "recompute", "auto"):
        got, losses, _ = _train(CONV_FAN, mode, "bf16")
        assert losses == ref_losses and got == ref, mode


def test_the_plan_counts_half_bytes():
    """Every planned tensor is elements x its storage type's size (in whole pool blocks), so a half one is half."""
    wide = _input((16, 3, 32, 32), 16) + CONV_FAN[len(_input((2, 3, 8, 8), 2)):]
    programs = {p: make_plan(_graph(wide, p), train=True) for p in ("fp32", "bf16")}
    layout = Net(_graph(wide, "bf16"), BACKEND).layout
    halved = copies = 0
    for key, t in programs["bf16"].program.tensors.items():
        if key not in programs["fp32"].program.tensors:  # a half working copy of a weight (or its half gradient)
            spec = layout.by_key[key]
            if key.endswith("_float32"):  # the loss's float32 copy of its half bottom (or of that one's gradient)
                assert key.startswith("loss#bottom0_") and spec.dtype == FLOAT32, key
                assert t.nbytes == round_up(4 * int(np.prod(spec.shape))), key
                continue
            assert "#param" in key and spec.dtype == BFLOAT16, key
            assert t.nbytes == round_up(2 * int(np.prod(spec.shape))), key
            copies += 1
            continue
        full = programs["fp32"].program.tensors[key].nbytes
        if layout.by_key[key].dtype == BFLOAT16:
            assert t.nbytes == round_up(full // 2), key
            halved += 1
        else:
            assert t.nbytes == full and layout.by_key[key].dtype != FLOAT16, key
    assert halved >= 10 and copies >= 2
    assert programs["bf16"].param_bytes == programs["fp32"].param_bytes  # master weights stay float32


def test_a_float32_layer_computes_on_planned_float32_copies_of_its_half_bottoms(monkeypatch):
    """The loss (a float32 layer) reads fc2, which bfloat16 stores: the Net casts fc2 into a float32 buffer of the
    loss's forward step and hands the loss's backward a float32 buffer for fc2's gradient, which it rounds into
    the bfloat16 gradient after (Layer.use_float32_copies). So the ops see one type (on the GPU none runs on
    copies of its own outside the pool), the plan holds the copies in those steps alone, and the numbers are the
    CPU's float32 math on the half arrays, bit for bit."""
    ref, ref_losses, net = _train(CONV_FAN, "liveness", "bf16")
    layout = net.layout
    fwd, diff = "loss#bottom0_forward_float32", "loss#bottom0_diff_float32"
    # The loss's backward reads its labels and its own probabilities, not fc2: no backward copy of fc2.
    assert {key for key, _name, _fb in layout.buffer_keys["loss"]} >= {fwd, diff}
    assert "loss#bottom0_backward_float32" not in layout.by_key
    assert layout.by_key[fwd].dtype == layout.by_key[diff].dtype == FLOAT32
    assert layout.by_key[fwd].shape == net.data["fc2"].shape and net.data["fc2"].dtype == BFLOAT16
    program = make_plan(net.graph, train=True, layout=layout).program
    steps = [(s.phase, s.node.name) for s in program.steps if fwd in s.uses or diff in s.uses]
    assert steps == [("forward", "loss"), ("backward", "loss")]  # a buffer of each step alone
    seen = []
    for name in ("softmax_forward", "softmax_loss_backward"):
        real = getattr(net.ops, name)
        monkeypatch.setattr(net.ops, name, lambda *a, _real=real, **k: (
            seen.extend(x.dtype for x in a if isinstance(x, np.ndarray) and x.dtype.kind in "fV"), _real(*a, **k))[1])
    net.forward_backward()
    assert seen and set(seen) == {np.dtype(FLOAT32)}
    monkeypatch.undo()
    # Without the copies, the CPU's ops widen the half arrays themselves: the same numbers.
    monkeypatch.setattr("superneurons.layers.base.Layer.use_float32_copies", lambda *a: None)
    got, losses, plain = _train(CONV_FAN, "liveness", "bf16")
    assert not plain.layer("loss").float32_copies("forward")
    assert (got, losses) == (ref, ref_losses)


def test_resnet50_at_batch_64_peaks_at_most_0_52_of_float32_in_bfloat16_in_every_mode():
    from superneurons.io.prototxt import read_net

    peaks = {}
    for precision in ("fp32", "bf16"):
        net = override_defaults(read_net(os.path.join(ROOT, "models/resnet50/resnet50_dummy.prototxt")), precision)
        plan = make_plan(build_graph(net, pb.TRAIN), train=True)
        peaks[precision] = {m: plan.peak(m)[0] for m in ("baseline", "liveness", "offload", "recompute")}
    assert all(peaks["bf16"][m] <= 0.52 * peaks["fp32"][m] for m in peaks["fp32"]), peaks


# -- loss scaling ----------------------------------------------------------------------------------------------
def _regression(weight: float, extra: str = "", filler: str = 'type: "gaussian" std: 1') -> str:
    """x -> InnerProduct -> Euclidean loss against 0 with loss weight `weight`: the gradients are `weight`-small."""
    return extra + f"""
layer {{ name: "data" type: "DummyData" top: "data" top: "zero"
  dummy_data_param {{ data_filler {{ {filler} }} data_filler {{ type: "constant" value: 0 }}
    shape {{ dim: 4 dim: 8 }} shape {{ dim: 4 dim: 3 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 3 weight_filler {{ type: "gaussian" std: 1 }} }} }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "zero" top: "loss" loss_weight: {weight} }}
"""


def _solver(net: str, text: str = "base_lr: 1e8 max_iter: 5"):
    return Solver(solver_param(text, net=net), "s.prototxt", log=Quiet())


def _weights(solver) -> list[bytes]:
    return [BACKEND.to_host(d.data).tobytes() for d in solver.net.learnable]


def test_float16_gradients_underflow_without_scaling_and_train_with_adaptive_scaling():
    """Loss weight 1e-9: the top gradient (~1e-10) is below float16's smallest subnormal (6e-8)."""
    plain = _solver(_regression(1e-9, "default_forward_type: FLOAT16 default_backward_type: FLOAT16"))
    before = _weights(plain)
    plain.step(5)
    assert _weights(plain) == before  # every gradient underflowed to zero: nothing trains
    full = _solver(_regression(1e-9))
    full.step(5)
    scaled = _solver(_regression(1e-9, "default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
                                       "global_grad_scale_adaptive: true"))
    scaled.step(5)
    assert scaled.loss_scale.scale == 2.0 ** 16
    w32 = [BACKEND.to_host(d.data) for d in full.net.learnable]
    w16 = [BACKEND.to_host(d.data) for d in scaled.net.learnable]
    w0 = [np.frombuffer(b, np.float32) for b in before]
    for a, b, c in zip(w32, w16, w0):
        assert np.abs(a.ravel() - c).max() > 0.1  # float32 moves the weights ...
        np.testing.assert_allclose(b, a, rtol=0.02, atol=0.02)  # ... and scaled float16 moves them alike


def test_adaptive_scaling_skips_overflowing_steps_and_lowers_the_scale():
    solver = _solver(_regression(1.0, "default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
                                      "global_grad_scale: 1048576 global_grad_scale_adaptive: true"),
                     "base_lr: 0.01 max_iter: 8")
    before = _weights(solver)
    solver.step(1)
    assert _weights(solver) == before and solver.loss_scale.scale == 2.0 ** 19
    solver.step(7)
    lowered = [line for line in solver.log.lines if "gradient overflow: update skipped" in line]
    assert 1 <= len(lowered) < 8 and "loss scale lowered to 524288" in lowered[0]
    assert _weights(solver) != before


def test_adaptive_scaling_raises_the_scale_after_clean_steps(monkeypatch):
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 2)
    solver = _solver(_regression(1e-3, "default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
                                       "global_grad_scale: 4 global_grad_scale_adaptive: true"), "base_lr: 0.01")
    solver.step(4)
    assert solver.loss_scale.scale == 16.0
    assert sum("without overflow: loss scale raised to" in line for line in solver.log.lines) == 2


OVERFLOW = 'type: "constant" value: 300'  # 8 inputs of 300 through weights ~1 reach float16's 65504 and beyond


def test_an_inf_loss_in_float16_without_adaptive_scaling_names_the_first_layer():
    net = _regression(1.0, "default_forward_type: FLOAT16 default_backward_type: FLOAT16", OVERFLOW)
    net = net.replace('weight_filler { type: "gaussian" std: 1 }', 'weight_filler { type: "constant" value: 60 }')
    solver = _solver(net, "base_lr: 0.01")
    with pytest.raises(UserError, match="the loss is inf at iteration 0 with float16 storage; layer 'ip' was the first "
                                        "to produce Inf or NaN; adaptive loss scaling exists"):
        solver.step(1)


def test_an_adaptive_scale_below_2_to_the_minus_24_stops_the_run():
    net = _regression(1.0, "default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
                           "global_grad_scale: 4e-7 global_grad_scale_adaptive: true", OVERFLOW)
    net = net.replace('weight_filler { type: "gaussian" std: 1 }', 'weight_filler { type: "constant" value: 60 }')
    solver = _solver(net, "base_lr: 0.01")
    with pytest.raises(UserError, match=r"the adaptive loss scale fell to .*below 2\^-24, at iteration 2"):
        solver.step(5)


@pytest.mark.parametrize("master", ["FLOAT", "FLOAT16"])
def test_a_half_precision_run_resumes_from_its_snapshot_bit_exactly(master, tmp_path, monkeypatch):
    """float16 activations with adaptive scaling; master weights and momentum in `solver_data_type`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loss_scale, "GROWTH_INTERVAL", 3)
    net = _regression(1e-3, "default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
                            "global_grad_scale: 2 global_grad_scale_adaptive: true")
    text = f'base_lr: 0.05 momentum: 0.9 max_iter: 8 snapshot: 4 snapshot_prefix: "snap/r" solver_data_type: {master}'
    full = _solver(net, text)
    assert full.net.learnable[0].data.dtype == (FLOAT16 if master == "FLOAT16" else FLOAT32)
    assert full.net.history[0][0].dtype == full.net.learnable[0].data.dtype
    full.solve()
    assert full.loss_scale.scale > 2
    uninterrupted = (tmp_path / "snap/r_iter_8.caffemodel").read_bytes()
    os.remove(tmp_path / "snap/r_iter_8.caffemodel")
    resumed = _solver(net, text)
    resumed.solve(resume="snap/r_iter_4.solverstate")
    assert resumed.loss_scale.state() == full.loss_scale.state()
    assert (tmp_path / "snap/r_iter_8.caffemodel").read_bytes() == uninterrupted


# -- mistakes: one line naming the file and the layer ----------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ('forward_type: INT', r"net\.prototxt: layer 'ip': forward_type: INT cannot store a layer's blobs"),
    ('backward_type: DOUBLE', r"layer 'ip': backward_type: DOUBLE cannot store"),
    ('forward_math: BOOL', r"layer 'ip': forward_math: BOOL is no math type"),
])
def test_a_type_a_layer_cannot_use_is_refused(text, message):
    net = _regression(1.0).replace('name: "ip" type: "InnerProduct"', f'name: "ip" type: "InnerProduct" {text}')
    with pytest.raises(UserError, match=message):
        _graph(net)


def test_a_grad_scale_of_zero_and_a_filler_beyond_float16_are_refused():
    with pytest.raises(UserError, match="net.prototxt: global_grad_scale is 0; it must be above 0"):
        _graph(_regression(1.0, "global_grad_scale: 0"))
    big = _regression(1.0).replace('weight_filler { type: "gaussian" std: 1 }',
                                   'weight_filler { type: "constant" value: 1e6 }')
    with pytest.raises(UserError, match=r"layer 'ip': param 0's constant filler reaches 1e\+06, beyond float16's "
                                        "largest value 65504"):
        _graph(big, "fp16")
    _graph(big, "bf16")  # bfloat16 spans float32's range


def test_the_cli_says_it_in_one_line_and_exits_1(tmp_path):
    model = tmp_path / "bad.prototxt"
    model.write_text('name: "t"\n' + _regression(1.0).replace('layer { name: "ip" type: "InnerProduct"',
                                                               'layer {\n  name: "ip"\n  type: "InnerProduct"\n'
                                                               '  forward_type: UINT'))
    run = subprocess.run([sys.executable, "-m", "superneurons", "memory", "--model", str(model), "--precision", "bf16"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{model}:7: layer 'ip': forward_type: UINT" in lines[0], run.stderr


def test_an_nvcaffe_prototxt_with_float16_defaults_trains():
    solver = _solver(NVCAFFE_NET, "base_lr: 0.2 momentum: 0.9 max_iter: 30")
    assert solver.net.data["ip2"].dtype == FLOAT16 and solver.loss_scale.adaptive
    losses = []
    solver.callbacks.append(lambda s, it, loss: losses.append(loss))
    solver.step(30)
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


class _Backend:
    name = "cuda"
    storage_types = (FLOAT32,)


def test_a_backend_without_half_kernels_refuses_a_half_net_in_one_line():
    with pytest.raises(UserError, match=r"net.prototxt: the cuda backend stores tensors in float32 only, and this net "
                                        r"asks for bfloat16; run it with --precision fp32"):
        check_backend(_graph(NVCAFFE_NET, "bf16"), _Backend())
    check_backend(_graph(NVCAFFE_NET.replace("FLOAT16", "FLOAT").replace("BFLOAT", "FLOAT"), "fp32"), _Backend())


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lenet_trains_on_the_digits_in_half_precision(precision, tmp_path, monkeypatch):
    """A short run (40 iterations of the LeNet example's SGD) reaches 90% on the 300 test digits; the full
    2000-iteration figures against float32 are in docs/PRECISION.md."""
    load_tool("data/make_digits_lmdb").main(["--out", str(tmp_path / "data" / "digits")])
    monkeypatch.chdir(tmp_path)
    lenet = os.path.join(ROOT, "models", "lenet", "lenet_train_test.prototxt")
    param = text_format.Parse(
        f'net: "{lenet}" base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "inv" gamma: 0.0001 '
        'power: 0.75 max_iter: 40 display: 0 test_iter: 3 test_interval: 1000 test_initialization: false '
        'snapshot_after_train: false random_seed: 1701', pb.SolverParameter())
    solver = Solver(param, "solver.prototxt", log=Quiet(), precision=precision)
    assert solver.net.data["conv1"].dtype == HALVES[precision]
    assert solver.loss_scale.adaptive == (precision == "fp16")
    solver.step(40)
    scores, _loss = evaluate(solver.test_nets[0], 3, 0)
    accuracy = next(s.value for s in scores if s.name == "accuracy")
    assert accuracy >= 0.9, accuracy


@pytest.mark.parametrize("defaults", ["default_forward_type: BFLOAT16 default_backward_type: BFLOAT16",
                                      "default_forward_type: FLOAT16 default_backward_type: FLOAT16 "
                                      "global_grad_scale: 1024 global_grad_scale_adaptive: true"],
                         ids=["bf16", "fp16_adaptive"])
@pytest.mark.parametrize("master", ["FLOAT", "BFLOAT16"])
def test_streamed_parameters_train_half_nets_to_their_baseline_weights(defaults, master, monkeypatch):
    """solver_data_type BFLOAT16: the host homes of streamed weights, gradients and momentum are bfloat16 too
    (half the pinned bytes), and the run is still the resident one's, bit for bit."""
    from test_param_offload import _dummy, _train as train_solver

    net = _dummy(CONV_FAN).replace('name: "t"\n', f'name: "t"\n{defaults}\n', 1)
    text = ('type: "SGD" base_lr: 0.05 momentum: 0.9 weight_decay: 0.01 clip_gradients: 0.5 max_iter: 3 '
            f'solver_data_type: {master}')
    ref, ref_w, ref_h = train_solver(net, text, "baseline")
    assert ref.net.data["conv1"].dtype in (BFLOAT16, FLOAT16)
    monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "1")
    solver, w, h = train_solver(net, text, "recompute")
    assert solver.net.params.offloaded and w == ref_w and h == ref_h
    homes = solver.net.params.home.values()
    assert homes and {a.dtype for a in homes} == {BFLOAT16 if master == "BFLOAT16" else FLOAT32}


def test_indices_and_labels_stay_float32_whoever_produces_them():
    text = """
layer { name: "data" type: "DummyData" top: "ids" dummy_data_param { data_filler { type: "constant" value: 301 }
  shape { dim: 4 dim: 1 } } }
layer { name: "flat" type: "Flatten" bottom: "ids" top: "flat_ids" }
layer { name: "embed" type: "Embed" bottom: "flat_ids" top: "vec"
  embed_param { num_output: 3 input_dim: 400 weight_filler { type: "gaussian" std: 1 } } }
"""
    graph = _graph(text, "bf16")
    assert graph.precision.data["ids"] == FLOAT32 and graph.precision.data["vec"] == BFLOAT16
    net = Net(graph, BACKEND, train=False)
    net.forward()
    weights = BACKEND.to_host(net.layer("embed").params[0].data)
    want = np.tile(weights[301], (4, 1, 1)).astype(BFLOAT16)  # row 301: bfloat16 would have read row 300 or 302
    np.testing.assert_array_equal(net.blob("vec"), want)
