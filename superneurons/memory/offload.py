"""Unified Tensor Pool (paper section 3.3): offloading checkpoint outputs and prefetching them back.

Two halves:
- the *plan* (`plan_offload`): which tensors leave the device and when. Checkpoint layers are
  CONV by default (compute-heavy, so the copy hides under their compute); data-layer outputs are
  checkpoints too, as in the paper's implementation. A checkpoint output that backward needs is
  modelled as leaving the device right after the step following its production (or its last
  forward use, if later), and as coming back when backward reaches the next checkpoint in forward
  order ("one checkpoint ahead"), or at its first backward use if that comes sooner.
- the *host side* (`HostStore`): the external pool, `HeapPool`s over host memory (pinned on the GPU)
  added chunk by chunk as tensors leave the device (`HostChunks`), and the asynchronous copies in
  flight (`backend/{cpu,cuda}/transfer.py`).
"""
from __future__ import annotations

import bisect
from typing import Any, Hashable, Iterable

from superneurons.errors import UserError
from superneurons.memory.liveness import OFFLOAD, PREFETCH, Liveness, OverLimit, Program, Schedule, simulate
from superneurons.memory.pool import HeapPool, format_bytes, round_up
from superneurons.memory.tensors import DATA, tensor_key

DEFAULT_CHECKPOINTS: tuple[str, ...] = ("Convolution",)

# The host store pins memory in chunks of this size as tensors leave the device, not all up front: the
# Tensor Cache keeps tensors on the device while they fit, so far fewer bytes are off it at once than the
# sum of everything it may evict, and one huge cuMemHostAlloc (81 GiB for ResNet-50 at batch 1120) is the
# pinned allocation least likely to succeed. 1 GiB keeps the list of chunks (scanned per save) short.
CHUNK = 1 << 30


def checkpoint_steps(program: Program, types: Iterable[str]) -> list[int]:
    """Forward indices of checkpoint layers (the given types, plus data layers)."""
    types = set(types)
    return [i for i, n in enumerate(program.graph.nodes) if n.layer.type_name in types or n.layer.is_data]


def checkpoint_tensors(program: Program, types: Iterable[str]) -> set[str]:
    """What offload may move and recompute never drops: roots first written by a checkpoint layer, and
    the buffers of the layers that rewrite such a root in place (a BatchNorm or Scale after a
    convolution, fused or not). Those layers read an intermediate value of the root, which only re-running
    the checkpoint layer could produce again, so their buffers cannot be rebuilt cheaply either.
    Likewise the blob a fused BatchNorm writes where graph/fuse.py took it out of place on a checkpoint's
    top (`Graph.internal_blobs`): it is the value the prototxt's in-place chain leaves in that top."""
    cps = set(checkpoint_steps(program, types))
    roots = {k for k, ws in program.writers.items() if ws[0] in cps}
    steps = program.steps
    # Each writer once: a Slice of T time steps writes T roots, and visiting its writes per root is quadratic in T.
    rewriters = {w for k in roots if program.tensors[k].kind == "data" for w in program.writers[k]}
    chained = {b for w in rewriters for b in steps[w].writes if program.tensors[b].kind == "buffer"}
    split_from = program.graph.internal_blobs
    rejoined = {tensor_key(DATA, split_from[k]) for k in roots if k in split_from}
    return roots | chained | (rejoined & program.writers.keys())


def backward_reads(program: Program, live: Liveness, keys: Iterable[str]) -> set[str]:
    """Of `keys`, the forward-produced tensors backward reads: the ones worth moving (outputs excepted,
    which stay for the caller)."""
    return {k for k in keys if k in live.backward_first and k in live.forward_last and k not in program.pinned}


def plan_offload(program: Program, live: Liveness, types: Iterable[str],
                 needed_by: dict[str, int] | None = None,
                 candidates: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
    """key -> (step after which it leaves the device, step before which it is back).

    `candidates` (default: the checkpoint tensors) are what may move. `needed_by` lets recomputation ask
    for a tensor earlier than its own backward use (a replayed forward step reads it).
    """
    out: dict[str, tuple[int, int]] = {}
    due = first_needed(live, needed_by)
    ahead = one_checkpoint_ahead(program, types)
    keys = checkpoint_tensors(program, types) if candidates is None else candidates
    for k in sorted(backward_reads(program, live, keys)):
        prod = program.writers[k][0]
        off = max(prod + 1, live.forward_last.get(k, prod))
        back = min(ahead(prod), due(k))
        if back > off + 1:  # at least one step spent off the device, or it is not worth moving
            out[k] = (off, back)
    return out


def first_needed(live: Liveness, needed_by: dict[str, int] | None = None):
    """key -> the first backward step that reads it (or a replay, per `needed_by`)."""
    needed_by = needed_by or {}
    return lambda k: min(live.backward_first[k], needed_by.get(k, live.backward_first[k]))


def one_checkpoint_ahead(program: Program, types: Iterable[str]):
    """forward step -> the backward step of the next checkpoint after it, where what it wrote comes back."""
    cps = checkpoint_steps(program, types)
    bstep = program.backward_step_of()
    with_backward = [c for c in cps if c in bstep]

    def ahead(prod: int) -> int:
        i = bisect.bisect_right(with_backward, prod)
        return bstep[with_backward[i]] if i < len(with_backward) else program.n_forward
    return ahead


def apply_offload(schedule: Schedule, moves: dict[str, tuple[int, int]]) -> None:
    for k, (off, _back) in moves.items():
        schedule.after[off].append((OFFLOAD, k))
    _prefetch_first(schedule, moves)


def _prefetch_first(schedule: Schedule, moves: dict[str, tuple[int, int]]) -> None:
    """Put each move's prefetch first before its `back` step, the later in `moves` the earlier. Each step's
    list is extended once: inserting one by one shifted the first backward step's list, which holds every
    tensor brought back there, once per tensor."""
    at: dict[int, list[tuple[str, Any]]] = {}
    for k, (_off, back) in moves.items():
        at.setdefault(back, []).append((PREFETCH, k))
    for back, acts in at.items():
        schedule.before[back][:0] = reversed(acts)


def delay_prefetches(program: Program, schedule: Schedule, moves: dict[str, tuple[int, int]],
                     due: dict[str, int], limit: int) -> None:
    """Cost-aware prefetching: a tensor brought back "one checkpoint ahead" that pushes a step on the way
    to its use (`due[k]`) over `limit` bytes is brought back just before its use instead. The copy is then
    less hidden, but the plan stays at `limit` where it can (`moves` is updated in place)."""
    while True:
        over = OverLimit(simulate(program, schedule).bytes, limit)
        late = {k: (off, due[k]) for k, (off, back) in moves.items() if over.within(back, due[k])}
        if not late:
            return
        gone = {(PREFETCH, k) for k in late}
        for back in {moves[k][1] for k in late}:
            schedule.before[back] = [a for a in schedule.before[back] if a not in gone]
        moves.update(late)
        _prefetch_first(schedule, late)


class HostMemoryError(UserError):
    """The host store could not pin the host memory a tensor leaving the device needs."""


def host_store_limit(sizes: Iterable[int]) -> int:
    """The most the host store pins for tensors of `sizes` bytes: all of them off the device at once."""
    return sum(round_up(n) for n in sizes)


class HostChunks:
    """HeapPool's interface (alloc, free, rename, view, owns, used_bytes) over a list of HeapPools, each
    over one pinned allocation of the transfer, added when no chunk has room (first fit over the chunks).

    A new chunk is max(CHUNK, the request) bytes, but no more than `limit` minus what is pinned already
    when that still holds the request: the limit bounds the rounding up to CHUNK, never a save itself
    (chunks split the free bytes, so a save may need a chunk of its own past the limit)."""

    def __init__(self, transfer: Any, limit: int | None = None):
        self.transfer = transfer
        self.limit = limit
        self.chunks: list[HeapPool] = []
        self._chunk_of: dict[Hashable, HeapPool] = {}

    @property
    def pinned_bytes(self) -> int:
        return sum(c.capacity for c in self.chunks)

    @property
    def used_bytes(self) -> int:
        return sum(c.used_bytes for c in self.chunks)

    def owns(self, key: Hashable) -> bool:
        return key in self._chunk_of

    def alloc(self, key: Hashable, nbytes: int) -> None:
        if key in self._chunk_of:
            raise KeyError(f"{key!r} is already allocated")
        size = round_up(nbytes)
        chunk = next((c for c in self.chunks if c.largest_free() >= size), None) or self._add(key, size)
        chunk.alloc(key, nbytes)
        self._chunk_of[key] = chunk

    def _add(self, key: Hashable, size: int) -> HeapPool:
        pinned = self.pinned_bytes
        room = CHUNK if self.limit is None else self.limit - pinned
        nbytes = max(size, min(CHUNK, room))
        try:
            chunk = HeapPool(nbytes, self.transfer)
        except Exception as e:  # cuMemHostAlloc's CudaAPIError on the GPU, MemoryError on the CPU
            raise HostMemoryError(
                f"could not pin {nbytes} bytes ({format_bytes(nbytes)}) of host memory for {key!r} "
                f"({size} bytes) with {pinned} bytes ({format_bytes(pinned)}) already pinned in "
                f"{len(self.chunks)} chunk(s) by the host store ({type(e).__name__}: {e}). Tensors that leave "
                f"the device need host memory: train with a smaller batch, on a machine with more host "
                f"memory, or with --memory recompute and other checkpoint layers (memory_param "
                f"checkpoint_type), so that fewer bytes leave the device") from e
        self.chunks.append(chunk)
        return chunk

    def free(self, key: Hashable) -> None:
        self._chunk_of.pop(key).free(key)

    def rename(self, key: Hashable, new_key: Hashable) -> None:
        if new_key in self._chunk_of:
            raise KeyError(f"{new_key!r} is already allocated")
        chunk = self._chunk_of.pop(key)
        chunk.rename(key, new_key)
        self._chunk_of[new_key] = chunk

    def view(self, key: Hashable, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._chunk_of[key].view(key, shape, dtype)


class HostStore:
    """The external pool: host copies of device tensors, carved from chunks of host memory (pinned, on
    the GPU) added as they are needed, up to about `limit` bytes (`HostChunks`), and the copies in
    flight between the two.

    A save (D2H) keeps its host block under the tensor's key; until its event completes the caller
    must keep the device block too (`saving`). A load (H2D) gives the host block up at once -- it is
    re-keyed and freed when the copy has read it -- and the step that reads the tensor `ready`s it
    first. Copies complete in issue order per direction, so polling stops at the first pending one.
    """

    def __init__(self, limit: int | None, backend: Any):
        self.transfer = backend.make_transfer()
        self.pool = HostChunks(self.transfer, limit)
        self._saving: dict[str, Any] = {}  # key -> event of its D2H, oldest first
        self._loading: dict[str, Any] = {}  # key -> event of its H2D, oldest first
        self._retiring: list[tuple[Any, tuple]] = []  # (event, host pool key) freed once the event completes
        self._serial = 0

    def __contains__(self, key: str) -> bool:
        """A host copy of `key` exists (complete, or its D2H still in flight)."""
        return self.pool.owns(key)

    @property
    def busy(self) -> bool:
        return bool(self._saving or self._loading or self._retiring)

    @property
    def pinned_bytes(self) -> int:
        """Host memory the store holds (every chunk, used or not: chunks are kept once pinned)."""
        return self.pool.pinned_bytes

    def saving(self, key: str) -> bool:
        """`key`'s copy to the host is still in flight (its device block must not be reused yet)."""
        event = self._saving.get(key)
        return event is not None and not event.query()

    def loading(self, key: str) -> bool:
        return key in self._loading

    # -- starting copies ------------------------------------------------------------------------------
    def save(self, key: str, device_array: Any) -> None:
        """Start copying `device_array` to a new host block for `key` (after the compute issued so far)."""
        self._saving.pop(key, None)  # an earlier, finished save of this key that no poll has reported
        self.pool.alloc(key, device_array.nbytes)
        host = self.pool.view(key, device_array.shape, device_array.dtype)
        self._saving[key] = self.transfer.to_host(device_array, host)

    def load(self, key: str, device_array: Any) -> None:
        """Start copying `key`'s host copy into `device_array`; the host copy is gone from now on."""
        host = self.pool.view(key, device_array.shape, device_array.dtype)
        event = self.transfer.to_device(host, device_array)
        self._loading[key] = event
        self._retire(key, event)

    def cancel(self, key: str) -> None:
        """The host copy of `key` is not wanted after all (the device copy stayed valid)."""
        event = self._saving.pop(key, None)
        if event is not None:
            self._retire(key, event)
        elif self.pool.owns(key):
            self.pool.free(key)

    def _retire(self, key: str, event: Any) -> None:
        self._serial += 1
        tag = ("retiring", key, self._serial)
        self.pool.rename(key, tag)
        self._retiring.append((event, tag))

    # -- completion -------------------------------------------------------------------------------------
    def poll(self) -> list[str]:
        """Keys whose save has completed since the last poll; retires finished loads on the way."""
        done = []
        for key, event in list(self._saving.items()):
            if not event.query():
                break
            del self._saving[key]
            done.append(key)
        for key, event in list(self._loading.items()):
            if not event.query():
                break
            del self._loading[key]
        while self._retiring and self._retiring[0][0].query():
            self.pool.free(self._retiring.pop(0)[1])
        return done

    def ready(self, key: str) -> None:
        """Before compute reads `key` on the device: make it wait for the key's H2D (GPU-side)."""
        event = self._loading.pop(key, None)
        if event is not None:
            self.transfer.join(event)

    def settle(self, key: str) -> None:
        """Block until every copy that reads or writes `key`'s blocks has finished (`poll` then reports it)."""
        for event in (self._saving.get(key), self._loading.get(key)):
            if event is not None:
                event.synchronize()
        for event, tag in self._retiring:
            if tag[1] == key:
                event.synchronize()

    def drop(self, key: str) -> None:
        """Forget `key`'s host copy (the tensor is dead)."""
        self.settle(key)
        self._saving.pop(key, None)
        self._loading.pop(key, None)
        if self.pool.owns(key):
            self.pool.free(key)

    def drain(self) -> list[str]:
        """Block until every copy has finished; returns the saves completed meanwhile."""
        for table in (self._saving, self._loading):
            if table:
                next(reversed(table.values())).synchronize()  # streams are FIFO: the newest covers the rest
        for event, _tag in self._retiring:
            event.synchronize()
        return self.poll()
