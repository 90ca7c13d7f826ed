"""Error lines name the file, the line and the layer (and the field), cut what they quote to a readable
length, and say what is wrong in plain words."""
from __future__ import annotations

import pytest

from superneurons.errors import LONG_TOKEN, UserError
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb

INPUT = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: %s dim: 5 dim: 5 } } }\n'


def _error(tmp_path, text: str) -> str:
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        build_graph(read_net(str(path)), pb.TRAIN, source=str(path))
    return str(e.value)


def test_a_field_typo_names_the_layer(tmp_path):
    msg = _error(tmp_path, INPUT % 1 + 'layer {\n  name: "conv"\n  type: "Convolution" bottom: "data" top: "c"\n'
                           '  convolution_param { num_ouput: 3 kernel_size: 3 }\n}\n')
    assert msg.startswith(f"{tmp_path}/net.prototxt:5:23: layer 'conv': ") and '"num_ouput"' in msg


def test_a_missing_bottom_names_the_line(tmp_path):
    msg = _error(tmp_path, INPUT % 1 + '\nlayer { name: "relu" type: "ReLU" bottom: "nothere" top: "r" }\n')
    assert msg.startswith(f"{tmp_path}/net.prototxt:3: layer 'relu': unknown bottom blob 'nothere'")


def test_a_wrong_bottom_count_names_the_file_and_line(tmp_path):
    msg = _error(tmp_path, INPUT % 1 + 'layer { name: "drop" type: "Dropout" top: "d" }\n')
    assert msg == f"{tmp_path}/net.prototxt:2: layer 'drop' (Dropout): takes 1 bottom blob(s), got 0"


def test_a_negative_dimension_is_called_one(tmp_path):
    msg = _error(tmp_path, INPUT % -1)
    assert "negative dimension" in msg and "empty" not in msg and "(4 -1 5 5)" in msg


def test_a_long_token_is_cut(tmp_path):
    token = "9" * 10200
    msg = str(UserError(f"net.prototxt:1:1: bad value {token}"))
    assert len(msg) < LONG_TOKEN + 100 and "[10200 characters]" in msg


def test_an_empty_or_folder_net_field_names_the_solver_and_field(tmp_path):
    from superneurons.solver.nets import train_net_source

    solver = str(tmp_path / "s.prototxt")
    with pytest.raises(UserError, match=r"s\.prototxt: net is empty; give the path of the net prototxt"):
        train_net_source(pb.SolverParameter(net=""), solver)
    with pytest.raises(UserError, match=r"s\.prototxt: train_net '\.' is a folder, not a net prototxt"):
        train_net_source(pb.SolverParameter(train_net="."), solver)


def test_a_folder_as_learned_net_names_the_solverstate(tmp_path):
    from superneurons.solver.snapshot import _find_learned_net

    state = str(tmp_path / "x.solverstate")
    with pytest.raises(UserError, match=r"x\.solverstate: its learned_net '\.' is a folder, not a \.caffemodel"):
        _find_learned_net(".", state)


def test_input_dim_without_input_names_says_so(tmp_path):
    from superneurons.io.upgrade import upgrade_net

    net = pb.NetParameter(input_dim=[1])
    with pytest.raises(UserError) as e:
        upgrade_net(net, "w.caffemodel")
    assert str(e.value) == ("w.caffemodel: 1 input_dim value(s) but no input names; give an `input:` name for each "
                            "4 input_dim values (N, C, H, W)")


def test_an_image_that_does_not_decode_shows_no_python_object(tmp_path):
    from superneurons.data.datum import decode_image, load_image

    with pytest.raises(UserError) as e:
        decode_image(b"not an image at all", "layer 'data' (Data): record 3")
    assert " at 0x" not in str(e.value) and "not in an image format Pillow can read" in str(e.value)
    path = tmp_path / "x.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG signature, then nothing usable
    with pytest.raises(UserError) as e:
        load_image(str(path))
    assert str(e.value).startswith(f"{path}: cannot read the image (") and " at 0x" not in str(e.value)
