"""Data-parallel scaling: img/s of ResNet-50 and VGG16 (batch 64 per GPU) on 1, 2 and 4 GPUs, ours beside
PyTorch DistributedDataParallel, the scaling efficiency img/s(N) / (N x img/s(1)) of both, and the same under a
per-GPU memory budget at a per-GPU batch where DDP runs out of memory (ours under `auto` on every rank, DDP with
per-block checkpointing at its widest batch under the same budget).

    python3 -m tools.bench.scaling [--nets resnet50,vgg16] [--gpus 1,2,4] [--batches resnet50=64,vgg16=64]
                                   [--iterations 20] [--warmup 5] [--repeats 3] [--bucket-mb 25 | 8,25,64]
                                   [--nccl-ctas 0,8,4] [--nccl-priority normal,high]
                                   [--budget 12G (0: no budget rows)] [--budget-batches resnet50=256,vgg16=160]
                                   [--budget-gpus 2,4] [--budget-only] [--precision fp32|bf16|fp16]
                                   [--reduce fp32 | backward | fp32,backward]
                                   [--no-torch] [--no-ours] [--apart] [--device cuda|cpu] [--dry-run]
                                   [--out DIR] [--tag T]

Each row is one MPI job, `mpiexec -n N python3 -m tools.bench.scaling rank ...`, one process per GPU, that
builds both sides once and then times them in alternating windows (ours, DDP, ours, DDP, ...; --repeats
windows each, --warmup untimed steps before each): a row is the median window of each side, so both meet the
same machine state, and a slow window (clocks, a neighbour) moves one sample, not the row. `--apart` runs
each window as a job of its own instead (the sides never share a process; slower to start).
- ours: superneurons.parallel's RankSolver on the dummy solver of models/<net>/ (SGD, momentum 0.9), gradients
  averaged through NCCL in flat buckets during backward; the first drawn DummyData batch stays on the device
  (as PyTorch reuses one tensor); `baseline` memory, or `auto` under the budget (pool = budget - --workspace on
  every GPU). Also reported: how long compute waited on the reduction per iteration (median of the window's).
  `--bucket-mb 8,25,64` times ours once per bucket size in every window round (the reducer is rebuilt in
  place): the measurement behind SUPERNEURONS_DP_BUCKET_MB's default; the row's ours is the first size.
  `--nccl-ctas 0,8,4` likewise times ours once per cap on the thread blocks of NCCL's kernels (one
  communicator per value, 0: NCCL's own choice; SUPERNEURONS_DP_NCCL_CTAS), and `--nccl-priority normal,high`
  once per priority of NCCL's stream (SUPERNEURONS_DP_STREAM_PRIORITY), each at the row's other choices;
  `ours_nccl` in the JSON holds each variant's img/s.
- PyTorch: torchvision's model, SGD with our solver's lr, momentum and weight decay, cudnn.benchmark on (ours
  times its convolution engines too), DistributedDataParallel over NCCL (its default 25 MiB buckets),
  torch.distributed initialized from the MPI ranks. Under the budget: torch.utils.checkpoint over each block,
  `set_per_process_memory_fraction(budget / total)` per GPU, cudnn.benchmark off (its engine trials ask for
  workspaces the cap refuses later), at the widest batch (multiple of 8) whose training step fits with DDP's
  bucket memory kept aside, the same on every rank (stepping down by 8 while DDP itself does not fit).
Both time the slowest rank (device synchronized); img/s counts every rank's batch. Rows for more GPUs than
the machine has are skipped and say so. NCCL_NVLS_ENABLE=0 (NVLink multicast off) unless the environment
sets it.

`--precision bf16` stores ours' activations and gradients in bfloat16 (DDP stays float32 unless
`--torch-config bf16-cl`: bfloat16 autocast with channels_last; `fp32-cl`: float32 channels_last). `--reduce` says what
ours sums gradients in: fp32, or backward, the net's half backward type (`train --reduce-type`, docs/PARALLEL.md);
`--reduce fp32,backward` times both in every window round of the same job, as bucket sizes are (one net built
with the half buffer, its reducer switched between the two: the same convolution engines and pool, which
separate jobs would not share); the row's ours is the first type, `ours_reduce` holds each type's img/s and
`ours_wire_bytes` the bytes each rank hands NCCL per iteration (`MiB/it` in the table: the row's type).

`--device cpu` runs ours over MPI on the CPU (ranks instead of GPUs, no PyTorch): the plumbing, for tests.
`--dry-run` prints the jobs without running them. Prints a table and writes bench_scaling[_TAG].json to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.bench import common

DEFAULT_NETS = ("resnet50", "vgg16")
DEFAULT_BATCH = {"resnet50": 64, "vgg16": 64}
# At 4 GPUs, batch 64 per GPU: efficiency at least this and at least DDP's, img/s at least RATIO_TARGET x DDP's.
EFFICIENCY_TARGET = 0.95
RATIO_TARGET = 1.15
TARGET_GPUS = 4
SYSTEMS = ("ours", "torch")
# DDP's configurations (--torch-config), by their names in torch_nets.TORCH_CONFIGS: eager, and autocast without a
# GradScaler (float16's would need one) or torch.compile
DDP_CONFIGS = ("fp32", "fp32-cl", "bf16-cl")


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = common.base_parser(__doc__, DEFAULT_NETS, iterations=20)
    ap.set_defaults(warmup=5)
    ap.add_argument("--gpus", default="1,2,4", help="numbers of GPUs (ranks) to measure (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed windows per side and row (default %(default)s)")
    ap.add_argument("--bucket-mb", default="",
                    help="ours' gradient bucket sizes in MiB, comma-separated (default: SUPERNEURONS_DP_BUCKET_MB)")
    ap.add_argument("--nccl-ctas", default="",
                    help="ours' caps on NCCL's thread blocks per kernel, comma-separated, 0: NCCL's choice "
                         "(default: SUPERNEURONS_DP_NCCL_CTAS)")
    ap.add_argument("--nccl-priority", default="",
                    help="ours' priorities of NCCL's stream, comma-separated: normal, high (default: "
                         "SUPERNEURONS_DP_STREAM_PRIORITY)")
    ap.add_argument("--budget-batches", default="resnet50=256,vgg16=160",
                    help="per-GPU batch of the budget rows, per net (default %(default)s); needs --budget")
    ap.add_argument("--budget-gpus", default="", help="numbers of GPUs of the budget rows (default: --gpus)")
    ap.add_argument("--budget-only", action="store_true", help="only the budget rows")
    ap.add_argument("--apart", action="store_true", help="every window a job of its own (sides never share a process)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (default), or cpu: ours over MPI on CPU ranks, for checking the plumbing")
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"),
                    help="ours' storage of activations and gradients (default: the prototxt's, float32)")
    ap.add_argument("--reduce", default="fp32",
                    help="ours' gradient reduction type(s), comma-separated: fp32 (float32), backward (the net's "
                         "half backward type; needs --precision bf16/fp16); several: timed in turn in every window "
                         "round (default %(default)s)")
    ap.add_argument("--torch-config", choices=DDP_CONFIGS, default="fp32",
                    help="DDP's configuration (tools/bench/torch_nets.py): fp32 (eager NCHW, default), fp32-cl "
                         "(channels_last), bf16-cl (bfloat16 autocast, channels_last)")
    ap.add_argument("--dry-run", action="store_true", help="print the MPI jobs, run nothing")
    return ap


def parse_reduce(text: str) -> list[str]:
    from superneurons.parallel.reducer import REDUCE_CHOICES

    kinds = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not kinds or any(k not in REDUCE_CHOICES for k in kinds):
        raise SystemExit(f"--reduce {text!r}: expected {' or '.join(REDUCE_CHOICES)}, comma-separated")
    return kinds


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--gpus {text!r}: expected numbers like 1,2,4,8") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--gpus {text!r}: expected numbers of at least 1, like 1,2,4,8")
    return sorted(set(counts))


def parse_buckets(text: str) -> list[int]:
    """Bucket sizes in MiB, in the order given ([]: the setting's)."""
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--bucket-mb {text!r}: expected MiB like 8,25,64") from None
    if any(v < 0 for v in sizes):
        raise SystemExit(f"--bucket-mb {text!r}: sizes are MiB >= 0")
    return sizes


def parse_ctas(text: str) -> list[int]:
    """Caps on NCCL's thread blocks per kernel, in the order given, 0 for NCCL's choice ([]: the setting's)."""
    try:
        caps = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--nccl-ctas {text!r}: expected numbers like 0,8,4") from None
    if any(not 0 <= v <= 32 for v in caps):
        raise SystemExit(f"--nccl-ctas {text!r}: caps are 1 to 32 thread blocks, or 0 for NCCL's choice")
    return list(dict.fromkeys(caps))


def parse_priorities(text: str) -> list[bool]:
    """NCCL stream priorities in the order given, True for high ([]: the setting's)."""
    names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if any(n not in ("normal", "high") for n in names):
        raise SystemExit(f"--nccl-priority {text!r}: expected normal or high, comma-separated")
    return [n == "high" for n in names]


def nccl_label(cap: int | None, high: bool | None) -> str:
    """A variant's name in `ours_nccl`: its cap on NCCL's blocks and its stream's priority."""
    priority = "default" if high is None else "high" if high else "normal"
    return f"ctas {cap or 'default'}, {priority} priority"


def available_gpus(device: str) -> int:
    if device == "cpu":
        return 1 << 10  # ranks, not devices
    from superneurons.parallel.devices import gpu_count

    return gpu_count()


def rank_command(n: int, systems: list[str], net: str, batch: int, a: argparse.Namespace, budget: int | None,
                 repeats: int) -> list[str]:
    from superneurons.parallel.launch import find_mpiexec

    cmd = [find_mpiexec(), "-n", str(n), sys.executable, "-m", "tools.bench.scaling", "rank", ",".join(systems),
           "--net", net, "--batch", str(batch), "--iterations", str(a.iterations), "--warmup", str(a.warmup),
           "--repeats", str(repeats), "--device", a.device, "--workspace", a.workspace]
    if a.bucket_mb:
        cmd += ["--bucket-mb", a.bucket_mb]
    if a.nccl_ctas and a.device == "cuda":
        cmd += ["--nccl-ctas", a.nccl_ctas]
    if a.nccl_priority and a.device == "cuda":
        cmd += ["--nccl-priority", a.nccl_priority]
    if a.precision:
        cmd += ["--precision", a.precision]
    if a.reduce != "fp32":
        cmd += ["--reduce", ",".join(parse_reduce(a.reduce))]
    if a.torch_config != "fp32":
        cmd += ["--torch-config", a.torch_config]
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


def merge_windows(parts: list[dict], system: str) -> dict:
    """One side's result from the jobs that timed it (--apart: one window each): every window's img/s."""
    ok = [p[system] for p in parts if p.get(system, {}).get("ok")]
    if not ok:
        failed = next((p.get(system) or p for p in parts if not p.get(system, {}).get("ok")), {})
        return {"ok": False, **{k: v for k, v in failed.items() if k in ("fits", "error", "skipped")}}
    out = dict(ok[0])
    out["windows"] = [w for r in ok for w in r["windows"]]
    out["img_per_s"] = statistics.median(out["windows"])
    waits = [r["wait_ms"] for r in ok if r.get("wait_ms") is not None]
    if waits:
        out["wait_ms"] = statistics.median(waits)
    return out


def measure_row(a: argparse.Namespace, systems: list[str], net: str, n: int, batch: int,
                budget: int | None) -> dict:
    row: dict[str, Any] = {"net": net, "gpus": n, "batch_per_gpu": batch, "budget": budget}
    jobs = [(systems, a.repeats)] if not a.apart else [([s], 1) for _ in range(a.repeats) for s in systems]
    parts = []
    for job_systems, repeats in jobs:
        cmd = rank_command(n, job_systems, net, batch, a, budget, repeats)
        if a.dry_run:
            print(" ".join(cmd))
            continue
        result = run_job(cmd, a.timeout)
        parts.append(result if "ours" in result or "torch" in result else {s: result for s in job_systems})
    for s in systems:
        row[s] = {"ok": False, "skipped": "dry run"} if a.dry_run else merge_windows(parts, s)
    for key in ("ours_buckets", "ours_nccl"):
        found = [p[key] for p in parts if p.get(key)]
        if found:
            row[key] = {v: statistics.median(w for b in found for w in b.get(v, [])) for v in found[0]}
    kinds = [p["ours_reduce"] for p in parts if p.get("ours_reduce")]
    if kinds:
        row["ours_reduce"] = {k: statistics.median(w for b in kinds for w in b.get(k, [])) for k in kinds[0]}
        row["ours_wire_bytes"] = next(p["ours_wire_bytes"] for p in parts if p.get("ours_wire_bytes"))
    return row


def measure_rows(a: argparse.Namespace, nets: list[str], counts: list[int], batches: Any, budget: int | None,
                 have: int) -> list[dict]:
    systems = [s for s, off in (("ours", a.no_ours), ("torch", a.no_torch or a.device == "cpu")) if not off]
    rows = []
    for net in nets:
        default = [DEFAULT_BATCH.get(net, common.NETS[net].speed_batch)]
        for batch in common.batches_for(net, batches, default if budget is None else []):
            for n in counts:
                if n > have and not a.dry_run:
                    rows.append({"net": net, "gpus": n, "batch_per_gpu": batch, "budget": budget,
                                 **{s: {"ok": False, "skipped": f"this machine has {have} GPU(s)"} for s in systems}})
                    continue
                row = measure_row(a, systems, net, n, batch, budget)
                if not a.dry_run:
                    print(f"{net} x{n} b{batch}{' budget' if budget else ''}: "
                          + ", ".join(f"{s} {common.fmt(row[s].get('img_per_s'))} img/s {row[s].get('error', '')}"
                                      for s in systems)
                          + (f" buckets {row['ours_buckets']}" if row.get("ours_buckets") else "")
                          + (f" NCCL {row['ours_nccl']}" if row.get("ours_nccl") else "")
                          + (f" reduce {row['ours_reduce']} bytes/iter {row['ours_wire_bytes']}"
                             if row.get("ours_reduce") else ""), flush=True)
                rows.append(row)
    add_efficiency(rows)
    return rows


def add_efficiency(rows: list[dict]) -> None:
    """efficiency = img/s on N / (N x img/s on 1), per net, batch, budget and system; ours / DDP."""
    one = {(r["net"], r["batch_per_gpu"], r["budget"], s): r[s].get("img_per_s")
           for r in rows if r["gpus"] == 1 for s in SYSTEMS if s in r}
    for r in rows:
        for s in SYSTEMS:
            if s in r:
                base = one.get((r["net"], r["batch_per_gpu"], r["budget"], s))
                speed = r[s].get("img_per_s")
                r[s]["efficiency"] = speed / (r["gpus"] * base) if speed and base else None
        r["ours_vs_ddp"] = common.ratio(r.get("ours", {}).get("img_per_s"), r.get("torch", {}).get("img_per_s"))


def table(rows: list[dict]) -> str:
    header = ("net", "GPUs", "batch/GPU", "budget", "reduce", "ours img/s", "ours eff.", "ours mode", "wait ms/it",
              "MiB/it", "DDP batch/GPU", "DDP img/s", "DDP eff.", "ours/DDP")
    body = []
    for r in rows:
        o, t = r.get("ours", {}), r.get("torch", {})
        wire = o.get("wire_bytes_per_iter")
        body.append((r["net"], r["gpus"], r["batch_per_gpu"], _size(r["budget"]), o.get("reduce_type", "-"), _cell(o),
                     o.get("efficiency"), o.get("memory_mode", "-"), o.get("wait_ms"),
                     round(wire / 2**20, 1) if wire else "-", t.get("batch", "-"), _cell(t), t.get("efficiency"),
                     r.get("ours_vs_ddp")))
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
    for r in rows:
        if r["budget"] or r["gpus"] != TARGET_GPUS or r["batch_per_gpu"] != 64:
            continue
        o, t = r.get("ours", {}), r.get("torch", {})
        net = r["net"]
        out.append(common.target(f"{net}_efficiency_{TARGET_GPUS}gpu", f">= {EFFICIENCY_TARGET} at {TARGET_GPUS} GPUs",
                                 o.get("efficiency"), EFFICIENCY_TARGET))
        if t.get("efficiency") is not None:
            out.append(common.target(f"{net}_efficiency_vs_ddp_{TARGET_GPUS}gpu", ">= DDP's efficiency",
                                     o.get("efficiency"), t["efficiency"]))
        out.append(common.target(f"{net}_vs_ddp_{TARGET_GPUS}gpu", f">= {RATIO_TARGET}x DDP's img/s",
                                 r.get("ours_vs_ddp"), RATIO_TARGET))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:
        return rank_main(argv[1:])
    a = parser().parse_args(argv)
    nets = common.parse_nets(a.nets)
    counts = parse_counts(a.gpus)
    parse_buckets(a.bucket_mb)
    parse_ctas(a.nccl_ctas)
    parse_priorities(a.nccl_priority)
    parse_reduce(a.reduce)
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: at least 1")
    budget = common.parse_size(a.budget)
    have = available_gpus(a.device)
    if have == 0 and not a.dry_run:
        raise SystemExit("no usable NVIDIA GPU here; run on a GPU machine, or --device cpu to check the plumbing")
    rows = [] if a.budget_only else measure_rows(a, nets, counts, common.parse_batches(a.batches), None, have)
    if budget:
        budget_counts = parse_counts(a.budget_gpus) if a.budget_gpus else counts
        rows += measure_rows(a, nets, budget_counts, common.parse_batches(a.budget_batches), budget, have)
    if a.dry_run:
        return 0
    print()
    print(table(rows))
    found = targets(rows)
    for t in found:
        print(f"target {t['name']}: {t['target']}: measured {common.fmt(t['measured'])} -> "
              f"{'met' if t['met'] else 'NOT met'}")
    doc = {"rows": rows, "targets": found, "device": a.device, "gpus_available": have, "repeats": a.repeats,
           "iterations": a.iterations, "warmup": a.warmup, "apart": a.apart, "versions": common.versions()}
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
    ap.add_argument("systems", help="ours, torch or ours,torch (alternating windows)")
    ap.add_argument("--net", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", default="")
    ap.add_argument("--nccl-ctas", default="")
    ap.add_argument("--nccl-priority", default="")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--workspace", default=common.DEFAULT_WORKSPACE)
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--reduce", default="fp32")
    ap.add_argument("--torch-config", choices=DDP_CONFIGS, default="fp32")
    return ap


def rank_main(argv: list[str]) -> int:
    from superneurons.parallel.world import World

    a = rank_parser().parse_args(argv)
    common.parse_nets(a.net)
    systems = [s for s in a.systems.split(",") if s]
    world = World()
    result: dict[str, Any] = {}
    side_name = ""
    try:
        sides = {}
        for side_name in systems:
            sides[side_name] = (OursSide if side_name == "ours" else TorchSide)(a, world)
        for s, side in sides.items():
            result[s] = side.result()
        runnable = {s: side for s, side in sides.items() if side.fits}
        for _ in range(a.repeats):  # alternating windows: ours, DDP, ours, DDP, ...
            for side_name, side in runnable.items():
                side.window()
        for s, side in runnable.items():
            result[s] = side.result()
            if s == "ours" and len(side.sizes) > 1:
                result["ours_buckets"] = {str(mb): w for mb, w in side.by_size.items()}
            if s == "ours" and len(side.variants) > 1:
                result["ours_nccl"] = {nccl_label(*v): w for v, w in side.by_variant.items()}
            if s == "ours" and len(side.kinds) > 1:
                result["ours_reduce"] = side.by_kind
                result["ours_wire_bytes"] = side.wire_bytes
        for side in sides.values():
            side.close()
    except Exception as e:  # noqa: BLE001 - report it, then end every rank (none may wait in a collective)
        print(common.RESULT_TAG + json.dumps({"ok": False, "error": f"{side_name}, rank {world.rank}: "
                                              f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
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
    return max(world.comm.allgather(elapsed))


class OursSide:
    """Our RankSolver on this rank, built once; `window()` times it (each bucket size and NCCL cap in turn)."""

    def __init__(self, a: argparse.Namespace, world: Any):
        from superneurons.errors import PoolExhausted, UserError
        from superneurons.parallel.collectives import MpiCollective, NcclCollective
        from superneurons.parallel.reducer import bucket_bytes_setting
        from superneurons.parallel.solver import RankSolver
        from superneurons.runtime.logging import TrainLog

        self.a, self.world = a, world
        workspace = common.parse_size(a.workspace) if a.device == "cuda" else None
        self.backend = common.make_backend("cpu" if a.device == "cpu" else f"cuda:{world.local_rank}", workspace)
        # NCCL variants (cap on its blocks, high-priority stream; None: the settings'): the row's first, then
        # each other cap and each other priority at the row's other choice.
        caps: list[int | None] = list(parse_ctas(a.nccl_ctas)) or [None]
        priorities: list[bool | None] = list(parse_priorities(a.nccl_priority)) or [None]
        self.variants = ([(caps[0], priorities[0])] + [(c, priorities[0]) for c in caps[1:]]
                         + [(caps[0], p) for p in priorities[1:]]) if a.device == "cuda" else [(None, None)]
        self.collectives = ({(None, None): MpiCollective(world, self.backend.ops)} if a.device == "cpu" else
                            {v: NcclCollective(world, self.backend, world.local_rank, max_ctas=v[0], high_priority=v[1])
                             for v in self.variants})
        self.collective = self.collectives[self.variants[0]]
        self.by_variant: dict[tuple, list[float]] = {v: [] for v in self.variants}
        self.sizes = parse_buckets(a.bucket_mb) or [bucket_bytes_setting() >> 20]
        self.kinds = parse_reduce(a.reduce)  # the first is the row's; a net with the half buffer if any is backward
        self.by_kind: dict[str, list[float]] = {k: [] for k in self.kinds}
        self.wire_bytes: dict[str, int] = {}
        memory = "auto" if a.budget else "baseline"
        pool = a.budget - (workspace or 0) if a.budget else None
        self.windows: list[float] = []
        self.waits: list[float] = []
        self.by_size: dict[int, list[float]] = {mb: [] for mb in self.sizes}
        self.sink = open(os.devnull, "w")
        try:
            self.solver = common.make_solver(a.net, a.batch, self.backend, memory, pool, factory=RankSolver,
                                             world=world, collective=self.collective, log=TrainLog(stream=self.sink),
                                             bucket_bytes=self.sizes[0] << 20, precision=a.precision,
                                             reduce="backward" if "backward" in self.kinds else "fp32")
        except (PoolExhausted, UserError) as e:
            self.fits, self.error = False, f"{type(e).__name__}: {e}"
            return
        self.fits, self.error = True, ""
        self.solver.share_rank0_state()
        self.solver.step(1)  # draws the batch, compiles kernels, picks convolution algorithms
        common.freeze_data(self.solver)

    def _use(self, mb: int, variant: tuple) -> None:
        """Rebuild the reducer with buckets of `mb` MiB on the communicator of NCCL `variant` (the same on
        every rank)."""
        from superneurons.parallel.reducer import GradientReducer

        s, collective = self.solver, self.collectives[variant]
        if s.reducer.bucket_bytes == mb << 20 and s.reducer.collective is collective:
            return
        s.reducer.detach()
        s.reducer = GradientReducer(s.net, collective, s.iter_size, layer_wise=s.param.layer_wise_reduce,
                                    bucket_bytes=mb << 20)
        s._agree_on_buckets()
        s.reducer.attach()

    def _reduce_in(self, kind: str) -> None:
        reducer = self.solver.reducer
        if reducer.half_tensor is not None:
            reducer.sum_in_half(kind == "backward")
        self.wire_bytes[kind] = reducer.wire_bytes()

    def _time(self) -> float:
        seconds = _timed(self.world, lambda: self.solver.step(1), self.backend.synchronize, self.a.warmup,
                         self.a.iterations)
        return self.world.size * self.a.batch * self.a.iterations / seconds

    def window(self) -> None:
        row_mb, row_variant = self.sizes[0], self.variants[0]
        for kind in self.kinds[1:]:  # the other reduction types, at the row's bucket size
            self._use(row_mb, row_variant)
            self._reduce_in(kind)
            self.by_kind[kind].append(self._time())
        for variant in self.variants[1:]:  # the other NCCL variants, at the row's bucket size
            self._use(row_mb, variant)
            self._reduce_in(self.kinds[0])
            self.by_variant[variant].append(self._time())
        for mb in self.sizes[1:] + self.sizes[:1]:  # the row's own size last: `result` reads its reducer
            self._use(mb, row_variant)
            self._reduce_in(self.kinds[0])
            reducer = self.solver.reducer
            first = len(reducer.settle_timing())
            speed = self._time()
            self.by_size[mb].append(speed)
            if mb == self.sizes[0]:
                self.windows.append(speed)
                self.by_variant[row_variant].append(speed)
                self.by_kind[self.kinds[0]].append(speed)
                waits = reducer.settle_timing()[first + self.a.warmup:]
                self.waits.append(statistics.median(waits) if waits else 0.0)

    def result(self) -> dict:
        if not self.fits:
            return {"ok": False, "fits": False, "error": self.error}
        r = self.solver.reducer
        return {"ok": bool(self.windows), "fits": True, "batch": self.a.batch, "ranks": self.world.size,
                "windows": self.windows, "img_per_s": statistics.median(self.windows) if self.windows else None,
                "wait_ms": statistics.median(self.waits) if self.waits else None,
                "memory_mode": self.solver.net.memory.name, "pool_bytes": self.solver.net.pool.capacity,
                "buckets": len(r.buckets), "bucket_mb": self.sizes[0], "flat": r.flat,
                "reductions_per_iter": r.calls_per_iteration, "layer_wise": r.layer_wise,
                "precision": self.a.precision or "prototxt", "reduce_type": r.reduce_type_name,
                "wire_bytes_per_iter": r.wire_bytes()}

    def close(self) -> None:
        for collective in self.collectives.values():
            if self.fits and hasattr(collective, "close"):
                collective.close()
        self.sink.close()


class TorchSide:
    """torchvision's model under DistributedDataParallel on this rank, built once; `window()` times it."""

    def __init__(self, a: argparse.Namespace, world: Any):
        import socket

        import torch
        import torch.distributed as dist

        from tools.bench import torch_nets

        self.a, self.world, self.torch = a, world, torch
        self.config = torch_nets.TORCH_CONFIGS[a.torch_config]
        self.local = world.local_rank
        torch.cuda.set_device(self.local)
        # Under the budget cuDNN's engine search would try workspaces the cap then refuses mid-run: off there.
        torch.backends.cudnn.benchmark = not a.budget
        port = world.broadcast(_free_port() if world.is_root else None)
        os.environ["MASTER_ADDR"] = world.broadcast(socket.gethostname() if world.is_root else None)
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("nccl", rank=world.rank, world_size=world.size)
        self.windows: list[float] = []
        self.fits, self.error = True, ""
        self.batch = a.batch
        if a.budget:
            self.batch = self._widest()
        while self.batch:
            try:
                self._build(self.batch)
                for _ in range(2):  # the second step holds the optimizer's momentum too
                    self._step()
                torch.cuda.synchronize()
                self.fits, self.error = True, ""
                return
            except torch.cuda.OutOfMemoryError as e:  # every rank alike: the same model, batch and cap
                self.fits, self.error = False, f"DDP at batch {self.batch}: OOM: {str(e)[:200]}"
                self.ddp = self.opt = self.x = self.y = None
                torch.cuda.empty_cache()
                if not a.budget:
                    return
                self.batch -= 8
        self.fits, self.error = False, self.error or "DDP: OOM at every batch down to 8"

    def _cap(self, nbytes: int) -> None:
        total = self.torch.cuda.get_device_properties(self.local).total_memory
        self.torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), self.local)

    def _model(self, batch: int) -> tuple[Any, tuple]:
        from tools.bench import torch_nets

        self.torch.manual_seed(0)
        model, shape, _source = torch_nets.build(self.a.net, "checkpoint" if self.a.budget else "plain", batch)
        model = model.cuda().train()
        if self.config.channels_last:
            model = model.to(memory_format=self.torch.channels_last)
        return model, shape

    def _widest(self) -> int:
        """The widest batch (multiple of 8) whose checkpointed training step (SGD with momentum) fits the
        budget less DDP's gradient buckets, probed without DDP (no collective can hang on an out-of-memory),
        the smallest of every rank's; `__init__` steps down from it should DDP itself not fit."""
        from tools.bench import torch_nets

        torch = self.torch
        model, shape = self._model(8)
        grads = sum(p.numel() * p.element_size() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=1e-9, momentum=0.9)
        self._cap(self.a.budget - grads)

        def fits(b: int) -> bool:
            def steps() -> None:  # the batch lives in this frame only: gone once it returns or fails
                x = torch.randn((b,) + tuple(shape[1:]), device="cuda")
                y = torch.full((b,), 7, dtype=torch.long, device="cuda")
                for _ in range(2):
                    opt.zero_grad(set_to_none=True)
                    model(x, y).backward()
                    opt.step()

            def release() -> None:
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()

            return torch_nets.fits_in_memory(steps, release)

        start = common.NETS[self.a.net].torch_checkpoint_widest or self.a.batch
        best = common.search_edge(fits, start, step=8, max_probes=7)
        model = opt = None  # the probes' memory goes before DDP's model is built
        torch.cuda.empty_cache()
        self._cap(self.a.budget)
        from mpi4py import MPI

        return int(self.world.comm.allreduce(best, op=MPI.MIN))

    def _build(self, batch: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from superneurons.io.prototxt import read_solver

        torch = self.torch
        model, shape = self._model(batch)
        sp = read_solver(str(common.ROOT / common.NETS[self.a.net].solver))
        self.ddp = DistributedDataParallel(model, device_ids=[self.local])
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=sp.base_lr or 0.01, momentum=sp.momentum,
                                   weight_decay=sp.weight_decay)
        self.x = torch.randn((batch,) + tuple(shape[1:]), device="cuda")
        if self.config.channels_last:
            self.x = self.x.to(memory_format=torch.channels_last)
        self.y = torch.full((batch,), 7, dtype=torch.long, device="cuda")

    def _step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.ddp(self.x, self.y)
        loss.backward()
        self.opt.step()

    def autocast(self) -> Any:
        """The forward's autocast region of --torch-config (none for the float32 configurations)."""
        if self.config.autocast is None:
            return contextlib.nullcontext()
        return self.torch.autocast("cuda", dtype=getattr(self.torch, self.config.autocast))

    def window(self) -> None:
        seconds = _timed(self.world, self._step, self.torch.cuda.synchronize, self.a.warmup, self.a.iterations)
        self.windows.append(self.world.size * self.batch * self.a.iterations / seconds)

    def result(self) -> dict:
        if not self.fits:
            return {"ok": False, "fits": False, "batch": self.batch, "error": self.error}
        return {"ok": bool(self.windows), "fits": True, "batch": self.batch, "ranks": self.world.size,
                "windows": self.windows, "img_per_s": statistics.median(self.windows) if self.windows else None,
                "checkpoint": bool(self.a.budget), "torch_config": self.a.torch_config,
                "max_memory_allocated": self.torch.cuda.max_memory_allocated()}

    def close(self) -> None:
        self.torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
