"""Runtime memory managers: execute a plan's per-step actions on the Net's pool.

The schedule comes from the same code `superneurons memory` prints (`plan.make_plan`), so the
bytes the pool holds at every step under `liveness` are exactly the plan's. Everything is
resolved at setup into per-step lists of (bound method, Tensor); a hook call then does O(actions)
work.

- `LivenessManager`: allocate before first use, free after last use.
- `OffloadManager`: liveness, plus a Tensor Cache (Alg. 2) of checkpoint outputs. Nothing moves
  while the pool has room; when an allocation fails, the least recently used unlocked checkpoint
  tensors are copied to the host store and their device memory freed, until it fits. A step locks
  what it computes on and brings evicted tensors back first (a miss); at the plan's prefetch point
  ("one checkpoint ahead") an evicted tensor comes back if it fits without evicting anything.
  Copies are asynchronous (HostStore): a tensor the plan says may have to leave is copied out as
  soon as its last forward writer has run, so that by the time the cache evicts it the copy is
  usually done; a device block is returned only once its copy has completed.
- `RecomputeManager`: offload, plus dropping non-checkpoint outputs after forward and replaying
  forward steps (with `ctx.recomputing` set) where the cost-aware plan says.
Parameters and their gradients are allocated once at setup and never move.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

from superneurons.errors import PoolExhausted, UserError
from superneurons.memory.counters import MovementCounters
from superneurons.memory.liveness import ALLOC, FREE, OFFLOAD, PREFETCH, RUN, Schedule, simulate
from superneurons.memory.offload import DEFAULT_CHECKPOINTS, HostStore
from superneurons.memory.params import PARAM_KINDS, OffloadedParams, ResidentParams
from superneurons.memory.pool import BLOCK, format_bytes, round_up

_PARAM_KINDS = PARAM_KINDS  # parameters, their gradients, solver history: placed at setup or streamed


class LivenessManager(MovementCounters):
    name = "liveness"

    def __init__(self, net: Any, checkpoint_types: Iterable[str] = DEFAULT_CHECKPOINTS):
        self.net = net
        self.checkpoint_types = tuple(checkpoint_types)
        self.trace: list[int] = []  # peak activation bytes in the pool per global step (this iteration)
        self.on: set[str] = set()  # roots with device memory now
        self.allocs = 0  # tensors given device memory / freed by the schedule (cumulative; `superneurons time`)
        self.frees = 0

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        from superneurons.memory.plan import make_plan  # plan imports this package's modules

        net = self.net
        self.in_setup = True
        self.plan = make_plan(net.graph, train=net.train, modes=(self.name,), plan_backward=False,
                              checkpoint_types=self.checkpoint_types)
        self.program = self.plan.program
        schedule = self.plan.schedules[self.name]
        self.tensors = {t.key: t for t in net.tensors}
        roots = {t.key for t in net.tensors if t.base is None and t.kind not in _PARAM_KINDS}
        if roots != set(self.program.tensors):
            planned = set(self.program.tensors)
            raise RuntimeError(f"memory plan and Net disagree on tensors: only in Net {sorted(roots - planned)}, "
                               f"only in plan {sorted(planned - roots)}")
        self.views: dict[str, list[Any]] = {}
        for t in net.tensors:
            if t.base is not None:
                r = t
                while r.base is not None:
                    r = r.base
                self.views.setdefault(r.key, []).append(t)
        self.buffer_decl = {f"{n.name}#{name}": buf for n in net.graph.nodes for name, buf in n.layer.buffers.items()}
        self.nf = self.program.n_forward
        params = [t for t in net.tensors if t.base is None and t.kind in _PARAM_KINDS]
        all_params = sum(round_up(t.nbytes) for t in params)
        self.param_store = self._param_store(params, all_params)
        self._check_floor(all_params)
        # Resident: parameters, their gradients and history (unless streamed), and the inputs data
        # layers (or the caller) write.
        if not self.param_store.offloaded:
            for t in params:
                self._place(t.key)
        self.param_bytes = net.pool.used_bytes
        for k in sorted(self.program.resident):
            self._place(k)
        for t in net.tensors:  # parameter views (none today) follow their base
            if t.base is not None and t.array is None and _root(t).array is not None:
                net._materialize(t)
        self._compile(schedule)
        self.in_setup = False

    def _param_store(self, params: list, all_params: int):
        """Stream the parameters through the pool when the pool cannot hold them all beside this mode's
        planned peak; keep them resident otherwise. SUPERNEURONS_PARAM_OFFLOAD=1 / 0 forces either."""
        net = self.net
        setting = os.environ.get("SUPERNEURONS_PARAM_OFFLOAD", "").strip()
        fits = all_params + max(self.plan.traces[self.name].bytes, default=0) <= net.pool.capacity
        stream = (not fits) if not setting else _env_flag("SUPERNEURONS_PARAM_OFFLOAD", False)
        if net.train and params and stream:
            return OffloadedParams(net, params)
        return ResidentParams(net)

    def _param_window(self) -> list[int]:
        """Per global step, the parameter bytes streamed in for it (zeros while parameters are resident)."""
        n = len(self.program.steps)
        if not self.param_store.offloaded:
            return [0] * n
        fwd, bwd = self.param_store.step_lists(self.net.graph.nodes, self.net.train)
        size = lambda uses: sum(round_up(t.nbytes) for t in uses[0])  # noqa: E731
        return ([size(fwd[st.forward_index]) for st in self.program.steps[:self.nf]]
                + [size(bwd[st.forward_index]) for st in self.program.steps[self.nf:]])

    def _check_floor(self, all_params: int) -> None:
        """No layer-wise schedule runs in a pool below max(l_i) plus what parameters need at that step:
        say so before training, naming the layer and the bytes."""
        if not self.program.steps:
            return
        window = self._param_window()
        resident = 0 if self.param_store.offloaded else all_params
        s = max(range(len(window)), key=lambda i: self.plan.layer_bytes[i] + window[i])
        need = self.plan.layer_bytes[s]
        total = resident + need + window[s]
        if total > self.net.pool.capacity:
            st = self.program.steps[s]
            params = (f"{window[s]} bytes of its parameters streamed in (all {all_params} do not fit)"
                      if self.param_store.offloaded else f"{all_params} bytes of parameters")
            raise UserError(
                f"a {self.net.pool.capacity}-byte pool ({format_bytes(self.net.pool.capacity)}) cannot train this net "
                f"under --memory {self.name}: layer {st.node.name!r} ({st.phase}) needs {need} bytes "
                f"({format_bytes(need)}) at once, plus {params} = {total} bytes; give a larger pool/--gpu-memory")

    def _compile(self, schedule) -> None:
        do = {ALLOC: self._alloc, FREE: self._free, OFFLOAD: self._offload, PREFETCH: self._prefetch,
              RUN: self._run}
        self.before = [[(do[op], arg) for op, arg in acts] for acts in schedule.before]
        self.after = [[(do[op], arg) for op, arg in acts] for acts in schedule.after]

    # -- the hooks -----------------------------------------------------------------------------
    def before_forward(self, i: int, step: Any) -> None:
        if i == 0:
            self._start_iteration()
        self._enter(i)

    def after_forward(self, i: int, step: Any) -> None:
        self._leave(i)

    def before_backward(self, i: int, step: Any) -> None:
        self._enter(self.nf + i)

    def after_backward(self, i: int, step: Any) -> None:
        self._leave(self.nf + i)

    def ensure(self, tensor: Any) -> None:
        """Give `tensor` device memory now (the loss gradient Net.backward seeds)."""
        k = _root(tensor).key
        if k not in self.on:
            self._alloc(k)

    # -- per step --------------------------------------------------------------------------------
    def _start_iteration(self) -> None:
        # Outputs kept for the caller since the last iteration (and anything an interrupted one left).
        for k in [k for k in self.on if k not in self.program.resident and k in self.program.tensors]:
            self._free(k)
        self.trace = []
        self._mark_iteration()

    def _enter(self, s: int) -> None:
        self.trace.append(self._run_actions(self.before[s]) - self.param_bytes)

    def _run_actions(self, actions: list) -> int:
        """Run a before-list; returns the pool's peak meanwhile (transient replay tensors included).
        Tracked here rather than with pool.high_water, which belongs to the profiler."""
        pool = self.net.pool
        peak = pool.used_bytes
        for fn, arg in actions:
            fn(arg)
            if pool.used_bytes > peak:
                peak = pool.used_bytes
        return peak

    def _leave(self, s: int) -> None:
        for fn, arg in self.after[s]:
            fn(arg)

    # -- actions ---------------------------------------------------------------------------------
    def _place(self, k: str) -> None:
        """Materialize root `k` (gradients come zeroed) and re-point its views and buffer."""
        net, t = self.net, self.tensors[k]
        try:
            net._materialize(t)
        except PoolExhausted as e:
            raise PoolExhausted(f"{e} under --memory {self.name}{self._where()}") from None
        self._bind(k, t)

    def _bind(self, k: str, t: Any) -> None:
        for v in self.views.get(k, ()):
            self.net._materialize(v)
        buf = self.buffer_decl.get(k)
        if buf is not None:
            buf.array = t.array
        self.on.add(k)

    def _unplace(self, k: str) -> None:
        self._unbind(k)
        self.net._release(self.tensors[k])

    def _unbind(self, k: str) -> None:
        """Detach root `k` and its views from their arrays; the pool block itself is the caller's."""
        self.tensors[k].array = None
        for v in self.views.get(k, ()):
            v.array = None
        buf = self.buffer_decl.get(k)
        if buf is not None:
            buf.array = None
        self.on.discard(k)

    def alloc_block(self, key: str, nbytes: int) -> None:
        """A pool block for a streamed parameter tensor."""
        try:
            self.net.pool.alloc(key, nbytes)
        except PoolExhausted as e:
            raise PoolExhausted(f"{e} under --memory {self.name}{self._where()}") from None

    def _alloc(self, k: str) -> None:
        if k not in self.on:
            self.allocs += 1
            self._place(k)

    def _free(self, k: str) -> None:
        if k in self.on:
            self.frees += 1
            self._unplace(k)

    def _offload(self, k: str) -> None:
        pass  # liveness moves nothing to the host

    def _prefetch(self, k: str) -> None:
        pass

    def _run(self, w: int) -> None:
        raise RuntimeError("replay in a schedule without recomputation")

    def _where(self) -> str:
        if getattr(self, "in_setup", False):
            return (f", during setup (placing parameters and inputs, before any step runs): give a larger "
                    f"pool/--gpu-memory (it has {self.net.pool.capacity} bytes)")
        s = len(self.trace)
        steps = self.program.steps
        if s < len(steps):
            st = steps[s]
            params = getattr(self, "param_bytes", None)  # unset while setup still places the parameters
            if params is None:
                params = sum(round_up(t.nbytes) for t in self.net.tensors if t.base is None and t.kind in _PARAM_KINDS)
            plan_peak = max(self.plan.traces[self.name].bytes) + params
            return (f", at {st.phase} step {s + 1} (layer {st.node.name!r}); this mode's plan needs "
                    f"{plan_peak} bytes ({format_bytes(plan_peak)}) with parameters, the pool has "
                    f"{self.net.pool.capacity}: give a larger pool/--gpu-memory or a leaner --memory mode")
        return ""


class OffloadManager(LivenessManager):
    name = "offload"

    def setup(self) -> None:
        from superneurons.memory.cache import TensorCache

        self.cache = TensorCache()
        self.host_keys: set[str] = set()  # evicted: the data is on the host, or on its way there
        self.leaving: dict[str, None] = {}  # evicted, copy still in flight: device block held (oldest first)
        # SUPERNEURONS_CACHE=0: no Tensor Cache policy -- every planned checkpoint moves at its plan points.
        self.use_cache = _env_flag("SUPERNEURONS_CACHE", True)
        self.offloadable: set[str] = set()
        super().setup()
        live = self.plan.liveness
        # What the Tensor Cache may evict: the plan's choice (checkpoints; under recompute also what no
        # replay rebuilds), so that the runtime and `superneurons memory` agree.
        self.offloadable = set(self.plan.schedules[self.name].info["offloadable"])
        self.host = HostStore(sum(round_up(self.tensors[k].nbytes) for k in self.offloadable) + BLOCK,
                              self.net.backend)
        for k in self.offloadable & self.on:
            self.cache.insert(k, self.tensors[k].nbytes)
        # Per step: the cached tensors it computes on (locked while it runs), and which of those it
        # merely reads (a hit or a miss; the step that produces a tensor is neither).
        first = live.first
        self.locks = [[k for k in st.uses if k in self.offloadable] for st in self.program.steps]
        self.checks = [[k for k in ks if first[k] != s] for s, ks in enumerate(self.locks)]
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
            stay = simulate(self.program, _without_moves(schedule)).bytes
            moves = {k: span for k, span in moves.items() if max(stay[span[0] + 1:span[1]], default=0) > budget}
        self.copy_ahead = set(moves)
        for k in sorted(moves):
            self.after[self.program.writers[k][-1]].append((self._copy_out, k))

    @property
    def hits(self) -> int:
        return self.cache.hits

    @property
    def misses(self) -> int:
        return self.cache.misses

    # -- the hooks ---------------------------------------------------------------------------------
    def _start_iteration(self) -> None:
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
        peak = self._run_actions(self.before[s])
        self._lock(self.locks[s], self.checks[s])  # may fetch evicted tensors back
        self.trace.append(max(peak, self.net.pool.used_bytes) - self.param_bytes)

    def _leave(self, s: int) -> None:
        for k in self.locks[s]:
            self.cache.unlock(k)
        for fn, arg in self.after[s]:
            fn(arg)
        if s == len(self.program.steps) - 1:
            for k in sorted(self.program.resident & self.host_keys):
                self._fetch(k)  # the caller writes the next inputs into them
            # Between iterations nothing is in flight: the caller writes inputs, the solver reads weights.
            self._settle_all()

    def _lock(self, keys: list[str], checks: list[str]) -> None:
        for k in keys:
            self.cache.lock(k)
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
        net._attach(t)
        if t.zero_init:
            net.ops.fill(t.array, 0.0)
        self._bind(k, t)
        if k in self.offloadable:
            self.cache.insert(k, t.nbytes)

    def alloc_block(self, key: str, nbytes: int) -> None:
        """A pool block of `nbytes` for `key`, evicting cached tensors to the host until it fits."""
        while True:
            try:
                self.net.pool.alloc(key, nbytes)
                return
            except PoolExhausted as e:
                if self.leaving:  # blocks on their way out: wait for the oldest copy, then retry
                    self.host.settle(next(iter(self.leaving)))
                    self.reclaim()
                    continue
                victim = next(self.cache.victims(), None)
                if victim is None:
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
        self.net._attach(t)
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


class RecomputeManager(OffloadManager):
    name = "recompute"

    def _run(self, w: int) -> None:
        """Replay forward step `w` on the tensors the schedule has just allocated."""
        net = self.net
        step = net.forward_steps[w]
        keys = self.locks[w]
        self._lock(keys, [k for k in keys if k in self.on or k in self.host_keys])
        net.ctx.recomputing = True
        try:
            step.node.layer.forward([t.array for t in step.bottoms], [t.array for t in step.tops])
        finally:
            net.ctx.recomputing = False
            for k in keys:
                self.cache.unlock(k)
        self.replays += 1

    def setup(self) -> None:
        self.replays = 0
        super().setup()


MANAGERS = {"liveness": LivenessManager, "offload": OffloadManager, "recompute": RecomputeManager}


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no", "off")


def _without_moves(schedule: Schedule) -> Schedule:
    """The schedule as it runs when the cache keeps everything: no offload, no prefetch."""
    def keep(acts):
        return [(op, arg) for op, arg in acts if op not in (OFFLOAD, PREFETCH)]
    return Schedule([keep(a) for a in schedule.before], [keep(a) for a in schedule.after], schedule.carry)


def _root(t: Any) -> Any:
    while t.base is not None:
        t = t.base
    return t
