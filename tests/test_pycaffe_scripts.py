"""Classic pycaffe scripts, with only `import caffe` changed to `import superneurons as caffe`.

Where Caffe's own numbers exist (tests/fixtures/caffe: Caffe's LeNet after 400 iterations, its outputs on
300 test digits, and 20 iterations Caffe trained on from its own .solverstate) the scripts must give them;
elsewhere each result is recomputed independently in NumPy.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from harness import lmdb_digest, load_tool
from PIL import Image

import superneurons as caffe
from superneurons import layers as L
from superneurons import params as P
from superneurons.proto import caffe_pb2

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "caffe"
MODEL = FIX / "lenet_iter_400.caffemodel"
DEPLOY = ROOT / "models" / "lenet" / "lenet.prototxt"
TRAIN_TEST = ROOT / "models" / "lenet" / "lenet_train_test.prototxt"
PROB_ATOL = 1e-5  # float32 rounding: the [0, 1] image times 255 is not always the exact pixel value
LENET_SOLVER = """
test_iter: 3
test_interval: 10000
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 0
max_iter: 10000
random_seed: 1701
"""


@pytest.fixture(scope="module")
def fixture():
    with np.load(FIX / "caffe_lenet_outputs.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A folder holding data/digits/{train,test}_lmdb, which the LeNet prototxts name relative to it."""
    work = tmp_path_factory.mktemp("digits")
    load_tool("data/make_digits_lmdb").main(["--out", str(work / "data" / "digits")])
    return work


def file_blobs(path: Path) -> dict[str, list[np.ndarray]]:
    """The weights of a .caffemodel read with the protobuf schema alone (not through the loader)."""
    model = caffe_pb2.NetParameter()
    model.ParseFromString(path.read_bytes())
    return {lp.name: [np.array(b.data, dtype=np.float32).reshape(tuple(b.shape.dim)) for b in lp.blobs]
            for lp in model.layer if len(lp.blobs)}


def digit_files(tmp_path: Path, images: np.ndarray) -> list[str]:
    paths = []
    for i, image in enumerate(images):
        path = tmp_path / f"digit_{i:03d}.png"
        Image.fromarray(image, "L").save(path)
        paths.append(str(path))
    return paths


# -- classification of images with a deploy net and a caffemodel ------------------------------------------


def test_classify_images_gives_caffes_probabilities(fixture, tmp_path):
    caffe.set_mode_cpu()
    batch = int(fixture["batch_size"])
    paths = digit_files(tmp_path, fixture["images"][:batch])
    net = caffe.Net(str(DEPLOY), str(MODEL), caffe.TEST)
    net.blobs["data"].reshape(batch, 1, 28, 28)
    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_raw_scale("data", 255)
    transformer.set_input_scale("data", float(fixture["scale"]))  # the Data layer's scale in training
    for i, path in enumerate(paths):
        net.blobs["data"].data[i] = transformer.preprocess("data", caffe.io.load_image(path, color=False))
    prob = net.forward()["prob"]
    assert np.abs(prob - fixture["prob"][:batch]).max() <= PROB_ATOL
    np.testing.assert_array_equal(prob.argmax(1), fixture["prob"][:batch].argmax(1))

    # The same through caffe.Classifier (centre crop of the image at the input's size).
    classifier = caffe.Classifier(str(DEPLOY), str(MODEL), raw_scale=255, input_scale=float(fixture["scale"]))
    images = [caffe.io.load_image(p, color=False) for p in paths[:10]]
    scores = classifier.predict(images, oversample=False)
    assert scores.shape == (10, 10)
    assert np.abs(scores - fixture["prob"][:10]).max() <= PROB_ATOL


def test_classifier_oversampling_averages_the_ten_crops(fixture):
    """Images resized to 32 x 32, ten 28 x 28 crops each: predict equals the mean over the crops run by hand."""
    classifier = caffe.Classifier(str(DEPLOY), str(MODEL), image_dims=(32, 32), raw_scale=255,
                                  input_scale=float(fixture["scale"]))
    images = [fixture["images"][i][:, :, None] / np.float32(255) for i in range(3)]
    scores = classifier.predict(images)
    plain = caffe.Net(str(DEPLOY), str(MODEL), caffe.TEST)
    plain.blobs["data"].reshape(10, 1, 28, 28)
    for image, row in zip(images, scores):
        big = caffe.io.resize_image(image, (32, 32))
        boxes = [(0, 0), (0, 4), (4, 0), (4, 4), (2, 2)]
        crops = [big[t:t + 28, s:s + 28] for t, s in boxes]
        crops += [c[:, ::-1] for c in crops]
        x = np.stack([c.transpose(2, 0, 1) * 255 * float(fixture["scale"]) for c in crops])
        expected = plain.forward(data=x)["prob"].mean(axis=0)
        np.testing.assert_allclose(row, expected, atol=1e-6)
    assert (scores.argmax(1) == fixture["prob"][:3].argmax(1)).all()


# -- feature extraction from an intermediate blob ---------------------------------------------------------


def test_feature_extraction_from_intermediate_blobs(fixture):
    batch = int(fixture["batch_size"])
    net = caffe.Net(str(DEPLOY), caffe.TEST, weights=str(MODEL))
    net.blobs["data"].reshape(batch, 1, 28, 28)
    net.blobs["data"].data[...] = fixture["images"][:batch, None] * np.float32(fixture["scale"])
    out = net.forward(blobs=["pool2", "ip1"])
    pool2, ip1 = out["pool2"].copy(), out["ip1"].copy()
    assert pool2.shape == (batch, 50, 4, 4) and ip1.shape == (batch, 500)
    weights = file_blobs(MODEL)
    w1, b1 = (a.astype(np.float64) for a in weights["ip1"])
    w2, b2 = (a.astype(np.float64) for a in weights["ip2"])
    features = np.maximum(pool2.reshape(batch, -1) @ w1.T + b1, 0)  # ip1 is ReLU'd in place
    np.testing.assert_allclose(ip1, features, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ip1 @ w2.T + b2, fixture["ip2"][:batch], atol=1e-4)
    np.testing.assert_allclose(net.blobs["ip2"].data, fixture["ip2"][:batch], atol=1e-5)  # Caffe's logits
    # Forward up to a layer only, nothing after: up to ip1 its output before the in-place ReLU, as in Caffe.
    net.blobs["ip2"].data[...] = 0
    before_relu = net.forward(end="ip1")["ip1"]
    np.testing.assert_allclose(before_relu, pool2.reshape(batch, -1) @ w1.T + b1, rtol=1e-5, atol=1e-5)
    assert (before_relu < 0).any() and not net.blobs["ip2"].data.any()
    np.testing.assert_allclose(net.forward(end="relu1")["ip1"], features, rtol=1e-5, atol=1e-5)


# -- training LeNet through get_solver, reading solver.net.blobs -----------------------------------------


def test_solver_step_resumes_caffes_solverstate_like_caffe(digits, tmp_path, monkeypatch):
    """Caffe trained 20 iterations on from its iteration-400 .solverstate; solver.restore + step(1) x 20 with
    the loss read from solver.net.blobs gives Caffe's losses and weights."""
    with np.load(FIX / "caffe_lenet_resume.npz") as f:
        ref = {k: f[k] for k in f.files}
    if lmdb_digest(digits / "data" / "digits" / "train_lmdb", int(ref["train_records"])) != str(ref["train_sha256"]):
        pytest.skip("tools/data/make_digits_lmdb.py no longer writes the train records Caffe read for the fixture")
    monkeypatch.chdir(digits)
    for f in ("lenet_iter_400.caffemodel", "lenet_iter_400.solverstate"):
        shutil.copy(FIX / f, tmp_path / f)
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text((FIX / "lenet_solver_resume.prototxt").read_text()
                           .replace('net: "tests/fixtures/caffe/', f'net: "{FIX}/')
                           .replace('"/tmp/caffe_fixture/resume/lenet"', f'"{tmp_path}/lenet"'))
    solver = caffe.get_solver(str(solver_file))
    solver.restore(str(tmp_path / "lenet_iter_400.solverstate"))
    assert solver.iter == 400
    losses = []
    for _ in range(20):
        solver.step(1)
        losses.append(float(solver.net.blobs["loss"].data))
    assert solver.iter == 420
    np.testing.assert_allclose(losses, ref["losses"], rtol=2e-5)
    names = [f"{layer}/{k}" for layer in solver.net.params for k in range(len(solver.net.params[layer]))]
    assert names == list(ref["keys"])
    for i, name in enumerate(names):
        layer, k = name.split("/")
        w = solver.net.params[layer][int(k)].data
        head = ref[f"head_{i}"]
        assert np.abs(w[:len(head)] - head).max() <= 1e-6, name
        assert abs(w.astype(np.float64).sum() - ref[f"sum_{i}"]) <= 1e-7 * w.size, name


# -- fine-tuning: copy_from and a renamed last layer --------------------------------------------------------


def test_finetune_with_copy_from_and_a_renamed_last_layer(digits, tmp_path, monkeypatch):
    monkeypatch.chdir(digits)
    net_file = tmp_path / "finetune.prototxt"
    net_file.write_text(TRAIN_TEST.read_text().replace('name: "ip2"', 'name: "ip2_digits"'))
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{net_file}"\n' + LENET_SOLVER)
    solver = caffe.SGDSolver(str(solver_file))
    solver.net.copy_from(str(MODEL))
    trained = file_blobs(MODEL)
    for name in ("conv1", "conv2", "ip1"):
        for blob, expected in zip(solver.net.params[name], trained[name]):
            np.testing.assert_array_equal(blob.data, expected)
    fresh = solver.net.params["ip2_digits"][0].data.copy()
    assert fresh.shape == trained["ip2"][0].shape and not np.allclose(fresh, trained["ip2"][0])
    assert not solver.net.params["ip2_digits"][1].data.any()  # the constant bias filler
    # The test net reads the train net's weights.
    test_net = solver.test_nets[0]
    np.testing.assert_array_equal(test_net.params["conv1"][0].data, trained["conv1"][0])

    def accuracy() -> float:
        return float(np.mean([test_net.forward()["accuracy"] for _ in range(3)]))

    before = accuracy()
    solver.step(25)
    after = accuracy()
    # Only the new layer started from scratch: the pretrained features make it learn the digits fast.
    assert before < 0.5 and after >= 0.9, (before, after)
    assert not np.array_equal(solver.net.params["ip2_digits"][0].data, fresh)
    np.testing.assert_array_equal(test_net.params["ip2_digits"][0].data, solver.net.params["ip2_digits"][0].data)


# -- net surgery: a fully convolutional LeNet from the trained one ---------------------------------------------


def test_net_surgery_casts_inner_products_to_convolutions(fixture, tmp_path):
    full_conv = tmp_path / "lenet_full_conv.prototxt"
    text = DEPLOY.read_text()
    head = text[:text.index('layer {\n  name: "ip1"')]
    full_conv.write_text(head + """
layer { name: "ip1-conv" type: "Convolution" bottom: "pool2" top: "ip1-conv"
        convolution_param { num_output: 500 kernel_size: 4 } }
layer { name: "relu1" type: "ReLU" bottom: "ip1-conv" top: "ip1-conv" }
layer { name: "ip2-conv" type: "Convolution" bottom: "ip1-conv" top: "ip2-conv"
        convolution_param { num_output: 10 kernel_size: 1 } }
layer { name: "prob" type: "Softmax" bottom: "ip2-conv" top: "prob" }
""")
    net = caffe.Net(str(DEPLOY), str(MODEL), caffe.TEST)
    # The convolutional layers the file does not name start from their fillers; the others load.
    conv = caffe.Net(str(full_conv), str(MODEL), caffe.TEST)
    for fc, cv in (("ip1", "ip1-conv"), ("ip2", "ip2-conv")):
        assert conv.params[cv][0].data.shape != net.params[fc][0].data.shape
        conv.params[cv][0].data.flat = net.params[fc][0].data.flat  # pycaffe's surgery idiom
        conv.params[cv][1].data[...] = net.params[fc][1].data
    conv.save(str(tmp_path / "lenet_full_conv.caffemodel"))

    reloaded = caffe.Net(str(full_conv), str(tmp_path / "lenet_full_conv.caffemodel"), caffe.TEST)
    for name in conv.params:
        for a, b in zip(reloaded.params[name], conv.params[name]):
            np.testing.assert_array_equal(a.data, b.data)
    saved = file_blobs(tmp_path / "lenet_full_conv.caffemodel")
    np.testing.assert_array_equal(saved["ip1-conv"][0].reshape(500, -1), file_blobs(MODEL)["ip1"][0])

    # A 36 x 36 image gives a 3 x 3 map of classifications of its 28 x 28 windows at stride 4.
    scale = np.float32(fixture["scale"])
    canvas = np.zeros((1, 1, 36, 36), dtype=np.float32)
    canvas[0, 0, :28, :28] = fixture["images"][0] * scale
    canvas[0, 0, 8:, 8:] = np.maximum(canvas[0, 0, 8:, 8:], fixture["images"][1] * scale)
    reloaded.blobs["data"].reshape(1, 1, 36, 36)
    prob_map = reloaded.forward(data=canvas)["prob"]
    assert prob_map.shape == (1, 10, 3, 3)
    net.blobs["data"].reshape(9, 1, 28, 28)
    windows = np.stack([canvas[0, :, 4 * i:4 * i + 28, 4 * j:4 * j + 28] for i in range(3) for j in range(3)])
    expected = net.forward(data=windows)["prob"]
    np.testing.assert_allclose(prob_map[0].reshape(10, 9).T, expected, atol=1e-5)
    assert expected[0].argmax() == fixture["prob"][0].argmax() and expected[8].argmax() == fixture["prob"][1].argmax()


# -- writing LeNet with NetSpec and training it -------------------------------------------------------------


def lenet(lmdb: str, batch_size: int, test: bool = False):
    """The Caffe tutorial's LeNet, as written there (plus lr_mult and an Accuracy in the test net)."""
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb,
                             transform_param=dict(scale=0.00390625), ntop=2)
    mults = [dict(lr_mult=1), dict(lr_mult=2)]
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, stride=1, param=mults,
                            weight_filler=dict(type="xavier"), bias_filler=dict(type="constant"))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, stride=1, param=mults,
                            weight_filler=dict(type="xavier"), bias_filler=dict(type="constant"))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool2, num_output=500, param=mults, weight_filler=dict(type="xavier"),
                           bias_filler=dict(type="constant"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, param=mults, weight_filler=dict(type="xavier"),
                           bias_filler=dict(type="constant"))
    if test:
        n.accuracy = L.Accuracy(n.ip2, n.label)
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label)
    return n.to_proto()


def test_netspec_lenet_trains_like_the_prototxt_lenet(digits, tmp_path, monkeypatch):
    monkeypatch.chdir(digits)
    train, test = tmp_path / "lenet_train.prototxt", tmp_path / "lenet_test.prototxt"
    train.write_text(str(lenet("data/digits/train_lmdb", 64)))
    test.write_text(str(lenet("data/digits/test_lmdb", 100, test=True)))
    ours = tmp_path / "netspec_solver.prototxt"
    ours.write_text(f'train_net: "{train}"\ntest_net: "{test}"\n' + LENET_SOLVER)
    reference = tmp_path / "prototxt_solver.prototxt"
    reference.write_text(f'net: "{TRAIN_TEST}"\n' + LENET_SOLVER)

    # The NetSpec net is the repository's LeNet layer for layer (names aside: NetSpec names the data layer
    # after its first top).
    spec = caffe_pb2.NetParameter()
    spec.ParseFromString(lenet("x", 64).SerializeToString())
    from superneurons.io.prototxt import read_net

    repo = [lp for lp in read_net(str(TRAIN_TEST)).layer if lp.type != "Accuracy"]
    assert [lp.type for lp in spec.layer] == [lp.type for lp in repo if not len(lp.include) or
                                              lp.include[0].phase == caffe.TRAIN]
    assert spec.layer[1].convolution_param == repo[2].convolution_param
    assert list(spec.layer[1].param) == list(repo[2].param)

    a, b = caffe.get_solver(str(ours)), caffe.get_solver(str(reference))
    a.step(40)
    b.step(40)
    for name in b.net.params:  # same fillers, same batches, same updates
        for x, y in zip(a.net.params[name], b.net.params[name]):
            np.testing.assert_array_equal(x.data, y.data)
    accuracy = np.mean([a.test_nets[0].forward()["accuracy"] for _ in range(3)])
    assert accuracy >= 0.85, accuracy  # 0.91 after 40 iterations


@pytest.mark.gpu
def test_gpu_classification_and_training_follow_the_cpu(fixture, digits, tmp_path, monkeypatch):
    """On the GPU (SUPERNEURONS_TF32=0: FMA math): Caffe's probabilities, and ten LeNet iterations that end
    near the CPU's weights."""
    monkeypatch.setenv("SUPERNEURONS_TF32", "0")
    from superneurons.pycaffe import mode

    monkeypatch.setattr(mode, "_backends", {})  # a backend made now, with the setting above
    monkeypatch.chdir(digits)
    batch = int(fixture["batch_size"])
    x = fixture["images"][:batch, None] * np.float32(fixture["scale"])
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{TRAIN_TEST}"\n' + LENET_SOLVER)
    weights = {}
    for gpu in (True, False):
        caffe.set_mode_gpu() if gpu else caffe.set_mode_cpu()
        try:
            net = caffe.Net(str(DEPLOY), str(MODEL), caffe.TEST)
            net.blobs["data"].reshape(*x.shape)
            prob = net.forward(data=x)["prob"]
            assert np.abs(prob - fixture["prob"][:batch]).max() <= 1e-4
            solver = caffe.get_solver(str(solver_file))
            solver.step(10)
            weights[gpu] = {name: [b.data.copy() for b in blobs] for name, blobs in solver.net.params.items()}
        finally:
            caffe.set_mode_cpu()
    for name in weights[False]:
        for on_gpu, on_cpu in zip(weights[True][name], weights[False][name]):
            np.testing.assert_allclose(on_gpu, on_cpu, atol=1e-4)
