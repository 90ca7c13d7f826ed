"""The ReLU layer (layers/activations.py), with and without a negative slope, against NumPy and central differences."""
import numpy as np
from harness import check_gradients, forward, make_layer


def test_relu_matches_reference_and_gradient():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 5))
    for slope in (0.0, 0.1):
        layer, shapes = make_layer(f"type: 'ReLU' relu_param {{ negative_slope: {slope} }}", [x.shape])
        (y,) = forward(layer, [x.copy()], shapes)
        np.testing.assert_allclose(y, np.where(x > 0, x, slope * x))
        check_gradients(f"type: 'ReLU' relu_param {{ negative_slope: {slope} }}", [x])
