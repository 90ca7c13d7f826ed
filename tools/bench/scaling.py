"""Data-parallel scaling (issue 14): img/s of ResNet-50 (batch 64 per GPU) and VGG16 (batch 64 per GPU) on
1, 2, 4 and 8 GPUs, ours beside PyTorch DistributedDataParallel in the same run, the scaling efficiency
img/s(N) / (N x img/s(1)) of both, and the same under a per-GPU memory budget at a per-GPU batch that makes
ours offload or recompute (where DDP runs out of memory).

    python3 -m tools.bench.scaling [--nets resnet50,vgg16] [--gpus 1,2,4,8] [--batches resnet50=64,vgg16=64]
                                   [--iterations 20] [--warmup 5] [--budget 12G (0: no budget rows)]
                                   [--budget-batches resnet50=256,vgg16=160] [--no-torch] [--no-ours]
                                   [--device cuda|cpu] [--dry-run] [--out DIR] [--tag T]

Every measurement is one MPI job, `mpiexec -n N python3 -m tools.bench.scaling rank ours|torch ...`, so each
starts on fresh devices:
- ours: one rank per GPU (the local rank picks it), superneurons.parallel's RankSolver on the dummy solver of
  models/<net>/ (SGD, momentum 0.9), gradients averaged through NCCL in buckets during backward; the first
  drawn DummyData batch stays on the device (as PyTorch reuses one tensor), `baseline` memory, or `auto`
  under the budget (pool = budget - --workspace on every GPU).
- PyTorch: torchvision's model (the same nets tools/bench/speed.py compares), SGD with our solver's lr,
  momentum and weight decay, DistributedDataParallel over NCCL (its default 25 MiB buckets), torch.distributed
  initialized from the MPI ranks; under the budget `set_per_process_memory_fraction(budget / total)` per GPU.
Both time `--iterations` steps after `--warmup`, the clock of the slowest rank after a device synchronize;
img/s counts every rank's batch. Rows for more GPUs than the machine has are skipped and say so.
NCCL_NVLS_ENABLE=0 (NVLink multicast off) is set unless the environment sets it.

`--device cpu` runs ours over MPI on the CPU (ranks instead of GPUs, no PyTorch): the plumbing, for tests.
`--dry-run` prints the jobs without running them. Prints a table and writes bench_scaling[_TAG].json to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.bench import common

DEFAULT_NETS = ("resnet50", "vgg16")
DEFAULT_BATCH = {"resnet50": 64, "vgg16": 64}
EFFICIENCY_TARGET = 0.92  # at 8 GPUs, ResNet-50 batch 64 per GPU


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = common.base_parser(__doc__, DEFAULT_NETS, iterations=20)
    ap.set_defaults(warmup=5)
    ap.add_argument("--gpus", default="1,2,4,8", help="numbers of GPUs (ranks) to measure (default %(default)s)")
    ap.add_argument("--budget-batches", default="resnet50=256,vgg16=160",
                    help="per-GPU batch of the budget rows, per net (default %(default)s); needs --budget")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default), or cpu: ours over MPI on CPU ranks, for checking the plumbing")
    ap.add_argument("--dry-run", action="store_true", help="print the MPI jobs, run nothing")
    return ap


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--gpus {text!r}: expected numbers like 1,2,4,8") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--gpus {text!r}: expected numbers of at least 1, like 1,2,4,8")
    return sorted(set(counts))


def available_gpus(device: str) -> int:
    if device == "cpu":
        return 1 << 10  # ranks, not devices
    from superneurons.parallel.devices import gpu_count

    return gpu_count()


def rank_command(n: int, system: str, net: str, batch: int, a: argparse.Namespace, budget: int | None) -> list[str]:
    from superneurons.parallel.launch import find_mpiexec

    cmd = [find_mpiexec(), "-n", str(n), sys.executable, "-m", "tools.bench.scaling", "rank", system, "--net", net,
           "--batch", str(batch), "--iterations", str(a.iterations), "--warmup", str(a.warmup),
           "--device", a.device, "--workspace", a.workspace]
    return cmd + (["--budget", str(budget)] if budget else [])


def run_job(cmd: list[str], timeout: int) -> dict:
    env = common.child_env()
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    for line in r.stdout.splitlines():
        if line.startswith(common.RESULT_TAG):
            return {**json.loads(line[len(common.RESULT_TAG):]), "job_s": time.perf_counter() - t0}
    tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
    return {"ok": False, "error": f"exit {r.returncode}: " + " | ".join(tail)}


def measure_rows(a: argparse.Namespace, nets: list[str], counts: list[int], batches: Any, budget: int | None,
                 have: int) -> list[dict]:
    systems = [s for s, off in (("ours", a.no_ours), ("torch", a.no_torch or a.device == "cpu")) if not off]
    rows = []
    for net in nets:
        default = [DEFAULT_BATCH.get(net, common.NETS[net].speed_batch)]
        for batch in common.batches_for(net, batches, default if budget is None else []):
            for n in counts:
                row: dict[str, Any] = {"net": net, "gpus": n, "batch_per_gpu": batch, "budget": budget}
                for system in systems:
                    cmd = rank_command(n, system, net, batch, a, budget)
                    if a.dry_run:
                        print(" ".join(cmd))
                        row[system] = {"ok": False, "skipped": "dry run"}
                    elif n > have:
                        row[system] = {"ok": False, "skipped": f"this machine has {have} GPU(s)"}
                    else:
                        row[system] = run_job(cmd, a.timeout)
                        print(f"{net} x{n} b{batch} {system}: "
                              f"{common.fmt(row[system].get('img_per_s'))} img/s {row[system].get('error', '')}",
                              flush=True)
                rows.append(row)
    add_efficiency(rows)
    return rows


def add_efficiency(rows: list[dict]) -> None:
    """efficiency = img/s on N / (N x img/s on 1), per net, batch, budget and system; ours / DDP."""
    one = {(r["net"], r["batch_per_gpu"], r["budget"], s): r[s].get("img_per_s")
           for r in rows if r["gpus"] == 1 for s in ("ours", "torch") if s in r}
    for r in rows:
        for s in ("ours", "torch"):
            if s in r:
                base = one.get((r["net"], r["batch_per_gpu"], r["budget"], s))
                speed = r[s].get("img_per_s")
                r[s]["efficiency"] = speed / (r["gpus"] * base) if speed and base else None
        r["ours_vs_ddp"] = common.ratio(r.get("ours", {}).get("img_per_s"), r.get("torch", {}).get("img_per_s"))


def table(rows: list[dict]) -> str:
    header = ("net", "GPUs", "batch/GPU", "budget", "ours img/s", "ours eff.", "ours mode", "DDP img/s", "DDP eff.",
              "ours/DDP")
    body = []
    for r in rows:
        o, t = r.get("ours", {}), r.get("torch", {})
        body.append((r["net"], r["gpus"], r["batch_per_gpu"], _size(r["budget"]), _cell(o), o.get("efficiency"),
                     o.get("memory_mode", "-"), _cell(t), t.get("efficiency"), r.get("ours_vs_ddp")))
    return common.text_table(header, body)


def _cell(result: dict) -> Any:
    if result.get("img_per_s"):
        return result["img_per_s"]
    if result.get("skipped"):
        return "skipped"
    return "OOM" if result.get("fits") is False else ("-" if not result else "failed")


def _size(n: int | None) -> str:
    return "-" if not n else f"{n / common.GiB:g}G"


def targets(rows: list[dict]) -> list[dict]:
    out = []
    eight = [r for r in rows if r["net"] == "resnet50" and r["gpus"] == 8 and r["batch_per_gpu"] == 64
             and not r["budget"]]
    if eight:
        out.append(common.target("resnet50_efficiency_8gpu", f">= {EFFICIENCY_TARGET} at 8 GPUs, batch 64",
                                 eight[0].get("ours", {}).get("efficiency"), EFFICIENCY_TARGET))
    for r in rows:
        if not r["budget"] and r.get("ours_vs_ddp") is not None:
            out.append(common.target(f"{r['net']}_vs_ddp_{r['gpus']}gpu", ">= 1.0x DDP's img/s", r["ours_vs_ddp"], 1.0))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:
        return rank_main(argv[1:])
    a = parser().parse_args(argv)
    nets = common.parse_nets(a.nets)
    counts = parse_counts(a.gpus)
    budget = common.parse_size(a.budget)
    have = available_gpus(a.device)
    if have == 0 and not a.dry_run:
        raise SystemExit("no usable NVIDIA GPU here; run on a GPU machine, or --device cpu to check the plumbing")
    rows = measure_rows(a, nets, counts, common.parse_batches(a.batches), None, have)
    if budget:
        rows += measure_rows(a, nets, counts, common.parse_batches(a.budget_batches), budget, have)
    if a.dry_run:
        return 0
    print()
    print(table(rows))
    doc = {"rows": rows, "targets": targets(rows), "device": a.device, "gpus_available": have,
           "iterations": a.iterations, "warmup": a.warmup, "versions": common.versions()}
    out = Path(a.out) / f"bench_scaling{'_' + a.tag if a.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nwrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------------
# One rank of a job (run by mpiexec)
# ---------------------------------------------------------------------------------------------------
def rank_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scaling.py rank", description="one rank of a scaling job (run by mpiexec)")
    ap.add_argument("system", choices=("ours", "torch"))
    ap.add_argument("--net", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--workspace", default=common.DEFAULT_WORKSPACE)
    return ap


def rank_main(argv: list[str]) -> int:
    from superneurons.parallel.world import World

    a = rank_parser().parse_args(argv)
    common.parse_nets(a.net)
    world = World()
    try:
        result = ours_rank(a, world) if a.system == "ours" else torch_rank(a, world)
    except Exception as e:  # noqa: BLE001 - report it, then end every rank (none may wait in a collective)
        print(common.RESULT_TAG + json.dumps({"ok": False, "error": f"rank {world.rank}: {type(e).__name__}: "
                                              f"{str(e)[:300]}"}), flush=True)
        world.abort(1)
    if world.is_root:
        print(common.RESULT_TAG + json.dumps(result, default=str), flush=True)
    return 0


def _timed(world: Any, step: Any, sync: Any, warmup: int, iterations: int) -> float:
    """Seconds of the slowest rank for `iterations` steps after `warmup` (every rank starts together)."""
    for _ in range(warmup):
        step()
    sync()
    world.barrier()
    t0 = time.perf_counter()
    for _ in range(iterations):
        step()
    sync()
    elapsed = time.perf_counter() - t0
    times = world.gather(elapsed)
    return max(times) if times else elapsed


def ours_rank(a: argparse.Namespace, world: Any) -> dict:
    from superneurons.errors import PoolExhausted, UserError
    from superneurons.parallel.solver import RankSolver
    from superneurons.runtime.logging import TrainLog

    workspace = common.parse_size(a.workspace) if a.device == "cuda" else None
    backend = common.make_backend("cpu" if a.device == "cpu" else f"cuda:{world.local_rank}", workspace)
    if a.device == "cpu":
        from superneurons.parallel.collectives import MpiCollective

        collective: Any = MpiCollective(world, backend.ops)
    else:
        from superneurons.parallel.collectives import NcclCollective

        collective = NcclCollective(world, world.local_rank)
    memory = "auto" if a.budget else "baseline"
    pool = a.budget - (workspace or 0) if a.budget else None
    with open(os.devnull, "w") as sink:
        try:
            solver = common.make_solver(a.net, a.batch, backend, memory, pool, factory=RankSolver, world=world,
                                        collective=collective, log=TrainLog(stream=sink))
        except (PoolExhausted, UserError) as e:
            return {"ok": False, "fits": False, "error": f"{type(e).__name__}: {e}"}
        solver.share_rank0_state()
        losses: list[float] = []
        solver.callbacks.append(lambda s, it, loss: losses.append(float(loss)))
        solver.step(1)  # draws the batch, compiles kernels, picks convolution algorithms
        common.freeze_data(solver)
        seconds = _timed(world, lambda: solver.step(1), backend.synchronize, a.warmup - 1, a.iterations)
    return {"ok": True, "fits": True, "img_per_s": world.size * a.batch * a.iterations / seconds,
            "seconds": seconds, "ranks": world.size, "memory_mode": solver.net.memory.name,
            "pool_bytes": solver.net.pool.capacity, "buckets": len(solver.reducer.buckets),
            "layer_wise": solver.reducer.layer_wise, "losses": losses}


def torch_rank(a: argparse.Namespace, world: Any) -> dict:
    import socket

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tools.bench import torch_nets
    from superneurons.io.prototxt import read_solver

    local = world.local_rank
    torch.cuda.set_device(local)
    port = world.broadcast(_free_port() if world.is_root else None)
    os.environ["MASTER_ADDR"] = world.broadcast(socket.gethostname() if world.is_root else None)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=world.rank, world_size=world.size)
    try:
        if a.budget:
            total = torch.cuda.get_device_properties(local).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget / total), local)
        sp = read_solver(str(common.ROOT / common.NETS[a.net].solver))
        torch.manual_seed(0)
        try:
            model, shape, source = torch_nets.build(a.net, "plain", a.batch)
            ddp = DistributedDataParallel(model.cuda().train(), device_ids=[local])
            opt = torch.optim.SGD(ddp.parameters(), lr=sp.base_lr or 0.01, momentum=sp.momentum,
                                  weight_decay=sp.weight_decay)
            x = torch.randn((a.batch,) + tuple(shape[1:]), device="cuda")
            y = torch.full((a.batch,), 7, dtype=torch.long, device="cuda")

            def step():
                opt.zero_grad(set_to_none=True)
                ddp(x, y).backward()
                opt.step()

            seconds = _timed(world, step, torch.cuda.synchronize, a.warmup, a.iterations)
        except torch.cuda.OutOfMemoryError as e:
            return {"ok": False, "fits": False, "error": f"OOM: {str(e)[:200]}"}
        return {"ok": True, "fits": True, "img_per_s": world.size * a.batch * a.iterations / seconds,
                "seconds": seconds, "ranks": world.size, "source": source,
                "max_memory_allocated": torch.cuda.max_memory_allocated()}
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
