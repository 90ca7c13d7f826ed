"""R-CNN's window files and the windows WindowData samples from them (Caffe's WindowData layer).

A window file repeats, per image (whitespace separated, Caffe's format):

    # image_index
    image_path
    channels height width
    num_windows
    class_index overlap x1 y1 x2 y2        (num_windows lines; corners inclusive, 0-based pixels)

A window whose overlap is at least fg_threshold is foreground (its class must be 1 or more); one below
bg_threshold is background (class and overlap 0); others are not used. Each batch is batch_size - num_fg
background windows then num_fg = floor(batch_size * fg_fraction) foreground ones, each drawn at random.

Position n of the stream is item n mod batch_size of its batch: a background or a foreground window by
that item, drawn (with its mirror flip) by a generator seeded from the layer's seeds and n, so batch k is
a pure function of k as for every data layer. The window (widened by context_pad, squared by crop_mode
"square") is cut out of the image (color, BGR), warped to crop_size x crop_size (bilinear) with the part
outside the image left at zero, flipped when mirrored, mean-subtracted (mean_file at the warped pixel's
place in the mean's centre crop, or mean_value per channel) and scaled by window_data_param.scale.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

from superneurons.data.batches import WINDOW, Seeds
from superneurons.data.datum import array_to_pil, load_image, pil_to_array
from superneurons.errors import UserError
from superneurons.io.prototxt import decode_text

CHANNELS = 3  # Caffe reads every image in color


@dataclass(frozen=True)
class Window:
    image: int  # index into WindowRecords.images
    label: int
    overlap: float
    x1: int
    y1: int
    x2: int
    y2: int


def read_window_file(path: str, root: str, fg_threshold: float, bg_threshold: float, where: str):
    """(images as (path, (channels, height, width)), foreground windows, background windows)."""
    try:
        with open(path, "rb") as f:
            text = decode_text(f.read(), path, "a window file")
    except FileNotFoundError:
        raise UserError(f"{where}: window file {path!r} does not exist") from None
    except OSError as e:
        raise UserError(f"{where}: cannot read window file {path!r} ({e.strerror or e})") from None
    tokens = [(word, lineno) for lineno, line in enumerate(text.splitlines(), 1) for word in line.split()]
    pos = 0

    def take(what: str, kind=int):
        nonlocal pos
        if pos >= len(tokens):
            raise UserError(f"{path}: ends where {what} should be")
        word, lineno = tokens[pos]
        pos += 1
        try:
            return kind(word), lineno
        except ValueError:
            raise UserError(f"{path}:{lineno}: expected {what} ({kind.__name__}), got {word!r}") from None

    images: list[tuple[str, tuple[int, int, int]]] = []
    fg: list[Window] = []
    bg: list[Window] = []
    while pos < len(tokens):
        mark, lineno = take("'#'", str)
        if mark != "#":
            raise UserError(f"{path}:{lineno}: expected '# image_index', got {mark!r}")
        index, lineno = take("the image index")
        if index != len(images):
            raise UserError(f"{path}:{lineno}: image index {index}, expected {len(images)} (images are numbered "
                            f"from 0 in order)")
        name, lineno = take("the image path", str)
        image = root + name
        if not os.path.exists(image):
            raise UserError(f"{path}:{lineno}: image {image!r} does not exist")
        size = tuple(take(what)[0] for what in ("the channels", "the height", "the width"))
        if size[0] != CHANNELS or min(size) < 1:
            raise UserError(f"{path}:{lineno}: image {image!r} is {size[0]} x {size[1]} x {size[2]} (channels x "
                            f"height x width); WindowData reads images in color: 3 channels")
        images.append((image, size))
        count, _ = take("the number of windows")
        for _ in range(count):
            label, lineno = take("a window's class")
            overlap = take("a window's overlap", float)[0]
            x1, y1, x2, y2 = (take(f"a window's {c}")[0] for c in ("x1", "y1", "x2", "y2"))
            if not (0 <= x1 <= x2 < size[2] and 0 <= y1 <= y2 < size[1]):
                raise UserError(f"{path}:{lineno}: window ({x1}, {y1}, {x2}, {y2}) is not inside image {image!r} "
                                f"of {size[1]} x {size[2]} pixels")
            if overlap >= fg_threshold:
                if label < 1:
                    raise UserError(f"{path}:{lineno}: a foreground window (overlap {overlap:g} >= fg_threshold "
                                    f"{fg_threshold:g}) needs a class of 1 or more, got {label}")
                fg.append(Window(len(images) - 1, label, overlap, x1, y1, x2, y2))
            elif overlap < bg_threshold:
                bg.append(Window(len(images) - 1, 0, 0.0, x1, y1, x2, y2))
    if not images:
        raise UserError(f"{where}: window file {path!r} is empty")
    return images, fg, bg


def c_round(v: float) -> int:
    """C's round(): halves away from zero (Python's round() goes to the even neighbour)."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


@dataclass(frozen=True)
class WindowSettings:
    batch_size: int
    fg_fraction: float
    crop_size: int
    context_pad: int
    square: bool
    mirror: bool
    scale: float
    mean_image: np.ndarray | None  # (C, H, W)
    mean_values: tuple[float, ...]  # one per channel, or ()


class WindowRecords:
    """The windows of a window file as a RecordSource (`batches.RecordSource`) of warped, normalized crops."""

    multiprocess = True

    def __init__(self, path: str, root: str, fg_threshold: float, bg_threshold: float, settings: WindowSettings,
                 where: str):
        self.where = where
        self.settings = settings
        self.images, self.fg, self.bg = read_window_file(path, root, fg_threshold, bg_threshold, where)
        if not self.fg or not self.bg:
            raise UserError(f"{where}: window file {path!r} has {len(self.fg)} foreground and {len(self.bg)} "
                            f"background windows; WindowData samples both (fg_threshold {fg_threshold:g}, "
                            f"bg_threshold {bg_threshold:g})")
        self.count = len(self.fg) + len(self.bg)
        self.num_fg = int(settings.batch_size * np.float32(settings.fg_fraction))

    def open(self, seeds: Seeds) -> "WindowReader":
        return WindowReader(self, seeds)

    def close(self) -> None:
        pass


class WindowReader:
    def __init__(self, source: WindowRecords, seeds: Seeds):
        self.source = source
        self.seeds = seeds

    def read(self, position: int) -> tuple[int, np.ndarray, int]:
        s = self.source
        foreground = position % s.settings.batch_size >= s.settings.batch_size - s.num_fg
        pool = s.fg if foreground else s.bg
        rng = self.seeds.rng(WINDOW, position)
        window = pool[int(rng.integers(len(pool)))]
        mirror = s.settings.mirror and bool(rng.integers(2))
        path, _ = s.images[window.image]
        pixels = load_image(path, is_color=True)
        return window.image, warp_window(pixels, window, mirror, s.settings), window.label

    def close(self) -> None:
        pass


def warp_window(image: np.ndarray, w: Window, mirror: bool, s: WindowSettings) -> np.ndarray:
    """The window of `image` (C, H, W uint8) as WindowData's (C, crop_size, crop_size) float32 input."""
    size = s.crop_size
    height, width = image.shape[1:]
    x1, y1, x2, y2 = w.x1, w.y1, w.x2, w.y2
    pad_w = pad_h = 0
    out_h = out_w = size
    if s.context_pad > 0 or s.square:
        # Widen the window so that, warped to size x size, context_pad pixels of context surround it.
        grow = np.float32(size) / np.float32(size - 2 * s.context_pad)
        half_h, half_w = (y2 - y1 + 1) / 2.0, (x2 - x1 + 1) / 2.0
        cx, cy = x1 + half_w, y1 + half_h
        if s.square:
            half_h = half_w = max(half_h, half_w)
        x1, x2 = c_round(cx - half_w * grow), c_round(cx + half_w * grow)
        y1, y2 = c_round(cy - half_h * grow), c_round(cy + half_h * grow)
        full_h, full_w = y2 - y1 + 1, x2 - x1 + 1
        # The part past the image stays zero: clip, and keep how much was cut on each side.
        cut_x1, cut_y1 = max(0, -x1), max(0, -y1)
        cut_x2, cut_y2 = max(0, x2 - width + 1), max(0, y2 - height + 1)
        x1, x2, y1, y2 = x1 + cut_x1, x2 - cut_x2, y1 + cut_y1, y2 - cut_y2
        sx, sy = size / full_w, size / full_h
        out_w, out_h = c_round((x2 - x1 + 1) * sx), c_round((y2 - y1 + 1) * sy)
        pad_h = c_round(cut_y1 * sy)
        pad_w = c_round((cut_x2 if mirror else cut_x1) * sx)
        out_h, out_w = min(out_h, size - pad_h), min(out_w, size - pad_w)
    crop = image[:, y1:y2 + 1, x1:x2 + 1]
    warped = pil_to_array(array_to_pil(crop).resize((max(out_w, 1), max(out_h, 1)), Image.BILINEAR), force_color=True)
    if mirror:
        warped = warped[:, :, ::-1]
    values = warped.astype(np.float32)
    if s.mean_image is not None:
        off = (s.mean_image.shape[2] - size) // 2
        values -= s.mean_image[:, off + pad_h:off + pad_h + out_h, off + pad_w:off + pad_w + out_w]
    elif s.mean_values:
        values -= np.asarray(s.mean_values, np.float32).reshape(-1, 1, 1)
    out = np.zeros((image.shape[0], size, size), np.float32)
    out[:, pad_h:pad_h + out_h, pad_w:pad_w + out_w] = values * np.float32(s.scale)
    return out
