"""tools/bench/concat.py's CPU side: which Concat layers of a zoo net it times (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest

from tools.bench import concat


def test_it_finds_every_concat_of_the_zoo_nets():
    # SqueezeNet: one per Fire module; Inception-v4: stem 3, A 4, reduction-A 1, B 7, reduction-B 1, C 3;
    # DenseNet-121: one per dense layer (6 + 12 + 24 + 16), each joining the block's input and 32 new channels.
    counts = {net: concat.concat_shapes(net, 4) for net in ("squeezenet", "inception_v4", "densenet121")}
    assert {net: sum(c.values()) for net, c in counts.items()} == {
        "squeezenet": 8, "inception_v4": 19, "densenet121": 58}
    assert counts["squeezenet"][(((4, 64, 55, 55), (4, 64, 55, 55)), 1)] == 2  # fire2 and fire3
    assert all(axis == 1 and len(bottoms) == 2 and bottoms[1][1] == 32
               for bottoms, axis in counts["densenet121"])
    assert concat.top_shape(((4, 64, 55, 55), (4, 32, 55, 55), (4, 1, 55, 55)), 1) == (4, 97, 55, 55)


def test_it_parses_its_arguments():
    assert "python3 -m tools.bench.concat" in concat.__doc__
    with pytest.raises(SystemExit) as e:
        concat.main(["--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit, match="has no Concat layer"):
        concat.main(["--net", "resnet50", "--batch", "2"])
