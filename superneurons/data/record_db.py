"""Databases of serialized records (Caffe's `Datum`), kept in LMDB or LevelDB: what both stores share.

A reader (`LmdbReader`, `LevelDbReader`) offers `count`, `values_from(start)` (values in key order
from record `start` on, wrapping at the end as Caffe's cursor does), `cursor()` (records by number, for the
data layers' position-addressed batches) and `close()`. `resolve_backend` picks the store by name, or, when
none is named, by what the folder holds (LMDB: `data.mdb`, LevelDB: `CURRENT`), so an old prototxt that
leaves `backend` unset (Caffe's default is LEVELDB) reads either. The stores (`lmdb_source.py`,
`leveldb_source.py`) build on this module; `databases.py` opens and writes either.
"""
from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Callable, Iterable, Iterator, Protocol

from superneurons.errors import UserError

LMDB = "lmdb"
LEVELDB = "leveldb"
BACKENDS = (LMDB, LEVELDB)
_MARKER = {LMDB: "data.mdb", LEVELDB: "CURRENT"}  # the file that says which store a folder holds
_SPELLED = {LMDB: "LMDB", LEVELDB: "LEVELDB"}


class RecordCursor(Protocol):
    """Records by number for one thread (`RecordReader.cursor`); close it before its reader."""

    def record(self, number: int) -> tuple[bytes, bytes]:
        """(key, value) of record `number` (0 <= number < count), in key order."""
        ...

    def close(self) -> None:
        ...


class RecordReader(Protocol):
    """A read-only database of records, opened by `databases.open_reader`."""

    path: str
    backend: str  # LMDB or LEVELDB
    count: int

    def cursor(self) -> RecordCursor:
        ...

    def values_from(self, start: int) -> Iterator[bytes]:
        """Values from record number `start` (mod count) on, in key order, forever, wrapping at the end."""
        ...

    def close(self) -> None:
        ...


def shown_path(path: str) -> str:
    """`path` quoted, with where it resolves to when it is relative (the working directory matters)."""
    return f"{path!r}" if os.path.isabs(path) else f"{path!r} (resolved to {os.path.abspath(path)!r})"


def detect_backend(path: str) -> str | None:
    """LMDB or LEVELDB by the files in the folder at `path`; None when it holds neither."""
    for backend, marker in _MARKER.items():
        if os.path.isfile(os.path.join(path, marker)):
            return backend
    return None


def check_database_folder(path: str, backend: str, where: str) -> None:
    """Raise a UserError saying what is wrong when `path` is not a `backend` database folder."""
    shown = shown_path(path)
    if not os.path.exists(path):
        raise UserError(f"{where}: database {shown} does not exist")
    if not os.path.isdir(path):
        raise UserError(f"{where}: database {shown} is a file; an {_SPELLED[backend]} database is a folder")
    found = detect_backend(path)
    if found == backend:
        return
    if found is not None:
        raise UserError(f"{where}: database {shown} is a {_SPELLED[found]} database but backend is "
                        f"{_SPELLED[backend]}; name backend {_SPELLED[found]} or leave backend out")
    raise UserError(f"{where}: {shown} is not an {_SPELLED[backend]} database (no {_MARKER[backend]} in the "
                    f"folder)")


def resolve_backend(path: str, backend: str | None, where: str) -> str:
    """The backend named, or the one the folder holds when none is named."""
    if backend is not None:
        if backend not in BACKENDS:
            raise UserError(f"{where}: unknown database backend {backend!r}; use lmdb or leveldb")
        return backend
    found = detect_backend(path)
    if found is None:
        if not os.path.exists(path):
            raise UserError(f"{where}: database {shown_path(path)} does not exist")
        raise UserError(f"{where}: {shown_path(path)} is neither an LMDB (data.mdb) nor a LevelDB (CURRENT) "
                        f"database")
    return found


class SharedHandles:
    """One open handle per database and process, counted: LMDB allows one environment per database and
    process, LevelDB one handle (its LOCK), yet a train and a test net (or two layers) may read the same
    database. Keys are real paths, resolved once at open (the working directory may change later).

    A reader's close may run from a garbage-collection finalizer (a dropped net's Data layer), and the
    collector may run inside `open_handle` itself, on the thread that holds the lock: a release there is
    recorded and done once the open has returned, rather than wait for a lock its own thread holds (which
    hung a process for good: found by the fuzzer, tools/fuzz).
    """

    def __init__(self, close: Callable[[Any], None]):
        self._close = close
        self._entries: dict[str, list] = {}  # real path -> [handle, number of readers]
        self._lock = threading.RLock()  # re-entered only by a release from a finalizer during an open
        self._opening = False
        self._deferred: list[str] = []  # releases that arrived during an open

    def acquire(self, key: str, open_handle: Callable[[], Any]) -> Any:
        with self._lock:
            try:
                entry = self._entries.get(key)
                if entry is None:
                    self._opening = True
                    try:
                        handle = open_handle()
                    finally:
                        self._opening = False
                    entry = self._entries[key] = [handle, 0]
                entry[1] += 1
                return entry[0]
            finally:
                deferred, self._deferred = self._deferred, []
                for waiting in deferred:
                    self._release(waiting)

    def release(self, key: str) -> None:
        with self._lock:
            if self._opening:
                self._deferred.append(key)
            else:
                self._release(key)

    def _release(self, key: str) -> None:
        entry = self._entries[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._entries[key]
            self._close(entry[0])


def build_folder_atomically(path: str, fill: Callable[[str], int]) -> int:
    """Run `fill(folder)` on a sibling folder and rename it to `path` once it returns.

    An interrupted or failed run never leaves a half-written database that looks complete;
    an existing `path` is replaced only at the end. Returns what `fill` returns.
    """
    path = os.path.normpath(path)
    tmp = f"{path}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        result = fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return result


def chunks(records: Iterable[tuple[bytes, bytes]], size: int) -> Iterator[list[tuple[bytes, bytes]]]:
    """`records` in lists of at most `size` (one write transaction or batch each)."""
    chunk: list[tuple[bytes, bytes]] = []
    for record in records:
        chunk.append(record)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
