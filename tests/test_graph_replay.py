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
                     'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } } }\n'
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
