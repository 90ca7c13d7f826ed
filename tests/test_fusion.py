"""The BatchNorm + Scale (+ ReLU) fusion (graph/fuse.py, backend op bn_affine_*) on the CPU backend.

The fused op is checked against an independent float64 NumPy reference and central differences; fused nets
against the same nets with SUPERNEURONS_FUSE=0 (the CPU fused op is bit-identical by construction); every
memory mode against baseline on a fused net; and the pass's detection rules.
"""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from harness import _numeric, make_layer
from test_memory_modes import _check_modes, _input, _layer, conv

from superneurons.backend.cpu import CpuBackend
from superneurons.graph.build import build_graph
from superneurons.layers.base import NEEDS_BOTTOM
from superneurons.layers.fused import Absorbed
from superneurons.layers.fused.batch_norm_scale_relu import BatchNormScaleReLU
from superneurons.memory.tensors import declare_tensors
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

OPS = CpuBackend().ops
EPS = 1e-5


# ---- the op against a float64 reference ---------------------------------------------------------

def reference(x, gamma, beta, relu, stats=None, eps=EPS):
    """y, x_hat, mean, biased var of relu(gamma * BN(x) + beta) over (N, C, ...) in float64."""
    axes = (0,) + tuple(range(2, x.ndim))
    per_c = (1, -1) + (1,) * (x.ndim - 2)
    mean, var = stats if stats is not None else (x.mean(axis=axes), x.var(axis=axes))
    x_hat = (x - mean.reshape(per_c)) / np.sqrt(var.reshape(per_c) + eps)
    pre = gamma.reshape(per_c) * x_hat + beta.reshape(per_c)
    return (np.maximum(pre, 0) if relu else pre), x_hat, mean, var


def reference_backward(x_hat, gamma, beta, dy, relu, inv_std, batch):
    axes = (0,) + tuple(range(2, x_hat.ndim))
    per_c = (1, -1) + (1,) * (x_hat.ndim - 2)
    pre = gamma.reshape(per_c) * x_hat + beta.reshape(per_c)
    g = dy * (pre > 0) if relu else dy
    dbeta, dgamma = g.sum(axis=axes), (g * x_hat).sum(axis=axes)
    d_xhat = g * gamma.reshape(per_c)
    if batch:
        d_xhat = d_xhat - d_xhat.mean(axis=axes, keepdims=True) - x_hat * (d_xhat * x_hat).mean(axis=axes,
                                                                                                 keepdims=True)
    return d_xhat * inv_std.reshape(per_c), dgamma, dbeta


class Fused:
    """Arrays for one call of the fused op on (N, C, H, W) float32/64 input."""

    def __init__(self, rng, shape, dtype, relu, global_stats=False, keep=True):
        self.shape, self.dtype, self.relu = shape, dtype, relu
        c = shape[1]
        self.dims = (shape[0], c, int(np.prod(shape[2:])))
        self.x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
        self.gamma = rng.standard_normal(c).astype(dtype)
        self.beta = rng.standard_normal(c).astype(dtype)
        self.mean_sum = rng.uniform(0, 1, c).astype(dtype)
        self.var_sum = rng.uniform(1, 2, c).astype(dtype)
        self.scale_factor = np.array([1.5], dtype)
        self.global_stats = global_stats
        self.x_hat = np.zeros(shape, dtype) if keep else None
        self.mean, self.var, self.inv_std = (np.zeros(c, dtype) for _ in range(3))

    def forward(self, y=None, update=True, maf=0.9, correction=1.0):
        y = np.zeros(self.shape, self.dtype) if y is None else y
        OPS.bn_affine_forward(self.x, y, self.x_hat, self.mean, self.var, self.inv_std, self.gamma, self.beta,
                              self.mean_sum, self.var_sum, self.scale_factor, *self.dims, EPS, self.global_stats,
                              update, maf, correction, 0.0 if self.relu else None)
        return y

    def backward(self, dy, dx=None):
        dx = np.zeros(self.shape, self.dtype) if dx is None else dx
        dgamma, dbeta = np.full(self.shape[1], 0.25, self.dtype), np.full(self.shape[1], -0.5, self.dtype)
        # x_hat where forward kept it, else x (which forward then must not have overwritten) and the mean
        kept, mean = (self.x_hat, None) if self.x_hat is not None else (self.x, self.mean)
        OPS.bn_affine_backward(kept, mean, self.inv_std, self.gamma, self.beta, dy, dx, dgamma, dbeta, *self.dims,
                               self.global_stats, 0.0 if self.relu else None)
        return dx, dgamma - self.dtype(0.25), dbeta + self.dtype(0.5)  # diffs accumulate: remove the start values


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("global_stats", [False, True])
def test_fused_op_matches_float64_reference(rng, relu, global_stats):
    f = Fused(rng, (4, 3, 5, 6), np.float32, relu, global_stats)
    sums = (f.mean_sum.astype(np.float64), f.var_sum.astype(np.float64))
    y = f.forward()
    x64 = f.x.astype(np.float64)
    stats = (sums[0] / 1.5, sums[1] / 1.5) if global_stats else None
    want, x_hat, mean, var = reference(x64, f.gamma.astype(np.float64), f.beta.astype(np.float64), relu, stats)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f.x_hat, x_hat, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f.inv_std, 1 / np.sqrt(var + EPS), rtol=1e-5)
    if global_stats:  # the running sums are read, never written
        np.testing.assert_array_equal(f.mean_sum, sums[0].astype(np.float32))
    else:
        np.testing.assert_allclose(f.mean_sum, 0.9 * sums[0] + mean, rtol=1e-5)
        np.testing.assert_allclose(f.var_sum, 0.9 * sums[1] + var, rtol=1e-5)
        assert f.scale_factor[0] == np.float32(0.9 * 1.5 + 1)
    dy = rng.standard_normal(f.shape).astype(np.float32)
    dx, dgamma, dbeta = f.backward(dy)
    want_dx, want_dg, want_db = reference_backward(x_hat, f.gamma.astype(np.float64), f.beta.astype(np.float64),
                                                   dy.astype(np.float64), relu, 1 / np.sqrt(var + EPS),
                                                   not global_stats)
    scale = np.abs(want_dx).max()
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(dgamma, want_dg, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dbeta, want_db, rtol=1e-4, atol=1e-4)


def test_fused_op_in_place_and_without_saved_x_hat(rng):
    f = Fused(rng, (3, 4, 2, 5), np.float32, relu=True)
    y_sep = f.forward(update=False)
    x = f.x.copy()
    y_in_place = f.forward(y=f.x, update=False)  # y is x
    np.testing.assert_array_equal(y_in_place, y_sep)
    f.x = x
    dy = rng.standard_normal(f.shape).astype(np.float32)
    dx_sep = f.backward(dy.copy())
    dy_in_place = dy.copy()
    dx_in_place = f.backward(dy_in_place, dx=dy_in_place)  # dx is dy
    for a, b in zip(dx_in_place, dx_sep):
        np.testing.assert_array_equal(a, b)
    g = Fused(rng, (3, 4, 2, 5), np.float32, relu=True, keep=False)  # TEST phase: no x_hat kept
    g.x, g.gamma, g.beta = f.x, f.gamma, f.beta
    np.testing.assert_array_equal(g.forward(update=False), y_sep)


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("global_stats", [False, True])
def test_fused_op_gradient_by_central_differences(rng, relu, global_stats):
    f = Fused(rng, (3, 2, 3, 4), np.float64, relu, global_stats)
    weights = rng.standard_normal(f.shape)

    def objective():
        return float((f.forward(update=False) * weights).sum())

    objective()
    dx, dgamma, dbeta = f.backward(weights.copy())
    for analytic, wrt, what in ((dx, f.x, "x"), (dgamma, f.gamma, "gamma"), (dbeta, f.beta, "beta")):
        np.testing.assert_allclose(analytic, _numeric(objective, wrt, 1e-6), rtol=1e-4, atol=1e-6,
                                   err_msg=f"gradient of {what}")


def test_fused_layer_gradient_by_central_differences(rng):
    """The layers themselves, fused by hand as the graph pass does: gradients of x, gamma and beta."""
    shape = (4, 3, 2, 3)
    bn, _ = make_layer("type: 'BatchNorm' bottom: 'a' top: 'a'", [shape], rng=rng)
    scale, _ = make_layer("type: 'Scale' bottom: 'a' top: 'a' scale_param { bias_term: true }", [shape], rng=rng)
    relu, _ = make_layer("type: 'ReLU' bottom: 'a' top: 'a'", [shape], rng=rng)
    bn = BatchNormScaleReLU(bn, scale, relu, keep_for_backward=True, in_place=True)
    scale, relu = (Absorbed(layer, forward=True, backward=True) for layer in (scale, relu))
    assert bn.backward_needs() == frozenset() and scale.backward_needs() == frozenset() == relu.backward_needs()
    assert set(bn.buffers) == {"mean", "var", "inv_std", "x_hat"} and not scale.buffers
    assert bn.buffers["x_hat"].for_backward and bn.buffers["inv_std"].for_backward
    assert not bn.buffers["mean"].for_backward
    for buf in bn.buffers.values():
        buf.array = np.zeros(buf.shape)
    x = rng.standard_normal(shape) + 0.2
    weights = rng.standard_normal(shape)

    def objective():
        top = x.copy()  # in place
        for layer in (bn, scale, relu):
            layer.forward([top], [top])
        return float((top * weights).sum())

    objective()
    dy = weights.copy()
    for layer in (relu, scale, bn):  # in place: one diff array
        layer.backward([None], [dy], [True], [None], [dy])
    np.testing.assert_allclose(dy, _numeric(objective, x, 1e-6), rtol=1e-4, atol=1e-6)
    for decl in scale.params:
        analytic = decl.diff.copy()
        np.testing.assert_allclose(analytic, _numeric(objective, decl.data, 1e-6), rtol=1e-4, atol=1e-6)


# ---- the graph pass -------------------------------------------------------------------------

def _bn_chain(prefix, bottom, relu=True, bias=True, slope=0.0, scale_top=None):
    top = scale_top or bottom
    text = (_layer(f"bn_{prefix}", "BatchNorm", [bottom], [bottom],
                   "batch_norm_param { moving_average_fraction: 0.8 }")
            + _layer(f"sc_{prefix}", "Scale", [bottom], [top],
                     f"scale_param {{ bias_term: {str(bias).lower()} filler {{ type: 'gaussian' std: 1 }} "
                     f"bias_filler {{ type: 'gaussian' std: 0.5 }} }}"))
    if relu:
        text += _layer(f"relu_{prefix}", "ReLU", [top], [top], f"relu_param {{ negative_slope: {slope} }}")
    return text


def _resnet_block():
    """conv -> BN -> Scale -> ReLU, twice, plus a shortcut BN -> Scale into an Eltwise; a softmax loss."""
    return (_input((4, 3, 6, 6), 4)
            + conv("c1", "data", "c1", 4) + _bn_chain("1", "c1")
            + conv("c2", "c1", "c2", 4) + _bn_chain("2", "c2", relu=False)
            + conv("cs", "data", "cs", 4, k=1, pad=0) + _bn_chain("s", "cs", relu=False)
            + _layer("sum", "Eltwise", ["c2", "cs"], ["sum"]) + _layer("rs", "ReLU", ["sum"], ["sum"])
            + _layer("pool", "Pooling", ["sum"], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
            + _layer("ip", "InnerProduct", ["pool"], ["ip"],
                     "inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } }")
            + _layer("loss", "SoftmaxWithLoss", ["ip", "label"], ["loss"]))


def _graph(text, phase=pb.TRAIN):
    return build_graph(text_format.Parse('name: "t"\n' + text, pb.NetParameter()), phase)


def _fused(graph):
    return {n.name: (graph.step_layer(n).scale.name, graph.step_layer(n).relu_slope) for n in graph.nodes
            if isinstance(graph.step_layer(n), BatchNormScaleReLU)}


def test_pass_fuses_the_resnet_chains_and_nothing_else(monkeypatch):
    g = _graph(_resnet_block())
    assert _fused(g) == {"bn_1": ("sc_1", 0.0), "bn_2": ("sc_2", None), "bn_s": ("sc_s", None)}
    assert g.fusions.forward_owner("relu_1") == g.fusions.backward_owner("relu_1") == "bn_1"
    assert g.fusions.forward_owner("rs") == "sum"  # the Eltwise's (test_eltwise_relu_fusion.py)
    monkeypatch.setenv("SUPERNEURONS_FUSE", "0")
    assert _fused(_graph(_resnet_block())) == {}


def test_pass_leaves_chains_it_cannot_fuse():
    base = _input((2, 3, 4, 4), 2) + conv("c", "data", "c", 3)
    # Scale without bias; Scale not in place; leaky ReLU with a negative slope (its mask is not y > 0).
    assert _fused(_graph(base + _bn_chain("a", "c", bias=False))) == {}
    assert _fused(_graph(base + _bn_chain("a", "c", scale_top="s"))) == {}
    assert _fused(_graph(base + _bn_chain("a", "c", slope=-0.5))) == {"bn_a": ("sc_a", None)}
    assert _fused(_graph(base + _bn_chain("a", "c", slope=0.25))) == {"bn_a": ("sc_a", 0.25)}
    # The BatchNorm's output read by another layer too (a Split goes in between): no fusion. The Scale
    # cannot then work in place on it (Caffe refuses that net: "produced by multiple sources").
    two_readers = (base + _layer("bn", "BatchNorm", ["c"], ["n"]) + _layer("other", "ReLU", ["n"], ["o"])
                   + _layer("sc", "Scale", ["n"], ["s"], "scale_param { bias_term: true }"))
    assert _fused(_graph(two_readers)) == {}
    # Read after the Scale (its output, not the BatchNorm's): fused, the reader sees the fused result.
    after = (base + _layer("bn", "BatchNorm", ["c"], ["n"])
             + _layer("sc", "Scale", ["n"], ["n"], "scale_param { bias_term: true }")
             + _layer("other", "ReLU", ["n"], ["o"]))
    assert _fused(_graph(after)) == {"bn": ("sc", None)}


def test_pass_takes_the_batch_norm_out_of_place_on_its_producers_top():
    """A fused BatchNorm in place on a convolution's top reads a blob of its own and keeps it (not x_hat), and
    its gradient shares memory with the top's; TEST nets and BatchNorms on a net input stay in place."""
    g = _graph(_resnet_block())
    assert g.internal_blobs == {"c1/bn_input": "c1", "c2/bn_input": "c2", "cs/bn_input": "cs"}
    assert g.node("c1").tops == ["c1/bn_input"] and g.node("c2").bottoms == ["c1"]
    assert (g.node("bn_1").bottoms, g.node("bn_1").tops) == (["c1/bn_input"], ["c1"])
    assert g.blob_shapes["c1/bn_input"] == g.blob_shapes["c1"]
    layer = g.step_layer(g.node("bn_1"))
    assert layer.keeps_input and not layer.in_place and "x_hat" not in layer.buffers
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
    assert layer.buffers["mean"].for_backward and layer.buffers["inv_std"].for_backward
    layout = declare_tensors(g, train=True)
    assert {t: layout.aliases.views.get(t) for t in ("c1", "c2", "cs")} == {
        "c1": "c1/bn_input", "c2": "c2/bn_input", "cs": "cs/bn_input"}

    test = _graph(_resnet_block(), pb.TEST)
    assert test.internal_blobs == {} and test.node("bn_1").bottoms == ["c1"]
    on_input = _graph("force_backward: true\n" + _input((2, 3, 4, 4), 2) + _bn_chain("a", "data")
                      + conv("c", "data", "c", 3, k=4, pad=0)
                      + _layer("loss", "SoftmaxWithLoss", ["c", "label"], ["loss"]))
    assert on_input.node("bn_a").need_backward
    assert on_input.internal_blobs == {} and on_input.node("bn_a").bottoms == ["data"]
    fused = on_input.step_layer(on_input.node("bn_a"))
    assert "x_hat" in fused.buffers and not fused.keeps_input


def test_fused_op_backward_from_x_is_bit_identical_to_from_x_hat(rng):
    for relu, global_stats in ((True, False), (False, True)):
        f = Fused(rng, (3, 4, 2, 5), np.float32, relu, global_stats)
        f.forward(update=False)
        dy = rng.standard_normal(f.shape).astype(np.float32)
        from_x_hat = f.backward(dy)
        f.x_hat = None  # backward now reads x and the mean
        for a, b in zip(f.backward(dy), from_x_hat):
            np.testing.assert_array_equal(a, b)


def test_test_phase_is_fused_without_saved_x_hat():
    g = _graph(_resnet_block(), pb.TEST)
    layer = g.step_layer(g.node("bn_1"))
    assert isinstance(layer, BatchNormScaleReLU) and layer.bn.use_global_stats and "x_hat" not in layer.buffers
    assert not any(b.for_backward for b in layer.buffers.values())


# ---- nets: fused against unfused -------------------------------------------------------------

def _train(text, fuse, monkeypatch, iters=3, memory="baseline"):
    monkeypatch.setenv("SUPERNEURONS_FUSE", "1" if fuse else "0")
    net = Net(_graph(text), CpuBackend(), train=True, seed=5, memory=memory)
    rng = np.random.default_rng(11)
    losses = []
    for it in range(iters):
        net.ctx.iteration = it
        net.data["data"].array[...] = rng.standard_normal(net.data["data"].shape).astype(np.float32) + 0.3
        net.data["label"].array[...] = rng.integers(0, 3, net.data["label"].shape).astype(np.float32)
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        for decl in net.learnable:
            decl.data -= np.float32(0.05) * decl.diff
    params = {t.key: t.array.copy() for t in net.tensors if t.kind == "param"}
    return net, losses, params


def test_fused_net_trains_bit_identically_to_unfused_on_cpu(monkeypatch):
    fused, losses_f, params_f = _train(_resnet_block(), True, monkeypatch)
    plain, losses_p, params_p = _train(_resnet_block(), False, monkeypatch)
    assert _fused(fused.graph) and not _fused(plain.graph)
    assert losses_f == losses_p
    assert params_f.keys() == params_p.keys()
    for key in params_f:  # weights, Scale params and BatchNorm running statistics alike
        np.testing.assert_array_equal(params_f[key], params_p[key], err_msg=key)
    # Fusion drops the in-place copies (BatchNorm's and Scale's saved inputs): the BatchNorm keeps the
    # convolution's own output, now a blob of its own.
    assert fused.baseline_bytes() < plain.baseline_bytes()


def _dense_block():
    """DenseNet's pattern: a BatchNorm out of place on a Concat's top, which the next Concat reads too (a Split
    in between); fused, the BatchNorm keeps that top rather than an x_hat of its own."""
    return (_input((4, 3, 6, 6), 4)
            + conv("c0", "data", "x0", 4)
            + _layer("bn_a", "BatchNorm", ["x0"], ["a"], "batch_norm_param { moving_average_fraction: 0.8 }")
            + _layer("sc_a", "Scale", ["a"], ["a"], "scale_param { bias_term: true filler { type: 'gaussian' std: 1 } "
                     "bias_filler { type: 'gaussian' std: 0.5 } }")
            + _layer("relu_a", "ReLU", ["a"], ["a"])
            + conv("c1", "a", "b1", 4) + _layer("cat1", "Concat", ["x0", "b1"], ["x1"])
            + _layer("bn_b", "BatchNorm", ["x1"], ["b"], "batch_norm_param { moving_average_fraction: 0.8 }")
            + _layer("sc_b", "Scale", ["b"], ["b"], "scale_param { bias_term: true filler { type: 'gaussian' std: 1 } "
                     "bias_filler { type: 'gaussian' std: 0.5 } }")
            + _layer("relu_b", "ReLU", ["b"], ["b"])
            + conv("c2", "b", "b2", 4) + _layer("cat2", "Concat", ["x1", "b2"], ["x2"])
            + _layer("pool", "Pooling", ["x2"], ["pool"], "pooling_param { pool: AVE global_pooling: true }")
            + _layer("ip", "InnerProduct", ["pool"], ["ip"],
                     "inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } }")
            + _layer("loss", "SoftmaxWithLoss", ["ip", "label"], ["loss"]))


def test_out_of_place_fused_batch_norm_keeps_its_input_and_trains_like_unfused(monkeypatch):
    g = _graph(_dense_block())
    assert set(_fused(g)) == {"bn_a", "bn_b"} and g.internal_blobs == {}
    for name in ("bn_a", "bn_b"):
        layer = g.step_layer(g.node(name))
        assert layer.keeps_input and "x_hat" not in layer.buffers and layer.backward_needs() == {NEEDS_BOTTOM}
    assert_trains_like_unfused_in_every_mode(_dense_block(), monkeypatch)


def assert_trains_like_unfused_in_every_mode(text, monkeypatch):
    """The fused net of `text` trains bit-identically to the unfused one on the CPU (losses, weights, running
    statistics), and fused, every memory mode trains like baseline."""
    fused, losses_f, params_f = _train(text, True, monkeypatch)
    plain, losses_p, params_p = _train(text, False, monkeypatch)
    assert losses_f == losses_p and params_f.keys() == params_p.keys()
    for key in params_f:
        np.testing.assert_array_equal(params_f[key], params_p[key], err_msg=key)
    monkeypatch.setenv("SUPERNEURONS_FUSE", "1")
    _check_modes(text)


def assert_test_phase_forward_matches_unfused(text, monkeypatch, prepare=lambda net: None):
    """The TEST net of `text` fused and with SUPERNEURONS_FUSE=0, `prepare`d, on one input: the same loss and the
    same `ip` blob, bit for bit."""
    outs = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("SUPERNEURONS_FUSE", fuse)
        net = Net(_graph(text, pb.TEST), CpuBackend(), train=False, seed=5)
        prepare(net)
        net.data["data"].array[...] = np.random.default_rng(3).standard_normal(net.data["data"].shape)
        net.data["label"].array[...] = 1
        outs.append((net.forward(), net.blob("ip")))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


def test_fused_net_test_phase_forward_matches_unfused(monkeypatch):
    def running_statistics(net):  # non-trivial ones
        for name in ("bn_1", "bn_2", "bn_s"):
            mean_sum, var_sum, factor = net.layer(name).params
            mean_sum.data[...] = np.linspace(-1, 1, mean_sum.data.size)
            var_sum.data[...] = np.linspace(0.5, 2, var_sum.data.size)
            factor.data[...] = 2.0

    assert_test_phase_forward_matches_unfused(_resnet_block(), monkeypatch, running_statistics)


def test_every_memory_mode_trains_a_fused_net_like_baseline():
    assert _fused(_graph(_resnet_block()))
    _check_modes(_resnet_block())


def test_solver_run_fused_matches_unfused(monkeypatch):
    from test_solver import make_solver

    net = """
name: "bn_tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 }
    shape { dim: 8 dim: 3 dim: 5 dim: 5 } shape { dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "msra" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
    results = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("SUPERNEURONS_FUSE", fuse)
        solver = make_solver('base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" max_iter: 4 display: 0', net=net)
        losses = []
        solver.callbacks.append(lambda s, it, loss: losses.append(float(loss)))
        solver.step(4)
        graph = solver.net.graph
        assert isinstance(graph.step_layer(graph.node("bn")), BatchNormScaleReLU) == (fuse == "1")
        results.append((losses, [p.copy() for layer in ("conv", "bn", "sc", "ip")
                                 for p in (d.data for d in solver.net.layer(layer).params)]))
    (losses_f, params_f), (losses_p, params_p) = results
    np.testing.assert_allclose(losses_f, losses_p, rtol=1e-6)
    for a, b in zip(params_f, params_p):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_recomputed_fused_forward_leaves_running_stats_unchanged(monkeypatch):
    net, _, _ = _train(_resnet_block(), True, monkeypatch, iters=1)
    stats = [p.data.copy() for p in net.layer("bn_1").params]
    net.ctx.recomputing = True
    net.forward()
    net.ctx.recomputing = False
    for before, p in zip(stats, net.layer("bn_1").params):
        np.testing.assert_array_equal(p.data, before)
    net.forward()
    assert net.layer("bn_1").params[2].data[0] != stats[2][0]



BN_TRAIN_NET = """name: "bnt"
force_backward: true
layer { name: "in" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } shape { dim: 2 dim: 3 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip" type: "InnerProduct" bottom: "conv1" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "target" top: "loss" }
"""


def test_pycaffe_shows_the_prototxts_blobs_and_refuses_a_range_inside_the_split(tmp_path, rng):
    """The blob split off for the BatchNorm (conv1/bn_input) stays out of pycaffe's view: blobs and top names
    are the prototxt's, conv1 holds the chain's result, and a range that would stop between the convolution
    and the BatchNorm (where Caffe's conv1 holds the convolution's output) is refused."""
    import superneurons as caffe
    from superneurons.errors import UserError

    model = tmp_path / "bnt.prototxt"
    model.write_text(BN_TRAIN_NET)
    assert build_graph(text_format.Parse(BN_TRAIN_NET, pb.NetParameter())).internal_blobs == {
        "conv1/bn_input": "conv1"}
    net = caffe.Net(str(model), caffe.TRAIN)
    assert list(net.blobs) == ["data", "target", "conv1", "ip", "loss"]
    assert net.top_names["conv1"] == ["conv1"] and net.bottom_names["bn1"] == ["conv1"]
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    t = rng.standard_normal((2, 3)).astype(np.float32)
    for call in (lambda: net.forward(data=x, target=t, end="conv1"), lambda: net.forward(start="bn1")):
        with pytest.raises(UserError, match=r"separates 'conv1' \(Convolution\) from 'bn1' \(BatchNorm\).*"
                                            r"SUPERNEURONS_FUSE=0"):
            call()
    after = net.forward(data=x, target=t, end="relu1")["conv1"]
    assert (after >= 0).all() and after.any()
    net.forward(data=x, target=t)
    net.backward()
    assert net.blobs["conv1"].diff.any()  # the gradient at the convolution's output (shared memory)


def test_fusion_leaves_the_prototxt_layers_as_they_were(monkeypatch):
    """The passes record their decisions in the graph's table (`Graph.fusions`) and give the steps fused layers
    to run; the prototxt's layers (what pycaffe, caffemodels and the solver see) keep exactly the state they
    have in the unfused graph: no layer learns of its neighbours."""
    pool = "pooling_param { pool: MAX kernel_size: 2 stride: 2 }"
    vgg = (_input((2, 3, 6, 6), 2) + conv("c1", "data", "c1", 4) + _layer("r1", "ReLU", ["c1"], ["c1"])
           + _layer("p1", "Pooling", ["c1"], ["p1"], pool)
           + _layer("ip", "InnerProduct", ["p1"], ["ip"], "inner_product_param { num_output: 3 }")
           + _layer("loss", "SoftmaxWithLoss", ["ip", "label"], ["loss"]))

    def state(text, fuse):
        monkeypatch.setenv("SUPERNEURONS_FUSE", fuse)
        graph = _graph(text)
        graph.use_concat_slices(True)
        return graph, {n.name: dict(vars(n.layer)) for n in graph.nodes}

    for text in (_resnet_block(), vgg):
        fused, fused_state = state(text, "1")
        plain, plain_state = state(text, "0")
        assert fused.fusions.matches and not plain.fusions.matches
        assert fused_state == plain_state
        assert any(fused.step_layer(n) is not n.layer for n in fused.nodes)
