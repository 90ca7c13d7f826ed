"""Layer types SuperNeurons refuses with a clear error (layers/unsupported.py).
"""
import pytest
from google.protobuf import text_format

from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb


def test_python_layer_is_a_clear_user_error():
    text = """
    layer { name: 'in' type: 'Input' top: 'x' input_param { shape { dim: 2 } } }
    layer { name: 'py' type: 'Python' bottom: 'x' top: 'y' python_param { module: 'm' layer: 'L' } }
    """
    with pytest.raises(UserError, match=r"unsupported layer type 'Python' in layer 'py' \(SuperNeurons cannot run "
                                        r"Python layers\)"):
        build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN)
