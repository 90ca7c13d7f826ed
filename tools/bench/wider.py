"""Going wider (paper Table 5): the widest batch each system trains under a memory budget (default 12G).

    python3 -m tools.bench.wider [--nets resnet50,...] [--budget 12G] [--torch-variants plain,checkpoint] [--quick]

Ours: the planner (superneurons.memory.plan, no device) predicts the widest batch, a multiple of --step,
at which the cheapest mode `--memory auto` can pick fits the budget (pool, which holds parameters,
gradients and solver history or streams them from the host, + cuDNN workspace) while the pinned host
memory it takes (the host store for evicted activations) stays within 100 GiB; a worker then trains 2 iterations there and steps down ~3 % at a time until one succeeds.
PyTorch: torch.cuda.set_per_process_memory_fraction(budget / device memory), probing from the H200
figures of docs/BENCHMARKS.md up or down in whole --step batches (catching OutOfMemoryError,
empty_cache between probes), plain for every net and with per-block checkpointing for the ResNets.
--batches gives our starting batches instead of the planner's.

Writes wider.json (speed_zoo.py reads PyTorch-checkpoint's widest batches from it).
"""
from __future__ import annotations

import sys

from tools.bench import common


def torch_variants_for(net: str, given: str) -> list[str]:
    if given:
        return [v for v in given.split(",") if v]
    return ["plain", "checkpoint"] if net in common.RESNETS else ["plain"]


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, common.PAPER_NETS, iterations=2)
    ap.add_argument("--step", type=int, default=8, help="batch granularity (default %(default)s)")
    ap.add_argument("--torch-variants", default="", help="default: plain, and checkpoint for ResNets")
    ap.add_argument("--torch-source", default="auto", choices=["auto", "torchvision", "prototxt"],
                    help="PyTorch model: torchvision where it has the net (auto), or built from our prototxt")
    ap.add_argument("--predict-only", action="store_true", help="print the planner's predictions; no device")
    args = ap.parse_args(argv)
    if args.quick:
        args.nets = "resnet50"
        args.torch_variants = args.torch_variants or "checkpoint"
    nets = common.parse_nets(args.nets)
    budget = common.parse_size(args.budget)
    workspace = common.parse_size(args.workspace)
    starts = common.parse_batches(args.batches)
    log = common.log_path(args, "wider")
    rows, targets = [], []
    raw: dict[str, dict] = {}
    torch_widest: dict[str, dict[str, int | None]] = {"plain": {}, "checkpoint": {}, "offload": {}}
    for net in nets:
        spec = common.NETS[net]
        predicted, need = common.predict_widest(net, budget, workspace, args.step)
        start = (common.batches_for(net, starts, []) or [predicted])[0]
        print(f"{spec.label}: planner predicts batch {predicted} ({need.mode if need else '-'}) under {args.budget}",
              flush=True)
        ours = {}
        if not (args.no_ours or args.predict_only) and start:
            ours = common.run_worker([dict(kind="ours_widest", net=net, start=start, budget=budget,
                                           workspace=workspace, step=args.step, iterations=args.iterations)],
                                     args.timeout, log=log)[0]
        pt: dict[str, dict] = {}
        if not (args.no_torch or args.predict_only):
            variants = torch_variants_for(net, args.torch_variants)
            tasks = [dict(kind="torch_widest", net=net, variant=v, budget=budget, step=args.step,
                          start=(spec.torch_checkpoint_widest if v == "checkpoint" else spec.torch_plain_widest)
                          or spec.speed_batch, source=args.torch_source) for v in variants]
            pt = dict(zip(variants, common.run_worker(tasks, args.timeout, log=log)))
        for v, r in pt.items():
            torch_widest[v][net] = r.get("widest")
        raw[net] = {"predicted": predicted, "need": need.__dict__ if need else None, "ours": ours, "torch": pt}
        got = ours.get("widest")
        plain = pt.get("plain", {}).get("widest")
        ckpt = pt.get("checkpoint", {}).get("widest")
        r_ck, r_pl = common.ratio(got, ckpt), common.ratio(got, plain)
        rows.append([spec.label, predicted, need.mode if need else None, got, ours.get("memory_mode"),
                     plain, ckpt, r_pl, r_ck])
        if net in common.RESNETS:
            targets.append(common.target(f"wider {spec.label}", ">= 3x PyTorch-checkpoint's widest batch", r_ck, 3.0,
                                         _explain(need, budget, workspace)))
        if net in ("vgg16", "alexnet"):
            targets.append(common.target(f"wider {spec.label}", ">= 1.5x PyTorch plain's widest batch", r_pl, 1.5,
                                         _explain(need, budget, workspace)))
    header = ["net", "planner batch", "planner mode", "ours widest", "ours mode", "PyTorch plain", "PyTorch checkpoint",
              "ours / plain", "ours / checkpoint"]
    common.finish("wider", f"Widest batch under {args.budget} (Table 5)", args, header, rows,
                  extra={"raw": raw, "torch_widest": torch_widest, "budget": budget, "workspace": workspace},
                  targets=targets)
    return 0


def _explain(need, budget: int, workspace: int) -> str:
    """Where our bytes go at the widest batch: the floor of the largest layer and the resident parts."""
    if need is None:
        return ""
    mode = need.mode or "recompute"
    if need.streams:
        return (f"at batch {need.batch}: {mode} with parameters streamed from the host: device peak "
                f"{need.streamed_peak / common.GiB:.2f} GiB + workspace {workspace / common.GiB:.2f} of "
                f"{budget / common.GiB:.0f} GiB; pinned host {need.host / common.GiB:.1f} GiB")
    return (f"at batch {need.batch}: {mode} peak {need.peaks[mode] / common.GiB:.2f} GiB + params/grads "
            f"{need.params / common.GiB:.2f} + history {need.history / common.GiB:.2f} + workspace "
            f"{workspace / common.GiB:.2f} of {budget / common.GiB:.0f} GiB")


if __name__ == "__main__":
    sys.exit(main())
