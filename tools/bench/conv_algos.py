"""A net's convolutions alone on cuDNN's graph API: is the heuristics' first engine the fastest? (GPU)

    python3 -m tools.bench.conv_algos [--net resnet50] [--batch 64] [--top 8] [--workspace 1G] [--out DIR]

For every distinct ungrouped convolution shape of models/<net>/<net>_dummy.prototxt at --batch and each
direction the training step runs (forward; backward data, overwriting; backward filter, adding into dw as
Caffe's gradients accumulate, and the same with beta = 0), this builds the graph-API direction exactly as
the runtime does (backend/cuda/cudnn_graph.GraphDirection), then times, with CUDA events, the engine the
runtime picks (the first in heuristic order whose workspace fits --workspace) and the first --top engines
that fit, each on random operands (median of 5 runs after one warm-up). The table gives, per direction and
summed over the layers (weighted by how many layers share each shape), the picked engines' time and the
fastest measured engines' time: the gap is what measuring engines, as PyTorch's cudnn.benchmark does,
could save per iteration; the beta rows show whether adding into dw costs anything.

Writes conv_algos_<net>.json to --out (default $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from tools.bench import common

# (label, cudnn_graph direction: 0 forward, 1 backward data, 2 backward filter; beta)
DIRECTIONS = (("fwd", 0, 0.0), ("bwd data", 1, 0.0), ("bwd filter +=", 2, 1.0), ("bwd filter =", 2, 0.0))


def conv_shapes(net: str, batch: int) -> Counter:
    """(x shape, w shape, y shape, geometry) of every ungrouped Convolution of `net` at `batch` (grouped ones
    run on the legacy API), with multiplicity."""
    graph = common.train_graph(net, batch)
    out: Counter = Counter()
    for n in graph.nodes:
        layer = n.layer
        if layer.type_name == "Convolution" and layer.geom.group == 1:
            out[((layer.n, layer.c, layer.h, layer.w), tuple(layer.weight.shape),
                 (layer.n, layer.m, layer.oh, layer.ow), layer.geom)] += 1
    return out


def time_plan(direction, plan, handle_ptrs, ws: int, cuda) -> float:
    a, b, out = handle_ptrs
    start, end = cuda.event(), cuda.event()
    direction.execute(plan, a, b, out, ws)
    times = []
    for _ in range(5):
        start.record()
        direction.execute(plan, a, b, out, ws)
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--workspace", default="1G")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    from numba import cuda

    from superneurons.backend.cuda import CudaBackend, cudnn, cudnn_graph
    from superneurons.backend.cuda.device import current
    from superneurons.backend.cuda.pointers import pointer

    CudaBackend(0)  # the device, its cuDNN handle (on the compute stream) and TF32 setting, as training has
    dev = current()
    handle = dev.cudnn.value.value
    tf32 = dev.cudnn.math != cudnn.FMA_MATH
    limit = common.parse_size(args.workspace)
    ws = cuda.device_array(limit // 4, np.float32)
    rng = np.random.default_rng()
    totals = {label: [0.0, 0.0] for label, _d, _b in DIRECTIONS}
    raw, rows = [], []
    for (xs, wsh, ys, geom), layers in conv_shapes(args.net, args.batch).items():
        arrays = {k: cuda.to_device(rng.standard_normal(int(np.prod(s))).astype(np.float32))
                  for k, s in (("x", xs), ("w", wsh), ("y", ys))}
        operands = {0: ("x", "w", "y"), 1: ("w", "y", "x"), 2: ("x", "y", "w")}
        entry = {"x": xs, "w": wsh, "y": ys, "geom": str(geom), "layers": layers}
        for label, d, beta in DIRECTIONS:
            if d == 1 and xs[1] == 3:
                continue  # conv1's input gradient is never computed
            names = operands[d]
            shapes = tuple({"x": xs, "w": wsh, "y": ys}[k] for k in names)
            ptrs = tuple(pointer(arrays[k]) for k in names)
            direction = cudnn_graph.GraphDirection(handle, d, shapes, geom, 0, tf32, beta)
            picked = direction.pick(limit)
            measured = []
            for plan in direction.choices._all():
                if len(measured) >= args.top:
                    break
                if plan.workspace <= limit:
                    measured.append((time_plan(direction, plan, ptrs, pointer(ws), cuda), plan.engine, plan.workspace))
            t_pick = next(t for t, e, w in measured if e == picked.engine and w == picked.workspace)
            t_best, e_best, _ = min(measured)
            totals[label][0] += layers * t_pick
            totals[label][1] += layers * t_best
            entry[label] = {"picked": [picked.engine, picked.workspace, t_pick],
                            "measured": [[e, w, t] for t, e, w in measured]}
            rows.append([f"{xs[1]}x{xs[2]} -> {ys[1]} k{geom.kernel[0]} s{geom.stride[0]}", layers, label,
                         f"eng{picked.engine}", t_pick, f"eng{e_best}", t_best, len(measured)])
        raw.append(entry)
    for label, (p, b) in totals.items():
        rows.append(["all (x layers)", "", label, "", p, "", b, None])
    header = ["shape (C x H -> M)", "layers", "direction", "picked", "picked ms", "fastest", "fastest ms", "timed"]
    print(f"\n{args.net} convolutions, batch {args.batch}, graph API, workspace <= {args.workspace}")
    print(common.text_table(header, rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"conv_algos_{args.net}.json").write_text(json.dumps({"net": args.net, "batch": args.batch, "totals_ms": totals, "shapes": raw,
                                                     "device": common.device_info()}, indent=1))
    print(f"wrote {out / f'conv_algos_{args.net}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
