"""Which nets may replay a training pass as a CUDA graph (runtime/graph_replay.py), decided on the CPU: the data
layers in front, a layer that draws per-pass values on the host, a memory mode that moves tensors. The replay
itself runs on the GPU (tests/test_gpu_graph_replay.py)."""
from __future__ import annotations

from google.protobuf import text_format

from superneurons.backend.cpu import CpuBackend
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.graph_replay import _why_not, data_steps, replay_for
from superneurons.runtime.net import Net

NET = """name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "uniform" min: 0 max: 9.99 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""
DROPOUT = NET.replace('layer { name: "fc"', 'layer { name: "drop" type: "Dropout" bottom: "conv" top: "conv" }\n'
                      'layer { name: "fc"')


def _net(text: str, memory: str = "baseline") -> Net:
    return Net(build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN), CpuBackend(), memory=memory)


INPUTS = NET.replace(NET[NET.index("layer"):NET.index('layer { name: "conv"')],
                     'layer { name: "data" type: "Input" top: "data"\n'
                     '  input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } } }\n'
                     'layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }\n')


def test_a_plain_net_qualifies_with_its_data_layers_in_front():
    net = _net(NET)
    assert data_steps(net) == ([0], [1, 2, 3, 4])  # ReLU in place after the convolution: fused or not, 4 steps
    assert _why_not(net) is None
    net = _net(INPUTS)  # the route places the label's Input just before the loss: it runs in front all the same
    data, rest = data_steps(net)
    assert [net.forward_steps[i].node.name for i in data] == ["data", "label"]
    assert sorted(data + rest) == list(range(len(net.forward_steps)))
    assert _why_not(net) is None


IDENTITY = """import superneurons as caffe


class Identity(caffe.Layer):
    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff
"""


def test_python_layers_and_moving_memory_modes_keep_passes_eager(tmp_path, monkeypatch):
    (tmp_path / "replay_identity.py").write_text(IDENTITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    python = NET.replace('bottom: "conv" top: "fc"', 'bottom: "same" top: "fc"').replace(
        'layer { name: "fc"', 'layer { name: "py" type: "Python" bottom: "conv" top: "same"\n'
        '  python_param { module: "replay_identity" layer: "Identity" } }\nlayer { name: "fc"')
    assert "'py' (Python) runs host code every pass" in _why_not(_net(python))
    assert "--memory liveness moves tensors" in _why_not(_net(NET, "liveness"))


def test_dropout_replays_with_its_pass_key_prepared(monkeypatch):
    """Dropout qualifies: before each launch it queues its pass's key (the CPU has nothing to queue)."""
    net = _net(DROPOUT)
    assert _why_not(net) is None
    calls = []
    monkeypatch.setattr(net.ops, "dropout_pass", lambda seed, iteration: calls.append((seed, iteration)))
    net.ctx.iteration = 7
    net.layer("drop").prepare_replay()
    assert calls == [(net.ctx.seed, 7)]


def test_the_cpu_backend_never_records(monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_CUDA_GRAPH", "1")
    net = _net(NET)
    assert replay_for(net) is None
    for _ in range(4):
        assert net.forward_backward() > 0  # eager passes, as always
    assert net.replayed_passes == 0


class _FakeGraph:
    """Stands in for a recorded graph on the CPU: a launch runs the recorded function again with the cleared-gradient
    flags of the recording (a replay repeats the kernels the recording's Python chose), and leaves the flags as it
    found them (a replay runs no Python)."""

    def __init__(self, net: Net, fn, flags: list[bool]):
        self.net, self.fn, self.flags, self.nodes = net, fn, flags, 0

    def launch(self) -> None:
        learnable = self.net.learnable
        found = [decl.diff_cleared for decl in learnable]
        for decl, cleared in zip(learnable, self.flags):
            decl.diff_cleared = cleared
        self.fn()
        for decl, cleared in zip(learnable, found):
            decl.diff_cleared = cleared


class _FakeRecorder:
    """Records as the GPU's recorder does, on the CPU: the function's Python runs and nothing is computed (what it
    computes is undone: every tensor gets its contents back); `fail_at`: that capture fails after running."""

    def __init__(self, net: Net, fail_at: int | None = None):
        self.net, self.fail_at, self.captures = net, fail_at, 0

    def capture(self, fn):
        from superneurons.backend.base import CaptureFailed

        self.captures += 1
        net = self.net
        flags = [decl.diff_cleared for decl in net.learnable]
        kept = [(t.array, t.array.copy()) for t in net.tensors if t.base is None and t.array is not None]
        fn()
        for array, contents in kept:
            array[...] = contents
        if self.captures == self.fail_at:
            raise CaptureFailed("refused for the test")
        return _FakeGraph(net, fn, flags)


def _replaying(text: str, fail_at: int | None = None) -> Net:
    from superneurons.runtime.graph_replay import GraphReplay

    net = _net(text)
    net.__dict__["_replay"] = GraphReplay(net, _FakeRecorder(net, fail_at))  # what replay_for gives a GPU net
    return net


def _passes(net: Net, kinds: list[bool]) -> list[float]:
    """A pass per entry: True clears the gradients first (a first micro-batch), False adds into them."""
    losses = []
    for it, clear in enumerate(kinds):
        net.ctx.iteration = it
        if clear:
            net.clear_param_diffs()
        losses.append(net.forward_backward())
    return losses


KINDS = [True] * 5 + [False, True] * 4  # from pass 5 on, iter_size 2: every other pass accumulates


def _same_passes(text: str, fail_at: int | None = None) -> Net:
    """KINDS on an eager net and a replaying one: equal losses and parameter gradients after every pass, and the
    cleared-gradient flags left alike. Returns the replaying net."""
    eager, replayed = _net(text), _replaying(text, fail_at)
    for it, clear in enumerate(KINDS):
        assert _passes(replayed, [clear]) == _passes(eager, [clear]), it
        for a, b in zip(eager.learnable, replayed.learnable):
            assert (a.diff == b.diff).all() and a.diff_cleared == b.diff_cleared, it
    return replayed


def test_replayed_passes_are_the_eager_passes():
    """Two warm-up passes per kind, then one recording (forward and backward), then replays; the accumulating passes
    are a kind of their own, recorded adding where the clearing kind overwrites."""
    replay = _same_passes(DROPOUT)._replay
    assert len(replay._graphs) == 2 and replay.recorder.captures == 4
    # kind one: passes 0-1 warm up, 2-4 and the clearing passes 6, 8, 10, 12 replay; kind two: 5, 7 warm up, 9, 11
    assert replay.replays == 3 + 4 + 2


def test_a_failed_recording_leaves_the_pass_and_the_rest_eager():
    """The backward's recording fails after its layers' Python ran: that pass runs again eagerly from its first step
    after the data layers, and so does every pass after it, each equal to the eager net's."""
    replayed = _same_passes(NET, fail_at=2)
    assert replayed._replay.failed and replayed.replayed_passes == 0 and replayed._replay.recorder.captures == 2


def test_moved_arrays_and_new_loss_scales_record_again():
    net = _replaying(NET)
    _passes(net, [True] * 4)
    replay = net._replay
    assert replay.recorder.captures == 2
    net.loss_scale = 2.0  # a new kind: warm-up again, then its own graphs; the old ones stay
    _passes(net, [True] * 3)
    assert len(replay._graphs) == 2 and replay.recorder.captures == 4
    tensor = next(t for t in net.tensors if t.base is None and t.array is not None)
    tensor.array = tensor.array.copy()  # as a compaction or a reshape would re-point it
    _passes(net, [True] * 3)
    assert replay.recorder.captures == 6  # recorded again after two eager passes
    for scale in (3.0, 4.0, 5.0):
        net.loss_scale = scale
        _passes(net, [True] * 3)
    assert len(replay._graphs) == 4  # KEPT: the oldest went


def test_per_step_hooks_keep_passes_eager_and_say_so(capsys):
    from superneurons.memory.interface import StepHooks

    net = _replaying(NET)
    net.add_hooks(StepHooks())  # as the profiler or the float16 watch adds theirs
    _passes(net, [True] * 4)
    assert net.replayed_passes == 0 and net._replay.recorder.captures == 0
    assert capsys.readouterr().err.count("passes run eagerly while per-step hooks watch them") == 1
