"""`auto`'s time model: what a plan costs per iteration under a mode and a pool budget, and the choice it drives.

The paper fixes CONV layers as checkpoints: in 2017 a convolution took long enough to hide the PCIe copy
of its output. Today's GPUs compute ~30x faster but PCIe is only ~3x faster, so offloading every conv
output is transfer-bound (ResNet-50, batch 344, 12 GiB on an H100: 495 img/s under offload, 985 img/s
recomputing from ResNet block outputs). So `auto` weighs, per candidate (mode x checkpoint set):
- compute: every forward step (roofline: FLOPs or bytes, whichever takes longer, as each layer declares
  them: `Layer.forward_flops`, `Layer.forward_bytes`) and backward at ~2x;
- replay: the forward steps the recompute schedule runs again in backward;
- transfer: the checkpoint bytes that cannot stay on the device, out and back over the host link.
Recompute is weighed at several replay limits (RECOMPUTE_LIMITS): where the budget has room, a segment is
replayed once and its tensors kept until their last use, rather than step by step down to max(l_i).
Copies overlap compute, so an iteration takes about max(compute + replay, transfer). The model only
ranks candidates for one net; it does not predict absolute times (docs/MEMORY.md, "How auto chooses").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from superneurons.errors import UserError
from superneurons.graph.build import Graph
from superneurons.graph.node import Node
from superneurons.memory.liveness import RUN
from superneurons.memory.plan import PLAN_MODES, MemoryPlan, no_fit_error, offloaded_bytes
from superneurons.memory.pool import format_bytes

# Effective rates of the device the ranking assumes: one H100 (SXM), fp32 with TF32 convolutions. Fitted
# to our ResNet-50 runs at batch 344 in 12 GiB; the model then gives baseline 1508 img/s (measured ~1450),
# offload with CONV checkpoints 596 (495), recompute from block outputs 1026 (985). Only the ratios matter
# for the ranking; change them here and nowhere else.
FLOPS = 50e12  # FLOP/s a convolution or matrix product sustains (cuDNN, TF32)
DEVICE_BW = 3e12  # bytes/s an element-wise layer (BatchNorm, ReLU, pooling...) reads and writes (HBM3)
HOST_BW = 50e9  # bytes/s between device and pinned host memory, each way (PCIe 5 x16)
BACKWARD_FACTOR = 2.0  # a backward step costs ~2x its forward (gradients of the input and of the weights)
# Predictions within this fraction of the fastest count as a tie, won by the earliest candidate (the
# paper's CONV set before others, offload before recompute, a higher replay limit before a lower): the model
# is a coarse ranking, off by up to ~20% on the measured runs, and leaves out the runtime bookkeeping that
# recomputation adds.
TIE = 0.10

MOVING_MODES = ("offload", "recompute")  # the modes whose plan depends on the checkpoint types
FITS_ANYWAY = PLAN_MODES[:2]  # baseline, liveness: nothing moves, nothing replays -- take them when they fit


def keeps_everything_resident(choice) -> bool:
    """Whether auto's `choice` keeps every tensor on the device (baseline or liveness, parameters not streamed):
    where a channels-last Net under --memory auto keeps its layout (runtime/net.py, commands/memory.py)."""
    return choice.mode in FITS_ANYWAY and not choice.streams_params


def keeps_auto_layout(choice, layouts) -> bool:
    """Whether a Net whose layout `auto` chose (graph/layout.py) keeps it under auto's `choice`: every tensor
    resident, and baseline where the layout rests on passes replayed as CUDA graphs (`replay_only`), which
    only baseline replays."""
    return keeps_everything_resident(choice) and (not layouts.replay_only or choice.mode == "baseline")


def forward_seconds(node: Node, graph: Graph) -> float:
    """One forward step: the longer of its arithmetic and its memory traffic, as its layer declares them
    (nothing for a view or a layer fused into another)."""
    layer = graph.step_layer(node)
    moved = layer.forward_bytes([graph.blob_shapes[b] for b in node.bottoms], node.top_shapes)
    return max(layer.forward_flops() / FLOPS, moved / DEVICE_BW)


@dataclass
class Estimate:
    """The predicted cost of one iteration of `plan` under `mode`, within a budget."""

    mode: str
    checkpoint_types: tuple[str, ...]
    streams_params: bool  # fits only with the parameters streamed from the host
    peak_bytes: int  # planned peak, resident parameters included (or the streamed peak)
    compute_s: float  # forward + backward
    replay_s: float  # recomputation
    replays: int  # replayed forward steps
    moved_bytes: int  # over the host link, both ways
    recompute_limit: int = 0  # the plan's (make_plan): bytes a recompute step may hold before it replays more
    host_bytes: int = 0  # pinned host memory it may take (MemoryPlan.host_bytes)

    @property
    def transfer_s(self) -> float:
        return self.moved_bytes / HOST_BW

    @property
    def seconds(self) -> float:
        """Copies overlap compute: the iteration waits on whichever is longer."""
        return max(self.compute_s + self.replay_s, self.transfer_s)


def estimate(plan: MemoryPlan, mode: str, budget: int, streams_params: bool = False) -> Estimate:
    """Cost `plan` under `mode` in a `budget`-byte pool (the parameters resident, or streamed)."""
    program, graph = plan.program, plan.program.graph
    fwd = [forward_seconds(n, graph) for n in graph.nodes]
    compute = sum(fwd[s.forward_index] * (1.0 if s.index < program.n_forward else BACKWARD_FACTOR)
                  for s in program.steps)
    runs = [arg for acts in plan.schedules[mode].before for op, arg in acts if op == RUN]
    if streams_params:
        peak = plan.streamed_peak(mode)
        params_moved = sum(plan.param_window)  # each step brings its own parameters (and gradients) in
    else:
        peak = plan.peak(mode)[0] + plan.param_bytes
        params_moved = 0
    # The Tensor Cache keeps on the device whatever of the planned moves fits beside the peak; only the
    # rest goes out and comes back.
    spare = max(0, budget - peak)
    moved = 2 * max(0, offloaded_bytes(plan, mode) - spare) + params_moved
    return Estimate(mode, plan.checkpoint_types, streams_params, peak, compute, sum(fwd[w] for w in runs),
                    len(runs), moved, plan.recompute_limit if mode == "recompute" else 0,
                    plan.host_bytes(mode, streams_params))


@dataclass
class Choice:
    """What `auto` picked, and the candidates it weighed (empty when baseline or liveness fit)."""

    mode: str
    checkpoint_types: tuple[str, ...]
    budget: int
    streams_params: bool = False
    recompute_limit: int = 0  # for the recompute manager's plan (make_plan); 0: down to max(l_i)
    candidates: list[Estimate] = field(default_factory=list)
    chosen: Estimate | None = None  # the winning candidate (None when there were none)

    def summary(self) -> str:
        """'--memory auto with 12.0 GiB: recompute (checkpoints: Eltwise, Concat, Pooling)': for a log line."""
        notes = []
        if self.mode in MOVING_MODES:  # baseline and liveness move nothing: their checkpoints do not matter
            notes.append(f"checkpoints: {', '.join(self.checkpoint_types)}")
        if self.streams_params:
            notes.append("parameters streamed from the host")
        line = f"--memory auto with {format_bytes(self.budget)}: {self.mode}"
        return f"{line} ({'; '.join(notes)})" if notes else line


# The recompute limits `auto` weighs, as fractions of what the budget leaves beside the resident parameters:
# a plan may keep a replayed segment's tensors until their last backward use (one replay per segment, as
# PyTorch's checkpointing does) wherever that fits, instead of replaying step by step down to max(l_i).
# Higher limits come first: among predictions within TIE they replay less, which the model undercounts.
RECOMPUTE_LIMITS = (1.0, 0.75, 0.5)


class PlanFor(Protocol):
    def __call__(self, types: tuple[str, ...], modes: Sequence[str], recompute_limit: int = 0) -> MemoryPlan:
        """The net planned under `modes` with checkpoint `types` (make_plan's `recompute_limit`)."""


def choose(budget: int, checkpoint_sets: Sequence[tuple[str, ...]], plan_for: PlanFor,
           host_limit: int | None = None) -> Choice:
    """`auto`: baseline or liveness when one fits beside the resident parameters; otherwise the fastest
    predicted (mode x checkpoint set x recompute limit) that fits, with the parameters resident if any
    candidate allows it, else streamed. `plan_for` plans the net (once per set and limit, only as needed).
    `host_limit`: the pinned host memory a candidate may take (None: no limit); one that may take more is
    not weighed, so a run never starts a plan the host cannot hold."""
    first = plan_for(checkpoint_sets[0], FITS_ANYWAY)
    for mode in FITS_ANYWAY:
        if first.fits(mode, budget):
            return Choice(mode, checkpoint_sets[0], budget)
    plans = [plan_for(types, MOVING_MODES) for types in checkpoint_sets]

    def on_host(candidates: list[Estimate]) -> list[Estimate]:
        return [e for e in candidates if host_limit is None or e.host_bytes <= host_limit]

    fitting = [e for p in plans for e in _with_limits(p, budget, plan_for)]
    ranked = on_host(fitting)
    if not ranked:  # deep nets: stream the parameters (liveness does not depend on the checkpoints)
        streamed = [estimate(p, m, budget, streams_params=True)
                    for p, modes in [(first, ("liveness",))] + [(p, MOVING_MODES) for p in plans]
                    for m in modes if p.fits_streamed(m, budget)]
        fitting += streamed
        ranked = on_host(streamed)
    if not ranked:
        if fitting:
            raise host_error(first.program.graph.name or "net", fitting, budget, host_limit or 0)
        raise no_fit_error(plans, budget)
    fastest = min(e.seconds for e in ranked)
    win = next(e for e in ranked if e.seconds <= fastest * (1 + TIE))
    return Choice(win.mode, win.checkpoint_types, budget, win.streams_params, win.recompute_limit, ranked, win)


def host_error(net: str, fitting: list[Estimate], budget: int, host_limit: int) -> UserError:
    """What `auto` says when plans fit the device but each may pin more host memory than `host_limit`."""
    least = min(fitting, key=lambda e: e.host_bytes)
    return UserError(
        f"{net}: every plan that fits {format_bytes(budget)} ({budget} bytes) on the device may pin more host memory "
        f"than the {format_bytes(host_limit)} ({host_limit} bytes) allowed: the least, {least.mode} with "
        f"checkpoints {', '.join(least.checkpoint_types)}"
        f"{' and the parameters streamed' if least.streams_params else ''}, may pin {least.host_bytes} bytes "
        f"({format_bytes(least.host_bytes)}); train with a smaller batch, a larger --gpu-memory, or a higher "
        f"SUPERNEURONS_HOST_MEMORY_MB")


def _with_limits(plan: MemoryPlan, budget: int, plan_for: PlanFor) -> list[Estimate]:
    """The candidates of one checkpoint set with resident parameters: offload, then recompute at each limit
    of RECOMPUTE_LIMITS above max(l_i) and at max(l_i) itself, those that fit; a limit whose plan is the
    same as a higher one's (same peak, replays and moves) is weighed once."""
    out = [estimate(plan, "offload", budget)] if plan.fits("offload", budget) else []
    activations = budget - plan.param_bytes
    limits = sorted({int(f * activations) for f in RECOMPUTE_LIMITS if f * activations > plan.max_layer[1]},
                    reverse=True)
    seen = set()
    for limited in [plan_for(plan.checkpoint_types, ("recompute",), recompute_limit=x) for x in limits] + [plan]:
        if limited.fits("recompute", budget):
            e = estimate(limited, "recompute", budget)
            if (e.peak_bytes, e.replays, e.moved_bytes) not in seen:
                seen.add((e.peak_bytes, e.replays, e.moved_bytes))
                out.append(e)
    return out
