"""Going deeper (paper Table 4): the deepest ResNet tools/models/make_resnet.py --blocks 6,32,N,6 each system
trains at batch 16 under a memory budget (default 12G). Depth = 3 * (44 + N) + 2 layers.

    python3 -m tools.bench.deeper [--budget 12G] [--batch 16] [--step 8] [--torch-variants plain,checkpoint] [--quick]
                                  [--precision fp32|bf16|fp16] [--solver-data-type FLOAT|FLOAT16|BFLOAT16]
                                  [--host-limit 76G] [--predict-only] [--start N]

Ours: the planner predicts the largest N (a multiple of --step) whose cheapest mode fits the budget (pool,
which holds parameters, gradients and solver history, + cuDNN workspace). When the parameters do not fit
beside the activations they stream from the host, one layer at a time, so the device need hardly grows
with N and the host's pinned memory (--host-limit, default 60% of this machine's RAM) bounds the depth:
the host store for evicted activations plus every parameter, gradient and history blob. A worker trains
2 iterations there and steps down by --step on failure.
PyTorch: the same prototxt turned into a torch module (tools/bench/torch_nets.py), capped with
set_per_process_memory_fraction, probed from the H200 figures of docs/BENCHMARKS.md (N = 176 plain,
544 checkpointed, i.e. 662 / 1766 layers; twice those in half precision). --quick: ours and PyTorch
checkpointed only. --predict-only prints the planner's N and needs no GPU.

--precision: ours (the planner and the run) stores activations and gradients in float32, bfloat16 or
float16, as --precision of train; PyTorch runs the configuration its users would pick for that storage:
fp32 as above, bf16 as bfloat16 autocast with channels_last (torch_nets.py's bf16-cl), fp16 as float16
autocast with channels_last and a GradScaler (fp16-cl), checkpointed blocks recomputed under the same
autocast. The table's rows and the JSON name the precision and the configuration.

--solver-data-type: ours keeps the master weights, their gradients and the momentum in this type (NVCaffe's
SolverParameter.solver_data_type; default FLOAT). With the parameters streamed they are most of the pinned
host bytes, so BFLOAT16 roughly halves what bounds N; it also rounds every update into bfloat16 (a weight
moves only by steps above 1/256 of itself), a training choice the user makes, not a free lunch. PyTorch's
runs are unchanged by it.

Writes deeper.json, or deeper_<precision>.json for bf16 and fp16 (and _solver<TYPE> when not FLOAT).
"""
from __future__ import annotations

import sys

from tools.bench import common, speed_zoo, torch_nets
from tools.bench.wider import HALF_START

TORCH_START = {"plain": common.TORCH_DEEP_PLAIN_N, "checkpoint": common.TORCH_DEEP_CHECKPOINT_N}


def torch_start(variant: str, precision: str) -> int:
    """The N PyTorch's probes start from: the float32 figure, scaled for half precision (a guess)."""
    return TORCH_START.get(variant, common.TORCH_DEEP_PLAIN_N) * (1 if precision == "fp32" else HALF_START)


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, [], iterations=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--step", type=int, default=8, help="granularity of N, blocks of stage 4 (default %(default)s)")
    ap.add_argument("--torch-variants", default="plain,checkpoint")
    ap.add_argument("--predict-only", action="store_true", help="print the planner's prediction; no device")
    ap.add_argument("--start", type=int, default=0,
                    help="our N to verify, instead of the planner's search (which takes minutes at N ~ 3000: run "
                         "it once with --predict-only, on any machine, with this machine's --host-limit)")
    ap.add_argument("--host-limit", default=f"{common.HOST_PINNED_LIMIT >> 30}G",
                    help="pinned host memory our run may use (default %(default)s: 60%% of this machine's RAM)")
    common.add_precision_argument(ap)
    ap.add_argument("--solver-data-type", choices=common.SOLVER_DATA_TYPES, default="FLOAT",
                    help="ours: storage of the master weights, their gradients and history (default %(default)s)")
    args = ap.parse_args(argv)
    master = args.solver_data_type
    variants = ["checkpoint"] if args.quick else [v for v in args.torch_variants.split(",") if v]
    budget = common.parse_size(args.budget)
    workspace = common.parse_size(args.workspace)
    log = common.log_path(args, "deeper")
    host_limit = common.parse_size(args.host_limit)
    precision, config = args.precision, common.PRECISION_TORCH_CONFIG[args.precision]
    args.tag = common.precision_tag(args.tag, precision)
    if master != "FLOAT":
        args.tag = "_".join(t for t in (args.tag, f"solver{master}") if t)
    if args.no_ours and not args.predict_only:
        predicted, need = 0, None  # PyTorch only: no need for the planner's minutes-long search
    elif args.start:
        predicted = args.start
        need = common.plan_need(f"deep:{predicted}", args.batch, budget, workspace, host_limit, precision, master)
    else:
        predicted, need = common.predict_deepest(budget, workspace, args.batch, args.step, host_limit, precision,
                                                 master)
    print(f"{'given' if args.start else 'planner'}: N = {predicted} ({common.deep_depth(predicted) if predicted else 0} layers, "
          f"{need.mode if need else '-'}{', parameters streamed' if need and need.streams else ''}) under "
          f"{args.budget} at batch {args.batch} in {precision}{_master(master)}; {_explain(need, predicted, budget, host_limit)}", flush=True)
    ours: dict = {}
    if predicted and not (args.no_ours or args.predict_only):
        ours = common.run_worker([dict(kind="ours_deepest", start=predicted, budget=budget, workspace=workspace,
                                       batch=args.batch, step=args.step, iterations=args.iterations,
                                       **speed_zoo.precision_arg(precision),
                                       **({"master": master} if master != "FLOAT" else {}))],
                                 args.timeout, env=common.host_env(host_limit), log=log)[0]
    pt: dict[str, dict] = {}
    if not (args.no_torch or args.predict_only):
        # one worker per variant: a deep net that ran out of memory leaves the allocator fragmented
        for v in variants:
            pt[v] = common.run_worker([dict(kind="torch_deepest", variant=v, start=torch_start(v, precision),
                                            budget=budget, batch=args.batch, step=args.step, config=config)],
                                      args.timeout, log=log)[0]
    rows = [[f"SuperNeurons ({'given start' if args.start else 'planner'})", precision + _master(master), predicted,
             common.deep_depth(predicted) if predicted else None, need.mode if need else None, None],
            ["SuperNeurons (trained)", precision + _master(master), ours.get("deepest_n"), ours.get("depth"), ours.get("memory_mode"),
             None if ours.get("ok", True) else ours.get("error")]]
    for v, r in pt.items():
        rows.append([f"PyTorch {v}", config, r.get("deepest_n"), r.get("depth"), None,
                     None if r.get("ok", True) else str(r.get("error"))[:80]])
    ck_depth = pt.get("checkpoint", {}).get("depth")
    targets = [common.target(f"deeper {precision}", f">= 3x PyTorch-checkpoint's depth ({config})",
                             common.ratio(ours.get("depth"), ck_depth), 3.0,
                             _explain(need, predicted, budget, host_limit))]
    title = (f"Deepest ResNet 6,32,N,6 at batch {args.batch} under {args.budget} (Table 4), ours {precision}{_master(master)}, "
             f"PyTorch {torch_nets.TORCH_CONFIGS[config].label}")
    common.finish("deeper", title, args, ["system", "precision", "N", "layers", "mode", "note"], rows,
                  extra={"predicted_n": predicted, "need": need.__dict__ if need else None, "ours": ours,
                         "torch": pt, "budget": budget, "host_limit": host_limit, "precision": precision,
                         "solver_data_type": master,
                         "torch_config": config}, targets=targets)
    return 0


def _master(master: str) -> str:
    return "" if master == "FLOAT" else f", solver_data_type {master}"


def _explain(need, n: int, budget: int, host_limit: int) -> str:
    if need is None:
        return ""
    mode = need.mode or "recompute"
    if need.streams:
        store = need.host - need.params - need.history  # evicted and checkpointed activations
        return (f"at N={n}: {mode} with parameters streamed from the host: device peak "
                f"{need.streamed_peak / common.GiB:.2f} GiB of {budget / common.GiB:.0f} GiB; pinned host "
                f"{need.host / common.GiB:.1f} GiB (params/grads {need.params / common.GiB:.2f} + history "
                f"{need.history / common.GiB:.2f} + host store {store / common.GiB:.2f}) of "
                f"{host_limit / common.GiB:.0f} GiB")
    per_block = "parameters, gradients and momentum of one 14x14 block: ~13 MiB"
    return (f"at N={n}: {mode} peak {need.peaks[mode] / common.GiB:.2f} GiB + params/grads "
            f"{need.params / common.GiB:.2f} + history {need.history / common.GiB:.2f} GiB of "
            f"{budget / common.GiB:.0f} GiB ({per_block})")


if __name__ == "__main__":
    sys.exit(main())
