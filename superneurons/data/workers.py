"""Decode worker processes: batches made in parallel into a ring of shared-memory slots, served in order.

Worker w of W makes batches k = w, w+W, w+2W, ... (each a pure function of k, see `data.batches`),
so the bytes are those of the in-process path whatever W is. Batch k goes to slot k mod S of one
`multiprocessing.shared_memory` block of S slots; the consumer takes batches in order, and the
slot of batch k is given to batch k+S when the consumer asks for batch k+1. Resident memory is
therefore S batches (S = max(prefetch depth, W) + 1: every worker busy, one batch in use).

Why processes: JPEG decoding in Pillow releases the GIL, but parsing the Datum, the random crop and
NumPy's small per-image steps do not; on 2 cores two threads gave 1.08x one thread, two processes
1.43x (docs/ARCHITECTURE.md's data section).

Why 'forkserver': a worker is forked from a small server process that never had the parent's CUDA
context, threads (other layers' prefetchers, the CUDA driver's) or LMDB environments, so none of
those can be half-copied into a worker, and it costs a fork and an import of this package, not
a copy of a large parent. Workers open their own database after they start.

Faults: a record that does not parse or decode comes back as the worker's UserError, raised in the
consumer; a worker that dies is noticed through its process sentinel within a poll interval. Workers
ignore SIGINT (the parent handles Ctrl-C and closes them), exit when their pipe closes, and ask
Linux to kill them when their parent (the fork server, which itself exits with the run) dies, so
none outlive the run.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import shutil
import signal
import sys
import traceback
import types
from multiprocessing import connection, shared_memory
from typing import Any

import numpy as np

from superneurons.data.batches import Batch, BatchPlan, RecordSource, fill_batch
from superneurons.data.transformer import DataTransformer
from superneurons.errors import UserError

_POLL_S = 0.2  # how often a consumer waiting for a batch checks that its worker still lives
_JOIN_S = 2.0  # how long close() waits for a terminated worker before killing it
_PR_SET_PDEATHSIG = 1

_context: Any = None


_requested: int | None = None  # --data-workers, for every data layer of the run


def request_workers(n: int | None) -> None:
    """Set (or with None clear) the number of workers every data layer uses, over its decode_workers."""
    global _requested
    _requested = n


def choose_workers(param: Any, ranks: int = 1) -> int:
    """Workers for a layer whose data_param/image_data_param is `param`: --data-workers, else its
    decode_workers, else the CPU cores this process may run on shared among the `ranks` data-parallel
    processes of the machine."""
    if _requested is not None:
        return _requested
    if param.HasField("decode_workers"):
        return int(param.decode_workers)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, ranks))


def _mp_context():
    global _context
    if _context is None:
        if "forkserver" in mp.get_all_start_methods():
            # Nothing preloaded in the server: before 3.12 it does not take the parent's sys.path, so
            # it could import another copy of this package than the parent's. Each worker imports it
            # after taking the parent's path (~0.3 s, all workers at once).
            _context = mp.get_context("forkserver")
        else:  # macOS has forkserver too; this is for platforms with spawn only
            _context = mp.get_context("spawn")
    return _context


class SharedMemoryShort(Exception):
    """/dev/shm cannot hold the slot ring (a container's default is often 64 MiB); the layer falls back
    to its in-process thread rather than let a worker die of SIGBUS when it writes past the limit."""


def _check_shared_memory(nbytes: int, where: str) -> None:
    if not os.path.isdir("/dev/shm"):
        return
    free = shutil.disk_usage("/dev/shm").free
    if free < nbytes:
        raise SharedMemoryShort(f"{where}: /dev/shm has {free / 2**20:.0f} MiB free, the decode workers' slots need "
                                f"{nbytes / 2**20:.0f} MiB; making batches in one thread instead (enlarge "
                                f"/dev/shm, e.g. docker --shm-size, or lower prefetch or --data-workers)")


class SlotRing:
    """S slots of (data, label) for batches of one plan, in one shared-memory block."""

    def __init__(self, plan: BatchPlan, slots: int, name: str | None = None, where: str = ""):
        self.data_shape = (plan.batch_size,) + tuple(plan.item_shape)
        self.data_bytes = int(np.prod(self.data_shape)) * 4
        self.slot_bytes = self.data_bytes + plan.batch_size * 4
        self.slots = slots
        if name is None:
            _check_shared_memory(slots * self.slot_bytes, where)
            self.shm = shared_memory.SharedMemory(create=True, size=slots * self.slot_bytes)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.name = self.shm.name
        self._views: list[tuple[np.ndarray, np.ndarray]] | None = [
            (np.ndarray(self.data_shape, np.float32, self.shm.buf, s * self.slot_bytes),
             np.ndarray((plan.batch_size,), np.float32, self.shm.buf, s * self.slot_bytes + self.data_bytes))
            for s in range(slots)]

    def slot(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        assert self._views is not None
        return self._views[s]

    def close(self) -> None:
        self._views = None
        try:
            self.shm.close()
        except BufferError:  # a Batch handed out still views it; the mapping goes when that array does
            pass


@contextlib.contextmanager
def _main_script_hidden():
    """While workers start, `__main__` is an empty module. A forkserver (or spawn) child re-runs the
    parent's main script before its target, which a script without an `if __name__ == "__main__":`
    guard cannot survive (it would build its net again, in the worker); the workers need nothing
    from it, so it is not handed to them."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass  # the closed pipe still ends the worker


def _worker_main(conn, ring_name: str, slots: int, source: RecordSource, transformer: DataTransformer,
                 plan: BatchPlan, where: str) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ring = SlotRing(plan, slots, ring_name)
    reader = None
    try:
        while True:
            try:
                k, s = conn.recv()
            except (EOFError, OSError):
                return  # the consumer is gone
            try:
                if reader is None:  # here, so that a database that will not open is reported like a record
                    reader = source.open(plan.seeds)
                data, label = ring.slot(s)
                fill_batch(reader, transformer, plan, k, data, label, where)
            except UserError as e:
                conn.send(("user", k, str(e)))
                return
            except BaseException:  # noqa: BLE001 - a bug must reach the consumer with its traceback
                conn.send(("error", k, traceback.format_exc()))
                return
            conn.send(("ok", k, ""))
    finally:
        if reader is not None:
            reader.close()
        ring.close()
        conn.close()


class WorkerPool:
    """Batches start, start+1, ... of `plan`, made by `workers` processes; `next()` serves them in order.

    A served batch views its slot and stays valid until the following `next()` or `close()`.
    """

    def __init__(self, source: RecordSource, transformer: DataTransformer, plan: BatchPlan, start: int,
                 workers: int, depth: int, where: str):
        if workers < 2:
            raise ValueError(f"a WorkerPool needs at least 2 workers, got {workers}")
        self.where = where
        self.workers = workers
        self.slots = max(depth, workers) + 1
        self._next = start  # the batch next() serves
        self._held: int | None = None  # the batch served last, whose slot the consumer may still read
        self._failure: Exception | None = None
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._ring: SlotRing | None = SlotRing(plan, self.slots, where=where)
        ctx = _mp_context()
        try:
            for w in range(workers):
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main, name=f"decode-{w}", daemon=True,
                                   args=(theirs, self._ring.name, self.slots, source, transformer, plan, where))
                with _main_script_hidden():
                    proc.start()
                theirs.close()
                self._conns.append(ours)
                self._procs.append(proc)
            for k in range(start, start + self.slots):
                self._issue(k)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def shared_memory_name(self) -> str | None:
        return None if self._ring is None else self._ring.name

    def _issue(self, k: int) -> None:
        try:
            self._conns[k % self.workers].send((k, k % self.slots))
        except (BrokenPipeError, OSError):
            pass  # the worker is gone; next() reports how when it waits for this batch

    def next(self) -> Batch:
        if self._failure is not None:
            raise self._failure
        if self._held is not None:  # the consumer is done with it: its slot takes the batch S later
            self._issue(self._held + self.slots)
            self._held = None
        k = self._next
        w = k % self.workers
        kind, got, message = self._receive(w, k)
        if kind != "ok":
            self._failure = UserError(message) if kind == "user" else RuntimeError(
                f"{self.where}: decode worker {w} failed on batch {got}:\n{message}")
            raise self._failure
        assert got == k, (got, k)
        self._held = k
        self._next = k + 1
        data, label = self._ring.slot(k % self.slots)
        return Batch(k, data, label)

    def _receive(self, w: int, k: int) -> tuple[str, int, str]:
        conn, proc = self._conns[w], self._procs[w]
        while True:
            ready = connection.wait([conn, proc.sentinel], _POLL_S)
            if conn in ready or conn.poll():
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    pass
            if proc.sentinel in ready or not proc.is_alive():
                proc.join(_POLL_S)
                self._failure = UserError(f"{self.where}: decode worker {w} of {self.workers} (pid {proc.pid}) "
                                          f"died {_how(proc.exitcode)} while making batch {k}; the run cannot "
                                          f"go on (set decode_workers or --data-workers lower if memory is short)")
                raise self._failure

    def close(self) -> None:
        """Stop and join the workers, unlink the shared memory. Safe to call twice."""
        # Workers hold nothing worth flushing (a read-only database, slots nobody will take), and may
        # have several batches queued: end them now rather than let them finish.
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(_JOIN_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
            ring.shm.unlink()


def _how(exitcode: int | None) -> str:
    if exitcode is None:
        return ""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = "; out of memory?" if -exitcode == signal.SIGKILL else ""
        return f"(killed by {name}{hint})"
    return f"(exit code {exitcode})"
