#!/usr/bin/env python3
"""Write the data of models/lstm_sequence (an LSTM that recalls the symbol it saw two steps earlier) as HDF5.

    python tools/data/make_sequence_hdf5.py [--out data/lstm_sequence]

Sequences of T = 10 symbols drawn uniformly from 4; the label at step t is the symbol of step t - 2 (-1, which
the net ignores, at the first two steps), so a net that sees one step at a time must remember two. Each batch
of the net holds N = 16 whole sequences, time-major as Caffe's recurrent layers read them: row t * N + n of a
batch is step t of sequence n. Each file holds `data` (rows, 4) one-hot, `cont` (rows,) 0 at a sequence's
first step and 1 after, and `label` (rows,) float32 datasets, the layout Caffe's HDF5Data reads; `train.txt`
and `test.txt` list them relative to the working directory, as Caffe expects.
"""
from __future__ import annotations

import argparse
import os
import sys

import h5py
import numpy as np

STEPS, STREAMS, SYMBOLS, DELAY = 10, 16, 4, 2
SEED = 0


def make_batches(batches: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`batches` batches of STREAMS sequences, each laid out time-major (rows t * STREAMS + n)."""
    symbols = rng.integers(0, SYMBOLS, size=(batches, STEPS, STREAMS))
    labels = np.full(symbols.shape, -1.0)
    labels[:, DELAY:] = symbols[:, :-DELAY]
    cont = np.ones(symbols.shape)
    cont[:, 0] = 0
    return {"data": np.eye(SYMBOLS, dtype=np.float32)[symbols.reshape(-1)],
            "cont": cont.reshape(-1).astype(np.float32), "label": labels.reshape(-1).astype(np.float32)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/lstm_sequence", help="folder for the .h5 and list files")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for split, batches in (("train", 64), ("test", 8)):
        path = os.path.join(args.out, f"{split}.h5")
        with h5py.File(path, "w") as f:
            for name, values in make_batches(batches, rng).items():
                f.create_dataset(name, data=values)
        with open(os.path.join(args.out, f"{split}.txt"), "w") as f:
            f.write(path + "\n")
    print(f"{args.out}: 64 training and 8 test batches of {STREAMS} sequences of {STEPS} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
