"""The Split layer (layers/split.py)."""
import numpy as np
from harness import _numeric, forward, make_layer


def test_split_sums_diffs_and_copies_when_asked():
    rng = np.random.default_rng(70)
    x = rng.standard_normal((2, 3))
    layer, shapes = make_layer("type: 'Split' top: 'a' top: 'b' top: 'c'", [x.shape])
    assert shapes == [x.shape] * 3 and layer.backward_needs() == frozenset()
    layer.copy_data = True  # the graph sets this when a consumer works in place on a top
    tops = forward(layer, [x.copy()], shapes)
    for t in tops:
        np.testing.assert_array_equal(t, x)
    weights = [rng.standard_normal(x.shape) for _ in range(3)]
    dx = np.zeros_like(x)
    layer.backward(tops, [w.copy() for w in weights], [True], [x], [dx])
    np.testing.assert_allclose(dx, weights[0] + weights[1] + weights[2], rtol=1e-14)

    def objective():
        return sum(float((t * w).sum()) for t, w in zip(forward(layer, [x], shapes), weights))

    np.testing.assert_allclose(dx, _numeric(objective, x, 1e-6), rtol=1e-6, atol=1e-8)
