"""WindowData (layers/window_data.py, data/windows.py) on generated images and window files: the batch layout
(background windows, then fg_fraction foreground ones), the warped crops against crops cut by hand, the zero
band where context_pad reaches past the image, mirroring, the window file's errors, and a small net training."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format
from harness import cpu_net
from PIL import Image

from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.proto import superneurons_pb2 as pb


def write_images(folder, rng, sizes):
    """RGB images of random pixels in [1, 255] (so a zero in a crop is padding); their (C, H, W) BGR arrays."""
    arrays = []
    for k, (h, w) in enumerate(sizes):
        rgb = rng.integers(1, 256, size=(h, w, 3), dtype=np.uint8)
        Image.fromarray(rgb).save(folder / f"img{k}.png")
        arrays.append(rgb[:, :, ::-1].transpose(2, 0, 1).astype(np.float32))
    return arrays


def write_window_file(path, images, windows):
    """windows[k]: (class, overlap, x1, y1, x2, y2) lines of image k; paths relative to the file's folder."""
    lines = []
    for k, ((h, w), boxes) in enumerate(zip(images, windows)):
        lines += [f"# {k}", f"img{k}.png", "3", str(h), str(w), str(len(boxes))]
        lines += [" ".join(str(v) for v in box) for box in boxes]
    path.write_text("\n".join(lines) + "\n")


def window_layer(folder, batch, crop, extra="", transform=""):
    return (f"layer {{ name: 'data' type: 'WindowData' top: 'data' top: 'label' "
            f"transform_param {{ crop_size: {crop} {transform} }} "
            f"window_data_param {{ source: '{folder}/windows.txt' root_folder: '{folder}/' batch_size: {batch} "
            f"fg_threshold: 0.5 bg_threshold: 0.3 fg_fraction: 0.5 {extra} }} }} ")


def first_batch(text):
    net = cpu_net(text + "layer { name: 'sink' type: 'Silence' bottom: 'data' bottom: 'label' }")
    net.forward()
    return net.blob("data").copy(), net.blob("label").copy()


def test_batches_are_background_then_foreground_crops_of_their_windows(tmp_path, rng):
    sizes = [(20, 24), (18, 16)]
    images = write_images(tmp_path, rng, sizes)
    # Crops of exactly crop_size (6x6): the warp is then a plain cut, which the test does by hand.
    windows = [[(3, 0.9, 2, 3, 7, 8), (0, 0.1, 10, 5, 15, 10), (5, 0.4, 0, 0, 5, 5)],  # the last one is unused
               [(2, 0.7, 4, 4, 9, 9), (1, 0.2, 0, 12, 5, 17)]]
    write_window_file(tmp_path / "windows.txt", sizes, windows)
    means = "mean_value: 10 mean_value: 20 mean_value: 30"
    data, label = first_batch(window_layer(tmp_path, 8, 6, "scale: 0.5", means))
    assert data.shape == (8, 3, 6, 6) and label.shape == (8,)
    assert (label[:4] == 0).all() and set(label[4:]) <= {2.0, 3.0}  # 8 * 0.5 foreground windows, last
    mean = np.array([10, 20, 30], np.float32).reshape(3, 1, 1)
    def crop(k, box):
        x1, y1, x2, y2 = box[2:]
        return (images[k][:, y1:y2 + 1, x1:x2 + 1] - mean) * 0.5

    foreground = [crop(0, windows[0][0]), crop(1, windows[1][0])]  # overlaps 0.9 and 0.7 >= fg_threshold
    background = [crop(0, windows[0][1]), crop(1, windows[1][1])]  # 0.1 and 0.2 < bg_threshold; 0.4 is neither
    for item, lab in zip(data, label):
        candidates = foreground if lab > 0 else background
        assert any(np.array_equal(item, c) for c in candidates), "a window's crop differs from its hand-cut pixels"


def test_context_pad_past_the_image_leaves_a_zero_band_and_mirror_flips(tmp_path, rng):
    sizes = [(30, 30)]
    write_images(tmp_path, rng, sizes)
    # A 10x10 window at the top-left corner, widened by context_pad 4 of a 20-pixel crop: the widened region
    # starts left of and above the image, so the warped crop has a zero band on those sides.
    write_window_file(tmp_path / "windows.txt", sizes, [[(1, 0.8, 0, 0, 9, 9), (0, 0.0, 0, 0, 9, 9)]])
    data, label = first_batch(window_layer(tmp_path, 16, 20, "context_pad: 4"))
    # grow = 20 / 12; centre 5, half 5: x1 = y1 = round(5 - 8.33) = -3, so 3 / 16.67 x 20 = 3.6 -> 4 rows and columns
    for item in data:
        assert (item[:, :4, :] == 0).all() and (item[:, 4:, 4:16] > 0).all()
        assert (item[:, :, :4] == 0).all()
    mirrored = first_batch(window_layer(tmp_path, 16, 20, "context_pad: 4", "mirror: true"))[0]
    flipped = [not (m[:, :, :4] == 0).all() and (m[:, :, -4:] == 0).all() for m in mirrored]
    assert any(flipped) and not all(flipped)  # the padding follows the mirrored side
    for m in mirrored:
        assert any(np.allclose(m, item) or np.allclose(m, item[:, :, ::-1]) for item in data[:1])


@pytest.mark.parametrize("content,message", [
    ("# 0\nimg0.png\n3\n10\n10\n1\n1 0.9 0 0 12 5\n", r"windows.txt:7: window \(0, 0, 12, 5\) is not inside image"),
    ("# 0\nimg0.png\n3\n10\n10\n1\n0 0.9 0 0 5 5\n",
     r"windows.txt:7: a foreground window .* needs a class of 1 or more"),
    ("# 0\nimg0.png\n3\n10\nten\n", r"windows.txt:5: expected the width \(int\), got 'ten'"),
    ("# 0\nimg0.png\n3\n10\n10\n1\n1 0.9 0 0 5 5\n", r"has 1 foreground and 0 background windows"),
    ("# 1\nimg0.png\n", r"windows.txt:1: image index 1, expected 0"),
    ("# 0\nnone.png\n", r"windows.txt:2: image '.*none.png' does not exist"),
])
def test_window_file_errors_name_the_line(tmp_path, rng, content, message):
    write_images(tmp_path, rng, [(10, 10)])
    (tmp_path / "windows.txt").write_text(content)
    net = text_format.Parse(window_layer(tmp_path, 4, 6), pb.NetParameter())
    with pytest.raises(UserError, match=message) as e:
        build_graph(net, pb.TRAIN)
    assert "\n" not in str(e.value)


def test_a_small_net_trains_on_windows(tmp_path, rng):
    """A few iterations of a classifier on WindowData batches, as Caffe's finetune_pascal_detection does."""
    from superneurons.solver.solver import Solver

    sizes = [(24, 24), (20, 28)]
    write_images(tmp_path, rng, sizes)
    write_window_file(tmp_path / "windows.txt", sizes,
                      [[(1, 0.8, 2, 2, 12, 12), (0, 0.1, 10, 10, 20, 20)],
                       [(2, 0.6, 5, 3, 19, 15), (0, 0.0, 0, 0, 7, 7)]])
    text = (window_layer(tmp_path, 8, 12, "context_pad: 2 crop_mode: 'square'", "mirror: true mean_value: 128")
            + "layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv' convolution_param { num_output: 4 "
              "kernel_size: 3 stride: 2 weight_filler { type: 'gaussian' std: 0.01 } } } "
              "layer { name: 'fc' type: 'InnerProduct' bottom: 'conv' top: 'fc' inner_product_param { num_output: 3 "
              "weight_filler { type: 'gaussian' std: 0.01 } } } "
              "layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'fc' bottom: 'label' top: 'loss' }")
    (tmp_path / "net.prototxt").write_text(text)
    solver = pb.SolverParameter(net=str(tmp_path / "net.prototxt"), base_lr=0.001, momentum=0.9, max_iter=4,
                                lr_policy="fixed", display=0, snapshot_after_train=False, random_seed=3)
    s = Solver(solver, str(tmp_path / "solver.prototxt"))
    s.solve()
    assert s.iter == 4 and np.isfinite(s.net.loss_value())

