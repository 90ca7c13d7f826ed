#!/usr/bin/env python3
"""Caffe's convert_imageset: images named in a list file -> an LMDB of Datum records.

    python tools/convert_imageset.py [--gray] [--shuffle] [--resize_height H --resize_width W]
                                     [--encoded [--encode_type png|jpg]] [--check_size] ROOT/ LISTFILE DB_NAME

LISTFILE holds `relative/path.jpg label` lines; ROOT is prefixed to each path. Keys are
`%08d_<path>` in list order (after --shuffle, which uses a fixed seed), as Caffe writes them.
Raw records hold BGR (or gray) uint8 pixels; --encoded records hold the image file.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from superneurons.data.datum import array_to_datum, encode_image, encoded_datum, load_image
from superneurons.data.image_list import read_image_list
from superneurons.data.lmdb_source import write_lmdb
from superneurons.errors import UserError

_SHUFFLE_SEED = 0  # --shuffle gives the same order every time, as Caffe's fixed-seed shuffle does
_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "bmp": "BMP"}


def _format_for(name: str, encode_type: str) -> str:
    ext = (encode_type or os.path.splitext(name)[1].lstrip(".")).lower()
    if ext not in _FORMATS:
        raise UserError(f"{name}: cannot encode as {ext!r}; use --encode_type with one of {', '.join(_FORMATS)}")
    return _FORMATS[ext]


def _record(path: str, name: str, label: int, args: argparse.Namespace):
    """(pixels for --check_size, serialized Datum) for one image."""
    pixels = load_image(path, not args.gray, args.resize_height, args.resize_width)
    if not args.encoded:
        return pixels, array_to_datum(pixels, label).SerializeToString()
    untouched = not args.gray and not (args.resize_height and args.resize_width) and not args.encode_type
    if untouched:  # keep the file's bytes, as Caffe does when nothing asks to re-encode
        with open(path, "rb") as f:
            return pixels, encoded_datum(f.read(), label).SerializeToString()
    data = encode_image(pixels, _format_for(name, args.encode_type))
    return pixels, encoded_datum(data, label).SerializeToString()


def _records(entries, args):
    first_shape = None
    for i, (name, label) in enumerate(entries):
        pixels, value = _record(args.root + name, name, label, args)
        if args.check_size:
            if first_shape is None:
                first_shape = pixels.shape
            elif pixels.shape != first_shape:
                raise UserError(f"{args.root + name}: image is {pixels.shape}, the first one {first_shape} "
                                f"(--check_size)")
        if (i + 1) % 1000 == 0:
            print(f"processed {i + 1} files", flush=True)
        yield b"%08d_%s" % (i, name.encode()), value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="folder prefixed to every path in the list (may be empty: '')")
    p.add_argument("listfile")
    p.add_argument("db_name", help="the LMDB folder to create (replaced if it exists)")
    p.add_argument("--gray", action="store_true", help="store one gray channel instead of BGR")
    p.add_argument("--shuffle", action="store_true", help="shuffle the list (fixed seed)")
    p.add_argument("--backend", default="lmdb", choices=["lmdb"], help="only LMDB is written")
    p.add_argument("--resize_height", type=int, default=0)
    p.add_argument("--resize_width", type=int, default=0)
    p.add_argument("--check_size", action="store_true", help="require every image to have the same size")
    p.add_argument("--encoded", action="store_true", help="store the (re-)encoded image file")
    p.add_argument("--encode_type", default="", help="png or jpg; default: the file's own format")
    args = p.parse_args(argv)
    if (args.resize_height > 0) != (args.resize_width > 0):
        p.error("give both --resize_height and --resize_width, or neither")
    args.root = args.root if not args.root or args.root.endswith(os.sep) else args.root + os.sep
    try:
        entries = read_image_list(args.listfile, "convert_imageset")
        if args.shuffle:
            order = np.random.default_rng(_SHUFFLE_SEED).permutation(len(entries))
            entries = [entries[i] for i in order]
        n = write_lmdb(args.db_name, _records(entries, args))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.db_name}: wrote {n} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
