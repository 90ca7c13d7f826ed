"""Convolution workspace (paper Fig. 12): img/s and the cuDNN algorithms each convolution uses, at two
memory budgets.

    python3 -m tools.bench.workspace [--nets alexnet] [--batches 256] [--budgets 3G,5G] [--memory liveness]

At each budget the pool gets what the planner says --memory MODE needs (+3 % against fragmentation) and
the rest of the budget, after the solver history, becomes the cuDNN workspace limit: the algorithms a
convolution may pick are those whose workspace fits what is left. (The paper's runtime re-decides this at
every step from the pool's free bytes; here the limit is fixed per run, from the planned peak.) Default
budgets: the pool's need + 64 MiB and + 2 GiB. Writes workspace.json with the per-layer choices.
"""
from __future__ import annotations

import sys

from tools.bench import common


def budgets_for(net: str, batch: int, mode: str, given: str) -> list[tuple[int, int]]:
    """[(budget, workspace limit)] for the run: the workspace is the budget minus pool and history."""
    need = common.plan_need(net, batch)
    pool = int((need.peaks[mode] + need.params) * 1.03)
    fixed = pool + need.history
    sizes = ([common.parse_size(s) for s in given.split(",") if s.strip()] if given
             else [fixed + 64 * common.MiB, fixed + 2 * common.GiB])
    return [(b, b - fixed) for b in sizes]


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, ("alexnet",), iterations=10)
    ap.add_argument("--budgets", default="", help="two or more budgets, e.g. 3G,5G (default: need+64M, need+2G)")
    ap.add_argument("--memory", default="liveness", help="memory mode (default %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup = min(args.iterations, 5), 2
    log = common.log_path(args, "workspace")
    rows, algo_rows, raw = [], [], {}
    for net, spec, b in common.net_batches(args):
        plan = budgets_for(net, b, args.memory, args.budgets)
        tasks = [dict(kind="ours", net=net, batch=b, memory=args.memory, budget=budget, workspace=ws,
                      iterations=args.iterations, warmup=args.warmup, algorithms=True)
                 for budget, ws in plan if ws > 0]
        results = common.run_worker(tasks, args.timeout, log=log)
        raw[f"{net}@{b}"] = results
        for r in results:
            rows.append([spec.label, b, _gib(r["task"]["budget"]), round(r["task"]["workspace"] / common.MiB),
                         r.get("memory_mode"), r.get("img_per_s"), None if r.get("ok") else str(r.get("error"))[:80]])
        per_layer: dict[str, list[str]] = {}
        for r in results:
            for a in r.get("algorithms", []):
                per_layer.setdefault(a["layer"], []).append(a["algo"])
        for layer, algos in per_layer.items():
            algo_rows.append([spec.label, b, layer] + algos + [""] * (len(results) - len(algos)))
    header = ["net", "batch", "budget GiB", "workspace MiB", "mode", "img/s", "note"]
    cols = [f"algorithms at budget {i + 1}" for i in range(max((len(r) - 3 for r in algo_rows), default=2))]
    tables = [{"title": "cuDNN algorithms per convolution (f: forward, d: backward data, w: backward filter)",
               "header": ["net", "batch", "layer"] + cols, "rows": algo_rows}]
    common.finish("workspace", "Convolution workspace at two budgets (Fig. 12)", args, header, rows,
                  extra={"raw": raw}, tables=tables)
    return 0


def _gib(v: int) -> float:
    return round(v / common.GiB, 2)


if __name__ == "__main__":
    sys.exit(main())
