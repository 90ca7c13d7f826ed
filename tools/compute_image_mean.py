#!/usr/bin/env python3
"""Caffe's compute_image_mean: the mean image of an LMDB of Datum records, as a .binaryproto.

    python tools/compute_image_mean.py INPUT_DB [OUTPUT_FILE]

Use OUTPUT_FILE as transform_param { mean_file: ... }. Prints the mean of each channel too
(what transform_param { mean_value: ... } would take instead).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from superneurons.data.datum import datum_to_array, parse_datum
from superneurons.data.lmdb_source import LmdbReader
from superneurons.errors import UserError
from superneurons.io.binaryproto import write_mean


def compute_mean(path: str) -> np.ndarray:
    """The float64-accumulated mean (C, H, W) of every record; every record must have the first one's shape."""
    reader = LmdbReader(path, "compute_image_mean")
    try:
        total = None
        values = reader.values_from(0)
        for number in range(reader.count):
            where = f"{path}: record {number}"
            pixels = datum_to_array(parse_datum(next(values), where), where)
            if total is None:
                total = np.zeros(pixels.shape, dtype=np.float64)
            elif pixels.shape != total.shape:
                raise UserError(f"{where}: shape {pixels.shape} differs from the first record's {total.shape}")
            total += pixels
        values.close()
        return (total / reader.count).astype(np.float32)
    finally:
        reader.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input_db", help="LMDB folder")
    p.add_argument("output_file", nargs="?", help=".binaryproto to write")
    p.add_argument("--backend", default="lmdb", choices=["lmdb"], help="only LMDB is read")
    args = p.parse_args(argv)
    try:
        mean = compute_mean(args.input_db)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.output_file:
        write_mean(args.output_file, mean)
        print(f"{args.output_file}: wrote a {'x'.join(map(str, mean.shape))} mean image")
    for c, m in enumerate(mean.reshape(mean.shape[0], -1).mean(axis=1)):
        print(f"mean_value channel {c}: {m:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
