"""Caffe's other data sources: HDF5Data/HDF5Output, LevelDB, MemoryData, and the convert_imageset /
compute_image_mean commands with Caffe's flag spellings."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from google.protobuf import text_format
from gpu_harness import GPU_ONLY
from harness import load_tool
from logs import messages
from test_data import take
from PIL import Image

from superneurons.backend.cpu import CpuBackend
from superneurons.cli import main
from superneurons.data.datum import datum_to_array, load_image, parse_datum
from superneurons.data.imageset import SHUFFLE_SEED
from superneurons.data.databases import open_reader, write_database
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.binaryproto import read_mean
from superneurons.layers.memory_data import set_input_arrays
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from tests.harness import make_layer

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ---- HDF5Data ------------------------------------------------------------------------------------------
def write_h5(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, array in datasets.items():
            f.create_dataset(name, data=array)
    return str(path)


@pytest.fixture
def two_files(tmp_path):
    """Two .h5 files of 5 and 3 rows (data (n, 2, 3) float64, label int32) and a list naming them relative
    to the list's own folder (the fallback when they are not found from the working directory)."""
    rng = np.random.default_rng()
    data = rng.standard_normal((8, 2, 3))
    label = rng.integers(0, 10, size=8).astype(np.int32)
    (tmp_path / "h5").mkdir()
    write_h5(tmp_path / "h5/a.h5", data=data[:5], label=label[:5])
    write_h5(tmp_path / "h5/b.h5", data=data[5:], label=label[5:])
    (tmp_path / "h5/list.txt").write_text("a.h5\n\nb.h5\n")
    return str(tmp_path / "h5/list.txt"), data.astype(np.float32), label.astype(np.float32)


def hdf5_layer(source, batch, shuffle=False, seed=1234, phase=pb.TRAIN, tops=("data", "label")):
    text = (f'name: "h5" type: "HDF5Data" {" ".join(f"top: {t!r}" for t in tops)} '
            f'hdf5_data_param {{ source: "{source}" batch_size: {batch} shuffle: {str(shuffle).lower()} }}')
    layer, shapes = make_layer(text.replace("'", '"'), [], phase=phase)
    layer.ctx.seed = seed
    return layer, shapes


def test_hdf5_data_reads_files_in_order_across_boundaries_and_wraps(two_files):
    source, data, label = two_files
    layer, shapes = hdf5_layer(source, 3)
    assert shapes == [(3, 2, 3), (3,)]
    got = take(layer, shapes, 4)  # 12 rows of a stream of 8: batch 1 spans the files, batch 2 wraps
    stream = np.arange(12) % 8
    for k, (d, l) in enumerate(got):
        np.testing.assert_array_equal(d, data[stream[3 * k:3 * k + 3]])
        np.testing.assert_array_equal(l, label[stream[3 * k:3 * k + 3]])
    assert d.dtype == np.float32


def test_hdf5_shuffle_is_a_pure_function_of_seed_and_batch(two_files):
    source, data, label = two_files
    runs = {}
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        layer, shapes = hdf5_layer(source, 4, shuffle=True, seed=seed)
        runs[name] = np.concatenate([d for d, _ in take(layer, shapes, 6)])  # three passes of 8 rows
    np.testing.assert_array_equal(runs["a"], runs["b"])
    assert not np.array_equal(runs["a"], runs["c"])
    rows = {tuple(np.round(r.ravel(), 5)): i for i, r in enumerate(data)}
    passes = [[rows[tuple(np.round(r.ravel(), 5))] for r in runs["a"][8 * e:8 * e + 8]] for e in range(3)]
    for order in passes:
        assert sorted(order) == list(range(8))  # each pass is a permutation of every row of every file
    assert len({tuple(p) for p in passes}) > 1  # and passes differ
    # Rows of one file stay together within a pass (Caffe shuffles files, then rows within a file).
    for order in passes:
        assert order[0] < 5 and set(order[:5]) == set(range(5)) or order[0] >= 5 and set(order[:3]) == {5, 6, 7}


def test_hdf5_resume_continues_the_same_sequence(two_files):
    source, _, _ = two_files
    full, shapes = hdf5_layer(source, 3, shuffle=True)
    uninterrupted = take(full, shapes, 7)
    resumed, _ = hdf5_layer(source, 3, shuffle=True)
    take(resumed, shapes, 1)
    resumed.restore(full.state() | {"batch": 4})
    for (d, l), (ud, ul) in zip(take(resumed, shapes, 3), uninterrupted[4:]):
        np.testing.assert_array_equal(d, ud)
        np.testing.assert_array_equal(l, ul)
    assert resumed.state() == {"batch": 7}
    resumed.ctx.recomputing = True  # a memory manager replaying the step sees the same batch again
    np.testing.assert_array_equal(take(resumed, shapes, 1)[0][0], uninterrupted[6][0])


def test_hdf5_paths_relative_to_the_working_directory_come_first(two_files, tmp_path, monkeypatch):
    source, data, _ = two_files
    monkeypatch.chdir(tmp_path)
    write_h5(tmp_path / "a.h5", data=np.zeros((2, 2, 3)), label=np.zeros(2))  # shadows h5/a.h5, as in Caffe
    layer, shapes = hdf5_layer(source, 4)
    (d, _), = take(layer, shapes, 1)
    np.testing.assert_array_equal(d[:2], 0)
    np.testing.assert_array_equal(d[2:], data[5:7])


@pytest.mark.parametrize("case", ["no list", "no file", "no dataset", "rows differ", "strings", "scalar",
                                  "row shape", "not hdf5", "empty list", "no rows"])
def test_hdf5_errors_name_layer_source_and_file(case, tmp_path):
    h5 = tmp_path / "x.h5"
    listed = str(h5)
    if case == "no dataset":
        write_h5(h5, data=np.zeros((3, 2)), labels=np.zeros(3))
        want = r"no dataset 'label' \(datasets: data, labels\)"
    elif case == "rows differ":
        write_h5(h5, data=np.zeros((3, 2)), label=np.zeros(4))
        want = r"different numbers of samples \('data' 3, 'label' 4\)"
    elif case == "strings":
        write_h5(h5, data=np.zeros((3, 2)), label=np.array([b"a", b"b", b"c"]))
        want = r"dataset 'label' holds \|S1 values"
    elif case == "scalar":
        write_h5(h5, data=np.zeros((3, 2)), label=np.float32(1))
        want = r"dataset 'label' is a scalar"
    elif case == "row shape":
        write_h5(h5, data=np.zeros((3, 2)), label=np.zeros(3))
        write_h5(tmp_path / "y.h5", data=np.zeros((3, 4)), label=np.zeros(3))
        listed += "\n" + str(tmp_path / "y.h5")
        want = r"y.h5: dataset 'data' has rows of shape \(4,\), .*x.h5 of shape \(2,\)"
    elif case == "not hdf5":
        h5.write_bytes(b"not an hdf5 file at all")
        want = r"x.h5: not a readable HDF5 file"
    elif case == "no rows":
        write_h5(h5, data=np.zeros((0, 2)), label=np.zeros(0))
        want = r"x.h5: the datasets hold no samples"
    elif case == "no file":
        want = r"list.txt:1: HDF5 file '.*x.h5' does not exist"
    elif case == "empty list":
        listed = "\n"
        want = r"names no HDF5 files"
    else:
        want = r"list file '.*list.txt' does not exist"
    if case != "no list":
        (tmp_path / "list.txt").write_text(listed + "\n")
    source = tmp_path / "list.txt"
    with pytest.raises(UserError) as e:
        hdf5_layer(source, 2)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"layer 'h5' (HDF5Data), source '{source}': "), message
    assert re.search(want, message), message


def train_example(workdir: Path, solver_extra: str = "", args=()) -> str:
    """Train models/hdf5_classification from `workdir` (its data written by the example's tool); the log."""
    text = (ROOT / "models/hdf5_classification/solver.prototxt").read_text() + solver_extra
    (workdir / "solver.prototxt").write_text(text)
    return main(["train", "--solver", "solver.prototxt", *args])


@pytest.fixture
def example_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "models/hdf5_classification", tmp_path / "models/hdf5_classification")
    assert load_tool("data/make_hdf5_classification").main([]) == 0
    return tmp_path


def test_caffe_hdf5_classification_example_trains(example_dir, capsys):
    assert train_example(example_dir) == 0
    out = "\n".join(messages(capsys.readouterr().err))  # the training log: glog lines on stderr
    accuracies = [float(m) for m in re.findall(r"Test net output #1: accuracy = ([0-9.]+)", out)]
    assert len(accuracies) == 5 and accuracies[0] < 0.7  # before training, then every 500 iterations
    assert accuracies[-1] >= 0.88, out[-2000:]  # logistic regression on two Gaussians 2 apart: ~0.92


def test_hdf5_training_resumes_to_the_same_weights(example_dir):
    short = 'max_iter: 60\nsnapshot: 30\ntest_interval: 1000\nsnapshot_prefix: "snap/h5"\n'
    assert train_example(example_dir, short) == 0
    uninterrupted = (example_dir / "snap/h5_iter_60.caffemodel").read_bytes()
    os.remove(example_dir / "snap/h5_iter_60.caffemodel")
    assert train_example(example_dir, short, ["--snapshot", "snap/h5_iter_30.solverstate"]) == 0
    assert (example_dir / "snap/h5_iter_60.caffemodel").read_bytes() == uninterrupted


# ---- HDF5Output ---------------------------------------------------------------------------------------
def test_hdf5_output_writes_caffes_datasets_and_appends(tmp_path):
    out = tmp_path / "out.h5"
    out.write_bytes(b"an old file the first forward replaces")
    layer, _ = make_layer(f'type: "HDF5Output" hdf5_output_param {{ file_name: "{out}" }}', [(2, 3), (2,)])
    rng = np.random.default_rng()
    batches = [(rng.standard_normal((2, 3)), rng.standard_normal(2)) for _ in range(2)]
    layer.forward(list(batches[0]), [])
    with h5py.File(out, "r") as f:  # after one forward: exactly Caffe's file
        assert sorted(f) == ["data", "label"]
        assert f["data"].dtype == np.float32 and f["data"].shape == (2, 3, 1, 1)
        assert f["label"].dtype == np.float32 and f["label"].shape == (2, 1, 1, 1)
        np.testing.assert_array_equal(f["data"][...].reshape(2, 3), batches[0][0].astype(np.float32))
    layer.forward(list(batches[1]), [])
    layer.ctx.recomputing = True
    layer.forward(list(batches[1]), [])  # a replayed step writes nothing
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["data"][...].reshape(4, 3),
                                      np.concatenate([b[0] for b in batches]).astype(np.float32))
        np.testing.assert_array_equal(f["label"][...].ravel(),
                                      np.concatenate([b[1] for b in batches]).astype(np.float32))


def test_hdf5_output_checks_its_bottoms(tmp_path):
    text = f'name: "out" type: "HDF5Output" hdf5_output_param {{ file_name: "{tmp_path / "o.h5"}" }}'
    with pytest.raises(UserError, match=r"layer 'out' \(HDF5Output\): the bottoms have 2 and 3 samples"):
        make_layer(text, [(2, 3), (3,)])
    with pytest.raises(UserError, match=r"bottom 'data' has 5 axes"):
        make_layer(text, [(2, 1, 1, 1, 1), (2,)])
    with pytest.raises(UserError, match=r"file_name is required"):
        make_layer('name: "out" type: "HDF5Output"', [(2, 3), (2,)])


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=GPU_ONLY)])
def test_hdf5_data_feeds_hdf5_output_in_a_net(device, two_files, tmp_path, request):
    """The tops go up to the device and come back down unchanged (the GPU run checks upload/download)."""
    backend = request.getfixturevalue("gpu") if device == "gpu" else CpuBackend()
    source, data, label = two_files
    out = tmp_path / "copy.h5"
    net_text = f'''
        name: "copy"
        layer {{ name: "in" type: "HDF5Data" top: "data" top: "label"
                 hdf5_data_param {{ source: "{source}" batch_size: 4 }} }}
        layer {{ name: "out" type: "HDF5Output" bottom: "data" bottom: "label"
                 hdf5_output_param {{ file_name: "{out}" }} }}'''
    net = Net(build_graph(text_format.Parse(net_text, pb.NetParameter()), pb.TEST), backend, train=False)
    net.forward()
    net.forward()
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["data"][...].reshape(8, 2, 3), data)
        np.testing.assert_array_equal(f["label"][...].ravel(), label)


# ---- LevelDB and the data tools -----------------------------------------------------------------------
@pytest.fixture
def imageset(tmp_path):
    """Seven RGB PNG images of different sizes (one with a space in its name) and a list file."""
    rng = np.random.default_rng()
    (tmp_path / "img").mkdir()
    lines = []
    for i in range(7):
        h, w = 5 + i % 3, 6 + i % 2
        name = f"im {i}.png" if i == 3 else f"im{i}.png"
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(tmp_path / "img" / name)
        lines.append(f"{name} {i + 10}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return tmp_path


def read_records(path, backend=None):
    reader = open_reader(str(path), backend, "test")
    values = reader.values_from(0)
    datums = [parse_datum(next(values), "test") for _ in range(reader.count)]
    values.close()
    reader.close()
    return datums


def test_convert_imageset_with_caffe_spellings_writes_leveldb_and_lmdb_alike(imageset):
    root, listfile = str(imageset / "img"), str(imageset / "list.txt")
    caffe_args = ["-resize_height=6", "-resize_width", "5", "-shuffle", "-check_size=true", "-nogray"]
    assert main(["convert_imageset", *caffe_args, "-backend", "leveldb", root + "/", listfile,
                 str(imageset / "ldb")]) == 0
    assert main(["convert_imageset", *caffe_args, "--backend=lmdb", root, listfile, str(imageset / "mdb")]) == 0
    assert (imageset / "ldb/CURRENT").exists() and (imageset / "mdb/data.mdb").exists()
    from_ldb, from_mdb = read_records(imageset / "ldb", "leveldb"), read_records(imageset / "mdb")
    assert [d.SerializeToString() for d in from_ldb] == [d.SerializeToString() for d in from_mdb]
    order = np.random.default_rng(SHUFFLE_SEED).permutation(7)
    assert [d.label for d in from_ldb] == [int(i) + 10 for i in order]
    for d, i in zip(from_ldb, order):
        name = f"im {i}.png" if i == 3 else f"im{i}.png"
        np.testing.assert_array_equal(datum_to_array(d, "t"), load_image(f"{root}/{name}", True, 6, 5))


def test_data_layer_reads_leveldb_as_it_reads_lmdb(imageset):
    root, listfile = str(imageset / "img") + "/", str(imageset / "list.txt")
    for backend in ("leveldb", "lmdb"):
        assert main(["convert_imageset", "--resize_height", "6", "--resize_width", "6", "--backend", backend,
                     root, listfile, str(imageset / backend)]) == 0
    batches = {}
    for name, db, backend_field in (("leveldb", "leveldb", "backend: LEVELDB"), ("lmdb", "lmdb", "backend: LMDB"),
                                    ("leveldb, unset", "leveldb", "")):
        text = (f'name: "src" type: "Data" top: "data" top: "label" transform_param {{ crop_size: 4 mirror: true }} '
                f'data_param {{ source: "{imageset / db}" batch_size: 3 {backend_field} }}')
        layer, shapes = make_layer(text, [])
        try:
            batches[name] = take(layer, shapes, 4)  # 12 of 7 records: wraps
        finally:
            layer.close()
    for other in ("lmdb", "leveldb, unset"):
        for (d, l), (od, ol) in zip(batches["leveldb"], batches[other]):
            np.testing.assert_array_equal(d, od)
            np.testing.assert_array_equal(l, ol)
    labels = np.concatenate([l for _, l in batches["leveldb"]])
    np.testing.assert_array_equal(labels, [10 + i % 7 for i in range(12)])
    # A train and a test net reading one LevelDB share its single handle (LevelDB's LOCK allows one).
    text = f'name: "src" type: "Data" top: "data" data_param {{ source: "{imageset / "leveldb"}" batch_size: 2 }}'
    train, shapes = make_layer(text, [])
    test, _ = make_layer(text, [], phase=pb.TEST)
    try:
        take(test, shapes, 1)
        test.close()  # the handle stays open for the other reader, which starts reading only now
        records = [datum_to_array(d, "t") for d in read_records(imageset / "leveldb")]
        np.testing.assert_array_equal(take(train, shapes, 2)[1][0], np.stack(records[2:4]))
    finally:
        train.close()
        test.close()


def test_compute_image_mean_reads_both_backends(imageset, capsys):
    root, listfile = str(imageset / "img"), str(imageset / "list.txt")
    for backend in ("leveldb", "lmdb"):
        assert main(["convert_imageset", "-encoded", "-encode_type=png", "-resize_height=5", "-resize_width=6",
                     f"-backend={backend}", root, listfile, str(imageset / backend)]) == 0
    datums = read_records(imageset / "lmdb")
    assert all(d.encoded for d in datums)
    want = np.mean([datum_to_array(d, "t").astype(np.float64) for d in datums], axis=0)
    capsys.readouterr()
    assert main(["compute_image_mean", "-backend", "leveldb", str(imageset / "leveldb"), str(imageset / "a.bp")]) == 0
    assert main(["compute_image_mean", str(imageset / "lmdb"), str(imageset / "b.bp")]) == 0  # backend detected
    np.testing.assert_allclose(read_mean(str(imageset / "a.bp")), want, rtol=1e-6)
    np.testing.assert_array_equal(read_mean(str(imageset / "a.bp")), read_mean(str(imageset / "b.bp")))
    out = capsys.readouterr().out
    printed = [float(v) for v in re.findall(r"^mean_value channel \[(?:\d)\]: ([0-9.]+)$", out, re.M)]
    np.testing.assert_allclose(printed, np.tile(want.mean(axis=(1, 2)), 2), rtol=1e-6)
    # The old script path still works, as the same command.
    assert load_tool("data/compute_image_mean").main(["--backend=leveldb", str(imageset / "leveldb")]) == 0


def test_convert_imageset_keeps_files_skips_unreadable_and_refuses_half_a_resize(imageset, capsys):
    (imageset / "list.txt").write_text((imageset / "list.txt").read_text() + "missing.png 1\n")
    (imageset / "img/broken.png").write_bytes(b"\x89PNG not really")
    (imageset / "list.txt").write_text((imageset / "list.txt").read_text() + "broken.png 2\n")
    assert main(["convert_imageset", "-encoded", str(imageset / "img"), str(imageset / "list.txt"),
                 str(imageset / "enc")]) == 0
    captured = capsys.readouterr()
    assert "skipped 2 unreadable images" in captured.out
    assert "missing.png" in captured.err and "broken.png" in captured.err
    datums = read_records(imageset / "enc")
    assert len(datums) == 7
    assert datums[0].data == (imageset / "img/im0.png").read_bytes()  # nothing asked to re-encode: the file
    assert main(["convert_imageset", "-resize_height=4", str(imageset / "img"), str(imageset / "list.txt"),
                 str(imageset / "x")]) == 1
    assert "-resize_height and -resize_width" in one_line_error(capsys)
    assert not (imageset / "x").exists()


# ---- LevelDB faults -----------------------------------------------------------------------------------
def small_leveldb(path, n=50, size=2000):
    rng = np.random.default_rng()
    write_database(str(path), ((b"%08d" % i, rng.bytes(size)) for i in range(n)), "leveldb")
    return str(path)


def test_locked_leveldb_is_one_line_naming_layer_and_source(tmp_path, capsys):
    db = small_leveldb(tmp_path / "ldb")
    holder = subprocess.Popen([sys.executable, "-c", "import plyvel, sys; d = plyvel.DB(sys.argv[1]); "
                               "print('open', flush=True); sys.stdin.read()", db],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        text = (f'name: "src" type: "Data" top: "data" data_param {{ source: "{db}" batch_size: 2 '
                f'backend: LEVELDB }}')
        with pytest.raises(UserError, match=rf"^layer 'src' \(Data\): LevelDB database '{db}' is locked: another "
                                            r"process has it open"):
            make_layer(text, [])
        assert main(["compute_image_mean", db]) == 1
        assert "is locked" in one_line_error(capsys)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)


def test_corrupt_absent_and_mismatched_leveldb(tmp_path):
    db = small_leveldb(tmp_path / "ldb")
    for name in os.listdir(db):  # damage the middle of every data file
        if name.endswith((".ldb", ".log")) and os.path.getsize(os.path.join(db, name)) > 1000:
            with open(os.path.join(db, name), "r+b") as f:
                f.seek(os.path.getsize(os.path.join(db, name)) // 2)
                f.write(b"\xff" * 300)
    with pytest.raises(UserError, match=rf"^where: LevelDB database '{db}' is (corrupt|unreadable after record)"):
        open_reader(db, "leveldb", "where")
    with pytest.raises(UserError, match=r"^where: database '.*nowhere' .*does not exist"):
        open_reader(str(tmp_path / "nowhere"), "leveldb", "where")
    good = small_leveldb(tmp_path / "good")
    with pytest.raises(UserError, match=r"is a LEVELDB database but backend is LMDB; name backend LEVELDB"):
        open_reader(good, "lmdb", "where")
    (tmp_path / "neither").mkdir()
    with pytest.raises(UserError, match=r"neither an LMDB \(data.mdb\) nor a LevelDB \(CURRENT\) database"):
        open_reader(str(tmp_path / "neither"), None, "where")


# ---- MemoryData ---------------------------------------------------------------------------------------
MEMORY = 'name: "mem" type: "MemoryData" top: "data" top: "label" memory_data_param { batch_size: 2 channels: 1 ' \
         'height: 2 width: 3 }'


def test_memory_data_serves_the_callers_arrays_in_place_and_wraps():
    layer, shapes = make_layer(MEMORY, [])
    data = np.random.default_rng().standard_normal((4, 1, 2, 3)).astype(np.float32)
    labels = np.arange(4, dtype=np.float32).reshape(4, 1, 1, 1)  # pycaffe's label layout
    with pytest.raises(UserError, match=r"layer 'mem' \(MemoryData\): no data: call reset"):
        take(layer, shapes, 1)
    layer.reset(data, labels)
    got = take(layer, shapes, 3)
    np.testing.assert_array_equal(got[1][0], data[2:])
    np.testing.assert_array_equal(got[1][1], [2, 3])
    np.testing.assert_array_equal(got[2][0], data[:2])  # wrapped
    data[2:] = 7  # read in place, as Caffe reads the caller's memory
    np.testing.assert_array_equal(take(layer, shapes, 1)[0][0], 7)
    layer.reset(data, labels.ravel())  # starts again at the first sample
    np.testing.assert_array_equal(take(layer, shapes, 1)[0][1], [0, 1])


@pytest.mark.parametrize("data, labels, want", [
    (np.zeros((3, 1, 2, 3), np.float32), np.zeros(3, np.float32), "3 samples, which is not a positive multiple of "
                                                                   "batch_size 2"),
    (np.zeros((0, 1, 2, 3), np.float32), np.zeros(0, np.float32), "0 samples"),
    (np.zeros((4, 1, 2, 3)), np.zeros(4, np.float32), r"data must be a float32 C-contiguous array \(dtype float64\)"),
    (np.zeros((4, 1, 3, 2), np.float32).transpose(0, 1, 3, 2), np.zeros(4, np.float32), "not C-contiguous"),
    (np.zeros((4, 2, 2, 3), np.float32), np.zeros(4, np.float32), r"shape \(4, 2, 2, 3\), expected \(n, 1, 2, 3\)"),
    (np.zeros((4, 1, 2, 3), np.float32), np.arange(4), r"labels must be a float32 .*dtype int64"),
    (np.zeros((4, 1, 2, 3), np.float32), np.zeros((4, 2), np.float32), r"labels have shape \(4, 2\) for 4 samples"),
    (np.zeros((4, 1, 2, 3), np.float32), [0.0] * 4, "labels must be a NumPy array"),
])
def test_memory_data_reset_checks_what_pycaffe_checks(data, labels, want):
    layer, _ = make_layer(MEMORY, [])
    with pytest.raises(UserError, match=want):
        layer.reset(data, labels)


def test_set_input_arrays_feeds_the_first_layer_of_a_net():
    net_text = '''
        name: "mem"
        layer { name: "mem" type: "MemoryData" top: "data" top: "label"
                memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }'''
    net = Net(build_graph(text_format.Parse(net_text, pb.NetParameter()), pb.TRAIN), CpuBackend(), seed=1)
    data = np.random.default_rng().standard_normal((4, 1, 2, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 1], np.float32)
    layers = [node.layer for node in net.layers_in_prototxt_order()]
    set_input_arrays(layers, data, labels)
    for k in (0, 1, 0):
        loss = net.forward()
        np.testing.assert_array_equal(net.blob("data"), data[2 * k:2 * k + 2])
        w, b = (np.asarray(p.data, np.float64) for p in net.layer("ip").params)
        scores = data[2 * k:2 * k + 2].reshape(2, -1).astype(np.float64) @ w.T + b
        logp = scores - scores.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        assert loss == pytest.approx(-logp[[0, 1], labels[2 * k:2 * k + 2].astype(int)].mean(), rel=1e-5)
    with pytest.raises(UserError, match=r"first layer is a MemoryData layer; it is 'ip' \(InnerProduct\)"):
        set_input_arrays(layers[1:], data, labels)


def test_convert_imageset_raw_records_are_bgr_or_gray_pixels(imageset):
    root, listfile = str(imageset / "img"), str(imageset / "list.txt")
    assert main(["convert_imageset", root, listfile, str(imageset / "bgr")]) == 0
    assert main(["convert_imageset", "-gray", root, listfile, str(imageset / "gray")]) == 0
    names = [line.rpartition(" ")[0] for line in (imageset / "list.txt").read_text().splitlines()]
    for bgr, gray, name in zip(read_records(imageset / "bgr"), read_records(imageset / "gray"), names):
        with Image.open(imageset / "img" / name) as img:
            rgb = np.asarray(img.convert("RGB"))
            luma = np.asarray(img.convert("L"))
        np.testing.assert_array_equal(datum_to_array(bgr, "t"), rgb[:, :, ::-1].transpose(2, 0, 1))
        np.testing.assert_array_equal(datum_to_array(gray, "t"), luma[None])


def test_a_release_from_a_finalizer_during_an_open_waits_for_the_open_instead_of_hanging():
    """The garbage collector may run a dropped Data layer's finalizer (which releases its database) inside
    another database's open, on the thread that holds SharedHandles' lock: a fuzz case hung there for good."""
    import threading

    from superneurons.data.record_db import SharedHandles

    closed = []
    handles = SharedHandles(closed.append)
    assert handles.acquire("a", lambda: "A") == "A"

    def open_b():
        handles.release("a")  # what the finalizer does when the collector runs during this open
        assert closed == []  # recorded, not done: the open is still under way
        return "B"

    got = []
    opener = threading.Thread(target=lambda: got.append(handles.acquire("b", open_b)), daemon=True)
    opener.start()
    opener.join(10)
    assert not opener.is_alive(), "acquire waited for the lock its own thread holds"
    assert got == ["B"] and closed == ["A"]
    handles.release("b")
    assert closed == ["A", "B"]
