"""The InnerProduct layer (layers/inner_product.py) against a float64 NumPy product and central differences."""
import numpy as np
from harness import check_gradients, forward, make_layer


def test_inner_product_reference_and_gradient():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 2, 2))
    for transpose in ("false", "true"):
        proto = f"type: 'InnerProduct' inner_product_param {{ num_output: 5 transpose: {transpose} }}"
        layer, shapes = make_layer(proto, [x.shape])
        assert shapes == [(4, 5)]
        (y,) = forward(layer, [x.copy()], shapes)
        w, b = layer.params[0].data, layer.params[1].data
        w_nk = w.T if transpose == "true" else w
        np.testing.assert_allclose(y, x.reshape(4, 12) @ w_nk.T + b, rtol=1e-12)
        check_gradients(proto, [x])
