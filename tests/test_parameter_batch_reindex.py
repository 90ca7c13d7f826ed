"""Parameter and BatchReindex (layers/parameter.py, layers/batch_reindex.py) on the CPU backend: forward
against NumPy, backward against central differences on fresh random inputs, and both inside a training net."""
import numpy as np
import pytest
from harness import check_gradients, cpu_net, forward, make_layer

from superneurons.errors import UserError


def test_parameter_is_its_blob_and_learns_from_its_top(rng):
    proto = "type: 'Parameter' parameter_param { shape { dim: 2 dim: 3 } }"
    layer, shapes = make_layer(proto, [], rng=rng)
    assert shapes == [(2, 3)] and [p.shape for p in layer.params] == [(2, 3)]
    (y,) = forward(layer, [], shapes)
    np.testing.assert_array_equal(y, layer.params[0].data)
    check_gradients(proto, [])
    with pytest.raises(UserError, match=r"'under_test' \(Parameter\): parameter_param.shape \[2, 0\]"):
        make_layer("type: 'Parameter' parameter_param { shape { dim: 2 dim: 0 } }", [])


def test_parameter_starts_at_zero_and_trains_in_a_net(rng):
    net = cpu_net("""
        layer { name: 'p' type: 'Parameter' top: 'p' parameter_param { shape { dim: 4 dim: 3 } } }
        layer { name: 'target' type: 'DummyData' top: 'target'
                dummy_data_param { shape { dim: 4 dim: 3 } data_filler { type: 'constant' value: 0.5 } } }
        layer { name: 'loss' type: 'EuclideanLoss' bottom: 'p' bottom: 'target' top: 'loss' }""")
    blob = net.layer("p").params[0]
    np.testing.assert_array_equal(net.backend.to_host(blob.data), 0)
    net.clear_param_diffs()
    loss = net.forward_backward()
    assert loss == pytest.approx(0.5 * 12 * 0.25 / 4)
    # dLoss/dp = (p - target) / N
    np.testing.assert_allclose(net.backend.to_host(blob.diff), -0.5 / 4)


def test_batch_reindex_reference_and_gradient(rng):
    x = rng.standard_normal((4, 2, 3))
    idx = np.array([3.0, 0.0, 3.0, 1.0, 3.0])  # row 3 three times (its gradients add), row 2 never
    proto = "type: 'BatchReindex'"
    layer, shapes = make_layer(proto, [x.shape, idx.shape])
    assert shapes == [(5, 2, 3)] and layer.label_bottoms == (1,)
    (y,) = forward(layer, [x, idx], shapes)
    np.testing.assert_array_equal(y, x[idx.astype(int)])
    check_gradients(proto, [x, idx], check_bottoms=[0])


def test_batch_reindex_refuses_bad_indices_and_shapes():
    layer, shapes = make_layer("type: 'BatchReindex'", [(3, 2), (2,)])
    with pytest.raises(UserError, match=r"'under_test' \(BatchReindex\): 1 index value\(s\) not an integer in "
                                        r"\[0, 3\), e\.g\. 3 in bottom 'b1' \(the batch has 3 items\)"):
        forward(layer, [np.zeros((3, 2)), np.array([0.0, 3.0])], shapes)
    with pytest.raises(UserError, match=r"bottom 1 \(the indices\) must be 1-D, got 2-D \(2, 1\)"):
        make_layer("type: 'BatchReindex'", [(3, 2), (2, 1)])
