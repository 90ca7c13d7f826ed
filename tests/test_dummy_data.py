"""The DummyData layer (layers/dummy_data.py).
"""
import numpy as np
import pytest
from harness import make_layer

from superneurons.errors import UserError


DUMMY = """type: 'DummyData' top: 'a' top: 'b' top: 'c' top: 'd'
dummy_data_param { num: 4 channels: 3 height: 5 width: 6
  data_filler { type: 'constant' value: 2.5 } data_filler { type: 'gaussian' std: 3 }
  data_filler { type: 'positive_unitball' } data_filler { type: 'xavier' } }"""


def test_dummy_data_fills_as_caffe():
    layer, shapes = make_layer(DUMMY, [], dtype=np.float32)
    assert shapes == [(4, 3, 5, 6)] * 4
    tops = [np.zeros(s, np.float32) for s in shapes]
    layer.forward([], tops)
    assert (tops[0] == 2.5).all()
    np.testing.assert_allclose(tops[2].reshape(4, -1).sum(axis=1), 1.0, rtol=1e-5)
    assert (tops[2] > 0).all()
    limit = np.sqrt(3.0 / 90)  # xavier: fan_in = 3 * 5 * 6
    assert np.abs(tops[3]).max() <= limit * (1 + 1e-6) and np.abs(tops[3]).max() > limit * 0.9
    first = [t.copy() for t in tops]
    tops[0][...] = -1  # constant data is filled once, not refilled, for the same array (Caffe)
    layer.ctx.iteration = 1
    layer.forward([], tops)
    assert (tops[0] == -1).all()
    assert not np.array_equal(tops[1], first[1])  # random data is new every iteration
    layer.ctx.iteration = 0
    fresh = [np.zeros(s, np.float32) for s in shapes]  # a new array (a memory mode re-materialized it)
    layer.forward([], fresh)
    for got, want in zip(fresh, first):
        assert np.array_equal(got, want)  # batch k is a pure function of k


def test_dummy_data_rejects_unknown_filler():
    with pytest.raises(UserError, match="unknown filler type 'nope'"):
        make_layer("type: 'DummyData' top: 'a' dummy_data_param { shape { dim: 2 } data_filler { type: 'nope' } }",
                   [])
