"""Open or write a database of records in either store: `open_reader` picks LMDB or LevelDB by name or by
what the folder holds (`record_db.resolve_backend`); `write_database` builds a new one whole or not at all."""
from __future__ import annotations

from typing import Iterable

from superneurons.data.leveldb_source import LevelDbReader, write_leveldb
from superneurons.data.lmdb_source import LmdbReader, write_lmdb
from superneurons.data.record_db import LEVELDB, LMDB, RecordReader, resolve_backend


def open_reader(path: str, backend: str | None, where: str) -> RecordReader:
    """A reader of the database at `path`; `backend` None reads whichever store the folder holds."""
    backend = resolve_backend(path, backend, where)
    if backend == LEVELDB:
        return LevelDbReader(path, where)
    return LmdbReader(path, where)


def write_database(path: str, records: Iterable[tuple[bytes, bytes]], backend: str = LMDB) -> int:
    """Write (key, value) records into a new `backend` database at `path` (replaced if it exists)."""
    if backend == LEVELDB:
        return write_leveldb(path, records)
    if backend != LMDB:
        raise ValueError(f"unknown database backend {backend!r}")
    return write_lmdb(path, records)
