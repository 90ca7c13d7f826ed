"""The Embed layer (layers/embed.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, forward, make_layer

from superneurons.errors import UserError


@pytest.mark.parametrize("bias", [True, False])
def test_embed_reference_and_gradient(bias):
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
