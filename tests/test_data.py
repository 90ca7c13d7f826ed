"""Data input: LMDB Datum records through the Data layer, the DataTransformer, means, prefetching, tools."""
from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import numpy as np
from harness import load_tool
import pytest
from google.protobuf import text_format
from PIL import Image

from superneurons.backend.cpu import CpuBackend
from superneurons.data.datum import array_to_datum, encode_image, encoded_datum, parse_datum
from superneurons.data.lmdb_source import LmdbReader, write_lmdb
from superneurons.data.prefetch import Prefetcher
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.io.binaryproto import array_to_blob, blob_to_array, read_mean, write_mean
from superneurons.io.prototxt import read_net
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from tests.harness import make_layer

ROOT = Path(__file__).resolve().parents[1]


# ---- helpers -----------------------------------------------------------------------------------
def write_db(path, images, labels, encode: str | None = None, key_order=None) -> str:
    """An LMDB of Datum records keyed '%08d'; `key_order` inserts them out of order (LMDB sorts keys)."""
    order = range(len(images)) if key_order is None else key_order

    def records():
        for i in order:
            if encode:
                datum = encoded_datum(encode_image(images[i], encode), int(labels[i]))
            else:
                datum = array_to_datum(images[i], int(labels[i]))
            yield b"%08d" % i, datum.SerializeToString()

    write_lmdb(str(path), records())
    return str(path)


def random_db(tmp_path, n=7, shape=(3, 5, 4), seed=None, name="db"):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n,) + shape, dtype=np.uint8)
    labels = rng.integers(0, 10, size=n)
    return write_db(tmp_path / name, images, labels, key_order=rng.permutation(n)), images, labels


def data_layer(source, batch, transform="", phase=pb.TRAIN, seed=1234, extra="", tops=2):
    top = 'top: "data" ' + ('top: "label" ' if tops == 2 else "")
    text = (f'name: "src" type: "Data" {top} transform_param {{ {transform} }} '
            f'data_param {{ source: "{source}" batch_size: {batch} backend: LMDB {extra} }}')
    layer, shapes = make_layer(text, [], phase=phase)
    layer.ctx.seed = seed
    return layer, shapes


def take(layer, shapes, n):
    out = []
    for _ in range(n):
        tops = [np.full(s, np.nan, np.float32) for s in shapes]
        layer.forward([], tops)
        out.append(tops)
    return out


@pytest.fixture
def closing():
    """Layers registered here are closed after the test, so no prefetch thread outlives it."""
    layers = []
    yield layers.append
    for layer in layers:
        layer.close()


# ---- records, order, wrap-around -------------------------------------------------------------------
def test_batches_follow_key_order_and_wrap(tmp_path, closing):
    source, images, labels = random_db(tmp_path, n=7)
    layer, shapes = data_layer(source, 3)
    closing(layer)
    assert shapes == [(3, 3, 5, 4), (3,)]
    for k, (data, label) in enumerate(take(layer, shapes, 5)):  # 15 records from 7: wraps twice
        idx = [(3 * k + i) % 7 for i in range(3)]
        np.testing.assert_array_equal(data, images[idx].astype(np.float32))
        np.testing.assert_array_equal(label, labels[idx].astype(np.float32))


def test_float_data_records_and_single_top(tmp_path, closing):
    rng = np.random.default_rng()
    images = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
    records = [(b"%08d" % i, array_to_datum(images[i], i).SerializeToString()) for i in range(4)]
    write_lmdb(str(tmp_path / "f"), records)
    layer, shapes = data_layer(tmp_path / "f", 4, tops=1, transform="scale: 2")
    closing(layer)
    assert shapes == [(4, 2, 3, 3)]
    (data,), = take(layer, shapes, 1)
    np.testing.assert_allclose(data, images * 2, rtol=1e-6)


def test_rand_skip_starts_inside_the_database(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=9)
    layer, shapes = data_layer(source, 2, extra="rand_skip: 9")
    closing(layer)
    (data, _), = take(layer, shapes, 1)
    starts = [s for s in range(9) if np.array_equal(data[0], images[s].astype(np.float32))]
    assert starts and np.array_equal(data[1], images[(starts[0] + 1) % 9].astype(np.float32))


# ---- the transformer ----------------------------------------------------------------------------------
def test_scale_and_mean_value_per_channel_and_shared(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=4)
    mean = np.random.default_rng().uniform(0, 255, 3).astype(np.float32)
    layer, shapes = data_layer(source, 4, f"scale: 0.125 mean_value: {mean[0]} mean_value: {mean[1]} "
                                          f"mean_value: {mean[2]}")
    closing(layer)
    (data, _), = take(layer, shapes, 1)
    np.testing.assert_allclose(data, (images - mean[:, None, None]) * np.float32(0.125), rtol=1e-6, atol=1e-6)
    layer1, _ = data_layer(source, 4, f"mean_value: {mean[0]}")
    closing(layer1)
    (data1, _), = take(layer1, shapes, 1)
    np.testing.assert_allclose(data1, images - mean[0], rtol=1e-6, atol=1e-4)


def test_mean_file_then_scale(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=4)
    mean = np.random.default_rng().uniform(0, 255, (3, 5, 4)).astype(np.float32)
    write_mean(str(tmp_path / "mean.binaryproto"), mean)
    layer, shapes = data_layer(source, 4, f'scale: 0.5 mean_file: "{tmp_path / "mean.binaryproto"}"')
    closing(layer)
    (data, _), = take(layer, shapes, 1)
    np.testing.assert_allclose(data, (images - mean) * np.float32(0.5), rtol=1e-6, atol=1e-5)


def test_mean_file_of_the_wrong_shape_is_a_user_error(tmp_path):
    source, _, _ = random_db(tmp_path, n=2)
    write_mean(str(tmp_path / "m.binaryproto"), np.zeros((1, 5, 4), np.float32))
    with pytest.raises(UserError, match=r"'src'.*mean_file image has shape 1x5x4.*3x5x4"):
        data_layer(source, 2, f'mean_file: "{tmp_path / "m.binaryproto"}"')


def test_train_crop_and_mirror_take_random_windows(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=5, shape=(2, 6, 7))
    layer, shapes = data_layer(source, 5, "crop_size: 3 mirror: true scale: 0.5")
    closing(layer)
    assert shapes[0] == (5, 2, 3, 3)
    seen = set()
    for k, (data, _) in enumerate(take(layer, shapes, 8)):
        for i in range(5):
            src = images[(5 * k + i) % 5].astype(np.float32) * np.float32(0.5)
            fits = [(y, x, flip) for y in range(4) for x in range(5) for flip in (False, True)
                    if np.array_equal(data[i], src[:, y:y + 3, x:x + 3][:, :, ::-1] if flip
                                      else src[:, y:y + 3, x:x + 3])]
            assert fits, f"batch {k} item {i} is no (mirrored) 3x3 window of its record"
            seen.update(fits)
    assert {f for _, _, f in seen} == {False, True}
    assert len({(y, x) for y, x, _ in seen}) > 5  # offsets vary over the 40 images


def test_test_phase_center_crop_without_mirror(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=3, shape=(3, 7, 6))
    layer, shapes = data_layer(source, 3, "crop_size: 4 mirror: true", phase=pb.TEST)
    closing(layer)
    for data, _ in take(layer, shapes, 3):
        # (7-4)//2 = 1 rows and (6-4)//2 = 1 column off the top-left
        np.testing.assert_array_equal(data, images[:, :, 1:5, 1:5].astype(np.float32))


def test_legacy_data_param_transform_fields(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=2, shape=(1, 6, 6))
    layer, shapes = data_layer(source, 2, "", phase=pb.TEST, extra="scale: 0.25 crop_size: 2")
    closing(layer)
    (data, _), = take(layer, shapes, 1)
    np.testing.assert_allclose(data, images[:, :, 2:4, 2:4] * np.float32(0.25))


def test_crop_larger_than_image_names_numbers(tmp_path):
    source, _, _ = random_db(tmp_path, n=2, shape=(1, 5, 4))
    with pytest.raises(UserError, match=r"'src'.*crop_size 6 is larger than the 5x4 image"):
        data_layer(source, 2, "crop_size: 6")


def test_records_of_different_shapes_are_reported(tmp_path, closing):
    images = [np.zeros((1, 4, 4), np.uint8), np.zeros((1, 5, 4), np.uint8)]
    source = write_db(tmp_path / "mixed", images, [0, 1])
    layer, shapes = data_layer(source, 2)
    closing(layer)
    with pytest.raises(UserError, match=r"record 1 gives a 1x5x4 input, the first record a 1x4x4"):
        take(layer, shapes, 1)


# ---- encoded records ------------------------------------------------------------------------------------
def test_encoded_png_records_decode_to_the_stored_pixels(tmp_path, closing):
    rng = np.random.default_rng()
    for channels in (1, 3):
        images = rng.integers(0, 256, size=(3, channels, 5, 6), dtype=np.uint8)
        source = write_db(tmp_path / f"png{channels}", images, [1, 2, 3], encode="PNG")
        layer, shapes = data_layer(source, 3)
        closing(layer)
        assert shapes[0] == (3, channels, 5, 6)
        (data, label), = take(layer, shapes, 1)
        np.testing.assert_array_equal(data, images.astype(np.float32))
        np.testing.assert_array_equal(label, [1, 2, 3])


def test_encoded_color_is_bgr_and_force_gray_converts(tmp_path, closing):
    rgb = np.random.default_rng().integers(0, 256, size=(5, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, mode="RGB").save(buf, format="PNG")
    write_lmdb(str(tmp_path / "c"), [(b"0", encoded_datum(buf.getvalue(), 4).SerializeToString())])
    layer, shapes = data_layer(tmp_path / "c", 1)
    closing(layer)
    (data, _), = take(layer, shapes, 1)
    np.testing.assert_array_equal(data[0], rgb[:, :, ::-1].transpose(2, 0, 1))  # Caffe/OpenCV order
    gray, gshapes = data_layer(tmp_path / "c", 1, "force_gray: true")
    closing(gray)
    assert gshapes[0] == (1, 1, 5, 6)
    (gdata, _), = take(gray, gshapes, 1)
    np.testing.assert_array_equal(gdata[0, 0], np.asarray(Image.fromarray(rgb).convert("L")))


# ---- binaryproto ---------------------------------------------------------------------------------------
def test_binaryproto_mean_round_trip(tmp_path):
    mean = np.random.default_rng().standard_normal((3, 4, 5)).astype(np.float32)
    path = str(tmp_path / "mean.binaryproto")
    write_mean(path, mean)
    blob = pb.BlobProto.FromString(open(path, "rb").read())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 4, 5)  # Caffe's layout
    np.testing.assert_array_equal(read_mean(path), mean)
    other = np.random.default_rng().standard_normal((2, 7)).astype(np.float32)
    np.testing.assert_array_equal(blob_to_array(pb.BlobProto.FromString(array_to_blob(other).SerializeToString())),
                                  other)


def test_binaryproto_size_mismatch_is_reported():
    blob = pb.BlobProto(num=1, channels=2, height=2, width=2)
    blob.data.extend([1.0, 2.0])
    with pytest.raises(UserError, match="needs 8 values but it holds 2"):
        blob_to_array(blob, "m.binaryproto")


# ---- determinism, resuming, the thread --------------------------------------------------------------------
def test_same_seed_same_batches_whatever_the_prefetch_depth(tmp_path, closing):
    source, _, _ = random_db(tmp_path, n=11, shape=(1, 8, 8))
    transform = "crop_size: 5 mirror: true"
    runs = []
    for seed, depth in ((7, 1), (7, 8), (8, 4)):
        layer, shapes = data_layer(source, 4, transform, seed=seed, extra=f"prefetch: {depth} rand_skip: 5")
        closing(layer)
        runs.append(np.stack([d for d, _ in take(layer, shapes, 6)]))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_state_and_restore_resume_the_same_sequence(tmp_path, closing):
    source, _, _ = random_db(tmp_path, n=10, shape=(1, 6, 6))
    transform = "crop_size: 4 mirror: true"
    whole, shapes = data_layer(source, 3, transform, seed=5, extra="rand_skip: 4")
    closing(whole)
    expected = take(whole, shapes, 9)
    first, _ = data_layer(source, 3, transform, seed=5, extra="rand_skip: 4")
    closing(first)
    take(first, shapes, 4)
    state = first.state()
    assert state == {"batch": 4}
    resumed, _ = data_layer(source, 3, transform, seed=5, extra="rand_skip: 4")
    closing(resumed)
    resumed.restore(state)
    for (d, l), (ed, el) in zip(take(resumed, shapes, 5), expected[4:]):
        np.testing.assert_array_equal(d, ed)
        np.testing.assert_array_equal(l, el)
    with pytest.raises(UserError, match="cannot restore"):
        resumed.restore({"batch": -1})


def test_seed_set_after_the_thread_started_takes_effect(tmp_path, closing):
    source, _, _ = random_db(tmp_path, n=8, shape=(1, 6, 6))
    late, shapes = data_layer(source, 2, "crop_size: 3 mirror: true", seed=1)
    closing(late)
    take(late, shapes, 2)
    late.ctx.seed = 2  # as a resumed solver does when the snapshot's seed differs
    fresh, _ = data_layer(source, 2, "crop_size: 3 mirror: true", seed=2)
    closing(fresh)
    expected = take(fresh, shapes, 4)[2:]
    for (d, _), (ed, _) in zip(take(late, shapes, 2), expected):
        np.testing.assert_array_equal(d, ed)


def test_recomputed_forward_serves_the_same_batch(tmp_path, closing):
    source, images, _ = random_db(tmp_path, n=6)
    layer, shapes = data_layer(source, 2)
    closing(layer)
    (a, _), = take(layer, shapes, 1)
    layer.ctx.recomputing = True
    (b, _), = take(layer, shapes, 1)
    layer.ctx.recomputing = False
    (c, _), = take(layer, shapes, 1)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c, images[2:4].astype(np.float32))


def test_prefetch_thread_is_a_daemon_and_stops(tmp_path):
    source, _, _ = random_db(tmp_path, n=4)
    layer, shapes = data_layer(source, 2, extra="prefetch: 2 decode_workers: 1")
    take(layer, shapes, 1)
    threads = [t for t in threading.enumerate() if t.name == "prefetch:src"]
    assert len(threads) == 1 and threads[0].daemon
    layer.close()
    assert not threads[0].is_alive()


def test_prefetcher_keeps_order_and_carries_exceptions():
    def items():
        yield from range(5)
        raise ValueError("broken record 5")

    pre = Prefetcher(items(), depth=2)
    assert [pre.next() for _ in range(5)] == list(range(5))
    with pytest.raises(ValueError, match="broken record 5"):
        pre.next()
    pre.close()


# ---- errors ------------------------------------------------------------------------------------------
def test_missing_database_names_layer_and_path(tmp_path):
    missing = tmp_path / "nowhere_lmdb"
    with pytest.raises(UserError, match=rf"layer 'src' \(Data\).*{missing}.*does not exist"):
        data_layer(missing, 2)


# ---- inside a Net ------------------------------------------------------------------------------------
def test_data_layer_feeds_a_net(tmp_path):
    source, images, labels = random_db(tmp_path, n=5, shape=(1, 4, 4))
    net_text = f'''
        name: "tiny"
        layer {{ name: "d" type: "Data" top: "data" top: "label"
                 transform_param {{ scale: 0.00390625 }}
                 data_param {{ source: "{source}" batch_size: 2 backend: LMDB }} }}
        layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                 inner_product_param {{ num_output: 3 }} }}'''
    graph = build_graph(text_format.Parse(net_text, pb.NetParameter()), pb.TEST)
    assert graph.blob_shapes["data"] == (2, 1, 4, 4) and graph.blob_shapes["label"] == (2,)
    net = Net(graph, CpuBackend(), train=False, seed=3)
    try:
        for k in range(3):
            net.forward()
            idx = [(2 * k) % 5, (2 * k + 1) % 5]
            np.testing.assert_allclose(net.blob("data"), images[idx] * np.float32(0.00390625))
            np.testing.assert_array_equal(net.blob("label"), labels[idx])
    finally:
        net.layer("d").close()


def test_upload_and_download_ops():
    ops = CpuBackend().ops
    dst = np.zeros((2, 3), np.float32)
    host = np.random.default_rng().integers(0, 255, 6).astype(np.uint8)
    ops.upload(dst, host)
    np.testing.assert_array_equal(dst.ravel(), host)
    copy = ops.download(dst)
    dst[...] = 0
    np.testing.assert_array_equal(copy.ravel(), host)


# ---- other data layers ------------------------------------------------------------------------------
def test_image_data_reads_list_and_shuffles_reproducibly(tmp_path, closing):
    rng = np.random.default_rng()
    images = rng.integers(0, 256, size=(5, 3, 4, 6), dtype=np.uint8)
    (tmp_path / "img").mkdir()
    lines = []
    for i, img in enumerate(images):
        Image.fromarray(img[::-1].transpose(1, 2, 0)).save(tmp_path / "img" / f"im {i}.png")  # BGR -> RGB file
        lines.append(f"im {i}.png {i}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")

    def layer(shuffle):
        text = (f'name: "src" type: "ImageData" top: "data" top: "label" image_data_param {{ '
                f'source: "{tmp_path / "list.txt"}" root_folder: "{tmp_path / "img"}" batch_size: 5 '
                f'shuffle: {str(shuffle).lower()} }}')
        lay, shapes = make_layer(text, [])
        closing(lay)
        return lay, shapes

    plain, shapes = layer(False)
    (data, label), = take(plain, shapes, 1)
    np.testing.assert_array_equal(data, images.astype(np.float32))
    a, _ = layer(True)
    b, _ = layer(True)
    epochs_a, epochs_b = take(a, shapes, 3), take(b, shapes, 3)
    for (da, la), (db, lb) in zip(epochs_a, epochs_b):
        np.testing.assert_array_equal(da, db)
        assert sorted(la) == list(range(5))  # each pass is a permutation of the list
        np.testing.assert_array_equal(da, images[la.astype(int)].astype(np.float32))
    assert len({tuple(la) for _, la in epochs_a}) > 1  # reshuffled between passes


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("work") / "data" / "digits"
    load_tool("data/make_digits_lmdb").main(["--out", str(out)])
    return out


def test_make_digits_lmdb_writes_the_whole_dataset_once(digits_dir, capsys):
    from superneurons.data.digits import digit_images

    all_records = []
    for name, n in (("train_lmdb", 1497), ("test_lmdb", 300)):
        reader = LmdbReader(str(digits_dir / name), "test")
        assert reader.count == n
        values = reader.values_from(0)
        for _ in range(n):
            d = parse_datum(next(values), "test")
            assert (d.channels, d.height, d.width) == (1, 28, 28) and not d.encoded
            all_records.append((d.data, d.label))
        values.close()
        reader.close()
    images, labels = digit_images()
    assert sorted(all_records) == sorted((img.tobytes(), int(lab)) for img, lab in zip(images, labels))
    assert sorted({lab for _, lab in all_records}) == list(range(10))
    assert max(max(data) for data, _ in all_records) > 200  # scaled from 0..16 to 0..255
    stamp = os.stat(digits_dir / "train_lmdb" / "data.mdb").st_mtime_ns
    load_tool("data/make_digits_lmdb").main(["--out", str(digits_dir)])
    assert "nothing to do" in capsys.readouterr().out
    assert os.stat(digits_dir / "train_lmdb" / "data.mdb").st_mtime_ns == stamp


def test_lenet_models_parse_and_build(digits_dir, monkeypatch):
    from superneurons.io.prototxt import read_text

    solver = read_text(str(ROOT / "models/lenet/lenet_solver.prototxt"), pb.SolverParameter())
    assert solver.test_iter == [3] and solver.base_lr == pytest.approx(0.01) and solver.lr_policy == "inv"
    train_test = read_net(str(ROOT / solver.net))
    sources = [l.data_param.source for l in train_test.layer if l.type == "Data"]
    assert sources == ["data/digits/train_lmdb", "data/digits/test_lmdb"]
    monkeypatch.chdir(digits_dir.parent.parent)
    for phase, batch in ((pb.TRAIN, 64), (pb.TEST, 100)):
        graph = build_graph(train_test, phase)
        assert graph.blob_shapes["data"] == (batch, 1, 28, 28)
        assert graph.blob_shapes["ip2"] == (batch, 10)
        for node in graph.nodes:
            getattr(node.layer, "close", lambda: None)()
    deploy = build_graph(read_net(str(ROOT / "models/lenet/lenet.prototxt")), pb.TEST)
    assert deploy.blob_shapes["prob"] == (64, 10)
