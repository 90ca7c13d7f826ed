"""Decode worker processes: batches made in parallel into a ring of shared-memory slots, served in order.

Worker w of W makes batches k = w, w+W, w+2W, ... (each a pure function of k, see `data.batches`),
so the bytes are those of the in-process path whatever W is. Batch k goes to slot k mod S of one
`multiprocessing.shared_memory` block of S slots; the consumer takes batches in order, and the
slot of batch k is given to batch k+S once the consumer has handed batch k back (it asked for
batch k+1) and the device copies reading the slot (`reading`) have completed. Resident memory is
therefore S batches (S = max(prefetch depth, W) + 1: every worker busy, one batch in use).

Straight to the device: given a `pin` function (the backend's `ops.pin_host`), the pool page-locks
its ring once, so the layer copies each batch to the device directly from its slot, with no
staging memcpy on the host. Copy events are polled, never waited for, when the pool hands slots
back; the consumer blocks on one only when the batch it asks for needs that slot, i.e. when the
device is S batches behind.

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
import mmap
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import sys
import threading
import traceback
import types
import weakref
from collections import deque
from multiprocessing import connection, shared_memory
from typing import Any, Callable, Protocol

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

import numpy as np

from superneurons.data import worker_start
from superneurons.data.batches import Batch, BatchPlan, RecordSource, fill_batch
from superneurons.data.transformer import DataTransformer
from superneurons.dtypes import FLOAT32, tensor_bytes
from superneurons.errors import UserError
from superneurons.io.prototxt import process_running

_POLL_S = 0.2  # how often a consumer waiting for a batch checks that its worker still lives
_JOIN_S = 2.0  # how long close() waits for a terminated worker before killing it
_PR_SET_PDEATHSIG = 1
# Workers yield the CPU to the consumer's thread, which drives the device: a batch is needed only
# S-1 iterations after its slot is handed out, so a worker can wait, a queued kernel launch cannot.
_WORKER_NICENESS = 5

_context: Any = None


def choose_workers(param: Any, ranks: int = 1, requested: int | None = None) -> int:
    """Workers for a layer whose data_param/image_data_param is `param`: `requested` (the run's --data-workers,
    which its RunContext carries), else its decode_workers, else the CPU cores this process may run on shared
    among the `ranks` data-parallel processes of the machine."""
    if requested is not None:
        return requested
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


class WorkersUnavailable(Exception):
    """The decode worker processes cannot run here; the layer makes its batches in its own thread instead."""


class SharedMemoryShort(WorkersUnavailable):
    """/dev/shm cannot hold the slot ring (a container's default is often 64 MiB), or the file-size limit
    (`ulimit -f`) is below it; the layer falls back to its in-process thread rather than let a worker die of
    SIGBUS when it writes past the limit, or the segment's creation fail."""


def _check_shared_memory(nbytes: int, where: str) -> None:
    fallback = ("making batches in one thread instead (enlarge /dev/shm, e.g. docker --shm-size, or lower prefetch "
                "or --data-workers)")
    # A shared-memory segment is a file: `ulimit -f` caps it as it caps any other (ftruncate fails, EFBIG).
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource is not None else -1
    if limit != getattr(resource, "RLIM_INFINITY", -1) and 0 <= limit < nbytes:
        raise SharedMemoryShort(f"{where}: the file-size limit (ulimit -f) is {limit} bytes, the decode workers' "
                                f"slots need {nbytes}; making batches in one thread instead")
    if not os.path.isdir("/dev/shm"):
        return
    free = shutil.disk_usage("/dev/shm").free
    if free < nbytes:
        raise SharedMemoryShort(f"{where}: /dev/shm has {free / 2**20:.0f} MiB free, the decode workers' slots need "
                                f"{nbytes / 2**20:.0f} MiB; {fallback}")


# Slot rings are named `superneurons-PID-XXXXXXXX` after the process that made them, so a later run can tell
# a ring whose process is gone (killed with SIGKILL along with the resource tracker that would have unlinked
# it) from one a running process still uses, and remove it, as it removes a dead run's temporary snapshots.
RING_PREFIX = "superneurons-"
SHM_FOLDER = "/dev/shm"


def remove_dead_rings(folder: str = SHM_FOLDER) -> list[tuple[str, int]]:
    """Unlink the slot rings in `folder` whose process is no longer running; returns (name, bytes) of each."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        pid = name[len(RING_PREFIX):].split("-", 1)[0] if name.startswith(RING_PREFIX) else ""
        if not pid.isdigit() or process_running(int(pid)):
            continue
        path = os.path.join(folder, name)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:
            continue  # another user's, or removed meanwhile
        removed.append((name, size))
    return removed


def _create_segment(nbytes: int, where: str) -> shared_memory.SharedMemory:
    """A new segment of `nbytes`; one the system will not make (full, or a limit the check above cannot see)
    is SharedMemoryShort too. What killed runs left is removed first: it takes the room."""
    gone = remove_dead_rings()
    if gone:
        print(f"{where}: removed {len(gone)} shared-memory segment(s) ({sum(n for _, n in gone)} bytes) that "
              f"killed runs left in {SHM_FOLDER}", file=sys.stderr, flush=True)
    _check_shared_memory(nbytes, where)
    try:
        name = f"{RING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        return shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    except OSError as e:
        raise SharedMemoryShort(f"{where}: cannot create the decode workers' {nbytes}-byte shared-memory slots "
                                f"({e.strerror or e}); making batches in one thread instead") from None


class CopyEvent(Protocol):
    """Completion of a device copy reading a slot (`backend.base.CopyEvent`)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class HostPin(Protocol):
    """Memory page-locked for direct device copies (`ops.pin_host`), until `release()`."""

    def release(self) -> None: ...


class SlotRing:
    """S slots of (data, label) for batches of one plan, in one shared-memory block."""

    def __init__(self, plan: BatchPlan, slots: int, name: str | None = None, where: str = ""):
        self.data_shape = (plan.batch_size,) + tuple(plan.item_shape)
        self.data_bytes = tensor_bytes(self.data_shape, plan.data_dtype)
        self.slot_bytes = self.data_bytes + tensor_bytes((plan.batch_size,), FLOAT32)
        self.slots = slots
        if name is None:
            self.shm = _create_segment(slots * self.slot_bytes, where)
        else:
            self.shm = shared_memory.SharedMemory(name=name)
        self.name = self.shm.name
        # Our own mapping of the segment, which goes when the last array viewing it does: a Batch kept past
        # close() stays readable, and nothing ever has to close a mapping arrays still export (the
        # SharedMemory's own would complain at exit). Its own mapping is closed at once, never viewed.
        fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR)
        try:
            self._map: mmap.mmap | None = mmap.mmap(fd, slots * self.slot_bytes)
        finally:
            os.close(fd)
        self.shm.close()
        self._memory: np.ndarray | None = np.frombuffer(self._map, np.uint8, slots * self.slot_bytes)
        self._views: list[tuple[np.ndarray, np.ndarray]] | None = [
            (self._memory[s * self.slot_bytes:s * self.slot_bytes + self.data_bytes].view(plan.data_dtype)
             .reshape(self.data_shape),
             self._memory[s * self.slot_bytes + self.data_bytes:(s + 1) * self.slot_bytes].view(np.float32))
            for s in range(slots)]

    def slot(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        assert self._views is not None
        return self._views[s]

    def memory(self) -> np.ndarray:
        """All S slots as one uint8 array (what gets page-locked)."""
        assert self._memory is not None
        return self._memory

    def close(self) -> None:
        """Drop the ring's views; the mapping goes with the last array still viewing it."""
        self._views = self._memory = self._map = None


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


def worker_main(conn, ring_name: str, slots: int, source: RecordSource, transformer: DataTransformer,
                 plan: BatchPlan, where: str) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # done first by worker_start, the process's entry point
    try:
        os.nice(_WORKER_NICENESS)
    except OSError:
        pass
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


_open_pools: "weakref.WeakSet[WorkerPool]" = weakref.WeakSet()


def close_pools() -> None:
    """Close every pool still open. The command line does it before it returns, so that the workers and the
    shared memory go while a Ctrl-C can still be answered as an interruption, not in an exit handler."""
    for pool in list(_open_pools):
        pool.close()


@contextlib.contextmanager
def _ctrl_c_after():
    """Run the block to its end however often Ctrl-C comes, then act on it as the handler in place would
    have (on the main thread, where Python runs signal handlers; elsewhere the block runs as is). A clean-up
    cut short by a second Ctrl-C left workers running and shared memory behind; a start cut short, a worker
    nobody stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    frames: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: frames.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if callable(previous):
            for frame in frames:  # each, in order: the solver's first Ctrl-C stops after the iteration, a second at once
                previous(signal.SIGINT, frame)


def _start_fork_server(ctx: Any) -> None:
    """Start the fork server (if it is not running) with SIGINT blocked, as CPython starts its resource
    tracker: the blocked mask survives its exec and reaches every worker it forks, so the terminal's Ctrl-C,
    which goes to the whole process group, reaches neither the server while it imports (it died of it, with a
    traceback) nor a worker; this process acts on it once unblocked (the run stops, then closes the workers)."""
    if ctx.get_start_method() != "forkserver" or not hasattr(signal, "pthread_sigmask"):
        return
    from multiprocessing import forkserver

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class WorkerPool:
    """Batches start, start+1, ... of `plan`, made by `workers` processes; `next()` serves them in order.

    A served batch views its slot and stays valid until the following `next()` or `close()`, and
    after that until the copies `reading` was told of have completed.
    `pin`: page-lock the ring for direct device copies (`pinned`; `pin_failure` says why not).
    """

    def __init__(self, source: RecordSource, transformer: DataTransformer, plan: BatchPlan, start: int,
                 workers: int, depth: int, where: str, pin: Callable[[np.ndarray], HostPin] | None = None):
        if workers < 2:
            raise ValueError(f"a WorkerPool needs at least 2 workers, got {workers}")
        self.where = where
        self.workers = workers
        self.slots = max(depth, workers) + 1
        self._next = start  # the batch next() serves
        self._held: int | None = None  # the batch served last, whose slot the consumer may still read
        self._held_reads: list[CopyEvent] = []  # device copies reading the held batch's slot
        # Batches handed back, in order, with the copies still reading their slots: each slot goes to
        # the batch S later once they have completed.
        self._returned: deque[tuple[int, list[CopyEvent]]] = deque()
        self._failure: Exception | None = None
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._ring: SlotRing | None = SlotRing(plan, self.slots, where=where)
        _open_pools.add(self)
        self._pin: HostPin | None = None
        self.pin_failure: str | None = None
        ctx = _mp_context()
        try:
            if pin is not None:
                try:
                    self._pin = pin(self._ring.memory())
                except MemoryError as e:
                    self.pin_failure = str(e)
            try:
                self._start_workers(ctx, source, transformer, plan)
            except (EOFError, ConnectionError) as e:
                # The fork server died while starting: a Ctrl-C reached it before it could ignore the signal
                # (the run then stops as asked, after this batch), or the system refused it a process.
                raise WorkersUnavailable(f"{where}: the decode worker processes could not be started ({e!r}); "
                                         "making batches in one thread instead") from None
            for k in range(start, start + self.slots):
                self._issue(k)
        except BaseException:
            self.close()
            raise

    def _start_workers(self, ctx: Any, source: RecordSource, transformer: DataTransformer, plan: BatchPlan) -> None:
        assert self._ring is not None
        _start_fork_server(ctx)
        with _ctrl_c_after():  # a worker forked but not yet in _procs would outlive close() and miss its ring
            self._start_each(ctx, source, transformer, plan)

    def _start_each(self, ctx: Any, source: RecordSource, transformer: DataTransformer, plan: BatchPlan) -> None:
        assert self._ring is not None
        for w in range(self.workers):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_start.run, name=f"decode-{w}", daemon=True,
                               args=(worker_main, theirs, self._ring.name, self.slots, source, transformer, plan,
                                     self.where))
            with _main_script_hidden():
                proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def shared_memory_name(self) -> str | None:
        return None if self._ring is None else self._ring.name

    @property
    def pinned(self) -> bool:
        """Whether the slots are page-locked: the consumer may copy batches to the device straight from them."""
        return self._pin is not None

    def _issue(self, k: int) -> None:
        try:
            self._conns[k % self.workers].send((k, k % self.slots))
        except (BrokenPipeError, OSError):
            pass  # the worker is gone; next() reports how when it waits for this batch

    def reading(self, event: CopyEvent) -> None:
        """A device copy reads the batch served last until `event` completes: its slot is not given to
        another batch before then, however soon the consumer asks for the next one."""
        if self._held is None:
            raise ValueError(f"{self.where}: no batch is being served, nothing can be read")
        self._held_reads.append(event)

    def _hand_back(self) -> None:
        """The consumer is done with the held batch; its slot goes to batch held+S when its copies end."""
        if self._held is not None:
            self._returned.append((self._held, self._held_reads))
            self._held, self._held_reads = None, []

    def _reuse_slots(self, need: int) -> None:
        """Give the slots of handed-back batches whose copies have completed to the batches S later, in
        order (so every worker gets its batches in order). Copies are only polled, except for batches
        up to `need`, whose slots the batch asked for now was assigned to: those are waited for."""
        while self._returned:
            k, reads = self._returned[0]
            if k <= need:
                for event in reads:
                    event.synchronize()
            else:
                reads[:] = [event for event in reads if not event.query()]
                if reads:
                    break  # a copy stream completes in order: later batches' copies are not done either
            self._returned.popleft()
            self._issue(k + self.slots)

    def next(self) -> Batch:
        if self._failure is not None:
            raise self._failure
        self._hand_back()
        k = self._next
        self._reuse_slots(need=k - self.slots)
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
        """Stop and join the workers, unlink the shared memory. Safe to call twice; Ctrl-C meanwhile is acted on
        once it is done."""
        _open_pools.discard(self)
        with _ctrl_c_after():
            self._close()

    def _close(self) -> None:
        # The device may still be copying from the slots: wait for it before unlocking and unmapping them.
        self._hand_back()
        pending = [event for _, reads in self._returned for event in reads]
        self._returned.clear()
        for event in pending:
            with contextlib.suppress(Exception):  # at interpreter exit the device context may be gone
                event.synchronize()
        pin, self._pin = self._pin, None
        if pin is not None:
            with contextlib.suppress(Exception):
                pin.release()
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
