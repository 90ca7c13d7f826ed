"""Caffe's HDF5Data input: a list file naming `.h5` files, whose datasets of the tops' names are the batches.

The rows of all files, file after file, form one stream that wraps at the end, as Caffe reads them
(a batch may span two files). With `shuffle`, pass e over the stream takes the files in its own
permutation and each file's rows in their own, all seeded from the run seed and e, so batch k is a
pure function of k: a resumed run sees what an uninterrupted one sees.

Every file is checked when the layer is set up (names, dtypes, shapes: metadata only); a file's
rows are read when a batch first needs them and kept while batches use that file, as Caffe keeps
one file in memory.
"""
from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np

from superneurons.data.batches import SHUFFLE, Seeds
from superneurons.errors import UserError
from superneurons.io.caffemodel import HDF5_ERRORS, require_h5py

_CACHED_FILES = 2  # a batch spans at most two files when files hold at least a batch of rows each


@dataclass(frozen=True)
class Hdf5File:
    path: str  # as opened (resolved against the working directory or the list file's folder)
    rows: int


def read_file_list(source: str, where: str) -> list[str]:
    """The `.h5` paths a list file names, one a line, each relative to the working directory (as Caffe
    reads them) or else to the list file's folder."""
    try:
        with open(source, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise UserError(f"{where}: list file {source!r} does not exist (resolved to "
                        f"{os.path.abspath(source)!r})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: cannot read list file {source!r} ({e})") from None
    folder = os.path.dirname(source)
    paths = []
    for lineno, line in enumerate(lines, 1):
        name = line.strip()
        if not name:
            continue
        if os.path.isabs(name) or os.path.exists(name) or not os.path.exists(os.path.join(folder, name)):
            paths.append(name)
        else:
            paths.append(os.path.join(folder, name))
        if not os.path.isfile(paths[-1]):
            raise UserError(f"{where}: {source}:{lineno}: HDF5 file {name!r} does not exist (looked in "
                            f"{os.getcwd()!r} and {os.path.abspath(folder)!r})")
    if not paths:
        raise UserError(f"{where}: list file {source!r} names no HDF5 files")
    return paths


def _inspect(path: str, names: list[str], where: str) -> tuple[int, dict[str, tuple[int, ...]]]:
    """(rows, {name: shape of one row}) of one file, checking what Caffe's loader checks."""
    h5py = require_h5py()
    try:
        with h5py.File(path, "r") as f:
            shapes = {}
            for name in names:
                obj = f.get(name)
                if not isinstance(obj, h5py.Dataset):
                    have = ", ".join(k for k, v in f.items() if isinstance(v, h5py.Dataset)) or "none"
                    raise UserError(f"{where}: {path}: no dataset {name!r} (datasets: {have}); each top of the "
                                    f"layer reads the dataset of its name")
                if obj.dtype.kind not in "fiu":
                    raise UserError(f"{where}: {path}: dataset {name!r} holds {obj.dtype} values; HDF5Data reads "
                                    f"numbers (float or integer)")
                if obj.ndim < 1:
                    raise UserError(f"{where}: {path}: dataset {name!r} is a scalar; it needs a first "
                                    f"dimension of samples")
                shapes[name] = tuple(int(d) for d in obj.shape)
    except HDF5_ERRORS as e:  # a damaged file: OSError on open, RuntimeError from a corrupt symbol table
        raise UserError(f"{where}: {path}: not a readable HDF5 file ({type(e).__name__}: {e})") from None
    rows = {name: shape[0] for name, shape in shapes.items()}
    if len(set(rows.values())) > 1:
        listed = ", ".join(f"{name!r} {n}" for name, n in rows.items())
        raise UserError(f"{where}: {path}: datasets have different numbers of samples ({listed}); the first "
                        f"dimensions must match")
    n = next(iter(rows.values()))
    if n == 0:
        raise UserError(f"{where}: {path}: the datasets hold no samples")
    return n, {name: shape[1:] for name, shape in shapes.items()}


class Hdf5Rows:
    """The rows of the datasets `names` across the files a list file names; batches by index."""

    def __init__(self, source: str, names: list[str], where: str, shuffle: bool):
        self.where = where
        self.names = list(names)
        self.shuffle = shuffle
        files = []
        self.row_shapes: dict[str, tuple[int, ...]] = {}
        for path in read_file_list(source, where):
            rows, shapes = _inspect(path, self.names, where)
            if not self.row_shapes:
                self.row_shapes = shapes
            for name in self.names:
                if shapes[name] != self.row_shapes[name]:
                    raise UserError(f"{where}: {path}: dataset {name!r} has rows of shape {shapes[name]}, "
                                    f"{files[0].path} of shape {self.row_shapes[name]}; every file needs the same")
            files.append(Hdf5File(path, rows))
        self.files = files
        self.total = sum(f.rows for f in files)
        self._plan: tuple[int, list[int], list[int], list] | None = None  # epoch, order, starts, row orders
        self._loaded: dict[int, dict[str, np.ndarray]] = {}  # file index -> {name: float32 rows}, newest last

    def batch(self, k: int, batch_size: int, seeds: Seeds) -> list[np.ndarray]:
        """Batch k: stream positions k*N ... k*N+N-1, one float32 array per name."""
        out = [np.empty((batch_size,) + self.row_shapes[name], np.float32) for name in self.names]
        pos, filled = k * batch_size, 0
        while filled < batch_size:
            epoch, p = divmod(pos, self.total)
            _, order, starts, row_orders = self._epoch_plan(epoch, seeds)
            slot = bisect.bisect_right(starts, p) - 1
            index = order[slot]
            first = p - starts[slot]
            take = min(batch_size - filled, self.files[index].rows - first)
            rows = np.arange(first, first + take) if row_orders is None else row_orders(slot)[first:first + take]
            data = self._load(index)
            for array, name in zip(out, self.names):
                array[filled:filled + take] = data[name][rows]
            filled += take
            pos += take
        return out

    def _epoch_plan(self, epoch: int, seeds: Seeds):
        """For one pass: file order, each file's first stream position, and its row order (None: in order)."""
        if self._plan is not None and self._plan[0] == epoch:
            return self._plan
        n_files = len(self.files)
        if self.shuffle:
            rng = seeds.rng(SHUFFLE, epoch)
            order = [int(i) for i in rng.permutation(n_files)]
            children = rng.spawn(n_files)  # one generator per slot of the pass, independent of the others
            cache: dict[int, np.ndarray] = {}

            def row_orders(slot: int) -> np.ndarray:
                if slot not in cache:
                    cache.clear()  # passes walk the slots in order: the previous one is done with
                    cache[slot] = children[slot].permutation(self.files[order[slot]].rows)
                return cache[slot]
        else:
            order = list(range(n_files))
            row_orders = None
        starts = [0]
        for index in order[:-1]:
            starts.append(starts[-1] + self.files[index].rows)
        self._plan = (epoch, order, starts, row_orders)
        return self._plan

    def _load(self, index: int) -> dict[str, np.ndarray]:
        if index in self._loaded:
            return self._loaded[index]
        path = self.files[index].path
        h5py = require_h5py()
        try:
            with h5py.File(path, "r") as f:
                data = {name: np.asarray(f[name][...], dtype=np.float32) for name in self.names}
        except HDF5_ERRORS as e:
            raise UserError(f"{self.where}: {path}: cannot read the datasets ({type(e).__name__}: {e})") from None
        for name, array in data.items():  # the file may have changed since setup looked at it
            if array.shape != (self.files[index].rows,) + self.row_shapes[name]:
                raise UserError(f"{self.where}: {path}: dataset {name!r} changed shape to {array.shape} while "
                                f"the net ran")
        if len(self._loaded) >= _CACHED_FILES:
            del self._loaded[next(iter(self._loaded))]
        self._loaded[index] = data
        return data
