"""pycaffe's names beyond Net and Solver basics (superneurons/pycaffe): index-level Net names, callbacks, ranges'
return values, HDF5 weights under any name, solver update/lr/callbacks, the solver classes, errors that are
also pycaffe's built-in types, submodules, coord_map, Caffe's leniencies (automatic loss tops, share_with)."""
import importlib
import re
import textwrap

import numpy as np
import pytest

import superneurons as caffe
from superneurons.errors import UserError

MLP = """name: 'mlp' force_backward: true
input: 'data' input_shape { dim: 4 dim: 6 }
input: 'target' input_shape { dim: 4 dim: 3 }
layer { name: 'ip1' type: 'InnerProduct' bottom: 'data' top: 'ip1'
        inner_product_param { num_output: 5 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2'
        inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'ip2' bottom: 'target' top: 'loss' }
"""


@pytest.fixture
def files(tmp_path):
    caffe.set_mode_cpu()
    (tmp_path / "mlp.prototxt").write_text(MLP)
    (tmp_path / "solver.prototxt").write_text(textwrap.dedent(f"""\
        train_net: '{tmp_path / 'mlp.prototxt'}'
        test_net: '{tmp_path / 'mlp.prototxt'}'
        test_iter: 1 test_interval: 1000 test_initialization: false
        base_lr: 0.1 lr_policy: 'step' gamma: 0.5 stepsize: 2 momentum: 0 display: 0 max_iter: 4
        type: 'Nesterov'"""))
    return tmp_path


def _fed(net):
    rng = np.random.default_rng()
    net.blobs["data"].data[...] = rng.standard_normal((4, 6))
    net.blobs["target"].data[...] = rng.standard_normal((4, 3))
    return net


def test_index_names_ranges_and_backward_returns_the_end_layers_bottom_diffs(files):
    net = _fed(caffe.Net(str(files / "mlp.prototxt"), caffe.TRAIN))
    names = net._blob_names
    assert [names[i] for i in net._inputs] == ["data", "target"] and [names[i] for i in net._outputs] == ["loss"]
    i = net._layer_names.index("ip2")
    assert [names[k] for k in net._bottom_ids(i)] == ["ip1"] and [names[k] for k in net._top_ids(i)] == ["ip2"]
    assert net._blob_loss_weights[names.index("loss")] == 1 and len(net._blobs) == len(names)
    loss = net._forward(0, len(net.layers) - 1)
    assert loss == pytest.approx(float(net.blobs["loss"].data))
    dy = np.random.default_rng().standard_normal((4, 3)).astype(np.float32)
    net.blobs["ip2"].diff[...] = dy
    out = net.backward(start="ip2", end="ip2")
    assert set(out) == {"ip1"}  # pycaffe: the end layer's bottoms
    np.testing.assert_allclose(out["ip1"], dy @ net.params["ip2"][0].data, rtol=1e-5)
    seen = []
    net.before_forward(lambda k: seen.append(("f", net._layer_names[k])))
    net.after_backward(lambda k: seen.append(("b", net._layer_names[k])))
    net.forward()
    net.backward()
    assert [s for s in seen if s[0] == "f"] == [("f", n) for n in net._layer_names]
    assert ("b", "ip1") in seen and seen.index(("b", "ip2")) < seen.index(("b", "ip1"))
    assert np.abs(net.params["ip1"][0].diff).max() > 0
    net.clear_param_diffs()
    assert all(not np.any(p.diff) for ps in net.params.values() for p in ps)


def test_hdf5_weights_under_any_name(files):
    net = caffe.Net(str(files / "mlp.prototxt"), caffe.TRAIN)
    net.save_hdf5(str(files / "weights_without_extension"))
    other = caffe.Net(str(files / "mlp.prototxt"), caffe.TRAIN)
    other.load_hdf5(str(files / "weights_without_extension"))
    for name in net.params:
        for a, b in zip(net.params[name], other.params[name]):
            np.testing.assert_array_equal(a.data, b.data)


def test_solver_class_update_lr_and_callbacks(files):
    solver = caffe.get_solver(str(files / "solver.prototxt"))
    assert type(solver) is caffe.NesterovSolver and isinstance(solver, caffe.SGDSolver)
    assert solver.lr == pytest.approx(0.1)
    w = solver.net.params["ip2"][0]
    w.data[...] = 0
    w.diff[...] = 1
    solver.apply_update()
    np.testing.assert_allclose(w.data, -0.1, rtol=1e-6)  # Nesterov with momentum 0 is plain SGD
    assert solver.iter == 0
    calls = []
    solver.add_callback(lambda: calls.append("start"), lambda: calls.append("ready"))
    _fed(solver.net)
    solver.step(3)
    assert calls == ["start", "ready"] * 3 and solver.lr == pytest.approx(0.05)
    with pytest.raises(TypeError):
        solver.add_callback(object())
    solver.test_nets[0].share_with(solver.net)  # Caffe's pascal notebook does this: a no-op, they share already


def test_only_rank_0_tests_displays_and_snapshots(files):
    caffe.set_solver_count(2)
    caffe.set_solver_rank(1)
    try:
        follower = caffe.get_solver(str(files / "solver.prototxt"))
    finally:
        caffe.set_solver_count(1)
        caffe.set_solver_rank(0)
    assert follower.test_nets == [] and follower.param.snapshot == 0 and follower.param.display == 0
    assert len(caffe.get_solver(str(files / "solver.prototxt")).test_nets) == 1


def test_errors_are_also_pycaffes_builtin_types():
    blob = caffe.proto.caffe_pb2.BlobProto()
    blob.data.extend([1.0] * 4)
    blob.shape.dim.extend([3])
    with pytest.raises(ValueError):
        caffe.io.blobproto_to_array(blob)
    with pytest.raises(UserError):
        caffe.io.blobproto_to_array(blob)
    with pytest.raises(TypeError, match="phase must be caffe.TRAIN or caffe.TEST"):  # Boost's ArgumentError in pycaffe
        caffe.Net("any.prototxt", "TRAIN")
    with pytest.raises(TypeError, match="input 0 is not a Top"):
        caffe.layers.Silence(caffe.layers.DummyData(ntop=2), ntop=0)


def test_names_and_submodules():
    for name in ("draw", "net_spec", "classifier", "detector", "coord_map", "proto"):
        module = importlib.import_module(f"superneurons.{name}")
        assert getattr(caffe, name) is module
    assert importlib.import_module("superneurons.draw") is importlib.import_module("superneurons.pycaffe.draw")
    assert {"Python", "Convolution", "Data"} <= set(caffe.layer_type_list())
    caffe.set_solver_count(2)
    caffe.set_solver_rank(1)
    assert (caffe.solver_count(), caffe.solver_rank()) == (2, 1)
    caffe.set_solver_count(1)
    caffe.set_solver_rank(0)
    timer = caffe.Timer()
    timer.start()
    timer.stop()
    assert timer.ms >= 0
    assert isinstance(caffe.has_nccl(), bool)
    draw = caffe.draw
    conv = caffe.proto.caffe_pb2.LayerParameter(name="c", type="Convolution")
    conv.param.add(lr_mult=2)
    assert draw.get_layer_lr_mult(conv) == (2.0, 1.0) and draw.get_pooling_types_dict()[1] == "AVE"
    with pytest.raises(ValueError):
        draw.get_layer_lr_mult(caffe.proto.caffe_pb2.LayerParameter(type="ReLU"))
    assert draw.get_layer_label(conv, "TB").startswith("c (Convolution)") and draw.get_edge_label(conv) == "0"
    assert draw.choose_color_by_layertype("Convolution") != draw.choose_color_by_layertype("ReLU")


def test_log_writes_a_glog_line(capsys):
    caffe.init_log()
    caffe.log("hello from a script")
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r"I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ test_pycaffe_api\.py:\d+\] hello from a script", line)


def test_coord_map_composes_window_arithmetic():
    from superneurons.coord_map import coord_map_from_to, crop

    L, P = caffe.layers, caffe.params
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 1, 64, 64]))
    n.conv = L.Convolution(n.data, num_output=2, kernel_size=5, stride=2, pad=1)  # x -> (x + 1 - 2) / 2
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=3, stride=3)  # y -> (y - 1) / 3
    n.up = L.Deconvolution(n.pool, num_output=2, kernel_size=12, stride=6, pad=2)  # z -> 6 z + 5.5 - 2
    # Each map is top = a * bottom + b: conv x / 2 + (1 - 2) / 2, pool y / 3 + (0 - 1) / 3, deconv 6 z + (5.5 - 2).
    up_of_x = 6 * ((-0.5) / 3 - 1 / 3) + 3.5  # up = x + up_of_x
    ax, a, b = coord_map_from_to(n.up, n.data)
    assert (ax, a, b) == (1, 1.0, -up_of_x)
    n.relu = L.ReLU(n.up)
    assert coord_map_from_to(n.relu, n.data) == (ax, a, b)
    n.ip = L.InnerProduct(n.up, num_output=3)
    with pytest.raises(RuntimeError):
        coord_map_from_to(n.ip, n.data)
    with pytest.raises(AssertionError):
        crop(n.up, n.data)  # the offset is fractional
    n2 = caffe.NetSpec()
    n2.data = L.Input(shape=dict(dim=[1, 1, 64, 64]))
    n2.conv = L.Convolution(n2.data, num_output=2, kernel_size=3, pad=5)  # conv = x + 4
    n2.crop = crop(n2.conv, n2.data)
    layer = n2.to_proto().layer[-1]
    assert (layer.type, layer.crop_param.axis, list(layer.crop_param.offset)) == ("Crop", 2, [4])


def test_loss_layer_without_top_gets_an_automatic_one(tmp_path):
    caffe.set_mode_cpu()
    path = tmp_path / "v1.prototxt"
    path.write_text("""name: 'v1'
    layers { name: 'data' type: DUMMY_DATA top: 'data' top: 'label'
      dummy_data_param { num: 4 channels: 3 height: 1 width: 1 num: 4 channels: 1 height: 1 width: 1 } }
    layers { name: 'ip' type: INNER_PRODUCT bottom: 'data' top: 'ip' inner_product_param { num_output: 2 } }
    layers { name: 'loss' type: SOFTMAX_LOSS bottom: 'ip' bottom: 'label' }
    """)
    net = caffe.Net(str(path), caffe.TRAIN)
    assert net.outputs == ["loss (automatic)"] and net.blob_loss_weights["loss (automatic)"] == 1
    # all-zero inputs and weights: the loss of a uniform softmax over 2 classes
    assert float(net.forward()["loss (automatic)"]) == pytest.approx(np.log(2), rel=1e-6)
