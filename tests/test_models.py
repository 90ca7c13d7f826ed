"""models/: every net builds; the zoo-derived DummyData nets are what tools/models/zoo_to_train.py writes; the deep-ResNet
generator (tools/models/make_resnet.py) builds the paper's bottleneck ResNets with the depth it prints."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from harness import is_net_prototxt, load_tool
import pytest
from google.protobuf import text_format
from logs import messages
from zoo import ZOO_ENV, missing, zoo_path

from superneurons.backend import get_backend
from superneurons.cli import main
from superneurons.graph.batch import set_batch
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net, read_solver
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

ROOT = Path(__file__).resolve().parents[1]
ZOO = zoo_path()
MODEL_FILES = sorted(ROOT.glob("models/*/*.prototxt"))


zoo_to_train = load_tool("models/zoo_to_train")
make_resnet = load_tool("models/make_resnet")


NETS = [p for p in MODEL_FILES if is_net_prototxt(p)]
SOLVERS = [p for p in MODEL_FILES if p not in NETS]


def _skip_without_data(net: pb.NetParameter) -> None:
    for layer in net.layer:
        source = {"Data": layer.data_param.source, "HDF5Data": layer.hdf5_data_param.source}.get(layer.type)
        if source and not (ROOT / source).exists() and not Path(source).exists():
            pytest.skip(f"layer {layer.name!r} reads {source}, which is not built here")


@pytest.mark.parametrize("path", NETS, ids=lambda p: p.relative_to(ROOT / "models").as_posix())
def test_model_builds(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # data sources are relative to the repository root
    net = read_net(str(path))
    _skip_without_data(net)
    for phase in (pb.TRAIN, pb.TEST):
        graph = build_graph(net, phase, source=str(path))
        assert graph.outputs
        losses = [blob for blob, _ in graph.loss_blobs]
        assert all(graph.blob_shapes[b] == () for b in losses)
        if path.name.endswith("_dummy.prototxt"):
            assert losses, f"{path.name} has no loss in {pb.Phase.Name(phase)}"


@pytest.mark.parametrize("path", SOLVERS, ids=lambda p: p.relative_to(ROOT / "models").as_posix())
def test_solver_names_an_existing_net(path):
    solver = read_solver(str(path))
    assert solver.net and (ROOT / solver.net).is_file(), f"{path}: net {solver.net!r} not found from the repo root"
    if path.name.endswith("_dummy_solver.prototxt") and path.parent.name in zoo_to_train.SPECS:  # generated ones
        assert (solver.type, solver.base_lr, solver.momentum, solver.max_iter, solver.snapshot) == \
            ("SGD", pytest.approx(0.01), pytest.approx(0.9), 20, 0)
        assert solver.solver_mode == pb.SolverParameter.GPU


def test_every_zoo_net_has_its_model_folder():
    for name in zoo_to_train.SPECS:
        assert (ROOT / "models" / name / f"{name}_dummy.prototxt").is_file(), name
        assert (ROOT / "models" / name / f"{name}_dummy_solver.prototxt").is_file(), name


# -- tools/models/zoo_to_train.py ---------------------------------------------------------------------------------


@pytest.mark.skipif(missing() is not None, reason=str(missing()))
@pytest.mark.parametrize("name", list(zoo_to_train.SPECS))
def test_committed_nets_are_what_the_script_writes(name, tmp_path):
    zoo_to_train.write_model(ZOO, name, zoo_to_train.SPECS[name], tmp_path, None, 1)
    fresh = (tmp_path / name / f"{name}_dummy.prototxt").read_text()
    assert fresh == (ROOT / "models" / name / f"{name}_dummy.prototxt").read_text(), \
        f"models/{name} is stale: rerun python tools/models/zoo_to_train.py ${ZOO_ENV}"


def _train_net(name: str) -> pb.NetParameter:
    return read_net(str(ROOT / "models" / name / f"{name}_dummy.prototxt"))


def test_conversion_rules():
    spec = zoo_to_train.SPECS
    for name in spec:
        net = _train_net(name)
        types = [layer.type for layer in net.layer]
        assert types[0] == "DummyData" and "Input" not in types and "Softmax" not in types, name
        assert types[-2:] == ["SoftmaxWithLoss", "Accuracy"], name
        assert [r.phase for r in net.layer[-1].include] == [pb.TEST]
        dp = net.layer[0].dummy_data_param
        assert [list(s.dim) for s in dp.shape] == [[spec[name].batch, 3, spec[name].side, spec[name].side],
                                                   [spec[name].batch]], name
        assert dp.data_filler[0].type == "gaussian" and dp.data_filler[0].std == 1.0
        label = dp.data_filler[1]
        assert label.type == "constant" and label.value == int(label.value) and 0 <= label.value < spec[name].classes
        for layer in net.layer:
            if layer.type == "BatchNorm":
                assert not layer.batch_norm_param.HasField("use_global_stats"), (name, layer.name)
            if layer.type == "Convolution":
                assert layer.convolution_param.HasField("weight_filler"), (name, layer.name)
            if layer.type == "InnerProduct":
                assert layer.inner_product_param.HasField("weight_filler"), (name, layer.name)


def test_batchnorm_uses_batch_statistics_in_train_only():
    net = _train_net("mobilenet")
    bn = {pb.TRAIN: [], pb.TEST: []}
    for phase in bn:
        graph = build_graph(net, phase)
        bn[phase] = [n.layer.use_global_stats for n in graph.nodes if n.layer.type_name == "BatchNorm"]
    assert bn[pb.TRAIN] and not any(bn[pb.TRAIN]) and all(bn[pb.TEST])


def test_convert_single_deploy_keeps_its_side(tmp_path, capsys):
    deploy = tmp_path / "d.prototxt"
    deploy.write_text('input: "data" input_dim: 1 input_dim: 3 input_dim: 20 input_dim: 20\n'
                      'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" '
                      'inner_product_param { num_output: 5 } }\n'
                      'layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }\n')
    out = tmp_path / "t.prototxt"
    assert zoo_to_train.main(["--deploy", str(deploy), "--out", str(out), "--batch", "4", "--label", "3"]) == 0
    graph = build_graph(read_net(str(out)), pb.TRAIN)
    assert graph.blob_shapes["data"] == (4, 3, 20, 20) and graph.blob_shapes["label"] == (4,)
    assert graph.outputs == ["loss"]
    # Two unconsumed outputs cannot be told apart from the class scores: a clear error, not a guess.
    deploy.write_text(deploy.read_text().replace('layer { name: "prob" type: "Softmax" bottom: "fc" top: "prob" }',
                                                 'layer { name: "fc2" type: "InnerProduct" bottom: "data" top: "fc2" '
                                                 'inner_product_param { num_output: 5 } }'))
    capsys.readouterr()
    assert zoo_to_train.main(["--deploy", str(deploy), "--out", str(out), "--batch", "4"]) == 1
    err = capsys.readouterr().err
    assert str(deploy) in err and "found 2: fc, fc2" in err


def test_cifar10_quick_trains_two_iterations_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    solver = read_solver(str(ROOT / "models/cifar10_quick/cifar10_quick_dummy_solver.prototxt"))
    solver.solver_mode = pb.SolverParameter.CPU
    solver.max_iter = 2
    solver.test_interval = 2
    solver.snapshot_prefix = str(tmp_path / "snap")
    net = read_net(str(ROOT / solver.net))
    set_batch(net, 10)  # the committed batch of 100 is for GPUs; 10 keeps this test quick on a CPU
    (tmp_path / "net.prototxt").write_text(text_format.MessageToString(net))
    solver.net = str(tmp_path / "net.prototxt")
    path = tmp_path / "solver.prototxt"
    path.write_text(text_format.MessageToString(solver))
    assert main(["train", "--solver", str(path)]) == 0
    out = "\n".join(messages(capsys.readouterr().err))  # glog lines on stderr
    assert "Iteration 2" in out and "accuracy" in out
    # Every label is class 1 and the data is noise: the loss starts near ln(10).
    losses = [float(line.rsplit("=", 1)[1].split()[0]) for line in out.splitlines()
              if "Iteration" in line and ", loss = " in line]
    assert losses and 1.0 < losses[0] < 5.0


@pytest.mark.parametrize("name", ["squeezenet", "mobilenet"])
def test_small_zoo_net_forward_backward(name):
    net = _train_net(name)
    set_batch(net, 1)
    n = Net(build_graph(net, pb.TRAIN), get_backend("cpu"), train=True, seed=0)
    loss = n.forward_backward()
    assert np.isfinite(loss) and loss > 0
    first_conv = next(nd for nd in n.graph.nodes if nd.layer.type_name == "Convolution")
    grad = n.backend.to_host(first_conv.layer.params[0].diff)
    assert np.isfinite(grad).all() and np.abs(grad).sum() > 0


# -- tools/models/make_resnet.py ----------------------------------------------------------------------------------


def test_tiny_resnet_shapes_and_structure():
    net = make_resnet.make_resnet([1, 1, 1, 1], batch=2)
    graph = build_graph(net, pb.TRAIN)
    s = graph.blob_shapes
    assert s["data"] == (2, 3, 224, 224) and s["label"] == (2,)
    assert s["conv1"] == (2, 64, 112, 112) and s["pool1"] == (2, 64, 56, 56)
    assert [s[f"res{k}a"] for k in (2, 3, 4, 5)] == [(2, 256, 56, 56), (2, 512, 28, 28), (2, 1024, 14, 14),
                                                    (2, 2048, 7, 7)]
    assert s["pool5"] == (2, 2048, 1, 1) and s["fc1000"] == (2, 1000) and graph.outputs == ["loss"]
    types = [layer.type for layer in net.layer]
    # conv1 + 3 per block + 1 projection per stage; each convolution followed by BatchNorm and Scale
    assert types.count("Convolution") == 1 + 3 * 4 + 4
    assert types.count("BatchNorm") == types.count("Scale") == types.count("Convolution")
    assert types.count("Eltwise") == 4 and types.count("InnerProduct") == 1
    for layer in net.layer:
        if layer.type == "BatchNorm":
            assert not layer.batch_norm_param.HasField("use_global_stats")
    test_graph = build_graph(net, pb.TEST)
    assert "accuracy" in test_graph.outputs


def test_resnet50_blocks_match_the_published_resnet50():
    net = make_resnet.make_resnet([3, 4, 6, 3], batch=1)
    graph = build_graph(net, pb.TRAIN)
    n_params = sum(int(np.prod(d.shape)) for nd in graph.nodes for d in nd.layer.params)
    zoo = ZOO / "resnet" / "ResNet-50-deploy.prototxt"
    if zoo.is_file():
        ref = build_graph(read_net(str(zoo)), pb.TEST)
        ref_params = sum(int(np.prod(d.shape)) for nd in ref.nodes for d in nd.layer.params)
        # The published conv1 has a bias (64 values); ours, like every other convolution, has none.
        assert n_params == ref_params - 64
        assert graph.blob_shapes["res5c"] == ref.blob_shapes["res5c"] == (1, 2048, 7, 7)
    else:
        assert n_params == 25_610_205


def test_tiny_resnet_trains_a_step_on_cpu():
    net = make_resnet.make_resnet([1, 1, 1, 1], batch=1)
    n = Net(build_graph(net, pb.TRAIN), get_backend("cpu"), train=True, seed=0)
    loss = n.forward_backward()
    assert np.isfinite(loss) and loss > 0


@pytest.mark.parametrize("blocks,depth", [("1,1,1,1", 14), ("3,4,6,3", 50), ("3,8,36,3", 152), ("6,32,300,6", 1034)])
def test_printed_depth(blocks, depth, tmp_path):
    out = tmp_path / "r.prototxt"
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "models" / "make_resnet.py"), "--blocks", blocks, "--batch", "1",
                          "--out", str(out)], capture_output=True, text=True, check=True)
    assert f"= {depth} layers" in res.stdout
    assert depth == 3 * sum(int(b) for b in blocks.split(",")) + 2
    net = text_format.Parse(out.read_text(), pb.NetParameter())
    assert net.name == f"ResNet-{depth}"
    weighted = sum(1 for layer in net.layer if layer.type in ("Convolution", "InnerProduct")
                   and "branch1" not in layer.name)
    assert weighted == depth


def test_make_resnet_errors(capsys):
    assert make_resnet.main(["--blocks", "3,4,6"]) == 1
    assert "expected four block counts" in capsys.readouterr().err
    assert make_resnet.main(["--blocks", "3,4,x,3"]) == 1
    assert "3,4,x,3" in capsys.readouterr().err


def test_cifar10_quick_lmdb_net_shapes():
    """Caffe's LMDB-fed cifar10_quick, its Data layers swapped for Inputs of CIFAR's shape (no LMDB here)."""
    net = read_net(str(ROOT / "models/cifar10_quick/cifar10_quick_train_test.prototxt"))
    for layer in net.layer:
        if layer.type == "Data":
            batch = layer.data_param.batch_size
            layer.type = "Input"
            layer.ClearField("data_param")
            layer.ClearField("transform_param")
            layer.input_param.shape.add().dim.extend([batch, 3, 32, 32])
            layer.input_param.shape.add().dim.extend([batch])
    for phase, outputs in ((pb.TRAIN, ["loss"]), (pb.TEST, ["accuracy", "loss"])):
        graph = build_graph(net, phase)
        assert graph.blob_shapes["pool3"] == (100, 64, 4, 4) and graph.blob_shapes["ip2"] == (100, 10)
        assert sorted(graph.outputs) == outputs
    solver = read_solver(str(ROOT / "models/cifar10_quick/cifar10_quick_solver.prototxt"))
    assert (solver.base_lr, solver.max_iter, solver.test_iter[0]) == (pytest.approx(0.001), 4000, 100)
