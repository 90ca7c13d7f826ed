"""The record sources of the prefetching data layers: a database of Datums (Data), an image list (ImageData).

A source is picklable, so decode worker processes receive it; each thread or process that reads
calls `open` and gets a reader of its own (see `batches.RecordSource`). The layer's process keeps
the database open only to count records and read the first one while setting up.
"""
from __future__ import annotations

import os

import numpy as np

from superneurons.data.batches import SHUFFLE, Seeds
from superneurons.data.datum import datum_to_array, load_image, parse_datum
from superneurons.data.databases import open_reader
from superneurons.data.record_db import LEVELDB, RecordCursor, RecordReader


class DatumRecords:
    """The records of a database (LMDB or LevelDB) of serialized Datums; position n is record n mod count."""

    def __init__(self, path: str, backend: str | None, where: str, force_color: bool, force_gray: bool):
        self.path = path
        self.where = where
        self.force_color = force_color
        self.force_gray = force_gray
        self._db: RecordReader | None = open_reader(path, backend, where)  # validates; this process's handle
        self.backend = self._db.backend
        self.count = self._db.count
        self.real_path = os.path.realpath(path)  # what readers open: the working directory may change later
        # LevelDB's LOCK admits one process: its records are read in the layer's own process.
        self.multiprocess = self.backend != LEVELDB

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_db": None}

    def open(self, seeds: Seeds) -> "DatumReader":
        return DatumReader(self)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


class DatumReader:
    def __init__(self, source: DatumRecords):
        self.source = source
        self._db = open_reader(source.real_path, source.backend, source.where)
        self._cursor: RecordCursor = self._db.cursor()

    def read(self, position: int) -> tuple[int, np.ndarray, int]:
        s = self.source
        number = position % s.count
        key, value = self._cursor.record(number)
        where = f"{s.where}: {s.path} record {number} (key {key.decode('utf-8', 'backslashreplace')!r})"
        datum = parse_datum(value, where)
        return number, datum_to_array(datum, where, s.force_color, s.force_gray), datum.label

    def close(self) -> None:
        self._cursor.close()
        self._db.close()


class ImageListRecords:
    """Images named in a list file. Position n is entry n mod count, or with `shuffle` entry
    perm_p[n mod count] where perm_p is pass p = n // count's own seeded permutation."""

    def __init__(self, entries: list[tuple[str, int]], root: str, where: str, shuffle: bool, is_color: bool,
                 height: int, width: int):
        self.entries = entries
        self.count = len(entries)
        self.root = root
        self.where = where
        self.shuffle = shuffle
        self.is_color = is_color
        self.height = height
        self.width = width
        self.multiprocess = True

    def open(self, seeds: Seeds) -> "ImageListReader":
        return ImageListReader(self, seeds)

    def close(self) -> None:
        pass


class ImageListReader:
    def __init__(self, source: ImageListRecords, seeds: Seeds):
        self.source = source
        self.seeds = seeds
        self._order: tuple[int, np.ndarray] | None = None  # (pass, permutation), the last one used

    def read(self, position: int) -> tuple[int, np.ndarray, int]:
        s = self.source
        epoch, pos = divmod(position, s.count)
        number = pos
        if s.shuffle:
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, self.seeds.rng(SHUFFLE, epoch).permutation(s.count))
            number = int(self._order[1][pos])
        name, label = s.entries[number]
        return number, load_image(s.root + name, s.is_color, s.height, s.width), label

    def close(self) -> None:
        pass
