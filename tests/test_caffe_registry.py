"""Every layer type BVLC Caffe registers (REGISTER_LAYER_CLASS / REGISTER_LAYER_CREATOR at its last commit) is a
registered type here, and `superneurons summary` builds a net of each type added for that; the V1 enum names
that map to them convert."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from test_window_data import write_images, write_window_file

from superneurons.cli import main
from superneurons.io.upgrade import upgrade_net
from superneurons.layers.base import known_types
from superneurons.proto import superneurons_pb2 as pb

CAFFE_TYPES = [
    "AbsVal", "Accuracy", "ArgMax", "BNLL", "BatchNorm", "BatchReindex", "Bias", "Clip", "Concat", "ContrastiveLoss",
    "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData", "ELU", "Eltwise", "Embed",
    "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data", "HDF5Output", "HingeLoss", "Im2col", "ImageData",
    "InfogainLoss", "InnerProduct", "Input", "LRN", "LSTM", "LSTMUnit", "Log", "MVN", "MemoryData",
    "MultinomialLogisticLoss", "PReLU", "Parameter", "Pooling", "Power", "Python", "RNN", "ReLU", "Reduction",
    "Reshape", "SPP", "Scale", "Sigmoid", "SigmoidCrossEntropyLoss", "Silence", "Slice", "Softmax",
    "SoftmaxWithLoss", "Split", "Swish", "TanH", "Threshold", "Tile", "WindowData",
]


@pytest.mark.parametrize("type_name", CAFFE_TYPES)
def test_every_caffe_layer_type_is_registered(type_name):
    assert len(CAFFE_TYPES) == 61
    if type_name == "Python" and type_name not in known_types():
        pytest.skip("the Python layer comes with pycaffe's Python layers")
    assert type_name in known_types()


INPUT = "layer { name: 'in' type: 'Input' top: 'x' top: 'idx' input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } " \
        "shape { dim: 5 } } } "
SEQUENCE = "layer { name: 'in' type: 'Input' top: 'x' top: 'cont' input_param { shape { dim: 5 dim: 2 dim: 3 } " \
           "shape { dim: 5 dim: 2 } } } "
NETS = {
    "SPP": (INPUT + "layer { name: 'l' type: 'SPP' bottom: 'x' top: 'y' spp_param { pyramid_height: 2 } } "
            "layer { name: 's' type: 'Silence' bottom: 'idx' }", "4 15"),
    "Im2col": (INPUT + "layer { name: 'l' type: 'Im2col' bottom: 'x' top: 'y' convolution_param { kernel_size: 3 } } "
               "layer { name: 's' type: 'Silence' bottom: 'idx' }", "4 27 4 4"),
    "Parameter": ("layer { name: 'l' type: 'Parameter' top: 'y' parameter_param { shape { dim: 2 dim: 7 } } }", "2 7"),
    "BatchReindex": (INPUT + "layer { name: 'l' type: 'BatchReindex' bottom: 'x' bottom: 'idx' top: 'y' }", "5 3 6 6"),
    "LSTM": (SEQUENCE + "layer { name: 'l' type: 'LSTM' bottom: 'x' bottom: 'cont' top: 'y' "
             "recurrent_param { num_output: 4 } }", "5 2 4"),
    "RNN": (SEQUENCE + "layer { name: 'l' type: 'RNN' bottom: 'x' bottom: 'cont' top: 'y' "
            "recurrent_param { num_output: 4 } }", "5 2 4"),
    "LSTMUnit": ("layer { name: 'in' type: 'Input' top: 'c' top: 'g' top: 'cont' input_param { shape { dim: 1 dim: 2 "
                 "dim: 3 } shape { dim: 1 dim: 2 dim: 12 } shape { dim: 1 dim: 2 } } } "
                 "layer { name: 'l' type: 'LSTMUnit' bottom: 'c' bottom: 'g' bottom: 'cont' top: 'c1' top: 'h1' }",
                 "1 2 3; 1 2 3"),
    # planned at the full batch: the most items a selection keeps
    "Filter": ("layer { name: 'in' type: 'Input' top: 'x' top: 's' input_param { shape { dim: 4 dim: 3 } "
               "shape { dim: 4 dim: 1 } } } layer { name: 'l' type: 'Filter' bottom: 'x' bottom: 's' top: 'y' }", "4 3"),
}


def _summary(tmp_path, capsys, text):
    (tmp_path / "net.prototxt").write_text("name: 'one_type' " + text)
    code = main(["summary", "--model", str(tmp_path / "net.prototxt")])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("type_name", sorted(NETS))
def test_summary_builds_a_net_of_each_new_type(tmp_path, capsys, type_name):
    text, shape = NETS[type_name]
    code, out, err = _summary(tmp_path, capsys, text)
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("l "))
    assert type_name in row and shape in out, out  # recurrent layers: the output comes from their last step


def test_summary_builds_window_data_and_refuses_a_filter_of_mismatched_items(tmp_path, capsys):
    rng = np.random.default_rng(5)
    write_images(tmp_path, rng, [(12, 12)])
    write_window_file(tmp_path / "windows.txt", [(12, 12)], [[(1, 0.9, 0, 0, 7, 7), (0, 0.1, 2, 2, 9, 9)]])
    code, out, err = _summary(tmp_path, capsys, (
        f"layer {{ name: 'l' type: 'WindowData' top: 'x' top: 'y' transform_param {{ crop_size: 8 }} "
        f"window_data_param {{ source: '{tmp_path}/windows.txt' root_folder: '{tmp_path}/' batch_size: 4 }} }}"))
    assert code == 0 and "WindowData" in out and "4 3 8 8; 4" in out, err
    code, out, err = _summary(tmp_path, capsys, INPUT + "layer { name: 'l' type: 'Filter' bottom: 'x' bottom: 'idx' "
                                                        "top: 'y' }")
    assert code == 1 and "net.prototxt:1: layer 'l' (Filter): bottom 0 'x' must have the selector's 5 items" in err
    assert err.count("\n") == 1


def test_v1_names_of_the_new_types_convert():
    v1 = text_format.Parse("""
        layers { name: 'w' type: WINDOW_DATA top: 'data' top: 'label'
                 window_data_param { source: 'windows.txt' batch_size: 8 crop_size: 227 mirror: true context_pad: 16 } }
        layers { name: 'c' type: IM2COL bottom: 'data' top: 'col' convolution_param { kernel_size: 3 } }""",
                           pb.NetParameter())
    net = upgrade_net(v1, "v1.prototxt")
    assert [(layer.type, layer.name) for layer in net.layer] == [("WindowData", "w"), ("Im2col", "c")]
    assert net.layer[0].transform_param.crop_size == 227 and net.layer[0].transform_param.mirror
    assert net.layer[0].window_data_param.context_pad == 16


def test_netspec_writes_the_new_types_and_the_net_builds(tmp_path):
    import superneurons as caffe
    from superneurons import layers as L, params as P
    from superneurons.graph.build import build_graph

    n = caffe.NetSpec()
    n.x, n.cont = L.Input(shape=[dict(dim=[5, 2, 3]), dict(dim=[5, 2])], ntop=2)
    n.h = L.LSTM(n.x, n.cont, recurrent_param=dict(num_output=4, weight_filler=dict(type="gaussian", std=0.1)))
    n.o = L.RNN(n.h, n.cont, recurrent_param=dict(num_output=3))
    n.s = L.SPP(L.Reshape(n.o, shape=dict(dim=[5, 2, 3, 1])), spp_param=dict(pyramid_height=1, pool=P.SPP.AVE))
    n.p = L.Parameter(parameter_param=dict(shape=dict(dim=[2, 3])))
    graph = build_graph(n.to_proto(), pb.TRAIN)
    assert graph.blob_shapes["s"] == (5, 2, 1, 1) and graph.blob_shapes["p"] == (2, 3)
    assert [graph.node(name).layer.type_name for name in ("h", "o")] == ["LSTM", "RNN"]


def test_draw_shows_the_new_types_as_the_prototxt_writes_them():
    from superneurons.pycaffe.draw import net_to_dot

    net = text_format.Parse(NETS["LSTM"][0] + " layer { name: 'p' type: 'Parameter' top: 'p' "
                                              "parameter_param { shape { dim: 1 } } }", pb.NetParameter())
    dot = net_to_dot(net)
    assert "(LSTM)" in dot and "(Parameter)" in dot and "unit_1" not in dot  # the layer, not its unrolled steps
