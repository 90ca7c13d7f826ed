"""The MVN layer (layers/mvn.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.layers.base import NEEDS_TOP


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
