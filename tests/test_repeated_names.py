"""Repeated layer names, which Caffe accepts: its examples/mnist/mnist_autoencoder.prototxt names two layers 'loss'.
The runtime keys layers as `name`, `name#2`, ...; saved models keep the prototxt's names; weights load onto the
first layer of a name, as Caffe's CopyTrainedLayersFrom does."""
from __future__ import annotations

import numpy as np
from google.protobuf import text_format
from test_solver import Quiet

from superneurons.backend.cpu import CpuBackend
from superneurons.cli import main
from superneurons.graph.build import build_graph, unique_layer_names
from superneurons.io.caffemodel import load_weights, net_to_proto, read_weights, save_weights
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from superneurons.solver.solver import Solver


def _ip(name: str, bottom: str, n: int) -> str:
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}" param {{ lr_mult: 1 }} '
            f'param {{ lr_mult: 2 }} inner_product_param {{ num_output: {n} weight_filler {{ type: "gaussian" '
            f'std: 1 sparse: 4 }} bias_filler {{ type: "constant" value: 0 }} }} }}\n')


def _sigmoid(name: str) -> str:
    return f'layer {{ name: "{name}neuron" type: "Sigmoid" bottom: "{name}" top: "{name}neuron" }}\n'


def autoencoder() -> str:
    """Caffe's mnist_autoencoder layout (its phase/stage data layers, encoder, decoder and the two layers named
    'loss'), on 8x8 DummyData and narrower codes so it runs in a moment."""
    data = ('layer {{ name: "data" type: "DummyData" top: "data" include {{ phase: {phase} {stage} }} '
            'dummy_data_param {{ shape {{ dim: 16 dim: 1 dim: 8 dim: 8 }} data_filler {{ type: "uniform" min: 0 '
            'max: 1 }} }} }}\n')
    text = 'name: "MNISTAutoencoder"\n' + data.format(phase="TRAIN", stage="") + \
        data.format(phase="TEST", stage='stage: "test-on-train"') + \
        data.format(phase="TEST", stage='stage: "test-on-test"')
    text += 'layer { name: "flatdata" type: "Flatten" bottom: "data" top: "flatdata" }\n'
    bottom = "data"
    for name, n in (("encode1", 32), ("encode2", 16), ("encode3", 8)):
        text += _ip(name, bottom, n) + _sigmoid(name)
        bottom = name + "neuron"
    text += _ip("encode4", bottom, 4)
    bottom = "encode4"
    for name, n in (("decode4", 8), ("decode3", 16), ("decode2", 32)):
        text += _ip(name, bottom, n) + _sigmoid(name)
        bottom = name + "neuron"
    text += _ip("decode1", bottom, 64)
    text += ('layer { name: "loss" type: "SigmoidCrossEntropyLoss" bottom: "decode1" bottom: "flatdata" '
             'top: "cross_entropy_loss" loss_weight: 1 }\n' + _sigmoid("decode1") +
             'layer { name: "loss" type: "EuclideanLoss" bottom: "decode1neuron" bottom: "flatdata" top: "l2_error" '
             'loss_weight: 0 }\n')
    return text


def test_unique_names_keep_the_first_and_never_take_a_real_name():
    assert unique_layer_names(["a", "loss", "loss", "loss#2", "loss"]) == ["a", "loss", "loss#3", "loss#2", "loss#4"]


def test_the_autoencoder_builds_trains_and_snapshots(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net_param = text_format.Parse(autoencoder(), pb.NetParameter())
    graph = build_graph(net_param, pb.TRAIN)
    assert [n.name for n in graph.nodes if n.layer.type_name.endswith("Loss")] == ["loss", "loss#2"]
    assert dict(graph.loss_blobs) == {"cross_entropy_loss": 1.0}

    param = text_format.Parse('base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" max_iter: 30 snapshot: 30 '
                              'snapshot_prefix: "snap/ae" random_seed: 2 test_iter: 1 test_iter: 1 '
                              'test_interval: 30 '
                              'test_state { stage: "test-on-train" } test_state { stage: "test-on-test" } '
                              'display: 10', pb.SolverParameter())
    param.net_param.CopyFrom(net_param)
    solver = Solver(param, "ae_solver.prototxt", log=Quiet())
    first = solver.net.forward()
    solver.solve()
    assert solver.net.forward() < first  # it learns
    # both test nets, at iterations 0 and 30
    assert sum("Test net output #1: l2_error = " in line for line in solver.log.lines) == 4

    saved = read_weights("snap/ae_iter_30.caffemodel")
    assert [lp.name for lp in saved.layer].count("loss") == 2  # Caffe's names, as Caffe writes them
    assert "loss#2" not in [lp.name for lp in saved.layer]
    resumed = Solver(param, "ae_solver.prototxt", log=Quiet())
    resumed.restore("snap/ae_iter_30.solverstate")
    np.testing.assert_array_equal(resumed.net.layer("decode1").params[0].data,
                                  solver.net.layer("decode1").params[0].data)


def test_the_autoencoder_snapshots_in_hdf5(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    param = text_format.Parse('base_lr: 0.05 lr_policy: "fixed" max_iter: 2 snapshot_prefix: "snap/ae" '
                              'snapshot_format: HDF5 random_seed: 2', pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(autoencoder(), pb.NetParameter()))
    solver = Solver(param, "ae_solver.prototxt", log=Quiet())
    solver.solve()
    resumed = Solver(param, "ae_solver.prototxt", log=Quiet())
    resumed.restore("snap/ae_iter_2.solverstate.h5")
    np.testing.assert_array_equal(resumed.net.layer("encode1").params[0].data,
                                  solver.net.layer("encode1").params[0].data)


def test_summary_of_the_autoencoder(tmp_path, capsys):
    (tmp_path / "ae.prototxt").write_text(autoencoder())
    assert main(["summary", "--model", str(tmp_path / "ae.prototxt")]) == 0
    out = capsys.readouterr().out
    assert "loss#2" in out and "EuclideanLoss" in out


TWO_IPS = """
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "a" inner_product_param { num_output: 5
  weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "a" top: "b" inner_product_param { num_output: 5
  weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } } }
"""


def test_weights_load_onto_the_first_layer_of_a_name_as_caffe_does(tmp_path):
    """Caffe's CopyTrainedLayersFrom: each layer of the file is copied onto the first layer of the net with its
    name, so both file layers named 'ip' land on the first, the second file layer last."""
    def net(seed):
        return Net(build_graph(text_format.Parse(TWO_IPS, pb.NetParameter()), pb.TEST), CpuBackend(), train=False,
                   seed=seed)

    source = net(1)
    path = str(tmp_path / "two.caffemodel")
    save_weights(source, path)
    assert [lp.name for lp in net_to_proto(source).layer] == ["in", "ip", "ip"]
    target = net(2)
    second_before = target.layer("ip#2").params[0].data.copy()
    report = load_weights(target, path)
    np.testing.assert_array_equal(target.layer("ip").params[0].data, source.layer("ip#2").params[0].data)
    np.testing.assert_array_equal(target.layer("ip#2").params[0].data, second_before)
    assert report.missing == ["ip#2"]
