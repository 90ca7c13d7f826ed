"""The Eltwise SUM + ReLU fusion (graph/fuse.py: fuse_eltwise_relu, backend op eltwise_sum_relu(_backward)).

The ops against an independent float64 NumPy reference and central differences; fused nets against the same nets
with SUPERNEURONS_FUSE=0 (bit for bit: the CPU fused op repeats the unfused arithmetic), in every memory mode and
with gradient aliasing on and off; and the pass's detection rules. The CUDA kernels are checked under the
simulator in test_cuda_zoo_ops_sim.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from harness import _numeric, make_layer
from test_fusion import _graph, _train
from test_memory_modes import _check_modes, _input, _layer, conv

from superneurons.backend.cpu import CpuBackend
from superneurons.layers.base import NEEDS_TOP
from superneurons.layers.fused import Absorbed
from superneurons.layers.fused.eltwise_sum_relu import EltwiseSumReLU
from superneurons.memory.plan import make_plan
from superneurons.proto import superneurons_pb2 as pb

OPS = CpuBackend().ops


def leaky64(v, slope):
    return np.where(v > 0, v, v * slope)


# ---- the ops against a float64 reference --------------------------------------------------------------

@pytest.mark.parametrize("n_bottoms", [2, 3])
@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_ops_match_float64_reference(rng, n_bottoms, slope):
    shape = (3, 4, 5, 2)
    bottoms = [rng.standard_normal(shape).astype(np.float32) for _ in range(n_bottoms)]
    coeffs = [1.0] + [float(c) for c in rng.uniform(-2, 2, n_bottoms - 1)]
    top = np.full(shape, np.nan, np.float32)
    OPS.eltwise_sum_relu(bottoms, coeffs, top, slope)
    pre = sum(c * b.astype(np.float64) for c, b in zip(coeffs, bottoms))
    np.testing.assert_allclose(top, leaky64(pre, slope), rtol=1e-6, atol=1e-6)

    dy = rng.standard_normal(shape).astype(np.float32)
    g = dy.astype(np.float64) * np.where(pre > 0, 1.0, slope)
    # Every bottom its own gradient; then the last one in place on dy (an aliased or in-place bottom).
    for shared in (False, True):
        d = dy.copy()
        outs = [np.full(shape, np.nan, np.float32) for _ in range(n_bottoms - shared)] + ([d] if shared else [])
        OPS.eltwise_sum_relu_backward(top, d, coeffs, outs, slope)
        for c, dx in zip(coeffs, outs):
            np.testing.assert_allclose(dx, c * g, rtol=1e-6, atol=1e-6)
        if not shared:
            np.testing.assert_array_equal(d, dy)  # an input only


def test_forward_in_place_on_bottom_0(rng):
    a, b = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
    want = np.empty_like(a)
    OPS.eltwise_sum_relu([a, b], [1.0, -0.5], want, 0.1)
    OPS.eltwise_sum_relu([a, b], [1.0, -0.5], a, 0.1)  # top is bottom 0
    np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize("slope", [0.0, 0.3])
def test_ops_gradient_by_central_differences(rng, slope):
    bottoms = [rng.standard_normal((2, 3, 4)) for _ in range(2)]
    coeffs = [1.0, -0.7]
    weights = rng.standard_normal(bottoms[0].shape)
    top = np.zeros_like(weights)

    def objective():
        OPS.eltwise_sum_relu(bottoms, coeffs, top, slope)
        return float((top * weights).sum())

    objective()
    outs = [np.zeros_like(weights) for _ in bottoms]
    OPS.eltwise_sum_relu_backward(top, weights.copy(), coeffs, outs, slope)
    for j, (dx, x) in enumerate(zip(outs, bottoms)):
        np.testing.assert_allclose(dx, _numeric(objective, x, 1e-6), rtol=1e-4, atol=1e-6, err_msg=f"bottom {j}")


def test_ops_repeat_the_unfused_arithmetic_bit_for_bit(rng):
    """sum then ReLU; the ReLU's gradient in place, then the Eltwise's scaled copies (float32, leaky)."""
    a, b = (rng.standard_normal(500).astype(np.float32) for _ in range(2))
    coeffs, slope = [0.3, -1.7], 0.15
    want = np.empty_like(a)
    OPS.eltwise_sum([a, b], coeffs, want)
    OPS.relu_forward(want, want, slope)
    got = np.empty_like(a)
    OPS.eltwise_sum_relu([a, b], coeffs, got, slope)
    np.testing.assert_array_equal(got, want)
    dy = rng.standard_normal(500).astype(np.float32)
    g = np.empty_like(dy)
    OPS.relu_backward(want, dy, g, slope)
    outs = [np.empty_like(dy) for _ in coeffs]
    OPS.eltwise_sum_relu_backward(got, dy, coeffs, outs, slope)
    for c, dx in zip(coeffs, outs):
        expect = np.empty_like(dy)
        OPS.scaled_copy(c, g, expect)
        np.testing.assert_array_equal(dx, expect)


def test_fused_layers_gradient_by_central_differences(rng):
    """The layers fused by hand as the pass does, the Eltwise in place on bottom 0: gradients of both bottoms."""
    shape = (2, 3, 2, 2)
    elt, _ = make_layer("type: 'Eltwise' bottom: 'a' bottom: 'b' top: 'a' eltwise_param { coeff: 1.5 coeff: -1 }",
                        [shape, shape], rng=rng)
    relu, _ = make_layer("type: 'ReLU' bottom: 'a' top: 'a' relu_param { negative_slope: 0.1 }", [shape], rng=rng)
    elt, relu = EltwiseSumReLU(elt, relu), Absorbed(relu, forward=True, backward=True)
    assert elt.backward_needs() == frozenset({NEEDS_TOP}) and relu.backward_needs() == frozenset()
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    weights = rng.standard_normal(shape)
    top = np.zeros(shape)

    def objective():
        np.copyto(top, a)  # in place: bottom 0 is the top
        for layer, bottoms in ((elt, [top, b]), (relu, [top])):
            layer.forward(bottoms, [top])
        return float((top * weights).sum())

    objective()
    dy, db = weights.copy(), np.zeros(shape)
    relu.backward([top], [dy], [True], [top], [dy])
    elt.backward([top], [dy], [True, True], [top, b], [dy, db])  # bottom 0's diff is the top diff
    np.testing.assert_allclose(dy, _numeric(objective, a, 1e-6), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(db, _numeric(objective, b, 1e-6), rtol=1e-4, atol=1e-6)


# ---- the graph pass -----------------------------------------------------------------------------------

def _base():
    return (_input((2, 3, 4, 4), 2) + conv("ca", "data", "a", 3) + conv("cb", "data", "b", 3))


def _head(blob):
    return (_layer("pool", "Pooling", [blob], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
            + _layer("ip", "InnerProduct", ["pool"], ["ip"],
                     "inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } }")
            + _layer("loss", "SoftmaxWithLoss", ["ip", "label"], ["loss"]))


def _join(op="SUM", relu_top="s", slope=0.0, between="", relu_extra="", top="s", bottoms=("a", "b")):
    return (_base() + _layer("sum", "Eltwise", list(bottoms), [top], f"eltwise_param {{ operation: {op} }}")
            + between + _layer("r", "ReLU", [top], [relu_top], f"relu_param {{ negative_slope: {slope} }} {relu_extra}")
            + _head(relu_top))


def _fused_pairs(text, phase=pb.TRAIN):
    g = _graph(text, phase)
    return {n.name: g.fusions.forward_owner(n.name) for n in g.nodes
            if g.fusions.forward_owner(n.name) is not None and n.layer.type_name == "ReLU"}


def _relu_slope(graph, name):
    """The slope of the ReLU fused into layer `name`'s step; None: none is."""
    return getattr(graph.step_layer(graph.node(name)), "slope", None)


def test_pass_fuses_the_residual_join(monkeypatch):
    assert _fused_pairs(_join()) == {"r": "sum"}
    assert _fused_pairs(_join(slope=0.25)) == {"r": "sum"}
    assert _fused_pairs(_join(top="a", relu_top="a")) == {"r": "sum"}  # an Eltwise in place on bottom 0
    assert _fused_pairs(_join(), pb.TEST) == {"r": "sum"}  # forward only
    g = _graph(_join())
    assert _relu_slope(g, "sum") == 0.0 and g.step_layer(g.node("sum")).backward_needs() == {NEEDS_TOP}
    # The planner sees the new need: the Eltwise's backward step reads its top, the ReLU's reads nothing.
    program = make_plan(g).program
    steps = {s.node.name: s.uses for s in program.steps[program.n_forward:]}
    assert "s" in steps["sum"] and "s" not in steps["r"]
    monkeypatch.setenv("SUPERNEURONS_FUSE", "0")
    assert _fused_pairs(_join()) == {}


def test_pass_leaves_joins_it_cannot_fuse():
    assert _fused_pairs(_join(op="PROD")) == {}
    assert _fused_pairs(_join(op="MAX")) == {}
    assert _fused_pairs(_join(relu_top="r")) == {}  # the ReLU not in place
    assert _fused_pairs(_join(slope=-0.5)) == {}  # its mask is not "output > 0"
    # The sum read by another layer before the ReLU (the pass would hand it relu(sum)). The ReLU cannot then
    # work in place on the sum (Caffe refuses that net: "produced by multiple sources").
    other = _layer("peek", "Pooling", ["s"], ["peek"], "pooling_param { pool: MAX kernel_size: 2 }")
    assert _fused_pairs(_join(between=other, relu_top="r")) == {}
    # The ReLU told not to propagate: it runs no backward while the Eltwise does.
    assert _fused_pairs(_join(relu_extra="propagate_down: false")) == {}


# ---- nets: fused against unfused ----------------------------------------------------------------------

def _residual():
    """Two residual joins: a plain one (conv + projection shortcut, ReLU in place on the sum) and one in place
    on its bottom 0 with coefficients and a leaky ReLU; a Split feeds the second join and a convolution."""
    return (_input((4, 3, 6, 6), 4)
            + conv("c1", "data", "c1", 4) + _layer("r1", "ReLU", ["c1"], ["c1"])
            + conv("c2", "c1", "c2", 4) + conv("cs", "data", "cs", 4, k=1, pad=0)
            + _layer("sum", "Eltwise", ["c2", "cs"], ["sum"]) + _layer("rs", "ReLU", ["sum"], ["sum"])
            + conv("c3", "sum", "c3", 4)
            + _layer("sum2", "Eltwise", ["c3", "sum"], ["c3"], "eltwise_param { coeff: 1.5 coeff: -0.5 }")
            + _layer("rs2", "ReLU", ["c3"], ["c3"], "relu_param { negative_slope: 0.1 }")
            + _head("c3"))


def test_residual_net_fuses_both_joins():
    # (r1, in place on a convolution's top, is the Convolution's: test_conv_relu_fusion.py)
    assert _fused_pairs(_residual()) == {"rs": "sum", "rs2": "sum2", "r1": "c1"}


@pytest.mark.parametrize("alias", ["1", "0"])
def test_fused_net_trains_bit_identically_to_unfused_on_cpu(monkeypatch, alias):
    monkeypatch.setenv("SUPERNEURONS_DIFF_ALIAS", alias)
    fused, losses_f, params_f = _train(_residual(), True, monkeypatch)
    plain, losses_p, params_p = _train(_residual(), False, monkeypatch)
    assert _relu_slope(fused.graph, "sum") == 0.0 and _relu_slope(plain.graph, "sum") is None
    assert ("sum" in fused.layout.aliases.index) == (alias == "1")
    assert losses_f == losses_p
    assert params_f.keys() == params_p.keys()
    for key in params_f:
        np.testing.assert_array_equal(params_f[key], params_p[key], err_msg=key)


def test_every_memory_mode_trains_a_fused_net_like_baseline():
    assert _fused_pairs(_residual())
    _check_modes(_residual())
