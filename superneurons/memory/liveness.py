"""Liveness analysis (paper section 3.2): which tensors each step touches, when each is first and last used.

`Program` is the device-free picture of one training iteration: every activation tensor of the
layout the Net builds its tensors from (`tensors.declare_tensors`, so the plan and the runtime talk
about the same objects), reduced to *root* tensors (views such as Split/Flatten tops follow their
base), and for every forward and backward step the roots it reads or writes. Parameters and their
gradients are not part of it: they stay resident or are streamed, and are reported separately.

`Liveness` turns the program into first/last use per root and from that into per-step action
lists (allocate before the first use, free after the last), which both `plan.py` (bytes per step)
and the runtime managers (real pool traffic) execute. Building it is the O(N^2) pass of the paper;
running it is O(actions) per step.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from superneurons.graph.build import Graph
from superneurons.graph.node import Node
from superneurons.layers.base import NEEDS_BOTTOM, NEEDS_TOP
from superneurons.memory.pool import round_up
from superneurons.memory.tensors import BUFFER, DATA, DIFF, TensorLayout, declare_tensors

ACTIVATION_KINDS = (DATA, DIFF, BUFFER)  # what the program plans; parameters are placed or streamed apart

FORWARD, BACKWARD = "forward", "backward"

# Actions of a schedule, executed in order before or after a step.
ALLOC = "alloc"        # give the tensor device memory
FREE = "free"          # give its device memory back (it is dead, or dropped for recomputation)
OFFLOAD = "offload"    # copy to the host pool, then free the device copy
PREFETCH = "prefetch"  # bring an offloaded tensor back to the device
RUN = "run"            # replay forward step `arg` (recomputation)


@dataclass
class TensorInfo:
    key: str
    shape: tuple[int, ...]
    nbytes: int  # pool bytes: rounded up to whole 1 KiB blocks, exactly what HeapPool reserves
    kind: str  # "data" | "diff" | "buffer"


@dataclass
class StepInfo:
    index: int  # global: forward steps 0..F-1, then backward steps
    phase: str
    node: Node
    forward_index: int  # the node's position in the route
    uses: tuple[str, ...]  # roots read or written by this step
    writes: tuple[str, ...] = ()  # forward only: roots whose contents this step (re)writes (tops, buffers)


@dataclass
class Schedule:
    """Per global step, the actions to run before and after it (and the frees carried to the next iteration)."""

    before: list[list[tuple[str, Any]]]
    after: list[list[tuple[str, Any]]]
    carry: list[str] = field(default_factory=list)  # freed when the next iteration starts (outputs)
    info: dict[str, Any] = field(default_factory=dict)


class Program:
    """The tensors and per-step uses of one iteration of `graph`.

    `plan_backward=True` plans a deploy net (no loss) as if its outputs fed one: every layer that can
    run backward does, and every bottom produced by such a layer gets a gradient. `layout`: the tensors
    as a Net declared them (`net.layout`, for the plan the Net's memory manager runs); by default they
    are declared here, with the same function (`tensors.declare_tensors`), with `history` solver history
    sets per learnable parameter (and, with `update_chunk`, the grouped solver update's tables).
    """

    def __init__(self, graph: Graph, train: bool = True, plan_backward: bool = False,
                 layout: TensorLayout | None = None, history: int = 0, update_chunk: int = 0):
        self.graph = graph
        self.need_backward, self.propagate_down = self._backward_flags(graph, plan_backward)
        # Gradients the loss seeds (Net.backward fills them before the first backward step); a deploy net
        # planned with backward seeds its outputs.
        self.seed_blobs = ([t for t, _w in graph.loss_blobs] or (list(graph.outputs) if plan_backward else [])
                           if train else [])
        if layout is None:
            layout = declare_tensors(graph, train=train, need_backward=self.need_backward,
                                     propagate_down=self.propagate_down, seeds=self.seed_blobs, history=history,
                                     update_chunk=update_chunk)
        self.layout = layout
        # Split / Eltwise SUM top gradients that are views of a bottom gradient (as the Net declares them).
        self.aliases = layout.aliases
        # Parameters and their gradients are not part of the program: they stay resident or are streamed.
        self.tensors: dict[str, TensorInfo] = {  # roots only
            t.key: TensorInfo(t.key, t.shape, round_up(t.nbytes), t.kind) for t in layout.roots(ACTIVATION_KINDS)}
        # every key (views included) -> its root key
        self.root: dict[str, str] = {t.key: layout.root(t.key) for t in layout.specs if t.kind in ACTIVATION_KINDS}
        self.data_key: dict[str, str] = layout.data_key  # blob name -> data tensor key
        self.diff_key: dict[str, str] = layout.diff_key  # blob name -> diff tensor key
        self.buffer_keys: dict[str, list[tuple[str, bool]]] = {  # node name -> [(key, for_backward)]
            node: [(key, for_backward) for key, _name, for_backward in bufs]
            for node, bufs in layout.buffer_keys.items()}
        self.backward_only: set[str] = layout.backward_only  # buffers no forward step uses
        # The net's float64 scratch region (tensors.py): the ops that sum, in any step and in the solver, share it,
        # so it is in the pool for the whole run and every step counts it.
        self.scratch: tuple[str, ...] = (layout.scratch,) if layout.scratch is not None else ()
        # A data-parallel net's half gradient run (tensors.py: `#reduce`): written after each backward step that
        # finishes a bucket and read until the update, so held for the whole run as the scratch region is.
        self.reduce: tuple[str, ...] = (layout.reduce,) if layout.reduce is not None else ()
        # The reserve the GPU ops' fallback copies come from in any step (tensors.py: `#copies`): resident and in
        # every step's uses, as the scratch region.
        self.copies: tuple[str, ...] = (layout.copies,) if layout.copies is not None else ()
        self.steps: list[StepInfo] = []
        self.seeds: list[str] = []
        self._build_steps(train, plan_backward)
        self.n_forward = len(graph.nodes)
        # Inputs written by data layers (or by the caller, for Input) live in the pool for the whole run.
        self.resident = {self.root[self.data_key[t]] for n in graph.nodes if n.layer.is_data for t in n.tops}
        self.resident.update(self.scratch + self.reduce + self.copies)
        # The grouped solver update's tables (tensors.py): used between iterations, by no step, so in no l_i, but
        # resident, so in every step's live bytes and every peak.
        self.update: tuple[str, ...] = (layout.update,) if layout.update is not None else ()
        self.resident.update(self.update)
        # What the caller reads after forward (losses, outputs) stays until the next iteration starts.
        out_blobs = list(graph.outputs) + [t for t, _w in graph.loss_blobs]
        self.pinned = {self.root[self.data_key[b]] for b in out_blobs if b in self.data_key} - self.resident
        self.writers: dict[str, list[int]] = {}  # root (data or buffer) -> forward steps that write it, in order
        for s in self.steps[:self.n_forward]:
            for k in s.writes:
                self.writers.setdefault(k, []).append(s.index)

    @staticmethod
    def _backward_flags(graph: Graph, plan_backward: bool):
        if not plan_backward:
            return ({n.name: n.need_backward for n in graph.nodes},
                    {n.name: list(n.propagate_down) for n in graph.nodes})
        needs: dict[str, bool] = {}
        need_bw, pdown = {}, {}
        for n in graph.nodes:
            layer = n.layer
            nb = layer.has_backward and not layer.is_data
            pdown[n.name] = [nb and j not in layer.label_bottoms and needs.get(b, False)
                             for j, b in enumerate(n.bottoms)]
            need_bw[n.name] = nb
            for t in n.tops:
                needs[t] = nb
        return need_bw, pdown

    # -- per-step uses ---------------------------------------------------------------------------
    def _build_steps(self, train: bool, plan_backward: bool) -> None:
        r, data, diff = self.root, self.data_key, self.diff_key
        nodes = self.graph.nodes
        for i, node in enumerate(nodes):
            uses = [r[data[b]] for b in node.bottoms] + [r[data[t]] for t in node.tops]
            buffers = tuple(k for k, _fb in self.buffer_keys[node.name] if k not in self.backward_only)
            uses += buffers
            uses += self.scratch + self.reduce + self.copies
            view = node.layer.views_bottom_data
            # A forward step (re)writes its tops and every buffer it keeps: a replay rebuilds them together.
            tops = () if view else tuple(r[data[t]] for t in node.tops)
            writes = tuple(dict.fromkeys(tops + buffers))
            self.steps.append(StepInfo(i, FORWARD, node, i, tuple(dict.fromkeys(uses)), writes))
        if not train:
            return
        self.seeds = [r[diff[b]] for b in self.seed_blobs if b in diff]
        first = True
        for i in reversed(range(len(nodes))):
            node = nodes[i]
            if not self.need_backward[node.name]:
                continue
            needs = self.graph.step_layer(node).backward_needs()
            uses = list(self.seeds) if first else []
            first = False
            if NEEDS_BOTTOM in needs:
                uses += [r[data[b]] for b in node.bottoms]
            if NEEDS_TOP in needs:
                uses += [r[data[t]] for t in node.tops]
            uses += [k for k, fb in self.buffer_keys[node.name] if fb]
            uses += [r[diff[t]] for t in self.graph.top_gradient_blobs(node) if t in diff]
            written = self.graph.bottom_gradients_written(node, self.propagate_down[node.name])
            uses += [r[diff[b]] for b, w in zip(node.bottoms, written) if w and b in diff]
            uses += self.scratch + self.reduce + self.copies
            self.steps.append(StepInfo(len(self.steps), BACKWARD, node, i, tuple(dict.fromkeys(uses))))

    # -- helpers -------------------------------------------------------------------------------------
    def step_bytes(self, s: int) -> int:
        """l_i: the bytes step `s` needs on the device at once."""
        return sum(self.tensors[k].nbytes for k in self.steps[s].uses)

    def backward_step_of(self) -> dict[int, int]:
        """forward index -> global index of that layer's backward step."""
        return {s.forward_index: s.index for s in self.steps[self.n_forward:]}

    @functools.cached_property
    def sizes(self) -> dict[str, int]:
        """Root key -> pool bytes (every simulation of a schedule reads them)."""
        return {k: t.nbytes for k, t in self.tensors.items()}

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class Liveness:
    """First and last use of every root tensor, and the allocate/free schedule that follows from them."""

    def __init__(self, program: Program):
        self.program = program
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.forward_last: dict[str, int] = {}  # last use among forward steps
        self.backward_first: dict[str, int] = {}
        self.backward_last: dict[str, int] = {}
        nf = program.n_forward
        for s in program.steps:
            for k in s.uses:
                self.first.setdefault(k, s.index)
                self.last[k] = s.index
                if s.index < nf:
                    self.forward_last[k] = s.index
                else:
                    self.backward_first.setdefault(k, s.index)
                    self.backward_last[k] = s.index

    def schedule(self, last: dict[str, int] | None = None) -> Schedule:
        """Allocate before first use, free after `last` use (default: the real last use)."""
        p = self.program
        n = len(p.steps)
        last = self.last if last is None else last
        before: list[list] = [[] for _ in range(n)]
        after: list[list] = [[] for _ in range(n)]
        carry = []
        for k, f in self.first.items():
            if k in p.resident:
                continue  # allocated at setup, never freed
            before[f].append((ALLOC, k))
            if k in p.pinned:
                carry.append(k)
            else:
                after[last[k]].append((FREE, k))
        return Schedule(before, after, carry)


def seeds_first(program: Program, sched: Schedule) -> None:
    """Put the loss gradients first among the first backward step's actions: `Net.backward` seeds them
    (`seed_loss_diffs`) before any hook of that step runs, so they are on the device while the step's
    prefetches and replays run, and a schedule must say so for its bytes to be the pool's."""
    if len(program.steps) <= program.n_forward or not program.seeds:
        return
    acts = sched.before[program.n_forward]
    seeds = set(program.seeds)
    first = [a for a in acts if a[0] == ALLOC and a[1] in seeds]
    sched.before[program.n_forward] = first + [a for a in acts if a not in first]


@dataclass
class Trace:
    """Device bytes and live-tensor count per step, as a schedule leaves them."""

    bytes: list[int]  # peak during the step (transient replay tensors included)
    count: list[int]  # live roots while the step computes
    replay: list[int] = field(default_factory=list)  # peak of the step's replays, each with `run_extra` of its layer


def simulate(program: Program, schedule: Schedule, run_extra: list[int] | None = None) -> Trace:
    """Run a schedule on paper: the bytes a pool executing it would hold at every step. `run_extra`: bytes
    a replay of forward step w needs beside the activations (its streamed parameters), per w."""
    sizes = program.sizes
    live = set(program.resident)
    cur = sum(sizes[k] for k in live)
    out_b, out_c, out_r = [], [], []
    for s in range(len(program.steps)):
        peak = cur
        replay = 0
        for op, arg in schedule.before[s]:
            if op in (ALLOC, PREFETCH):
                if arg not in live:
                    live.add(arg)
                    cur += sizes[arg]
                    peak = max(peak, cur)
            elif op in (FREE, OFFLOAD) and arg in live:
                live.discard(arg)
                cur -= sizes[arg]
            elif op == RUN and run_extra is not None:
                replay = max(replay, cur + run_extra[arg])
        out_b.append(max(peak, cur))
        out_c.append(len(live))
        out_r.append(replay)
        for op, arg in schedule.after[s]:
            if op in (FREE, OFFLOAD) and arg in live:
                live.discard(arg)
                cur -= sizes[arg]
    return Trace(out_b, out_c, out_r)


class OverLimit:
    """Which steps of a trace exceed a byte limit, asked of a range of steps in O(1) (a prefix count of the
    steps over it): the planners ask it for every tensor's span, and scanning each span made planning a
    long unrolled recurrent net quadratic in its steps."""

    def __init__(self, trace: list[int], limit: int):
        self._before = list(itertools.accumulate((b > limit for b in trace), initial=0))

    def within(self, start: int, stop: int) -> bool:
        """Whether a step of range(start, stop) exceeds the limit."""
        return stop > start and self._before[stop] > self._before[start]
