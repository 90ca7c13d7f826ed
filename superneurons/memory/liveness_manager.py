"""The liveness manager (paper section 3.2): executes the plan's alloc/free actions on the Net's pool.

The schedule comes from the same code `superneurons memory` prints (`plan.make_plan`), so the bytes the
pool holds at every step are exactly the plan's. Everything is resolved at setup into per-step lists of
(bound method, argument); a hook call then does O(actions) work. This class is also the base of the
offload and recompute managers (`offload_manager.py`, `recompute_manager.py`): it places the
parameters (resident, or streamed through `params.py`), checks the floor, and runs the actions.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from superneurons.errors import PoolExhausted, UserError
from superneurons.memory.interface import MemoryManager, NetServices
from superneurons.memory.liveness import ALLOC, FREE, OFFLOAD, PREFETCH, RUN
from superneurons.memory.offload import DEFAULT_CHECKPOINTS
from superneurons.memory.params import OffloadedParams, ResidentParams
from superneurons.memory.plan import make_plan
from superneurons.memory.pool import format_bytes, round_up
from superneurons.memory.tensors import PARAM_KINDS  # parameters, their gradients, history: placed or streamed

if TYPE_CHECKING:
    from superneurons.memory.steps import Step, Tensor

# A compiled schedule action: the bound method that does it, and its argument (a tensor key; RUN's replay index).
Action = tuple[Callable[[Any], object], Any]


class LivenessManager(MemoryManager):
    name = "liveness"
    param_store: OffloadedParams | ResidentParams  # `setup` picks it; these managers always have one

    def __init__(self, net: NetServices, checkpoint_types: Iterable[str] = DEFAULT_CHECKPOINTS,
                 recompute_limit: int = 0):
        super().__init__(net, checkpoint_types, recompute_limit)
        self.trace: list[int] = []  # peak activation bytes in the pool per global step (this iteration)
        self.on: set[str] = set()  # roots with device memory now
        self.allocs = 0  # tensors given device memory / freed by the schedule (cumulative; `superneurons time`)
        self.frees = 0
        self.compactions = 0  # times the pool was compacted because free bytes were in pieces (cumulative)

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        net = self.net
        self.in_setup = True
        # Planned on the layout the Net built its tensors from: the plan's keys are the Net's tensors.
        self.plan = make_plan(net.graph, train=net.train, modes=(self.name,), plan_backward=False,
                              checkpoint_types=self.checkpoint_types, layout=net.layout,
                              recompute_limit=self.recompute_limit)
        self.program = self.plan.program
        schedule = self.plan.schedules[self.name]
        self.tensors = {t.key: t for t in net.tensors}
        self.views: dict[str, list[Any]] = {}
        for t in net.tensors:
            if t.base is not None:
                r = t
                while r.base is not None:
                    r = r.base
                self.views.setdefault(r.key, []).append(t)
        self.buffer_decl = {key: net.graph.step_layer(n).buffers[name] for n in net.graph.nodes
                            for key, name, _for_backward in net.layout.buffer_keys[n.name]}
        self.nf = self.program.n_forward
        params = [t for t in net.tensors if t.base is None and t.kind in PARAM_KINDS]
        all_params = sum(round_up(t.nbytes) for t in params)
        self.param_store = self._param_store(params)
        self._check_floor(all_params)
        self._check_plan(all_params)
        # Resident: parameters, their gradients and history (unless streamed), and the inputs data
        # layers (or the caller) write.
        if not self.param_store.offloaded:
            for t in params:
                self._place(t.key)
        self.param_bytes = net.pool.used_bytes
        for k in sorted(self.program.resident):
            self._place(k)
        for t in net.tensors:  # parameter views (none today) follow their base
            if t.base is not None and t.array is None and root_of(t).array is not None:
                net.materialize(t)
        self._compile(schedule)
        self.in_setup = False

    def _param_store(self, params: list) -> OffloadedParams | ResidentParams:
        """Stream the parameters through the pool when the pool cannot hold them all beside this mode's
        planned peak; keep them resident otherwise (`MemoryPlan.need` decides the same way). The policy's
        param_offload true / false forces either."""
        net = self.net
        setting = net.policy.param_offload
        stream = (self.plan.resident_need(self.name) > net.pool.capacity) if setting is None else setting
        if net.train and params and stream:
            return OffloadedParams(net, params)
        return ResidentParams(net)

    def _param_window(self) -> list[int]:
        """Per global step, the parameter bytes streamed in for it (zeros while parameters are resident)."""
        n = len(self.program.steps)
        if not self.param_store.offloaded:
            return [0] * n
        fwd, bwd = self.param_store.step_lists(self.net.graph, self.net.train)
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

    def _check_plan(self, all_params: int) -> None:
        """A plan is a promise: refuse here, before any step runs, a pool smaller than what this mode's plan
        needs (`MemoryPlan.need`: its peak beside the resident parameters, or with them streamed each step's
        activations plus its parameters, and between iterations the update of the largest parameter with its
        solver history), rather than run out of memory in the middle of an iteration."""
        trace = self.plan.traces[self.name].bytes
        if not trace:
            return
        need, streamed = self.plan.need(self.name, stream=self.param_store.offloaded)
        if need <= self.net.pool.capacity:
            return
        if streamed:
            steps = self.plan.streamed_steps(self.name)
            s = max(range(len(trace)), key=lambda i: steps[i])
            if steps[s] < need:  # the update between iterations needs more than any step
                raise UserError(
                    f"a {self.net.pool.capacity}-byte pool ({format_bytes(self.net.pool.capacity)}) cannot train "
                    f"this net under --memory {self.name}: with the parameters streamed, the update between "
                    f"iterations holds one parameter with its gradient and solver history "
                    f"({self.plan.update_bytes} bytes) beside the {self.plan.between_bytes(self.name)} bytes of "
                    f"inputs and outputs kept = {need} bytes ({format_bytes(need)}); give a larger "
                    f"pool/--gpu-memory")
            params = f"{steps[s] - trace[s]} bytes of streamed parameters (its own or a replay's)"
        else:
            s = max(range(len(trace)), key=lambda i: trace[i])
            params = f"{all_params} bytes of parameters"
        st = self.program.steps[s]
        raise UserError(
            f"a {self.net.pool.capacity}-byte pool ({format_bytes(self.net.pool.capacity)}) cannot train this net "
            f"under --memory {self.name}: its plan peaks at {st.phase} step {s + 1} (layer {st.node.name!r}) with "
            f"{trace[s]} bytes of activations plus {params} = {need} bytes ({format_bytes(need)}); give a larger "
            f"pool/--gpu-memory or a leaner --memory mode")

    def _compile(self, schedule) -> None:
        do: dict[str, Callable[[Any], object]] = {ALLOC: self._alloc, FREE: self._free, OFFLOAD: self._offload, PREFETCH: self._prefetch,
              RUN: self._run}
        self.before: list[list[Action]] = [[(do[op], arg) for op, arg in acts] for acts in schedule.before]
        self.after: list[list[Action]] = [[(do[op], arg) for op, arg in acts] for acts in schedule.after]

    # -- the hooks -----------------------------------------------------------------------------
    def before_forward(self, i: int, step: Step) -> None:
        if i == 0:
            self._start_iteration()
        self._enter(i)

    def after_forward(self, i: int, step: Step) -> None:
        self._leave(i)

    def before_backward(self, i: int, step: Step) -> None:
        self._enter(self.nf + i)

    def after_backward(self, i: int, step: Step) -> None:
        self._leave(self.nf + i)

    def ensure(self, tensor: Tensor) -> None:
        """Give `tensor` device memory now (the loss gradient Net.backward seeds)."""
        k = root_of(tensor).key
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

    def _run_actions(self, actions: list[Action]) -> int:
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
        while True:
            try:
                net.materialize(t)
                break
            except PoolExhausted as e:
                if not (self._make_param_room() or self._defragment(t.nbytes)):
                    raise PoolExhausted(f"{e} under --memory {self.name}{self._where()}") from None
        self._bind(k, t)

    def _defragment(self, nbytes: int) -> bool:
        """The pool has the bytes but not in one piece: compact it (once per failed allocation: a second
        failure of the same request finds nothing moved and gives up)."""
        pool = self.net.pool
        if pool.free_bytes() < round_up(nbytes) or pool.largest_free() >= round_up(nbytes):
            return False
        self._quiesce()
        self.compactions += 1
        return self.net.compact_pool()

    def _quiesce(self) -> None:
        """Finish every copy in flight: a copy reads or writes a pool block, which compaction moves."""
        store = self.param_store
        if store is not None and store.offloaded:
            for event in list(store.incoming.values()):
                event.synchronize()
            store.settle()

    def _make_param_room(self) -> bool:
        """Streamed parameters may hold blocks for copies in flight or prefetched ahead: reclaim them."""
        store = self.param_store
        return store is not None and store.make_room()

    def _bind(self, k: str, t: Any) -> None:
        for v in self.views.get(k, ()):
            self.net.materialize(v)
        buf = self.buffer_decl.get(k)
        if buf is not None:
            buf.array = t.array
        self.on.add(k)

    def _unplace(self, k: str) -> None:
        self._unbind(k)
        self.net.release(self.tensors[k])

    def _unbind(self, k: str) -> None:
        """Detach root `k` and its views from their arrays; the pool block itself is the caller's."""
        self.tensors[k].array = None
        for v in self.views.get(k, ()):
            v.array = None
        buf = self.buffer_decl.get(k)
        if buf is not None:
            buf.array = None
        self.on.discard(k)

    def alloc_block(self, key: str, nbytes: int, high: bool = False) -> None:
        """A pool block for a streamed parameter tensor (`high`: from the top of the pool)."""
        while True:
            try:
                self.net.pool.alloc(key, nbytes, high=high)
                return
            except PoolExhausted as e:
                if not (self._make_param_room() or self._defragment(nbytes)):
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
            if self.param_store is not None and self.param_store.offloaded:
                plan_peak, how = max(self.plan.streamed_steps(self.name)), "with the parameters streamed"
            else:
                params = getattr(self, "param_bytes", None)  # unset while setup still places the parameters
                if params is None:
                    params = sum(round_up(t.nbytes) for t in self.net.tensors
                                 if t.base is None and t.kind in PARAM_KINDS)
                plan_peak, how = max(self.plan.traces[self.name].bytes) + params, "with parameters"
            return (f", at {st.phase} step {s + 1} (layer {st.node.name!r}); this mode's plan needs "
                    f"{plan_peak} bytes ({format_bytes(plan_peak)}) {how}, the pool has "
                    f"{self.net.pool.capacity}: give a larger pool/--gpu-memory or a leaner --memory mode")
        return ""


def root_of(t: Any) -> Any:
    while t.base is not None:
        t = t.base
    return t
