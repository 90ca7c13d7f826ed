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
- `RecomputeManager`: offload, plus dropping non-checkpoint outputs after forward and replaying
  forward steps (with `ctx.recomputing` set) where the cost-aware plan says.
Parameters and their gradients are allocated once at setup and never move.
"""
from __future__ import annotations

from typing import Any, Iterable

from superneurons.errors import PoolExhausted
from superneurons.memory.liveness import ALLOC, FREE, OFFLOAD, PREFETCH, RUN
from superneurons.memory.offload import DEFAULT_CHECKPOINTS, HostStore, checkpoint_tensors
from superneurons.memory.pool import BLOCK, format_bytes, round_up

_PARAM_KINDS = ("param", "param_diff")


class LivenessManager:
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
        # Resident: parameters, their gradients, and the inputs data layers (or the caller) write.
        for t in net.tensors:
            if t.base is None and t.kind in _PARAM_KINDS:
                self._place(t.key)
        self.param_bytes = net.pool.used_bytes
        for k in sorted(self.program.resident):
            self._place(k)
        for t in net.tensors:  # parameter views (none today) follow their base
            if t.base is not None and t.array is None and _root(t).array is not None:
                net._materialize(t)
        self.nf = self.program.n_forward
        self._compile(schedule)

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
        self.net._release(self.tensors[k])
        for v in self.views.get(k, ()):
            v.array = None
        buf = self.buffer_decl.get(k)
        if buf is not None:
            buf.array = None
        self.on.discard(k)

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
        self.host_keys: set[str] = set()
        self.bytes_offloaded = 0
        self.bytes_prefetched = 0
        self.offloadable: set[str] = set()
        super().setup()
        live = self.plan.liveness
        self.offloadable = {k for k in checkpoint_tensors(self.program, self.checkpoint_types)
                            if k in live.backward_first and k not in self.program.pinned}
        self.host = HostStore(sum(round_up(self.tensors[k].nbytes) for k in self.offloadable) + BLOCK,
                              self.net.backend)
        for k in self.offloadable & self.on:
            self.cache.insert(k, self.tensors[k].nbytes)
        # Per step: the cached tensors it computes on (locked while it runs), and which of those it
        # merely reads (a hit or a miss; the step that produces a tensor is neither).
        first = live.first
        self.locks = [[k for k in st.uses if k in self.offloadable] for st in self.program.steps]
        self.checks = [[k for k in ks if first[k] != s] for s, ks in enumerate(self.locks)]

    @property
    def hits(self) -> int:
        return self.cache.hits

    @property
    def misses(self) -> int:
        return self.cache.misses

    def _enter(self, s: int) -> None:
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

    def _lock(self, keys: list[str], checks: list[str]) -> None:
        for k in keys:
            self.cache.lock(k)
        for k in checks:
            if not self.cache.check(k) and k in self.host_keys:
                self._fetch(k)

    # -- moving bytes ------------------------------------------------------------------------------
    def _place(self, k: str) -> None:
        net, t = self.net, self.tensors[k]
        while True:
            try:
                net._materialize(t)
                break
            except PoolExhausted as e:
                victim = next(self.cache.victims(), None)
                if victim is None:
                    raise PoolExhausted(f"{e} under --memory {self.name}, with nothing left to offload"
                                        f"{self._where()}") from None
                self._evict(victim)
        self._bind(k, t)
        if k in self.offloadable:
            self.cache.insert(k, t.nbytes)

    def _evict(self, k: str) -> None:
        """LRU.out for one tensor: copy to the host store, free the device copy."""
        t = self.tensors[k]
        self.host.save(k, t.array)
        self.bytes_offloaded += round_up(t.nbytes)
        self.cache.remove(k)
        self._unplace(k)
        self.host_keys.add(k)

    def _fetch(self, k: str) -> None:
        self._place(k)
        self.host.load(k, self.tensors[k].array)
        self.host_keys.discard(k)
        self.bytes_prefetched += round_up(self.tensors[k].nbytes)

    def _prefetch(self, k: str) -> None:
        if k in self.host_keys and self.net.pool.largest_free() >= round_up(self.tensors[k].nbytes):
            self._fetch(k)

    def _free(self, k: str) -> None:
        self.cache.remove(k)
        if k in self.host_keys:
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


def _root(t: Any) -> Any:
    while t.base is not None:
        t = t.base
    return t
