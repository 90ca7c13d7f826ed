"""Slice, Crop, Reshape, Tile and Silence (layers/shape_ops.py) on the CPU backend.

Every forward is compared with an independent float64 NumPy formula, every backward with central
differences (harness.check_gradients), on fresh random inputs.
"""
import numpy as np
import pytest
from harness import check_gradients, cpu_net, forward, make_layer

from superneurons.errors import UserError


def _tops(n):
    return " ".join(f"top: 't{i}'" for i in range(n))


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
    net = cpu_net("""
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
    net = cpu_net("""
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
