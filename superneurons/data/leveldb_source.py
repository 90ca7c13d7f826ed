"""Reading and writing LevelDB databases of serialized records (Caffe's `backend: LEVELDB`), through plyvel.

Same surface as `lmdb_source`: records in key order (LevelDB keeps keys sorted bytewise), reading
past the last record wraps to the first.

LevelDB lets one process at a time open a database (its LOCK file), and within a process one
handle: readers share it (`record_db.SharedHandles`), each iterating on its own, so prefetch
threads read concurrently. Another process holding the database is reported as such.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator

from superneurons.data.record_db import (LEVELDB, SharedHandles, build_folder_atomically, check_database_folder,
                                         chunks)
from superneurons.errors import UserError

_WRITE_CHUNK = 1000  # records per write batch

_handles = SharedHandles(lambda db: db.close())


def require_plyvel() -> Any:
    try:
        import plyvel
    except ImportError:
        raise UserError("LevelDB databases need the plyvel package (pip install plyvel; its wheels bundle "
                        "LevelDB up to Python 3.12, later Pythons build it from source and need libleveldb-dev)"
                        ) from None
    return plyvel


def _text(e: Exception) -> str:
    """plyvel's message (LevelDB's status string, as bytes)."""
    return e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)


def _open_error(plyvel: Any, e: Exception, path: str, where: str) -> UserError:
    text = _text(e)
    if isinstance(e, plyvel.IOError) and "lock" in text.lower():
        return UserError(f"{where}: LevelDB database {path!r} is locked: another process has it open ({text}); "
                         f"stop that process or copy the database")
    if isinstance(e, plyvel.CorruptionError):
        return UserError(f"{where}: LevelDB database {path!r} is corrupt ({text})")
    return UserError(f"{where}: cannot open LevelDB database {path!r} ({text})")


def _open_handle(key: str, path: str, where: str) -> Any:
    plyvel = require_plyvel()
    try:
        return plyvel.DB(key, create_if_missing=False, paranoid_checks=True)
    except plyvel.Error as e:
        raise _open_error(plyvel, e, path, where) from None


class LevelDbReader:
    """A LevelDB database opened for reading: its record count and a wrapping stream of values."""

    backend = LEVELDB

    def __init__(self, path: str, where: str):
        check_database_folder(path, LEVELDB, where)
        self.path = path
        self.where = where
        self._plyvel = require_plyvel()
        self._key = os.path.realpath(path)
        self.db = _handles.acquire(self._key, lambda: _open_handle(self._key, path, where))
        self._open = True
        try:
            # LevelDB keeps no count: walk the keys once (checksums verified, so corruption shows here).
            self.count = sum(1 for _ in self._iterator(include_value=False))
        except BaseException:
            self.close()
            raise
        if self.count == 0:
            self.close()
            raise UserError(f"{where}: LevelDB database {path!r} has no records")

    def _iterator(self, **kwargs) -> Iterator:
        """The database's entries in key order; a LevelDB error becomes a UserError naming the record."""
        n = 0
        try:
            for item in self.db.iterator(verify_checksums=True, fill_cache=False, **kwargs):
                yield item
                n += 1
        except self._plyvel.Error as e:
            raise UserError(f"{self.where}: LevelDB database {self.path!r} is unreadable after record {n} "
                            f"({_text(e)})") from None

    def values_from(self, start: int) -> Iterator[bytes]:
        """Values from record number `start` (mod count) on, forever, wrapping at the end.

        Reaching `start` walks the keys once; that is paid only when a run begins or resumes.
        """
        skip = start % self.count
        while True:
            for value in self._iterator(include_key=False):
                if skip:
                    skip -= 1
                    continue
                yield value

    def cursor(self) -> "LevelDbCursor":
        """Records by number, for one thread; close it before the reader."""
        return LevelDbCursor(self._iterator)

    def close(self) -> None:
        if self._open:
            self._open = False
            _handles.release(self._key)


class LevelDbCursor:
    """(key, value) of record number n, in key order. LevelDB iterators only step: the cursor steps forward
    from where it is, or starts a new pass when n lies behind it (as `lmdb_source.LmdbCursor`)."""

    def __init__(self, entries: Callable[[], Iterator[tuple[bytes, bytes]]]):
        self._entries = entries
        self._it: Iterator[tuple[bytes, bytes]] | None = None
        self._at = -1
        self._item: tuple[bytes, bytes] = (b"", b"")

    def record(self, number: int) -> tuple[bytes, bytes]:
        if self._it is None or number < self._at:
            self._it, self._at = self._entries(), -1
        while self._at < number:
            self._item = next(self._it)
            self._at += 1
        return self._item

    def close(self) -> None:
        self._it = None


def write_leveldb(path: str, records: Iterable[tuple[bytes, bytes]]) -> int:
    """Write (key, value) records into a new LevelDB folder at `path`, whole or not at all (an existing
    `path` is replaced). Returns the number of records written."""
    plyvel = require_plyvel()

    def fill(folder: str) -> int:
        db = plyvel.DB(folder, create_if_missing=True, error_if_exists=True)
        n = 0
        try:
            for chunk in chunks(records, _WRITE_CHUNK):
                with db.write_batch(sync=False) as batch:
                    for key, value in chunk:
                        batch.put(key, value)
                n += len(chunk)
            return n
        finally:
            db.close()  # flushes the log; the folder is complete once closed

    return build_folder_atomically(path, fill)
