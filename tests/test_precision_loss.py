"""tools/bench/precision_loss.py end to end on the CPU with its tiny net: the report's structure, its
differences against a recomputation from the runs, and float32 runs equal bit for bit for the same seed."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tools.bench import precision_loss

TINY = ["--net", "tiny", "--device", "cpu", "--batch", "16", "--held-out", "32", "--iterations", "6",
        "--base-lr", "0.1", "--timeout", "300"]


def _run(tmp_path, name, extra):
    out = tmp_path / name
    rc = precision_loss.main(TINY + ["--out", str(out), "--data", str(tmp_path / "data")] + extra)
    assert rc == 0
    return json.loads((out / "precision_loss.json").read_text())


def test_precision_loss_reports_each_seed_against_float32_and_repeats_float32_bit_for_bit(tmp_path):
    doc = _run(tmp_path, "a", ["--precisions", "fp32,bf16", "--seeds", "11,12"])
    assert doc["seeds"] == [11, 12] and doc["errors"] == {}
    assert doc["images"] == 6 * 16 and doc["held_out"] == 32  # one pass over the training images by default
    floor = doc["floor"]
    right, wrong = 0.91, 0.01  # 10% of the labels drawn from 10 classes: 0.9 + 0.1 / 10 stay right
    assert math.isclose(floor, -right * math.log(right) - 9 * wrong * math.log(wrong), rel_tol=1e-12)
    runs, summary = doc["runs"], doc["summary"]
    for p in ("fp32", "bf16"):
        for s in ("11", "12"):
            r = runs[p][s]
            assert len(r["losses"]) == 6 and all(math.isfinite(x) for x in r["losses"])
            assert math.isfinite(r["final_loss"]) and 0.0 <= r["accuracy"] <= 1.0
    # different initial weights give different runs
    assert runs["fp32"]["11"]["losses"] != runs["fp32"]["12"]["losses"]
    ref = [runs["fp32"][s]["final_loss"] for s in ("11", "12")]
    diffs = [runs["bf16"][s]["final_loss"] / runs["fp32"][s]["final_loss"] - 1 for s in ("11", "12")]
    assert summary["bf16"]["relative_difference"] == {"11": diffs[0], "12": diffs[1]}
    assert math.isclose(summary["bf16"]["mean_difference"], float(np.mean(diffs)), rel_tol=1e-12)
    assert math.isclose(summary["bf16"]["std_difference"], float(np.std(diffs, ddof=1)), rel_tol=1e-12)
    assert math.isclose(summary["fp32"]["seed_spread"], float(np.std(ref, ddof=1) / np.mean(ref)), rel_tol=1e-12)
    excess = [(runs["bf16"][s]["final_loss"] - floor) / (runs["fp32"][s]["final_loss"] - floor) - 1 for s in ("11", "12")]
    assert math.isclose(summary["bf16"]["mean_excess_difference"], float(np.mean(excess)), rel_tol=1e-9)
    (target,) = doc["targets"]
    assert target["name"] == "precision loss bf16" and target["measured"] == summary["bf16"]["mean_difference"]
    assert target["met"] == (abs(target["measured"]) <= 0.02)
    table = doc["tables"][0]
    assert table["header"][:3] == ["precision", "seed 11", "seed 12"] and [r[0] for r in table["rows"]] == ["fp32", "bf16"]

    # float32 again, seed 12 alone (a fresh process, no seed 11 before it): the same numbers, bit for bit
    again = _run(tmp_path, "b", ["--precisions", "fp32", "--seeds", "12"])
    assert again["runs"]["fp32"]["12"]["losses"] == runs["fp32"]["12"]["losses"]
    assert again["runs"]["fp32"]["12"]["final_loss"] == runs["fp32"]["12"]["final_loss"]
    assert again["targets"] == []


def test_the_schedule_decays_to_near_zero_and_the_test_pass_reads_the_held_out_images_once(tmp_path):
    import h5py

    from superneurons.solver.lr_policy import LrPolicy

    data = precision_loss.make_data(tmp_path, 64, precision_loss.SIDES["tiny"], 0.1, held_out=32)
    param = precision_loss.solver_param("tiny", data, 16, 300, 32, 1701, 0.01)
    policy = LrPolicy(param, "precision_loss")
    assert math.isclose(policy.rate(0), 0.01, rel_tol=1e-6) and policy.rate(299) < 0.01 / 200
    assert list(param.test_iter) == [2] and param.test_interval == 0
    sources = [n.layer[0].hdf5_data_param.source for n in (param.train_net_param, param.test_net_param[0])]
    assert sources == [str(data[0]), str(data[1])]

    def rows(listing):
        out = []
        for name in listing.read_text().split():
            with h5py.File(name) as f:
                assert f["data"].shape[1:] == (3, 16, 16)
                out += [(f["data"][i].tobytes(), float(f["label"][i])) for i in range(f["label"].shape[0])]
        return out

    train, test = rows(data[0]), rows(data[1])
    assert len(train) == 64 and len(test) == 32 and {label for _, label in train + test} <= set(range(10))
    assert not {x for x, _ in train} & {x for x, _ in test}  # never trained on
    # the data set is a function of its parameters alone: a second call reads the same files
    assert precision_loss.make_data(tmp_path, 64, 16, 0.1, held_out=32) == data
    # without held-out images the TEST pass reads the training images
    same = precision_loss.make_data(tmp_path, 64, 16, 0.1)
    assert same[0] == same[1] and same[0] != data[0]


def test_merge_reports_runs_of_several_gpus_as_one_and_refuses_another_design(tmp_path, capsys):
    """Seeds trained apart (as one process per GPU would) and merged give the report of all of them: each seed's
    difference as in its own file, the mean over every seed and its standard error."""
    first = _run(tmp_path, "first", ["--precisions", "fp32,bf16", "--seeds", "21,22"])
    second = _run(tmp_path, "second", ["--precisions", "fp32,bf16", "--seeds", "23"])
    files = [str(tmp_path / d / "precision_loss.json") for d in ("first", "second")]
    assert precision_loss.main(["--merge", ",".join(files), "--out", str(tmp_path / "merged")]) == 0
    doc = json.loads((tmp_path / "merged" / "precision_loss.json").read_text())
    assert doc["seeds"] == [21, 22, 23] and doc["net"] == "tiny" and doc["iterations"] == 6
    diffs = {**first["summary"]["bf16"]["relative_difference"], **second["summary"]["bf16"]["relative_difference"]}
    bf16 = doc["summary"]["bf16"]
    assert bf16["relative_difference"] == diffs
    values = list(diffs.values())
    assert math.isclose(bf16["mean_difference"], float(np.mean(values)), rel_tol=1e-12)
    assert math.isclose(bf16["standard_error"], float(np.std(values, ddof=1)) / math.sqrt(3), rel_tol=1e-12)
    assert "standard error" in doc["targets"][0]["note"]
    # a file of another design, or a seed twice, is refused with what differs
    other = json.loads(open(files[1]).read())
    other["label_noise"] = 0.2
    (tmp_path / "other.json").write_text(json.dumps(other))
    for bad, why in (([files[0], str(tmp_path / "other.json")], "label_noise 0.2 against 0.1"),
                     ([files[0], files[0]], "seed 21 of fp32 is in an earlier file too")):
        with pytest.raises(SystemExit, match=why):
            precision_loss.main(["--merge", ",".join(bad), "--out", str(tmp_path / "bad")])


def test_pytorch_s_runs_start_from_our_weights_train_as_ours_and_are_compared_with_their_own_float32(tmp_path):
    """torch-fp32 is the same net, initial weights, batches and Caffe update in PyTorch: its losses follow ours
    to float32 rounding. torch-bf16's difference is taken against torch-fp32, and only ours carry targets."""
    pytest.importorskip("torch", reason="torch is not installed: PyTorch's runs cannot be built")
    doc = _run(tmp_path, "t", ["--precisions", "fp32,torch-fp32,torch-bf16", "--seeds", "11,12"])
    runs, summary = doc["runs"], doc["summary"]
    for s in ("11", "12"):
        ours, theirs = runs["fp32"][s], runs["torch-fp32"][s]
        np.testing.assert_allclose(theirs["losses"], ours["losses"], rtol=1e-5)
        assert math.isclose(theirs["final_loss"], ours["final_loss"], rel_tol=1e-5)
        assert theirs["accuracy"] == ours["accuracy"]
        assert runs["torch-bf16"][s]["losses"] != theirs["losses"]  # autocast did round
    diffs = {s: runs["torch-bf16"][s]["final_loss"] / runs["torch-fp32"][s]["final_loss"] - 1 for s in ("11", "12")}
    assert summary["torch-bf16"]["relative_difference"] == diffs
    assert summary["torch-fp32"]["seed_spread"] is not None and "mean_difference" not in summary["torch-fp32"]
    assert doc["targets"] == []  # fp32 alone of ours: nothing to hold to a target
    with pytest.raises(SystemExit, match="torch-bf32"):
        precision_loss.main(TINY + ["--out", str(tmp_path / "x"), "--precisions", "fp32,torch-bf32"])


def test_pytorch_s_float16_loss_scale_halves_on_an_overflow_and_doubles_after_clean_steps():
    from tools.bench.precision_loss_torch import LossScale

    scale = LossScale(dynamic=True, start=1024.0, growth_interval=3)
    assert scale.step(True) and scale.step(True) and scale.scale == 1024.0
    assert not scale.step(False) and scale.scale == 512.0  # skipped, lowered, the clean count restarts
    assert scale.step(True) and scale.step(True) and scale.scale == 512.0
    assert scale.step(True) and scale.scale == 1024.0  # three clean steps in a row
    fixed = LossScale(dynamic=False)
    assert fixed.step(False) and fixed.scale == 1.0  # float32 and bfloat16 are not scaled
