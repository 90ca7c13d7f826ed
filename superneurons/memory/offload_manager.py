"""The offload manager (paper section 3.3): liveness plus a Tensor Cache (Alg. 2) of checkpoint outputs.

Nothing moves while the pool has room; when an allocation fails, the least recently used unlocked
checkpoint tensors are copied to the host store and their device memory freed, until it fits. A step
locks what it computes on and brings evicted tensors back first (a miss); at the plan's prefetch point
("one checkpoint ahead") an evicted tensor comes back if it fits without evicting anything. Copies are
asynchronous (HostStore): a tensor the plan says may have to leave is copied out as soon as its last
forward writer has run, so that by the time the cache evicts it the copy is usually done; a device
block is returned only once its copy has completed.
"""
from __future__ import annotations

from superneurons.errors import PoolExhausted
from superneurons.memory.cache import TensorCache
from superneurons.memory.liveness import OFFLOAD, PREFETCH, OverLimit, Schedule, simulate
from superneurons.memory.liveness_manager import LivenessManager
from superneurons.memory.offload import HostStore, host_store_limit
from superneurons.memory.pool import round_up


class OffloadManager(LivenessManager):
    name = "offload"

    def setup(self) -> None:
        self.cache = TensorCache()
        self.host_keys: set[str] = set()  # evicted: the data is on the host, or on its way there
        self.leaving: dict[str, None] = {}  # evicted, copy still in flight: device block held (oldest first)
        # tensor_cache off: no Tensor Cache policy -- every planned checkpoint moves at its plan points.
        self.use_cache = self.net.policy.tensor_cache
        self.offloadable: set[str] = set()
        self.between: list[str] = []  # inputs locked on the device from the end of one iteration to the next
        super().setup()
        live = self.plan.liveness
        # What the Tensor Cache may evict: the plan's choice (checkpoints; under recompute also what no
        # replay rebuilds), so that the runtime and `superneurons memory` agree.
        self.offloadable = set(self.plan.schedules[self.name].info["offloadable"])
        # Host memory is pinned chunk by chunk as tensors leave (offload.CHUNK), about all of them at most.
        self.host = HostStore(host_store_limit(self.tensors[k].nbytes for k in self.offloadable), self.net.backend)
        for k in self.offloadable & self.on:
            self.cache.insert(k, self.tensors[k].nbytes)
        # Per step: the cached tensors it computes on (locked while it runs), and which of those it
        # merely reads (a hit or a miss; the step that produces a tensor is neither).
        first = live.first
        self.locks = [[k for k in st.uses if k in self.offloadable] for st in self.program.steps]
        self.checks = [[k for k in ks if first[k] != s] for s, ks in enumerate(self.locks)]
        # A gradient changes at the steps that use it (written, or added into), unlike a forward output: a
        # host copy made before such a step is stale after it and must not stand in for the device copy.
        self.rewrites = [[k for k in ks if self.tensors[k].kind == "diff"] for ks in self.locks]
        self._schedule_copies()

    def _schedule_copies(self) -> None:
        """Start the copy to the host of every tensor that may have to leave right after its last forward
        writer, so the copy overlaps the following steps and an eviction rarely waits for it.

        "May have to leave": with the cache, the pool would overflow somewhere in the span the plan keeps
        the tensor off the device if nothing moved (so when the net fits, nothing is copied); without
        the cache, every planned move.
        """
        schedule = self.plan.schedules[self.name]
        moves: dict[str, tuple[int, int]] = schedule.info.get("offloaded", {})
        if self.use_cache:
            budget = self.net.pool.capacity - self.param_bytes
            over = OverLimit(simulate(self.program, _without_moves(schedule)).bytes, budget)
            moves = {k: (off, back) for k, (off, back) in moves.items() if over.within(off + 1, back)}
        self.copy_ahead = set(moves)
        writers = self.program.writers
        for k, (off, _back) in sorted(moves.items()):
            # A forward output is copied once its last forward writer ran; a parked gradient once the
            # backward step before its wait (recompute.py) has written it.
            self.after[writers[k][-1] if k in writers else off].append((self._copy_out, k))

    @property
    def hits(self) -> int:
        return self.cache.hits

    @property
    def misses(self) -> int:
        return self.cache.misses

    @property
    def host_pinned_bytes(self) -> int:
        return self.host.pinned_bytes

    # -- the hooks ---------------------------------------------------------------------------------
    def _start_iteration(self) -> None:
        for k in self.between:
            self.cache.unlock(k)
        self.between = []
        # Only an interrupted iteration leaves anything in flight or on the host.
        self._settle_all()
        for k in sorted(self.program.resident & self.host_keys):
            self._fetch(k)
        for k in list(self.host_keys):
            self._free(k)
        self._settle_all()
        super()._start_iteration()

    def _enter(self, s: int) -> None:
        self.reclaim()
        # Locked before the step's own actions run: an allocation among them (a gradient, a replay's
        # tensors) must not evict a tensor the step computes on that an earlier action allocated.
        for k in self.locks[s]:
            self.cache.lock(k)
        peak = self._run_actions(self.before[s])
        self._check(self.locks[s], self.checks[s])  # may fetch evicted tensors back
        self.trace.append(max(peak, self.net.pool.used_bytes) - self.param_bytes)

    def _leave(self, s: int) -> None:
        for k in self.locks[s]:
            self.cache.unlock(k)
        for k in self.rewrites[s]:
            if k in self.host and k in self.on:
                self.host.cancel(k)  # an unfinished copy retires on its own; nothing waits for it
        for fn, arg in self.after[s]:
            fn(arg)
        if s == len(self.program.steps) - 1:
            for k in sorted(self.program.resident & self.host_keys):
                self._fetch(k)  # the caller writes the next inputs into them
            # ... so nothing between iterations (the update of streamed parameters) may evict them again.
            self.between = sorted(self.program.resident & self.offloadable)
            for k in self.between:
                self.cache.lock(k)
            # Between iterations nothing is in flight: the caller writes inputs, the solver reads weights.
            self._settle_all()

    def _lock(self, keys: list[str], checks: list[str]) -> None:
        for k in keys:
            self.cache.lock(k)
        self._check(keys, checks)

    def _check(self, keys: list[str], checks: list[str]) -> None:
        """Count the cache's hits and misses on `checks`, bring back the evicted ones, and make compute wait
        for prefetches of `keys` still in flight."""
        for k in checks:
            if not self.cache.check(k) and k in self.host_keys:
                self._fetch(k)
        if self.host.busy:
            for k in keys:
                self.host.ready(k)  # compute waits for a prefetch still in flight (on the device)

    # -- completion of copies ----------------------------------------------------------------------
    def reclaim(self) -> None:
        """Return the device blocks of evicted tensors whose copy to the host has completed."""
        if self.host.busy:
            self._release_leaving(self.host.poll())

    def _quiesce(self) -> None:
        super()._quiesce()
        self._settle_all()  # offloads done (their blocks freed), prefetches landed

    def _settle_all(self) -> None:
        if self.host.busy:
            self._release_leaving(self.host.drain())

    def _release_leaving(self, saved: list[str]) -> None:
        for k in saved:
            if k in self.leaving:
                del self.leaving[k]
                self.net.pool.free(k)

    # -- moving bytes ------------------------------------------------------------------------------
    def _place(self, k: str) -> None:
        if k in self.leaving:
            self._revive(k)
            return
        net, t = self.net, self.tensors[k]
        self.alloc_block(k, t.nbytes)
        net.attach(t)
        if t.zero_init:
            net.ops.fill(t.array, 0.0)
        self._bind(k, t)
        if k in self.offloadable:
            self.cache.insert(k, t.nbytes)

    def alloc_block(self, key: str, nbytes: int, high: bool = False) -> None:
        """A pool block of `nbytes` for `key`, evicting cached tensors to the host until it fits (`high`:
        from the top of the pool)."""
        while True:
            try:
                self.net.pool.alloc(key, nbytes, high=high)
                return
            except PoolExhausted as e:
                if self.leaving:  # blocks on their way out: wait for the oldest copy, then retry
                    self.host.settle(next(iter(self.leaving)))
                    self.reclaim()
                    continue
                if self._make_param_room():  # parameter blocks copying home or prefetched ahead
                    continue
                if not self.use_cache and self._defragment(nbytes):
                    continue  # without the cache only the plan moves tensors: the bytes are free, in pieces
                victim = self.cache.victim()
                if victim is None:
                    # Last resort, as compaction stops the device: the bytes are free but in pieces.
                    if self._defragment(nbytes):
                        continue
                    raise PoolExhausted(f"{e} under --memory {self.name}, with nothing left to offload"
                                        f"{self._where()}") from None
                self._evict(victim)

    def _copy_out(self, k: str) -> None:
        """Start copying `k` to the host while it stays on the device (and in the cache)."""
        if k in self.on and k not in self.host:
            self.host.save(k, self.tensors[k].array)
            self.bytes_offloaded += round_up(self.tensors[k].nbytes)

    def _evict(self, k: str) -> None:
        """LRU.out for one tensor: its bytes go to the host store, its device block once the copy is done."""
        self.host.ready(k)  # a prefetch into it still in flight must land before the copy out reads it
        self._copy_out(k)
        self.cache.remove(k)
        self._unbind(k)
        self.host_keys.add(k)
        if self.host.saving(k):
            self.leaving[k] = None
        else:
            self.net.pool.free(k)

    def _revive(self, k: str) -> None:
        """Take back a tensor whose eviction is still copying: its device block still holds the data."""
        del self.leaving[k]
        self.host.cancel(k)
        self.host_keys.discard(k)
        t = self.tensors[k]
        self.net.attach(t)
        self._bind(k, t)
        self.cache.insert(k, t.nbytes)

    def _fetch(self, k: str) -> None:
        if k in self.leaving:
            self._revive(k)
            return
        self._place(k)
        self.host.load(k, self.tensors[k].array)
        self.host_keys.discard(k)
        self.bytes_prefetched += round_up(self.tensors[k].nbytes)

    def _prefetch(self, k: str) -> None:
        """The plan's prefetch point: bring `k` back if it is off the device and fits (with the cache)."""
        if k not in self.host_keys:
            return
        self.reclaim()
        if (k in self.leaving or not self.use_cache
                or self.net.pool.largest_free() >= round_up(self.tensors[k].nbytes)):
            self._fetch(k)

    def _offload(self, k: str) -> None:
        """The plan's offload point: only without the cache does it move anything by itself."""
        if not self.use_cache and k in self.on and not self.cache.locked(k):
            self._evict(k)

    def _free(self, k: str) -> None:
        self.cache.remove(k)
        if k in self.leaving:  # dead while its copy is in flight: the copy must finish reading first
            self.host.settle(k)
            del self.leaving[k]
            self.net.pool.free(k)
        if self.host.busy:
            self.host.ready(k)
            self.host.settle(k)  # nothing may still read or write its device block once it is reused
        if k in self.host:
            self.host.drop(k)
        self.host_keys.discard(k)
        if k in self.on:
            self.frees += 1
            self._unplace(k)



def _without_moves(schedule: Schedule) -> Schedule:
    """The schedule as it runs when the cache keeps everything: no offload, no prefetch."""
    def keep(acts):
        return [(op, arg) for op, arg in acts if op not in (OFFLOAD, PREFETCH)]
    return Schedule([keep(a) for a in schedule.before], [keep(a) for a in schedule.after], schedule.carry)
