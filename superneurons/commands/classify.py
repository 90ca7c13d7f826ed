"""`superneurons classify`: Caffe's classification example as a command (python/classify.py, oversample off).

Each image is preprocessed the way Caffe's Python `Classifier` + `Transformer` do it:
load as RGB floats in [0, 1]; resize (bilinear) to --resize H,W (default: the net's input H x W); center-crop
to the net's input H x W; HWC -> CHW; channel swap (default 2,1,0: RGB -> BGR, the order Caffe models were
trained in); multiply by --raw-scale; subtract the mean (--mean-file image or --mean-value per channel);
multiply by --scale. The deploy net runs forward (TEST phase) and the top-k entries of its output blob
are printed per image.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from superneurons.commands._options import add_command
from superneurons.errors import UserError
from superneurons.io.caffe_io import load_image
from superneurons.io.prototxt import decode_text

EXAMPLES = """examples:
  superneurons classify --model deploy.prototxt --weights bvlc_alexnet.caffemodel \\
      --mean-file imagenet_mean.binaryproto --resize 256,256 --labels synset_words.txt cat.jpg dog.png
  superneurons classify --model mobilenet_deploy.prototxt --weights mobilenet.caffemodel \\
      --mean-value 103.94,116.78,123.68 --scale 0.017 --top-k 3 --gpu 0 *.jpg
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "classify", run,
                    help="classify images with a deploy net and print the top-k labels",
                    examples=EXAMPLES)
    p.add_argument("images", nargs="+", metavar="IMAGE", help="image files (anything Pillow reads)")
    p.add_argument("--model", required=True, help="deploy prototxt (an Input layer, or input: fields)")
    p.add_argument("--weights", required=True, help="comma-separated .caffemodel files")
    p.add_argument("--mean-file", help=".binaryproto mean image (C x H x W; center-cropped if larger than the input)")
    p.add_argument("--mean-value", action="append", default=[], metavar="V[,V,...]",
                   help="per-channel mean, e.g. 104,117,123 (in the order of the net's channels, after the swap)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the input by this after mean subtraction")
    p.add_argument("--raw-scale", type=float, default=255.0,
                   help="multiply the [0, 1] image by this before mean subtraction (default 255)")
    p.add_argument("--channel-swap",
                   help="channel order of the net's input, indices into RGB (default 2,1,0 = BGR; 'none' keeps RGB); "
                        "a 1-channel net reads the images as grayscale and takes no swap")
    p.add_argument("--resize", metavar="H,W", help="resize to H,W before the center crop (default: the input size)")
    p.add_argument("--labels", help="text file: one label per class, line k naming class k (e.g. synset_words.txt)")
    p.add_argument("--top-k", type=int, default=5, help="how many classes to print per image (default 5)")
    p.add_argument("--output", help="output blob to read (default: the net's one output)")
    p.add_argument("--batch", type=int, default=10, help="images per forward pass (default 10)")
    p.add_argument("--gpu", help="GPU id (default: the CPU)")
    return p


# -- preprocessing (pure NumPy + Pillow, so tests can check it on its own) --------------------------------


def _ints(text: str, flag: str, n: int | None = None) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None
    if n is not None and len(values) != n:
        raise UserError(f"{flag} {text!r}: expected {n} values, got {len(values)}")
    return values


def parse_mean_values(items: list[str]) -> list[float]:
    out: list[float] = []
    for item in items:
        for v in item.split(","):
            if v.strip():
                try:
                    out.append(float(v))
                except ValueError:
                    raise UserError(f"--mean-value {item!r}: {v!r} is not a number") from None
    return out


def resize_image(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of an H x W x C float image, channel by channel (caffe.io.resize_image, order 1)."""
    if img.shape[:2] == (height, width):
        return img
    from PIL import Image

    chans = [np.asarray(Image.fromarray(np.ascontiguousarray(img[:, :, c]), mode="F")
                        .resize((width, height), Image.BILINEAR), dtype=np.float32) for c in range(img.shape[2])]
    return np.stack(chans, axis=2)


def center_crop(img: np.ndarray, height: int, width: int, what: str) -> np.ndarray:
    """The central H x W of an (..., H', W', ...) array whose spatial axes are the first two (HWC)."""
    h, w = img.shape[:2]
    if h < height or w < width:
        raise UserError(f"{what}: {h} x {w} is smaller than the net's input {height} x {width}; "
                        "use --resize H,W with H and W at least the input size")
    top, left = (h - height) // 2, (w - width) // 2
    return img[top:top + height, left:left + width]


def preprocess(img: np.ndarray, height: int, width: int, *, resize: tuple[int, int] | None = None,
               channel_swap: list[int] | None = (2, 1, 0), raw_scale: float = 255.0, mean: np.ndarray | None = None,
               scale: float = 1.0, where: str = "<image>") -> np.ndarray:
    """HWC RGB [0, 1] image -> the net's C x H x W input (see the module docstring for the order of steps)."""
    rh, rw = resize or (height, width)
    x = center_crop(resize_image(img, rh, rw), height, width, where)
    x = x.transpose(2, 0, 1)
    if channel_swap is not None:
        x = x[list(channel_swap)]
    x = x * np.float32(raw_scale)
    if mean is not None:
        x = x - mean
    x = x * np.float32(scale)
    return np.ascontiguousarray(x, dtype=np.float32)


def make_mean(args, channels: int, height: int, width: int) -> np.ndarray | None:
    values = parse_mean_values(args.mean_value)
    if args.mean_file and values:
        raise UserError("give --mean-file or --mean-value, not both")
    if args.mean_file:
        from superneurons.io.binaryproto import read_mean

        mean = read_mean(args.mean_file)
        if mean.shape[0] != channels:
            raise UserError(f"{args.mean_file}: the mean has {mean.shape[0]} channels, the net's input has {channels}")
        hwc = center_crop(mean.transpose(1, 2, 0), height, width, f"{args.mean_file}: mean image")
        return np.ascontiguousarray(hwc.transpose(2, 0, 1), dtype=np.float32)
    if values:
        if len(values) == 1:
            values = values * channels
        if len(values) != channels:
            raise UserError(f"--mean-value gives {len(values)} values; the net's input has {channels} channels "
                            "(give one value, or one per channel)")
        return np.asarray(values, dtype=np.float32).reshape(channels, 1, 1)
    return None


def read_labels(path: str, classes: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            labels = decode_text(f.read(), path, "a labels file (one name a line)").splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read the labels ({e.strerror or e})") from None
    while labels and not labels[-1].strip():
        labels.pop()
    if len(labels) < classes:
        raise UserError(f"{path}: {len(labels)} label line(s), but the net's output has {classes} classes")
    return labels


# -- the command ------------------------------------------------------------------------------------------


def _input_blob(graph, where: str) -> tuple[str, tuple[int, ...]]:
    inputs = [(n.tops[0], n.top_shapes[0]) for n in graph.nodes if n.layer.type_name == "Input"]
    if len(inputs) != 1:
        raise UserError(f"{where}: classify needs a deploy net with exactly one Input layer (or input: field), "
                        f"found {len(inputs)}")
    name, shape = inputs[0]
    if len(shape) != 4:
        raise UserError(f"{where}: input blob {name!r} has shape {shape}; expected N x C x H x W")
    return name, shape


def run(args) -> int:
    from superneurons.commands._options import pick_backend
    from superneurons.graph.batch import set_batch
    from superneurons.graph.build import build_graph
    from superneurons.io.caffemodel import load_weights_files
    from superneurons.io.prototxt import read_net
    from superneurons.proto import superneurons_pb2 as pb
    from superneurons.runtime.net import Net

    if args.top_k <= 0:
        raise UserError(f"--top-k must be positive, got {args.top_k}")
    if args.batch <= 0:
        raise UserError(f"--batch must be positive, got {args.batch}")
    resize = tuple(_ints(args.resize, "--resize", 2)) if args.resize else None
    if resize is not None and min(resize) <= 0:
        raise UserError(f"--resize {args.resize!r}: sizes must be positive")
    for path in args.images:
        if not os.path.isfile(path):
            raise UserError(f"{path}: no such image file")

    net_param = read_net(args.model)
    batch = min(len(args.images), args.batch)
    set_batch(net_param, batch)
    graph = build_graph(net_param, pb.TEST, source=args.model)
    in_name, (_, channels, height, width) = _input_blob(graph, args.model)
    if channels not in (1, 3):
        raise UserError(f"{args.model}: input {in_name!r} has {channels} channels; classify feeds RGB (3) "
                        "or grayscale (1) images")
    color = channels == 3
    swap = None
    if args.channel_swap is not None and args.channel_swap.lower() != "none":
        swap = _ints(args.channel_swap, "--channel-swap")
        if not color or sorted(swap) != [0, 1, 2]:
            raise UserError(f"--channel-swap {args.channel_swap!r}: expected a permutation of 0,1,2 for a 3-channel "
                            f"input; the net's input {in_name!r} has {channels} channel(s)")
    elif args.channel_swap is None and color:
        swap = [2, 1, 0]  # Caffe's models take BGR
    out_name = args.output
    if out_name is None:
        outs = [o for o in graph.outputs if o != in_name]
        if len(outs) != 1:
            raise UserError(f"{args.model}: the net has {len(outs)} outputs ({', '.join(outs)}); "
                            "pick one with --output")
        out_name = outs[0]
    elif out_name not in graph.blob_shapes:
        raise UserError(f"{args.model}: no blob named {out_name!r} (--output)")
    producer = next(n for n in reversed(graph.nodes) if out_name in n.tops)
    kind = "probability" if producer.layer.type_name == "Softmax" else "score"

    mean = make_mean(args, channels, height, width)
    net = Net(graph, pick_backend(args.gpu), train=False, seed=0)
    load_weights_files(net, args.weights)
    classes = int(np.prod(graph.blob_shapes[out_name][1:]))
    labels = read_labels(args.labels, classes) if args.labels else None
    k = min(args.top_k, classes)

    for start in range(0, len(args.images), batch):
        paths = args.images[start:start + batch]
        x = np.zeros((batch, channels, height, width), dtype=np.float32)  # a short last batch is zero-padded
        for j, path in enumerate(paths):
            x[j] = preprocess(load_image(path, color), height, width, resize=resize, channel_swap=swap,
                              raw_scale=args.raw_scale, mean=mean, scale=args.scale, where=path)
        net.backend.from_host(net.data[in_name].array, x)
        net.forward()
        scores = net.blob(out_name).reshape(batch, -1)
        for j, path in enumerate(paths):
            row = scores[j]
            order = np.argsort(-row, kind="stable")[:k]
            print(f"{path}:")
            for rank, c in enumerate(order, 1):
                name = labels[c] if labels else f"class {c}"
                print(f"  {rank}. {kind} {row[c]:.4f}  {name}  (#{c})")
    return 0
