"""Tensor cache (paper Table 3): bytes moved between device and host per iteration, with and without the
cache, under --memory offload and a memory budget (default 12G).

    python3 -m tools.bench.cache [--nets alexnet,resnet50] [--batches 'alexnet=256:512:768:1024:1536,...'] [--quick]

With the cache (the default runtime) checkpoint outputs leave the device only when an allocation needs
their room, so a net that fits moves nothing. SUPERNEURONS_CACHE=0 turns the cache off: the offload manager
then moves every planned checkpoint every iteration. A case *fits* when the planner's liveness peak plus the
parameters fits the pool (budget - solver history - cuDNN workspace); otherwise it *overflows* and some
bytes must move. Moved = bytes_offloaded + bytes_prefetched per timed iteration, from the manager's counters.
Writes cache.json.
"""
from __future__ import annotations

import sys

from tools.bench import common

DEFAULT_BATCHES = {"alexnet": [256, 512, 768, 1024, 1536], "resnet50": [64, 96, 128]}
CACHE = (("cache", {}), ("no cache", {"SUPERNEURONS_CACHE": "0"}))


def fits_without_moving(net: str, batch: int, budget: int, workspace: int) -> tuple[bool, int, bool]:
    """(liveness fits the pool, bytes the offload plan moves, offload itself fits)."""
    need = common.plan_need(net, batch, budget, workspace)
    pool = budget - need.history - workspace
    return (need.peaks["liveness"] + need.params <= pool, need.offloaded,
            need.peaks["offload"] + need.params <= pool)


def moved(r: dict) -> float | None:
    per = r.get("per_iteration")
    return None if not per else per["bytes_offloaded"] + per["bytes_prefetched"]


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, ("alexnet", "resnet50"), iterations=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.nets, args.batches, args.iterations, args.warmup = "resnet50", args.batches or "resnet50=64", 2, 1
    budget = common.parse_size(args.budget)
    workspace = common.parse_size(args.workspace)
    batches = common.parse_batches(args.batches)
    log = common.log_path(args, "cache")
    rows, raw, targets = [], {}, []
    for net in common.parse_nets(args.nets):
        bs = common.batches_for(net, batches, DEFAULT_BATCHES.get(net, [common.NETS[net].speed_batch]))
        plans = {b: fits_without_moving(net, b, budget, workspace) for b in bs}
        runnable = [b for b in bs if plans[b][2]]
        results = {}
        for name, env in CACHE:
            tasks = [dict(kind="ours", net=net, batch=b, memory="offload", budget=budget, workspace=workspace,
                          iterations=args.iterations, warmup=args.warmup) for b in runnable]
            results[name] = dict(zip(runnable, common.run_worker(tasks, args.timeout, env=env, log=log)))
        for b in bs:
            fits, planned, runs = plans[b]
            w, wo = results["cache"].get(b, {}), results["no cache"].get(b, {})
            case = "fits" if fits else ("overflows" if runs else "does not fit even with offload")
            note = "; ".join(str(r.get("error"))[:80] for r in (w, wo) if r and not r.get("ok", True))
            if fits and planned and moved(wo) == 0:
                note = (note + "; " if note else "") + "SUPERNEURONS_CACHE=0 moved nothing: not honoured?"
            rows.append([common.NETS[net].label, b, case, _mib(planned), _mib(moved(w)), _mib(moved(wo)),
                         w.get("img_per_s"), wo.get("img_per_s"), note])
            raw[f"{net}@{b}"] = {"fits": fits, "planned_offload_bytes": planned, "cache": w, "no_cache": wo}
            if fits:
                m = moved(w)
                targets.append(common.target(f"cache {common.NETS[net].label} b{b}", "0 bytes moved when the net fits",
                                             None if m is None else float(m == 0), 1.0,
                                             "" if m is None else f"moved {m / common.MiB:.1f} MiB per iteration"))
    header = ["net", "batch", f"under {args.budget}", "planned offload MiB", "moved MiB/iter (cache)",
              "moved MiB/iter (no cache)", "img/s (cache)", "img/s (no cache)", "note"]
    common.finish("cache", "Tensor cache: bytes moved per iteration (Table 3)", args, header, rows,
                  extra={"raw": raw}, targets=targets)
    return 0


def _mib(v: float | None) -> float | None:
    return None if v is None else round(v / common.MiB, 1)


if __name__ == "__main__":
    sys.exit(main())
