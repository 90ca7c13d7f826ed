"""Caffe's convert_imageset: the images a list file names, as (key, serialized Datum) records.

Keys are `%08d_<name>` with the line's position in the (possibly shuffled) list, as Caffe writes
them, so a database built here sorts and reads like Caffe's. Raw records hold BGR (or gray) uint8
pixels; encoded ones the image file: the file's own bytes when nothing asks to change them (colour,
no resize, the requested format is the file's), else the image re-encoded, as Caffe does.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from superneurons.data.datum import array_to_datum, encode_image, encoded_datum, load_image
from superneurons.errors import UserError

SHUFFLE_SEED = 0  # shuffling gives the same order every time, as Caffe's fixed-seed shuffle does
_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "bmp": "BMP"}


@dataclass(frozen=True)
class ImagesetOptions:
    gray: bool = False
    resize_height: int = 0
    resize_width: int = 0
    encoded: bool = False
    encode_type: str = ""  # png, jpg, ...; empty: the file's own format
    check_size: bool = False


def shuffled(entries: list[tuple[str, int]]) -> list[tuple[str, int]]:
    order = np.random.default_rng(SHUFFLE_SEED).permutation(len(entries))
    return [entries[i] for i in order]


def _format_name(text: str) -> str:
    """'JPEG', 'jpeg', 'jpg' -> 'jpg'; other names lowercased."""
    text = text.lower()
    return "jpg" if text == "jpeg" else text


def _extension(name: str) -> str:
    return _format_name(os.path.splitext(name)[1].lstrip("."))


def _serialized(path: str, name: str, label: int, options: ImagesetOptions, pixels: np.ndarray) -> bytes:
    """The serialized Datum of one image, read as `pixels`."""
    if not options.encoded:
        return array_to_datum(pixels, label).SerializeToString()
    wanted = _format_name(options.encode_type) if options.encode_type else _extension(name)
    resized = options.resize_height > 0 and options.resize_width > 0
    if not options.gray and not resized and wanted == _extension(name):
        with open(path, "rb") as f:  # the file as it is
            return encoded_datum(f.read(), label).SerializeToString()
    if wanted not in _FORMATS:
        raise UserError(f"{path}: cannot encode as {wanted!r}; use -encode_type with one of {', '.join(_FORMATS)}")
    return encoded_datum(encode_image(pixels, _FORMATS[wanted]), label).SerializeToString()


def imageset_records(root: str, entries: list[tuple[str, int]], options: ImagesetOptions,
                     skipped: Callable[[str, UserError], None],
                     advance: Callable[[], None] = lambda: None) -> Iterator[tuple[bytes, bytes]]:
    """Records of the images `entries` names under `root` (a plain prefix, as Caffe's ROOTFOLDER).

    An image that cannot be read is reported to `skipped` and left out, as Caffe does; `advance` is
    called once per list entry (for a progress display).
    """
    first_shape = None
    for line_id, (name, label) in enumerate(entries):
        path = root + name
        try:
            pixels = load_image(path, not options.gray, options.resize_height, options.resize_width)
        except UserError as e:  # missing or undecodable
            skipped(path, e)
            advance()
            continue
        if options.check_size:
            if first_shape is None:
                first_shape = pixels.shape
            elif pixels.shape != first_shape:
                raise UserError(f"{path}: image is {_fmt(pixels.shape)}, the first one {_fmt(first_shape)} "
                                f"(-check_size)")
        advance()
        yield b"%08d_%s" % (line_id, name.encode()), _serialized(path, name, label, options, pixels)


def _fmt(shape) -> str:
    return "x".join(str(d) for d in shape)
