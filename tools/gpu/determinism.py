"""Is GPU training repeatable? Trains a small net (conv, BatchNorm, Scale, ReLU, pooling, InnerProduct,
SoftmaxWithLoss on DummyData) a few iterations, plain `--gpu 0` twice and through NCCL (`mpiexec -n 1`)
once, snapshotting every iteration, and prints per iteration the blobs that differ: the largest |a - b|
over the largest |a| of the blob's layer (see `report`), and in brackets over the blob's own.

What it showed on an H100 (cuDNN 9, SUPERNEURONS_TF32=0): the runs differ by about 1e-7 of each layer's
weights, from cuDNN's weight-gradient algorithm (the trace's first difference is conv1's weight gradient,
in the first iteration); with SUPERNEURONS_CUDNN_DETERMINISTIC=1 plain, plain and NCCL agree bit for bit.
Measured blob by blob instead, conv1's bias differed by 50-80% between any two runs: ahead of BatchNorm
its gradient is zero in exact arithmetic, so it holds rounding noise (6e-8 beside 0.43 for the weights').

    source tools/gpu/env.sh
    python tools/gpu/determinism.py                                  # plain, plain again, NCCL
    python tools/gpu/determinism.py --set SUPERNEURONS_CUDNN_DETERMINISTIC=1 --set SUPERNEURONS_FUSE=0,SUPERNEURONS_TF32=1
    python tools/gpu/determinism.py --trace                          # also: every blob and gradient, per step

Each `--set` is one more configuration (comma-separated VAR=VALUE, docs/SETTINGS.md), run the same way
(SUPERNEURONS_CUDNN_DETERMINISTIC=1 should show no difference at all).
`--trace` runs two solvers one after another in one process under --memory baseline and compares every
blob's data and gradient after each iteration's backward (before the update), so the first op whose output
differs shows, at the cost of a host copy per blob (which waits for the GPU, and may hide a race).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NET = (ROOT / "tests" / "fixtures" / "conv_bn_net.prototxt").read_text()  # shared with tests/test_parallel_gpu.py


def solver_text(iters: int, prefix: str) -> str:
    return (f'net: "net.prototxt"\nbase_lr: 0.05\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
            f'display: 1\nmax_iter: {iters}\nsnapshot: 1\nsnapshot_prefix: "{prefix}/m"\nrandom_seed: 3\n')


def group(key: str) -> str:
    """The blobs measured against one scale: a layer's parameters (`conv1.0`, `conv1.1`), their gradients,
    all history blobs; any other key (a blob's data or gradient) alone."""
    base, tail = (key[:-5], ".diff") if key.endswith(".diff") else (key, "")
    head, _, last = base.rpartition(".")
    return f"{head}[*]{tail}" if head and last.isdigit() else key


def report(label: str, a: dict[str, np.ndarray], b: dict[str, np.ndarray], show: int = 4) -> float:
    """One line: the worst difference, then the `show` worst blobs: max |a - b| over the largest |a| of the
    blob's group (a layer's parameters: the bias of a convolution feeding BatchNorm has a gradient that is
    zero in exact arithmetic, so it holds rounding noise that differs by 100% of itself between runs), and
    in brackets over the blob's own largest |a|, with that largest |a|."""
    scale: dict[str, float] = {}
    for k, v in a.items():
        scale[group(k)] = max(scale.get(group(k), 0.0), float(np.abs(v).max()) if v.size else 0.0)
    rows = []
    for k in a:
        if k in b and a[k].size:
            gap = float(np.abs(a[k].astype(np.float64) - b[k]).max())
            own = float(np.abs(a[k]).max())
            rows.append((gap / (scale[group(k)] + 1e-30), k, gap / (own + 1e-30), own))
    rows.sort(reverse=True)
    worst = rows[0][0] if rows else 0.0
    top = ", ".join(f"{k} {d:.3g} ({r:.3g} of max {m:.2g})" for d, k, r, m in rows[:show] if d > 0) or "identical"
    print(f"  {label:<24} worst {worst:.3g}: {top}", flush=True)
    return worst


# -- whole runs, through the CLI ------------------------------------------------------------------
def model_blobs(path: Path) -> dict[str, np.ndarray]:
    from superneurons.io.caffemodel import blob_to_array
    from superneurons.io.prototxt import read_binary
    from superneurons.proto import superneurons_pb2 as pb

    model = read_binary(str(path), pb.NetParameter())
    return {f"{l.name}.{k}": blob_to_array(b, l.name) for l in model.layer for k, b in enumerate(l.blobs)}


def history_blobs(path: Path) -> dict[str, np.ndarray]:
    from superneurons.io.caffemodel import blob_to_array
    from superneurons.io.prototxt import read_binary
    from superneurons.proto import superneurons_pb2 as pb

    state = read_binary(str(path), pb.SolverState())
    return {f"history.{i}": blob_to_array(b, "history") for i, b in enumerate(state.history)}


def train(work: Path, name: str, iters: int, env: dict[str, str], nccl: bool, gpu: str) -> float:
    (work / f"{name}.prototxt").write_text(solver_text(iters, name))
    cmd = [sys.executable, "-m", "superneurons", "train", "--solver", f"{name}.prototxt", "--gpu", gpu,
           "--no-progress"]
    if nccl:
        from superneurons.parallel import launch

        cmd = [launch.find_mpiexec(), "-n", "1"] + cmd
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, timeout=600)
    if r.returncode:
        sys.exit(f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    memory = [line.split("] ", 1)[-1] for line in r.stderr.splitlines() if "memory" in line.lower()][:1]
    print(f"  {name}: {time.perf_counter() - start:.1f}s {memory[0] if memory else ''}", flush=True)
    return time.perf_counter() - start


def compare_runs(work: Path, names: list[str], iters: int) -> None:
    for it in range(1, iters + 1):
        print(f" iteration {it}:")
        runs = [model_blobs(work / n / f"m_iter_{it}.caffemodel") | history_blobs(work / n / f"m_iter_{it}.solverstate")
                for n in names]
        for n, other in zip(names[1:], runs[1:]):
            report(f"{names[0]} vs {n}", runs[0], other)


def whole_runs(iters: int, overrides: dict[str, str], nccl: bool, gpu: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NCCL_NVLS_ENABLE="0", SUPERNEURONS_TF32="0") | overrides
    given = {k: v for k, v in env.items() if k.startswith("SUPERNEURONS_")}
    print(f"== {' '.join(f'{k}={v}' for k, v in sorted(given.items()))}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "net.prototxt").write_text(NET)
        names = ["plain", "again"] + (["nccl"] if nccl else [])
        for n in names:
            train(work, n, iters, env, nccl=n == "nccl", gpu=gpu)
        compare_runs(work, names, iters)


# -- two solvers in one process, every blob after each backward -------------------------------------
def trace(iters: int, gpu: str) -> None:
    os.environ.setdefault("SUPERNEURONS_TF32", "0")
    from superneurons.backend import get_backend
    from superneurons.io.prototxt import read_solver
    from superneurons.memory.interface import StepHooks
    from superneurons.runtime.logging import TrainLog
    from superneurons.solver import Solver

    class AfterBackward(StepHooks):
        """Host copies of every blob's data and gradient, and every parameter's, after the last backward step."""

        def __init__(self, net):
            self.net, self.seen = net, []

        def after_backward(self, i, step):
            if i != len(self.net.backward_steps) - 1:
                return
            net, host = self.net, self.net.backend.to_host
            got = {f"{b}.data": host(t.array) for b, t in net.data.items() if t.array is not None}
            got |= {f"{b}.diff": host(t.array) for b, t in net.diff.items() if t.array is not None}
            for node in net.layers_in_prototxt_order():
                for k, decl in enumerate(node.layer.params):
                    got[f"{node.name}.{k}"] = host(decl.data)
                    if decl.diff is not None:
                        got[f"{node.name}.{k}.diff"] = host(decl.diff)
            self.seen.append(got)

    backend = get_backend("cpu") if gpu == "-1" else get_backend("cuda", int(gpu))
    given = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("SUPERNEURONS_"))
    print(f"== trace: two solvers in one process, --memory baseline, after each backward; {given}", flush=True)
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as quiet:
        work = Path(tmp)
        os.chdir(work)  # the snapshots' prefix is relative
        (work / "net.prototxt").write_text(NET)
        (work / "s.prototxt").write_text(solver_text(iters, "t"))
        recorders = []
        for _ in range(2):
            solver = Solver(read_solver(str(work / "s.prototxt")), str(work / "s.prototxt"), backend=backend,
                            memory="baseline", log=TrainLog(stream=quiet))
            rec = AfterBackward(solver.net)
            solver.net.add_hooks(rec)
            for _ in range(iters):
                solver.step(1)
            recorders.append(rec)
        for it, (a, b) in enumerate(zip(*(r.seen for r in recorders))):
            print(f" iteration {it} (before its update):")
            report("solver 1 vs solver 2", a, b, show=8)
        os.chdir(here)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--gpu", default="0", help="the GPU (-1: the CPU, to try this script without one)")
    p.add_argument("--set", action="append", default=[], metavar="VAR=V[,VAR=V]",
                   help="one more configuration, run plain twice (repeatable)")
    p.add_argument("--no-nccl", dest="nccl", action="store_false", help="leave out the NCCL run")
    p.add_argument("--trace", action="store_true", help="also compare every blob of two in-process solvers")
    p.add_argument("--only-trace", action="store_true", help="just the trace")
    args = p.parse_args()
    if args.trace or args.only_trace:
        trace(args.iters, args.gpu)
    if not args.only_trace:
        whole_runs(args.iters, {}, args.nccl, args.gpu)
        for spec in args.set:
            whole_runs(args.iters, dict(kv.split("=", 1) for kv in spec.split(",") if kv), args.nccl, args.gpu)


if __name__ == "__main__":
    main()
