"""Cost-aware recomputation (paper section 3.4): drop cheap forward outputs, replay them in backward.

Checkpoint outputs (CONV and data layers by default) are kept (and offloaded, as in `offload`);
every other forward output is *droppable*: freed after its last forward use, and rebuilt before
the first backward step that needs it by replaying the forward steps that wrote it.

A *segment* is the run of layers from one checkpoint to the next. Per segment:
- speed-centric: the first time backward needs a tensor of the segment, replay the segment once
  and keep every rebuilt tensor until its last backward use (O(N) extra forward steps);
- memory-centric: for each backward step, replay only what that step needs and free it right
  after (O(N^2) extra steps, but never more than that step's own l_i in flight).
The cost-aware choice starts from speed-centric everywhere and switches a segment to
memory-centric when any step within the span it keeps tensors over exceeds the plan's *limit*: the
paper's l_peak = max(l_i) by default, which recomputes down to the floor; `auto` passes what its budget
leaves for activations when that is more, so that it replays no more than the budget needs.

Joins hold gradients too: at a Split or Concat, backward finishes one branch while the gradient the
other branch will need waits on the device (a DenseNet block's running concat, an Inception stem's
pooling branch). Where such a wait spans a step over the limit, the waiting gradient leaves the device
between its two uses like a checkpoint (`_park_waiting_gradients`), and the Tensor Cache keeps it
when memory suffices.

Replays are exact because they re-run the same writers in the same order on the same inputs:
a dropped tensor is rebuilt by *all* its writers (producer, then in-place layers), and a tensor
only qualifies when every reader saw its final value, every input its writers read already had its
final value then (nothing rewrites it in place later), and everything its writers read is either
droppable too or kept alive past the last step that may have to rebuild it.
"""
from __future__ import annotations

import bisect
from typing import Iterable

from superneurons.memory.liveness import (ALLOC, FREE, RUN, Liveness, OverLimit, Program, Schedule, StepInfo,
                                         seeds_first, simulate)
from superneurons.memory.offload import (apply_offload, backward_reads, checkpoint_steps, checkpoint_tensors,
                                        delay_prefetches, first_needed, plan_offload)

SPEED, MEMORY = "speed", "memory"


def droppable(program: Program, live: Liveness, kept: set[str]) -> set[str]:
    """Forward outputs that can be freed after forward and rebuilt exactly by replay.

    A candidate is replayable when every forward step that writes it can be replayed exactly in backward
    (`_replay_until`) until the last step that may have to rebuild it (`_needed_until`). Dropping one
    candidate makes every step that reads or writes it unreplayable, which may disqualify others: the
    candidates are checked in key order, pass after pass, until a pass drops none. The per-step verdicts
    are kept across passes and only the steps touching a disqualified candidate change, so a pass costs
    O(candidates), not O(candidates x their writers' uses): a Slice of T time steps has T tops and T + 1
    uses, and rescanning its uses per top made planning an unrolled recurrent net take minutes."""
    steps = program.steps
    nf = program.n_forward
    cand = {k for k, ws in program.writers.items() if k not in kept and k in live.first}
    # The forward steps that read each candidate without writing it, and every forward step using it.
    readers: dict[str, list[int]] = {}
    users: dict[str, list[int]] = {}
    for st in steps[:nf]:
        for k in st.uses:
            if k in cand:
                users.setdefault(k, []).append(st.index)
                if k not in st.writes:
                    readers.setdefault(k, []).append(st.index)
    until = {w: _replay_until(program, live, steps[w], cand, kept) for w in {w for x in cand for w in program.writers[x]}}
    fixed = set()  # candidates that can never be replayed, whatever else is dropped
    for x in cand:
        writers = program.writers[x]
        # A data layer's output cannot be replayed; a reader that saw an intermediate (pre in-place) value
        # cannot be reproduced by a replay of all the writers.
        if any(steps[w].node.layer.is_data for w in writers) or any(r < writers[-1] for r in readers.get(x, ())):
            fixed.add(x)
    changed = True
    while changed:
        changed = False
        need = _needed_until(program, live, cand)
        for x in sorted(cand):
            if x in fixed or min(until[w] for w in program.writers[x]) < need[x]:
                cand.discard(x)
                changed = True
                for w in users.get(x, ()):
                    # Its replay would now read (or have to rebuild) a tensor that is neither dropped nor kept.
                    until[w] = -1
    return cand


def _replay_until(program: Program, live: Liveness, step: StepInfo, cand: set[str], kept: set[str]) -> int:
    """The last step at which forward `step` can still be replayed exactly, every droppable candidate being
    dropped: the last use of the kept tensors it reads (-1: never)."""
    until = len(program.steps)
    writes = set(step.writes)
    for y in step.uses:
        written = y in writes
        if not written and program.writers.get(y, [step.index])[-1] > step.index:
            # A later layer rewrites the input in place (a TanH on a Flatten view of it): a replay in
            # backward would read that value, not the one this step read.
            return -1
        if written:
            if y not in cand:
                return -1  # a writer's tops are rebuilt together or not at all
        elif program.tensors[y].kind != "diff" and y not in cand:
            if y not in kept:
                return -1  # nothing brings the replay's input back
            until = min(until, live.last.get(y, -1))  # the replay's input is gone after its last use
    return until


def _needed_until(program: Program, live: Liveness, cand: set[str]) -> dict[str, int]:
    """The last step at which each candidate may have to be rebuilt: its own last use, or the last use of a
    candidate whose replay reads it (softmax(pool(conv)): rebuilding the softmax for its backward replays
    the pooling too, so the convolution's output must still be there then, not only at the pooling's last
    use). Likewise through in-place writers: rebuilding a Scale's input copy replays the BatchNorm before it.
    Propagated step by step, the later steps first (dependents before their inputs), until nothing rises."""
    steps = program.steps
    need = {x: live.backward_last.get(x, live.forward_last.get(x, 0)) for x in cand}
    writing = sorted({w for x in cand for w in program.writers[x]}, reverse=True)
    changed = True
    while changed:
        changed = False
        for w in writing:
            st = steps[w]
            # What a replay of this step reads, and what it rebuilds with the candidates it writes (an
            # in-place writer's input comes from replaying the writers before it).
            rebuilt = max((need[z] for z in st.writes if z in cand), default=None)
            if rebuilt is None:
                continue
            for y in st.uses:
                if y in cand and need[y] < rebuilt:
                    need[y] = rebuilt
                    changed = True
    return need


class RecomputePlanner:
    """Builds the recompute schedule (liveness + drops + replays + checkpoint offload)."""

    def __init__(self, program: Program, live: Liveness, checkpoint_types: Iterable[str], limit: int):
        self.p = program
        self.live = live
        self.types = tuple(checkpoint_types)
        self.limit = limit  # bytes a step may hold before a segment trades speed for memory (>= max(l_i))
        self.cps = checkpoint_steps(program, self.types)
        self._classify(checkpoint_tensors(program, self.types) | program.resident | program.pinned)

    def _classify(self, kept: set[str]) -> None:
        """Split what backward reads into dropped (rebuilt by replay) and movable, given the `kept` tensors."""
        program = self.p
        self.kept = kept
        self.drop = droppable(program, self.live, kept)
        # Whatever backward reads and no replay can rebuild leaves the device between its uses: the
        # checkpoints, and the tensors whose replay inputs would be gone by then (e.g. a ResNet's Eltwise
        # sum, whose inputs backward never reads once BatchNorm keeps x_hat) -- moving them costs fewer
        # bytes than keeping their inputs for a replay.
        self.movable = backward_reads(program, self.live, set(program.writers) - self.drop)
        self.bwd_uses: dict[str, list[int]] = {}
        for s in program.steps[program.n_forward:]:
            for k in s.uses:
                if k in self.drop:
                    self.bwd_uses.setdefault(k, []).append(s.index)
        self.dropped_in: dict[int, list[str]] = {}  # segment -> its dropped tensors, in a stable order
        for k in sorted(self.drop):
            self.dropped_in.setdefault(self.segment(k), []).append(k)

    def segment(self, key: str) -> int:
        return bisect.bisect_right(self.cps, self.p.writers[key][0])

    def plan(self) -> Schedule:
        """A replay needs its inputs on the device at the step that triggers it, often a checkpoint brought
        back sooner than its own use (an Inception stem's max pooling, replayed for its mask, holds the
        convolution output that only the next step reads). Where a step that replays a single layer still
        exceeds the limit, what that layer rebuilds is kept and moved instead (a small copy against a large
        early prefetch), and the plan is made again. Longer replays (whole segments) stay: moving all they
        rebuild would cost transfers that recomputation exists to avoid. A round that does not lower the
        peak is undone."""
        best = None
        while True:
            sched, spans, strategy = self._plan_strategies()
            self._park_waiting_gradients(sched)
            trace = simulate(self.p, sched).bytes
            if best is not None and max(trace) >= best[0]:
                _, sched, spans, strategy = best  # moving did not lower the peak: keep the replays
                break
            best = (max(trace), sched, spans, strategy)
            rebuilt = {k for s in range(self.p.n_forward, len(trace)) if trace[s] > self.limit
                       and sum(op == RUN for op, _ in sched.before[s]) == 1
                       for op, k in sched.before[s] if op == ALLOC and k in self.drop}
            if not rebuilt:
                break
            self._classify(self.kept | rebuilt)
        # Segments are named after the checkpoint layer that opens them.
        nodes = self.p.graph.nodes
        sched.info["strategies"] = {(nodes[self.cps[g - 1]].name if g else "(input)"): strategy[g]
                                    for g in sorted(spans)}
        return sched

    def _plan_strategies(self):
        segs = {self.segment(k) for k in self.drop}
        strategy = {g: SPEED for g in segs}
        for _ in range(len(segs) + 1):
            sched, spans = self._build(strategy)
            over = OverLimit(simulate(self.p, sched).bytes, self.limit)
            worse = [g for g, span in spans.items()
                     if strategy[g] == SPEED and any(over.within(a, b) for a, b in span)]
            if not worse:
                break
            for g in worse:
                strategy[g] = MEMORY
        return sched, spans, strategy

    def _park_waiting_gradients(self, sched: Schedule) -> None:
        """Move each gradient that waits, untouched, across a backward step over the limit to the host for its
        longest such wait (the runtime's cache keeps one host copy per tensor at a time)."""
        p = self.p
        trace = simulate(p, sched).bytes
        if max(trace[p.n_forward:], default=0) <= self.limit:
            return
        uses: dict[str, list[int]] = {}
        for st in p.steps[p.n_forward:]:
            for k in st.uses:
                if p.tensors[k].kind == "diff" and k not in p.pinned:
                    uses.setdefault(k, []).append(st.index)
        parked: dict[str, tuple[int, int]] = {}
        over = OverLimit(trace, self.limit)
        for k, at in uses.items():
            waits = [(b - a, a, b) for a, b in zip(at, at[1:]) if over.within(a + 1, b)]
            if waits:
                _, a, b = max(waits)
                parked[k] = (a, b)
        apply_offload(sched, parked)
        sched.info["offloaded"].update(parked)
        sched.info["offloadable"] = sorted(set(sched.info["offloadable"]) | set(parked))

    # -- one build under fixed per-segment strategies ----------------------------------------
    def _build(self, strategy: dict[int, str]):
        p, live = self.p, self.live
        last = dict(live.last)
        for k in self.drop:
            last[k] = live.forward_last[k]  # dropped once forward is done with it
        sched = live.schedule(last)
        on = set(p.resident)
        spans: dict[int, list[tuple[int, int]]] = {}  # segment -> the step ranges it keeps rebuilt tensors over
        reads_at: dict[str, int] = {}  # kept tensor -> earliest step a replay reads it
        extra = 0
        for s in range(len(p.steps)):
            if s >= p.n_forward:
                need = [k for k in p.steps[s].uses if k in self.drop and k not in on]
                by_seg: dict[int, list[str]] = {}
                for k in need:
                    by_seg.setdefault(self.segment(k), []).append(k)
                replay: list = []
                for g in sorted(by_seg, reverse=True):
                    if strategy[g] == SPEED:
                        targets = {k for k in self.dropped_in[g] if k not in on
                                   and self.bwd_uses.get(k) and self.bwd_uses[k][-1] >= s}
                    else:
                        targets = set(by_seg[g])
                    runs = self._closure(targets, on)
                    extra += len(runs)
                    replay += self._replay(runs, targets, on, reads_at, s)
                    span = spans.setdefault(g, [])
                    for k in targets:
                        # speed: keep until the last backward use; memory: only for this step
                        until = self.bwd_uses[k][-1] if strategy[g] == SPEED else s
                        sched.after[until].append((FREE, k))
                        span.append((s, until + 1))
                sched.before[s][:0] = replay
            for op, k in sched.before[s]:
                if op == ALLOC:
                    on.add(k)
                elif op == FREE:
                    on.discard(k)
            for op, k in sched.after[s]:
                if op == FREE:
                    on.discard(k)
        moves = plan_offload(p, live, self.types, reads_at, candidates=self.movable)
        apply_offload(sched, moves)
        due = first_needed(live, reads_at)
        delay_prefetches(p, sched, moves, {k: due(k) for k in moves}, self.limit)
        seeds_first(p, sched)  # before the strategies are weighed on its trace
        sched.info.update(extra_forward_steps=extra, offloaded=moves, dropped=sorted(self.drop),
                          offloadable=sorted(self.movable))
        return sched, spans

    def _closure(self, targets: set[str], on: set[str]) -> list[int]:
        """The forward steps to replay, in order, to rebuild `targets` from what is on the device."""
        steps = self.p.steps
        need = set(targets)
        stack = list(targets)
        runs: set[int] = set()
        while stack:
            x = stack.pop()
            for w in self.p.writers[x]:
                if w in runs:
                    continue
                runs.add(w)
                for y in steps[w].uses:
                    rebuild = y in steps[w].writes or (y in self.drop and y not in on)
                    if rebuild and y not in need:
                        need.add(y)
                        stack.append(y)
        return sorted(runs)

    def _replay(self, runs: list[int], keep: set[str], on: set[str], reads_at: dict[str, int], s: int) -> list:
        steps = self.p.steps
        last_read = {}
        for i, w in enumerate(runs):
            for y in steps[w].uses:
                last_read[y] = i
        actions: list = []
        mine: set[str] = set()
        for i, w in enumerate(runs):
            for y in steps[w].uses:
                if y in self.kept and y not in reads_at:
                    reads_at[y] = s
                if y not in on:
                    if y not in self.drop:
                        # droppable() keeps every input a replay reads alive until then: an empty block here
                        # would be read as if it held the tensor.
                        raise RuntimeError(f"recompute plan: replaying {steps[w].node.name!r} at step {s} needs "
                                           f"{y!r}, which is no longer on the device")
                    actions.append((ALLOC, y))
                    on.add(y)
                    mine.add(y)
            actions.append((RUN, w))
            for y in steps[w].uses:
                if y in mine and y not in keep and last_read[y] == i:
                    actions.append((FREE, y))
                    on.discard(y)
                    mine.discard(y)
        return actions
