"""caffe.io, caffe.NetSpec and caffe.draw: each checked against NumPy or the protobuf schema directly."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from google.protobuf import text_format
from PIL import Image

import superneurons as caffe
from superneurons import layers as L
from superneurons import params as P
from superneurons.errors import UserError
from superneurons.proto import caffe_pb2


# -- caffe.io ----------------------------------------------------------------------------------------------


def test_transformer_preprocess_and_deprocess(rng):
    t = caffe.io.Transformer({"data": (10, 3, 4, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    mean = rng.uniform(0, 255, (3, 4, 5)).astype(np.float32)
    t.set_mean("data", mean)
    t.set_input_scale("data", 0.5)
    image = rng.uniform(0, 1, (4, 5, 3)).astype(np.float32)
    x = t.preprocess("data", image)
    expected = (image.transpose(2, 0, 1)[::-1] * 255 - mean) * 0.5
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-4)
    assert x.dtype == np.float32
    np.testing.assert_allclose(t.deprocess("data", x), image, atol=1e-5)

    t.set_mean("data", np.array([1.0, 2.0, 3.0]))  # per channel
    np.testing.assert_allclose(t.preprocess("data", image),
                               (image.transpose(2, 0, 1)[::-1] * 255 - [[[1.0]], [[2.0]], [[3.0]]]) * 0.5, atol=1e-4)
    with pytest.raises(UserError, match="not one of the net inputs"):
        t.preprocess("label", image)
    with pytest.raises(UserError, match="channels"):
        t.set_mean("data", np.zeros(4))
    with pytest.raises(UserError, match="differs"):
        t.set_mean("data", np.zeros((3, 5, 5)))
    with pytest.raises(UserError, match="3 channels"):
        t.set_channel_swap("data", (1, 0))


def test_transformer_resizes_images_of_another_size(rng):
    t = caffe.io.Transformer({"data": (1, 3, 6, 6)})
    t.set_transpose("data", (2, 0, 1))
    image = rng.uniform(0, 1, (12, 9, 3)).astype(np.float32)
    x = t.preprocess("data", image)
    np.testing.assert_array_equal(x, caffe.io.resize_image(image, (6, 6)).transpose(2, 0, 1))


def test_resize_image(rng):
    image = rng.uniform(0.2, 0.9, (5, 7, 3))
    same = caffe.io.resize_image(image, (5, 7))
    np.testing.assert_allclose(same, image, atol=1e-6)  # same size: unchanged
    flat = caffe.io.resize_image(np.full((4, 4, 1), 0.3), (9, 2))
    assert flat.shape == (9, 2, 1) and np.allclose(flat, 0.3) and flat.dtype == np.float32
    # Doubling with bilinear interpolation at pixel centres: interior output pixels are 3:1 mixes of their
    # two nearest input pixels along each axis.
    up = caffe.io.resize_image(image, (10, 14))
    assert up.shape == (10, 14, 3)
    np.testing.assert_allclose(up[3, 5], 0.75 * (0.75 * image[1, 2] + 0.25 * image[1, 3]) +
                               0.25 * (0.75 * image[2, 2] + 0.25 * image[2, 3]), atol=1e-6)
    assert image.min() - 1e-6 <= up.min() and up.max() <= image.max() + 1e-6
    four = caffe.io.resize_image(rng.uniform(size=(6, 6, 4)), (3, 3))  # not 1 or 3 channels: a plain zoom
    assert four.shape == (3, 3, 4)


@pytest.mark.parametrize("shape,out", [((5, 7, 3), (10, 14)), ((12, 9, 3), (6, 6)), ((12, 9, 1), (5, 4)),
                                       ((20, 3, 3), (4, 9)), ((6, 6, 4), (3, 3)), ((4, 5, 2), (9, 11))])
def test_resize_image_is_scikit_images_recipe(shape, out, rng):
    """pycaffe's resize through scikit-image, spelled out with SciPy's filters (where SciPy is installed)."""
    ndimage = pytest.importorskip("scipy.ndimage")
    image = rng.uniform(-2, 3, shape)
    if shape[-1] in (1, 3):
        lo, hi = image.min(), image.max()
        unit = (image - lo) / (hi - lo)
        factors = np.array([shape[0] / out[0], shape[1] / out[1], 1.0])
        if (factors > 1).any():
            unit = ndimage.gaussian_filter(unit, np.maximum(0, (factors - 1) / 2), mode="constant", cval=0)
        unit = ndimage.zoom(unit, (out[0] / shape[0], out[1] / shape[1], 1), order=1, mode="grid-constant",
                            grid_mode=True)
        expected = np.clip(unit, 0, 1) * (hi - lo) + lo
    else:
        expected = ndimage.zoom(image, (out[0] / shape[0], out[1] / shape[1], 1), order=1)
    np.testing.assert_allclose(caffe.io.resize_image(image, out), expected, atol=2e-6)


def test_oversample_takes_corners_centre_and_mirrors(rng):
    images = rng.standard_normal((2, 8, 10, 3)).astype(np.float32)
    crops = caffe.io.oversample(images, (4, 6))
    assert crops.shape == (20, 4, 6, 3)
    for i, image in enumerate(images):
        boxes = [(0, 0), (0, 4), (4, 0), (4, 4), (2, 2)]
        for k, (top, left) in enumerate(boxes):
            window = image[top:top + 4, left:left + 6]
            np.testing.assert_array_equal(crops[10 * i + k], window)
            np.testing.assert_array_equal(crops[10 * i + 5 + k], window[:, ::-1])


def test_load_image(tmp_path, rng):
    pixels = rng.integers(0, 256, (5, 6, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(tmp_path / "rgb.png")
    Image.fromarray(pixels[:, :, 0], "L").save(tmp_path / "gray.png")
    rgb = caffe.io.load_image(str(tmp_path / "rgb.png"))
    assert rgb.shape == (5, 6, 3) and rgb.dtype == np.float32
    np.testing.assert_allclose(rgb, pixels / 255.0, atol=1e-7)
    gray = caffe.io.load_image(str(tmp_path / "gray.png"), color=False)
    assert gray.shape == (5, 6, 1)
    np.testing.assert_allclose(gray[:, :, 0], pixels[:, :, 0] / 255.0, atol=1e-7)
    np.testing.assert_allclose(caffe.io.load_image(str(tmp_path / "gray.png")), np.repeat(gray, 3, axis=2))
    with pytest.raises(UserError, match="no such image"):
        caffe.io.load_image(str(tmp_path / "missing.png"))


def test_datum_and_blobproto_conversions(rng):
    pixels = rng.integers(0, 256, (3, 4, 5), dtype=np.uint8)
    datum = caffe.io.array_to_datum(pixels, 7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (3, 4, 5, 7)
    assert datum.data == pixels.tobytes() and not len(datum.float_data)
    np.testing.assert_array_equal(caffe.io.datum_to_array(datum), pixels)
    floats = rng.standard_normal((2, 3, 4))
    parsed = caffe_pb2.Datum()
    parsed.ParseFromString(caffe.io.array_to_datum(floats).SerializeToString())
    back = caffe.io.datum_to_array(parsed)
    assert back.dtype == np.float64 and parsed.label == 0
    np.testing.assert_allclose(back, floats.astype(np.float32))

    arr, diff = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
    blob = caffe.io.array_to_blobproto(arr, diff)
    assert list(blob.shape.dim) == [2, 3, 4, 5]
    np.testing.assert_allclose(caffe.io.blobproto_to_array(blob), arr.astype(np.float32))
    np.testing.assert_allclose(caffe.io.blobproto_to_array(blob, return_diff=True), diff.astype(np.float32))
    legacy = text_format.Parse("num: 1 channels: 2 height: 1 width: 2 data: [1, 2, 3, 4]", caffe_pb2.BlobProto())
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(legacy), [[[[1, 2]], [[3, 4]]]])
    text = caffe.io.arraylist_to_blobprotovector_str([arr, diff[0]])
    restored = caffe.io.blobprotovector_str_to_arraylist(text)
    assert [a.shape for a in restored] == [(2, 3, 4, 5), (3, 4, 5)]
    np.testing.assert_allclose(restored[1], diff[0].astype(np.float32))
    with pytest.raises(UserError, match="C x H x W"):
        caffe.io.array_to_datum(np.zeros((2, 2)))


# -- NetSpec -----------------------------------------------------------------------------------------------


def test_netspec_writes_caffes_prototxt():
    n = caffe.NetSpec()
    n.data = L.Input(shape=[dict(dim=[2, 3, 8, 8])])
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=3, pad=1, weight_filler=dict(type="gaussian", std=0.1),
                           param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)])
    n.relu = L.ReLU(n.conv, in_place=True)
    n.pool = L.Pooling(n.relu, pool=P.Pooling.AVE, global_pooling=True)
    n.a, n.b = L.Slice(n.pool, ntop=2, slice_param=dict(axis=1, slice_point=[2]))
    n.sum = L.Eltwise(n.a, n.b, operation=P.Eltwise.SUM, loss_weight=1)
    L.Silence(n.b, ntop=0)  # a layer with no tops is returned as itself
    expected = text_format.Parse("""
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 4 pad: 1 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: AVE global_pooling: true } }
layer { name: "a" type: "Slice" bottom: "pool" top: "a" top: "b" slice_param { axis: 1 slice_point: 2 } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "sum" loss_weight: 1
        eltwise_param { operation: SUM } }
""", caffe_pb2.NetParameter())
    assert n.to_proto() == expected
    # The written net builds and runs.
    from superneurons.graph.build import build_graph

    graph = build_graph(n.to_proto(), caffe.TRAIN)
    assert graph.blob_shapes["sum"] == (2, 2, 1, 1)


def test_netspec_names_unnamed_tops_and_reports_bad_fields():
    n = caffe.NetSpec()
    n.data = L.DummyData(shape=dict(dim=[1, 4]))
    hidden = L.InnerProduct(n.data, num_output=3)
    n.out = L.Sigmoid(hidden)
    proto = n.to_proto()
    assert [(lp.name, list(lp.top)) for lp in proto.layer] == [
        ("data", ["data"]), ("InnerProduct1", ["InnerProduct1"]), ("out", ["out"])]
    assert [lp.name for lp in caffe.to_proto(hidden).layer] == ["DummyData1", "InnerProduct1"]
    with pytest.raises(UserError, match="kernel_szie"):
        caffe.to_proto(L.Convolution(n.data, kernel_szie=3))
    with pytest.raises(TypeError, match=r"^ReLU input 0 is not a Top \(type is <class 'str'>\)$"):  # pycaffe's words and type
        L.ReLU("data")
    assert P.Pooling.MAX == caffe_pb2.PoolingParameter.MAX and P.Data.LMDB == caffe_pb2.DataParameter.LMDB


# -- caffe.draw ----------------------------------------------------------------------------------------------


NET = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 stride: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "drop" type: "Dropout" bottom: "conv" top: "conv" include { phase: TRAIN } }
"""


def test_draw_writes_graphviz_text_and_says_what_is_missing(tmp_path, monkeypatch):
    net = text_format.Parse(NET, caffe_pb2.NetParameter())
    dot = caffe.draw.net_to_dot(net, "TB", phase=caffe.TEST)
    assert 'digraph "tiny"' in dot and "rankdir=TB" in dot
    assert '"conv_Convolution" [shape="record", fillcolor="#FF5050"' in dot
    assert 'label="conv (Convolution) kernel size: 3 stride: 1 pad: 0"' in dot
    assert '"data_blob" -> "conv_Convolution";' in dot and '"conv_Convolution" -> "conv_blob" [label="2"];' in dot
    assert '"relu_ReLU" -> "conv_blob";' in dot  # in place: back to its own blob
    assert "drop" not in dot  # a TRAIN-only layer in a TEST picture
    assert "drop_Dropout" in caffe.draw.net_to_dot(net)

    caffe.draw.draw_net_to_file(net, str(tmp_path / "tiny.dot"))
    assert (tmp_path / "tiny.dot").read_text() == caffe.draw.net_to_dot(net)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(UserError, match="Graphviz"):
        caffe.draw.draw_net_to_file(net, str(tmp_path / "tiny.png"))
    with pytest.raises(UserError, match="rankdir"):
        caffe.draw.net_to_dot(net, "XY")


# -- caffe.Detector ------------------------------------------------------------------------------------------


DETECT_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "score" type: "InnerProduct" bottom: "data" top: "score"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
"""


@pytest.fixture
def detector_files(tmp_path, rng):
    model = tmp_path / "detect.prototxt"
    model.write_text(DETECT_NET)
    caffe.Net(str(model), caffe.TEST).save(str(tmp_path / "detect.caffemodel"))  # random weights
    pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(tmp_path / "image.png")
    return str(model), str(tmp_path / "detect.caffemodel"), str(tmp_path / "image.png"), pixels / np.float32(255)


def test_detector_scores_each_window(detector_files):
    model, weights, image_file, image = detector_files
    detector = caffe.Detector(model, weights, raw_scale=255, channel_swap=(2, 1, 0))
    windows = [(0, 0, 10, 10), (5, 3, 20, 17)]
    detections = detector.detect_windows([(image_file, windows)])
    assert [d["window"] for d in detections] == windows and detections[0]["filename"] == image_file
    w, b = (p.data.astype(np.float64) for p in detector.params["score"])
    for (y0, x0, y1, x1), d in zip(windows, detections):
        x = caffe.io.resize_image(image[y0:y1, x0:x1], (8, 8)).transpose(2, 0, 1)[::-1] * 255
        np.testing.assert_allclose(d["prediction"], x.reshape(-1) @ w.T + b, rtol=1e-4, atol=1e-3)


def test_detector_context_padding_geometry(detector_files):
    """Windows grown by context_pad pixels at the input's scale (8 px input, pad 1: by 8/6), the part
    outside the image filled with the mean (in the image's terms: channel order back, raw_scale undone)."""
    model, weights, _image_file, image = detector_files
    mean = np.array([10.0, 20.0, 30.0])
    detector = caffe.Detector(model, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0), context_pad=1)
    inside = detector.crop(image, (5, 5, 14, 14))  # 10 x 10 around (10, 10): grown to rows/cols 3..17
    np.testing.assert_allclose(inside, caffe.io.resize_image(image[3:17, 3:17], (8, 8)))
    corner = detector.crop(image, (0, 0, 9, 9))  # grown to -2..12: 1 px of mean, then 7 px of image
    np.testing.assert_allclose(corner[1:, 1:], caffe.io.resize_image(image[0:12, 0:12], (7, 7)))
    expected_mean = np.array([30.0, 20.0, 10.0]) / 255  # the mean is BGR (the net's order); the image RGB
    np.testing.assert_allclose(corner[0, :], np.tile(expected_mean, (8, 1)), rtol=1e-6)
    np.testing.assert_allclose(corner[:, 0], np.tile(expected_mean, (8, 1)), rtol=1e-6)
