"""Every layer type, given a bottom with fewer axes than it indexes (a Reduction's 0-D top, a 1-D label
vector), answers with a UserError naming the layer, or sets up: never another exception."""
from __future__ import annotations

import pytest
from google.protobuf import text_format

from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.layers.base import known_types, layer_class
from superneurons.proto import superneurons_pb2 as pb


@pytest.mark.parametrize("type_name", known_types())
@pytest.mark.parametrize("shape", [(), (4,), (2, 3)], ids=["0-d", "1-d", "2-d"])
def test_setup_on_few_axes_is_a_user_error_or_works(type_name, shape):
    cls = layer_class(type_name)
    lo, hi = cls.n_bottoms
    if hi == 0:
        pytest.skip("takes no bottom")
    n = max(1, lo)
    for phase in (pb.TRAIN, pb.TEST):
        param = pb.LayerParameter(name="x", type=type_name, bottom=[f"b{i}" for i in range(n)], top=["t"])
        try:
            tops = cls(param, phase).setup([shape] * n)
        except UserError as e:
            assert "'x'" in str(e)
        else:
            assert all(isinstance(s, (tuple, list)) for s in tops)


def test_batch_norm_of_a_reduction_names_the_layer():
    net = text_format.Parse('''
        layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
        layer { name: "sum" type: "Reduction" bottom: "data" top: "sum" reduction_param { axis: 0 } }
        layer { name: "bn" type: "BatchNorm" bottom: "sum" top: "bn" }''', pb.NetParameter())
    with pytest.raises(UserError, match=r"net.prototxt: layer 'bn' \(BatchNorm\): its bottom must have at least 1 "
                                        r"axis/axes, got a 0-D blob"):
        build_graph(net, pb.TRAIN, source="net.prototxt")
