"""`superneurons classify`: a tiny deploy net with known weights, real PNG files, and the same preprocessing
redone in NumPy to predict what must be printed."""
from __future__ import annotations

import numpy as np
import pytest
from harness import parse_classify_output
from PIL import Image

from superneurons.backend import get_backend
from superneurons.cli import main
from superneurons.graph.build import build_graph
from superneurons.io.binaryproto import write_mean
from superneurons.io.caffemodel import save_weights
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

H = W = 6
CLASSES = 7
DEPLOY = f"""name: "tiny"
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 3 dim: {H} dim: {W} }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
        inner_product_param {{ num_output: {CLASSES} weight_filler {{ type: "gaussian" std: 0.01 }}
                               bias_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "prob" type: "Softmax" bottom: "fc" top: "prob" }}
"""


@pytest.fixture
def setup(tmp_path):
    model = tmp_path / "deploy.prototxt"
    model.write_text(DEPLOY)
    net = Net(build_graph(read_net(str(model)), pb.TEST), get_backend("cpu"), train=False, seed=3)
    weights = tmp_path / "tiny.caffemodel"
    save_weights(net, str(weights))
    fc = net.graph.node("fc").layer.params
    w, b = (net.backend.to_host(d.data).astype(np.float64) for d in fc)
    rng = np.random.default_rng(0)
    images = []
    for i, side in enumerate((H, H + 4)):  # the second image is larger: it tests --resize + center crop
        pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        path = tmp_path / f"img{i}.png"
        Image.fromarray(pixels, "RGB").save(path)
        images.append((str(path), pixels))
    return model, weights, w, b, images


def expected_probs(pixels, w, b, mean, scale=1.0, swap=(2, 1, 0)):
    x = pixels.astype(np.float64) / 255.0
    h, wd = x.shape[:2]
    t, l = (h - H) // 2, (wd - W) // 2
    x = x[t:t + H, l:l + W].transpose(2, 0, 1)[list(swap)] * 255.0  # center crop, CHW, RGB -> BGR, raw scale
    x = (x - mean) * scale
    z = w @ x.ravel() + b
    e = np.exp(z - z.max())
    return e / e.sum()


def test_classify_matches_numpy(setup, tmp_path, capsys):
    model, weights, w, b, images = setup
    mean = np.array([100.0, 120.0, 130.0]).reshape(3, 1, 1)
    labels = tmp_path / "labels.txt"
    labels.write_text("".join(f"n0{c} thing {c}\n" for c in range(CLASSES)))
    paths = [p for p, _ in images]
    rc = main(["classify", "--model", str(model), "--weights", str(weights), "--mean-value", "100,120,130",
               "--scale", "0.5", "--resize", f"{H + 4},{W + 4}", "--labels", str(labels), "--top-k", "3",
               paths[1]])
    assert rc == 0
    got = parse_classify_output(capsys.readouterr().out)[paths[1]]
    p = expected_probs(images[1][1], w, b, mean, scale=0.5)
    assert [c for c, _, _ in got] == list(np.argsort(-p)[:3])
    assert got[0][2] == f"n0{got[0][0]} thing {got[0][0]}"
    np.testing.assert_allclose([v for _, v, _ in got], np.sort(p)[::-1][:3], atol=1e-4)


def test_classify_two_images_batched_with_mean_file(setup, tmp_path, capsys):
    """Two images through a batch of 1 (two forward passes), a mean image larger than the input."""
    model, weights, w, b, images = setup
    rng = np.random.default_rng(1)
    mean_img = rng.uniform(0, 255, size=(3, H + 2, W + 2)).astype(np.float32)
    mean_file = tmp_path / "mean.binaryproto"
    write_mean(str(mean_file), mean_img)
    small = images[0][0]
    rc = main(["classify", "--model", str(model), "--weights", str(weights), "--mean-file", str(mean_file),
               "--batch", "1", "--top-k", "1", small, small])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count(f"{small}:") == 2
    got = parse_classify_output(out)[small]
    p = expected_probs(images[0][1], w, b, mean_img[:, 1:1 + H, 1:1 + W].astype(np.float64))
    assert got[0][0] == int(np.argmax(p))
    assert got[0][1] == pytest.approx(p.max(), abs=1e-4)
    assert got[0][2] == f"class {got[0][0]}"


def test_classify_errors_name_files_and_numbers(setup, tmp_path, capsys):
    model, weights, _, _, images = setup
    big = images[1][0]
    assert main(["classify", "--model", str(model), "--weights", str(weights), big]) == 0  # resized down to 6x6
    capsys.readouterr()
    labels = tmp_path / "few.txt"
    labels.write_text("a\nb\n")
    assert main(["classify", "--model", str(model), "--weights", str(weights), "--labels", str(labels),
                 images[0][0]]) == 1
    err = capsys.readouterr().err
    assert str(labels) in err and "2 label line(s)" in err and "7 classes" in err
    assert main(["classify", "--model", str(model), "--weights", str(weights), "--mean-value", "1,2",
                 images[0][0]]) == 1
    assert "2 values" in capsys.readouterr().err
    missing = str(tmp_path / "nope.png")
    assert main(["classify", "--model", str(model), "--weights", str(weights), missing]) == 1
    assert missing in capsys.readouterr().err


def test_channel_swap_none_keeps_rgb(setup, capsys):
    model, weights, w, b, images = setup
    path, pixels = images[0]
    assert main(["classify", "--model", str(model), "--weights", str(weights), "--channel-swap", "none",
                 "--raw-scale", "1", "--top-k", str(CLASSES), path]) == 0
    got = parse_classify_output(capsys.readouterr().out)[path]
    x = pixels.astype(np.float64) / 255.0
    z = w @ x.transpose(2, 0, 1).ravel() + b
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    assert [c for c, _, _ in got] == list(np.argsort(-p))
    np.testing.assert_allclose([v for _, v, _ in got], np.sort(p)[::-1], atol=6e-5)  # printed with 4 decimals


def test_grayscale_net_reads_images_as_gray(tmp_path, capsys):
    model = tmp_path / "gray.prototxt"
    model.write_text(DEPLOY.replace("dim: 1 dim: 3", "dim: 1 dim: 1"))
    net = Net(build_graph(read_net(str(model)), pb.TEST), get_backend("cpu"), train=False, seed=5)
    weights = tmp_path / "gray.caffemodel"
    save_weights(net, str(weights))
    w, b = (net.backend.to_host(d.data).astype(np.float64) for d in net.graph.node("fc").layer.params)
    gray = np.random.default_rng(2).integers(0, 256, size=(H, W), dtype=np.uint8)
    path = tmp_path / "g.png"
    Image.fromarray(gray, "L").save(path)
    assert main(["classify", "--model", str(model), "--weights", str(weights), "--top-k", "1", str(path)]) == 0
    got = parse_classify_output(capsys.readouterr().out)[str(path)]
    assert got[0][0] == int(np.argmax(w @ gray.astype(np.float64).ravel() + b))
    assert main(["classify", "--model", str(model), "--weights", str(weights), "--channel-swap", "2,1,0",
                 str(path)]) == 1
    assert "1 channel(s)" in capsys.readouterr().err
