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
