"""Issue 5's layers on the CPU backend: shape ops, reductions, extra neurons, Bias, extra losses, MVN, Embed,
Deconvolution and the unsupported Python layer.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from google.protobuf import text_format
from harness import check_gradients, forward, make_layer

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.binaryproto import array_to_blob
from superneurons.io.prototxt import write_binary
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

A07 = float(np.float32(0.7))  # prototxt float fields are float32


def _net(text, seed=5):
    return Net(build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN), CpuBackend(), seed=seed)


def _tops(n):
    return " ".join(f"top: 't{i}'" for i in range(n))


# ---- Slice ------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,n_top,axis,cuts", [
    ("slice_param { axis: 1 slice_point: 1 slice_point: 3 }", 3, 1, [1, 3]),
    ("slice_param { axis: -1 }", 2, 2, [2]),
    ("slice_param { slice_dim: 0 slice_point: 2 }", 2, 0, [2]),
])
def test_slice_reference_and_gradient(extra, n_top, axis, cuts):
    rng = np.random.default_rng(100)
    x = rng.standard_normal((3, 5, 4))
    proto = f"type: 'Slice' {extra} {_tops(n_top)}"
    layer, shapes = make_layer(proto, [x.shape])
    assert layer.backward_needs() == frozenset()
    tops = forward(layer, [x.copy()], shapes)
    refs = np.split(x, cuts, axis=axis)
    assert len(tops) == len(refs)
    for t, r in zip(tops, refs):
        np.testing.assert_array_equal(t, r)
    check_gradients(proto, [x])


def test_slice_rejects_bad_points():
    with pytest.raises(UserError, match=r"under_test.*1 slice_point value\(s\) for 3 tops \(need 2\)"):
        make_layer(f"type: 'Slice' slice_param {{ slice_point: 2 }} {_tops(3)}", [(2, 5)])
    with pytest.raises(UserError, match=r"slice points \[3, 2\] must increase"):
        make_layer(f"type: 'Slice' slice_param {{ slice_point: 3 slice_point: 2 }} {_tops(3)}", [(2, 5)])
    with pytest.raises(UserError, match=r"axis 1 has 5 entries, not divisible into 2"):
        make_layer(f"type: 'Slice' {_tops(2)}", [(2, 5)])
    with pytest.raises(UserError, match="axis or the legacy slice_dim"):
        make_layer(f"type: 'Slice' slice_param {{ axis: 1 slice_dim: 1 }} {_tops(1)}", [(2, 5)])


# ---- Crop -------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,window", [
    ("crop_param { offset: 1 offset: 2 }", (slice(None), slice(None), slice(1, 4), slice(2, 5))),
    ("crop_param { offset: 1 }", (slice(None), slice(None), slice(1, 4), slice(1, 4))),
    ("", (slice(None), slice(None), slice(0, 3), slice(0, 3))),
    ("crop_param { axis: 1 offset: 1 }", (slice(None), slice(1, 3), slice(1, 4), slice(1, 4))),
])
def test_crop_reference_and_gradient(extra, window):
    rng = np.random.default_rng(101)
    x = rng.standard_normal((2, 3, 5, 6))
    ref_blob = rng.standard_normal((2, 2, 3, 3))
    if "axis: 1" not in extra:
        ref_blob = rng.standard_normal((5, 9, 3, 3))  # axes before `axis` are not cropped: any size
    proto = f"type: 'Crop' {extra}"
    layer, shapes = make_layer(proto, [x.shape, ref_blob.shape])
    (y,) = forward(layer, [x.copy(), ref_blob], shapes)
    np.testing.assert_array_equal(y, x[window])
    check_gradients(proto, [x, ref_blob], check_bottoms=[0])


def test_crop_rejects_window_outside_the_bottom():
    with pytest.raises(UserError, match=r"axis 3: offset 4 \+ size 3 exceeds bottom 0's size 6"):
        make_layer("type: 'Crop' crop_param { offset: 0 offset: 4 }", [(2, 3, 5, 6), (2, 3, 3, 3)])
    with pytest.raises(UserError, match=r"3 offsets for 2 cropped axes"):
        make_layer("type: 'Crop' crop_param { offset: 0 offset: 1 offset: 1 }", [(2, 3, 5, 6), (2, 3, 3, 3)])


# ---- Reshape ----------------------------------------------------------------------------------

def test_reshape_shapes():
    x = (2, 3, 4, 5)
    cases = {
        "shape { dim: 0 dim: -1 }": (2, 60),
        "shape { dim: 0 dim: 3 dim: 2 dim: -1 }": (2, 3, 2, 10),
        "shape { dim: -1 dim: 0 }": (40, 3),  # 0 copies the bottom's axis at the same position
        "shape { dim: 6 dim: 2 } axis: 1 num_axes: 2": (2, 6, 2, 5),
        "shape { dim: 1 } axis: 1 num_axes: 0": (2, 1, 3, 4, 5),
        "shape { dim: 20 } axis: -3": (2, 3, 20),  # axis -3 starts after axis 1 (Caffe: axis + ndim + 1)
        "shape { dim: 1 } axis: -1": (2, 3, 4, 5, 1),  # nothing replaced: an appended axis
    }
    for extra, want in cases.items():
        layer, shapes = make_layer(f"type: 'Reshape' reshape_param {{ {extra} }}", [x])
        assert shapes == [want], extra
        assert layer.shares_data and layer.shares_diff and layer.backward_needs() == frozenset()
    bad = {
        "shape { dim: -1 dim: -1 }": "more than one -1",
        "shape { dim: 7 dim: -1 }": "120 values are not a multiple of 7",
        "shape { dim: 2 dim: 3 }": r"top of \(2, 3\) \(6 values\) for a bottom of \(2, 3, 4, 5\)",
        "shape { dim: 0 dim: 0 dim: 0 dim: 0 dim: 0 }": "shape dim 4 is 0 \\(copy\\) but the bottom has no axis 4",
        "shape { dim: -2 }": "shape dim 0 is -2",
        "shape { dim: 1 } axis: 2 num_axes: 3": "axis 2 with num_axes 3 goes past the 4 axes",
    }
    for extra, msg in bad.items():
        with pytest.raises(UserError, match=r"under_test.*" + msg):
            make_layer(f"type: 'Reshape' reshape_param {{ {extra} }}", [x])


def test_reshape_top_and_diff_are_views_in_a_net():
    net = _net("""
    force_backward: true
    layer { name: 'in' type: 'Input' top: 'x' top: 'w'
            input_param { shape { dim: 2 dim: 3 dim: 4 } shape { dim: 2 dim: 4 dim: 3 } } }
    layer { name: 'rs' type: 'Reshape' bottom: 'x' top: 'xr' reshape_param { shape { dim: 0 dim: -1 dim: 3 } } }
    layer { name: 'prod' type: 'Eltwise' bottom: 'xr' bottom: 'w' top: 'loss'
            eltwise_param { operation: PROD } loss_weight: 1 }
    """)
    rng = np.random.default_rng(102)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((2, 4, 3)).astype(np.float32)
    net.data["x"].array[...] = x
    net.data["w"].array[...] = w
    assert np.shares_memory(net.data["xr"].array, net.data["x"].array)
    loss = net.forward()
    np.testing.assert_allclose(loss, float((x.reshape(2, 4, 3) * w).sum()), rtol=1e-5)
    net.backward()
    np.testing.assert_array_equal(net.diff["x"].array, w.reshape(2, 3, 4))


# ---- Tile -------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis,tiles", [(1, 3), (0, 2), (-1, 2)])
def test_tile_reference_and_gradient(axis, tiles):
    rng = np.random.default_rng(103)
    x = rng.standard_normal((2, 3, 2))
    proto = f"type: 'Tile' tile_param {{ axis: {axis} tiles: {tiles} }}"
    layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    reps = [1] * x.ndim
    reps[axis] = tiles
    np.testing.assert_array_equal(y, np.tile(x, reps))
    check_gradients(proto, [x])
    with pytest.raises(UserError, match="tiles must be 1 or more, got 0"):
        make_layer("type: 'Tile'", [x.shape])


# ---- Silence ----------------------------------------------------------------------------------

def test_silence_has_no_tops_and_no_backward_in_a_net():
    net = _net("""
    layer { name: 'in' type: 'Input' top: 'x' top: 'y' input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
    layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'h' inner_product_param { num_output: 3 } }
    layer { name: 'sil' type: 'Silence' bottom: 'h' bottom: 'y' }
    """)
    node = net.graph.node("sil")
    assert node.tops == [] and not node.need_backward
    assert "h" not in net.graph.outputs
    net.forward()
    layer, shapes = make_layer("type: 'Silence'", [(2, 3)])
    assert shapes == [] and not layer.has_backward
    dx = np.ones((2, 3))
    layer.backward([], [], [True], [np.zeros((2, 3))], [dx])
    np.testing.assert_array_equal(dx, 0)


# ---- Reduction --------------------------------------------------------------------------------

REDUCE = {"SUM": lambda x, a: x.sum(a), "ASUM": lambda x, a: np.abs(x).sum(a),
          "SUMSQ": lambda x, a: (x * x).sum(a), "MEAN": lambda x, a: x.mean(a)}


@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("axis,coeff", [(0, 1.0), (1, -0.5), (-1, 2.0)])
def test_reduction_reference_and_gradient(op, axis, coeff):
    rng = np.random.default_rng(104)
    x = rng.standard_normal((3, 2, 4))
    proto = f"type: 'Reduction' reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}"
    layer, shapes = make_layer(proto, [x.shape])
    a = axis % 3
    assert shapes == [x.shape[:a]]
    assert layer.backward_needs() == (frozenset({NEEDS_BOTTOM}) if op in ("ASUM", "SUMSQ") else frozenset())
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, coeff * REDUCE[op](x, tuple(range(a, 3))), rtol=1e-12)
    check_gradients(proto, [x])


# ---- ArgMax -----------------------------------------------------------------------------------

def test_argmax_without_axis_caffe_layout():
    rng = np.random.default_rng(105)
    x = rng.standard_normal((4, 3, 2, 2))
    flat = x.reshape(4, -1)
    order = np.argsort(-flat, axis=1)[:, :3]
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { top_k: 3 }", [x.shape])
    assert shapes == [(4, 1, 3, 1)] and not layer.has_backward
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y[:, 0, :, 0], order)
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { top_k: 3 out_max_val: true }", [x.shape])
    assert shapes == [(4, 2, 3, 1)]
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y[:, 0, :, 0], order)
    np.testing.assert_array_equal(y[:, 1, :, 0], np.take_along_axis(flat, order, 1))
    layer, shapes = make_layer("type: 'ArgMax'", [(5, 7)])
    assert shapes == [(5, 1, 1)]
    (y,) = forward(layer, [flat[:, :7][:4].repeat(2, 0)[:5]], shapes)
    np.testing.assert_array_equal(y[:, 0, 0], flat[:, :7][:4].repeat(2, 0)[:5].argmax(1))


def test_argmax_along_axis_and_ties():
    rng = np.random.default_rng(106)
    x = rng.standard_normal((2, 5, 3))
    order = np.argsort(-x, axis=1)[:, :2]
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { axis: 1 top_k: 2 }", [x.shape])
    assert shapes == [(2, 2, 3)]
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y, order)
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { axis: 1 top_k: 2 out_max_val: true }", [x.shape])
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_array_equal(y, np.take_along_axis(x, order, 1))
    # Ties go to the larger index, as Caffe's partial_sort on (value, index) pairs.
    layer, shapes = make_layer("type: 'ArgMax' argmax_param { top_k: 2 }", [(1, 4)])
    (y,) = forward(layer, [np.array([[1.0, 3.0, 1.0, 3.0]])], shapes)
    np.testing.assert_array_equal(y.ravel(), [3, 1])
    with pytest.raises(UserError, match="top_k is 6, but must be between 1 and the 5 values"):
        make_layer("type: 'ArgMax' argmax_param { axis: 1 top_k: 6 }", [x.shape])


# ---- Elementwise neurons ----------------------------------------------------------------------

def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


NEURONS = [
    ("ELU", "elu_param { alpha: 0.7 }", lambda x: np.where(x > 0, x, A07 * (np.exp(x) - 1)), {NEEDS_TOP}),
    ("ELU", "", lambda x: np.where(x > 0, x, np.exp(x) - 1), {NEEDS_TOP}),
    ("AbsVal", "", np.abs, {NEEDS_BOTTOM}),
    ("BNLL", "", lambda x: np.log(1 + np.exp(x)), {NEEDS_TOP}),
    ("Exp", "", np.exp, {NEEDS_TOP}),
    ("Exp", "exp_param { base: 2 scale: 0.5 shift: -1 }", lambda x: 2.0 ** (-1 + 0.5 * x), {NEEDS_TOP}),
    ("Log", "log_param { shift: 4 scale: 0.5 }", lambda x: np.log(4 + 0.5 * x), {NEEDS_BOTTOM}),
    ("Log", "log_param { base: 10 shift: 5 scale: -1 }", lambda x: np.log10(5 - x), {NEEDS_BOTTOM}),
    ("Power", "power_param { power: 2 scale: 0.5 shift: 1 }", lambda x: (1 + 0.5 * x) ** 2, {NEEDS_BOTTOM}),
    ("Power", "power_param { power: 0.5 scale: 1.5 shift: 5 }", lambda x: (5 + 1.5 * x) ** 0.5, {NEEDS_BOTTOM}),
    ("Power", "power_param { power: -1.5 shift: 4 }", lambda x: (4 + x) ** -1.5, {NEEDS_BOTTOM}),
    ("Power", "power_param { scale: -3 shift: 2 }", lambda x: 2 - 3 * x, set()),
    ("Power", "power_param { power: 0 }", lambda x: np.ones_like(x), set()),
]


@pytest.mark.parametrize("type_name,extra,f,needs", NEURONS, ids=[f"{n[0]}-{i}" for i, n in enumerate(NEURONS)])
def test_neuron_reference_and_gradient(type_name, extra, f, needs):
    rng = np.random.default_rng(107)
    x = rng.uniform(-2.5, 2.5, (2, 3, 4))
    x[np.abs(x) < 1e-3] = 0.5  # keep central differences away from kinks
    proto = f"type: '{type_name}' {extra}"
    layer, shapes = make_layer(proto, [x.shape])
    assert layer.backward_needs() == frozenset(needs)
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, f(x), rtol=1e-12, atol=1e-14)
    check_gradients(proto, [x])
    (y32,) = forward(make_layer(proto, [x.shape])[0], [x.astype(np.float32)], shapes, dtype=np.float32)
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, f(x), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("type_name,extra", [("ELU", ""), ("BNLL", ""), ("Exp", "exp_param { scale: 0.3 }")])
def test_output_gradient_neurons_work_in_place(type_name, extra):
    rng = np.random.default_rng(108)
    x = rng.standard_normal((3, 4))
    proto = f"type: '{type_name}' {extra}"
    ref_layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(ref_layer, [x.copy()], shapes)
    dy = rng.standard_normal(x.shape)
    dx = np.zeros_like(x)
    ref_layer.backward([y], [dy.copy()], [True], [x.copy()], [dx])
    layer, _ = make_layer(proto + " bottom: 'x' top: 'x'", [x.shape])
    buf, diff = x.copy(), dy.copy()
    layer.forward([buf], [buf])
    layer.backward([buf], [diff], [True], [buf], [diff])
    np.testing.assert_allclose(buf, y, rtol=1e-14)
    np.testing.assert_allclose(diff, dx, rtol=1e-12)


def test_bnll_is_stable_and_input_reading_neurons_refuse_in_place():
    layer, shapes = make_layer("type: 'BNLL'", [(4,)])
    with np.errstate(over="raise"):
        (y,) = forward(layer, [np.array([-800.0, -1.0, 1.0, 800.0])], shapes)
    np.testing.assert_allclose(y, [0.0, np.log1p(np.exp(-1.0)), 1 + np.log1p(np.exp(-1.0)), 800.0], rtol=1e-12)
    for proto in ("type: 'AbsVal'", "type: 'Log'", "type: 'Power' power_param { power: 2 }"):
        with pytest.raises(UserError, match="cannot work in place on 'x' when training"):
            make_layer(proto + " bottom: 'x' top: 'x'", [(2, 3)])
        make_layer(proto + " bottom: 'x' top: 'x'", [(2, 3)], phase=pb.TEST)
    make_layer("type: 'Power' power_param { scale: 2 } bottom: 'x' top: 'x'", [(2, 3)])  # linear: in place is fine
    with pytest.raises(UserError, match="base must be a positive number other than 1.*got 1"):
        make_layer("type: 'Exp' exp_param { base: 1 }", [(2, 3)])
    with pytest.raises(UserError, match="alpha must be >= 0, got -1"):
        make_layer("type: 'ELU' elu_param { alpha: -1 }", [(2, 3)])


def test_threshold_forward_and_no_backward():
    x = np.array([[-1.0, 0.2, 0.3, 0.9]])
    layer, shapes = make_layer("type: 'Threshold' threshold_param { threshold: 0.3 }", [x.shape])
    assert not layer.has_backward
    (y,) = forward(layer, [x], shapes)
    np.testing.assert_array_equal(y, [[0.0, 0.0, 0.0, 1.0]])


# ---- PReLU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [False, True])
def test_prelu_reference_gradient_and_default_filler(shared):
    rng = np.random.default_rng(109)
    x = rng.standard_normal((2, 3, 2, 2))
    x[np.abs(x) < 1e-3] = 0.5
    proto = f"type: 'PReLU' prelu_param {{ channel_shared: {str(shared).lower()} }}"
    layer, shapes = make_layer(proto, [x.shape])
    assert [p.shape for p in layer.params] == [(1,) if shared else (3,)]
    f = layer.params[0].filler
    assert f.type == "constant" and abs(f.value - 0.25) < 1e-7
    (y,) = forward(layer, [x.copy()], shapes)
    a = layer.params[0].data.reshape(1, -1, 1, 1)
    np.testing.assert_allclose(y, np.where(x > 0, x, a * x), rtol=1e-14)
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
    check_gradients(proto, [x])
    # In place: a saved copy of the input feeds the backward; the slope diff accumulates.
    inplace, _ = make_layer(proto + " bottom: 'x' top: 'x'", [x.shape])
    assert inplace.backward_needs() == frozenset()
    inplace.params[0].data[...] = layer.params[0].data
    inplace.params[0].diff[...] = 1.0
    buf, dy = x.copy(), rng.standard_normal(x.shape)
    diff = dy.copy()
    inplace.forward([buf], [buf])
    inplace.backward([buf], [diff], [True], [buf], [diff])
    np.testing.assert_allclose(diff, np.where(x > 0, dy, a * dy), rtol=1e-12)
    da = np.where(x > 0, 0, x * dy).sum(axis=(0, 2, 3))
    np.testing.assert_allclose(inplace.params[0].diff, 1.0 + (da.sum(keepdims=True) if shared else da), rtol=1e-12)


# ---- Bias -------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,bshape", [("", (3,)), ("bias_param { axis: 1 num_axes: 2 }", (3, 4)),
                                          ("bias_param { axis: 0 num_axes: -1 }", (2, 3, 4, 2)),
                                          ("bias_param { num_axes: 0 }", ())])
def test_bias_learned_reference_and_gradient(extra, bshape):
    rng = np.random.default_rng(110)
    x = rng.standard_normal((2, 3, 4, 2))
    proto = f"type: 'Bias' {extra}"
    layer, shapes = make_layer(proto, [x.shape])
    assert [p.shape for p in layer.params] == [bshape] and layer.backward_needs() == frozenset()
    (y,) = forward(layer, [x.copy()], shapes)
    b = layer.params[0].data.reshape((1,) * (1 if extra.find("axis: 0") < 0 else 0) + bshape
                                     + (1,) * (4 - len(bshape) - (1 if extra.find("axis: 0") < 0 else 0)))
    np.testing.assert_allclose(y, x + b, rtol=1e-14)
    check_gradients(proto, [x])


def test_bias_second_bottom_and_in_place():
    rng = np.random.default_rng(111)
    x = rng.standard_normal((2, 3, 4))
    b = rng.standard_normal((3, 4))
    proto = "type: 'Bias'"
    layer, shapes = make_layer(proto, [x.shape, b.shape])
    assert layer.params == []
    (y,) = forward(layer, [x.copy(), b.copy()], shapes)
    np.testing.assert_allclose(y, x + b, rtol=1e-14)
    check_gradients(proto, [x, b])
    scalar, shapes = make_layer("type: 'Bias' bias_param { axis: 2 }", [x.shape, ()])
    (y,) = forward(scalar, [x.copy(), np.array(0.5)], shapes)
    np.testing.assert_allclose(y, x + 0.5)
    inplace, _ = make_layer("type: 'Bias' bottom: 'x' top: 'x'", [x.shape])
    buf = x.copy()
    inplace.forward([buf], [buf])
    np.testing.assert_allclose(buf, x + inplace.params[0].data.reshape(1, 3, 1))
    with pytest.raises(UserError, match=r"bias bottom's shape \(4,\) does not match"):
        make_layer(proto, [x.shape, (4,)])


# ---- Losses -----------------------------------------------------------------------------------

def test_euclidean_loss_reference_and_gradient():
    rng = np.random.default_rng(112)
    a = rng.standard_normal((4, 3, 2))
    b = rng.standard_normal((4, 6))
    layer, shapes = make_layer("type: 'EuclideanLoss'", [a.shape, b.shape])
    assert shapes == [()] and layer.is_loss and layer.label_bottoms == ()
    (loss,) = forward(layer, [a, b], shapes)
    np.testing.assert_allclose(loss, ((a.reshape(4, 6) - b) ** 2).sum() / 8, rtol=1e-12)
    check_gradients("type: 'EuclideanLoss'", [a, b])
    with pytest.raises(UserError, match=r"shapes \(4, 6\) and \(4, 5\)"):
        make_layer("type: 'EuclideanLoss'", [(4, 6), (4, 5)])


def _sigmoid_ce_ref(x, t, ignore, mode):
    p = _sig(x)
    terms = t * np.log(p) + (1 - t) * np.log(1 - p)
    valid = np.ones(x.shape, bool) if ignore is None else t != ignore
    norm = {"FULL": x.size, "VALID": valid.sum(), "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return -terms[valid].sum() / max(norm, 1)


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore", [None, -1])
def test_sigmoid_cross_entropy_loss_reference_and_gradient(mode, ignore):
    rng = np.random.default_rng(113)
    x = 2.0 * rng.standard_normal((3, 2, 3))
    t = rng.random(x.shape)
    if ignore is not None:
        t[rng.random(x.shape) < 0.3] = ignore
    fields = (f"ignore_label: {ignore} " if ignore is not None else "") + f"normalization: {mode}"
    proto = f"type: 'SigmoidCrossEntropyLoss' loss_param {{ {fields} }}"
    layer, shapes = make_layer(proto, [x.shape, t.shape])
    assert layer.label_bottoms == (1,)
    (loss,) = forward(layer, [x, t], shapes)
    np.testing.assert_allclose(loss, _sigmoid_ce_ref(x, t, ignore, mode), rtol=1e-12)
    check_gradients(proto, [x, t], check_bottoms=[0])


def test_sigmoid_cross_entropy_default_is_valid_legacy_normalize_and_stability():
    x = np.array([[800.0, -800.0, 0.0]])
    t = np.array([[0.0, 1.0, 1.0]])
    layer, shapes = make_layer("type: 'SigmoidCrossEntropyLoss'", [x.shape, t.shape])
    with np.errstate(over="raise"):
        (loss,) = forward(layer, [x, t], shapes)
    np.testing.assert_allclose(loss, (800 + 800 + np.log(2)) / 3, rtol=1e-12)
    layer, shapes = make_layer("type: 'SigmoidCrossEntropyLoss' loss_param { normalize: false }", [x.shape, t.shape])
    (loss,) = forward(layer, [x, t], shapes)
    np.testing.assert_allclose(loss, 800 + 800 + np.log(2), rtol=1e-12)


def _hinge_ref(x, lab, norm):
    n = x.shape[0]
    x = x.reshape(n, -1)
    total = 0.0
    for i in range(n):
        for j in range(x.shape[1]):
            m = max(0.0, 1 + (-x[i, j] if j == int(lab[i]) else x[i, j]))
            total += m if norm == "L1" else m * m
    return total / n


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss_reference_and_gradient(norm):
    rng = np.random.default_rng(114)
    x = rng.standard_normal((5, 4, 1, 1))
    lab = rng.integers(0, 4, (5,)).astype(np.float64)
    proto = f"type: 'HingeLoss' hinge_loss_param {{ norm: {norm} }}"
    layer, shapes = make_layer(proto, [x.shape, lab.shape])
    (loss,) = forward(layer, [x, lab], shapes)
    np.testing.assert_allclose(loss, _hinge_ref(x, lab, norm), rtol=1e-12)
    check_gradients(proto, [x, lab], check_bottoms=[0])
    with pytest.raises(UserError, match=r"under_test.*outside the 4 classes.*'b1'"):
        forward(layer, [x, np.array([0.0, 1, 2, 3, 4])], shapes)


def _contrastive_ref(a, b, sim, margin, legacy):
    total = 0.0
    for i in range(a.shape[0]):
        d2 = ((a[i] - b[i]) ** 2).sum()
        if sim[i]:
            total += d2
        elif legacy:
            total += max(margin - d2, 0.0)
        else:
            total += max(margin - np.sqrt(d2), 0.0) ** 2
    return total / (2 * a.shape[0])


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss_reference_and_gradient(legacy):
    rng = np.random.default_rng(115)
    a = rng.standard_normal((6, 3, 1, 1))
    b = rng.standard_normal((6, 3, 1, 1))
    sim = np.array([1, 0, 0, 1, 0, 0], np.float64).reshape(6, 1, 1, 1)
    margin = 6.0 if legacy else 2.5  # some dissimilar pairs inside the margin, some outside
    proto = (f"type: 'ContrastiveLoss' contrastive_loss_param {{ margin: {margin} "
             f"legacy_version: {str(legacy).lower()} }}")
    layer, shapes = make_layer(proto, [a.shape, b.shape, sim.shape])
    assert layer.label_bottoms == (2,)
    (loss,) = forward(layer, [a, b, sim], shapes)
    np.testing.assert_allclose(loss, _contrastive_ref(a, b, sim.ravel(), margin, legacy), rtol=1e-12)
    # Caffe's non-legacy gradient divides by (d + 1e-4), not d: a 1e-4 relative difference, kept for parity.
    check_gradients(proto, [a, b, sim], check_bottoms=[0, 1], rtol=1e-3 if not legacy else 1e-4)


def test_multinomial_logistic_loss_reference_and_gradient():
    rng = np.random.default_rng(116)
    prob = rng.uniform(0.05, 1.0, (4, 5))
    lab = rng.integers(0, 5, (4, 1, 1, 1)).astype(np.float64)
    layer, shapes = make_layer("type: 'MultinomialLogisticLoss'", [prob.shape, lab.shape])
    (loss,) = forward(layer, [prob, lab], shapes)
    np.testing.assert_allclose(loss, -np.log(prob[np.arange(4), lab.ravel().astype(int)]).mean(), rtol=1e-12)
    check_gradients("type: 'MultinomialLogisticLoss'", [prob, lab], check_bottoms=[0])
    prob[0, int(lab.ravel()[0])] = 0.0
    (loss0,) = forward(layer, [prob, lab], shapes)
    assert np.isfinite(loss0) and loss0 > -np.log(1e-20) / 4 - 1e-9
    with pytest.raises(UserError, match="label blob 'b1' has 3 values for the 4 samples"):
        make_layer("type: 'MultinomialLogisticLoss'", [(4, 5), (3,)])


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _infogain_ref(scores, labels, h, ignore, mode):
    prob = _softmax(scores, 1)
    n, c = scores.shape[:2]
    p = prob.reshape(n, c, -1)
    lab = labels.reshape(n, -1)
    total, valid = 0.0, 0
    for i in range(n):
        for j in range(lab.shape[1]):
            if ignore is not None and lab[i, j] == ignore:
                continue
            total -= sum(h[int(lab[i, j]), k] * np.log(max(p[i, k, j], 1e-20)) for k in range(c))
            valid += 1
    norm = {"FULL": n * lab.shape[1], "VALID": valid, "BATCH_SIZE": n, "NONE": 1}[mode]
    return total / max(norm, 1)


@pytest.mark.parametrize("mode,ignore", [("VALID", None), ("FULL", 2), ("BATCH_SIZE", None)])
def test_infogain_loss_third_bottom_reference_and_gradient(mode, ignore):
    rng = np.random.default_rng(117)
    scores = rng.standard_normal((3, 4, 2))
    labels = rng.integers(0, 4, (3, 2)).astype(np.float64)
    labels[0, 0] = 1
    h = rng.uniform(0, 1, (4, 4))
    fields = (f"ignore_label: {ignore} " if ignore is not None else "") + f"normalization: {mode}"
    proto = f"type: 'InfogainLoss' loss_param {{ {fields} }}"
    layer, shapes = make_layer(proto, [scores.shape, labels.shape, h.shape])
    assert layer.label_bottoms == (1, 2)
    (loss,) = forward(layer, [scores, labels, h], shapes)
    np.testing.assert_allclose(loss, _infogain_ref(scores, labels, h, ignore, mode), rtol=1e-12)
    check_gradients(proto, [scores, labels, h], check_bottoms=[0])


def test_infogain_loss_from_binaryproto_identity_is_softmax_loss(tmp_path):
    rng = np.random.default_rng(118)
    scores = rng.standard_normal((5, 3))
    labels = rng.integers(0, 3, (5,)).astype(np.float64)
    path = tmp_path / "H.binaryproto"
    write_binary(str(path), array_to_blob(np.eye(3, dtype=np.float32).reshape(1, 1, 3, 3)))
    proto = f"type: 'InfogainLoss' infogain_loss_param {{ source: '{path}' }} top: 'loss' top: 'prob'"
    layer, shapes = make_layer(proto, [scores.shape, labels.shape])
    assert shapes == [(), scores.shape]
    loss, prob = forward(layer, [scores, labels], shapes)
    np.testing.assert_allclose(prob, _softmax(scores, 1), rtol=1e-12)
    np.testing.assert_allclose(loss, -np.log(prob[np.arange(5), labels.astype(int)]).mean(), rtol=1e-12)
    check_gradients(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{path}' }}", [scores, labels],
                    check_bottoms=[0])
    with pytest.raises(UserError, match=r"3 x 3 matrix|need 4 x 4"):
        make_layer(f"type: 'InfogainLoss' infogain_loss_param {{ source: '{path}' }}", [(5, 4), (5,)])
    with pytest.raises(UserError, match="cannot read infogain_loss_param.source.*no such file"):
        make_layer("type: 'InfogainLoss' infogain_loss_param { source: '/nonexistent/H.binaryproto' }",
                   [(5, 3), (5,)])
    with pytest.raises(UserError, match="needs the infogain matrix"):
        make_layer("type: 'InfogainLoss'", [(5, 3), (5,)])


# ---- MVN --------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", ["", "mvn_param { normalize_variance: false }",
                                   "mvn_param { across_channels: true }",
                                   "mvn_param { across_channels: true normalize_variance: false eps: 0.01 }"])
def test_mvn_reference_and_gradient(extra):
    rng = np.random.default_rng(119)
    x = 2.0 * rng.standard_normal((2, 3, 2, 3)) + 1.0
    proto = f"type: 'MVN' {extra}"
    layer, shapes = make_layer(proto, [x.shape])
    across = "across_channels: true" in extra
    normalize = "normalize_variance: false" not in extra
    axes = (1, 2, 3) if across else (2, 3)
    y_ref = x - x.mean(axis=axes, keepdims=True)
    if normalize:
        y_ref = y_ref / (x.std(axis=axes, keepdims=True) + 1e-9)
    assert layer.backward_needs() == (frozenset({NEEDS_TOP}) if normalize else frozenset())
    (y,) = forward(layer, [x.copy()], shapes)
    np.testing.assert_allclose(y, y_ref, rtol=1e-9, atol=1e-12)
    check_gradients(proto, [x])


# ---- Embed ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_embed_reference_and_gradient(bias):
    rng = np.random.default_rng(120)
    idx = np.array([[0.0, 3.0, 3.0], [1.0, 4.0, 0.0]])  # repeats: their gradients add up
    proto = f"type: 'Embed' embed_param {{ num_output: 3 input_dim: 5 bias_term: {str(bias).lower()} }}"
    layer, shapes = make_layer(proto, [idx.shape])
    assert shapes == [(2, 3, 3)] and layer.label_bottoms == (0,)
    assert [p.shape for p in layer.params] == [(5, 3)] + ([(3,)] if bias else [])
    (y,) = forward(layer, [idx], shapes)
    ref = layer.params[0].data[idx.astype(int)] + (layer.params[1].data if bias else 0)
    np.testing.assert_allclose(y, ref, rtol=1e-14)
    check_gradients(proto, [idx], check_bottoms=[])
    with pytest.raises(UserError, match=r"under_test.*1 index value\(s\) not an integer in \[0, 5\), e\.g\. 5"):
        forward(layer, [np.array([[0.0, 5.0, 1.0], [1.0, 1.0, 1.0]])], shapes)
    with pytest.raises(UserError, match="input_dim must be 1 or more"):
        make_layer("type: 'Embed' embed_param { num_output: 3 }", [idx.shape])


# ---- Deconvolution ----------------------------------------------------------------------------

def _deconv_ref(x, w, b, stride, pad, group):
    """Direct scatter: every input pixel adds its value times the kernel into the (padded) output."""
    n, c, h, wd = x.shape
    mg, kh, kw = w.shape[1:]
    m = mg * group
    oh, ow = stride * (h - 1) + kh - 2 * pad, stride * (wd - 1) + kw - 2 * pad
    full = np.zeros((n, m, oh + 2 * pad, ow + 2 * pad))
    cg = c // group
    for i in range(n):
        for ci in range(c):
            g = ci // cg
            for yy in range(h):
                for xx in range(wd):
                    full[i, g * mg:(g + 1) * mg, yy * stride:yy * stride + kh, xx * stride:xx * stride + kw] += \
                        x[i, ci, yy, xx] * w[ci]
    out = full[:, :, pad:pad + oh, pad:pad + ow]
    return out + (b.reshape(1, -1, 1, 1) if b is not None else 0)


@pytest.mark.parametrize("stride,pad,group,bias", [(2, 1, 1, True), (1, 0, 2, False), (3, 0, 1, True)])
def test_deconvolution_reference_and_gradient(stride, pad, group, bias):
    rng = np.random.default_rng(121)
    x = rng.standard_normal((2, 4, 3, 3))
    proto = (f"type: 'Deconvolution' convolution_param {{ num_output: 4 kernel_size: 3 stride: {stride} "
             f"pad: {pad} group: {group} bias_term: {str(bias).lower()} }}")
    layer, shapes = make_layer(proto, [x.shape])
    assert [p.shape for p in layer.params][0] == (4, 4 // group, 3, 3)
    assert layer.backward_needs() == frozenset({NEEDS_BOTTOM})
    (y,) = forward(layer, [x.copy()], shapes)
    ref = _deconv_ref(x, layer.params[0].data, layer.params[1].data if bias else None, stride, pad, group)
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    check_gradients(proto, [x])


def test_deconvolution_is_the_adjoint_of_convolution():
    rng = np.random.default_rng(122)
    conv, cshapes = make_layer("type: 'Convolution' convolution_param { num_output: 3 kernel_size: 3 stride: 2 "
                               "pad: 1 bias_term: false }", [(1, 2, 7, 7)])
    deconv, dshapes = make_layer("type: 'Deconvolution' convolution_param { num_output: 2 kernel_size: 3 stride: 2 "
                                 "pad: 1 bias_term: false }", [cshapes[0]])
    assert dshapes == [(1, 2, 7, 7)]
    deconv.params[0].data[...] = conv.params[0].data
    u = rng.standard_normal((1, 2, 7, 7))
    v = rng.standard_normal(cshapes[0])
    (cu,) = forward(conv, [u], cshapes)
    (dv,) = forward(deconv, [v], dshapes)
    np.testing.assert_allclose((cu * v).sum(), (u * dv).sum(), rtol=1e-12)


# ---- Python -----------------------------------------------------------------------------------

def test_python_layer_is_a_clear_user_error():
    text = """
    layer { name: 'in' type: 'Input' top: 'x' input_param { shape { dim: 2 } } }
    layer { name: 'py' type: 'Python' bottom: 'x' top: 'y' python_param { module: 'm' layer: 'L' } }
    """
    with pytest.raises(UserError, match=r"unsupported layer type 'Python' in layer 'py' \(SuperNeurons cannot run "
                                        r"Python layers\)"):
        build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)


# ---- In a Net ---------------------------------------------------------------------------------

NET = """
layer { name: 'in' type: 'Input' top: 'x' top: 'target' top: 'ids'
        input_param { shape { dim: 4 dim: 6 dim: 3 dim: 3 } shape { dim: 4 dim: 72 } shape { dim: 4 dim: 2 } } }
layer { name: 'slice' type: 'Slice' bottom: 'x' top: 'a' top: 'b' slice_param { slice_point: 2 } }
layer { name: 'prelu' type: 'PReLU' bottom: 'a' top: 'a' }
layer { name: 'elu' type: 'ELU' bottom: 'b' top: 'b' }
layer { name: 'deconv' type: 'Deconvolution' bottom: 'b' top: 'up'
        convolution_param { num_output: 2 kernel_size: 2 stride: 2 weight_filler { type: 'gaussian' std: 0.3 } } }
layer { name: 'crop' type: 'Crop' bottom: 'up' bottom: 'a' top: 'upc' crop_param { offset: 1 } }
layer { name: 'cat' type: 'Concat' bottom: 'a' bottom: 'upc' bottom: 'b' top: 'cat' }
layer { name: 'mvn' type: 'MVN' bottom: 'cat' top: 'cat' }
layer { name: 'flat' type: 'Reshape' bottom: 'cat' top: 'flat' reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: 'bias' type: 'Bias' bottom: 'flat' top: 'flat' bias_param { filler { type: 'gaussian' } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'flat' bottom: 'target' top: 'loss' }
layer { name: 'emb' type: 'Embed' bottom: 'ids' top: 'e' embed_param { num_output: 3 input_dim: 7 } }
layer { name: 'red' type: 'Reduction' bottom: 'e' top: 'r' reduction_param { operation: SUMSQ } loss_weight: 0.1 }
layer { name: 'am' type: 'ArgMax' bottom: 'x' top: 'am' }
layer { name: 'sil' type: 'Silence' bottom: 'am' }
"""


@pytest.mark.parametrize("memory", ["baseline", "liveness", "recompute"])
def test_new_layers_train_together_in_float32_under_memory_modes(memory):
    rng = np.random.default_rng(123)
    inputs = {"x": rng.standard_normal((4, 6, 3, 3)), "target": rng.standard_normal((4, 72)),
              "ids": rng.integers(0, 7, (4, 2)).astype(np.float64)}
    results = []
    for mode in ("baseline", memory):
        net = Net(build_graph(text_format.Parse(NET, pb.NetParameter()), pb.TRAIN), CpuBackend(), seed=7,
                  memory=mode)
        for k, v in inputs.items():
            net.data[k].array[...] = v
        loss = net.forward()
        net.backward()
        grads = [np.array(d.diff, copy=True) for n in net.graph.nodes for d in net.layer(n.name).params]
        results.append((loss, grads))
    (loss0, g0), (loss1, g1) = results
    assert np.isfinite(loss0) and loss0 > 0
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g0, g1):
        assert a.dtype == np.float32 and np.isfinite(a).all()
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


# ---- random_fill and DummyData -------------------------------------------------------------------

def _fill(kind, a, b, keep=1.0, n=200_000, seed=5, iteration=3, layer=2, stream=0, dtype=np.float32):
    out = np.zeros(n, dtype)
    CpuBackend().ops.random_fill(out, kind, a, b, keep, seed, iteration, layer, stream)
    return out


def test_random_fill_distributions():
    z = _fill("gaussian", 0.5, 2.0).astype(np.float64)
    # n = 2e5: the sample mean's standard error is 2 / sqrt(n) = 0.0045, the std's 0.0032.
    assert abs(z.mean() - 0.5) < 0.03 and abs(z.std() - 2.0) < 0.02
    assert abs(np.mean(np.abs(z - 0.5) < 2.0) - 0.6827) < 0.01  # the normal's one-sigma mass
    u = _fill("uniform", -1.0, 3.0).astype(np.float64)
    assert u.min() >= -1.0 and u.max() <= 3.0 and abs(u.mean() - 1.0) < 0.02
    assert abs(u.std() - 4.0 / np.sqrt(12.0)) < 0.02
    sparse = _fill("gaussian", 0.0, 1.0, keep=0.3)
    assert abs(np.mean(sparse != 0) - 0.3) < 0.01
    assert not _fill("gaussian", 0.0, 1.0, keep=0.0).any()


def test_random_fill_is_a_pure_function_of_its_counters():
    base = _fill("gaussian", 0.0, 1.0)
    assert np.array_equal(base, _fill("gaussian", 0.0, 1.0))  # same (seed, iteration, layer, stream)
    for changed in ({"seed": 6}, {"iteration": 4}, {"layer": 3}, {"stream": 1}):
        other = _fill("gaussian", 0.0, 1.0, **changed)
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.02, changed
    # Element i does not depend on the array's size or dtype (beyond rounding).
    np.testing.assert_allclose(_fill("gaussian", 0.0, 1.0, n=1000, dtype=np.float64), base[:1000], rtol=1e-6,
                               atol=1e-6)


DUMMY = """type: 'DummyData' top: 'a' top: 'b' top: 'c' top: 'd'
dummy_data_param { num: 4 channels: 3 height: 5 width: 6
  data_filler { type: 'constant' value: 2.5 } data_filler { type: 'gaussian' std: 3 }
  data_filler { type: 'positive_unitball' } data_filler { type: 'xavier' } }"""


def test_dummy_data_fills_as_caffe():
    layer, shapes = make_layer(DUMMY, [], dtype=np.float32)
    assert shapes == [(4, 3, 5, 6)] * 4
    tops = [np.zeros(s, np.float32) for s in shapes]
    layer.forward([], tops)
    assert (tops[0] == 2.5).all()
    np.testing.assert_allclose(tops[2].reshape(4, -1).sum(axis=1), 1.0, rtol=1e-5)
    assert (tops[2] > 0).all()
    limit = np.sqrt(3.0 / 90)  # xavier: fan_in = 3 * 5 * 6
    assert np.abs(tops[3]).max() <= limit * (1 + 1e-6) and np.abs(tops[3]).max() > limit * 0.9
    first = [t.copy() for t in tops]
    tops[0][...] = -1  # constant data is filled once, not refilled, for the same array (Caffe)
    layer.ctx.iteration = 1
    layer.forward([], tops)
    assert (tops[0] == -1).all()
    assert not np.array_equal(tops[1], first[1])  # random data is new every iteration
    layer.ctx.iteration = 0
    fresh = [np.zeros(s, np.float32) for s in shapes]  # a new array (a memory mode re-materialized it)
    layer.forward([], fresh)
    for got, want in zip(fresh, first):
        assert np.array_equal(got, want)  # batch k is a pure function of k


def test_dummy_data_rejects_unknown_filler():
    with pytest.raises(UserError, match="unknown filler type 'nope'"):
        make_layer("type: 'DummyData' top: 'a' dummy_data_param { shape { dim: 2 } data_filler { type: 'nope' } }",
                   [])
