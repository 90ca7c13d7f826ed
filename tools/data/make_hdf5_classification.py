#!/usr/bin/env python3
"""Write the data of models/hdf5_classification (Caffe's hdf5_classification example) as HDF5 files.

    python tools/make_hdf5_classification.py [--out data/hdf5_classification]

10,000 samples of four features in two classes (two informative features, two of noise; classes
are Gaussians whose means differ, so logistic regression reaches about 0.9 accuracy), split 75/25
as Caffe's notebook does: the training samples in two files (`train_0.h5`, `train_1.h5`, listed in
`train.txt`), the test samples in one gzip-compressed file (`test.h5`, listed in `test.txt`). Each
file holds `data` (N, 4) and `label` (N,) float32 datasets, the layout Caffe's HDF5Data reads.
The list files name the .h5 files relative to the working directory, as Caffe expects.
"""
from __future__ import annotations

import argparse
import os
import sys

import h5py
import numpy as np

SAMPLES = 10_000
SEED = 0


def make_samples(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, 2, size=n)
    data = rng.standard_normal((n, 4))
    data[:, :2] += np.where(labels[:, None] == 1, 1.0, -1.0)  # class means (1, 1) and (-1, -1)
    return data.astype(np.float32), labels.astype(np.float32)


def write_h5(path: str, data: np.ndarray, labels: np.ndarray, **options) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=data, **options)
        f.create_dataset("label", data=labels, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/hdf5_classification", help="folder for the .h5 and list files")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    data, labels = make_samples(SAMPLES, np.random.default_rng(SEED))
    n_train = SAMPLES * 3 // 4
    half = n_train // 2
    train = [os.path.join(args.out, f"train_{i}.h5") for i in range(2)]
    write_h5(train[0], data[:half], labels[:half])
    write_h5(train[1], data[half:n_train], labels[half:n_train])
    test = os.path.join(args.out, "test.h5")
    write_h5(test, data[n_train:], labels[n_train:], compression="gzip", compression_opts=1)
    for name, files in (("train.txt", train), ("test.txt", [test])):
        with open(os.path.join(args.out, name), "w") as f:
            f.write("".join(p + "\n" for p in files))
    print(f"{args.out}: {n_train} training samples in {len(train)} files, {SAMPLES - n_train} test samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
