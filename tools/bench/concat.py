"""A net's Concat layers alone: our slab copies against PyTorch's cat and slice copies on the same tensors (GPU).

    python3 -m tools.bench.concat [--net squeezenet] [--batch 64] [--repeat 20] [--out DIR]

For every distinct Concat of models/<net>/<net>_dummy.prototxt at --batch (bottom shapes and axis), times with
CUDA events (median of --repeat after one warm-up), on tensors PyTorch allocated and our ops see through the
CUDA array interface:
- forward: ops.concat_forward (one slab copy per bottom) against torch.cat(bottoms, dim=axis, out=top)
  (CatArrayBatchedCopy: one launch for up to a batch of bottoms);
- backward: ops.concat_backward for every bottom (its slab of the top diff) against
  bottom_diff.copy_(top_diff.narrow(axis, offset, width)) for every bottom (the copy PyTorch makes where a
  consumer needs cat's gradient slices contiguous);
and checks that both sides produce the same bits. Totals are weighted by how many layers share each Concat:
what one training iteration spends. GB/s counts bytes read plus bytes written.

Writes concat_<net>.json to --out (default $OUT or .).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from math import prod
from pathlib import Path

from tools.bench import common


def concat_shapes(net: str, batch: int) -> Counter:
    """(bottom shapes, axis) of every Concat layer of the net's training graph, with multiplicity."""
    graph = common.train_graph(net, batch)
    shapes: Counter = Counter()
    for n in graph.nodes:
        if n.layer.type_name == "Concat":
            shapes[(tuple(graph.blob_shapes[b] for b in n.bottoms), n.layer.axis)] += 1
    return shapes


def top_shape(bottoms, axis: int) -> tuple:
    top = list(bottoms[0])
    top[axis] = sum(s[axis] for s in bottoms)
    return tuple(top)


def run_concat(key, repeat: int, timer) -> dict:
    import torch
    from numba import cuda

    from superneurons.backend.cuda.ops import concat

    bottom_shapes, axis = key
    shape = top_shape(bottom_shapes, axis)
    widths = [s[axis] for s in bottom_shapes]
    offsets = [sum(widths[:j]) for j in range(len(widths))]
    dev = torch.device("cuda")
    xs = [torch.randn(s, device=dev) for s in bottom_shapes]
    tops = {side: torch.full(shape, float("nan"), device=dev) for side in ("ours", "torch")}
    dtop = torch.randn(shape, device=dev)
    dxs = {side: [torch.full(s, float("nan"), device=dev) for s in bottom_shapes] for side in ("ours", "torch")}
    # our side's views of the same memory, made once: the launch cache keys arrays by identity
    n_xs = [cuda.as_cuda_array(x) for x in xs]
    n_top, n_dtop = cuda.as_cuda_array(tops["ours"]), cuda.as_cuda_array(dtop)
    n_dxs = [cuda.as_cuda_array(d) for d in dxs["ours"]]

    def ours_forward():
        concat.concat_forward(n_xs, n_top, axis)

    def torch_forward():
        torch.cat(xs, dim=axis, out=tops["torch"])

    def ours_backward():
        for d, off in zip(n_dxs, offsets):
            concat.concat_backward(n_dtop, d, axis, off)

    def torch_backward():
        for d, off, w in zip(dxs["torch"], offsets, widths):
            d.copy_(dtop.narrow(axis, off, w))

    out = {"bottoms": [list(s) for s in bottom_shapes], "axis": axis, "top": list(shape),
           "forward_ms": {"ours": timer.ms(ours_forward, repeat), "torch.cat": timer.ms(torch_forward, repeat)},
           "backward_ms": {"ours": timer.ms(ours_backward, repeat),
                           "narrow.copy_": timer.ms(torch_backward, repeat)}}
    torch.cuda.synchronize()
    out["same_bits"] = bool(torch.equal(tops["ours"], tops["torch"])
                            and all(torch.equal(a, b) for a, b in zip(dxs["ours"], dxs["torch"])))
    out["mbytes_moved"] = 2 * 4 * tops["ours"].numel() / 1e6  # each direction reads and writes the top's size
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", default="squeezenet", help="a zoo net with Concat layers: squeezenet, inception_v4, "
                                                        "densenet121")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    common.parse_nets(args.net)
    shapes = concat_shapes(args.net, args.batch)
    if not shapes:
        raise SystemExit(f"{args.net} has no Concat layer")
    from superneurons.backend import get_backend
    from tools.bench.bn_kernels import Timer

    get_backend("cuda", 0)
    timer = Timer()
    rows, totals = [], {"forward": {"ours": 0.0, "torch.cat": 0.0}, "backward": {"ours": 0.0, "narrow.copy_": 0.0}}
    print(f"{args.net} Concat layers, batch {args.batch}: ms per call (median of {args.repeat}); "
          f"ratio = ours / PyTorch (below 1: ours faster)")
    print(f"{'top':>22} {'bottoms':>7} {'axis':>4} {'layers':>6} {'MB':>7} {'fwd ours':>9} {'torch.cat':>9} "
          f"{'ratio':>5} {'GB/s':>6} {'bwd ours':>9} {'narrow':>9} {'ratio':>5} {'GB/s':>6} {'same':>4}")
    for key, count in sorted(shapes.items(), key=lambda kv: -prod(top_shape(*kv[0]))):  # largest first
        r = run_concat(key, args.repeat, timer)
        r["layers"] = count
        rows.append(r)
        f, b = r["forward_ms"], r["backward_ms"]
        for direction, times in (("forward", f), ("backward", b)):
            for side, ms in times.items():
                totals[direction][side] += count * ms
        mb = r["mbytes_moved"]
        print(f"{' x '.join(map(str, r['top'])):>22} {len(r['bottoms']):>7} {r['axis']:>4} {count:>6} {mb:>7.1f} "
              f"{f['ours']:>9.3f} {f['torch.cat']:>9.3f} {f['ours'] / f['torch.cat']:>5.2f} {mb / f['ours']:>6.0f} "
              f"{b['ours']:>9.3f} {b['narrow.copy_']:>9.3f} {b['ours'] / b['narrow.copy_']:>5.2f} "
              f"{mb / b['ours']:>6.0f} {'yes' if r['same_bits'] else 'NO':>4}", flush=True)
    tf, tb = totals["forward"], totals["backward"]
    print(f"{'all (x layers)':>22} {'':>7} {'':>4} {sum(shapes.values()):>6} {'':>7} {tf['ours']:>9.3f} "
          f"{tf['torch.cat']:>9.3f} {tf['ours'] / tf['torch.cat']:>5.2f} {'':>6} {tb['ours']:>9.3f} "
          f"{tb['narrow.copy_']:>9.3f} {tb['ours'] / tb['narrow.copy_']:>5.2f}")
    path = Path(args.out) / f"concat_{args.net}.json"
    path.write_text(json.dumps({"net": args.net, "batch": args.batch, "device": common.device_info(),
                                "rows": rows, "totals_ms": totals}, indent=1))
    print(f"wrote {path}")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
