"""Files written by Caffe itself (tests/fixtures/caffe, made by tools/caffe_reference/make_fixture.sh).

Caffe trained the repository's LeNet for 400 iterations on the digits LMDB and wrote
lenet_iter_400.caffemodel/.solverstate; its extract_features dumped the logits and softmax of the 300
test digits, `caffe test` scored them, and `caffe train --snapshot` resumed 20 iterations from its own
solverstate. These tests check that our loader, forward pass, `classify`, `test` and resume give
Caffe's answers. Tolerances are float32 rounding: our logits equal Caffe's bit for bit, the softmax
differs by at most a few ulp (exp and the sum are computed in another order).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from harness import lmdb_digest, load_tool, parse_classify_output
from logs import messages
from PIL import Image

from superneurons.backend import get_backend
from superneurons.cli import main
from superneurons.data.datum import array_to_datum
from superneurons.data.lmdb_source import write_lmdb
from superneurons.graph.batch import set_batch
from superneurons.graph.build import build_graph
from superneurons.io.caffemodel import blob_to_array, load_weights, read_weights
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.logging import TrainLog
from superneurons.runtime.net import Net
from superneurons.solver.solver import Solver

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "caffe"
MODEL = FIX / "lenet_iter_400.caffemodel"
STATE = FIX / "lenet_iter_400.solverstate"
TRAIN_TEST = FIX / "lenet_train_test.prototxt"
DEPLOY = ROOT / "models" / "lenet" / "lenet.prototxt"
PARAMS = ["conv1", "conv2", "ip1", "ip2"]

PROB_ATOL = 4e-6  # observed: 2.4e-7 on one CPU, 1.25e-6 on another (NumPy picks its float32 exp by SIMD width)
LOGIT_ATOL = 1e-5  # observed: 0 (bit-identical)


@pytest.fixture(scope="module")
def caffe():
    with np.load(FIX / "caffe_lenet_outputs.npz") as f:
        return {k: f[k] for k in f.files}


def caffe_log_values(log: str, pattern: str) -> list[str]:
    return re.findall(pattern, (FIX / log).read_text())


def deploy_net(batch: int) -> Net:
    param = read_net(str(DEPLOY))
    set_batch(param, batch)
    return Net(build_graph(param, pb.TEST, source=str(DEPLOY)), get_backend("cpu"), train=False, seed=0)


def write_test_lmdb(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    write_lmdb(str(path), ((b"%08d" % i, array_to_datum(img[None], int(lab)).SerializeToString())
                           for i, (img, lab) in enumerate(zip(images, labels))))


# -- (a) the Caffe-written .caffemodel loads ---------------------------------------------------------------


def test_caffe_caffemodel_loads_into_our_lenet(digits_workdir, monkeypatch):
    monkeypatch.chdir(digits_workdir)  # the train/test net's Data layers read data/digits/* from here
    model = read_weights(str(MODEL))
    # Caffe's Net::ToProto of the TRAIN net: every layer in prototxt order, blobs on the four with params.
    assert [lp.name for lp in model.layer] == ["digits", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1",
                                               "ip2", "loss"]
    shapes = {lp.name: [tuple(b.shape.dim) for b in lp.blobs] for lp in model.layer if len(lp.blobs)}
    assert shapes == {"conv1": [(20, 1, 5, 5), (20,)], "conv2": [(50, 20, 5, 5), (50,)],
                      "ip1": [(500, 800), (500,)], "ip2": [(10, 500), (10,)]}
    # Every field Caffe wrote is one our schema knows: nothing is carried as an unknown field.
    assert len(model.SerializeToString()) == MODEL.stat().st_size

    for net in (deploy_net(4),
                Net(build_graph(read_net(str(TRAIN_TEST)), pb.TRAIN), get_backend("cpu"), train=True, seed=0),
                Net(build_graph(read_net(str(TRAIN_TEST)), pb.TEST), get_backend("cpu"), train=False, seed=0)):
        report = load_weights(net, str(MODEL))
        assert report.copied == PARAMS and report.missing == [] and report.ignored == []
        by_name = {lp.name: lp for lp in model.layer}
        for name in PARAMS:
            for k, decl in enumerate(net.graph.node(name).layer.params):
                np.testing.assert_array_equal(net.backend.to_host(decl.data),
                                              blob_to_array(by_name[name].blobs[k]))


# -- (b) our forward gives Caffe's outputs ---------------------------------------------------------------


def test_forward_matches_caffe_probabilities(caffe):
    images, scale = caffe["images"], np.float32(caffe["scale"])
    n, batch = len(images), int(caffe["batch_size"])
    net = deploy_net(batch)
    load_weights(net, str(MODEL))
    prob, ip2 = [], []
    for start in range(0, n, batch):
        x = images[start:start + batch, None].astype(np.float32) * scale  # Caffe's DataTransformer: pixel * scale
        net.backend.from_host(net.data["data"].array, x)
        net.forward()
        prob.append(net.blob("prob").copy())
        ip2.append(net.blob("ip2").copy())
    prob, ip2 = np.concatenate(prob), np.concatenate(ip2)
    assert np.abs(ip2 - caffe["ip2"]).max() <= LOGIT_ATOL
    assert np.abs(prob - caffe["prob"]).max() <= PROB_ATOL
    np.testing.assert_array_equal(prob.argmax(axis=1), caffe["prob"].argmax(axis=1))
    # The fixture itself: Caffe's answers are right on 290 of the 300 digits.
    assert int((caffe["prob"].argmax(axis=1) == caffe["labels"]).sum()) == 290


# -- (c) `superneurons classify` on image files -------------------------------------------------------------


def test_classify_png_files_gives_caffes_answers(caffe, tmp_path, capsys):
    n = 100
    paths = []
    for i in range(n):
        path = tmp_path / f"digit_{i:03d}.png"
        Image.fromarray(caffe["images"][i], "L").save(path)  # 8-bit grayscale: the LMDB's exact pixels
        paths.append(str(path))
    # LeNet's input is 1 channel, so classify reads the files as grayscale with no channel swap; the [0, 1]
    # image times --raw-scale 255 gives back the pixel values, and --scale 1/256 is the Data layer's scale.
    rc = main(["classify", "--model", str(DEPLOY), "--weights", str(MODEL), "--raw-scale", "255",
               "--scale", "0.00390625", "--top-k", "10", "--batch", "32", *paths])
    assert rc == 0
    printed = {k: [(i, p) for i, p, _label in v] for k, v in parse_classify_output(capsys.readouterr().out).items()}
    assert list(printed) == paths
    for i, path in enumerate(paths):
        rows = printed[path]
        assert len(rows) == 10
        assert rows[0][0] == int(caffe["prob"][i].argmax()), path
        for cls, p in rows:  # printed with 4 decimals
            assert abs(p - float(caffe["prob"][i, cls])) <= 5e-5 + PROB_ATOL, (path, cls)


# -- (d) `superneurons test` reproduces `caffe test` -------------------------------------------------------


def test_superneurons_test_reproduces_caffe_test(caffe, tmp_path, capsys):
    lmdb_path = tmp_path / "test_lmdb"
    write_test_lmdb(lmdb_path, caffe["images"], caffe["labels"])
    model = tmp_path / "lenet_train_test.prototxt"
    model.write_text(TRAIN_TEST.read_text().replace('"data/digits/test_lmdb"', f'"{lmdb_path}"'))
    iterations = len(caffe["batch_loss"])
    assert main(["test", "--model", str(model), "--weights", str(MODEL), "--iterations", str(iterations)]) == 0
    out = "\n".join(messages(capsys.readouterr().err))  # glog lines on stderr

    # What Caffe printed (caffe_test.log) and what we print, line for line for the accuracies.
    caffe_acc = caffe_log_values("caffe_test.log", r"\] Batch \d+, accuracy = (\S+)")
    ours_acc = re.findall(r"^Batch \d+, accuracy = (\S+)$", out, re.M)
    assert ours_acc == caffe_acc == ["0.97", "0.98", "0.95"]
    assert re.findall(r"^accuracy = (\S+)$", out, re.M) == \
        caffe_log_values("caffe_test.log", r"\] accuracy = (\S+)") == ["0.966667"]
    # Losses: Caffe's exact per-batch floats (extract_features) vs ours, to float32 rounding.
    ours_loss = [float(v) for v in re.findall(r"^Batch \d+, loss = (\S+)$", out, re.M)]
    np.testing.assert_allclose(ours_loss, caffe["batch_loss"], rtol=2e-5)
    (caffe_mean,) = caffe_log_values("caffe_test.log", r"\] Loss: (\S+)")
    (ours_mean,) = re.findall(r"^Loss: (\S+)$", out, re.M)
    np.testing.assert_allclose(float(ours_mean), float(caffe_mean), rtol=2e-5)


# -- (e) resuming from Caffe's .solverstate ---------------------------------------------------------------


@pytest.fixture(scope="module")
def resume_ref():
    with np.load(FIX / "caffe_lenet_resume.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def digits_workdir(tmp_path_factory, resume_ref):
    """data/digits regenerated; skipped if it is not the data Caffe trained on."""
    work = tmp_path_factory.mktemp("caffe_resume")
    load_tool("data/make_digits_lmdb").main(["--out", str(work / "data" / "digits")])
    digest = lmdb_digest(work / "data" / "digits" / "train_lmdb", int(resume_ref["train_records"]))
    if digest != str(resume_ref["train_sha256"]):
        pytest.skip("tools/data/make_digits_lmdb.py no longer writes the train records Caffe read for the fixture")
    return work


def resume_solver(work: Path) -> Solver:
    param = text_format.Parse((FIX / "lenet_solver_resume.prototxt").read_text(), pb.SolverParameter())
    param.net = str(TRAIN_TEST)
    param.snapshot_prefix = str(work / "out" / "lenet")
    # The solverstate names its model as Caffe wrote it (/tmp/caffe_fixture/...); the reader then finds
    # it beside the solverstate. A copy in a fresh folder makes sure that is the file used.
    state_dir = work / "state"
    state_dir.mkdir(exist_ok=True)
    for f in (MODEL, STATE):
        shutil.copy(f, state_dir / f.name)
    return Solver(param, str(work / "solver.prototxt"), log=TrainLog())


def test_caffe_solverstate_restores(digits_workdir, monkeypatch):
    monkeypatch.chdir(digits_workdir)
    solver = resume_solver(digits_workdir)
    solver.restore(str(digits_workdir / "state" / STATE.name))
    state = pb.SolverState()
    state.ParseFromString(STATE.read_bytes())
    assert state.learned_net == "/tmp/caffe_fixture/lenet_iter_400.caffemodel"
    assert solver.iter == 400 and solver.lr_policy.current_step == 0
    hists = solver.history_blobs()
    assert len(hists) == len(state.history) == 8
    for hist, blob in zip(hists, state.history):
        np.testing.assert_array_equal(solver.backend.to_host(hist), blob_to_array(blob))
    model = {lp.name: lp for lp in read_weights(str(MODEL)).layer}
    for name in PARAMS:
        for k, decl in enumerate(solver.net.graph.node(name).layer.params):
            np.testing.assert_array_equal(solver.backend.to_host(decl.data), blob_to_array(model[name].blobs[k]))


def test_resume_from_caffe_solverstate_trains_like_caffe(digits_workdir, resume_ref, monkeypatch):
    monkeypatch.chdir(digits_workdir)
    solver = resume_solver(digits_workdir)
    losses = []
    solver.callbacks.append(lambda s, it, loss: losses.append(loss))
    solver.solve(resume=str(digits_workdir / "state" / STATE.name))
    assert solver.iter == int(resume_ref["iter"]) == 420
    # Caffe's Data layer restarts at the first record on resume, as ours does without a .extra sidecar, so
    # both runs see the same 20 batches. Caffe's log has 6 significant digits.
    np.testing.assert_allclose(losses, resume_ref["losses"], rtol=2e-5)

    ours = read_weights(str(digits_workdir / "out" / "lenet_iter_420.caffemodel"))
    blobs = [(f"{lp.name}/{k}", blob_to_array(b)) for lp in ours.layer for k, b in enumerate(lp.blobs)]
    assert [key for key, _ in blobs] == list(resume_ref["keys"])
    for i, (key, w) in enumerate(blobs):
        assert w.shape == tuple(resume_ref[f"shape_{i}"]), key
        head = resume_ref[f"head_{i}"]
        assert np.abs(w[:len(head)] - head).max() <= 1e-6, key  # observed: 3e-8; 20 steps move weights ~1e-3
        w64 = w.astype(np.float64)
        assert abs(w64.sum() - resume_ref[f"sum_{i}"]) <= 1e-7 * w.size, key
        np.testing.assert_allclose((w64 ** 2).sum(), resume_ref[f"sumsq_{i}"], rtol=1e-5, err_msg=key)
    state = pb.SolverState()
    state.ParseFromString((digits_workdir / "out" / "lenet_iter_420.solverstate").read_bytes())
    for i, blob in enumerate(state.history):
        h = blob_to_array(blob).astype(np.float64)
        absmax = resume_ref[f"hist_absmax_{i}"]
        np.testing.assert_allclose(np.abs(h).max(), absmax, rtol=1e-4)
        assert abs(h.sum() - resume_ref[f"hist_sum_{i}"]) <= 1e-6 * absmax * h.size
