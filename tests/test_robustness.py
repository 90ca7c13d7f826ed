"""Damaged and mistaken input files give one line naming the file and what is wrong, never a traceback,
a signal or a hang. Each test is one class of input the fuzzer (tools/fuzz) found."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_solver import TINY_NET
from test_train_cli import SOLVER

from superneurons.backend.cpu import CpuBackend
from superneurons.cli import main
from superneurons.data.datum import array_to_datum, datum_to_array
from superneurons.data.lmdb_source import LmdbReader, check_lmdb_file, write_lmdb
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import parse_text, read_net
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from superneurons.solver.lr_policy import LrPolicy
from superneurons.solver.snapshot import read_extra


def _one_line_error(capsys) -> str:
    """The CLI's error line: the last line on stderr, the only one of its form (log lines may precede it)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("superneurons ") and ": error: " in line]
    assert errors == lines[-1:] and "Traceback" not in err, err
    return lines[-1]


# -- prototxt text ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, kind, offset, line_col", [
    (b'name: "x"\nlayer { name: "a\xff" }\n', "byte 0xff, not UTF-8", 26, "2:17"),
    (b'name: "x"\n  \x00layer {}\n', "a NUL byte", 12, "2:3"),
    (b'name: "\xc3"', "byte 0xc3, not UTF-8", 7, "1:8"),  # a sequence cut short
])
def test_prototxt_that_is_not_text_names_the_byte(tmp_path, bad, kind, offset, line_col):
    path = tmp_path / "net.prototxt"
    path.write_bytes(bad)
    with pytest.raises(UserError) as e:
        read_net(str(path))
    assert str(e.value) == f"{path}:{line_col}: {kind}{' text' if 'UTF' in kind else ''} at byte offset {offset}; " \
                           f"expected a prototxt file"


# -- sizes ----------------------------------------------------------------------------------------
BIG = """name: "big"
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 100000 dim: 300000 dim: 100000 } } }
layer { name: "relu" type: "ReLU" bottom: "data" top: "out" }
"""


def test_dims_too_large_are_refused_before_allocation_naming_the_blob(tmp_path, capsys):
    path = tmp_path / "big.prototxt"
    path.write_text(BIG)
    assert main(["summary", "--model", str(path)]) == 0  # allocates nothing: shows what it would need
    capsys.readouterr()
    assert main(["time", "--model", str(path), "--iterations", "1"]) == 1
    err = _one_line_error(capsys)
    assert f"{path}: blob 'data' (top of layer 'in', shape 100000x300000x100000) needs " \
           f"{100000 * 300000 * 100000 * 4} bytes" in err


def test_product_beyond_int64_is_refused_too():
    text = BIG.replace("dim: 100000 dim: 300000", "dim: 1000000000000 dim: 3000000000000000")
    graph = build_graph(parse_text(text, pb.NetParameter()), pb.TEST, source="big.prototxt")
    with pytest.raises(UserError, match=r"big.prototxt: blob 'data' .* needs \d+ bytes"):
        Net(graph, CpuBackend(), train=False)


def test_pool_larger_than_the_machine_is_refused():
    graph = build_graph(parse_text(TINY_NET, pb.NetParameter()), pb.TRAIN, source="tiny.prototxt")
    with pytest.raises(UserError, match=r"tiny.prototxt: the memory pool needs 1152921504606846976 bytes"):
        Net(graph, CpuBackend(), pool_bytes=1 << 60)


# -- in-place layers --------------------------------------------------------------------------------
HEAD = """name: "t"
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 4 weight_filler { type: "xavier" } } }
"""


def test_in_place_layer_on_a_blob_another_layer_read_is_refused_as_in_caffe():
    # Caffe's insert_splits gives relu the bottom ip1_ip1_0_split_1 and keeps its top ip1, which Net::Init
    # then refuses: "Top blob 'ip1' produced by multiple sources". Before, the pool raised KeyError.
    text = HEAD + """
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 4 } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip2" top: "s" }
"""
    with pytest.raises(UserError) as e:
        build_graph(parse_text(text, pb.NetParameter()), pb.TRAIN, source="n.prototxt")
    assert str(e.value).startswith("n.prototxt: layer 'relu': top blob 'ip1' is produced by multiple sources "
                                   "(first by layer 'ip1'); it works in place on 'ip1', which another layer also "
                                   "reads")


def test_two_layers_writing_one_blob_is_refused():
    text = HEAD + 'layer { name: "again" type: "Input" top: "ip1" input_param { shape { dim: 2 dim: 4 } } }\n'
    with pytest.raises(UserError, match=r"layer 'again': top blob 'ip1' is produced by multiple sources "
                                        r"\(first by layer 'ip1'\)$"):
        build_graph(parse_text(text, pb.NetParameter()), pb.TEST)


def test_in_place_before_a_fan_out_still_runs():
    # Caffe's SplitLayerInsertionTest.TestWithInPlace: relu in place, then two readers of its output.
    text = HEAD + """
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 4 } }
layer { name: "sum" type: "Eltwise" bottom: "ip1" bottom: "ip2" top: "s" }
layer { name: "loss" type: "Reduction" bottom: "s" top: "loss" loss_weight: 1 }
"""
    graph = build_graph(parse_text(text, pb.NetParameter()), pb.TRAIN)
    net = Net(graph, CpuBackend(), seed=3)
    net.forward()
    net.backward()
    relu = [n for n in graph.nodes if n.name == "relu"][0]
    assert relu.bottoms == relu.tops == ["ip1"]


# -- fillers ----------------------------------------------------------------------------------------
def test_unknown_filler_is_caught_at_build_naming_file_and_layer(tmp_path, capsys):
    path = tmp_path / "f.prototxt"
    path.write_text(HEAD.replace('"xavier"', '"xaviar"'))
    assert main(["summary", "--model", str(path)]) == 1
    err = _one_line_error(capsys)
    line = HEAD.split("\n").index(next(x for x in HEAD.split("\n") if 'name: "ip1"' in x)) + 1
    assert f"{path}:{line}: layer 'ip1' (InnerProduct): parameter 0: unknown filler type 'xaviar'" in err


def test_negative_gaussian_std_is_caught_at_build():
    text = HEAD.replace('type: "xavier"', 'type: "gaussian" std: -1')
    with pytest.raises(UserError, match="layer 'ip1' .*gaussian filler needs std >= 0, got -1"):
        build_graph(parse_text(text, pb.NetParameter()), pb.TEST)


# -- learning-rate policies -----------------------------------------------------------------------------
def _policy(**kw) -> LrPolicy:
    return LrPolicy(pb.SolverParameter(base_lr=0.01, **kw), "s.prototxt")


def test_inv_with_a_gamma_that_reaches_zero_is_refused_up_front():
    with pytest.raises(UserError, match=r'^s.prototxt: lr_policy "inv" with gamma -0.1 makes 1 \+ gamma \* iter'
                                        r' <= 0 before max_iter 100'):
        _policy(lr_policy="inv", gamma=-0.1, power=0.75, max_iter=100)
    assert _policy(lr_policy="inv", gamma=-0.001, power=0.75, max_iter=100).rate(50) == \
        pytest.approx(0.01 * (1 - 0.001 * 50) ** -0.75)


@pytest.mark.parametrize("kw, it", [
    (dict(lr_policy="inv", gamma=-0.001, power=0.75, max_iter=100), 1000),  # past max_iter (a resumed state)
    (dict(lr_policy="poly", power=0.5, max_iter=10), 20),  # negative base, fractional power: complex
    (dict(lr_policy="exp", gamma=10.0), 1000),  # overflow
    (dict(lr_policy="step", gamma=0.0, stepsize=1), -3),  # negative iteration: 0 ** -3
])
def test_rates_that_are_not_finite_reals_are_errors_naming_the_policy(kw, it):
    with pytest.raises(UserError, match=r"^s.prototxt: (lr_policy \"\w+\" gives no finite learning rate at "
                                        r"iteration|iteration -3 is negative)"):
        _policy(**kw).rate(it)


def test_sigmoid_overflow_decays_to_zero_as_in_caffe():
    assert _policy(lr_policy="sigmoid", gamma=-1.0, stepsize=10).rate(2000) == 0.0


# -- solverstate and its sidecar -------------------------------------------------------------------------
@pytest.fixture
def trained(tmp_path, monkeypatch, capsys):
    (tmp_path / "conf/nets").mkdir(parents=True)
    (tmp_path / "conf/nets/tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "conf/solver.prototxt").write_text(SOLVER.replace("max_iter: 6", "max_iter: 4"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--solver", "conf/solver.prototxt"]) == 0
    capsys.readouterr()
    return tmp_path / "out/tiny_iter_4.solverstate"


def _resume(state) -> list[str]:
    return ["train", "--solver", "conf/solver.prototxt", "--snapshot", str(state)]


@pytest.mark.parametrize("field, value, message", [
    ("iter", -5, "field iter is -5; it must be >= 0"),
    ("current_step", -1, "field current_step is -1; it must be >= 0"),
])
def test_solverstate_negative_counters(trained, capsys, field, value, message):
    state = pb.SolverState()
    state.ParseFromString(trained.read_bytes())
    setattr(state, field, value)
    trained.write_bytes(state.SerializeToString())
    assert main(_resume(trained)) == 1
    assert _one_line_error(capsys).endswith(f"{trained}: {message}")


def test_solverstate_learned_net_not_utf8(trained, capsys):
    data = trained.read_bytes().replace(b"out/tiny_iter_4.caffemodel", b"out/tin\xff_iter_4.caffemodel")
    trained.write_bytes(data)
    assert main(_resume(trained)) == 1
    assert _one_line_error(capsys).endswith(f"{trained}: field learned_net is not UTF-8 text (byte 0xff at offset "
                                            f"7 of the path)")


@pytest.mark.parametrize("extra, message", [
    ([1, 2], "the snapshot sidecar must be a JSON object, got list"),
    ({"seed": "abc"}, "field seed is 'abc'; expected an integer in [0, 2^63)"),
    ({"seed": -1}, "field seed is -1; expected an integer in [0, 2^63)"),
    ({"seed": True}, "field seed is True; expected an integer in [0, 2^63)"),
    ({"test_passes": 3}, "field test_passes is 3; expected a list of integers >= 0"),
    ({"test_passes": ["x"]}, "field test_passes is ['x']; expected a list of integers >= 0"),
    ({"layers": []}, "field layers is []; expected an object of layer states"),
    ({"loss_scale": None}, "field loss_scale is None; expected an object with the scale and its count of clean "
                           "iterations"),
    ({"loss_scale": [65536.0, 3]}, "field loss_scale is [65536.0, 3]; expected an object with the scale and its "
                                   "count of clean iterations"),
    ({"version": 7}, "field version is 7; this SuperNeurons reads version 1"),
])
def test_sidecar_with_wrong_types_is_one_line(tmp_path, extra, message):
    path = tmp_path / "s.solverstate.extra"
    path.write_text(json.dumps(extra))
    with pytest.raises(UserError) as e:
        read_extra(str(path))
    assert str(e.value) == f"{path}: {message}"


def test_sidecar_not_json_or_too_deep(tmp_path):
    path = tmp_path / "s.extra"
    for data in (b"\xff\xfe", b"{", b"[" * 100000):
        path.write_bytes(data)
        with pytest.raises(UserError, match="unreadable snapshot sidecar"):
            read_extra(str(path))


# -- Datum and LMDB -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [(-1, -1, 3), (0, 2, 2), (1, -2, -2)])
def test_datum_with_non_positive_dimensions(dims):
    datum = array_to_datum(np.zeros((1, 1, 3), np.uint8))
    datum.channels, datum.height, datum.width = dims
    with pytest.raises(UserError, match=r"^db: record 7: Datum has channels"):
        datum_to_array(datum, "db: record 7")


def test_datum_whose_size_disagrees_with_its_data():
    datum = array_to_datum(np.zeros((1, 2, 3), np.uint8))
    datum.width = 4
    with pytest.raises(UserError, match=r"^db: record 0: Datum says 1x2x4 = 8 values but holds 6 bytes"):
        datum_to_array(datum, "db: record 0")


def _lmdb(path, n=200):
    rng = np.random.default_rng(0)
    records = ((b"%06d" % i, array_to_datum(rng.integers(0, 255, (1, 28, 28), dtype=np.uint8), i % 10)
                .SerializeToString()) for i in range(n))
    write_lmdb(str(path), records)
    return path / "data.mdb"


@pytest.mark.parametrize("keep", [0.9, 0.5, 3 * 4096, 2 * 4096 + 100])
def test_truncated_lmdb_is_refused_before_it_is_mapped(tmp_path, keep):
    mdb = _lmdb(tmp_path / "db")
    full = os.path.getsize(mdb)
    size = int(full * keep) if keep < 1 else keep
    os.truncate(mdb, size)
    with pytest.raises(UserError, match=rf"^layer 'data': '.*data.mdb' is truncated: {size} bytes, but its meta "
                                        rf"page says the database has \d+ pages of 4096 bytes \({full} bytes\)"):
        LmdbReader(str(tmp_path / "db"), "layer 'data'")


@pytest.mark.parametrize("size", [0, 100, 5000])
def test_lmdb_without_two_meta_pages(tmp_path, size):
    mdb = _lmdb(tmp_path / "db", 5)
    os.truncate(mdb, size)
    with pytest.raises(UserError, match="is not a complete LMDB file"):
        check_lmdb_file(str(tmp_path / "db"), "db")


def test_whole_lmdb_passes_the_check(tmp_path):
    _lmdb(tmp_path / "db")
    check_lmdb_file(str(tmp_path / "db"), "db")
    reader = LmdbReader(str(tmp_path / "db"), "db")
    assert reader.count == 200
    reader.close()


# -- other text inputs ----------------------------------------------------------------------------------------
def test_image_list_that_is_not_text(tmp_path):
    from superneurons.data.image_list import read_image_list

    path = tmp_path / "list.txt"
    path.write_bytes(b"a.png 1\n\xff.png 2\n")
    with pytest.raises(UserError, match=r"list.txt:2:1: byte 0xff, not UTF-8 text at byte offset 8; expected an "
                                        r"image list"):
        read_image_list(str(path), "layer 'img'")
    with pytest.raises(UserError, match="layer 'img': cannot read image list"):
        read_image_list(str(tmp_path), "layer 'img'")


def test_labels_file_that_is_not_text(tmp_path):
    from superneurons.commands.classify import read_labels

    path = tmp_path / "labels.txt"
    path.write_bytes(b"cat\r\ndog\r\n")
    assert read_labels(str(path), 2) == ["cat", "dog"]
    path.write_bytes(b"cat\n\x00dog\n")
    with pytest.raises(UserError, match=r"labels.txt:2:1: a NUL byte at byte offset 4"):
        read_labels(str(path), 2)


@pytest.mark.parametrize("height, width", [(1000000000, 12), (4294967295, 12), (100000, 100000)])
def test_resize_target_beyond_what_an_image_may_hold(tmp_path, height, width):
    from superneurons.data.datum import encode_image, load_image

    path = tmp_path / "a.png"
    path.write_bytes(encode_image(np.zeros((1, 4, 4), np.uint8)))
    with pytest.raises(UserError, match=rf"a.png: resizing to {height}x{width} asks for {height * width} pixels"):
        load_image(str(path), False, height, width)
    assert load_image(str(path), False, 6, 5).shape == (1, 6, 5)


def test_hdf5_snapshot_under_a_non_ascii_prefix_resumes(tmp_path, monkeypatch, capsys):
    (tmp_path / "conf/nets").mkdir(parents=True)
    (tmp_path / "conf/nets/tiny.prototxt").write_text(TINY_NET)
    solver = SOLVER.replace('snapshot_prefix: "out/tiny"', 'snapshot_prefix: "out/caf\u00e9"\nsnapshot_format: HDF5')
    (tmp_path / "conf/solver.prototxt").write_text(solver.replace("max_iter: 6", "max_iter: 4"), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--solver", "conf/solver.prototxt"]) == 0
    state = "out/caf\u00e9_iter_4.solverstate.h5"
    (tmp_path / "conf/solver.prototxt").write_text(solver, encoding="utf-8")
    assert main(["train", "--solver", "conf/solver.prototxt", "--snapshot", state]) == 0
    logged = capsys.readouterr()
    assert f"Restoring previous solver status from {state}" in logged.out + logged.err


def test_user_error_is_one_line_whatever_it_quotes():
    e = UserError("db 'x' is corrupt (CURRENT points to MANIFEST-0\n\x00\x1b[2J02: no such file)\tcaf\u00e9")
    assert str(e) == "db 'x' is corrupt (CURRENT points to MANIFEST-0\\n\\x00\\x1b[2J02: no such file)\\tcaf\u00e9"
    assert str(UserError("plain")) == "plain"
