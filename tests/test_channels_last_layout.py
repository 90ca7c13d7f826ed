"""Which blobs a backend keeps channels last (graph/layout.py) and how the tensor declaration records it
(memory/tensors.py): SUPERNEURONS_LAYOUT, the backend's layouts, the layers with a channels-last path, the
blobs tied together (in place, Split's views, Eltwise), and the KRSC working copies of a float32 convolution."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons import settings
from superneurons.backend.cpu import CpuBackend
from superneurons.dtypes import BFLOAT16, FLOAT32
from superneurons.errors import UserError
from superneurons.graph import layout
from superneurons.graph.build import build_graph
from superneurons.graph.precision import override_defaults
from superneurons.memory.tensors import BUFFER, DATA, DIFF, NCHW, NHWC, declare_tensors
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from test_memory_modes import CONV_FAN, _input, _layer, conv, ip
from test_recompute_resnet import RESNET

GPU_LAYOUTS = ("NCHW", "NHWC")

VGG = (  # conv -> relu -> pool twice, then an InnerProduct flattening the last pooling's top
    _input((2, 3, 8, 8), 2)
    + conv("conv1", "data", "conv1", 4) + _layer("relu1", "ReLU", ["conv1"], ["conv1"])
    + _layer("pool1", "Pooling", ["conv1"], ["pool1"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + conv("conv2", "pool1", "conv2", 5) + _layer("relu2", "ReLU", ["conv2"], ["conv2"])
    + _layer("pool2", "Pooling", ["conv2"], ["pool2"], "pooling_param { pool: MAX kernel_size: 2 stride: 2 }")
    + ip("fc", "pool2", "fc", 3)
    + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"])
)


def _graph(text: str, precision: str | None = None):
    net = override_defaults(text_format.Parse('name: "t"\n' + text, pb.NetParameter()), precision)
    return build_graph(net, pb.TRAIN)


def _nhwc_blobs(graph, layouts=GPU_LAYOUTS) -> set[str]:
    return {b for b, v in layout.choose(graph, layouts).blobs.items() if v == NHWC}


def test_nchw_unless_asked_and_unless_the_backend_stores_nhwc(monkeypatch):
    monkeypatch.delenv("SUPERNEURONS_LAYOUT", raising=False)
    assert settings.get("SUPERNEURONS_LAYOUT") == "nchw"
    assert _nhwc_blobs(_graph(VGG)) == set()
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    assert _nhwc_blobs(_graph(VGG), ("NCHW",)) == set()  # the CPU keeps NCHW
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "sideways")
    with pytest.raises(UserError, match="SUPERNEURONS_LAYOUT"):
        settings.get("SUPERNEURONS_LAYOUT")


# VGG with an LRN after its first ReLU: the LRN has no channels-last path, so conv1's top stays NCHW
VGG_LRN = VGG.replace(
    'layer { name: "pool1"', 'layer { name: "norm1" type: "LRN" bottom: "conv1" top: "conv1n" }\n'
    'layer { name: "pool1"').replace('bottom: "conv1" top: "pool1"', 'bottom: "conv1n" top: "pool1"')
# VGG whose second stage joins conv2 and pool1 in a Concat (SqueezeNet's and Inception's joins)
VGG_CONCAT = VGG.replace(
    'layer { name: "pool2"', 'layer { name: "cat" type: "Concat" bottom: "conv2" bottom: "pool1" top: "cat" }\n'
    'layer { name: "pool2"').replace('bottom: "conv2" top: "pool2"', 'bottom: "cat" top: "pool2"')
VGG_GROUPED = VGG.replace("num_output: 5 kernel_size: 3", "num_output: 4 kernel_size: 3 group: 2")


def test_auto_keeps_channels_last_where_the_zoo_measured_it_faster(monkeypatch):
    """`auto`: a plain convolution net in both types, a BatchNorm net in float32, and in bfloat16 where its passes
    replay as CUDA graphs; never a net with a Concat, a grouped convolution or a layer without a channels-last
    path between its convolutions."""
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "auto")
    vgg = {"conv1", "pool1", "conv2"}
    assert _nhwc_blobs(_graph(VGG, "fp32")) == vgg == _nhwc_blobs(_graph(VGG, "bf16"))
    assert _nhwc_blobs(_graph(VGG, "fp16")) == set()  # not measured channels last
    assert _nhwc_blobs(_graph(VGG, "bf16"), ("NCHW",)) == set()  # the CPU keeps NCHW
    resnet_graph = _graph(RESNET, "fp32")
    resnet = _nhwc_blobs(resnet_graph)
    assert resnet and all(len(resnet_graph.blob_shapes[b]) == 4 for b in resnet)
    assert _nhwc_blobs(_graph(RESNET, "bf16")) == set()  # eager: its channels-last step is bound by the host
    replayed = layout.choose(_graph(RESNET, "bf16"), GPU_LAYOUTS, replayed=True)
    assert set(replayed.blobs) == resnet and replayed.replay_only  # replayed as CUDA graphs: channels last
    assert not layout.choose(resnet_graph, GPU_LAYOUTS).replay_only
    assert not layout.choose(_graph(VGG, "bf16"), GPU_LAYOUTS, replayed=True).replay_only  # no BatchNorm
    assert _nhwc_blobs(_graph(VGG_GROUPED, "fp32")) == set()
    lrn = _graph(VGG_LRN, "fp32")
    assert layout.channels_last_blobs(lrn) and _nhwc_blobs(lrn) == set()
    # a Concat net has channels-last paths throughout, but stays NCHW (DenseNet-121 and SqueezeNet lost)
    concat_graph = _graph(VGG_CONCAT, "bf16")
    splits = {"pool1_pool1_0_split_0", "pool1_pool1_0_split_1"}  # pool1 feeds conv2 and the Concat
    assert set(layout.channels_last_blobs(concat_graph)) == vgg | {"cat"} | splits
    assert _nhwc_blobs(concat_graph) == set() == _nhwc_blobs(_graph(VGG_CONCAT, "fp32"))
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")  # asked for, it is channels last all the same
    assert _nhwc_blobs(_graph(VGG_LRN, "fp32")) and _nhwc_blobs(_graph(RESNET, "bf16"))
    assert _nhwc_blobs(_graph(VGG_CONCAT, "fp32")) == vgg | {"cat"} | splits


def test_vgg_like_net(monkeypatch):
    """The data layer's batch and the blob the InnerProduct flattens stay NCHW; the rest is NHWC, with each
    convolution's filter copy KRSC (a float32 net gets the copies for it) and the pooling masks NHWC."""
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    graph = _graph(VGG)
    chosen = layout.choose(graph, GPU_LAYOUTS)
    assert {b for b, v in chosen.blobs.items() if v == NHWC} == {"conv1", "pool1", "conv2"}
    specs = declare_tensors(graph, train=True, layouts=chosen).by_key
    for blob in ("conv1", "pool1", "conv2"):
        assert specs[blob].layout == NHWC and specs[f"{blob}@diff"].layout == NHWC
        assert specs[blob].shape[1] in (4, 5)  # the shape stays N, C, H, W
    for blob in ("data", "pool2", "fc"):
        assert specs[blob].layout == NCHW
    rooms = {"layout_copies", "layout_copies_bw"}  # for the NCHW blobs it converts (Layer.use_layout_copies)
    for conv_name in ("conv1", "conv2"):
        copies = [s for s in specs.values() if s.kind == BUFFER and s.owner == conv_name and "layout" not in s.key]
        assert {s.key.split("#")[1] for s in copies} == {"param0_copy", "param0_copy_bw"}
        assert all(s.layout == NHWC and s.dtype == FLOAT32 and len(s.shape) == 4 for s in copies)
        assert specs[f"{conv_name}.0"].layout == NCHW  # the master stays KCRS
    # conv1 reads the NCHW batch and pool2 writes the NCHW blob fc flattens: each has a room of its steps
    assert {s.key for s in specs.values() if "layout_copies" in s.key} == \
        {f"{name}#{room}" for name in ("conv1", "pool2") for room in rooms}
    assert specs["pool1#mask"].layout == NHWC and specs["pool2#mask"].layout == NHWC
    assert all(s.layout == NCHW for s in specs.values() if len(s.shape) != 4)


def test_half_net_reuses_its_working_copies(monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    graph = _graph(VGG, "bf16")
    specs = declare_tensors(graph, train=True, layouts=layout.choose(graph, GPU_LAYOUTS)).by_key
    copy = specs["conv2#param0_copy"]
    assert copy.dtype == BFLOAT16 and copy.layout == NHWC


@pytest.mark.parametrize("name,text", [("fan", CONV_FAN), ("resnet", RESNET)])
def test_tied_blobs_agree(monkeypatch, name, text):
    """In-place tops, Split's views and the gradients Split and Eltwise share are one memory: a view always has
    its base's layout, and a reshaping view (Flatten) an NCHW base (declare_tensors raises otherwise)."""
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    graph = _graph(text)
    out = declare_tensors(graph, train=True, layouts=layout.choose(graph, GPU_LAYOUTS))
    nhwc = [s for s in out.specs if s.layout == NHWC]
    assert nhwc, "a convolution net keeps some blobs channels last"
    for s in out.specs:
        if s.base is not None:
            assert s.layout == out.by_key[s.base].layout, s.key
    for s in nhwc:
        assert len(s.shape) == 4 and s.kind in (DATA, DIFF, BUFFER)
    assert out.by_key["data"].layout == NCHW


def test_a_layer_without_a_channels_last_path_keeps_its_blobs_nchw(monkeypatch):
    """Dropout's mask hashes the NCHW element index (the CPU's), and LRN indexes channels: their 4-D blobs, and
    the blobs tied to them, stay NCHW."""
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    text = (_input((2, 3, 8, 8), 2) + conv("conv1", "data", "conv1", 4)
            + _layer("drop", "Dropout", ["conv1"], ["conv1"], "dropout_param { dropout_ratio: 0.3 }")
            + conv("conv2", "conv1", "conv2", 4) + _layer("relu2", "ReLU", ["conv2"], ["conv2"])
            + _layer("norm", "LRN", ["conv2"], ["norm"]) + conv("conv3", "norm", "conv3", 4)
            + ip("fc", "conv3", "fc", 3) + _layer("loss", "SoftmaxWithLoss", ["fc", "label"], ["loss"]))
    assert _nhwc_blobs(_graph(text)) == set()


def test_bytes_are_the_same_in_either_layout(monkeypatch):
    """Layout moves elements, not bytes: the plan's sizes do not change (the float32 filter copies aside); the
    rooms for the conversions of the layers that mix layouts are added."""
    graph = _graph(VGG, "bf16")
    before = {s.key: s.nbytes for s in declare_tensors(graph, train=True).specs}
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")
    graph = _graph(VGG, "bf16")
    after = {s.key: s.nbytes for s in declare_tensors(graph, train=True, layouts=layout.choose(graph, GPU_LAYOUTS)).specs}
    rooms = {k for k in after if "layout_copies" in k}
    assert {k: v for k, v in after.items() if k not in rooms} == before
    assert {k.split("#")[0] for k in rooms} == {"conv1", "pool2"}
    assert np.dtype(BFLOAT16).itemsize == 2


def test_the_profiler_counts_each_layers_layout_conversions():
    """`superneurons time` shows, per layer, the op calls that converted layouts (a backend that counts them:
    CudaBackend.layout_conversions); here a CPU backend given a counter that the InnerProduct's forward bumps."""
    from superneurons.backend.cpu import CpuBackend
    from superneurons.commands.time import memory_column, to_json
    from superneurons.runtime.net import Net
    from superneurons.runtime.profiler import Profiler

    backend, count = CpuBackend(), [0]
    backend.layout_conversions = lambda: count[0]
    net = Net(_graph(VGG), backend)
    for blob in ("data", "label"):  # the Input layer's tops hold whatever the pool held: class 0, zero images
        net.ops.fill(net.data[blob].array, 0.0)
    fc = next(n.layer for n in net.graph.nodes if n.name == "fc")
    plain = fc.forward

    def forward(bottom, top):
        count[0] += 1
        plain(bottom, top)

    fc.forward = forward
    profile = Profiler(net).run(3)
    by_name = {t.name: t for t in profile.layers}
    assert by_name["fc"].layout_conversions == 3
    assert all(t.layout_conversions == 0 for name, t in by_name.items() if name != "fc")
    assert "layout conversions 1" in memory_column(by_name["fc"], 3)
    assert memory_column(by_name["conv2"], 3) == "-" or "layout" not in memory_column(by_name["conv2"], 3)

    class Args:
        iterations, memory = 3, "baseline"

    row = next(r for r in to_json(profile, "t", Args)["layers"] if r["name"] == "fc")
    assert row["layout_conversions"] == 1


class _TwoLayoutBackend(CpuBackend):
    """The CPU backend claiming to store NHWC too, for what the Net decides at setup (nothing here runs a step)."""

    layouts = GPU_LAYOUTS

    def ops_for(self, storage, channels_last=False):
        return self.ops

    def view(self, *args, layout=None, **kwargs):
        return super().view(*args, **kwargs)


def test_auto_runs_nchw_where_the_memory_runtime_is_needed(monkeypatch):
    """Under `auto` (layout and memory mode), a net runs channels last only while every tensor stays resident
    (baseline or liveness): NHWC's filter copies and conversion rooms cost memory, so a pool that needs recompute
    or offload gets the NCHW net: no channels-last tensor, and none of the buffers channels last declared."""
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "auto")
    seen = set()
    for pool in (None, 200_000, 60_000, 40_000, 30_000, 20_000, 12_000):
        net = Net(_graph(VGG), _TwoLayoutBackend(), train=True, seed=1, memory="auto", pool_bytes=pool)
        resident = type(net.memory).__name__ in ("BaselineManager", "LivenessManager")
        assert net.blob_layouts.any == resident, (pool, type(net.memory).__name__)
        if not resident:
            assert not any(spec.layout == NHWC for spec in net.layout.specs)
            assert not any("_copy" in name or "layout_copies" in name
                           for node in net.graph.nodes for name in node.layer.buffers)
        seen.add(resident)
    assert seen == {True, False}


class _RecordingBackend(_TwoLayoutBackend):
    """... with a graph recorder, as the GPU backend has (none is made here: no pass runs)."""

    graph_recorder = object


def test_auto_keeps_a_half_batchnorm_net_channels_last_only_where_its_passes_replay(monkeypatch, capsys):
    """A bfloat16 BatchNorm net under `auto` is channels last where its training passes will replay as CUDA
    graphs (a backend that records, baseline, SUPERNEURONS_CUDA_GRAPH on, not run eagerly), and NCHW
    otherwise; under --memory auto, channels last stays only where auto picks baseline."""
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "auto")

    def channels_last(backend=_RecordingBackend, memory="baseline", **kw) -> bool:
        return Net(_graph(RESNET, "bf16"), backend(), train=True, seed=1, memory=memory, **kw).blob_layouts.any

    assert channels_last()
    assert not channels_last(_TwoLayoutBackend)  # no recorder: eager passes
    assert not channels_last(memory="liveness")  # tensors share memory: liveness does not replay
    assert not channels_last(eager=True)  # a gradient reducer runs every step, pycaffe calls forward and backward
    monkeypatch.setenv("SUPERNEURONS_CUDA_GRAPH", "0")
    assert not channels_last()
    monkeypatch.delenv("SUPERNEURONS_CUDA_GRAPH")
    seen = set()
    for pool in (None, 200_000, 170_000, 100_000, 40_000):  # 170_000: liveness fits the channels-last net
        net = Net(_graph(RESNET, "bf16"), _RecordingBackend(), train=True, seed=1, memory="auto", pool_bytes=pool)
        baseline = type(net.memory).__name__ == "BaselineManager"
        assert net.blob_layouts.any == baseline, (pool, type(net.memory).__name__)
        seen.add(type(net.memory).__name__)
    assert {"BaselineManager", "LivenessManager"} <= seen, seen  # liveness keeps every tensor resident, eagerly
    assert "under baseline, where passes replay as CUDA graphs" in capsys.readouterr().err


# ---- `superneurons memory --layout`: the plan of what a GPU Net stores ---------------------------------------
SMALL = """name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 8 dim: 3 dim: 32 dim: 32 } shape { dim: 8 } } }
""" + "".join(f"""layer {{ name: "conv{k}" type: "Convolution" bottom: "{b}" top: "conv{k}"
  convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 weight_filler {{ type: "msra" }} }} }}
layer {{ name: "relu{k}" type: "ReLU" bottom: "conv{k}" top: "conv{k}" }}
""" for k, b in ((1, "data"), (2, "conv1"), (3, "conv2"))) + """layer { name: "pool" type: "Pooling" bottom: "conv3" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _memory_doc(capsys, tmp_path, *args: str, text: str = SMALL) -> dict:
    import json

    from superneurons.cli import main

    path = tmp_path / "small.prototxt"
    path.write_text(text)
    assert main(["memory", "--model", str(path), "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_plans_the_filter_copies_and_conversion_rooms_of_channels_last(capsys, tmp_path, monkeypatch):
    nchw = _memory_doc(capsys, tmp_path, "--layout", "nchw")
    nhwc = _memory_doc(capsys, tmp_path, "--layout", "nhwc")
    assert (nchw["channels_last_blobs"], nhwc["channels_last_blobs"]) == (0, 3)  # conv1..3 (ReLU in place)
    # Baseline holds everything at once: each convolution's KRSC filter copies (forward's and backward's), and
    # the conversion rooms of conv1 (reading the NCHW batch) and of the pooling (writing the NCHW blob the
    # InnerProduct flattens): a copy of the values forward, of the values and their gradient backward. What is
    # left over is the bias copies and the rounding of each buffer to the pool's blocks.
    filters = 4 * 16 * 9 * (3 + 16 + 16)
    batch, pooled = 4 * 8 * 3 * 32 * 32, 4 * 8 * 16 * 16 * 16
    added = nhwc["modes"]["baseline"]["peak_bytes"] - nchw["modes"]["baseline"]["peak_bytes"]
    assert 2 * filters + 3 * (batch + pooled) <= added <= 2 * filters + 3 * (batch + pooled) + 6 * 1024
    # Liveness holds a conversion room only in its own step: at conv1's forward the batch's copy is extra.
    step = next(i for i, s in enumerate(nchw["steps"]) if (s["layer"], s["phase"]) == ("conv1", "forward"))
    assert nhwc["steps"][step]["live_bytes"]["liveness"] - nchw["steps"][step]["live_bytes"]["liveness"] >= batch
    monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nhwc")  # the setting is the default
    assert _memory_doc(capsys, tmp_path)["modes"] == nhwc["modes"]


def test_memory_auto_keeps_auto_s_channels_last_only_where_it_stays_resident(capsys, tmp_path):
    roomy = _memory_doc(capsys, tmp_path, "--layout", "auto", "--memory", "auto", "--gpu-memory", "5M")
    assert roomy["auto"] == "baseline" and roomy["channels_last_blobs"] == 3
    tight = _memory_doc(capsys, tmp_path, "--layout", "auto", "--memory", "auto", "--gpu-memory", "1800K")
    assert tight["auto"] in ("offload", "recompute")
    assert (tight["channels_last_blobs"], tight["channels_last_released"]) == (0, 3)
    # released whole: the plan is the NCHW one
    assert tight["modes"] == _memory_doc(capsys, tmp_path, "--layout", "nchw", "--gpu-memory", "1800K")["modes"]


def test_memory_plans_a_bfloat16_batchnorm_net_channels_last_where_a_net_would_replay(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("SUPERNEURONS_CUDA_GRAPH", raising=False)

    def blobs(*args: str) -> int:
        doc = _memory_doc(capsys, tmp_path, "--layout", "auto", "--precision", "bf16", *args,
                          text='name: "r"\n' + RESNET)
        return doc["channels_last_blobs"]

    assert blobs("--memory", "baseline") > 0
    assert blobs("--memory", "liveness") == 0
    assert blobs("--memory", "baseline", "--phase", "TEST") == 0
    monkeypatch.setenv("SUPERNEURONS_CUDA_GRAPH", "0")
    assert blobs("--memory", "baseline") == 0
