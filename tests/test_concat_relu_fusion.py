"""A ReLU in place on a Concat's bottom reading its gradient from the Concat's top gradient (graph/fuse.py:
find_concat_slices, Graph.use_concat_slices, op relu_backward_slab).

The op against the unfused pair (the Concat's slice copy, then the ReLU's backward in place) bit for bit;
the pass's rules; fused nets against the same nets with SUPERNEURONS_FUSE=0 (bit for bit), with gradient
aliasing on and off, and every memory mode against baseline; which modes turn it on; a backward range that
would separate the pair. The CUDA kernels run under the simulator in
test_concat_kernels_sim.py and on a GPU in its gpu-marked tests.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_conv_relu_fusion import _head
from test_fusion import (_graph, _train, assert_test_phase_forward_matches_unfused,
                         assert_trains_like_unfused_in_every_mode)
from test_memory_modes import _input, _layer, conv

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cuda.probe import gpu_available
from superneurons.layers.fused.concat_slices import ConcatLeavingSlices, ReLUReadingSlice

OPS = CpuBackend().ops


@pytest.mark.parametrize("shape,axis,widths", [((3, 7, 4, 5), 1, (2, 5)), ((4, 6, 3), 0, (1, 3)),
                                               ((2, 3, 6, 2), 2, (4, 2)), ((5, 9), 1, (3, 6))])
@pytest.mark.parametrize("slope", [0.0, 0.2])
def test_op_is_the_slice_copy_then_the_relu_backward_bit_for_bit(rng, shape, axis, widths, slope):
    top_shape = list(shape)
    top_shape[axis] = sum(widths)
    top_diff = rng.standard_normal(top_shape).astype(np.float32)
    offset = 0
    for width in widths:
        bottom_shape = list(shape)
        bottom_shape[axis] = width
        y = np.maximum(rng.standard_normal(bottom_shape), 0).astype(np.float32)
        y[(0,) * len(shape)] = 0.0  # a zero output: masked
        want = np.full(bottom_shape, np.nan, np.float32)
        OPS.concat_backward(top_diff, want, axis, offset)
        OPS.relu_backward(y, want, want, slope)
        got = np.full(bottom_shape, np.nan, np.float32)
        OPS.relu_backward_slab(y, top_diff, got, axis, offset, slope)
        np.testing.assert_array_equal(got, want)
        assert (got == 0).any() or slope  # the mask did something
        offset += width


def _fire(expand_slope=0.1, source=_input((2, 3, 6, 6), 2)):
    """SqueezeNet's fire module and more: a squeeze convolution + ReLU split into a 1x1 and a 3x3 convolution,
    each + ReLU (the 3x3 one leaky), joined by a Concat with two more bottoms the pass leaves alone: a
    convolution without ReLU, and a ReLU whose output a pooling also reads (through a Split)."""
    return (source
            + conv("squeeze", "data", "s", 4, k=1, pad=0) + _layer("relu_s", "ReLU", ["s"], ["s"])
            + conv("e1", "s", "e1", 3, k=1, pad=0) + _layer("relu_e1", "ReLU", ["e1"], ["e1"])
            + conv("e3", "s", "e3", 5) + _layer("relu_e3", "ReLU", ["e3"], ["e3"],
                                                 f"relu_param {{ negative_slope: {expand_slope} }}")
            + conv("plain", "data", "plain", 2)
            + conv("shared", "data", "shared", 2) + _layer("relu_shared", "ReLU", ["shared"], ["shared"])
            + _layer("peek", "Pooling", ["shared"], ["peek"], "pooling_param { pool: MAX kernel_size: 1 }")
            + _layer("concat", "Concat", ["e1", "e3", "plain", "shared"], ["cat"])
            + _layer("join", "Concat", ["cat", "peek"], ["joined"])
            + _head("joined"))


def _bottoms_taken(graph, name):
    """The bottoms of Concat `name` whose gradients its step leaves to the ReLUs reading their slices."""
    step = graph.step_layer(graph.node(name))
    return step.taken if isinstance(step, ConcatLeavingSlices) else frozenset()


def _reading(graph):
    """{relu: (concat, offset)} for every ReLU whose step reads its gradient from a Concat's top gradient."""
    return {s.relu: (s.concat, s.offset) for s in graph.fusions.slices
            if isinstance(graph.step_layer(graph.node(s.relu)), ReLUReadingSlice)}


def _taken(text):
    """{concat: bottoms taken} and {relu: (concat, offset)} of the TRAIN graph of `text` with the slices on."""
    g = _graph(text)
    assert not any(_bottoms_taken(g, n.name) for n in g.nodes) and not _reading(g)  # off as built
    g.use_concat_slices(True)
    return g, {n.name: _bottoms_taken(g, n.name) for n in g.nodes if _bottoms_taken(g, n.name)}


def test_pass_rules():
    g, taken = _taken(_fire())
    reading = _reading(g)
    assert reading == {"relu_e1": ("concat", 0), "relu_e3": ("concat", 3)}
    assert taken == {"concat": {0, 1}}  # not join's: a Concat and a pooling make its bottoms, no ReLU
    assert g.top_gradient_blobs(g.node("relu_e3")) == ["cat"]
    assert g.bottom_gradients_written(g.node("concat"), [True] * 4) == [False, False, True, True]
    g.use_concat_slices(False)
    assert g.top_gradient_blobs(g.node("relu_e3")) == ["e3"] and not _bottoms_taken(g, "concat")
    # A leaky ReLU with a negative slope, and a Concat told not to propagate to a bottom, keep the copy.
    assert _taken(_fire(-0.5))[1] == {"concat": {0}}
    told = _fire().replace('bottom: "plain" bottom: "shared" top: "cat" ',
                           'bottom: "plain" bottom: "shared" top: "cat" propagate_down: true '
                           'propagate_down: false propagate_down: true propagate_down: true ')
    assert _taken(told)[1] == {"concat": {0}}


@pytest.mark.parametrize("alias", ["1", "0"])
def test_fused_net_trains_bit_identically_to_unfused_in_every_mode(monkeypatch, alias):
    monkeypatch.setenv("SUPERNEURONS_DIFF_ALIAS", alias)
    fused, _losses, _params = _train(_fire(), True, monkeypatch)
    assert _bottoms_taken(fused.graph, "concat") == {0, 1}
    assert_trains_like_unfused_in_every_mode(_fire(), monkeypatch)


def test_fused_net_test_phase_forward_matches_unfused(monkeypatch):
    assert_test_phase_forward_matches_unfused(_fire(), monkeypatch)


@pytest.mark.parametrize("memory,on", [("baseline", True), ("liveness", False), ("offload", False),
                                       ("recompute", False), ("auto", True)])
def test_only_baseline_reads_the_slices(memory, on):
    """Under the other modes the Concat's top gradient living on to the ReLU's step would cost memory (a
    replayed output beside it under recompute): the Net turns the slices on only under baseline (auto: when
    it picks baseline, as in this roomy pool), and its steps follow."""
    from superneurons.runtime.net import Net

    net = Net(_graph(_fire()), CpuBackend(), train=True, memory=memory)
    assert (_bottoms_taken(net.graph, "concat") == {0, 1}) == on
    step = next(s for s in net.backward_steps if s.node.name == "relu_e3")
    assert step.top_diffs == [net.diff["cat" if on else "e3"]]


def test_a_backward_range_that_separates_a_relu_from_the_concat_it_reads_is_refused(tmp_path, rng):
    """relu_e3 writes e3's gradient from concat's top gradient: backward(start='concat', end='concat') would leave
    it unwritten; refused with a line naming both. A range holding both runs from the top gradient set."""
    import superneurons as caffe
    from superneurons.errors import UserError

    model = tmp_path / "fire.prototxt"
    model.write_text('name: "fire"\nforce_backward: true\n' + _fire())
    net = caffe.Net(str(model), caffe.TRAIN)
    net.forward(data=rng.standard_normal((2, 3, 6, 6)).astype(np.float32), label=np.zeros(2, np.float32))
    with pytest.raises(UserError, match=r"separates 'concat' \(Concat\) from 'relu_e\d' \(ReLU\), whose backward "
                                        r"writes 'concat''s bottom gradient"):
        net.backward(start="concat", end="concat")
    cat = rng.standard_normal(net.blobs["cat"].diff.shape).astype(np.float32)
    net.blobs["cat"].diff[...] = cat
    net.backward(start="concat", end="relu_e1")
    e1 = net.blobs["e1"]
    np.testing.assert_array_equal(e1.diff, cat[:, :3] * (e1.data > 0))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
def test_gpu_net_reads_the_slices_like_the_cpu(gpu):
    """One iteration of the fire net on the GPU and the CPU, both under baseline with the slices on: the
    parameters' gradients agree."""
    from gpu_harness import assert_param_grads_match, one_iteration_on_both
    from test_conv_relu_fusion import GPU_NET_DATA

    nets, losses = one_iteration_on_both(gpu, 'name: "fire"\n' + _fire(source=GPU_NET_DATA))
    assert _bottoms_taken(nets["cuda"].graph, "concat") == {0, 1}
    assert_param_grads_match(nets, losses, "fire")
