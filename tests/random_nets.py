"""Random valid nets, and the check that every memory mode keeps the plan's promise on them.

`random_net(seed)` builds a small training net (a prototxt) from a seeded generator: convolutions (some
sharing weights through `param { name }`), deconvolutions, pooling, inner products, activations (in place
or not), BatchNorm + Scale + ReLU chains (which graph/fuse.py fuses), Eltwise (SUM, PROD, MAX, also of a
blob with itself), Concat (also of a blob with itself), Slice, LRN, Dropout, Flatten/Reshape, Softmax,
fan-out (Split layers), joins, `propagate_down: false` bottoms, and one or more losses (SoftmaxWithLoss,
EuclideanLoss, SigmoidCrossEntropyLoss) with their own weights. Shapes are tiny, so a net trains in
milliseconds on the CPU.

`check_net(net)` states the promise of `superneurons memory` and returns what broke it (an empty list
when nothing did):
- every mode trains to baseline's weights and losses, byte for byte;
- the pool's bytes at every step equal the plan's: baseline's and liveness's trace as planned; offload's
  and recompute's as planned with the Tensor Cache off (every planned move made), and with it on and room
  to spare, the plan without its host moves;
- in a pool of exactly the planned peak plus the parameters (the CPU takes no convolution workspace),
  every mode trains, again to baseline's weights;
- a pool one block smaller either trains (to baseline's weights) or is refused when the Net is built:
  never an error in the middle of an iteration.

Run at length: `python tests/random_nets.py --nets 500 [--start 0] [--modes ...] [--sweep]` (from the repository
root, with the package importable); tests/test_random_nets.py runs a few in CI.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from google.protobuf import text_format

from superneurons import settings
from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.graph.build import build_graph
from superneurons.solver.fused_update import CHUNK
from superneurons.memory.liveness import OFFLOAD, PREFETCH, Schedule, simulate
from superneurons.memory import BLOCK_CHECKPOINTS
from superneurons.memory.offload import DEFAULT_CHECKPOINTS
from superneurons.memory.plan import MemoryPlan, make_plan
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

# ":block": with the block-boundary checkpoints auto also weighs (Eltwise, Concat, Pooling), not Convolution.
MODES = ("baseline", "liveness", "offload", "recompute", "offload:block", "recompute:block", "auto")
CLASSES = 3  # SoftmaxWithLoss labels are drawn from 0..CLASSES-1
BLOCK = 1024  # the pool's unit (memory/pool.py)
BACKEND = CpuBackend()

WEIGHTS = 'weight_filler { type: "gaussian" std: 0.2 } bias_filler { type: "constant" value: 0.1 }'


@dataclass
class RandomNet:
    seed: int
    text: str  # the NetParameter, prototxt
    layers: int
    features: list[str] = field(default_factory=list)  # what the generator put in (for the run's summary)

    def graph(self, policy=None):
        return build_graph(text_format.Parse(self.text, pb.NetParameter()), pb.TRAIN, policy=policy)


class _Builder:
    """Grows one net: blobs with shapes, how often each is consumed, and the layers so far."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.lines: list[str] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.uses: dict[str, int] = {}  # blob -> layers reading it
        self.n = 0
        self.shared: dict[tuple, str] = {}  # parameter shapes -> name of a parameter others may share
        self.features: set[str] = set()

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def layer(self, type_: str, bottoms: list[str], tops: list[str], extra: str = "",
              shapes: list[tuple[int, ...]] | None = None) -> None:
        name = tops[0] if tops and tops[0] not in bottoms else self.name(type_.lower())
        b = "".join(f' bottom: "{x}"' for x in bottoms)
        t = "".join(f' top: "{x}"' for x in tops)
        self.lines.append(f'layer {{ name: "{name}" type: "{type_}"{b}{t} {extra} }}')
        for x in bottoms:
            self.uses[x] = self.uses.get(x, 0) + 1
        for x, s in zip(tops, shapes or []):
            self.shapes[x] = s
            self.uses.setdefault(x, 0)
        if len(set(bottoms)) < len(bottoms):
            self.features.add("repeated bottom")
        if any(x in bottoms for x in tops):
            self.features.add("in place")

    def pick(self, ndim: int | None = None) -> str | None:
        """A blob to read: recent ones more often, so chains grow deep as well as wide."""
        names = [b for b, s in self.shapes.items() if b != "label" and (ndim is None or len(s) == ndim)]
        if not names:
            return None
        weights = [1.0 + 3.0 * (i == len(names) - 1) + i / len(names) for i in range(len(names))]
        b = self.rng.choices(names, weights)[0]
        if self.uses.get(b, 0):
            self.features.add("fan-out")
        return b

    def param_spec(self, key: tuple, bias: bool) -> str:
        """`param { name }` shared with an earlier layer of the same parameter shapes, now and then."""
        if key in self.shared and self.rng.random() < 0.8:
            self.features.add("shared weights")
            name = self.shared[key]
            return f'param {{ name: "{name}_w" }}' + (f' param {{ name: "{name}_b" }}' if bias else "")
        if key not in self.shared and self.rng.random() < 0.5:
            name = self.name("p")
            self.shared[key] = name
            return f'param {{ name: "{name}_w" }}' + (f' param {{ name: "{name}_b" }}' if bias else "")
        return ""


def _pd(bottoms: int, rng: random.Random, builder: _Builder) -> str:
    """`propagate_down` with one bottom's gradient turned off, sometimes."""
    if bottoms < 2 or rng.random() > 0.15:
        return ""
    off = rng.randrange(bottoms)
    builder.features.add("propagate_down")
    return " ".join(f"propagate_down: {'false' if j == off else 'true'}" for j in range(bottoms))


def _add_layer(b: _Builder) -> None:
    rng = b.rng
    kinds = ["conv", "conv", "pool", "act", "act", "bn", "eltwise", "eltwise", "concat", "ip", "dropout",
             "lrn", "flatten", "deconv", "slice", "softmax"]
    kind = rng.choice(kinds)
    four = b.pick(4)
    if kind in ("conv", "pool", "bn", "concat", "lrn", "flatten", "deconv", "slice") and four is None:
        kind = rng.choice(["ip", "act", "eltwise", "dropout"])
    if kind == "conv":
        n, c, h, w = b.shapes[four]
        out = rng.randint(1, 4)
        k = rng.choice([1, 3]) if h >= 3 else 1
        stride = 2 if h >= 6 and rng.random() < 0.3 else 1
        bias = rng.random() < 0.7
        # Weights of an earlier convolution that reads as many channels, half the time there is one.
        earlier = [key for key in b.shared if key[0] == "conv" and key[1] == c and key[3] <= h]
        if earlier and rng.random() < 0.5:
            _, _, out, k, bias = rng.choice(earlier)
        pad = k // 2
        share = b.param_spec(("conv", c, out, k, bias), bias)
        top = b.name("conv")
        ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        b.layer("Convolution", [four], [top],
                f"{share} convolution_param {{ num_output: {out} kernel_size: {k} pad: {pad} stride: {stride} "
                f"bias_term: {str(bias).lower()} {WEIGHTS} }}", [(n, out, ho, wo)])
        b.features.add("Convolution")
    elif kind == "deconv":
        n, c, h, w = b.shapes[four]
        out = rng.randint(1, 3)
        up = h <= 4 and rng.random() < 0.6
        k, stride, pad = (2, 2, 0) if up else (3, 1, 1)
        top = b.name("deconv")
        b.layer("Deconvolution", [four], [top],
                f"convolution_param {{ num_output: {out} kernel_size: {k} pad: {pad} stride: {stride} {WEIGHTS} }}",
                [(n, out, (h - 1) * stride - 2 * pad + k, (w - 1) * stride - 2 * pad + k)])
        b.features.add("Deconvolution")
    elif kind == "pool":
        n, c, h, w = b.shapes[four]
        op = rng.choice(["MAX", "AVE"])
        top = b.name("pool")
        if h >= 2 and rng.random() < 0.5:
            b.layer("Pooling", [four], [top], f"pooling_param {{ pool: {op} kernel_size: 2 stride: 2 }}",
                    [(n, c, -(-(h - 2) // 2) + 1, -(-(w - 2) // 2) + 1)])
        else:
            b.layer("Pooling", [four], [top], f"pooling_param {{ pool: {op} kernel_size: 3 stride: 1 pad: 1 }}",
                    [(n, c, h, w)])
        b.features.add(f"Pooling {op}")
    elif kind == "act":
        x = b.pick()
        type_ = rng.choice(["ReLU", "ReLU", "Sigmoid", "TanH", "ELU", "AbsVal", "PReLU"])
        # In place only where backward reads the top alone (AbsVal, ELU, PReLU read their input).
        in_place = b.uses[x] == 0 and type_ in ("ReLU", "Sigmoid", "TanH") and rng.random() < 0.6
        top = x if in_place else b.name(type_.lower())
        b.layer(type_, [x], [top], "", [b.shapes[x]])
        b.features.add(type_)
    elif kind == "bn":
        x = four
        in_place = b.uses[x] == 0 and rng.random() < 0.7
        top = x if in_place else b.name("bn")
        b.layer("BatchNorm", [x], [top], "", [b.shapes[x]])
        b.features.add("BatchNorm")
        if rng.random() < 0.7:
            b.layer("Scale", [top], [top], "scale_param { bias_term: true }", [b.shapes[x]])
            b.features.add("Scale")
            if rng.random() < 0.7:
                b.layer("ReLU", [top], [top], "", [b.shapes[x]])
    elif kind == "eltwise":
        x = b.pick()
        same = [y for y, s in b.shapes.items() if s == b.shapes[x] and y not in ("label",)]
        y = x if rng.random() < 0.25 else rng.choice(same)
        op = rng.choice(["SUM", "SUM", "PROD", "MAX"])
        coeff = " coeff: 1 coeff: -0.5" if op == "SUM" and rng.random() < 0.2 else ""
        top = b.name("elt")
        b.layer("Eltwise", [x, y], [top], f"eltwise_param {{ operation: {op}{coeff} }} {_pd(2, rng, b)}",
                [b.shapes[x]])
        b.features.add(f"Eltwise {op}")
        if op == "SUM" and rng.random() < 0.4:
            b.layer("ReLU", [top], [top], "", [b.shapes[x]])  # the residual join graph/fuse.py folds
    elif kind == "concat":
        n, c, h, w = b.shapes[four]
        same = [y for y, s in b.shapes.items() if len(s) == 4 and s[0] == n and s[2:] == (h, w)]
        others = [rng.choice(same) for _ in range(rng.randint(1, 2))]
        bottoms = [four] + others
        top = b.name("cat")
        b.layer("Concat", bottoms, [top], f"{_pd(len(bottoms), rng, b)}",
                [(n, sum(b.shapes[y][1] for y in bottoms), h, w)])
        b.features.add("Concat")
    elif kind == "ip":
        x = b.pick()
        s = b.shapes[x]
        inputs = int(np.prod(s[1:]))
        out = rng.randint(2, 6)
        earlier = [key for key in b.shared if key[0] == "ip" and key[1] == inputs]
        if earlier and rng.random() < 0.5:
            out = rng.choice(earlier)[2]
        share = b.param_spec(("ip", inputs, out), True)
        top = b.name("ip")
        b.layer("InnerProduct", [x], [top], f"{share} inner_product_param {{ num_output: {out} {WEIGHTS} }}",
                [(s[0], out)])
        b.features.add("InnerProduct")
    elif kind == "dropout":
        x = b.pick()
        in_place = b.uses[x] == 0 and rng.random() < 0.6
        top = x if in_place else b.name("drop")
        b.layer("Dropout", [x], [top], "dropout_param { dropout_ratio: 0.3 }", [b.shapes[x]])
        b.features.add("Dropout")
    elif kind == "lrn":
        top = b.name("lrn")
        b.layer("LRN", [four], [top], "lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 }", [b.shapes[four]])
        b.features.add("LRN")
    elif kind == "flatten":
        n, c, h, w = b.shapes[four]
        top = b.name("flat")
        if rng.random() < 0.5:
            b.layer("Flatten", [four], [top], "", [(n, c * h * w)])
            b.features.add("Flatten")
        else:
            b.layer("Reshape", [four], [top], "reshape_param { shape { dim: 0 dim: -1 } }", [(n, c * h * w)])
            b.features.add("Reshape")
    elif kind == "slice":
        n, c, h, w = b.shapes[four]
        if c < 2:
            return
        at = rng.randint(1, c - 1)
        tops = [b.name("slice"), b.name("slice")]
        b.layer("Slice", [four], tops, f"slice_param {{ axis: 1 slice_point: {at} }}",
                [(n, at, h, w), (n, c - at, h, w)])
        b.features.add("Slice")
    elif kind == "softmax":
        x = b.pick()
        top = b.name("softmax")
        b.layer("Softmax", [x], [top], "", [b.shapes[x]])
        b.features.add("Softmax")


def _add_losses(b: _Builder) -> None:
    """One or more losses over blobs nothing reads yet (others stay outputs of the net)."""
    rng = b.rng
    dangling = [x for x in b.shapes if b.uses.get(x, 0) == 0 and x not in ("label", "data")]
    rng.shuffle(dangling)
    losses = 0
    for x in dangling:
        if losses and rng.random() < 0.3:
            continue  # left an output
        weight = rng.choice(["", "", " loss_weight: 0.5"])
        s = b.shapes[x]
        choice = rng.random()
        if choice < 0.5:
            logits = x
            if len(s) != 2 or s[1] != CLASSES:
                logits = b.name("cls")
                b.layer("InnerProduct", [x], [logits], f"inner_product_param {{ num_output: {CLASSES} {WEIGHTS} }}",
                        [(s[0], CLASSES)])
            b.layer("SoftmaxWithLoss", [logits, "label"], [b.name("loss")], weight, [()])
            b.features.add("SoftmaxWithLoss")
        elif choice < 0.8:
            partners = [y for y, t in b.shapes.items() if t == s and y != "label"]
            y = rng.choice(partners)  # may be x itself, or the input
            pd = " propagate_down: true propagate_down: false" if y != x and rng.random() < 0.3 else ""
            if pd:
                b.features.add("propagate_down")
            b.layer("EuclideanLoss", [x, y], [b.name("loss")], weight + pd, [()])
            b.features.add("EuclideanLoss")
        else:
            partners = [y for y, t in b.shapes.items() if t == s and y != "label" and y != x]
            if not partners:
                continue
            b.layer("SigmoidCrossEntropyLoss", [x, rng.choice(partners)], [b.name("loss")],
                    weight + " propagate_down: true propagate_down: false", [()])
            b.features.add("SigmoidCrossEntropyLoss")
        losses += 1
    if losses == 0:  # every blob was read by something: put a loss on the last one
        x = list(b.shapes)[-1]
        s = b.shapes[x]
        logits = b.name("cls")
        b.layer("InnerProduct", [x], [logits], f"inner_product_param {{ num_output: {CLASSES} {WEIGHTS} }}",
                [(s[0], CLASSES)])
        b.layer("SoftmaxWithLoss", [logits, "label"], [b.name("loss")], "", [()])
    if losses > 1:
        b.features.add("several losses")


def random_net(seed: int, min_layers: int = 4, max_layers: int = 14) -> RandomNet:
    """A valid training net, a pure function of `seed`."""
    rng = random.Random(seed)
    b = _Builder(rng)
    n = 2
    c, h = rng.randint(1, 3), rng.choice([4, 5, 6, 8])
    b.lines.append(f'layer {{ name: "input" type: "Input" top: "data" top: "label" input_param {{ '
                   f'shape {{ dim: {n} dim: {c} dim: {h} dim: {h} }} shape {{ dim: {n} }} }} }}')
    b.shapes["data"], b.shapes["label"] = (n, c, h, h), (n,)
    b.uses["data"] = b.uses["label"] = 0
    for _ in range(rng.randint(min_layers, max_layers)):
        _add_layer(b)
    _add_losses(b)
    return RandomNet(seed, f'name: "random{seed}"\n' + "\n".join(b.lines) + "\n", len(b.lines),
                     sorted(b.features))


# -- the check ----------------------------------------------------------------------------------------

def _memory_param(cache: bool = True, stream: bool | None = None) -> pb.MemoryParameter:
    p = pb.MemoryParameter(tensor_cache=cache)
    if stream is not None:
        p.param_offload = stream
    return p


GPU_SPARE_POOL = 1 << 30  # bytes: "room to spare" for a random net on a GPU


def checkpoints_of(mode: str) -> tuple[str, tuple[str, ...] | None]:
    """("offload", BLOCK_CHECKPOINTS) for "offload:block"; (mode, None: the Net's default) otherwise."""
    name, _, which = mode.partition(":")
    return name, (BLOCK_CHECKPOINTS if which == "block" else None)


def build(net: RandomNet, mode: str, pool_bytes: int | None = None, cache: bool = True,
          stream: bool | None = None, backend=None) -> Net:
    """`net` under `mode` (on `backend`, default the CPU's); odd seeds keep one solver history set (momentum)
    in the pool, as the Solver does."""
    if backend is not None and backend is not BACKEND:
        gc.collect()  # on a GPU the previous Net's arena must be gone first
    name, types = checkpoints_of(mode)
    return Net(net.graph(), backend or BACKEND, train=True, seed=7, pool_bytes=pool_bytes, memory=name,
               checkpoint_types=types, memory_param=_memory_param(cache, stream), solver_history=net.seed % 2)


def train(runtime: Net, iters: int = 2) -> tuple[list[np.ndarray], list[float], list[list[int]]]:
    """Plain SGD on the solver's list for `iters` iterations from seeded inputs: (weights, losses, the
    manager's per-step trace of every iteration). Any backend: arrays go through `runtime.backend`, the
    update through `ops.axpy`, streamed parameters brought in for it as the solver's update does."""
    rng = np.random.default_rng(1)
    backend, store = runtime.backend, runtime.params
    losses, traces = [], []
    for it in range(iters):
        runtime.ctx.iteration = it
        x, label = runtime.data["data"], runtime.data["label"]
        backend.from_host(x.array, rng.standard_normal(x.shape).astype(np.float32))
        backend.from_host(label.array, rng.integers(0, CLASSES, label.shape).astype(np.float32))
        runtime.clear_param_diffs()
        losses.append(runtime.forward_backward())
        traces.append(list(getattr(runtime.memory, "trace", [])))
        for decl in runtime.learnable:
            pair = [decl.data_tensor, decl.diff_tensor]
            if store.offloaded:
                store.acquire(pair)
            runtime.ops.axpy(-0.01, decl.diff, decl.data)
            if store.offloaded:
                store.release(pair, changed=[decl.data_tensor])
        if store.offloaded:
            store.settle()
    backend.synchronize()
    weights = [backend.to_host(t.array) for t in runtime.tensors if t.kind == "param" and t.array is not None]
    return weights, losses, traces


def _without_moves(schedule: Schedule) -> Schedule:
    keep = lambda acts: [a for a in acts if a[0] not in (OFFLOAD, PREFETCH)]  # noqa: E731
    return Schedule([keep(a) for a in schedule.before], [keep(a) for a in schedule.after])


def _first_difference(got: list[int], want: list[int], program) -> str:
    for s, (g, w) in enumerate(zip(got, want)):
        if g != w:
            st = program.steps[s]
            return f"step {s + 1} ({st.node.name} {st.phase}): pool {g}, plan {w}"
    return f"{len(got)} steps measured, {len(want)} planned"


def check_net(net: RandomNet, modes: tuple[str, ...] = MODES, iters: int = 2,
              tally: dict[tuple[str, str], int] | None = None, backend=None, rtol: float = 0.0) -> list[str]:
    """What broke the plan's promise on `net` (empty: nothing). `tally`, if given, counts per (mode, outcome)
    the runs ("trained", "refused at setup" where a smaller pool may be, "failed") and the trace comparisons
    ("traces compared", "traces differ"). `backend`: the CPU's by default; `rtol`: 0 asks for baseline's bits
    (the CPU), else weights and losses within that relative difference (a GPU, where the convolution
    algorithms follow the workspace a pool has free)."""
    problems: list[str] = []
    tally = {} if tally is None else tally

    def count(mode: str, outcome: str) -> None:
        tally[mode, outcome] = tally.get((mode, outcome), 0) + 1

    plans: dict[tuple[tuple[str, ...], bool], MemoryPlan] = {}

    def plan_for(types: tuple[str, ...], runtime: Net) -> MemoryPlan:
        """The plan of `runtime`'s tensors: the graph's, or where the Net keeps blobs channels last (a GPU under
        SUPERNEURONS_LAYOUT=nhwc or auto) its own graph and layout, which hold the layout's conversion rooms."""
        channels_last = runtime.blob_layouts.any
        if (types, channels_last) not in plans:
            graph, layout = (runtime.graph, runtime.layout) if channels_last else (net.graph(), None)
            plans[types, channels_last] = make_plan(graph, plan_backward=False, solver_history=net.seed % 2,
                                                    checkpoint_types=types, layout=layout)
        return plans[types, channels_last]

    ref = build(net, "baseline", backend=backend)
    plan = plan_for(DEFAULT_CHECKPOINTS, ref)
    params = ref.memory.param_bytes if hasattr(ref.memory, "param_bytes") else None
    ref_weights, ref_losses, _ = train(ref, iters)
    if params is None:
        params = ref.pool.used_bytes - plan.traces["baseline"].bytes[0]
    base = ref.pool.used_bytes - params
    count("baseline", "trained")
    count("baseline", "traces compared")
    if base != plan.traces["baseline"].bytes[0]:
        count("baseline", "traces differ")
        problems.append(f"baseline: pool holds {base} bytes of activations, plan {plan.traces['baseline'].bytes[0]}")

    def close(a, b) -> bool:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not rtol:
            return a.shape == b.shape and a.tobytes() == b.tobytes()  # bits: NaN equals NaN
        scale = float(np.nanmax(np.abs(b), initial=1))
        return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=rtol * scale, equal_nan=True))

    def same(mode: str, what: str, weights, losses) -> None:
        if not close(losses, ref_losses):
            problems.append(f"{mode} {what}: losses {losses} differ from baseline's {ref_losses}")
        elif len(weights) != len(ref_weights) or not all(close(w, r) for w, r in zip(weights, ref_weights)):
            problems.append(f"{mode} {what}: weights differ from baseline's")

    def attempt(mode: str, what: str, budget: int | None, cache: bool = True, may_refuse: bool = False,
                stream: bool | None = None):
        if budget is None and backend is not None and backend is not BACKEND:
            # A default pool is the device's free memory: while the caller still holds the previous Net,
            # the next could not get one. These nets are small: a fixed pool is room to spare.
            budget = GPU_SPARE_POOL
        try:
            runtime = build(net, mode, budget, cache, stream, backend)
        except UserError as e:
            count(mode, "refused at setup" if may_refuse else "failed")
            if not may_refuse:
                problems.append(f"{mode} {what}: refused: {e}")
            return None, None
        try:
            weights, losses, traces = train(runtime, iters)
        except UserError as e:
            count(mode, "failed")
            problems.append(f"{mode} {what}: failed mid-run: {e}")
            return None, None
        before = len(problems)
        same(mode, what, weights, losses)
        count(mode, "trained" if len(problems) == before else "failed")
        return runtime, traces

    def same_trace(mode: str, what: str, runtime: Net, traces, cache: bool = True) -> None:
        """The pool's trace against the plan of the mode the Net runs (auto: the one it picked, with its
        checkpoints): as planned without the cache, without the host moves with it and room to spare."""
        ran = runtime.memory.name
        if ran == "baseline":
            return  # checked above: everything placed at setup
        if not cache and settings.get("SUPERNEURONS_TRANSFER_LAG"):
            return  # a lagging copy out keeps its block while the pool has room: exact only when copies land at once
        mine = plan_for(tuple(runtime.checkpoint_types), runtime)
        want = simulate(mine.program, _without_moves(mine.schedules[ran])).bytes if cache else mine.traces[ran].bytes
        count(mode, "traces compared")
        for it, got in enumerate(traces):
            if got != want:
                count(mode, "traces differ")
                problems.append(f"{mode} {what} trace (iteration {it}): {_first_difference(got, want, mine.program)}")
                return

    for mode in modes:
        name, types = checkpoints_of(mode)
        if name == "baseline":
            continue
        mplan = plan_for(types or DEFAULT_CHECKPOINTS, ref)
        # Room to spare: the cache keeps everything it may; the pool holds the plan without its host moves.
        runtime, traces = attempt(mode, "default pool", None)
        if runtime is not None:
            same_trace(mode, "default pool", runtime, traces)
        if name in ("offload", "recompute"):
            # Without the cache every planned move is made: the pool holds exactly the plan.
            runtime, traces = attempt(mode, "without the tensor cache", None, cache=False)
            if runtime is not None:
                same_trace(mode, "without the tensor cache", runtime, traces, cache=False)
        planned = mplan.peak("liveness" if name == "auto" else name)[0]
        budget = params + planned
        for cache in ((True, False) if name in ("offload", "recompute") else (True,)):
            label = f"in a pool of the planned peak + parameters ({budget} bytes{'' if cache else ', no cache'})"
            runtime, traces = attempt(mode, label, budget, cache)
            if runtime is not None and runtime.params.offloaded:
                problems.append(f"{mode} {label}: streams the parameters, though the plan fits beside them")
            elif runtime is not None and (name in ("liveness", "auto") or not cache):
                same_trace(mode, label, runtime, traces, cache)  # nothing had to leave beyond the plan's moves
        # One block less: refused when the Net is built, or trains; never fails mid-run.
        attempt(mode, f"in a pool one block under the plan ({budget - BLOCK} bytes)", budget - BLOCK,
                may_refuse=True)
        if name in ("liveness", "offload", "recompute") and plan.param_bytes:
            # Parameters streamed from the host: the plan's streamed peak is enough, a block less is refused
            # or trains.
            streamed = mplan.streamed_peak(name)
            attempt(mode, f"with streamed parameters in a pool of the streamed peak ({streamed} bytes)", streamed,
                    stream=True)
            attempt(mode, f"with streamed parameters in a pool one block under ({streamed - BLOCK} bytes)",
                    streamed - BLOCK, stream=True, may_refuse=True)
    return problems


# -- the budget sweep ----------------------------------------------------------------------------

SWEEP_MODES = ("baseline", "liveness", "offload", "recompute", "auto")
SOLVER = ('type: "SGD" base_lr: 0.01 momentum: 0.9 lr_policy: "fixed" max_iter: 2 display: 0 random_seed: 3 '
          'solver_mode: CPU snapshot_after_train: false')
SOLVER_HISTORY = 1  # momentum SGD keeps one history blob per learnable parameter in the pool


PRECISIONS = ("FLOAT", "FLOAT16", "BFLOAT16")  # storage of activations and gradients (docs/PRECISION.md)


def with_dummy_data(net: RandomNet, precision: str = "FLOAT") -> str:
    """`net` reading DummyData (the Solver draws its own inputs) instead of its Input layer, its activations and
    gradients stored in `precision`."""
    _name, head, rest = net.text.split("\n", 2)
    layer = text_format.Parse(head.strip()[len("layer "):].strip()[1:-1], pb.LayerParameter())
    dims = " ".join(f"shape {{ {' '.join(f'dim: {d}' for d in s.dim)} }}" for s in layer.input_param.shape)
    types = f"default_forward_type: {precision} default_backward_type: {precision}\n" if precision != "FLOAT" else ""
    return (f'name: "random{net.seed}"\n{types}layer {{ name: "input" type: "DummyData" top: "data" top: "label" '
            'dummy_data_param { data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } '
            f"{dims} }} }}\n{rest}")


def sweep_budgets(needs: dict[str, int], count: int = 8) -> list[int]:
    """`count` pool sizes from the smallest mode's need to baseline's, in whole blocks, plus each mode's need and
    one block under it (where a promise is kept or broken)."""
    lo, hi = min(needs.values()), max(needs.values())
    even = {lo + (hi - lo) * k // max(1, count - 1) // BLOCK * BLOCK for k in range(count)}
    edges = {b for n in needs.values() for b in (n, n - BLOCK)}
    return sorted(b for b in even | edges if b > 0)


def sweep_needs(net: RandomNet, precision: str = "FLOAT") -> dict[str, int]:
    """The pool each mode of SWEEP_MODES needs under the solver (`MemoryPlan.need`); auto's is the least of the
    plans it weighs."""
    from superneurons.memory import checkpoint_sets

    graph = build_graph(text_format.Parse(with_dummy_data(net, precision), pb.NetParameter()), pb.TRAIN)
    needs: dict[str, int] = {}
    for types in checkpoint_sets(graph):  # the default first
        # as the Solver's Net plans: with the grouped SGD update's tables
        plan = make_plan(graph, plan_backward=False, solver_history=SOLVER_HISTORY, checkpoint_types=types,
                         update_chunk=CHUNK)
        for mode in SWEEP_MODES[:-1]:
            need = plan.need(mode)[0]
            if types == DEFAULT_CHECKPOINTS:
                needs[mode] = need
            needs["auto"] = min(needs.get("auto", need), need)
    return needs


def sweep_net(net: RandomNet, modes: tuple[str, ...] = SWEEP_MODES, count: int = 8,
              tally: dict[tuple[str, str], int] | None = None, precision: str = "FLOAT") -> list[str]:
    """Train `net` with momentum SGD (the Solver's own update, history in the pool) in every mode at every budget
    of `sweep_budgets`, its activations and gradients stored in `precision`: a run must be refused when its
    Solver is built exactly when the budget is below the plan's need for its mode, and train to the end
    otherwise. Returns what broke the promise."""
    from superneurons.runtime.logging import TrainLog
    from superneurons.solver import Solver

    needs = sweep_needs(net, precision)
    problems: list[str] = []
    tally = {} if tally is None else tally
    param = text_format.Parse(SOLVER, pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(with_dummy_data(net, precision), pb.NetParameter()))
    quiet = TrainLog(stream=open(os.devnull, "w"))
    for mode in modes:
        for budget in sweep_budgets(needs, count):
            below = budget < needs[mode]
            try:
                solver = Solver(param, "sweep.prototxt", memory=mode, pool_bytes=budget, log=quiet)
            except UserError as e:
                outcome = "refused at setup"
                if not below:
                    problems.append(f"{precision} {mode} at {budget} bytes (plan needs {needs[mode]}): refused: {e}")
            else:
                try:
                    solver.solve()
                    outcome = "trained"
                    if below and mode != "auto":
                        problems.append(f"{precision} {mode} at {budget} bytes trained, below the plan's {needs[mode]}: "
                                        "the plan counts bytes the run does not take")
                except UserError as e:
                    outcome = "failed midway"
                    problems.append(f"{precision} {mode} at {budget} bytes (plan needs {needs[mode]}): failed midway: {e}")
            tally[mode, outcome] = tally.get((mode, outcome), 0) + 1
    quiet.stream.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Random nets against the memory plan's promise.")
    ap.add_argument("--nets", type=int, default=50, help="how many nets (seeds start..start+nets-1)")
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--max-layers", type=int, default=14, help="layers the generator adds at most (before losses)")
    ap.add_argument("--show", action="store_true", help="print each failing net's prototxt")
    ap.add_argument("--sweep", action="store_true",
                    help="instead of check_net: sweep_net in every mode at 8 budgets and in every precision "
                         "(the Solver's momentum update; refused at setup exactly below the plan, else trained)")
    ap.add_argument("--gpu", type=int, default=None, metavar="ID",
                    help="run on this GPU (weights compared within a relative 1e-3, not by bits)")
    args = ap.parse_args(argv)
    backend, rtol = None, 0.0
    if args.gpu is not None:
        from superneurons.backend.cuda import CudaBackend

        backend, rtol = CudaBackend(args.gpu, tf32=False), 1e-3
    t0 = time.time()
    failed = 0
    features: dict[str, int] = {}
    tally: dict[tuple[str, str], int] = {}
    for seed in range(args.start, args.start + args.nets):
        net = random_net(seed, max_layers=max(4, args.max_layers))
        for f in net.features:
            features[f] = features.get(f, 0) + 1
        try:
            if args.sweep:
                problems = [p for precision in PRECISIONS for p in sweep_net(net, tally=tally, precision=precision)]
            else:
                problems = check_net(net, tuple(args.modes), tally=tally, backend=backend, rtol=rtol)
        except Exception as e:  # a crash is a finding too: report it with its seed
            problems = [f"crashed: {type(e).__name__}: {e}"]
        if problems:
            failed += 1
            print(f"seed {seed} ({net.layers} layers): {len(problems)} problem(s)")
            for p in problems:
                print(f"  {p}")
            if args.show:
                print(net.text)
        if (seed - args.start + 1) % 10 == 0:  # a long run says how far it got
            counts = {o: sum(n for (_, out), n in tally.items() if out == o) for o in ("trained", "failed midway")}
            print(f"... {seed - args.start + 1} nets, {failed} with problems, {counts}, {time.time() - t0:.0f} s")
        sys.stdout.flush()
    if args.sweep:
        outcomes, args.modes = ("trained", "refused at setup", "failed midway"), list(SWEEP_MODES)
    print(f"{args.nets} nets (seeds {args.start}..{args.start + args.nets - 1}), modes {' '.join(args.modes)}: "
          f"{failed} with problems, {time.time() - t0:.0f} s")
    outcomes = ("trained", "refused at setup", "failed", "traces compared", "traces differ")
    for mode in args.modes:
        print(f"  {mode:15s} " + ", ".join(f"{o} {tally.get((mode, o), 0)}" for o in outcomes))
    print("features: " + ", ".join(f"{k} {v}" for k, v in sorted(features.items())))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
