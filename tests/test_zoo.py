"""Real model-zoo prototxts (the folder in SUPERNEURONS_ZOO, see tests/zoo.py): every file parses and upgrades, every net infers its shapes.

Every layer type of a zoo net must be registered (a missing one fails its net's shape test, naming the
type), as every layer type a test meets must be; only a missing zoo file skips. Data layers are swapped for Input layers of the dataset's shape,
because the zoo ships prototxts, not LMDBs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from harness import is_net_prototxt
from zoo import missing, zoo_path
from google.protobuf import text_format

from superneurons.cli import main
from superneurons.commands.convert import read_any
from superneurons.graph.build import build_graph
from superneurons.io.upgrade import net_needs_upgrade, upgrade_net, upgrade_solver
from superneurons.layers.base import known_types
from superneurons.proto import superneurons_pb2 as pb

ZOO = zoo_path()
FILES = sorted(ZOO.rglob("*.prototxt")) if ZOO.is_dir() else []
pytestmark = pytest.mark.skipif(not FILES, reason=missing() or f"no prototxt files in {ZOO}")


def _rel(path: Path) -> str:
    return path.relative_to(ZOO).as_posix()


NETS = [p for p in FILES if is_net_prototxt(p)]

TRAIN, TEST = pb.TRAIN, pb.TEST
ALEXNET_DEPLOY = {"conv1": (10, 96, 55, 55), "pool1": (10, 96, 27, 27), "pool5": (10, 256, 6, 6),
                  "fc8": (10, 1000), "prob": (10, 1000)}
# Known shapes, by zoo file and phase. Pooling rounds up in Caffe (GoogLeNet's pool1 is 56, not 55) and
# down where a fork's `ceil_mode: false` says so (DenseNet's and ResNet-18's pool1 are 56, not 57).
EXPECTED: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {
    "caffe/models/bvlc_alexnet/deploy.prototxt": {TEST: ALEXNET_DEPLOY},
    "caffe-v1-format/models/bvlc_alexnet/deploy.prototxt": {TEST: ALEXNET_DEPLOY},
    "caffe/models/bvlc_alexnet/train_val.prototxt": {TRAIN: {"fc8": (256, 1000), "loss": ()},
                                                     TEST: {"fc8": (50, 1000), "accuracy": ()}},
    "caffe-v1-format/models/bvlc_alexnet/train_val.prototxt": {TRAIN: {"fc8": (256, 1000), "loss": ()}},
    "caffe/models/bvlc_reference_caffenet/deploy.prototxt": {TEST: {"pool5": (10, 256, 6, 6), "fc8": (10, 1000)}},
    "caffe/models/bvlc_googlenet/train_val.prototxt": {
        TRAIN: {"pool1/3x3_s2": (32, 64, 56, 56), "inception_5b/output": (32, 1024, 7, 7),
                "loss1/classifier": (32, 1000), "loss2/classifier": (32, 1000), "loss3/classifier": (32, 1000),
                "loss1/loss1": (), "loss2/loss2": (), "loss3/loss3": ()},
        TEST: {"loss1/classifier": (50, 1000), "loss2/classifier": (50, 1000), "loss3/classifier": (50, 1000)}},
    "caffe/models/bvlc_googlenet/deploy.prototxt": {TEST: {"loss3/classifier": (10, 1000), "prob": (10, 1000)}},
    "resnet/ResNet-50-deploy.prototxt": {TEST: {"conv1": (1, 64, 112, 112), "pool1": (1, 64, 56, 56),
                                                "res5c": (1, 2048, 7, 7), "pool5": (1, 2048, 1, 1),
                                                "fc1000": (1, 1000)}},
    "resnet/ResNet-101-deploy.prototxt": {TEST: {"fc1000": (1, 1000)}},
    "resnet/ResNet-152-deploy.prototxt": {TEST: {"fc1000": (1, 1000)}},
    "resnet/deploy_resnet18-priv.prototxt": {TEST: {"pool1": (1, 64, 56, 56), "pool5": (1, 512, 1, 1),
                                                    "fc1000": (1, 1000)}},
    "vgg/deploy_vgg16-pytorch.prototxt": {TEST: {"pool5": (1, 512, 7, 7), "classifier": (1, 1000)}},  # fc8
    "densenet/DenseNet_121.prototxt": {TEST: {"pool1": (1, 64, 56, 56), "fc6": (1, 1000, 1, 1)}},
    "inception/deploy_inception-v4.prototxt": {TEST: {"classifier": (1, 1000)}},
    "mobilenet/mobilenet_deploy.prototxt": {TEST: {"pool6": (1, 1024, 1, 1), "fc7": (1, 1000, 1, 1)}},
    "squeezenet/SqueezeNet_v1.0/deploy.prototxt": {TEST: {"pool10": (10, 1000, 1, 1)}},
    "squeezenet/SqueezeNet_v1.0/train_val.prototxt": {TRAIN: {"pool10": (32, 1000, 1, 1)}},
    "caffe/examples/mnist/lenet.prototxt": {TEST: {"pool2": (64, 50, 4, 4), "ip2": (64, 10)}},
    "caffe/examples/mnist/lenet_train_test.prototxt": {TRAIN: {"ip2": (64, 10)}, TEST: {"ip2": (100, 10)}},
    "caffe/examples/cifar10/cifar10_quick.prototxt": {TEST: {"pool3": (1, 64, 4, 4), "ip2": (1, 10)}},
    "caffe/examples/cifar10/cifar10_full_sigmoid_train_test_bn.prototxt": {TRAIN: {"ip1": (100, 10)}},
}

DATA_TYPES = {"Data": "data_param", "ImageData": "image_data_param", "WindowData": "window_data_param"}
# (channels, image side) of each dataset the zoo's data layers read, found by its name in `source`.
DATASETS = {"mnist": (1, 28), "cifar": (3, 32), "imagenet": (3, 256)}


def _read(path: Path):
    kind, msg = read_any(str(path))
    return kind, (upgrade_solver(msg, str(path)) if kind == "solver" else upgrade_net(msg, str(path)))


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_parses_and_upgrades(path, tmp_path, capsys):
    kind, msg = _read(path)
    if kind == "solver":
        assert not msg.HasField("solver_type") and msg.type
        return
    assert kind == "net" and len(msg.layer) > 0
    assert not net_needs_upgrade(msg), "something was left in an old format"
    # `convert` writes the same net, and its output reads back unchanged.
    out = tmp_path / "out.prototxt"
    assert main(["convert", str(path), str(out)]) == 0
    capsys.readouterr()
    assert text_format.Parse(out.read_text(), pb.NetParameter()) == msg


def _phases(net: pb.NetParameter) -> list[int]:
    """Nets with phase rules are built in both phases; deploy nets only in TEST."""
    has_rules = any(r.HasField("phase") for layer in net.layer for r in list(layer.include) + list(layer.exclude))
    return [TRAIN, TEST] if has_rules else [TEST]


def _data_layers_to_inputs(net: pb.NetParameter) -> None:
    """Replace each Data/ImageData/WindowData layer with an Input layer of the shapes it would produce."""
    for layer in net.layer:
        if layer.type not in DATA_TYPES:
            continue
        param_name = DATA_TYPES[layer.type]
        param = getattr(layer, param_name)
        dataset = next((d for d in DATASETS if d in param.source), "imagenet")
        channels, side = DATASETS[dataset]
        side = layer.transform_param.crop_size or side
        shapes = [(param.batch_size, channels, side, side), (param.batch_size,)][:len(layer.top)]
        layer.type = "Input"
        layer.ClearField(param_name)
        layer.ClearField("transform_param")
        for shape in shapes:
            layer.input_param.shape.add().dim.extend(shape)


@pytest.mark.parametrize("path", NETS, ids=_rel)
def test_shapes_infer(path):
    _, net = _read(path)
    _data_layers_to_inputs(net)
    missing = sorted({layer.type for layer in net.layer} - set(known_types()))
    assert not missing, f"layer types not registered: {', '.join(missing)}"
    expected = EXPECTED.get(_rel(path), {})
    for phase in sorted(set(_phases(net)) | set(expected)):
        graph = build_graph(net, phase, source=str(path))
        assert graph.outputs, "a net with shapes has outputs"
        for blob, shape in expected.get(phase, {}).items():
            assert graph.blob_shapes[blob] == shape, f"{blob} in {pb.Phase.Name(phase)}"


def test_expected_shapes_name_real_files_and_blobs():
    # Guards the table above against typos, which would silently test nothing.
    for rel, by_phase in EXPECTED.items():
        path = ZOO / rel
        assert path in NETS, rel
        _, net = _read(path)
        tops = {t for layer in net.layer for t in layer.top}
        for blobs in by_phase.values():
            assert set(blobs) <= tops, (rel, set(blobs) - tops)


@pytest.mark.parametrize("rel", ["models/bvlc_alexnet/train_val.prototxt", "models/bvlc_alexnet/deploy.prototxt",
                                 "examples/mnist/lenet_train_test.prototxt", "examples/mnist/lenet.prototxt"])
def test_v1_zoo_files_upgrade_to_their_current_versions(rel):
    old_path, new_path = ZOO / "caffe-v1-format" / rel, ZOO / "caffe" / rel
    if not old_path.is_file() or not new_path.is_file():
        pytest.skip(f"{rel} not in both zoo formats")
    _, old = _read(old_path)
    _, new = _read(new_path)
    # The current deploy files name their Input layer after its top; Caffe's upgrade names it "input".
    for net in (old, new):
        for layer in net.layer:
            if layer.type == "Input":
                layer.name = "input"
    assert old == new
