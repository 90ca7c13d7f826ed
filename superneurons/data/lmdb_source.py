"""Reading and writing LMDB databases of serialized records, the way Caffe's Data layer sees them.

Records are read in key order (LMDB keeps keys sorted bytewise) and reading past the last record
wraps to the first, as Caffe's cursor does.

Readers share one read-only environment per database (`record_db.SharedHandles`); each reader's
transaction is its own, so prefetch threads read concurrently. `lock=False`: training never
writes to its database.
"""
from __future__ import annotations

import gc
import os
import struct
from typing import Iterable, Iterator

import lmdb

from superneurons.data.record_db import LMDB, SharedHandles, build_folder_atomically, check_database_folder, chunks
from superneurons.errors import UserError

_WRITE_CHUNK = 1000  # records per write transaction
_INITIAL_MAP = 64 << 20  # bytes; doubled whenever a chunk does not fit


_environments = SharedHandles(lambda env: env.close())


# LMDB's file layout (lmdb.h / mdb.c, 64-bit builds): pages 0 and 1 are meta pages, each a 16-byte page
# header then MDB_meta: magic u32, version u32, address u64, mapsize u64, two 48-byte MDB_db records (the
# free list's, whose first u32 holds the page size, then the main tree's, entries at +32 and root at +40),
# last_pg u64, txnid u64. The meta page with the larger txnid is the current one.
_META = struct.Struct("<IIQQI44x32xQQQQ")  # magic, version, address, mapsize, psize, entries, root, last_pg, txnid
_PAGE_HEADER = 16
_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1


def check_lmdb_file(path: str, where: str) -> None:
    """Refuse a data.mdb that LMDB would map past its end (a truncated copy or download).

    LMDB memory-maps the file and trusts its meta page; reading a page beyond the file's end kills the
    process with SIGBUS inside the library, so the meta page's last page number is checked against the
    file's size before LMDB opens it.
    """
    mdb = os.path.join(path, "data.mdb")
    try:
        with open(mdb, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_PAGE_HEADER + _META.size)
            metas = []
            if len(head) == _PAGE_HEADER + _META.size:
                first = _META.unpack_from(head, _PAGE_HEADER)
                metas.append(first)
                psize = first[4]
                if first[0] == _MAGIC and 512 <= psize <= 1 << 16 and psize & (psize - 1) == 0:
                    f.seek(psize)
                    second = f.read(_PAGE_HEADER + _META.size)
                    if len(second) == len(head):
                        metas.append(_META.unpack_from(second, _PAGE_HEADER))
    except OSError as e:
        raise UserError(f"{where}: cannot read {mdb!r} ({e.strerror or e})") from None
    valid = [m for m in metas if m[0] == _MAGIC and m[1] == _DATA_VERSION]
    if len(valid) < 2 or size < 2 * valid[0][4]:
        raise UserError(f"{where}: {mdb!r} is not a complete LMDB file ({size} bytes; no two valid meta pages, "
                        f"magic 0x{_MAGIC:08X}, version {_DATA_VERSION})")
    psize = valid[0][4]
    current = max(valid, key=lambda m: m[8])
    need = (current[7] + 1) * psize
    if size < need:
        raise UserError(f"{where}: {mdb!r} is truncated: {size} bytes, but its meta page says the database has "
                        f"{current[7] + 1} pages of {psize} bytes ({need} bytes); copy or write it again")
    root = current[6]
    if current[5] and root > current[7]:
        raise UserError(f"{where}: {mdb!r} is damaged: its root page {root} lies beyond its last page "
                        f"{current[7]}")



def _open_environment(key: str) -> lmdb.Environment:
    return lmdb.open(key, readonly=True, lock=False, readahead=False, max_readers=512)


def _acquire_environment(key: str) -> lmdb.Environment:
    """The shared environment of the database at real path `key`, opened if needed."""
    try:
        return _environments.acquire(key, lambda: _open_environment(key))
    except lmdb.Error as e:
        if "already open" not in str(e):
            raise
    # LMDB knows environments by their file's inode, and a new folder can reuse a deleted one's: an unused
    # environment whose readers wait for the garbage collector (a Net dropped in a reference cycle, or kept
    # by an error's traceback) then blocks this one. Collecting closes it (outside the handles' lock, which
    # the readers' finalizers take); a second refusal is real.
    gc.collect()
    return _environments.acquire(key, lambda: _open_environment(key))


class LmdbReader:
    """A read-only LMDB database: its record count, its first record, and a wrapping stream of values."""

    backend = LMDB

    def __init__(self, path: str, where: str):
        check_database_folder(path, LMDB, where)
        check_lmdb_file(path, where)
        self.path = path
        self.where = where
        self._key = os.path.realpath(path)
        try:
            self.env = _acquire_environment(self._key)
        except lmdb.Error as e:
            raise UserError(f"{where}: cannot open LMDB database {path!r} ({e})") from None
        self._open = True
        try:
            self.count = int(self.env.stat()["entries"])
        except lmdb.Error as e:
            self.close()
            raise self.damaged(e) from None
        if self.count == 0:
            self.close()
            raise UserError(f"{where}: LMDB database {path!r} has no records")

    def first(self) -> tuple[bytes, bytes]:
        try:
            with self.env.begin(buffers=False) as txn:
                cursor = txn.cursor()
                cursor.first()
                return cursor.key(), cursor.value()
        except lmdb.Error as e:
            raise self.damaged(e) from None

    def values_from(self, start: int) -> Iterator[bytes]:
        """Values from record number `start` (mod count) on, forever, wrapping at the end.

        LMDB has no positional access, so reaching `start` walks the cursor once; that is paid only
        when a run begins or resumes.
        """
        try:
            with self.env.begin(buffers=False) as txn:
                cursor = txn.cursor()
                cursor.first()
                for _ in range(start % self.count):
                    cursor.next()
                while True:
                    yield cursor.value()
                    if not cursor.next():
                        cursor.first()
        except lmdb.Error as e:  # a damaged page: MDB_CORRUPTED, MDB_PAGE_NOTFOUND
            raise self.damaged(e) from None

    def damaged(self, e: lmdb.Error, doing: str = "") -> UserError:
        """The error for a damaged page LMDB met (`doing`: what it was reading)."""
        at = f" {doing}" if doing else ""
        return UserError(f"{self.where}: LMDB database {self.path!r} is damaged{at} ({type(e).__name__}: {e})")

    def cursor(self) -> "LmdbCursor":
        """Records by number, for one thread; close it before the reader."""
        return LmdbCursor(self)

    def close(self) -> None:
        if self._open:
            self._open = False
            _environments.release(self._key)


class LmdbCursor:
    """(key, value) of record number n, in key order, over one read transaction.

    LMDB has no positional access: the cursor steps forward from where it is, or from the first
    record when n lies behind it. Readers that ask for increasing numbers (a decode worker taking
    every W-th batch) therefore walk the database once per pass, stepping over what others read;
    a step does not touch the value.
    """

    def __init__(self, reader: LmdbReader):
        self._reader = reader
        self._txn = reader.env.begin(buffers=False)
        self._cursor = self._txn.cursor()
        self._at = -1

    def record(self, number: int) -> tuple[bytes, bytes]:
        try:
            if number < self._at or self._at < 0:
                self._cursor.first()
                self._at = 0
            while self._at < number:
                self._cursor.next()
                self._at += 1
            return self._cursor.key(), self._cursor.value()
        except lmdb.Error as e:  # a damaged page: MDB_CORRUPTED, MDB_PAGE_NOTFOUND
            raise self._reader.damaged(e, f"reading record {number}") from None

    def close(self) -> None:
        self._cursor.close()
        self._txn.abort()


def write_lmdb(path: str, records: Iterable[tuple[bytes, bytes]]) -> int:
    """Write (key, value) records into a new LMDB folder at `path`, whole or not at all (an existing
    `path` is replaced). Returns the number of records written."""

    def fill(folder: str) -> int:
        env = lmdb.open(folder, map_size=_INITIAL_MAP, subdir=True, lock=True)
        try:
            n = sum(_put_chunk(env, chunk) for chunk in chunks(records, _WRITE_CHUNK))
            env.sync(True)
            return n
        finally:
            env.close()

    return build_folder_atomically(path, fill)


def _put_chunk(env: lmdb.Environment, chunk: list[tuple[bytes, bytes]]) -> int:
    while True:
        try:
            with env.begin(write=True) as txn:
                for key, value in chunk:
                    txn.put(key, value)
            return len(chunk)
        except lmdb.MapFullError:  # the transaction was aborted; grow the map and write the chunk again
            env.set_mapsize(env.info()["map_size"] * 2)


def count_records(path: str) -> int:
    """Number of records in an LMDB folder, or -1 when it is missing or unreadable."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return -1
    key = os.path.realpath(path)
    try:
        check_lmdb_file(path, path)
        env = _acquire_environment(key)
    except (lmdb.Error, UserError):
        return -1
    try:
        return int(env.stat()["entries"])
    finally:
        _environments.release(key)
