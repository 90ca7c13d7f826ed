"""The static memory plan: per-step live bytes under each mode, l_i, max(l_i), peak_m (no device needed).

Modes are cumulative, as in the paper's Fig. 10: liveness; liveness + offload; liveness + offload +
recomputation. Bytes are pool bytes (whole 1 KiB blocks), so the runtime's measured trace under a
mode equals the plan's exactly. Parameters, their gradients and solver history are `param_bytes`,
reported beside the activations and not mixed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, cast

from superneurons.dtypes import tensor_bytes
from superneurons.errors import UserError
from superneurons.graph.build import Graph
from superneurons.memory.liveness import (ALLOC, FREE, OFFLOAD, PREFETCH, RUN, Liveness, Program, Schedule, Trace,
                                         seeds_first, simulate)
from superneurons.memory.offload import (DEFAULT_CHECKPOINTS, apply_offload, backward_reads, checkpoint_tensors,
                                        host_store_limit, plan_offload)
from superneurons.memory.params import layers_computed_by
from superneurons.memory.pool import format_bytes, round_up
from superneurons.memory.recompute import RecomputePlanner
from superneurons.memory.tensors import PARAM_KINDS, TensorLayout

PLAN_MODES = ("baseline", "liveness", "offload", "recompute")  # cheapest (in time) first


@dataclass
class MemoryPlan:
    program: Program
    liveness: Liveness
    schedules: dict[str, Schedule]
    traces: dict[str, Trace]
    layer_bytes: list[int]  # l_i per global step
    param_bytes: int  # params + their gradients (+ solver history when given), resident
    checkpoint_types: tuple[str, ...]
    extra: dict[str, Any] = field(default_factory=dict)
    # When the parameters are streamed from the host instead (memory/params.py): the bytes each step
    # brings in (its layer's weights; in backward also their gradients), and the update's need (one
    # parameter's data, gradient and history at a time).
    param_window: list[int] = field(default_factory=list)
    update_bytes: int = 0
    # Per mode and global step, the most a replay of that step needs with its own layer's parameters
    # streamed in (a recomputation brings in the weights of the forward step it replays).
    replay_peaks: dict[str, list[int]] = field(default_factory=dict)
    recompute_limit: int = 0  # what make_plan was given (0: recompute plans down to max(l_i))
    forward_window: int = 0  # the most one forward step streams in (a test net's step reads the train net's weights)
    streamable: bool = False  # a training plan with parameters: a run may stream them (memory/params.py)

    @property
    def max_layer(self) -> tuple[int, int]:
        """(global step, bytes) of max(l_i)."""
        s = max(range(len(self.layer_bytes)), key=lambda i: self.layer_bytes[i])
        return s, self.layer_bytes[s]

    def peak(self, mode: str) -> tuple[int, int]:
        """(bytes, global step) of peak_m under `mode`."""
        b = self.traces[mode].bytes
        s = max(range(len(b)), key=lambda i: b[i])
        return b[s], s

    def streamed_peak(self, mode: str) -> int:
        """peak_m with the parameters streamed: every step's activations plus its own parameters, or, between
        iterations, what stays plus the update of the largest parameter (or a test net's step, which streams
        the train net's weights into its pool)."""
        between = max(self.update_bytes, self.forward_window) + self.between_bytes(mode)
        return max(max(self.streamed_steps(mode), default=0), between)

    def between_bytes(self, mode: str) -> int:
        """What stays on the device between iterations: the inputs, which the caller writes next, and the
        outputs and losses, which it reads (every other tensor is freed after its last step)."""
        p = self.program
        return sum(p.tensors[k].nbytes for k in p.resident | p.pinned) if self.traces[mode].bytes else 0

    def streamed_steps(self, mode: str) -> list[int]:
        """Per global step, the bytes `mode` needs with the parameters streamed: the step's activations
        plus its own parameters, or a replay it runs with the replayed layer's parameters, if more."""
        b = self.traces[mode].bytes
        window = self.param_window or [0] * len(b)
        replays = self.replay_peaks.get(mode) or [0] * len(b)
        return [max(x + w, r) for x, w, r in zip(b, window, replays)]

    def resident_need(self, mode: str) -> int:
        """The pool `mode` needs with the parameters resident: its peak beside all of them."""
        return self.peak(mode)[0] + self.param_bytes

    def need(self, mode: str, stream: bool | None = None) -> tuple[int, bool]:
        """(the smallest pool `mode` trains in, whether the parameters are then streamed): resident when
        that fits, else streamed (the memory managers decide the same way, memory/liveness_manager.py);
        `stream` True / False forces either (the policy's param_offload). Baseline never streams. Every
        byte the run takes from the pool is in it, so a run below it is refused at setup and a run at it
        never fails midway."""
        resident = self.resident_need(mode)
        if mode == "baseline" or not self.streamable or stream is False:
            return resident, False
        streamed = self.streamed_peak(mode)
        if stream is True:
            return streamed, True
        return (resident, False) if resident <= streamed else (streamed, True)

    def fits(self, mode: str, budget: int) -> bool:
        """Whether `mode`'s peak fits `budget` bytes beside the resident parameters."""
        return self.resident_need(mode) <= budget

    def fits_streamed(self, mode: str, budget: int) -> bool:
        """Whether `mode` fits `budget` with the parameters streamed (baseline holds everything: never)."""
        return mode != "baseline" and self.streamable and self.streamed_peak(mode) <= budget

    def host_bytes(self, mode: str, streams_params: bool = False) -> int:
        """Pinned host memory `mode` may take, an upper bound: the host store pins as tensors leave the device,
        at most every tensor the Tensor Cache may evict (`host_store_limit`, what OffloadManager gives it),
        and streamed parameters, gradients and history live on the host."""
        keys = self.schedules[mode].info.get("offloadable", ()) if mode in ("offload", "recompute") else ()
        store = host_store_limit(self.program.tensors[k].nbytes for k in keys)
        return store + (self.param_bytes if streams_params else 0)


def no_fit_error(plans: list[MemoryPlan], budget: int) -> UserError:
    """What `auto` says when not even a recompute plan fits `budget`: per checkpoint set, the pool
    `--memory recompute` needs with it (`MemoryPlan.need`, the number its own refusal quotes), and max(l_i)."""
    plan = min(plans, key=lambda p: p.need("recompute")[0])
    s, largest = plan.max_layer
    step = plan.program.steps[s]

    sets: dict[tuple[int, bool], list[str]] = {}  # the need -> the checkpoint sets with it
    for p in plans:
        sets.setdefault(p.need("recompute"), []).append(",".join(p.checkpoint_types))
    needs = "; or ".join(
        f"{need} bytes ({format_bytes(need)}) with the parameters {'streamed from the host' if streamed else 'resident'}"
        f" (checkpoints {' or '.join(names)})" for (need, streamed), names in sets.items())
    return UserError(
        f"{plan.program.graph.name or 'net'}: {format_bytes(budget)} ({budget} bytes) cannot hold even the "
        f"recompute plan: --memory recompute needs {needs}; the largest layer, "
        f"{step.node.name!r} ({step.phase}), needs {largest} bytes ({format_bytes(largest)}) on its own")


def param_bytes(graph: Graph, train: bool = True, history: int = 0) -> int:
    """Owned parameters, their gradients when training, and `history` solver blobs per parameter."""
    seen: dict[str, int] = {}
    total = 0
    for n in graph.nodes:
        specs = n.layer.param.param
        for k, decl in enumerate(n.layer.params):
            name = specs[k].name if k < len(specs) and specs[k].name else ""
            if name and name in seen:
                continue
            if name:
                seen[name] = 1
            one = round_up(tensor_bytes(decl.shape, graph.precision.master))
            total += one * (1 + (1 if train else 0) + (history if decl.learnable else 0))
    return total


def layout_param_bytes(layout: TensorLayout) -> tuple[int, int]:
    """(pool bytes of every parameter tensor `layout` declares -- values, gradients, solver history --, the
    most one parameter's update holds at once with the parameters streamed: its value, gradient and history).
    A Net's layout carries its solver's history sets, so the plan counts what the run allocates."""
    size = {s.key: round_up(s.nbytes) for s in layout.roots(PARAM_KINDS)}
    # Learnable parameters own their value and gradient tensors.
    update = max((size[cast(str, p.data)] + size[cast(str, p.diff)] + sum(size[h[i]] for h in layout.history)
                  for i, p in enumerate(layout.learnable())), default=0)
    return sum(size.values()), update


def _param_steps(program: Program, train: bool) -> tuple[list[int], list[int]]:
    """(bytes of parameters each global step streams in, the same for each forward step by route index (what
    a replay brings in))."""
    def size(decl) -> int:
        return round_up(tensor_bytes(decl.shape, program.graph.precision.master))

    def node_bytes(layers, grads: bool) -> int:
        owned = {}
        for layer in layers:
            specs = layer.param.param
            for k, decl in enumerate(layer.params):
                name = specs[k].name if k < len(specs) and specs[k].name else f"{layer.name}#{k}"
                # Training declares a gradient for every parameter (tensors.declare_tensors), BatchNorm's
                # statistics too, and backward brings each in with its parameter.
                owned[name] = size(decl) * (2 if grads else 1)
        return sum(owned.values())

    computed_by = layers_computed_by(program.graph)
    forward = [node_bytes(layers, False) for layers in computed_by]
    window = [forward[st.forward_index] if st.phase == "forward" else
              node_bytes(computed_by[st.forward_index], train) for st in program.steps]
    return window, forward


def make_plan(graph: Graph, *, train: bool = True, checkpoint_types: Iterable[str] = DEFAULT_CHECKPOINTS,
              modes: Iterable[str] = PLAN_MODES, solver_history: int = 0,
              plan_backward: bool | None = None, layout: TensorLayout | None = None,
              recompute_limit: int = 0, update_chunk: int = 0, program: Program | None = None) -> MemoryPlan:
    """Plan `graph` under each of `modes`. A net with no loss is planned as if its outputs fed one
    (unless `plan_backward=False`: the runtime plans exactly the steps its Net will run, and passes the
    `layout` its tensors were built from). `recompute_limit`: the bytes a recompute step may hold before
    a segment is replayed step by step instead of once (memory-centric); below max(l_i) (0, the default)
    recompute plans down to max(l_i), the paper's floor. `update_chunk`: plan the grouped solver update's
    tables for blocks of that many elements (as a Net built with it declares them; ignored when `layout` is given).
    `program`: the Program of an earlier plan of the same graph with the same arguments, to plan on again
    (planners only read it; `auto` plans a net once per checkpoint set and replay limit, and building the
    Program is a third of planning a long unrolled net)."""
    if plan_backward is None:
        plan_backward = train and not graph.loss_blobs
    if program is None:
        program = Program(graph, train=train, plan_backward=plan_backward, layout=layout, history=solver_history,
                          update_chunk=update_chunk)
    live = Liveness(program)
    types = tuple(checkpoint_types)
    n = len(program.steps)
    layer_bytes = [program.step_bytes(s) for s in range(n)]
    l_peak = max(layer_bytes) if layer_bytes else 0
    schedules: dict[str, Schedule] = {}
    for mode in modes:
        if mode == "baseline":
            sched = Schedule([[] for _ in range(n)], [[] for _ in range(n)])
            if n:
                sched.before[0] = [(ALLOC, k) for k in program.tensors if k not in program.resident]
        elif mode == "liveness":
            sched = live.schedule()
        elif mode == "offload":
            sched = live.schedule()
            moves = plan_offload(program, live, types)
            apply_offload(sched, moves)
            sched.info["offloaded"] = moves
            sched.info["offloadable"] = sorted(backward_reads(program, live, checkpoint_tensors(program, types)))
        elif mode == "recompute":
            sched = RecomputePlanner(program, live, types, max(l_peak, recompute_limit)).plan()
        else:
            raise UserError(f"memory mode {mode!r} has no plan; choose from {', '.join(PLAN_MODES)}")
        seeds_first(program, sched)
        schedules[mode] = sched
    window, forward_window = _param_steps(program, train)
    traces = {m: simulate(program, s, forward_window) for m, s in schedules.items()}
    params, update = layout_param_bytes(program.layout)
    return MemoryPlan(program, live, schedules, traces, layer_bytes, params, types, param_window=window,
                      update_bytes=update, replay_peaks={m: t.replay for m, t in traces.items()},
                      recompute_limit=recompute_limit, forward_window=max(forward_window, default=0),
                      streamable=train and params > 0)


def offloaded_bytes(plan: MemoryPlan, mode: str) -> int:
    moves = plan.schedules[mode].info.get("offloaded", {})
    return sum(plan.program.tensors[k].nbytes for k in moves)


def to_json(plan: MemoryPlan, batch: int | None) -> dict[str, Any]:
    """The `superneurons memory --json` document (docs/MEMORY.md describes its keys); the command adds what auto picks for
    a budget (`commands.memory.auto_doc`), since that weighs other checkpoint sets than this plan's."""
    p = plan.program
    s_max, b_max = plan.max_layer
    modes: dict[str, Any] = {}
    for mode, trace in plan.traces.items():
        peak, step = plan.peak(mode)
        need, streamed = plan.need(mode)
        entry: dict[str, Any] = {"peak_bytes": peak, "peak_step": step + 1, "live_tensors_at_peak": trace.count[step],
                                 "pool_bytes": need, "pool_streams_params": streamed}
        if mode in ("offload", "recompute"):
            entry["offloaded_bytes"] = offloaded_bytes(plan, mode)
        if mode == "recompute":
            info = plan.schedules[mode].info
            entry["extra_forward_steps"] = info.get("extra_forward_steps", 0)
            entry["dropped_tensors"] = len(info.get("dropped", []))
            entry["segments"] = dict(info.get("strategies", {}))
        modes[mode] = entry
    doc: dict[str, Any] = {
        "net": p.graph.name, "batch": batch, "budget_bytes": None, "precision": p.graph.precision.name(),
        "param_bytes": plan.param_bytes,
        "scratch_bytes": scratch_bytes(plan),
        "update_table_bytes": sum(p.tensors[k].nbytes for k in p.update),
        "streamed_param_peaks": {m: plan.streamed_peak(m) for m in plan.traces if m != "baseline"},
        "checkpoint_types": list(plan.checkpoint_types),
        "max_layer": {"name": p.steps[s_max].node.name, "phase": p.steps[s_max].phase, "bytes": b_max},
        "modes": modes,
        "steps": [
            {"step": s.index + 1, "layer": s.node.name, "phase": s.phase, "l_bytes": plan.layer_bytes[s.index],
             "live_bytes": {m: t.bytes[s.index] for m, t in plan.traces.items()},
             "live_tensors": {m: t.count[s.index] for m, t in plan.traces.items()}}
            for s in p.steps
        ],
    }
    return doc


def scratch_bytes(plan: MemoryPlan) -> int:
    """Pool bytes of the net's float64 scratch region (memory/tensors.py: `#scratch`): resident, so in every step's
    live bytes and every l_i."""
    return sum(plan.program.tensors[k].nbytes for k in plan.program.scratch)


def live_at(plan: MemoryPlan, mode: str, step: int) -> list[str]:
    """The roots on the device while `step` computes under `mode` (the set `simulate` counts)."""
    sched = plan.schedules[mode]
    live = set(plan.program.resident)
    for s in range(step + 1):
        for op, arg in sched.before[s]:
            if op in (ALLOC, PREFETCH):
                live.add(arg)
            elif op in (FREE, OFFLOAD):
                live.discard(arg)
        if s == step:
            break
        for op, arg in sched.after[s]:
            if op in (FREE, OFFLOAD):
                live.discard(arg)
    return sorted(live, key=lambda k: (-plan.program.tensors[k].nbytes, k))


def replay_count(schedule: Schedule) -> int:
    return sum(1 for acts in schedule.before for op, _ in acts if op == RUN)


def prefetch_count(schedule: Schedule) -> int:
    return sum(1 for acts in schedule.before for op, _ in acts if op == PREFETCH)
