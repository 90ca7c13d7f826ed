"""The Convolution + ReLU fusion (graph/fuse.py: fuse_conv_relu, backend op conv_relu_forward/backward).

The ops against an independent float64 reference (a sliding-window convolution) and central differences, and
against the unfused ops bit for bit; fused nets against the same nets with SUPERNEURONS_FUSE=0 (bit for bit: the
CPU fused op repeats the unfused arithmetic), with gradient aliasing on and off, and in every memory mode; the
pass's detection rules. The CUDA passes are checked under the simulator in test_conv_relu_kernels_sim.py and on a
GPU in the gpu-marked tests at the end.
"""
from __future__ import annotations

import numpy as np
import pytest
from harness import _numeric, make_layer
from test_convolution import ref_conv
from test_fusion import (_graph, _train, assert_test_phase_forward_matches_unfused,
                         assert_trains_like_unfused_in_every_mode)
from test_memory_modes import W, _check_modes, _input, _layer, conv

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cuda.probe import gpu_available
from superneurons.backend.geometry import ConvGeometry
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.layers.fused import Absorbed
from superneurons.layers.fused.conv_relu import ConvolutionReLU
from superneurons.layers.fused.max_pool_relu import MaxPoolingReLU
from superneurons.memory.plan import make_plan
from superneurons.proto import superneurons_pb2 as pb

OPS = CpuBackend().ops


def leaky64(v, slope):
    return np.where(v > 0, v, v * slope)


GEOMS = {  # (x shape, weight shape, geometry)
    "plain": ((2, 3, 6, 5), (4, 3, 3, 3), ConvGeometry((3, 3), (1, 1), (1, 1))),
    "strided grouped": ((2, 4, 7, 7), (6, 2, 3, 2), ConvGeometry((3, 2), (2, 1), (1, 0), (1, 1), 2)),
    "dilated": ((1, 2, 7, 6), (3, 2, 2, 2), ConvGeometry((2, 2), (1, 1), (0, 1), (2, 2))),
}


def _arrays(rng, name, dtype=np.float32):
    x_shape, w_shape, geom = GEOMS[name]
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    b = rng.standard_normal(w_shape[0]).astype(dtype) * 0.5
    oh, ow = geom.out_size(x_shape[2:])
    return x, w, b, (x_shape[0], w_shape[0], oh, ow), geom


# ---- the ops --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(GEOMS))
@pytest.mark.parametrize("slope", [0.0, 0.25])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_float64_reference(rng, name, slope, bias):
    x, w, b, y_shape, geom = _arrays(rng, name)
    b = b if bias else None
    y = np.full(y_shape, np.nan, np.float32)
    OPS.conv_relu_forward(x, w, b, y, geom, slope)
    pre = ref_conv(x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64),
                   geom.stride, geom.pad, geom.dilation, geom.group)
    np.testing.assert_allclose(y, leaky64(pre, slope), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slope", [0.0, 0.15])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_op_repeats_the_unfused_arithmetic_bit_for_bit(rng, slope, bias):
    """conv, then the ReLU in place (float32)."""
    x, w, b, y_shape, geom = _arrays(rng, "strided grouped")
    b = b if bias else None
    want = np.empty(y_shape, np.float32)
    OPS.conv_forward(x, w, b, want, geom)
    OPS.relu_forward(want, want, slope)
    got = np.empty(y_shape, np.float32)
    OPS.conv_relu_forward(x, w, b, got, geom, slope)
    np.testing.assert_array_equal(got, want)


def test_fused_layers_gradient_by_central_differences(rng):
    """The layers fused by hand as the pass does (leaky ReLU in place on the convolution's top): gradients of the
    input, the weights and the bias through the layers' own forward and backward."""
    x_shape = (2, 3, 5, 4)
    cv, (y_shape,) = make_layer("type: 'Convolution' convolution_param { num_output: 4 kernel_size: 3 pad: 1 "
                                "stride: 2 }", [x_shape], rng=rng)
    relu, _ = make_layer("type: 'ReLU' bottom: 't0' top: 't0' relu_param { negative_slope: 0.1 }", [y_shape],
                         rng=rng)
    cv, relu = ConvolutionReLU(cv, relu), Absorbed(relu, forward=True)
    assert cv.slope == np.float32(0.1) and relu.forward_elsewhere and not relu.backward_elsewhere
    # The ReLU keeps its backward (and its need of the top); the convolution's needs are the unfused ones.
    assert cv.backward_needs() == frozenset({NEEDS_BOTTOM}) and relu.backward_needs() == frozenset({NEEDS_TOP})
    x = rng.standard_normal(x_shape)
    weights = rng.standard_normal(y_shape)
    top = np.zeros(y_shape)

    def objective():
        cv.forward([x], [top])
        relu.forward([top], [top])  # a pass-through now
        return float((top * weights).sum())

    objective()
    dy, dx = weights.copy(), np.zeros(x_shape)
    relu.backward([top], [dy], [True], [top], [dy])
    cv.backward([top], [dy], [True], [x], [dx])
    np.testing.assert_allclose(dx, _numeric(objective, x, 1e-6), rtol=1e-4, atol=1e-6)
    for decl, what in zip(cv.params, ("weight", "bias")):
        analytic = decl.diff.copy()
        np.testing.assert_allclose(analytic, _numeric(objective, decl.data, 1e-6), rtol=1e-4, atol=1e-6,
                                   err_msg=what)


# ---- the graph pass -------------------------------------------------------------------------------------

def _head(blob):
    return (_layer("pool", "Pooling", [blob], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
            + _layer("ip", "InnerProduct", ["pool"], ["ip"],
                     "inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } }")
            + _layer("loss", "SoftmaxWithLoss", ["ip", "label"], ["loss"]))


def _conv_relu(slope=0.0, relu_top="c", between="", relu_extra="", kind="Convolution"):
    producer = _layer("c", kind, ["data"], ["c"], f"convolution_param {{ num_output: 3 kernel_size: 3 pad: 1 {W} }}")
    return (_input((2, 3, 4, 4), 2) + producer + between
            + _layer("r", "ReLU", ["c"], [relu_top], f"relu_param {{ negative_slope: {slope} }} {relu_extra}")
            + _head(relu_top))


def _fused_pairs(text, phase=pb.TRAIN):
    """{relu: convolution} for every ReLU the pass folded into a Convolution."""
    g = _graph(text, phase)
    return {m.layers[1]: m.layers[0] for m in g.fusions.matches if m.pattern == "Convolution+ReLU"}


def _relu_slope(graph, name):
    """The slope of the ReLU fused into layer `name`'s step; None: none is."""
    return getattr(graph.step_layer(graph.node(name)), "slope", None)


def test_pass_fuses_a_convolution_and_its_relu(monkeypatch):
    assert _fused_pairs(_conv_relu()) == {"r": "c"}
    assert _fused_pairs(_conv_relu(slope=0.25)) == {"r": "c"}
    assert _fused_pairs(_conv_relu(), pb.TEST) == {"r": "c"}  # forward only
    g = _graph(_conv_relu(slope=0.25))
    assert _relu_slope(g, "c") == 0.25 and isinstance(g.step_layer(g.node("c")), ConvolutionReLU)
    assert g.step_layer(g.node("c")).backward_needs() == {NEEDS_BOTTOM}
    # The planner sees the unfused needs: the ReLU's backward step reads the top, the convolution's does not.
    program = make_plan(g).program
    steps = {s.node.name: s.uses for s in program.steps[program.n_forward:]}
    assert "c" in steps["r"] and "c" not in steps["c"]
    monkeypatch.setenv("SUPERNEURONS_FUSE", "0")
    assert _fused_pairs(_conv_relu()) == {}
    assert _relu_slope(_graph(_conv_relu()), "c") is None


def test_pass_leaves_pairs_it_cannot_fuse():
    assert _fused_pairs(_conv_relu(relu_top="r")) == {}  # the ReLU not in place
    assert _fused_pairs(_conv_relu(slope=-0.5)) == {}  # its mask is not "output > 0"
    # The ReLU told not to propagate: it runs no backward while the convolution does.
    assert _fused_pairs(_conv_relu(relu_extra="propagate_down: false")) == {}
    # Another in-place layer first: the convolution's output is next touched by the Dropout.
    drop = _layer("drop", "Dropout", ["c"], ["c"], "dropout_param { dropout_ratio: 0.5 }")
    assert _fused_pairs(_conv_relu(between=drop)) == {}
    # The convolution's output read by another layer before the ReLU (the pass would hand it relu(conv)).
    peek = _layer("peek", "Pooling", ["c"], ["peek"], "pooling_param { pool: MAX kernel_size: 2 }")
    assert _fused_pairs(_conv_relu(between=peek, relu_top="r")) == {}
    # Deconvolution and InnerProduct keep their ReLUs.
    g = _graph(_conv_relu(kind="Deconvolution"))
    assert g.fusions.forward_owner("r") is None
    fc = (_input((2, 3, 4, 4), 2) + _layer("fc", "InnerProduct", ["data"], ["fc"],
                                           f"inner_product_param {{ num_output: 5 {W} }}")
          + _layer("r", "ReLU", ["fc"], ["fc"]) + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"]))
    assert _graph(fc).fusions.forward_owner("r") is None


# ---- nets: fused against unfused ------------------------------------------------------------------------

def _vgg_like(source=_input((4, 3, 6, 6), 4)):
    """Convolutions each followed by an in-place ReLU, in the variations the fusion must reproduce:
    - c1 on the data (no bottom gradient), slope 0, with bias;
    - c2 without bias, leaky (0.1), whose top fans out after the ReLU (a Split feeds c3 and a pooling);
    - c3 grouped, summing its bottom gradient into the split blob's (accumulate_dx with gradient aliasing);
    - c4 told not to propagate to its bottom (propagate_down: false): weight gradients only;
    - cf with frozen parameters on the data: no backward at all (need_backward false), fused forward only;
    - cn whose ReLU is not in place (not fused), beside the others."""
    frozen = "param { lr_mult: 0 } param { lr_mult: 0 }"
    no_bias = f"convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 bias_term: false {W} }}"
    return (source
            + conv("c1", "data", "c1", 4) + _layer("r1", "ReLU", ["c1"], ["c1"])
            + _layer("c2", "Convolution", ["c1"], ["c2"], no_bias)
            + _layer("r2", "ReLU", ["c2"], ["c2"], "relu_param { negative_slope: 0.1 }")
            + _layer("c3", "Convolution", ["c2"], ["c3"],
                     f"convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 group: 2 {W} }}")
            + _layer("r3", "ReLU", ["c3"], ["c3"])
            + _layer("p2", "Pooling", ["c2"], ["p2"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
            + _layer("c4", "Convolution", ["p2"], ["c4"],
                     f"propagate_down: false convolution_param {{ num_output: 4 kernel_size: 1 {W} }}")
            + _layer("r4", "ReLU", ["c4"], ["c4"], "relu_param { negative_slope: 0.1 }")
            + _layer("cf", "Convolution", ["data"], ["cf"],
                     f"{frozen} convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {W} }}")
            + _layer("rf", "ReLU", ["cf"], ["cf"])
            + conv("cn", "c2", "cn", 4) + _layer("rn", "ReLU", ["cn"], ["rn"])
            + _layer("sum", "Eltwise", ["c3", "c4", "cf", "rn"], ["sum"])
            + _head("sum"))


def test_net_fuses_every_eligible_pair():
    g = _graph(_vgg_like())
    assert _fused_pairs(_vgg_like()) == {"r1": "c1", "r2": "c2", "r3": "c3", "r4": "c4", "rf": "cf"}
    assert not g.node("cf").need_backward and g.node("c4").need_backward
    assert g.node("c4").propagate_down == [False]
    assert not any(g.fusions.backward_owner(n.name) for n in g.nodes)  # p2 reads r2's output through a Split


@pytest.mark.parametrize("alias", ["1", "0"])
def test_fused_net_trains_bit_identically_to_unfused_on_cpu(monkeypatch, alias):
    monkeypatch.setenv("SUPERNEURONS_DIFF_ALIAS", alias)
    fused, losses_f, params_f = _train(_vgg_like(), True, monkeypatch)
    plain, losses_p, params_p = _train(_vgg_like(), False, monkeypatch)
    assert _relu_slope(fused.graph, "c2") == np.float32(0.1) and _relu_slope(plain.graph, "c2") is None
    assert (0 in fused.layout.aliases.accumulate.get("c3", ())) == (alias == "1")
    assert losses_f == losses_p
    assert params_f.keys() == params_p.keys()
    for key in params_f:
        np.testing.assert_array_equal(params_f[key], params_p[key], err_msg=key)


def test_fused_net_test_phase_forward_matches_unfused(monkeypatch):
    assert_test_phase_forward_matches_unfused(_vgg_like(), monkeypatch)


@pytest.mark.parametrize("model", ["vgg_like", "relu_pools", "models/vgg16/vgg16_dummy.prototxt",
                                   "models/squeezenet/squeezenet_dummy.prototxt"])
def test_the_fusion_grows_no_modes_plan(monkeypatch, model):
    """Memory is what the runtime is for: no mode's peak or streamed peak exceeds the unfused net's (when the
    ReLU's gradient ran in the convolution's step, VGG16's offload and recompute peaks grew 1176 -> 1568 MiB).
    A max pooling that takes its ReLU's backward leaves the ReLU's output unread in backward: VGG16's liveness
    peak falls (2058 -> 1341 MiB at batch 64)."""
    from pathlib import Path

    from superneurons.graph.build import build_graph
    from superneurons.io.prototxt import read_net

    def plan():
        if model in ("vgg_like", "relu_pools"):
            return make_plan(_graph(_vgg_like() if model == "vgg_like" else _relu_pools()))
        return make_plan(build_graph(read_net(str(Path(__file__).resolve().parents[1] / model)), pb.TRAIN))

    fused = plan()
    monkeypatch.setenv("SUPERNEURONS_FUSE", "0")
    unfused = plan()
    assert set(fused.traces) == set(unfused.traces)
    for mode in fused.traces:
        assert fused.peak(mode)[0] <= unfused.peak(mode)[0], mode
        if mode != "baseline":
            assert fused.streamed_peak(mode) <= unfused.streamed_peak(mode), mode
    if "vgg16" in model:
        assert fused.peak("liveness")[0] < 0.7 * unfused.peak("liveness")[0]


def _relu_pools():
    """Convolution -> ReLU -> max pooling, VGG's pattern, where the pooling takes the ReLU's backward: a 2x2
    stride-2 pooling after a plain ReLU, an overlapping 3x3 stride-2 (ceil-mode) one after a leaky ReLU, and
    one the pass leaves alone (1x1: its argmax buffer is as large as the activation it would free)."""
    pool = "pooling_param {{ pool: MAX kernel_size: {} stride: {} }}"
    return (_input((4, 3, 8, 8), 4)
            + conv("c1", "data", "c1", 4) + _layer("r1", "ReLU", ["c1"], ["c1"])
            + _layer("p1", "Pooling", ["c1"], ["p1"], pool.format(2, 2))
            + conv("c2", "p1", "c2", 4) + _layer("r2", "ReLU", ["c2"], ["c2"], "relu_param { negative_slope: 0.1 }")
            + _layer("p2", "Pooling", ["c2"], ["p2"], pool.format(3, 2))
            + conv("c3", "p2", "c3", 4) + _layer("r3", "ReLU", ["c3"], ["c3"])
            + _layer("p3", "Pooling", ["c3"], ["p3"], pool.format(1, 1))
            + _head("p3"))


def test_max_pooling_takes_the_backward_of_the_relu_it_reads(monkeypatch):
    g = _graph(_relu_pools())
    assert {n.name: g.fusions.backward_owner(n.name) for n in g.nodes if g.fusions.backward_owner(n.name)} == {
        "r1": "p1", "r2": "p2"}
    assert _relu_slope(g, "p2") == np.float32(0.1) and _relu_slope(g, "p3") is None
    assert isinstance(g.step_layer(g.node("p2")), MaxPoolingReLU)
    assert g.step_layer(g.node("r1")).backward_needs() == frozenset() == g.step_layer(g.node("p1")).backward_needs()
    # A ReLU told not to propagate to its bottom leaves the convolution the pooling's unmasked gradient.
    told = _graph(_relu_pools().replace('name: "r1" type: "ReLU" bottom: "c1" top: "c1" ',
                                        'name: "r1" type: "ReLU" bottom: "c1" top: "c1" propagate_down: false', 1))
    assert told.node("r1").propagate_down == [False] and told.fusions.backward_owner("r1") is None
    # Nothing reads c1 in backward any more: liveness frees it after p1's forward.
    program = make_plan(g).program
    assert not any("c1" in st.uses for st in program.steps[program.n_forward:])
    assert_trains_like_unfused_in_every_mode(_relu_pools(), monkeypatch)


def test_every_memory_mode_trains_a_fused_net_like_baseline():
    """Recomputation replays the fused forward, which rebuilds relu(conv) for the convolution's backward."""
    assert _fused_pairs(_vgg_like())
    _check_modes(_vgg_like())


# ---- on the GPU ------------------------------------------------------------------------------------------

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")]


@GPU_ONLY[0]
@GPU_ONLY[1]
@pytest.mark.parametrize("x_shape,m,geom", [
    ((8, 64, 56, 56), 64, ConvGeometry((3, 3), (1, 1), (1, 1))),   # VGG16 conv2-3 stage: long planes (plain sweep)
    ((8, 3, 227, 227), 96, ConvGeometry((11, 11), (4, 4))),        # AlexNet conv1: 55x55 planes
    ((16, 128, 14, 14), 256, ConvGeometry((3, 3), (1, 1), (1, 1))),  # small planes of many channels (the walk)
    ((4, 32, 15, 15), 64, ConvGeometry((3, 3), (1, 1), (1, 1), (1, 1), 2)),  # grouped, odd plane
])
@pytest.mark.parametrize("slope", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_fused_op_against_unfused_and_cpu(gpu, rng, x_shape, m, geom, slope, bias):
    """Forward equal to the unfused convolution + ReLU on the GPU (the same cuDNN call, then one float32 add and
    the ReLU) and close to the CPU fused op."""
    from gpu_harness import close, dev

    cin = x_shape[1] // geom.group
    x = rng.standard_normal(x_shape).astype(np.float32)
    fan_in = cin * geom.kernel[0] * geom.kernel[1]
    w = (rng.standard_normal((m, cin) + geom.kernel) / np.sqrt(fan_in)).astype(np.float32)
    b = (rng.standard_normal(m) * 0.3).astype(np.float32) if bias else None
    y_shape = (x_shape[0], m) + geom.out_size(x_shape[2:])
    dx_x, dx_w, dx_b = dev(gpu, x), dev(gpu, w), None if b is None else dev(gpu, b)
    ops = gpu.ops
    y_plain, y_fused = dev(gpu, np.zeros(y_shape, np.float32)), dev(gpu, np.full(y_shape, np.nan, np.float32))
    ops.conv_forward(dx_x, dx_w, dx_b, y_plain, geom)
    ops.relu_forward(y_plain, y_plain, slope)
    ops.conv_relu_forward(dx_x, dx_w, dx_b, y_fused, geom, slope)
    y = gpu.to_host(y_fused)
    np.testing.assert_array_equal(y, gpu.to_host(y_plain))
    y_cpu = np.empty(y_shape, np.float32)
    OPS.conv_relu_forward(x, w, b, y_cpu, geom, slope)
    close(y, y_cpu, rtol=1e-4, atol_scale=1e-4)


GPU_NET_DATA = _layer("data", "DummyData", [], ["data", "label"],
                      "dummy_data_param { shape { dim: 16 dim: 3 dim: 32 dim: 32 } shape { dim: 16 } "
                      "data_filler { type: 'gaussian' std: 1 } data_filler { type: 'uniform' min: 0 max: 2.99 } }")


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_gpu_fused_net_against_unfused_and_cpu(gpu, monkeypatch):
    """One iteration of the VGG-like net (every variation the fusion must reproduce) on the GPU and the CPU,
    fused and unfused: each GPU net's gradients close to its CPU twin's, and the fused GPU net's to the unfused."""
    from gpu_harness import assert_param_grads_match, close, one_iteration_on_both

    text = 'name: "vgg_like"\n' + _vgg_like(GPU_NET_DATA)
    grads = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("SUPERNEURONS_FUSE", fuse)
        nets, losses = one_iteration_on_both(gpu, text)
        assert (_relu_slope(nets["cuda"].graph, "c2") is not None) == (fuse == "1")
        assert_param_grads_match(nets, losses, f"vgg_like fuse={fuse}")
        grads[fuse] = [gpu.to_host(d.diff) for d in nets["cuda"].learnable]
    for f, p in zip(grads["1"], grads["0"]):
        close(f, p, rtol=1e-4, atol_scale=1e-4)


# ---- partial runs (pycaffe's forward(start=, end=)) -------------------------------------------------------

CONV_RELU_NET = """name: "cr"
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 }
                            bias_filler { type: "constant" value: -0.2 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
"""


def test_a_partial_run_that_separates_a_fused_pair_is_refused_and_runs_unfused(tmp_path, rng, monkeypatch):
    """Caffe's forward(end='conv1') leaves conv1's blob before the in-place ReLU; fused, the ReLU is part of the
    convolution's step, so such a range is one clear error, and SUPERNEURONS_FUSE=0 gives Caffe's blob."""
    import superneurons as caffe
    from superneurons.errors import UserError

    model = tmp_path / "cr.prototxt"
    model.write_text(CONV_RELU_NET)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    net = caffe.Net(str(model), caffe.TEST)
    for call in (lambda: net.forward(data=x, end="conv1"), lambda: net.forward(start="relu1")):
        with pytest.raises(UserError, match=r"separates 'conv1' \(Convolution\) from 'relu1' \(ReLU\).*"
                                            r"SUPERNEURONS_FUSE=0"):
            call()
    whole = net.forward(data=x, end="relu1")["conv1"].copy()  # a range holding both runs
    assert (whole >= 0).all() and whole.any()

    monkeypatch.setenv("SUPERNEURONS_FUSE", "0")
    plain = caffe.Net(str(model), caffe.TEST)
    plain.params["conv1"][0].data[...] = net.params["conv1"][0].data
    plain.params["conv1"][1].data[...] = net.params["conv1"][1].data
    before_relu = plain.forward(data=x, end="conv1")["conv1"]
    assert (before_relu < 0).any()
    np.testing.assert_array_equal(np.maximum(before_relu, 0), whole)


CONV_RELU_LOSS_NET = """name: "crl"
force_backward: true
layer { name: "in" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 dim: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 }
                            bias_filler { type: "uniform" min: -0.3 max: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" relu_param { negative_slope: 0.2 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv1" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def test_a_backward_range_may_split_a_convolution_from_its_relu(tmp_path, rng, monkeypatch):
    """The fused ReLU keeps its own backward step, so backward(end='relu1') (down to the ReLU, the convolution
    left out) is allowed and gives Caffe's masked gradient in conv1's diff; forward ranges stay refused."""
    import superneurons as caffe
    from superneurons.errors import UserError

    model = tmp_path / "crl.prototxt"
    model.write_text(CONV_RELU_LOSS_NET)
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    t = rng.standard_normal((2, 3)).astype(np.float32)

    def masked_gradient(net):
        net.forward(data=x, target=t)
        net.backward(end="relu1")
        return net.blobs["conv1"].diff.copy(), net.blobs["conv1"].data.copy()

    fused = caffe.Net(str(model), caffe.TRAIN)
    with pytest.raises(UserError, match="separates 'conv1'"):
        fused.forward(data=x, target=t, end="conv1")
    monkeypatch.setenv("SUPERNEURONS_FUSE", "0")
    plain = caffe.Net(str(model), caffe.TRAIN)
    for name in ("conv1", "ip"):
        for k, blob in enumerate(fused.params[name]):
            plain.params[name][k].data[...] = blob.data
    got, want = masked_gradient(fused), masked_gradient(plain)
    np.testing.assert_array_equal(got[1], want[1])
    assert (got[1] < 0).any() and got[0].any()  # leaky negatives: the mask scales some gradients by 0.2
    np.testing.assert_array_equal(got[0], want[0])


def test_the_loss_read_during_backward_is_the_value_at_the_end_of_forward():
    """LossReader on an asynchronous backend (the CPU transfer with a lag stands in for the GPU's copy stream):
    the value is the blob's when the copy was queued, though the blob is overwritten right after (backward may
    reuse its memory), and equals the synchronous weighted sum."""
    from types import SimpleNamespace

    from superneurons.backend.cpu.transfer import CpuTransfer
    from superneurons.runtime.loss_read import LossReader, weighted_loss

    cpu = CpuBackend()
    backend = SimpleNamespace(asynchronous=True, make_transfer=lambda: CpuTransfer(lag=3), to_host=cpu.to_host)
    rng = np.random.default_rng()
    blobs = [(SimpleNamespace(array=rng.standard_normal(s).astype(np.float32)), None, w)
             for s, w in (((), 1.0), ((3,), 0.5))]
    want = weighted_loss(cpu, blobs)
    reader = LossReader(backend)
    value = reader.start(blobs)
    for data, _diff, _w in blobs:
        data.array[...] = np.nan  # what backward may write there once the copy has been waited for
    assert value() == pytest.approx(want, rel=1e-6) and np.isfinite(value())
    assert LossReader(cpu).start([(SimpleNamespace(array=np.float32(2.5)), None, 2.0)])() == 5.0


CONV_RELU_POOL_NET = """name: "crp"
force_backward: true
layer { name: "in" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 dim: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def test_a_backward_range_that_separates_a_pooling_from_the_relu_it_masks_for_is_refused(tmp_path, rng):
    """pool1 runs relu1's backward: backward(end='pool1') would leave conv1's gradient masked, where Caffe's
    is not yet; refused with a line naming both. Ranges holding both, and the whole pass, run."""
    import superneurons as caffe
    from superneurons.errors import UserError

    model = tmp_path / "crp.prototxt"
    model.write_text(CONV_RELU_POOL_NET)
    net = caffe.Net(str(model), caffe.TRAIN)
    net.forward(data=rng.standard_normal((2, 3, 6, 6)).astype(np.float32),
                target=rng.standard_normal((2, 3)).astype(np.float32))
    with pytest.raises(UserError, match=r"separates 'pool1' \(Pooling\) from 'relu1' \(ReLU\), whose backward runs "
                                        r"in 'pool1''s.*SUPERNEURONS_FUSE=0"):
        net.backward(end="pool1")
    net.backward(end="relu1")
    masked = net.blobs["conv1"].diff.copy()
    assert masked.any() and not masked[net.blobs["conv1"].data <= 0].any()
