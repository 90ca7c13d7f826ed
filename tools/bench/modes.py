"""Speed of each memory mode on one net (what each technique costs when it has nothing, or something, to do).

    python3 -m tools.bench.modes [--nets resnet50] [--batches 64] [--budget 12G] [--profile 25] [--quick]

Every mode (baseline, liveness, offload, recompute, auto) trains the same net and batch in its own worker,
with the pool sized to what the mode needs (nothing has to move) unless --budget is given, in which case the
pool is that budget (auto, offload and recompute then move or rebuild what does not fit). The table gives
img/s, the ratio to baseline, bytes moved and forward steps replayed per iteration. --profile N adds each
worker's top N functions by own time under cProfile (host time: where Python overhead lives). Writes modes.json.
"""
from __future__ import annotations

import sys

from tools.bench import common

MODES = ("baseline", "liveness", "offload", "recompute", "auto")


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, ("resnet50",), iterations=10)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile", type=int, default=0, help="cProfile lines per worker (default none)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (to check the script itself)")
    ap.add_argument("--checkpoints", default="", help="checkpoint layer types, e.g. Eltwise (default: Convolution)")
    ap.set_defaults(budget="")
    args = ap.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup = min(args.iterations, 5), 2
    budget = common.parse_size(args.budget) if args.budget else None
    log = common.log_path(args, "modes")
    rows, raw = [], {}
    for net, spec, b in common.net_batches(args):
        base = None
        for mode in args.modes.split(","):
            task = dict(kind="ours", net=net, batch=b, memory=mode, budget=budget, iterations=args.iterations,
                        warmup=args.warmup, profile=args.profile, device=args.device,
                        checkpoints=args.checkpoints)
            r = common.run_worker([task], args.timeout, log=log)[0]
            raw[f"{net}@{b}:{mode}"] = r
            if mode == "baseline" and r.get("ok"):
                base = r.get("img_per_s")
            per = r.get("per_iteration") or {}
            moved = ((per.get("bytes_offloaded") or 0) + (per.get("bytes_prefetched") or 0)) / 2**20
            rows.append([spec.label, b, mode, r.get("memory_mode"), r.get("img_per_s"),
                         common.ratio(r.get("img_per_s"), base), moved, per.get("replays"),
                         (r.get("pool_high_water") or 0) / 2**20, "" if r.get("ok") else str(r.get("error"))[:100]])
            if r.get("profile"):
                print(f"--- profile {net} b{b} {mode}\n{r['profile']}")
    header = ["net", "batch", "mode", "ran as", "img/s", "/ baseline", "MiB moved/iter", "replayed/iter",
              "pool high water MiB", "note"]
    common.finish("modes", "Speed per memory mode", args, header, rows, extra={"raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
