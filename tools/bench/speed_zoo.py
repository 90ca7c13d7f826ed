"""Training speed across the zoo (paper Fig. 14), SuperNeurons beside PyTorch in the same run.

    python3 -m tools.bench.speed_zoo [--nets alexnet,vgg16,...] [--batches 64] [--iterations 10] [--quick]

Part 1, batches both fit: ours with --memory auto and a pool of what the net needs (so auto keeps
everything resident) against PyTorch plain (cudnn.benchmark on), at each net's default batch
(AlexNet 256, others 64) or --batches.
Part 2, ResNets at PyTorch-checkpoint's widest batch under the budget (GPU.md: 336 / 256 / 184 for
ResNet-50/101/152, or --ckpt-batches, or the widest measured by wider.py when its JSON is in --out): ours
with --memory auto under --budget (12G) against PyTorch with per-block checkpointing and with save_on_cpu
offload (uncapped: a cap changes no speed, and a run at the edge of the cap could fail by a few MiB).
When the planner says our net does not fit the budget at that batch, ours runs under a 60 GiB budget
instead (auto then keeps everything resident if it can) and the row says so.

Each system runs in its own worker process per net. Prints the tables last; writes speed_zoo.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.bench import common


def ckpt_batches(args, nets: list[str]) -> dict[str, int]:
    """PyTorch-checkpoint's widest batch per ResNet: --ckpt-batches, wider.json in --out, or GPU.md."""
    out = {n: common.NETS[n].torch_checkpoint_widest for n in nets if common.NETS[n].torch_checkpoint_widest}
    for wider in sorted(Path(args.out).glob("wider*.json")):  # measured by wider.py in this run
        for n, v in json.loads(wider.read_text()).get("torch_widest", {}).get("checkpoint", {}).items():
            if n in out and v:
                out[n] = int(v)
    given = common.parse_batches(args.ckpt_batches)
    if isinstance(given, dict):
        out.update({n: b[0] for n, b in given.items() if b})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, common.PAPER_NETS, iterations=10)
    ap.add_argument("--ckpt-batches", default="", help="e.g. 'resnet50=336,resnet101=256' (part 2)")
    ap.add_argument("--no-part2", action="store_true", help="skip the runs at PyTorch-checkpoint's widest batch")
    args = ap.parse_args(argv)
    if args.quick:
        args.nets, args.iterations, args.warmup = "resnet50", min(args.iterations, 5), 2
    nets = common.parse_nets(args.nets)
    batches = common.parse_batches(args.batches)
    budget = common.parse_size(args.budget)
    workspace = common.parse_size(args.workspace)
    log = common.log_path(args, "speed_zoo")
    wide = {} if args.no_part2 else ckpt_batches(args, nets)
    torch_variants = ["checkpoint"] if args.quick else ["checkpoint", "offload"]
    rows, rows2, targets = [], [], []
    raw: dict[str, dict] = {}
    for net in nets:
        spec = common.NETS[net]
        bs = common.batches_for(net, batches, [spec.speed_batch])
        ours_tasks = [dict(kind="ours", net=net, batch=b, memory="auto", iterations=args.iterations,
                           warmup=args.warmup) for b in bs]
        torch_tasks = [dict(kind="torch", net=net, variant="plain", batch=b, iterations=args.iterations,
                            warmup=args.warmup, benchmark=True) for b in bs]
        wb = wide.get(net)
        capped = None
        if wb:
            need = common.plan_need(net, wb, budget, workspace)
            capped = need.mode is not None
            ours_tasks.append(dict(kind="ours", net=net, batch=wb, memory="auto", iterations=args.iterations,
                                   warmup=args.warmup, workspace=workspace,
                                   budget=budget if capped else common.UNCAPPED))
            torch_tasks += [dict(kind="torch", net=net, variant=v, batch=wb, iterations=args.iterations,
                                 warmup=args.warmup, benchmark=True) for v in torch_variants]
        ours = [] if args.no_ours else common.run_worker(ours_tasks, args.timeout, log=log)
        pt = [] if args.no_torch else common.run_worker(torch_tasks, args.timeout, log=log)
        raw[net] = {"ours": ours, "torch": pt}
        for k, b in enumerate(bs):
            o = ours[k] if k < len(ours) else {}
            t = pt[k] if k < len(pt) else {}
            r = common.ratio(o.get("img_per_s"), t.get("img_per_s"))
            rows.append([spec.label, b, o.get("memory_mode"), o.get("img_per_s"), t.get("img_per_s"), r,
                         _why(o) or _why(t)])
            targets.append(common.target(f"speed {spec.label} b{b}", ">= 1.0x PyTorch plain", r, 1.0))
        if wb:
            o = ours[len(bs)] if len(ours) > len(bs) else {}
            tv = {v: (pt[len(bs) + i] if len(pt) > len(bs) + i else {}) for i, v in enumerate(torch_variants)}
            ck = tv["checkpoint"].get("img_per_s")
            r = common.ratio(o.get("img_per_s"), ck)
            mode = (o.get("memory_mode") or "-") + ("" if capped else f" (uncapped: needs more than {args.budget})")
            rows2.append([spec.label, wb, mode, o.get("img_per_s"), ck, tv.get("offload", {}).get("img_per_s"), r,
                          _why(o) or _why(tv["checkpoint"])])
            targets.append(common.target(f"speed {spec.label} b{wb} (PyTorch-checkpoint's widest)",
                                         ">= 1.5x PyTorch checkpoint", r, 1.5,
                                         "" if capped else "ours ran without the budget: the planner says it "
                                                           "does not fit at this batch"))
    header = ["net", "batch", "ours mode", "ours img/s", "PyTorch plain img/s", "ratio", "note"]
    tables = [] if not rows2 else [{
        "title": f"At PyTorch-checkpoint's widest batch (ours under {args.budget})",
        "header": ["net", "batch", "ours mode", "ours img/s", "PyTorch checkpoint img/s", "PyTorch offload img/s",
                   "ratio vs checkpoint", "note"], "rows": rows2}]
    common.finish("speed_zoo", "Training speed where both fit (Fig. 14)", args, header, rows,
                  extra={"raw": raw, "ckpt_batches": wide}, targets=targets, tables=tables)
    return 0


def _why(r: dict) -> str:
    return "" if not r or r.get("ok", True) else str(r.get("error", ""))[:80]


if __name__ == "__main__":
    sys.exit(main())
