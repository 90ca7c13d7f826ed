"""The activations (layers/activations.py, backend/cpu/activation.py) on the CPU backend, and the tables that
the GPU comparisons of their ops read.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs. A new activation adds one row to LAYERS (the
layer: its reference and what its backward reads) and one to OPS (its two ops and their scalars): then
tests/test_cuda_ops.py (GPU) and tests/test_cuda_zoo_ops_sim.py (the CUDA simulator) compare its GPU ops
with the CPU ops.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.proto import superneurons_pb2 as pb

A07 = float(np.float32(0.7))  # prototxt float fields are float32

# (type, parameter message, float64 reference of the forward, what the backward reads)
LAYERS = [
    ("Sigmoid", "", lambda x: 1.0 / (1.0 + np.exp(-x)), {NEEDS_TOP}),
    ("TanH", "", np.tanh, {NEEDS_TOP}),
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
    ("Clip", "clip_param { min: -1 max: 1.5 }", lambda x: np.clip(x, -1, 1.5), {NEEDS_BOTTOM}),
    ("Swish", "", lambda x: x / (1 + np.exp(-x)), {NEEDS_BOTTOM}),
    ("Swish", "swish_param { beta: 0.7 }", lambda x: x / (1 + np.exp(-A07 * x)), {NEEDS_BOTTOM}),
]

# (op name stem: <stem>_forward and <stem>_backward, forward scalars, backward scalars, whether the backward
# reads the output (else the input)). The GPU comparisons run each row on both backends.
OPS = [
    ("relu", (0.1,), (0.1,), True), ("sigmoid", (), (), True), ("tanh", (), (), True),
    ("elu", (0.7,), (0.7,), True), ("absval", (), (), False), ("bnll", (), (), True),
    ("exp", (0.5, 1.3, -0.2), (0.5, 1.3), True), ("log", (0.8, 0.6, 3.0), (0.8, 0.6, 3.0), False),
    ("power", (1.7, 0.6, 3.0), (1.7, 0.6, 3.0), False), ("power", (2.0, -0.5, 1.0), (2.0, -0.5, 1.0), False),
    ("power", (1.0, 1.5, 0.5), (1.0, 1.5, 0.5), False), ("power", (0.0, 1.5, 0.5), (0.0, 1.5, 0.5), False),
    ("clip", (-0.4, 0.9), (-0.4, 0.9), False), ("swish", (1.3,), (1.3,), False),
]


@pytest.mark.parametrize("type_name,extra,f,needs", LAYERS, ids=[f"{n[0]}-{i}" for i, n in enumerate(LAYERS)])
def test_activation_reference_and_gradient(type_name, extra, f, needs):
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


OUTPUT_READERS = [(t, extra) for t, extra, _, needs in LAYERS if needs == {NEEDS_TOP}]


@pytest.mark.parametrize("type_name,extra", OUTPUT_READERS, ids=[f"{t}-{i}" for i, (t, _) in enumerate(OUTPUT_READERS)])
def test_output_gradient_activations_work_in_place(type_name, extra):
    """In place (one array for bottom and top, one for both diffs, as the Net hands them over) computes what the
    layer computes out of place."""
    rng = np.random.default_rng(108)
    x = rng.standard_normal((3, 4))
    proto = f"type: '{type_name}' {extra}"
    ref_layer, shapes = make_layer(proto, [x.shape])
    (y,) = forward(ref_layer, [x.copy()], shapes)
    dy = rng.standard_normal(x.shape)
    dx = np.zeros_like(x)
    ref_layer.backward([y], [dy.copy()], [True], [x.copy()], [dx])
    layer, _ = make_layer(proto + " bottom: 'x' top: 'x'", [x.shape])
    assert layer.in_place
    buf, diff = x.copy(), dy.copy()
    layer.forward([buf], [buf])
    layer.backward([buf], [diff], [True], [buf], [diff])
    np.testing.assert_allclose(buf, y, rtol=1e-14)
    np.testing.assert_allclose(diff, dx, rtol=1e-12)


@pytest.mark.parametrize("type_name", ["Sigmoid", "TanH"])
def test_activation_keeps_float32_and_saturates_without_overflow(type_name):
    layer, shapes = make_layer(f"type: '{type_name}'", [(5,)])
    x = np.array([-1000.0, -30.0, 0.0, 30.0, 1000.0], np.float32)
    with np.errstate(all="raise"):
        (y,) = forward(layer, [x], shapes, dtype=np.float32)
    assert y.dtype == np.float32
    low = 0.0 if type_name == "Sigmoid" else -1.0
    np.testing.assert_allclose(y, [low, low, 0.5 if type_name == "Sigmoid" else 0.0, 1.0, 1.0], atol=1e-6)


def test_bnll_is_stable_and_input_reading_neurons_refuse_in_place():
    layer, shapes = make_layer("type: 'BNLL'", [(4,)])
    with np.errstate(over="raise"):
        (y,) = forward(layer, [np.array([-800.0, -1.0, 1.0, 800.0])], shapes)
    np.testing.assert_allclose(y, [0.0, np.log1p(np.exp(-1.0)), 1 + np.log1p(np.exp(-1.0)), 800.0], rtol=1e-12)
    for proto in ("type: 'AbsVal'", "type: 'Log'", "type: 'Power' power_param { power: 2 }",
                  "type: 'Clip' clip_param { min: 0 max: 6 }", "type: 'Swish'"):
        with pytest.raises(UserError, match="cannot work in place on 'x' when training"):
            make_layer(proto + " bottom: 'x' top: 'x'", [(2, 3)])
        make_layer(proto + " bottom: 'x' top: 'x'", [(2, 3)], phase=pb.TEST)
    make_layer("type: 'Power' power_param { scale: 2 } bottom: 'x' top: 'x'", [(2, 3)])  # linear: in place is fine
    with pytest.raises(UserError, match="base must be a positive number other than 1.*got 1"):
        make_layer("type: 'Exp' exp_param { base: 1 }", [(2, 3)])
    with pytest.raises(UserError, match="alpha must be >= 0, got -1"):
        make_layer("type: 'ELU' elu_param { alpha: -1 }", [(2, 3)])
    with pytest.raises(UserError, match=r"'under_test' \(Clip\): clip_param.min 2 is above clip_param.max 1"):
        make_layer("type: 'Clip' clip_param { min: 2 max: 1 }", [(2, 3)])


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
