"""Shared pieces of the tools/bench scripts: the nets, the planner's predictions, running our
Solver and PyTorch in isolated worker processes, timing, tables and JSON.

The scripts import this module as `common` (tools/bench is a folder of scripts, not a package). It is
also the worker: `python3 -m tools.bench.common worker '<json list of tasks>'` runs the tasks in order in
one fresh process and prints one `BENCH_RESULT <json>` line per task. Each measurement that could crash
the process or fragment the device (an OOM probe, a different allocator, a large net) runs that way, so
it cannot poison the next one.

Budgets: under `--budget 12G` our process may use 12 GiB of device memory in all: the Net's pool
(activations, parameters, their gradients and the solver's history, all pool tensors, streamed from the
host when they do not fit beside the activations) and the cuDNN workspace. So the pool gets
budget - workspace, and the cuDNN workspace limit is set to `--workspace`.
PyTorch gets `torch.cuda.set_per_process_memory_fraction(budget / total)`, which caps its caching
allocator (parameters, gradients, momentum, activations, cuDNN workspace). Neither counts the CUDA
context.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata as md
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_BUDGET = "12G"
DEFAULT_WORKSPACE = "256M"
UNCAPPED = 60 * (1 << 30)  # 'no cap' for ours: fits an H100 (80 GB) and an H200; auto still picks baseline below it  # cuDNN workspace reserved out of a budget (ours); PyTorch's comes from its cap
RESULT_TAG = "BENCH_RESULT "


@dataclass(frozen=True)
class NetSpec:
    name: str  # our short name (--nets)
    label: str  # for tables
    prototxt: str  # DummyData training net, relative to ROOT
    solver: str
    torchvision: str | None  # torchvision.models constructor, or None: PyTorch builds it from the prototxt
    speed_batch: int  # a batch both systems train at full device memory (Fig. 14)
    # PyTorch under a 12 GiB cap as measured on an H200 (docs/BENCHMARKS.md): where the probes start.
    torch_plain_widest: int | None = None
    torch_checkpoint_widest: int | None = None


def _spec(name: str, label: str, tv: str | None, speed_batch: int, plain: int | None = None,
          ckpt: int | None = None) -> NetSpec:
    return NetSpec(name, label, f"models/{name}/{name}_dummy.prototxt", f"models/{name}/{name}_dummy_solver.prototxt",
                   tv, speed_batch, plain, ckpt)


NETS: dict[str, NetSpec] = {s.name: s for s in (
    _spec("alexnet", "AlexNet", "alexnet", 256, 2624),
    _spec("vgg16", "VGG16", "vgg16", 64, 144),
    _spec("resnet50", "ResNet-50", "resnet50", 64, 136, 336),
    _spec("resnet101", "ResNet-101", "resnet101", 64, 96, 256),
    _spec("resnet152", "ResNet-152", "resnet152", 64, 64, 184),
    _spec("inception_v4", "Inception-v4", None, 64, 68),
    _spec("densenet121", "DenseNet-121", "densenet121", 64, 96),
    _spec("mobilenet", "MobileNet", None, 64),  # v1: torchvision has only v2 and v3
    _spec("squeezenet", "SqueezeNet", "squeezenet1_0", 64),  # v1.0 (7x7 conv1, 96 filters), as torchvision's
    _spec("cifar10_quick", "CIFAR-10 quick", None, 100),  # tiny: CPU tests of the plumbing
)}
PAPER_NETS = ("alexnet", "vgg16", "resnet50", "resnet101", "resnet152", "inception_v4")
SPEED_NETS = PAPER_NETS + ("densenet121", "mobilenet", "squeezenet")  # the speed table's rows
RESNETS = ("resnet50", "resnet101", "resnet152")

# Deep ResNets of tools/models/make_resnet.py: blocks 6,32,N,6 (depth 3 * (44 + N) + 2), batch 16 (paper Table 4).
DEEP_STAGES = (6, 32, None, 6)
TORCH_DEEP_PLAIN_N = 176  # 662 layers (an earlier H200 measurement, docs/BENCHMARKS.md "Depth")
TORCH_DEEP_CHECKPOINT_N = 544  # 1766 layers (the same)


# ---------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------
def base_parser(doc: str, nets: Sequence[str], iterations: int = 10) -> argparse.ArgumentParser:
    """The flags every script shares; each script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nets", default=",".join(nets), help="comma-separated nets (default: %(default)s); "
                    f"known: {', '.join(NETS)}")
    ap.add_argument("--batches", default="",
                    help="batches: '64,128' for every net, or per net 'resnet50=64:128,alexnet=256'")
    ap.add_argument("--iterations", type=int, default=iterations, help="timed iterations (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="only the most important rows (about a minute)")
    ap.add_argument("--budget", default=DEFAULT_BUDGET, help="device memory budget (default %(default)s)")
    ap.add_argument("--workspace", default=DEFAULT_WORKSPACE,
                    help="cuDNN workspace limit of ours, taken out of the budget (default %(default)s)")
    ap.add_argument("--no-torch", action="store_true", help="measure only SuperNeurons")
    ap.add_argument("--no-ours", action="store_true", help="measure only PyTorch")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per worker process (default %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON (default $OUT or .)")
    ap.add_argument("--tag", default="", help="suffix of the JSON name, for a run split over several calls")
    return ap


# The PyTorch configuration (tools/bench/torch_nets.py's TORCH_CONFIGS) set beside each of our precisions in
# the memory benchmarks: what a PyTorch user who wants that storage runs. float32 as PyTorch runs by default;
# bfloat16 and float16 as autocast with channels_last (float16 with its GradScaler), which keep the weights,
# their gradients and the optimizer's state in float32 as our solver does.
PRECISION_TORCH_CONFIG = {"fp32": "fp32", "bf16": "bf16-cl", "fp16": "fp16-cl"}


def add_precision_argument(ap: argparse.ArgumentParser) -> None:
    """--precision of the memory benchmarks (wider, deeper): ours and the planner in it, PyTorch in the
    matching configuration."""
    ap.add_argument("--precision", choices=tuple(PRECISION_TORCH_CONFIG), default="fp32",
                    help="storage of activations and gradients: ours and the planner as --precision of train, "
                         "PyTorch in " + ", ".join(f"{c} for {p}" for p, c in PRECISION_TORCH_CONFIG.items())
                         + " (default %(default)s)")


def precision_tag(tag: str, precision: str) -> str:
    """The JSON name's suffix: a half-precision run's file names its precision, so that it neither replaces
    the float32 run's in the same folder nor is read as it (speed_zoo.py reads wider*.json)."""
    return "_".join(t for t in (tag, "" if precision == "fp32" else precision) if t)


def kernel_parser(doc: str, net: str) -> argparse.ArgumentParser:
    """The flags of the scripts that time one kind of kernel over a net's shapes: --net, --batch, --repeat
    (CUDA-event timings per call, the median taken) and --out; each script adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default=net, help="the net whose shapes are timed (default %(default)s)")
    ap.add_argument("--batch", type=int, default=64, help="default %(default)s")
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per shape (default %(default)s)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON (default $OUT or .)")
    return ap


def parse_nets(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NETS]
    if unknown:
        raise SystemExit(f"unknown net(s) {', '.join(unknown)}; known: {', '.join(NETS)}")
    return names


def parse_batches(text: str) -> dict[str, list[int]] | list[int]:
    """'64,128' -> [64, 128] (every net); 'resnet50=64:128,alexnet=256' -> {'resnet50': [64, 128], ...}."""
    text = text.strip()
    if not text:
        return []
    if "=" not in text:
        return [int(b) for b in text.split(",") if b.strip()]
    out: dict[str, list[int]] = {}
    for part in text.split(","):
        name, _, values = part.partition("=")
        out[name.strip()] = [int(b) for b in values.split(":") if b.strip()]
    return out


def batches_for(net: str, batches: dict[str, list[int]] | list[int], default: Sequence[int]) -> list[int]:
    if isinstance(batches, dict):
        return list(batches.get(net, default))
    return list(batches) or list(default)


def net_batches(args: argparse.Namespace, default: Sequence[int] | None = None) -> list[tuple[str, NetSpec, int]]:
    """(net, its spec, batch) for every net of --nets and every batch --batches gives it; without one,
    `default` (the net's speed_batch when None)."""
    batches = parse_batches(args.batches)
    return [(net, NETS[net], b) for net in parse_nets(args.nets)
            for b in batches_for(net, batches, [NETS[net].speed_batch] if default is None else default)]


def parse_size(text: str | int | None) -> int | None:
    if text is None or text == "":
        return None
    from superneurons.memory.pool import parse_size as _parse

    return _parse(str(text))


# ---------------------------------------------------------------------------------------------------
# Nets and the planner (no device)
# ---------------------------------------------------------------------------------------------------
def net_param(net: str, batch: int | None = None, precision: str | None = None):
    """The NetParameter of a known net, or of a deep ResNet written as 'deep:N' (blocks 6,32,N,6).
    `precision` ("fp32", "bf16", "fp16"; None: the prototxt's types) sets the net's default storage types
    as --precision of train does (graph/precision.py), so the planner sizes the activations the run stores."""
    from superneurons.graph.batch import set_batch
    from superneurons.graph.precision import override_defaults
    from superneurons.io.prototxt import read_net

    if net.startswith("deep:"):
        from tools.models.make_resnet import make_resnet

        return override_defaults(make_resnet(deep_blocks(int(net[5:])), batch=batch or 16), precision)
    p = read_net(str(ROOT / NETS[net].prototxt))
    if batch:
        set_batch(p, batch)
    return override_defaults(p, precision)


def deep_blocks(n: int) -> list[int]:
    return [n if b is None else b for b in DEEP_STAGES]


def deep_depth(n: int) -> int:
    return 3 * sum(deep_blocks(n)) + 2


def train_graph(net: str, batch: int | None = None, precision: str | None = None, master: str = "FLOAT"):
    """`master`: the solver's solver_data_type by its enum name (FLOAT, FLOAT16, BFLOAT16), the storage of the
    weights, their gradients and the history, which the Solver sets on the graph before building the Net."""
    from superneurons.graph.build import build_graph
    from superneurons.proto import superneurons_pb2 as pb
    from superneurons.solver.solver import master_type

    graph = build_graph(net_param(net, batch, precision), pb.TRAIN, source=net)
    graph.precision.master = master_type(solver_data_type(master), "--solver-data-type")
    return graph


SOLVER_DATA_TYPES = ("FLOAT", "FLOAT16", "BFLOAT16")


def solver_data_type(name: str):
    """A SolverParameter with solver_data_type `name` (NVCaffe's enum names)."""
    from superneurons.proto import superneurons_pb2 as pb

    param = pb.SolverParameter()
    param.solver_data_type = pb.Type.Value(name)
    return param


def solver_history(net: str) -> int:
    """History blobs per learnable parameter of the net's solver (SGD with momentum: 1)."""
    from superneurons.io.prototxt import read_solver
    from superneurons.solver.updates import get_rule

    path = ROOT / (NETS[net].solver if not net.startswith("deep:") else NETS["resnet50"].solver)
    return get_rule(read_solver(str(path)), str(path)).n_history


@dataclass
class Need:
    """What the planner says a net needs on the device (and, when parameters stream, on the host), bytes."""

    batch: int
    mode: str | None  # what `--memory auto` picks for the pool (None: nothing fits)
    peaks: dict[str, int]  # activation peak per mode
    params: int  # parameters + gradients (in the pool, or streamed from the host)
    history: int  # solver history (in the pool with them, or streamed)
    offloaded: int  # bytes the offload plan moves per iteration
    streams: bool = False  # the picked mode needs the parameters streamed from the host
    streamed_peak: int = 0  # the picked mode's device peak with streamed parameters (activations + one step's)
    host: int = 0  # pinned host bytes the picked mode may use: the host store's at most, plus streamed parameters
    checkpoint_types: tuple[str, ...] = ()  # the checkpoint set auto picked with the mode (memory/cost.py)

    def total(self, mode: str, workspace: int) -> int:
        """Device bytes: the pool (activations, and parameters with history unless streamed) + workspace."""
        if self.streams and mode == self.mode:
            return self.streamed_peak + workspace
        return self.peaks[mode] + self.params + self.history + workspace


# Pinned host memory the planner lets our run use: this share of the machine's RAM, not all of it -- the OS,
# this process (the dataset, NumPy, the CUDA context) and the PyTorch runs beside ours need the rest, and
# locking most of RAM makes the kernel swap or refuse. On the 128 GiB GPU machine: 76.8 GiB.
HOST_PINNED_FRACTION = 0.6


def host_pinned_limit(fraction: float = HOST_PINNED_FRACTION) -> int:
    from superneurons.memory.host import host_memory_bytes

    return int(host_memory_bytes() * fraction)


HOST_PINNED_LIMIT = host_pinned_limit()


def host_env(host_limit: int) -> dict[str, str]:
    """A worker's environment that holds its run's `--memory auto` to the pinned host memory the planner's
    prediction allowed (memory/host.py), so both weigh the same candidates."""
    return {"SUPERNEURONS_HOST_MEMORY_MB": str(host_limit >> 20)}


def host_bytes(plan: Any, mode: str, streams: bool) -> int:
    """Pinned host memory `mode` may take, an upper bound (`MemoryPlan.host_bytes`)."""
    return plan.host_bytes(mode, streams)


def plan_need(net: str, batch: int, budget: int | None = None, workspace: int = 0,
              host_limit: int = HOST_PINNED_LIMIT, precision: str | None = None, master: str = "FLOAT") -> Need:
    """The planner's figures; with a budget, the mode `--memory auto` picks in a pool of budget - workspace
    (parameters, gradients and history are pool tensors, streamed from the host when they do not fit
    beside the activations), provided the host memory that mode pins stays within `host_limit`.
    `precision`: the storage type of activations and gradients, as our run's (`net_param`); `master`: the
    solver_data_type of the weights, their gradients and history (`train_graph`)."""
    from superneurons.errors import UserError
    from superneurons.memory import checkpoint_sets
    from superneurons.memory.cost import choose
    from superneurons.memory.plan import make_plan, offloaded_bytes

    graph = train_graph(net, batch, precision, master)
    plans: dict[tuple[tuple[str, ...], int], Any] = {}

    def plan_for(types: tuple[str, ...], modes=None, recompute_limit: int = 0) -> Any:
        # Every mode once per checkpoint set and limit: the host bytes and peaks below read the chosen plan.
        if (types, recompute_limit) not in plans:
            plans[types, recompute_limit] = make_plan(graph, train=True, solver_history=solver_history(net),
                                                      checkpoint_types=types, recompute_limit=recompute_limit)
        return plans[types, recompute_limit]

    sets = checkpoint_sets(graph, None)
    plan = plan_for(sets[0])
    history = plan.param_bytes - param_bytes_of(graph)
    peaks = {m: plan.peak(m)[0] for m in plan.traces}
    need = Need(batch, None, peaks, plan.param_bytes - history, history, offloaded_bytes(plan, "offload"))
    if budget is None:
        return need
    pool = budget - workspace
    try:
        choice = choose(pool, sets, plan_for, host_limit)  # what `--memory auto` picks (memory/cost.py)
    except UserError:
        return need
    chosen = plans[choice.checkpoint_types, choice.recompute_limit]
    need.checkpoint_types = choice.checkpoint_types
    need.peaks = {m: chosen.peak(m)[0] for m in chosen.traces}  # the peaks of the plan auto runs
    need.streams = choice.streams_params
    need.streamed_peak = chosen.streamed_peak(choice.mode) if need.streams else 0
    need.host = host_bytes(chosen, choice.mode, need.streams)
    need.mode = choice.mode if need.host <= host_limit else None
    return need


def param_bytes_of(graph: Any) -> int:
    from superneurons.memory.plan import param_bytes

    return param_bytes(graph, True, 0)


def largest_fitting(fits: Callable[[int], bool], step: int = 8, start: int = 64, limit: int = 1 << 16) -> int:
    """The largest multiple of `step` for which the monotone `fits` holds (0 when `step` does not fit):
    doubling from `start`, then bisection; about 2 log2(answer / step) calls."""
    if not fits(step):
        return 0
    lo, hi = step, max(step, start // step * step)
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    # fits(lo) holds; fits(hi) fails (or hi is past the limit)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def search_edge(fits: Callable[[int], bool], start: int, step: int = 8, max_probes: int = 8) -> int:
    """The largest multiple of `step` where the monotone `fits` holds, probing from a good guess `start`
    (a figure measured before): up or down by step, 2 step, 4 step... until the edge is bracketed, then
    bisection. Returns 0 when nothing fits; stops after `max_probes` calls with the best fit so far."""
    seen: dict[int, bool] = {}

    def probe(v: int) -> bool:
        if v not in seen:
            seen[v] = fits(v)
        return seen[v]

    v = max(step, start // step * step)
    jump = step
    if probe(v):
        lo, hi = v, None
        while len(seen) < max_probes:
            if probe(lo + jump):
                lo, jump = lo + jump, jump * 2
            else:
                hi = lo + jump
                break
    else:
        lo, hi = 0, v
        while len(seen) < max_probes and hi - jump >= step:
            if probe(hi - jump):
                lo = hi - jump
                break
            hi, jump = hi - jump, jump * 2
        if lo == 0 and hi - jump < step and hi > step and len(seen) < max_probes:
            lo = step if probe(step) else 0
            if not lo:
                return 0
    while hi is not None and hi - lo > step and len(seen) < max_probes:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return lo


def predict_widest(net: str, budget: int, workspace: int, step: int = 8, precision: str | None = None,
                   host_limit: int = HOST_PINNED_LIMIT) -> tuple[int, Need | None]:
    """Our widest batch (a multiple of `step`) whose cheapest fitting mode fits the budget, by the planner,
    with activations stored in `precision` and the pinned host memory within `host_limit`."""
    cache: dict[int, Need] = {}

    def fits(b: int) -> bool:
        cache[b] = plan_need(net, b, budget, workspace, host_limit, precision)
        return cache[b].mode is not None

    best = largest_fitting(fits, step, start=NETS[net].torch_checkpoint_widest or NETS[net].speed_batch)
    return best, cache.get(best)


def predict_deepest(budget: int, workspace: int, batch: int = 16, step: int = 8, host_limit: int = HOST_PINNED_LIMIT,
                    precision: str | None = None, master: str = "FLOAT") -> tuple[int, Need | None]:
    """The largest N (multiple of `step`) for which make_resnet 6,32,N,6 at `batch` fits the budget; with
    parameter streaming the device need hardly grows with N, so the host's pinned memory bounds it."""
    cache: dict[int, Need] = {}

    def fits(n: int) -> bool:
        cache[n] = plan_need(f"deep:{n}", batch, budget, workspace, host_limit, precision, master)
        return cache[n].mode is not None

    best = largest_fitting(fits, step, start=64, limit=1 << 14)
    return best, cache.get(best)


# ---------------------------------------------------------------------------------------------------
# Timing, device, versions
# ---------------------------------------------------------------------------------------------------
def time_loop(step: Callable[[], Any], sync: Callable[[], None], warmup: int, iterations: int) -> dict:
    """Run `step` warmup + iterations times; the clock covers the timed ones, device synchronized."""
    t0 = time.perf_counter()
    for _ in range(max(0, warmup)):
        step()
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    sync()
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "ms_per_iter": 1e3 * elapsed / max(1, iterations), "warmup_s": warm_s,
            "iterations": iterations}


def versions() -> dict[str, str]:
    v = {"python": platform.python_version()}
    for dist in ("numpy", "numba", "numba-cuda", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "torch",
                 "torchvision", "superneurons"):
        try:
            v[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return v


def device_info() -> dict[str, Any]:
    """The GPU as nvidia-smi names it (no CUDA context is created here), or 'cpu'."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    if not line:
        return {"name": "cpu (no nvidia-smi)"}
    name, mem, driver = (s.strip() for s in (line.split(",") + ["", ""])[:3])
    return {"name": name, "memory": mem, "driver": driver}


# ---------------------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------------------
def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus `env`, with the repository first on PYTHONPATH, so that a child
    `python -m tools.bench.<name>` finds the tools package and superneurons from any working directory."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH", "")]))
    return full_env


def run_worker(tasks: list[dict], timeout: int = 300, env: dict[str, str] | None = None,
               log: Path | None = None) -> list[dict]:
    """Run `tasks` in order in one fresh Python process; one result per task. A crash or timeout gives
    {'ok': False, 'error': ...} for the tasks it did not finish, with the tail of the process output."""
    cmd = [sys.executable, "-m", "tools.bench.common", "worker", json.dumps(tasks)]
    full_env = child_env(env)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = _text(e.stdout) + _text(e.stderr)
        rc = None
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ worker {json.dumps(tasks)} env={env or {}}\n{output}\n")
    results = [json.loads(line[len(RESULT_TAG):]) for line in output.splitlines() if line.startswith(RESULT_TAG)]
    why = f"timed out after {timeout} s" if rc is None else f"worker exited with status {rc}"
    tail = "\n".join(output.strip().splitlines()[-8:])
    for task in tasks[len(results):]:
        results.append({"ok": False, "task": task, "error": f"{why}: {tail}"})
    for r in results:
        r.setdefault("worker_s", time.perf_counter() - t0)
    return results


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _worker_main(tasks: list[dict]) -> int:
    for task in tasks:
        t0 = time.perf_counter()
        try:
            result = TASKS[task["kind"]](**{k: v for k, v in task.items() if k != "kind"})
            result.setdefault("ok", True)
        except Exception as e:  # one task's failure is its result; the next task still runs
            result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc(limit=6)}
        result["task"] = task
        result["task_s"] = time.perf_counter() - t0
        print(RESULT_TAG + json.dumps(result, default=float), flush=True)
        _release_device()  # the next task starts with the memory this one held
    return 0


# ---------------------------------------------------------------------------------------------------
# Ours (runs inside a worker)
# ---------------------------------------------------------------------------------------------------
def make_backend(device: str, workspace: int | None):
    if device == "cpu":
        from superneurons.backend import get_backend

        return get_backend("cpu")
    from superneurons.backend.cuda import CudaBackend

    kwargs = {"workspace_limit": workspace} if workspace is not None else {}
    return CudaBackend(int(device.split(":")[-1]) if ":" in device else 0, **kwargs)


def make_solver(net: str, batch: int, backend: Any, memory: str, pool_bytes: int | None, checkpoints: str = "",
                factory: Callable[..., Any] | None = None, master: str = "FLOAT", **solver_kwargs: Any):
    """Our Solver for `net` at `batch` (no test nets, no display, no snapshots) with a pool of `pool_bytes`
    (None: the runtime's default); `checkpoints`: comma-separated checkpoint layer types ("": the default).
    `factory`: the solver class (default Solver; scaling.py's ranks use the data-parallel RankSolver), given
    `solver_kwargs` besides. `master`: solver_data_type by its enum name (FLOAT: the solver's default)."""
    from superneurons.io.prototxt import read_solver
    from superneurons.solver.solver import Solver

    spec = NETS["resnet50" if net.startswith("deep:") else net]
    param = read_solver(str(ROOT / spec.solver))
    param.display = 0
    param.ClearField("test_iter")  # a test net would take a second pool
    param.test_interval = 0
    param.snapshot = 0
    param.snapshot_after_train = False
    param.max_iter = 1 << 30
    if master != "FLOAT":
        param.solver_data_type = solver_data_type(master).solver_data_type
    param.ClearField("net")
    param.net_param.CopyFrom(net_param(net, batch))
    if checkpoints:
        param.memory_param.checkpoint_type[:] = checkpoints.split(",")
    return (factory or Solver)(param, str(ROOT / spec.solver), backend=backend, memory=memory, pool_bytes=pool_bytes,
                               **solver_kwargs)


def history_bytes(solver: Any) -> int:
    from superneurons.layers.base import count
    from superneurons.memory.pool import round_up

    size = solver.net.graph.precision.master.itemsize  # solver_data_type
    return solver.rule.n_history * sum(round_up(size * count(d.shape)) for d in solver.net.learnable)


def freeze_data(solver: Any) -> None:
    """Keep the first drawn batch on the device: DummyData regenerates it on the host every iteration
    (160 ms at ResNet-50 batch 64), and PyTorch's loop reuses one tensor too."""
    for node in solver.net.graph.nodes:
        if node.layer.is_data:
            node.layer.forward = lambda bottom, top: None  # instance attribute shadows the method


MEMORY_COUNTERS = ("allocs", "frees", "bytes_offloaded", "bytes_prefetched", "hits", "misses", "replays")


def counters(manager: Any) -> dict[str, int]:
    """Cumulative counters of a memory manager: `stats()["total"]` where the manager has it (movement
    counters), attributes otherwise; a counter a manager lacks reads 0."""
    out = {k: int(getattr(manager, k, 0) or 0) for k in MEMORY_COUNTERS}
    stats = getattr(manager, "stats", None)
    if callable(stats):
        out.update({k: int(v) for k, v in (stats().get("total") or {}).items() if k in out})
    return out


def ours_task(net: str, batch: int, memory: str = "auto", budget: int | None = None, workspace: int | None = None,
              iterations: int = 10, warmup: int = 3, device: str = "cuda", algorithms: bool = False,
              trace: bool = False, expect_allocator: str | None = None, profile: int = 0,
              checkpoints: str = "", precision: str | None = None, master: str = "FLOAT") -> dict:
    """Build our Solver and train: warmup + iterations steps, timed; memory counters per timed iteration.
    `profile` > 0: run the timed loop under cProfile and keep that many lines of its report (by own time),
    to show where host time goes."""
    from superneurons.errors import PoolExhausted, UserError

    backend = make_backend(device, workspace)
    pool_bytes = None
    if budget is not None:
        # Solver history is a pool tensor like the weights (streamed with them when they do not fit).
        pool_bytes = budget - (workspace or 0)
    try:
        t0 = time.perf_counter()
        # precision: the Solver's `precision=` (as --precision of train), passed only when asked for
        solver = make_solver(net, batch, backend, memory, pool_bytes, checkpoints, master=master,
                             **({"precision": precision} if precision else {}))
        build_s = time.perf_counter() - t0
    except (PoolExhausted, UserError) as e:
        return {"ok": False, "fits": False, "error": f"{type(e).__name__}: {e}", "batch": batch}
    mgr = solver.net.memory
    pool = solver.net.pool
    result: dict[str, Any] = {"net": net, "batch": batch, "memory": memory, "memory_mode": mgr.name,
                              "precision": precision or "fp32", "solver_data_type": master,
                              "auto": mgr.auto.summary() if mgr.auto else None,
                              "recompute_limit": mgr.recompute_limit, **ours_settings(),
                              "pool_bytes": pool.capacity, "pool_class": type(pool).__name__,
                              "history_bytes": history_bytes(solver), "workspace_limit": workspace,
                              "build_s": build_s, "budget": budget,
                              # the layout the Net chose (SUPERNEURONS_LAYOUT; `auto` decides per net and type)
                              "channels_last_blobs": len(solver.net.blob_layouts.blobs)}
    if expect_allocator and result["pool_class"] == "HeapPool":
        # SUPERNEURONS_ALLOCATOR=malloc must swap the pool for per-tensor cudaMalloc; if it did not, the
        # measurement would silently time the pool twice.
        return {**result, "ok": False,
                "error": f"SUPERNEURONS_ALLOCATOR={os.environ.get('SUPERNEURONS_ALLOCATOR')} was not honoured: "
                         f"the Net's pool is still {result['pool_class']}"}
    losses: list[float] = []
    solver.callbacks.append(lambda s, it, loss: losses.append(float(loss)))
    try:
        t0 = time.perf_counter()
        solver.step(1)  # draws the batch, compiles kernels, picks convolution algorithms
        freeze_data(solver)
        backend.synchronize()
        result["first_iteration_s"] = time.perf_counter() - t0
        if warmup > 1:
            solver.step(warmup - 1)
        backend.synchronize()
        before = counters(mgr)
        replayed = solver.net.replayed_passes
        profiler = cProfile.Profile() if profile else None
        if profiler:
            profiler.enable()
        timing = time_loop(lambda: solver.step(1), backend.synchronize, 0, iterations)
        if profiler:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile)
            result["profile"] = text.getvalue()
        after = counters(mgr)
    except (PoolExhausted, UserError) as e:
        return {**result, "ok": False, "fits": False, "error": f"{type(e).__name__}: {e}"}
    n = max(1, iterations)
    result.update(timing)
    result["fits"] = result["ok"] = True
    result["img_per_s"] = batch * iterations / timing["seconds"] if iterations else None
    result["per_iteration"] = {k: (after[k] - before[k]) / n for k in MEMORY_COUNTERS}
    # timed passes run as CUDA graphs (SUPERNEURONS_CUDA_GRAPH, runtime/graph_replay.py): 0 where they ran eagerly
    result["graph_replayed"] = solver.net.replayed_passes - replayed
    result["losses"] = losses
    result["pool_high_water"] = pool.high_water
    result["host_pinned_bytes"] = int(getattr(mgr, "host_pinned_bytes", 0) or 0)
    if trace:
        result["trace"] = list(getattr(mgr, "trace", []))
    if algorithms:
        result["algorithms"] = conv_algorithms(solver.net)
    return result


def ours_settings() -> dict[str, Any]:
    """The settings of ours that a speed comparison must state beside PyTorch's (superneurons/settings.py):
    TF32 for cuDNN convolutions (cuBLAS GEMMs always run in FP32) and how convolution algorithms are
    chosen (measured on the real operands, PyTorch's cudnn.benchmark counterpart, or cuDNN's heuristics)."""
    from superneurons import settings
    from superneurons.backend.cuda.cudnn import measures_algorithms

    return {"tf32_convolutions": bool(settings.get("SUPERNEURONS_TF32")), "tf32_gemm": False,
            "algorithm_choice": "measurement" if measures_algorithms() else "heuristics"}


def conv_algorithms(net: Any) -> list[dict]:
    """The cuDNN algorithms (and workspace) each Convolution layer uses, as `superneurons time` shows them."""
    return [{"layer": node.name, "algo": str(node.layer.algo_name or "")}
            for node in net.graph.nodes if node.layer.param.type in ("Convolution", "Deconvolution")]


def ours_widest_task(net: str, start: int, budget: int, workspace: int, step: int = 8, tries: int = 4,
                     iterations: int = 2, device: str = "cuda", memory: str = "auto",
                     precision: str | None = None) -> dict:
    """Verify the planner's widest batch by training `iterations` steps; step down on failure. `precision`:
    ours_task's (None: float32, the Solver's default)."""
    attempts = []
    batch = start
    for _ in range(tries):
        if batch <= 0:
            break
        r = ours_task(net, batch, memory=memory, budget=budget, workspace=workspace, iterations=iterations,
                      warmup=1, device=device, precision=precision)
        attempts.append({k: r.get(k) for k in ("batch", "ok", "fits", "memory_mode", "error", "img_per_s",
                                                "pool_high_water", "per_iteration")})
        if r.get("ok"):
            return {"widest": batch, "memory_mode": r.get("memory_mode"), "precision": r.get("precision"),
                    "attempts": attempts}
        batch -= max(step, (batch // 32) // step * step)  # ~3 % per retry, whole steps
        _release_device()
    return {"ok": False, "widest": None, "attempts": attempts, "error": "no verified batch"}


def ours_deepest_task(start: int, budget: int, workspace: int, batch: int = 16, step: int = 8, tries: int = 3,
                      iterations: int = 2, device: str = "cuda", precision: str | None = None,
                      master: str = "FLOAT") -> dict:
    attempts = []
    n = start
    for _ in range(tries):
        if n <= 0:
            break
        r = ours_task(f"deep:{n}", batch, budget=budget, workspace=workspace, iterations=iterations, warmup=1,
                      device=device, precision=precision, master=master)
        attempts.append({"n": n, "depth": deep_depth(n), **{k: r.get(k) for k in ("ok", "memory_mode", "error",
                                                                                    "ms_per_iter")}})
        if r.get("ok"):
            return {"deepest_n": n, "depth": deep_depth(n), "memory_mode": r.get("memory_mode"),
                    "precision": r.get("precision"), "attempts": attempts}
        n -= step
        _release_device()
    return {"ok": False, "deepest_n": None, "attempts": attempts, "error": "no verified depth"}


def _release_device() -> None:
    """Let the next try find the memory of the last: drop references, and numba's deferred frees."""
    gc.collect()
    if "superneurons.backend.cuda" not in sys.modules:
        return  # no device context of ours to clean (and none to create)
    try:
        from numba import cuda

        cuda.current_context().deallocations.clear()
    except Exception:
        pass


def memory_trace_task(net: str, batch: int, modes: Sequence[str], device: str = "cuda", tight: bool = True) -> dict:
    """Per mode: our Net's measured pool bytes per step (the manager's trace) beside the plan's.

    With `tight`, each mode's pool is its plan's peak plus the parameters (+10 % against fragmentation:
    first fit over 1 KiB blocks cannot always place a large tensor in a pool of exactly the peak),
    so the offload manager's Tensor Cache really evicts; otherwise the pool holds everything and
    offload moves nothing (then its trace is liveness's)."""
    from superneurons.memory.plan import make_plan
    from superneurons.runtime.net import Net

    out: dict[str, Any] = {"net": net, "batch": batch, "modes": {}, "tight": tight}
    backend = make_backend(device, None)
    for mode in modes:
        graph = train_graph(net, batch)
        plan = make_plan(graph, train=True, modes=(mode,), plan_backward=False)
        pool_bytes = None
        if tight:
            pool_bytes = int((plan.peak(mode)[0] + plan.param_bytes) * 1.10) + MiB
        try:
            nt = Net(graph, backend, train=True, seed=1, memory=mode, pool_bytes=pool_bytes)
            nt.forward_backward()
            nt.forward_backward()  # the second iteration is the steady state (outputs of the first freed)
            backend.synchronize()
        except Exception as e:  # one mode's failure must not hide the others' traces
            out["modes"][mode] = {"error": f"{type(e).__name__}: {e}", "planned": [int(b) for b in
                                                                                   plan.traces[mode].bytes]}
            out["ok"] = False
            out["error"] = f"{mode}: {type(e).__name__}: {e}"
            _release_device()
            continue
        measured = [int(b) for b in getattr(nt.memory, "trace", [])]
        planned = [int(b) for b in plan.traces[mode].bytes]
        diffs = [abs(a - b) for a, b in zip(measured, planned)]
        out["modes"][mode] = {"measured": measured, "planned": planned, "steps": len(planned),
                              "max_abs_diff": max(diffs) if diffs else None,
                              "equal": measured == planned, "pool_bytes": nt.pool.capacity,
                              "counters": counters(nt.memory)}
        del nt
        _release_device()
    return out


# ---------------------------------------------------------------------------------------------------
# PyTorch (runs inside a worker)
# ---------------------------------------------------------------------------------------------------
def torch_task(net: str, variant: str, batch: int, iterations: int = 10, warmup: int = 3, budget: int | None = None,
               source: str = "auto", benchmark: bool = False, tf32: bool | None = None, config: str = "fp32") -> dict:
    from tools.bench import torch_nets

    return torch_nets.measure(net, variant, batch, iterations=iterations, warmup=warmup, budget=budget,
                              source=source, benchmark=benchmark, tf32=tf32, config=config)


def torch_widest_task(net: str, variant: str, start: int, budget: int, step: int = 8, max_probes: int = 8,
                      source: str = "auto", config: str = "fp32") -> dict:
    from tools.bench import torch_nets

    return torch_nets.widest(net, variant, start, budget, step=step, max_probes=max_probes, source=source,
                             config=config)


def torch_deepest_task(variant: str, start: int, budget: int, batch: int = 16, step: int = 8,
                       max_probes: int = 8, config: str = "fp32") -> dict:
    from tools.bench import torch_nets

    return torch_nets.deepest(variant, start, budget, batch=batch, step=step, max_probes=max_probes, config=config)


TASKS: dict[str, Callable[..., dict]] = {
    "ours": ours_task, "ours_widest": ours_widest_task, "ours_deepest": ours_deepest_task,
    "memory_trace": memory_trace_task, "torch": torch_task, "torch_widest": torch_widest_task,
    "torch_deepest": torch_deepest_task,
    # tools/bench/recurrent.py's, imported when a worker runs one
    "recurrent_ours": lambda **kw: __import__("tools.bench.recurrent", fromlist=["x"]).ours_task(**kw),
    "recurrent_torch": lambda **kw: __import__("tools.bench.recurrent", fromlist=["x"]).torch_task(**kw),
}


# ---------------------------------------------------------------------------------------------------
# Output: tables and JSON
# ---------------------------------------------------------------------------------------------------
def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and spec:
        return format(v, spec)
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def text_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[str(h) for h in header]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def target(name: str, goal: str, measured: float | None, threshold: float, note: str = "") -> dict:
    """One benchmark target (the paper's claim it checks): met when measured >= threshold (a missed target keeps how far off it is)."""
    met = measured is not None and measured >= threshold
    return {"name": name, "target": goal, "measured": measured, "threshold": threshold, "met": met,
            "shortfall": None if met or measured is None else threshold - measured, "note": note}


def finish(bench: str, title: str, args: argparse.Namespace, header: Sequence[str], rows: list[list[Any]],
           extra: dict | None = None, targets: list[dict] | None = None, notes: list[str] | None = None,
           tables: list[dict] | None = None, quiet: bool = False) -> Path:
    """Write <out>/<bench>[_quick].json (whole or not at all: a run killed while writing keeps the last one) and
    print the table(s) last; `quiet`: write only (a long run's figures so far, after each net)."""
    doc = {"benchmark": bench, "title": title, "quick": bool(getattr(args, "quick", False)),
           "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device_info(), "versions": versions(),
           "env": {k: v for k, v in os.environ.items() if k.startswith("SUPERNEURONS_")},
           "tables": [{"title": title, "header": list(header), "rows": rows}] + list(tables or []),
           "targets": targets or [], "notes": notes or []}
    doc.update(extra or {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = getattr(args, "tag", "")
    path = out / f"{bench}{'_' + tag if tag else ''}{'_quick' if doc['quick'] else ''}.json"
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(doc, indent=1, default=float))
    partial.replace(path)
    if quiet:
        return path
    dev = doc["device"]
    for t in doc["tables"]:
        print(f"\n{t['title']} ({dev.get('name')})")
        print(text_table(t["header"], t["rows"]))
    for t in doc["targets"]:
        status = "met" if t["met"] else ("NOT MET" if t["measured"] is not None else "not measured")
        print(f"target {t['name']}: {t['target']}: measured {fmt(t['measured'])} -> {status}"
              + (f" ({t['note']})" if t["note"] else ""))
    for n in doc["notes"]:
        print(f"note: {n}")
    print(f"wrote {path}")
    return path


def log_path(args: argparse.Namespace, bench: str) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{bench}_workers.log"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(_worker_main(json.loads(sys.argv[2])))
    raise SystemExit("usage: python3 -m tools.bench.common worker '<json list of tasks>' (the bench scripts call this)")
