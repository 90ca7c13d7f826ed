"""Memory pool (paper Table 2): our heap pool against one cudaMalloc/cudaFree per tensor, img/s.

    python3 -m tools.bench.pool [--nets resnet50,alexnet,vgg16] [--memory liveness] [--batches 64] [--quick]

Both runs use the same memory mode (default liveness, which allocates and frees tensors at every step:
that is where an allocator's cost shows). The second run sets SUPERNEURONS_ALLOCATOR=malloc, which makes the
Net allocate each tensor with its own cudaMalloc and free it with cudaFree; if the Net ignores it (its pool
class is still the heap pool) the row says so instead of timing the pool twice. Each run is its own worker
process. Writes pool.json.
"""
from __future__ import annotations

import sys

from tools.bench import common

ALLOCATORS = (("pool", {}), ("cudaMalloc", {"SUPERNEURONS_ALLOCATOR": "malloc"}))


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, ("resnet50", "alexnet", "vgg16", "resnet101", "inception_v4"), iterations=10)
    ap.add_argument("--memory", default="liveness", help="memory mode of both runs (default %(default)s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.nets, args.iterations, args.warmup = "resnet50", min(args.iterations, 5), 2
    log = common.log_path(args, "pool")
    rows, raw = [], {}
    for net, spec, b in common.net_batches(args):
        res = {}
        for name, env in ALLOCATORS:
            task = dict(kind="ours", net=net, batch=b, memory=args.memory, iterations=args.iterations,
                        warmup=args.warmup, expect_allocator=None if name == "pool" else "malloc")
            res[name] = common.run_worker([task], args.timeout, env=env, log=log)[0]
        p, m = res["pool"], res["cudaMalloc"]
        per = p.get("per_iteration") or {}
        note = "; ".join(str(r.get("error"))[:90] for r in (p, m) if not r.get("ok", True))
        rows.append([spec.label, b, args.memory, per.get("allocs"), p.get("img_per_s"), m.get("img_per_s"),
                     common.ratio(p.get("img_per_s"), m.get("img_per_s")), p.get("ms_per_iter"),
                     m.get("ms_per_iter"), note])
        raw[f"{net}@{b}"] = res
    header = ["net", "batch", "mode", "allocs/iter", "pool img/s", "cudaMalloc img/s", "speedup", "pool ms/iter",
              "cudaMalloc ms/iter", "note"]
    common.finish("pool", "Heap pool against cudaMalloc/cudaFree per tensor (Table 2)", args, header, rows,
                  extra={"raw": raw})
    return 0


if __name__ == "__main__":
    sys.exit(main())
