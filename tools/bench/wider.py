"""Going wider (paper Table 5): the widest batch each system trains under a memory budget (default 12G).

    python3 -m tools.bench.wider [--nets resnet50,...] [--budget 12G] [--torch-variants plain,checkpoint] [--quick]
                                 [--precision fp32|bf16|fp16] [--host-limit 76G] [--predict-only]

Ours: the planner (superneurons.memory.plan, no device) predicts the widest batch, a multiple of --step,
at which the cheapest mode `--memory auto` can pick fits the budget (pool, which holds parameters,
gradients and solver history or streams them from the host, + cuDNN workspace) while the pinned host
memory it takes (the host store for evicted activations) stays within --host-limit (default 60% of this
machine's RAM: give the GPU machine's when predicting elsewhere); a worker then trains 2 iterations there
and steps down ~3 % at a time until one succeeds. --predict-only prints the planner's batches and needs no
GPU.
PyTorch: torch.cuda.set_per_process_memory_fraction(budget / device memory), probing from the H200
figures of docs/BENCHMARKS.md up or down in whole --step batches (catching OutOfMemoryError,
empty_cache between probes), plain for every net and with per-block checkpointing for the ResNets.
--batches gives our starting batches instead of the planner's.

--precision: ours (the planner and the run) stores activations and gradients in float32, bfloat16 or
float16, as --precision of train; PyTorch runs the configuration its users would pick for that storage:
fp32 as above, bf16 as bfloat16 autocast with channels_last (torch_nets.py's bf16-cl), fp16 as float16
autocast with channels_last and a GradScaler (fp16-cl); checkpointing runs inside the autocast region, and
the recomputed forward runs under it too. The table's rows and the JSON name the precision and the
configuration.

Writes wider.json, or wider_<precision>.json for bf16 and fp16 (speed_zoo.py reads PyTorch-checkpoint's
widest batches from the float32 file).
"""
from __future__ import annotations

import sys

from tools.bench import common, speed_zoo, torch_nets


# Where PyTorch's probes start in half precision: the float32 figures times this (activations take half
# the bytes; weights, gradients and momentum stay float32), a guess that search_edge corrects.
HALF_START = 2


# The ResNets' bar against PyTorch with per-block checkpointing in the same storage type. Half storage halves
# the checkpointed and offloaded activations that bound our batch (the float32 master weights, gradients and
# history are a small part at these batches), so it is held to more than float32.
CHECKPOINT_BAR = {"fp32": 3.0, "bf16": 4.0, "fp16": 4.0}


def torch_variants_for(net: str, given: str) -> list[str]:
    if given:
        return [v for v in given.split(",") if v]
    return ["plain", "checkpoint"] if net in common.RESNETS else ["plain"]


def torch_start(spec: common.NetSpec, variant: str, precision: str) -> int:
    """The batch PyTorch's probes start from: the H200 float32 figure of the variant (the speed batch where
    none was measured), scaled for half precision."""
    fp32 = (spec.torch_checkpoint_widest if variant == "checkpoint" else spec.torch_plain_widest) or spec.speed_batch
    return fp32 * (1 if precision == "fp32" else HALF_START)


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, common.PAPER_NETS, iterations=2)
    ap.add_argument("--step", type=int, default=8, help="batch granularity (default %(default)s)")
    ap.add_argument("--torch-variants", default="", help="default: plain, and checkpoint for ResNets")
    ap.add_argument("--torch-source", default="auto", choices=["auto", "torchvision", "prototxt"],
                    help="PyTorch model: torchvision where it has the net (auto), or built from our prototxt")
    ap.add_argument("--predict-only", action="store_true", help="print the planner's predictions; no device")
    ap.add_argument("--host-limit", default=f"{common.HOST_PINNED_LIMIT >> 30}G",
                    help="pinned host memory our run may use (default %(default)s: 60%% of this machine's RAM)")
    common.add_precision_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.nets = "resnet50"
        args.torch_variants = args.torch_variants or "checkpoint"
    nets = common.parse_nets(args.nets)
    budget = common.parse_size(args.budget)
    workspace = common.parse_size(args.workspace)
    starts = common.parse_batches(args.batches)
    host_limit = common.parse_size(args.host_limit)
    precision, config = args.precision, common.PRECISION_TORCH_CONFIG[args.precision]
    args.tag = common.precision_tag(args.tag, precision)
    log = common.log_path(args, "wider")
    rows, targets = [], []
    raw: dict[str, dict] = {}
    torch_widest: dict[str, dict[str, int | None]] = {"plain": {}, "checkpoint": {}, "offload": {}}
    for net in nets:
        spec = common.NETS[net]
        predicted, need = common.predict_widest(net, budget, workspace, args.step, precision, host_limit)
        start = (common.batches_for(net, starts, []) or [predicted])[0]
        print(f"{spec.label}: planner predicts batch {predicted} ({need.mode if need else '-'}) in {precision} "
              f"under {args.budget}", flush=True)
        ours = {}
        if not (args.no_ours or args.predict_only) and start:
            ours = common.run_worker([dict(kind="ours_widest", net=net, start=start, budget=budget,
                                           workspace=workspace, step=args.step, iterations=args.iterations,
                                           **speed_zoo.precision_arg(precision))],
                                     args.timeout, env=common.host_env(host_limit), log=log)[0]
        pt: dict[str, dict] = {}
        if not (args.no_torch or args.predict_only):
            variants = torch_variants_for(net, args.torch_variants)
            tasks = [dict(kind="torch_widest", net=net, variant=v, budget=budget, step=args.step,
                          start=torch_start(spec, v, precision), source=args.torch_source, config=config)
                     for v in variants]
            pt = dict(zip(variants, common.run_worker(tasks, args.timeout, log=log)))
        for v, r in pt.items():
            torch_widest[v][net] = r.get("widest")
        raw[net] = {"predicted": predicted, "need": need.__dict__ if need else None, "ours": ours, "torch": pt}
        got = ours.get("widest")
        plain = pt.get("plain", {}).get("widest")
        ckpt = pt.get("checkpoint", {}).get("widest")
        r_ck, r_pl = common.ratio(got, ckpt), common.ratio(got, plain)
        rows.append([spec.label, precision, config, predicted, need.mode if need else None, got,
                     ours.get("memory_mode"), plain, ckpt, r_pl, r_ck])
        if net in common.RESNETS:
            bar = CHECKPOINT_BAR[precision]
            targets.append(common.target(f"wider {spec.label} {precision}",
                                         f">= {bar:g}x PyTorch-checkpoint's widest batch ({config})", r_ck, bar,
                                         _explain(need, budget, workspace)))
        if net in ("vgg16", "alexnet"):
            targets.append(common.target(f"wider {spec.label} {precision}",
                                         f">= 1.5x PyTorch plain's widest batch ({config})", r_pl, 1.5,
                                         _explain(need, budget, workspace)))
    header = ["net", "ours precision", "PyTorch config", "planner batch", "planner mode", "ours widest", "ours mode",
              "PyTorch plain", "PyTorch checkpoint", "ours / plain", "ours / checkpoint"]
    title = (f"Widest batch under {args.budget} (Table 5), ours {precision}, PyTorch "
             f"{torch_nets.TORCH_CONFIGS[config].label}")
    common.finish("wider", title, args, header, rows,
                  extra={"raw": raw, "torch_widest": torch_widest, "budget": budget, "workspace": workspace,
                         "host_limit": host_limit, "precision": precision, "torch_config": config},
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
