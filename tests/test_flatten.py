"""The Flatten layer (layers/flatten.py): shapes, and top and diff as views in a Net."""
import numpy as np
import pytest
from harness import cpu_net, make_layer

from superneurons.errors import UserError


def test_flatten_shapes():
    cases = {
        "": (2, 60),
        "flatten_param { axis: 2 }": (2, 3, 20),
        "flatten_param { axis: 1 end_axis: 2 }": (2, 12, 5),
        "flatten_param { axis: -3 end_axis: -2 }": (2, 12, 5),
        "flatten_param { axis: 0 }": (120,),
        "flatten_param { axis: 3 }": (2, 3, 4, 5),
    }
    for extra, want in cases.items():
        layer, shapes = make_layer(f"type: 'Flatten' {extra}", [(2, 3, 4, 5)])
        assert shapes == [want], extra
        assert layer.shares_data and layer.shares_diff and layer.backward_needs() == frozenset()
    with pytest.raises(UserError, match=r"end_axis 1 \(axis 1\) comes before axis 2"):
        make_layer("type: 'Flatten' flatten_param { axis: 2 end_axis: 1 }", [(2, 3, 4, 5)])
    with pytest.raises(UserError, match="axis 4 out of range for a 4-D blob"):
        make_layer("type: 'Flatten' flatten_param { axis: 4 }", [(2, 3, 4, 5)])


def test_flatten_top_and_diff_are_views_in_a_net():
    net = cpu_net("""
    force_backward: true
    layer { name: 'in' type: 'Input' top: 'x' top: 'w'
            input_param { shape { dim: 2 dim: 3 dim: 4 } shape { dim: 2 dim: 12 } } }
    layer { name: 'flat' type: 'Flatten' bottom: 'x' top: 'xf' }
    layer { name: 'prod' type: 'Eltwise' bottom: 'xf' bottom: 'w' top: 'loss'
            eltwise_param { operation: PROD } loss_weight: 1 }
    """)
    rng = np.random.default_rng(30)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    w = rng.standard_normal((2, 12)).astype(np.float32)
    net.data["x"].array[...] = x
    net.data["w"].array[...] = w
    assert net.data["xf"].array.shape == (2, 12)
    assert np.shares_memory(net.data["xf"].array, net.data["x"].array)
    loss = net.forward()
    np.testing.assert_allclose(loss, float((x.reshape(2, 12) * w).sum()), rtol=1e-5)
    net.backward()
    np.testing.assert_array_equal(net.diff["x"].array, w.reshape(2, 3, 4))
