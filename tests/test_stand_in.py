"""`summary`, `memory` and `time` on a net whose data is not on this machine (stand-in inputs from the layer's
own fields or --input-shape, and lines saying what was assumed), and `time` running backward on a deploy net."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from superneurons.cli import main

REPO = Path(__file__).resolve().parents[1]
LENET = REPO / "models/lenet/lenet_train_test.prototxt"
LENET_DEPLOY = REPO / "models/lenet/lenet.prototxt"


@pytest.fixture
def absent_data(tmp_path):
    """LeNet's train/test net reading LMDBs that do not exist, one of them with a crop_size."""
    text = LENET.read_text().replace("data/digits/train_lmdb", str(tmp_path / "nowhere/train_lmdb"))
    text = text.replace("data/digits/test_lmdb", str(tmp_path / "nowhere/test_lmdb"))
    path = tmp_path / "lenet_absent.prototxt"
    path.write_text(text)
    cropped = tmp_path / "lenet_cropped.prototxt"
    cropped.write_text(text.replace("scale: 0.00390625", "scale: 0.00390625 crop_size: 24 force_gray: true", 1))
    return path, cropped


def _stderr_lines(capsys) -> tuple[str, list[str]]:
    captured = capsys.readouterr()
    return captured.out, captured.err.splitlines()


def test_summary_sizes_the_data_from_crop_size_and_says_so(absent_data, capsys):
    _, cropped = absent_data
    assert main(["summary", "--model", str(cropped)]) == 0
    out, err = _stderr_lines(capsys)
    assert len(err) == 1 and "source" in err[0] and "not found" in err[0]
    assert "assumed data 64x1x24x24 (batch_size 64, 1 channels, crop_size 24), label 64 (batch_size)" in err[0]
    assert "64 1 24 24" in out and "64 20 20 20" in out  # conv1 (5x5) on the 24x24 crop


def test_the_assumed_shapes_say_the_batch_given_with_the_flag(absent_data, capsys):
    _, cropped = absent_data
    assert main(["summary", "--model", str(cropped), "--batch", "2"]) == 0
    out, err = _stderr_lines(capsys)
    assert "assumed data 2x1x24x24 (--batch 2, 1 channels, crop_size 24), label 2 (--batch)" in err[0]
    assert "batch_size 64" not in err[0] and "2 1 24 24" in out


def test_without_shape_fields_the_error_names_the_flag_and_the_flag_works(absent_data, capsys):
    path, _ = absent_data
    assert main(["summary", "--model", str(path)]) == 1
    out, err = _stderr_lines(capsys)
    assert len(err) == 1 and "does not exist here" in err[0] and "--input-shape data=N,C,H,W" in err[0]
    assert main(["summary", "--model", str(path), "--input-shape", "data=4,1,28,28"]) == 0
    out, err = _stderr_lines(capsys)
    assert "assumed data 4x1x28x28 (--input-shape), label 4 (as data)" in err[0]
    assert "4 20 24 24" in out and "Activations" in out


def test_memory_and_time_on_stand_in_inputs(absent_data, capsys):
    path, _ = absent_data
    assert main(["memory", "--model", str(path), "--input-shape", "data=8,1,28,28", "--json"]) == 0
    out, err = _stderr_lines(capsys)
    assert json.loads(out)["batch"] == 8 and "--input-shape" in err[0]
    assert main(["time", "--model", str(path), "--input-shape", "data=2,1,28,28", "--iterations", "1",
                 "--json"]) == 0
    out, err = _stderr_lines(capsys)
    layers = {rec["name"]: rec for rec in json.loads(out)["layers"]}
    assert layers["conv1"]["backward_ms"] > 0


def test_input_shape_resizes_an_input_layer_and_unknown_names_are_refused(capsys):
    assert main(["summary", "--model", str(LENET_DEPLOY), "--input-shape", "data=3,1,32,32"]) == 0
    out, err = _stderr_lines(capsys)
    assert "3 1 32 32" in out and "data 3x1x32x32 (--input-shape)" in err[0]
    assert main(["summary", "--model", str(LENET_DEPLOY), "--input-shape", "pixels=3,1,32,32"]) == 1
    _, err = _stderr_lines(capsys)
    assert "'pixels', which no input layer produces (inputs: data)" in err[0]
    assert main(["summary", "--model", str(LENET_DEPLOY), "--input-shape", "data=3,x"]) == 1
    assert "expected BLOB=N,C,H,W" in capsys.readouterr().err


def test_time_runs_every_layers_backward_on_a_deploy_net(capsys):
    assert main(["time", "--model", str(LENET_DEPLOY), "--iterations", "1", "--batch", "2", "--json"]) == 0
    out, err = _stderr_lines(capsys)
    assert "no loss in the net: timing backward as if prob fed a loss of weight 1" in err[0]
    layers = {rec["name"]: rec for rec in json.loads(out)["layers"]}
    for name in ("conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "prob"):
        assert layers[name]["backward_ms"] > 0, name
    assert layers["data"]["backward_ms"] == 0


def test_time_seeds_the_outputs_of_the_timed_phase_only(tmp_path, capsys):
    """A TEST-only layer writing the same top as the TRAIN net's last layer must not take the loss weight."""
    text = LENET_DEPLOY.read_text() + ('layer { name: "prob_test" type: "Softmax" bottom: "ip2" top: "prob" '
                                       'include { phase: TEST } }\n')
    text = text.replace('layer {\n  name: "prob"', 'layer {\n  name: "prob"\n  include { phase: TRAIN }', 1)
    path = tmp_path / "two_phase.prototxt"
    path.write_text(text)
    assert main(["time", "--model", str(path), "--iterations", "1", "--batch", "2", "--json"]) == 0
    out, err = _stderr_lines(capsys)
    layers = {rec["name"]: rec for rec in json.loads(out)["layers"]}
    assert "prob_test" not in layers and layers["conv1"]["backward_ms"] > 0
