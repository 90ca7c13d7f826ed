"""The embedded example dataset: scikit-learn's 1797 handwritten digits as MNIST-sized LMDBs.

Each 8x8 image (values 0..16) is scaled to 0..255 and upscaled to 28x28 (bilinear), so Caffe's
LeNet runs on it unchanged. A seeded permutation splits it into fixed train and test sets.
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image

from superneurons.data.datum import array_to_datum
from superneurons.data.lmdb_source import count_records, write_lmdb

SIZE = 28
N_DIGITS = 1797  # what load_digits() returns
N_TEST = 300
SPLIT_SEED = 1701  # fixed: the split is part of the dataset's definition


def digit_images() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 digits as (n, 28, 28) uint8 images and (n,) int labels, in scikit-learn's order."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    digits = load_digits()
    small = np.round(digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    images = np.stack([np.asarray(Image.fromarray(img, mode="L").resize((SIZE, SIZE), Image.BILINEAR))
                       for img in small])
    return images, digits.target.astype(np.int64)


def split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indexes, test indexes): the last N_TEST of a seeded permutation are the test set."""
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    return order[:n - N_TEST], order[n - N_TEST:]


def _records(images: np.ndarray, labels: np.ndarray, indexes: np.ndarray):
    for i, j in enumerate(indexes):
        yield b"%08d" % i, array_to_datum(images[j][None], int(labels[j])).SerializeToString()


def make_digits(out: str, log=print) -> dict[str, int]:
    """Write `out`/train_lmdb and `out`/test_lmdb unless both are already complete; returns record counts."""
    # Test first: `make` treats train_lmdb as the sign that the data is done, so it must appear last.
    sizes = {"test_lmdb": N_TEST, "train_lmdb": N_DIGITS - N_TEST}
    paths = {name: os.path.join(out, name) for name in sizes}
    if all(count_records(paths[name]) == n for name, n in sizes.items()):
        log(f"{out}: train_lmdb and test_lmdb are complete ({sizes['train_lmdb']} + {N_TEST} records), "
            f"nothing to do")
        return sizes
    images, labels = digit_images()
    train, test = split(len(images))
    for name, indexes in (("test_lmdb", test), ("train_lmdb", train)):
        n = write_lmdb(paths[name], _records(images, labels, indexes))
        log(f"{paths[name]}: wrote {n} records (1x{SIZE}x{SIZE} uint8 digits, labels 0..9)")
    return sizes
