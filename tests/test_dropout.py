"""The Dropout layer (layers/dropout.py) and its mask (backend/cpu/dropout.py) on the CPU backend."""
import numpy as np
import pytest
from harness import check_gradients, forward, in_place, make_layer

from superneurons.backend.cpu.dropout import keep_mask
from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb


def _fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def _spec_keep(i, ratio, seed, iteration, layer_index):
    """The mask formula exactly as the dropout ops module documents it, one element in plain Python ints."""
    g = 0x9E3779B9
    k1 = _fmix32((seed % 2**32 + g) % 2**32)
    k1 = _fmix32(((k1 ^ iteration % 2**32) + g) % 2**32)
    k1 = _fmix32(((k1 ^ layer_index % 2**32) + g) % 2**32)
    k2 = _fmix32((k1 + g) % 2**32)
    h = _fmix32((_fmix32(i ^ k1) + k2) % 2**32)
    return (h >> 8) >= int(np.ceil(ratio * 2**24))


def test_dropout_mask_matches_documented_formula_bit_for_bit():
    rng = np.random.default_rng(11)
    n = 5000
    for ratio, seed, iteration, layer_index in ((0.5, 1234, 0, 3), (0.1, -7, 123456, 0), (0.9, 2**40 + 5, 9, 17)):
        mask = keep_mask(n, ratio, seed, iteration, layer_index)
        for i in rng.choice(n, 200, replace=False):
            assert mask[i] == _spec_keep(int(i), ratio, seed, iteration, layer_index), (ratio, seed, i)


def test_dropout_mask_statistics_and_dependence_on_the_stream():
    n = 1 << 20
    for ratio in (0.2, 0.5, 0.75):
        dropped = 1.0 - keep_mask(n, ratio, 1, 0, 0).mean()
        assert abs(dropped - ratio) < 0.004, (ratio, dropped)  # std of the fraction is < 0.0005
    base = keep_mask(n, 0.5, 1, 5, 2)
    np.testing.assert_array_equal(base, keep_mask(n, 0.5, 1, 5, 2))
    # A change of any key gives an unrelated mask: about half the positions disagree.
    for other in (keep_mask(n, 0.5, 1, 6, 2), keep_mask(n, 0.5, 1, 5, 3), keep_mask(n, 0.5, 2, 5, 2)):
        assert abs((base != other).mean() - 0.5) < 0.005
    # Neighbouring elements are not correlated.
    assert abs((base[1:] != base[:-1]).mean() - 0.5) < 0.005


def test_dropout_train_forward_backward_and_gradient():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 5, 3, 3)) + 0.1  # no exact zeros: y == 0 then means "dropped"
    proto = "type: 'Dropout' dropout_param { dropout_ratio: 0.3 }"
    ratio = float(np.float32(0.3))  # the prototxt field is a float32
    layer, shapes = make_layer(proto, [x.shape], iteration=7)
    layer.layer_index = 4
    (y,) = forward(layer, [x.copy()], shapes)
    keep = keep_mask(x.size, ratio, 1234, 7, 4).reshape(x.shape)
    assert 0 < keep.sum() < x.size
    np.testing.assert_allclose(y, np.where(keep, x / (1 - ratio), 0.0), rtol=1e-12)
    # Backward regenerates the same mask from the context alone (no bottom, no top).
    assert layer.backward_needs() == frozenset()
    dy = rng.standard_normal(x.shape)
    dx = np.full(x.shape, np.nan)
    layer.backward([None], [dy.copy()], [True], [None], [dx])
    np.testing.assert_allclose(dx, np.where(keep, dy / (1 - ratio), 0.0), rtol=1e-12)
    # Another iteration draws another mask.
    layer.ctx.iteration = 8
    (y8,) = forward(layer, [x.copy()], shapes)
    assert ((y8 == 0) != (y == 0)).any()
    check_gradients(proto, [x])


def test_dropout_in_place_float32_and_test_phase_identity():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 50)).astype(np.float32) + np.float32(0.1)
    proto = "type: 'Dropout' dropout_param { dropout_ratio: 0.5 }"
    layer, _ = make_layer(in_place(proto), [x.shape])
    buf = x.copy()
    layer.forward([buf], [buf])
    assert buf.dtype == np.float32
    keep = keep_mask(x.size, 0.5, 1234, 0, 0).reshape(x.shape)
    np.testing.assert_array_equal(buf, np.where(keep, x * np.float32(2.0), np.float32(0)))

    test_layer, shapes = make_layer(proto, [x.shape], phase=pb.TEST)
    (y,) = forward(test_layer, [x.copy()], shapes, dtype=np.float32)
    np.testing.assert_array_equal(y, x)
    dx = np.zeros_like(x)
    test_layer.backward([y], [x.copy()], [True], [x], [dx])
    np.testing.assert_array_equal(dx, x)


@pytest.mark.parametrize("ratio", [1.0, -0.1])
def test_dropout_rejects_ratio_outside_unit_interval(ratio):
    with pytest.raises(UserError, match=r"under_test.*dropout_ratio"):
        make_layer(f"type: 'Dropout' dropout_param {{ dropout_ratio: {ratio} }}", [(2, 3)])
