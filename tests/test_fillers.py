"""Caffe's weight fillers drawn in pieces (layers/fillers.DRAW_CHUNK) give the values of one whole draw, so a
large parameter never needs a float64 copy of itself and every earlier filling is unchanged."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons.layers import fillers
from superneurons.proto import superneurons_pb2 as pb

SHAPE = (6, 5, 3, 3)


def whole(f: pb.FillerParameter, shape, rng: np.random.Generator) -> np.ndarray:
    """The reference: each filler's draws made at once in float64, then rounded to float32."""
    kind = f.type
    if kind == "uniform":
        return rng.uniform(f.min, f.max, size=shape).astype(np.float32)
    if kind == "gaussian":
        out = rng.normal(f.mean, f.std, size=shape).astype(np.float32)
        if f.sparse >= 0:
            out *= rng.random(size=shape) < (f.sparse / shape[0])
        return out
    fan_in = int(np.prod(shape)) // shape[0]
    if kind == "xavier":
        scale = np.sqrt(3.0 / fan_in)
        return rng.uniform(-scale, scale, size=shape).astype(np.float32)
    if kind == "msra":
        return rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape).astype(np.float32)
    raise AssertionError(kind)


@pytest.mark.parametrize("spec", ['type: "uniform" min: -2 max: 3', 'type: "gaussian" mean: 1 std: 0.5',
                                  'type: "gaussian" std: 1 sparse: 2', 'type: "xavier"', 'type: "msra"'])
@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_filling_in_pieces_draws_the_whole_draws_values(spec, chunk, monkeypatch):
    monkeypatch.setattr(fillers, "DRAW_CHUNK", chunk)
    f = text_format.Parse(spec, pb.FillerParameter())
    seed = int(np.random.default_rng().integers(1 << 31))
    got = fillers.fill(f, SHAPE, np.random.default_rng(seed))
    want = whole(f, SHAPE, np.random.default_rng(seed))
    assert got.dtype == np.float32 and got.shape == SHAPE
    np.testing.assert_array_equal(got, want)
    assert np.unique(got).size > 2 or "sparse" in spec  # the values are drawn, not a constant


def test_a_parameter_without_host_memory_to_fill_is_one_line_naming_the_layer(monkeypatch):
    from superneurons.backend import get_backend
    from superneurons.errors import UserError
    from superneurons.graph.build import build_graph
    from superneurons.runtime import net as net_module

    param = text_format.Parse(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
        '  inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }', pb.NetParameter())

    def no_memory(*args):
        raise MemoryError

    monkeypatch.setattr(net_module, "fill_host", no_memory)
    with pytest.raises(UserError, match=r"^layer 'ip': no host memory left to fill its parameter of shape \(4, 3\) "):
        net_module.Net(build_graph(param, pb.TEST), get_backend("cpu"))



def test_a_gaussian_std_of_minus_zero_fills_the_mean_and_a_negative_one_is_refused():
    """-0.0 passes `std >= 0` but NumPy's normal refuses its sign bit (a fuzzed prototxt found it)."""
    from superneurons.errors import UserError

    f = text_format.Parse('type: "gaussian" mean: 0.25 std: -0.0', pb.FillerParameter())
    np.testing.assert_array_equal(fillers.fill(f, (3, 4), np.random.default_rng(0)), np.full((3, 4), 0.25, np.float32))
    f.std = -0.5
    with pytest.raises(UserError, match="std -0.5 must be 0 or above"):
        fillers.fill(f, (3, 4), np.random.default_rng(0))
