"""V0/V1 -> current net upgrades, solver_type upgrade, and `superneurons convert` on files."""
from __future__ import annotations

import re

import pytest
from google.protobuf import text_format

from superneurons.cli import main
from superneurons.errors import UserError
from superneurons.io.prototxt import parse_text, read_binary, read_net, read_solver
from superneurons.io.upgrade import V0_FIELDS, V1_PARAM_SPEC_FIELDS, V1_TYPE_NAMES, upgrade_net, upgrade_solver
from superneurons.proto import superneurons_pb2 as pb

V1_CONV = """
name: "v1net"
layers {
  name: "conv1"
  type: CONVOLUTION
  bottom: "data"
  top: "conv1"
  blobs_lr: 1
  blobs_lr: 2
  weight_decay: 1
  weight_decay: 0
  param: "conv1_w"
  param: "conv1_b"
  blob_share_mode: PERMISSIVE
  loss_weight: 0.5
  include { phase: TRAIN }
  convolution_param {
    num_output: 96
    kernel_size: 11
    stride: 4
    weight_filler { type: "gaussian" std: 0.01 }
    bias_filler { type: "constant" value: 0 }
  }
}
layers { name: "loss" type: SOFTMAX_LOSS bottom: "conv1" bottom: "label" top: "loss" }
"""

V1_DATA = """
layers {
  name: "data"
  type: DATA
  top: "data"
  top: "label"
  data_param {
    source: "train_lmdb"
    backend: LMDB
    batch_size: 64
    scale: 0.00390625
    mean_file: "mean.binaryproto"
    crop_size: 227
    mirror: true
  }
}
"""

DEPLOY_HEADER = """
name: "deploy"
input: "data"
input_dim: 10
input_dim: 3
input_dim: 227
input_dim: 227
layers { name: "relu" type: RELU bottom: "data" top: "data" }
"""


def net_from(text: str) -> pb.NetParameter:
    return parse_text(text, pb.NetParameter())


def upgraded(text: str, path: str = "<test>") -> tuple[pb.NetParameter, list[str]]:
    notes: list[str] = []
    return upgrade_net(net_from(text), path, notes), notes


# ---- V1 -> current --------------------------------------------------------------------------

def test_v1_convolution_field_by_field():
    net, notes = upgraded(V1_CONV)
    assert len(net.layers) == 0 and len(net.layer) == 2
    conv = net.layer[0]
    assert conv.name == "conv1" and conv.type == "Convolution"
    assert list(conv.bottom) == ["data"] and list(conv.top) == ["conv1"]
    assert [(p.name, p.lr_mult, p.decay_mult) for p in conv.param] == [("conv1_w", 1, 1), ("conv1_b", 2, 0)]
    assert conv.param[0].share_mode == pb.ParamSpec.PERMISSIVE
    assert not conv.param[1].HasField("share_mode")  # only one blob_share_mode was given
    assert list(conv.loss_weight) == [0.5]
    assert [r.phase for r in conv.include] == [pb.TRAIN]
    cp = conv.convolution_param
    assert (cp.num_output, list(cp.kernel_size), list(cp.stride)) == (96, [11], [4])
    assert cp.weight_filler.type == "gaussian" and cp.weight_filler.std == pytest.approx(0.01)
    assert cp.bias_filler.type == "constant"
    assert net.layer[1].type == "SoftmaxWithLoss" and list(net.layer[1].bottom) == ["conv1", "label"]
    assert net.name == "v1net"
    assert notes == ["upgraded 2 V1 layers to the current format"]


def test_v1_layer_without_blobs_lr_gets_no_param_specs():
    net, _ = upgraded('layers { name: "r" type: RELU bottom: "x" top: "x" relu_param { negative_slope: 0.1 } }')
    assert len(net.layer[0].param) == 0
    assert net.layer[0].relu_param.negative_slope == pytest.approx(0.1)


def test_v1_type_table_covers_every_enum_value():
    enum_names = set(pb.V1LayerParameter.LayerType.keys()) - {"NONE"}
    assert set(V1_TYPE_NAMES) == enum_names
    assert V1_TYPE_NAMES["SOFTMAX_LOSS"] == "SoftmaxWithLoss"
    assert V1_TYPE_NAMES["INNER_PRODUCT"] == "InnerProduct"
    assert V1_TYPE_NAMES["TANH"] == "TanH"
    assert V1_TYPE_NAMES["HDF5_DATA"] == "HDF5Data"


@pytest.mark.parametrize("enum_name", sorted(V1_TYPE_NAMES))
def test_every_v1_type_upgrades(enum_name):
    net, _ = upgraded(f'layers {{ name: "l" type: {enum_name} }}')
    assert net.layer[0].type == V1_TYPE_NAMES[enum_name]


def test_every_v1_field_has_a_home_in_the_current_layer():
    current = pb.LayerParameter.DESCRIPTOR.fields_by_name
    handled = set(V1_PARAM_SPEC_FIELDS) | {"type", "layer"}
    for name, field in pb.V1LayerParameter.DESCRIPTOR.fields_by_name.items():
        if name in handled:
            continue
        assert name in current, name
        assert (current[name].type, current[name].message_type) == (field.type, field.message_type), name


def test_v1_every_param_message_is_copied():
    # One layer carrying several *_param messages: each must land in the same-named field.
    net, _ = upgraded("""layers { name: "l" type: POOLING
        pooling_param { pool: AVE kernel_size: 3 } lrn_param { local_size: 3 } dropout_param { dropout_ratio: 0.3 }
        transform_param { mirror: true } loss_param { ignore_label: 7 } }""")
    layer = net.layer[0]
    assert layer.pooling_param.pool == pb.PoolingParameter.AVE and layer.pooling_param.kernel_size == 3
    assert layer.lrn_param.local_size == 3
    assert layer.dropout_param.dropout_ratio == pytest.approx(0.3)
    assert layer.transform_param.mirror and layer.loss_param.ignore_label == 7


def test_v1_data_transform_fields_move_to_transform_param():
    net, notes = upgraded(V1_DATA)
    layer = net.layer[0]
    assert layer.type == "Data"
    t = layer.transform_param
    assert t.scale == pytest.approx(0.00390625)
    assert (t.mean_file, t.crop_size, t.mirror) == ("mean.binaryproto", 227, True)
    d = layer.data_param
    for old in ("scale", "mean_file", "crop_size", "mirror"):
        assert not d.HasField(old), old
    assert (d.source, d.batch_size, d.backend) == ("train_lmdb", 64, pb.DataParameter.LMDB)
    assert any("transform_param" in n and "scale" in n for n in notes)


def test_current_format_data_layer_old_fields_move_too():
    net, _ = upgraded('layer { name: "d" type: "ImageData" top: "d" top: "l" '
                      'image_data_param { source: "list.txt" crop_size: 32 } transform_param { mirror: true } }')
    layer = net.layer[0]
    assert layer.transform_param.crop_size == 32 and layer.transform_param.mirror
    assert not layer.image_data_param.HasField("crop_size")


def test_conflicting_transform_fields_are_an_error():
    with pytest.raises(UserError, match=r"data_param\.crop_size.*transform_param\.crop_size"):
        upgraded('layer { name: "d" type: "Data" data_param { crop_size: 32 } transform_param { crop_size: 28 } }')


# ---- net-level inputs -------------------------------------------------------------------------

def test_input_dim_becomes_an_input_layer_first():
    net, notes = upgraded(DEPLOY_HEADER)
    assert not net.input and not net.input_dim and not net.input_shape
    first = net.layer[0]
    assert (first.name, first.type, list(first.top)) == ("input", "Input", ["data"])
    assert [list(s.dim) for s in first.input_param.shape] == [[10, 3, 227, 227]]
    assert net.layer[1].type == "ReLU"
    assert any("input_dim" in n and "10 3 227 227" in n for n in notes)


def test_input_shape_with_two_inputs():
    net, _ = upgraded("""input: "a" input_shape { dim: 2 dim: 3 } input: "b" input_shape { dim: 2 }
        layer { name: "input" type: "ReLU" bottom: "a" top: "c" }""")
    first = net.layer[0]
    assert first.name == "input_1"  # "input" is taken by a layer of the net
    assert list(first.top) == ["a", "b"]
    assert [list(s.dim) for s in first.input_param.shape] == [[2, 3], [2]]


@pytest.mark.parametrize("header, message", [
    ('input: "a" input_dim: 1 input_dim: 2', r"need 4 input_dim values"),
    ('input: "a" input: "b" input_shape { dim: 1 }', r"2 input name\(s\) but 1 input_shape"),
    ('input: "a" input_shape { dim: 1 } input_dim: 1 input_dim: 1 input_dim: 1 input_dim: 1',
     r"both input_shape and input_dim"),
])
def test_bad_input_declarations(header, message):
    with pytest.raises(UserError, match=message):
        upgraded(header, "deploy.prototxt")


def test_input_names_without_shapes_are_dropped():
    # Old .caffemodel files name their inputs but carry no shapes; the deploy prototxt has them.
    net, notes = upgraded('input: "data" layer { name: "r" type: "ReLU" bottom: "data" top: "data" }')
    assert not net.input and [l.name for l in net.layer] == ["r"]
    assert notes and "dropped" in notes[0]


# ---- V0 -> V1 -> current ----------------------------------------------------------------------

V0_NET = """
name: "v0"
input: "data"
input_dim: 1 input_dim: 3 input_dim: 32 input_dim: 32
layers { layer { name: "pad1" type: "padding" pad: 2 } bottom: "data" top: "pad1" }
layers {
  layer { name: "conv1" type: "conv" num_output: 16 kernelsize: 5 stride: 1 biasterm: false
          weight_filler { type: "xavier" } blobs_lr: 1 weight_decay: 1 }
  bottom: "pad1" top: "conv1"
}
layers { layer { name: "pool1" type: "pool" pool: AVE kernelsize: 3 stride: 2 } bottom: "conv1" top: "pool1" }
layers { layer { name: "norm1" type: "lrn" local_size: 3 alpha: 0.5 beta: 0.25 } bottom: "pool1" top: "norm1" }
layers { layer { name: "ip" type: "innerproduct" num_output: 10 } bottom: "norm1" top: "ip" }
layers { layer { name: "loss" type: "softmax_loss" } bottom: "ip" bottom: "label" top: "loss" }
"""


def test_v0_net_upgrades_to_current():
    net, notes = upgraded(V0_NET)
    assert [(l.name, l.type) for l in net.layer] == [
        ("input", "Input"), ("conv1", "Convolution"), ("pool1", "Pooling"), ("norm1", "LRN"),
        ("ip", "InnerProduct"), ("loss", "SoftmaxWithLoss")]
    conv = net.layer[1]
    # The padding layer is gone: the conv reads the input directly and pads by itself.
    assert list(conv.bottom) == ["data"]
    cp = conv.convolution_param
    assert (cp.num_output, list(cp.kernel_size), list(cp.stride), list(cp.pad)) == (16, [5], [1], [2])
    assert cp.bias_term is False
    assert cp.weight_filler.type == "xavier"
    assert [(p.lr_mult, p.decay_mult) for p in conv.param] == [(1, 1)]
    pool = net.layer[2].pooling_param
    assert (pool.pool, pool.kernel_size, pool.stride) == (pb.PoolingParameter.AVE, 3, 2)
    lrn = net.layer[3].lrn_param
    assert (lrn.local_size, lrn.alpha, lrn.beta) == (3, 0.5, 0.25)
    assert net.layer[4].inner_product_param.num_output == 10
    assert notes[0] == "upgraded 5 V0 layers to V1 (folded 1 padding layer(s) into the following convolution)"


def test_v0_data_layer_fields():
    net, _ = upgraded("""layers { layer { name: "d" type: "data" source: "db" batchsize: 32 scale: 0.5
        meanfile: "m.binaryproto" cropsize: 24 mirror: true rand_skip: 5 } top: "data" top: "label" }""")
    layer = net.layer[0]
    assert layer.type == "Data"
    assert (layer.data_param.source, layer.data_param.batch_size, layer.data_param.rand_skip) == ("db", 32, 5)
    t = layer.transform_param
    assert (t.scale, t.mean_file, t.crop_size, t.mirror) == (0.5, "m.binaryproto", 24, True)


def test_v0_field_table_only_names_real_fields():
    v0_fields = set(pb.V0LayerParameter.DESCRIPTOR.fields_by_name) - {"name", "type"}
    assert set(V0_FIELDS) <= v0_fields


def test_v0_unknown_type_names_file_line_and_layer(tmp_path):
    path = tmp_path / "v0.prototxt"
    path.write_text('name: "x"\nlayers {\n  layer {\n    name: "weird"\n    type: "frobnicate"\n  }\n}\n')
    with pytest.raises(UserError, match=r"v0\.prototxt:4: layer 'weird': unknown V0 layer type 'frobnicate'"):
        read_net(str(path))


def test_v0_field_used_by_the_wrong_type():
    with pytest.raises(UserError, match=r"'kernelsize' has no meaning for a 'relu' layer"):
        upgraded('layers { layer { name: "r" type: "relu" kernelsize: 3 } bottom: "x" top: "y" }')


def test_v0_padding_into_a_non_conv_is_an_error():
    with pytest.raises(UserError, match="only a conv layer can absorb padding"):
        upgraded('layers { layer { name: "p" type: "padding" pad: 1 } bottom: "x" top: "px" } '
                 'layers { layer { name: "r" type: "relu" } bottom: "px" top: "y" }')


# ---- general rules --------------------------------------------------------------------------

def test_mixing_layer_and_layers_is_an_error():
    with pytest.raises(UserError, match="mixes current 'layer"):
        upgraded('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }', "mixed.prototxt")


def test_upgrade_is_pure_and_current_nets_pass_through():
    original = net_from(V1_CONV)
    before = original.SerializeToString()
    upgrade_net(original, "<test>")
    assert original.SerializeToString() == before
    current = net_from('layer { name: "r" type: "ReLU" bottom: "x" top: "x" }')
    notes: list[str] = []
    assert upgrade_net(current, "<test>", notes) is current and notes == []


def test_fork_ceil_mode_becomes_round_mode():
    net, notes = upgraded('layer { name: "p" type: "Pooling" pooling_param { kernel_size: 3 ceil_mode: false } }')
    pool = net.layer[0].pooling_param
    assert pool.round_mode == pb.PoolingParameter.FLOOR and not pool.HasField("ceil_mode")
    assert "p (FLOOR)" in notes[0]
    with pytest.raises(UserError, match="contradicts round_mode"):
        upgraded('layer { name: "p" type: "Pooling" pooling_param { ceil_mode: true round_mode: FLOOR } }')


def test_read_net_upgrades_v1_files(tmp_path):
    path = tmp_path / "v1.prototxt"
    path.write_text(DEPLOY_HEADER)
    net = read_net(str(path))
    assert [l.type for l in net.layer] == ["Input", "ReLU"]


# ---- solvers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("old, new", [("SGD", "SGD"), ("NESTEROV", "Nesterov"), ("ADAGRAD", "AdaGrad"),
                                      ("RMSPROP", "RMSProp"), ("ADADELTA", "AdaDelta"), ("ADAM", "Adam")])
def test_solver_type_becomes_type_string(old, new):
    notes: list[str] = []
    solver = upgrade_solver(parse_text(f"base_lr: 0.01 momentum: 0.9 solver_type: {old}", pb.SolverParameter()),
                            "s.prototxt", notes)
    assert solver.type == new and not solver.HasField("solver_type")
    assert solver.base_lr == pytest.approx(0.01) and solver.momentum == pytest.approx(0.9)
    assert notes == [f"solver_type: {old} -> type: {new!r}"]


def test_solver_type_and_type_disagreeing_is_an_error():
    with pytest.raises(UserError, match=r"s\.prototxt: solver_type: ADAM and type: 'SGD' disagree"):
        upgrade_solver(parse_text('solver_type: ADAM type: "SGD"', pb.SolverParameter()), "s.prototxt")


def test_current_solver_passes_through_and_inline_nets_upgrade():
    current = parse_text('type: "Adam" base_lr: 0.001', pb.SolverParameter())
    assert upgrade_solver(current, "s") is current
    notes: list[str] = []
    solver = upgrade_solver(parse_text('net_param { layers { name: "r" type: RELU } }', pb.SolverParameter()),
                            "s", notes)
    assert solver.net_param.layer[0].type == "ReLU" and not solver.net_param.layers
    assert notes == ["net_param: upgraded 1 V1 layers to the current format"]


def test_read_solver_upgrades(tmp_path):
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "n.prototxt"\nsolver_type: NESTEROV\n')
    assert read_solver(str(path)).type == "Nesterov"


# ---- superneurons convert ---------------------------------------------------------------------

def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["convert", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_convert_v1_text_net(tmp_path, capsys):
    src, dst = tmp_path / "old.prototxt", tmp_path / "new.prototxt"
    src.write_text(DEPLOY_HEADER + V1_CONV.replace('name: "v1net"', ""))
    rc, out, _ = run_cli(capsys, str(src), str(dst))
    assert rc == 0
    assert "upgraded 3 V1 layers" in out and "Input layer" in out
    net = parse_text(dst.read_text(), pb.NetParameter())  # current format: `layer`, no `layers`, no inputs
    assert not net.layers and not net.input and not net.input_dim
    assert [l.type for l in net.layer] == ["Input", "ReLU", "Convolution", "SoftmaxWithLoss"]
    assert upgrade_net(net) is net  # nothing left to upgrade


def test_convert_solver(tmp_path, capsys):
    src, dst = tmp_path / "solver.prototxt", tmp_path / "out.prototxt"
    src.write_text('net: "train_val.prototxt"\nbase_lr: 0.01\nsolver_type: ADAGRAD\n')
    rc, out, _ = run_cli(capsys, str(src), str(dst))
    assert rc == 0 and "type: 'AdaGrad'" in out
    solver = parse_text(dst.read_text(), pb.SolverParameter())
    assert solver.type == "AdaGrad" and solver.net == "train_val.prototxt" and not solver.HasField("solver_type")


def test_convert_current_file_says_so(tmp_path, capsys):
    src, dst = tmp_path / "net.prototxt", tmp_path / "out.prototxt"
    src.write_text('layer { name: "r" type: "ReLU" bottom: "x" top: "x" }\n')
    rc, out, _ = run_cli(capsys, str(src), str(dst))
    assert rc == 0 and "already in the current format" in out
    assert parse_text(dst.read_text(), pb.NetParameter()).layer[0].name == "r"


def v1_caffemodel() -> pb.NetParameter:
    """A V1 binary net as old Caffe wrote it: legacy 4-D blob dims, blobs_lr, enum types."""
    net = pb.NetParameter(name="tiny")
    conv = net.layers.add(name="conv1", type=pb.V1LayerParameter.CONVOLUTION)
    conv.bottom.append("data")
    conv.top.append("conv1")
    conv.blobs_lr.extend([1, 2])
    weight = conv.blobs.add(num=2, channels=1, height=2, width=2)
    weight.data.extend([0.5, -1.25, 3.0, 4.5, 0.0, 1.0, -2.0, 8.0])
    bias = conv.blobs.add(num=1, channels=1, height=1, width=2)
    bias.data.extend([0.25, -0.75])
    conv.convolution_param.num_output = 2
    conv.convolution_param.kernel_size.append(2)
    return net


@pytest.mark.parametrize("filename", ["old.caffemodel", "old.bin"])  # binary found by extension or by content
def test_convert_v1_caffemodel_keeps_blobs(tmp_path, capsys, filename):
    src, dst = tmp_path / filename, tmp_path / "new.caffemodel"
    original = v1_caffemodel()
    src.write_bytes(original.SerializeToString())
    rc, out, _ = run_cli(capsys, str(src), str(dst))
    assert rc == 0 and "upgraded 1 V1 layers" in out and "binary caffemodel" in out
    net = read_binary(str(dst), pb.NetParameter())
    assert not net.layers and net.name == "tiny"
    conv = net.layer[0]
    assert (conv.name, conv.type) == ("conv1", "Convolution")
    assert [p.lr_mult for p in conv.param] == [1, 2]
    assert len(conv.blobs) == 2
    for new, old in zip(conv.blobs, original.layers[0].blobs):
        assert list(new.data) == list(old.data)
        assert (new.num, new.channels, new.height, new.width) == (old.num, old.channels, old.height, old.width)


def test_convert_caffemodel_to_text(tmp_path, capsys):
    src, dst = tmp_path / "old.caffemodel", tmp_path / "new.prototxt"
    src.write_bytes(v1_caffemodel().SerializeToString())
    rc, _, _ = run_cli(capsys, "--text", str(src), str(dst))
    assert rc == 0
    net = text_format.Parse(dst.read_text(), pb.NetParameter())
    assert list(net.layer[0].blobs[1].data) == [0.25, -0.75]


def test_convert_malformed_prototxt_is_one_line_with_position(tmp_path, capsys):
    src = tmp_path / "bad.prototxt"
    src.write_text('name: "x"\nlayer {\n  name: "a"\n  tpye: "ReLU"\n}\n')
    rc, out, err = run_cli(capsys, str(src), str(tmp_path / "out.prototxt"))
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert re.search(r"bad\.prototxt:4:3: .*tpye", lines[0]), lines[0]
    assert not (tmp_path / "out.prototxt").exists()


def test_convert_malformed_solver_reports_the_solver_error(tmp_path, capsys):
    # Parses further as a solver than as a net, so the solver's error is the one shown.
    src = tmp_path / "solver.prototxt"
    src.write_text('base_lr: 0.01\nmax_iter: lots\n')
    rc, _, err = run_cli(capsys, str(src), str(tmp_path / "out.prototxt"))
    assert rc == 1 and re.search(r"solver\.prototxt:2:\d+: .*lots", err), err


@pytest.mark.parametrize("content, message", [
    (b"", "empty"),
    (b"\x0a\xff\xff\xff\xff\x0f", "not a valid NetParameter"),  # binary garbage
])
def test_convert_unusable_inputs(tmp_path, capsys, content, message):
    src = tmp_path / "in.caffemodel" if content else tmp_path / "in.prototxt"
    src.write_bytes(content)
    rc, _, err = run_cli(capsys, str(src), str(tmp_path / "out"))
    assert rc == 1 and message in err and len(err.strip().splitlines()) == 1


def test_convert_missing_input(tmp_path, capsys):
    rc, _, err = run_cli(capsys, str(tmp_path / "nope.prototxt"), str(tmp_path / "out"))
    assert rc == 1 and "no such file" in err


def test_convert_help_has_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "superneurons convert" in out and ".caffemodel" in out


def test_v1_caffemodel_loads_into_a_net(tmp_path):
    # A V1 file keeps weights in `layers` with legacy 4-D dims (an InnerProduct weight is 1 x 1 x out x in).
    import numpy as np

    from superneurons.backend.cpu import CpuBackend
    from superneurons.graph.build import build_graph
    from superneurons.io.caffemodel import load_weights
    from superneurons.runtime.net import Net

    prototxt = ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } } '
                'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }')
    net = Net(build_graph(parse_text(prototxt, pb.NetParameter()), pb.TEST), CpuBackend(), train=False, seed=0)
    old = pb.NetParameter()
    ip = old.layers.add(name="ip", type=pb.V1LayerParameter.INNER_PRODUCT)
    ip.blobs.add(num=1, channels=1, height=2, width=3).data.extend([1, 2, 3, 4, 5, 6])
    ip.blobs.add(num=1, channels=1, height=1, width=2).data.extend([-1, -2])
    path = tmp_path / "v1.caffemodel"
    path.write_bytes(old.SerializeToString())
    report = load_weights(net, str(path))
    assert report.copied == ["ip"] and report.missing == []
    weight, bias = (np.asarray(d.data) for d in net.graph.node("ip").layer.params)
    np.testing.assert_array_equal(weight, [[1, 2, 3], [4, 5, 6]])
    np.testing.assert_array_equal(bias, [-1, -2])
