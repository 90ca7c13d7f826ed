"""`superneurons compute_image_mean INPUT_DB [OUTPUT_FILE]`: the mean image of a database, as a .binaryproto."""
from __future__ import annotations

import argparse

from superneurons.commands._gflags import add_flag
from superneurons.commands._options import add_command
from superneurons.data.image_mean import compute_mean
from superneurons.data.record_db import BACKENDS
from superneurons.io.binaryproto import write_mean

EXAMPLES = """examples:
  superneurons compute_image_mean train_lmdb mean.binaryproto
  superneurons compute_image_mean -backend leveldb train_leveldb mean.binaryproto
  superneurons compute_image_mean train_lmdb          # only print the per-channel means

Use OUTPUT_FILE as `transform_param { mean_file: ... }`; the printed per-channel means are what
`transform_param { mean_value: ... }` takes instead. Encoded records are decoded. -backend is read
from the folder when not given (Caffe's default is lmdb).
"""


def register(sub) -> argparse.ArgumentParser:
    p = add_command(sub, "compute_image_mean", run,
                    help="compute the mean image of an LMDB or LevelDB of Datum records",
                    description="Caffe's compute_image_mean: the mean of every record of INPUT_DB, written as "
                                "a BlobProto (.binaryproto) for transform_param's mean_file.",
                    examples=EXAMPLES)
    p.add_argument("input_db", metavar="INPUT_DB", help="LMDB or LevelDB folder")
    p.add_argument("output_file", metavar="OUTPUT_FILE", nargs="?", help=".binaryproto to write")
    add_flag(p, "backend", default=None, type=str.lower, choices=BACKENDS,
             help="lmdb or leveldb (default: what the folder holds)")
    return p


def run(args) -> int:
    mean = compute_mean(args.input_db, args.backend)
    if args.output_file:
        write_mean(args.output_file, mean)
        print(f"{args.output_file}: wrote a {'x'.join(map(str, mean.shape))} mean image")
    for c, m in enumerate(mean.reshape(mean.shape[0], -1).mean(axis=1)):
        print(f"mean_value channel [{c}]: {m:.6f}")
    return 0
