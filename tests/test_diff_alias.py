"""Split and Eltwise SUM gradients share memory (memory/aliases.py) without changing a single bit."""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.memory.aliases import diff_aliases
from superneurons.memory.plan import make_plan
from superneurons.runtime.net import Net
from test_memory_modes import BACKEND, CONV_FAN, MLP_FAN, _graph, _layer, _mlp_with_loss, conv, ip, train

MODES = ("baseline", "liveness", "offload", "recompute")

# The Split's first top feeds a layer told not to propagate, so its gradient is never written: the alias
# must pick the other top (reusing the unwritten one would read last iteration's sum under baseline).
# The Eltwise's bottom 0 has coefficient 2: only bottom 1 may share the top gradient.
SKIPPED_TOP = (
    MLP_FAN.replace('bottom: "fc1" top: "fa"', 'bottom: "fc1" top: "fa" propagate_down: false')
    + _layer("sum", "Eltwise", ["fc2", "fc3"], ["out"], "eltwise_param { coeff: 2 coeff: 1 }")
    + _layer("loss", "SoftmaxWithLoss", ["out", "label"], ["loss"])
)

# An Eltwise whose top gradient nobody writes (its only consumer does not propagate): no alias.
UNWRITTEN_TOP = (
    MLP_FAN + _layer("sum", "Eltwise", ["fc2", "fc3"], ["out"])
    + ip("head", "out", "head", 3).replace('bottom: "out"', 'bottom: "out" propagate_down: false')
    + ip("side", "fc2", "side", 3)
    + _layer("loss", "SoftmaxWithLoss", ["head", "label"], ["loss"])
    + _layer("loss2", "SoftmaxWithLoss", ["side", "label"], ["loss2"])
)


def _aliases(text):
    g = _graph(text)
    return g, diff_aliases(g, {n.name: n.need_backward for n in g.nodes},
                           {n.name: list(n.propagate_down) for n in g.nodes}, [t for t, _w in g.loss_blobs])


def _kinds(g, aliases):
    return {g.node(name).layer.type_name: i for name, i in aliases.index.items()}


def test_split_and_eltwise_gradients_share_a_root():
    g, aliases = _aliases(_mlp_with_loss())
    # The Split's second top is read last in forward, so written first in backward: its gradient is the sum's.
    assert _kinds(g, aliases) == {"Split": 1, "Eltwise": 0}
    program = make_plan(g).program
    split = next(n for n in g.nodes if n.layer.type_name == "Split")
    assert program.root[split.tops[1] + "@diff"] == program.root[split.bottoms[0] + "@diff"]
    assert program.root[split.tops[0] + "@diff"] != program.root[split.bottoms[0] + "@diff"]  # an InnerProduct
    assert program.root["out@diff"] == program.root["fc2@diff"]
    net = Net(_graph(_mlp_with_loss()), BACKEND, memory="liveness")
    assert net.diff[split.tops[1]].base is net.diff[split.bottoms[0]]
    assert net.diff["out"].base is net.diff["fc2"]


def test_aliases_skip_unwritten_gradients_and_scaled_bottoms():
    g, aliases = _aliases(SKIPPED_TOP)
    split = next(n for n in g.nodes if n.layer.type_name == "Split")
    assert aliases.index[split.name] == 1  # top 0's consumer does not propagate
    assert aliases.index["sum"] == 1  # bottom 0 is scaled by 2
    g, aliases = _aliases(UNWRITTEN_TOP)
    assert "sum" not in aliases.index


@pytest.mark.parametrize("name,text", [("mlp", _mlp_with_loss()), ("conv_fan", CONV_FAN),
                                       ("skipped_top", SKIPPED_TOP), ("unwritten_top", UNWRITTEN_TOP)])
def test_every_mode_with_aliases_matches_baseline_without(name, text, monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_DIFF_ALIAS", "0")
    _, ref, ref_losses = train(text, "baseline", iters=4)
    monkeypatch.delenv("SUPERNEURONS_DIFF_ALIAS")
    for mode in MODES:
        _, got, losses = train(text, mode, iters=4)
        assert losses == ref_losses, mode
        assert got == ref, f"{mode}: weights differ from baseline without aliases"


def test_aliases_lower_the_plan():
    with_alias = make_plan(_graph(CONV_FAN))
    with pytest.MonkeyPatch.context() as m:
        m.setenv("SUPERNEURONS_DIFF_ALIAS", "0")
        without = make_plan(_graph(CONV_FAN))
    assert with_alias.program.total_bytes() < without.program.total_bytes()
    for mode in MODES:
        assert with_alias.peak(mode)[0] <= without.peak(mode)[0], mode


# One blob read by three convolutions: the last one read in forward writes the summed gradient, the other
# two add theirs into it (cuDNN's beta = 1 on the GPU), so the Split computes nothing.
THREE_CONVS = (
    CONV_FAN.split('layer { name: "conva"')[0]
    + conv("ca", "conv1", "ca", 3) + conv("cb", "conv1", "cb", 3) + conv("cc", "conv1", "cc", 3)
    + _layer("cat", "Concat", ["ca", "cb", "cc"], ["cat"])
    + ip("fc", "cat", "fc", 3) + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
)


def test_earlier_convolutions_add_into_the_split_gradient():
    g, aliases = _aliases(THREE_CONVS)
    split = next(n for n in g.nodes if n.layer.type_name == "Split")
    assert aliases.index[split.name] == 2 and aliases.added[split.name] == (0, 1)
    assert aliases.accumulate == {"ca": frozenset({0}), "cb": frozenset({0})}
    program = make_plan(g).program
    assert {program.root[t + "@diff"] for t in split.tops} == {program.root[split.bottoms[0] + "@diff"]}
    net = Net(_graph(THREE_CONVS), BACKEND, memory="liveness")
    assert net.layout.aliases.accumulate.get("ca") == {0}
    assert net.layout.aliases.accumulate.get("cc", frozenset()) == frozenset()


def test_accumulated_gradient_equals_the_separate_sum(monkeypatch):
    """Three shares summed in another order than the Split's: every mode still trains bit-identically to
    baseline, and to float tolerance like the unaliased net."""
    _, ref, ref_losses = train(THREE_CONVS, "baseline", iters=4)
    for mode in MODES[1:]:
        _, got, losses = train(THREE_CONVS, mode, iters=4)
        assert got == ref and losses == ref_losses, mode
    monkeypatch.setenv("SUPERNEURONS_DIFF_ALIAS", "0")
    _, separate, _ = train(THREE_CONVS, "baseline", iters=4)
    for a, b in zip(ref, separate, strict=True):
        assert np.allclose(np.frombuffer(a, np.float32), np.frombuffer(b, np.float32), rtol=1e-5, atol=1e-6)


def test_conv_backward_accumulate_adds_exactly(rng):
    from superneurons.backend.cpu.conv import conv_backward
    from superneurons.backend.geometry import ConvGeometry

    x = rng.standard_normal((3, 4, 7, 6)).astype(np.float32)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    geom = ConvGeometry((3, 3), (2, 1), (1, 0), (1, 1), 2)
    dy = rng.standard_normal((3, 6, 4, 4)).astype(np.float32)
    fresh = rng.standard_normal(x.shape).astype(np.float32)  # overwritten
    conv_backward(x, w, dy, fresh, None, None, geom)
    held = rng.standard_normal(x.shape).astype(np.float32)
    acc = held.copy()
    conv_backward(x, w, dy, acc, None, None, geom, accumulate_dx=True)
    assert np.array_equal(acc, held + fresh)
