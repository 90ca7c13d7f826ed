"""Training speed across the zoo (paper Fig. 14), SuperNeurons beside PyTorch on the same architecture.

    python3 -m tools.bench.speed_zoo [--nets alexnet,vgg16,...] [--batches 64] [--iterations 5] [--quick]
                                     [--tf32 on|off] [--torch-benchmark on|off] [--part2] [--time-limit 540]
                                     [--torch-configs fp32,fp32-cl,bf16-cl,bf16-cl-compile] [--precisions fp32,bf16]

Part 1, batches both fit: ours with --memory auto and a pool of what the net needs (so auto keeps
everything resident), in each of --precisions, against PyTorch plain, at each net's default batch (AlexNet
256, others 64) or --batches. PyTorch runs the net built from the same prototxt (tools/bench/torch_nets.py,
source="prototxt": the like-for-like columns and the ratios) in each of --torch-configs, the ways its users
run it: eager float32 NCHW, eager float32 channels_last, bfloat16 autocast channels_last and torch.compile of
that (its compile time a column apart from the steady-state img/s); then torchvision's model in float32
where torchvision has the net (a column of its own: torchvision's AlexNet, for one, has no LRN, no groups and
fewer filters than Caffe's). Our float32 is compared with PyTorch's float32 configurations, our half
precisions with its autocast ones. The default nets are the paper's six plus DenseNet-121,
MobileNet (v1, depthwise convolutions) and SqueezeNet (v1.0, fire modules).

Settings, stated in the table's title and in the JSON (`settings`, and per row): TF32 for cuDNN
convolutions on both sides by default (ours: SUPERNEURONS_TF32; PyTorch: cudnn.allow_tf32; --tf32 off turns
it off on both), GEMMs in FP32 on both (cuBLAS default math; PyTorch's matmul.allow_tf32 off); PyTorch's
cudnn.benchmark on (--torch-benchmark off), ours measures convolution algorithms too, its default
(SUPERNEURONS_CUDNN_FIND=0 takes cuDNN's heuristics instead).

Part 2 (--part2, or given --ckpt-batches), ResNets at PyTorch-checkpoint's widest batch under the budget
(GPU.md: 336 / 256 / 184 for ResNet-50/101/152, or --ckpt-batches, or the widest measured by wider.py when
its JSON is in --out): ours with --memory auto under --budget (12G) against PyTorch with per-block
checkpointing (torch.utils.checkpoint over each residual block), the net built from the same prototxt (the
ratio) and torchvision's ResNet as a second column, and with --torch-offload also save_on_cpu offload
(PyTorch uncapped: a cap changes no speed, and a run at the edge of the cap could fail by a few MiB). The
row also gives ours at that batch over ours at the default batch (how far from our own plain speed). When the planner says our net does not fit the budget at
that batch, ours runs under a 60 GiB budget instead (auto then keeps everything resident if it can) and
the row says so.

Each system runs in its own worker process per net. With --repeats N the two systems' workers alternate N
times per net and each row takes each side's median run (the JSON keeps every run's img/s, `runs`): where
a net's speed follows the host's from run to run (DenseNet-121 issues ~1300 launches and cuDNN calls per
step), one pair of runs can land anywhere in that spread. The run stops starting nets once --time-limit seconds
have passed (the rows left out say so), and every worker is stopped 30 s after it, so that the JSON is
written within one 10-minute GPU call. Prints the tables last; writes speed_zoo.json.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tools.bench import common, torch_nets

DEFAULT_CONFIGS = ("fp32", "fp32-cl", "bf16-cl", "bf16-cl-compile")
PRECISIONS = ("fp32", "bf16", "fp16")


def comparable(precision: str, config: str) -> bool:
    """Which of our precisions a ratio compares with which PyTorch configuration: float32 with PyTorch's
    float32 runs, half with its autocast runs (bfloat16 or float16 alike)."""
    return (precision == "fp32") == (torch_nets.TORCH_CONFIGS[config].autocast is None)


def precision_arg(precision: str) -> dict[str, str]:
    """ours_task's keyword for a precision: none for float32, so float32 rows run on any build of ours."""
    return {} if precision == "fp32" else {"precision": precision}


def ckpt_batches(args, nets: list[str]) -> dict[str, int]:
    """PyTorch-checkpoint's widest batch per ResNet: --ckpt-batches, wider.json in --out, or GPU.md."""
    out = {n: common.NETS[n].torch_checkpoint_widest for n in nets if common.NETS[n].torch_checkpoint_widest}
    for wider in sorted(Path(args.out).glob("wider*.json")):  # measured by wider.py in this run
        doc = json.loads(wider.read_text())
        if doc.get("precision", "fp32") != "fp32":  # part 2 runs both sides in float32
            continue
        for n, v in doc.get("torch_widest", {}).get("checkpoint", {}).items():
            if n in out and v:
                out[n] = int(v)
    given = common.parse_batches(args.ckpt_batches)
    if isinstance(given, dict):
        out.update({n: b[0] for n, b in given.items() if b})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, common.SPEED_NETS, iterations=5)
    ap.set_defaults(warmup=2)
    ap.add_argument("--tf32", choices=("on", "off"), default="on",
                    help="TF32 for cuDNN convolutions, both sides (default %(default)s, both sides' default)")
    ap.add_argument("--torch-benchmark", choices=("on", "off"), default="on",
                    help="PyTorch's cudnn.benchmark (default %(default)s)")
    ap.add_argument("--no-torchvision", action="store_true", help="skip the torchvision column")
    ap.add_argument("--torch-configs", default=",".join(DEFAULT_CONFIGS),
                    help="PyTorch configurations, each on the net built from the same prototxt (default "
                         f"%(default)s; of {', '.join(torch_nets.TORCH_CONFIGS)})")
    ap.add_argument("--precisions", default="fp32",
                    help="ours in these precisions (--precision of train: fp32, bf16, fp16; default %(default)s)")
    ap.add_argument("--part2", action="store_true", help="also run the ResNets at PyTorch-checkpoint's widest batch")
    ap.add_argument("--ckpt-batches", default="", help="e.g. 'resnet50=336,resnet101=256' (implies --part2)")
    ap.add_argument("--torch-offload", action="store_true",
                    help="part 2 also runs PyTorch's save_on_cpu offload (torchvision's ResNets; ~8x slower)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each side per net, alternating; rows take the medians (default %(default)s)")
    ap.add_argument("--time-limit", type=float, default=540,
                    help="seconds after which no further net starts (default %(default)s)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be 1 or more, not {args.repeats}")
    configs = [c for c in args.torch_configs.split(",") if c]
    precisions = [p for p in args.precisions.split(",") if p]
    for c in configs:
        if c not in torch_nets.TORCH_CONFIGS:
            ap.error(f"--torch-configs: unknown configuration {c!r}; choose from {', '.join(torch_nets.TORCH_CONFIGS)}")
    for p in precisions:
        if p not in PRECISIONS:
            ap.error(f"--precisions: unknown precision {p!r}; choose from {', '.join(PRECISIONS)}")
    if not configs or not precisions:
        ap.error("--torch-configs and --precisions each need at least one value")
    if args.quick:
        args.nets, args.iterations, args.warmup = "resnet50", min(args.iterations, 5), 2
    nets = common.parse_nets(args.nets)
    batches = common.parse_batches(args.batches)
    budget = common.parse_size(args.budget)
    workspace = common.parse_size(args.workspace)
    log = common.log_path(args, "speed_zoo")
    part2 = args.part2 or bool(args.ckpt_batches)
    wide = ckpt_batches(args, nets) if part2 else {}
    tf32, benchmark = args.tf32 == "on", args.torch_benchmark == "on"
    ours_env = {"SUPERNEURONS_TF32": "1" if tf32 else "0"}
    # Part 2's PyTorch runs: (variant, source), the like-for-like checkpoint first (the ratio).
    torch_variants = [("checkpoint", "prototxt")] + ([] if args.quick or args.no_torchvision else
                                                     [("checkpoint", "torchvision")])
    torch_variants += [("offload", "torchvision")] if args.torch_offload else []
    rows, rows2, targets, skipped = [], [], [], []
    raw: dict[str, dict] = {}
    t_start = time.monotonic()

    def worker_timeout() -> int:  # a net started before the limit may run 30 s past it, no more
        return max(1, min(args.timeout, int(args.time_limit + 30 - (time.monotonic() - t_start))))

    def write(done: bool) -> None:
        _report(args, precisions, configs, rows, rows2, targets, skipped, raw, wide, tf32, benchmark, t_start, done)

    for net in nets:
        left = args.time_limit - (time.monotonic() - t_start)
        if left <= 0:
            skipped.append(net)
            continue
        spec = common.NETS[net]
        bs = common.batches_for(net, batches, [spec.speed_batch])
        run = dict(iterations=args.iterations, warmup=args.warmup)
        ours_tasks = [dict(kind="ours", net=net, batch=b, memory="auto", **precision_arg(p), **run)
                      for b in bs for p in precisions]
        tv = spec.torchvision and not args.no_torchvision
        torch_tasks = [dict(kind="torch", net=net, variant="plain", batch=b, source=src, benchmark=benchmark,
                            tf32=tf32, config=c, **run)
                       for b in bs for src, c in [("prototxt", c) for c in configs] + ([("torchvision", "fp32")]
                                                                                      if tv else [])]
        wb = wide.get(net)
        capped = None
        if wb:
            need = common.plan_need(net, wb, budget, workspace)
            capped = need.mode is not None
            ours_tasks.append(dict(kind="ours", net=net, batch=wb, memory="auto", workspace=workspace,
                                   budget=budget if capped else common.UNCAPPED, **run))
            torch_tasks += [dict(kind="torch", net=net, variant=v, batch=wb, source=src, benchmark=benchmark,
                                 tf32=tf32, **run) for v, src in torch_variants]
        sides = ([] if args.no_ours else [f"ours {', '.join(precisions)}"]) + (
            [] if args.no_torch else [f"PyTorch {', '.join(configs)}{' and torchvision' if tv else ''}"])
        print(f"[{time.monotonic() - t_start:5.0f} s] {spec.label}: batches {bs}, {', '.join(sides)}", flush=True)
        ours_runs, pt_runs = [], []
        for _ in range(args.repeats):
            if not args.no_ours:
                ours_runs.append(common.run_worker(ours_tasks, worker_timeout(), env=ours_env, log=log))
            if not args.no_torch:
                pt_runs.append(common.run_worker(torch_tasks, worker_timeout(), log=log))
        ours, pt = median_runs(ours_runs), median_runs(pt_runs)
        raw[net] = {"ours": ours, "torch": pt}
        per_batch = len(configs) + (1 if tv else 0)
        for k, b in enumerate(bs):
            mine = {p: _at(ours, k * len(precisions) + i) for i, p in enumerate(precisions)}
            theirs = {c: _at(pt, k * per_batch + i) for i, c in enumerate(configs)}
            tv_run = _at(pt, k * per_batch + len(configs)) if tv else {}
            row, notes = [spec.label, b, mine[precisions[0]].get("memory_mode")], []
            row += [mine[p].get("img_per_s") for p in precisions]
            row += [theirs[c].get("img_per_s") for c in configs]
            row += [theirs[c].get("compile_s") for c in configs if torch_nets.TORCH_CONFIGS[c].compiled]
            for p in precisions:
                for c in configs:
                    if comparable(p, c):
                        r = common.ratio(mine[p].get("img_per_s"), theirs[c].get("img_per_s"))
                        row.append(r)
                        goal = 1.0 if torch_nets.TORCH_CONFIGS[c].compiled else 1.05
                        targets.append(common.target(f"speed {spec.label} b{b} ours {p} / PyTorch {c}",
                                                     f">= {goal:g}x PyTorch {torch_nets.TORCH_CONFIGS[c].label}, "
                                                     "same prototxt", r, goal))
            row += [tv_run.get("img_per_s"), common.ratio(mine[precisions[0]].get("img_per_s"),
                                                          tv_run.get("img_per_s"))]
            notes = [_why(r) for r in list(mine.values()) + list(theirs.values()) + [tv_run]]
            row.append(next((n for n in notes if n), ""))
            rows.append(row)
        if wb:
            o = _at(ours, len(bs) * len(precisions))
            first = len(bs) * (len(configs) + (1 if tv else 0))
            tv = {key: _at(pt, first + i) for i, key in enumerate(torch_variants)}
            same = tv[torch_variants[0]]
            ck = same.get("img_per_s")
            r = common.ratio(o.get("img_per_s"), ck)
            mode = (o.get("memory_mode") or "-") + ("" if capped else f" (uncapped: needs more than {args.budget})")
            rows2.append([spec.label, wb, mode, o.get("img_per_s"),
                          common.ratio(o.get("img_per_s"), _at(ours, 0).get("img_per_s")), ck,
                          tv.get(("checkpoint", "torchvision"), {}).get("img_per_s"),
                          tv.get(("offload", "torchvision"), {}).get("img_per_s"), r, _why(o) or _why(same)])
            targets.append(common.target(f"speed {spec.label} b{wb} (PyTorch-checkpoint's widest)",
                                         ">= 1.0x PyTorch checkpoint on the same prototxt", r, 1.0,
                                         "" if capped else "ours ran without the budget: the planner says it "
                                                           "does not fit at this batch"))
        write(done=False)  # the figures so far: a run killed by an outer time limit keeps the nets it finished
    write(done=True)
    return 0


def _report(args, precisions, configs, rows, rows2, targets, skipped, raw, wide, tf32, benchmark, t_start,
            done: bool) -> None:
    """speed_zoo.json from the rows so far (`done`: the whole run, printed; else written only, noted partial)."""
    header = (["net", "batch", "ours mode"] + [f"ours {p} img/s" for p in precisions]
              + [f"PyTorch {torch_nets.TORCH_CONFIGS[c].label} img/s" for c in configs]
              + [f"PyTorch {c} compile s" for c in configs if torch_nets.TORCH_CONFIGS[c].compiled]
              + [f"ours {p} / PyTorch {c}" for p in precisions for c in configs if comparable(p, c)]
              + ["PyTorch torchvision fp32 img/s", "ratio vs torchvision", "note"])
    rows = rows + [[common.NETS[net].label] + [None] * (len(header) - 2)
                   + [f"not run: --time-limit {args.time_limit:g} s reached"] for net in skipped]
    in_force = settings_in_force(raw, tf32, benchmark)
    title = f"Training speed where both fit (Fig. 14); {describe(in_force)}"
    tables = [] if not rows2 else [{
        "title": f"At PyTorch-checkpoint's widest batch (ours: --memory auto under {args.budget}; PyTorch: "
                 f"per-block checkpoint, uncapped)",
        "header": ["net", "batch", "ours mode", "ours img/s", "ours / ours at the default batch",
                   "PyTorch checkpoint, same prototxt img/s", "PyTorch checkpoint, torchvision img/s",
                   "PyTorch save_on_cpu img/s", "ratio vs checkpoint (same prototxt)", "note"], "rows": rows2}]
    common.finish("speed_zoo", title, args, header, rows,
                  extra={"raw": raw, "ckpt_batches": wide, "settings": in_force, "skipped": skipped,
                         "seconds": time.monotonic() - t_start, "partial": not done},
                  targets=targets, tables=tables, quiet=not done,
                  notes=[] if done else [f"partial: written after {len(raw)} net(s); the run had not finished"])


def settings_in_force(raw: dict[str, dict], tf32: bool, benchmark: bool) -> dict[str, dict]:
    """Each side's TF32 and algorithm-search settings: as its workers reported them (the first that did),
    else as asked for."""
    ours = next((r for v in raw.values() for r in v["ours"] if "tf32_convolutions" in r), None)
    theirs = next((r for v in raw.values() for r in v["torch"] if "cudnn_allow_tf32" in r), None)
    keys_ours = ("tf32_convolutions", "tf32_gemm", "algorithm_choice")
    keys_torch = ("cudnn_allow_tf32", "matmul_allow_tf32", "cudnn_benchmark")
    return {"ours": {k: ours[k] for k in keys_ours} if ours else
            {"tf32_convolutions": tf32, "tf32_gemm": False, "algorithm_choice": "as asked (no worker reported)"},
            "torch": {k: theirs[k] for k in keys_torch} if theirs else
            {"cudnn_allow_tf32": tf32, "matmul_allow_tf32": False, "cudnn_benchmark": benchmark}}


def describe(in_force: dict[str, dict]) -> str:
    o, t = in_force["ours"], in_force["torch"]
    on = lambda v: "on" if v else "off"  # noqa: E731
    return (f"TF32 convolutions: ours {on(o['tf32_convolutions'])}, PyTorch {on(t['cudnn_allow_tf32'])}; "
            f"TF32 GEMM: ours {on(o['tf32_gemm'])}, PyTorch {on(t['matmul_allow_tf32'])}; "
            f"algorithms: ours {o['algorithm_choice']}, PyTorch cudnn.benchmark {on(t['cudnn_benchmark'])}")


def median_runs(runs: list[list[dict]]) -> list[dict]:
    """Per task, the run with the median img/s among those that finished (the lower middle one of an even
    count), with every finished run's img/s under `runs`; a task no run finished keeps its first result."""
    if not runs:
        return []
    out = []
    for k in range(len(runs[0])):
        done = sorted((r[k] for r in runs if k < len(r) and r[k].get("img_per_s")), key=lambda r: r["img_per_s"])
        if not done:
            out.append(runs[0][k])
            continue
        pick = dict(done[(len(done) - 1) // 2])
        pick["runs"] = [r[k]["img_per_s"] for r in runs if k < len(r) and r[k].get("img_per_s")]
        out.append(pick)
    return out


def _at(results: list[dict], k: int) -> dict:
    return results[k] if k < len(results) else {}


def _why(r: dict) -> str:
    return "" if not r or r.get("ok", True) else str(r.get("error", ""))[:80]


if __name__ == "__main__":
    sys.exit(main())
