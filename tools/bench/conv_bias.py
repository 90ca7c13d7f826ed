"""A net's convolution biases alone: cuDNN's bias calls against our channel kernels (GPU).

    python3 -m tools.bench.conv_bias [--net vgg16] [--batch 64] [--repeat 20] [--out DIR]

For every distinct output shape (N, M, H, W) of a biased convolution of models/<net>/<net>_dummy.prototxt at
--batch, times with CUDA events (median of --repeat after one warm-up):
- forward: cudnnAddTensor (what Convolution's forward adds its bias with) against ops.add_bias (our
  channel_add kernel, one pass);
- backward: cudnnConvolutionBackwardBias (what Convolution's backward sums db with) against
  ops.bias_backward (our per-channel sum, the one InnerProduct and Bias use);
and checks that both compute the same (float32 sums in a different order: compared relative to the sum of
|dy|). Totals are weighted by how many layers share each shape: what one training iteration spends.

Writes conv_bias_<net>.json to --out (default $OUT or .).
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from tools.bench import common
from tools.bench.bn_kernels import Timer


def bias_shapes(net: str, batch: int) -> Counter:
    """(N, M, H, W, conv layer) of every biased, ungrouped convolution, with multiplicity per output shape."""
    graph = common.train_graph(net, batch)
    shapes: Counter = Counter()
    for n in graph.nodes:
        layer = n.layer
        if layer.type_name == "Convolution" and layer.bias is not None:
            shapes[(layer.n, layer.c, layer.h, layer.w, layer.m, layer.oh, layer.ow, layer.geom)] += 1
    return shapes


def run_shape(key, repeat: int, timer: Timer, rng) -> dict:
    from numba import cuda

    from superneurons.backend.cuda.device import current
    from superneurons.backend.cuda.ops import basic
    from superneurons.backend.scratch import row_sums

    n, c, h, w, m, oh, ow, geom = key
    cudnn = current().cudnn.conv_plan((n, c, h, w), (m, c // geom.group) + tuple(geom.kernel), (n, m, oh, ow),
                                      geom, np.dtype(np.float32))
    size = n * m * oh * ow
    dy_host = rng.standard_normal(size).astype(np.float32)
    dy = cuda.to_device(dy_host).reshape((n, m, oh, ow))
    y = cuda.to_device(dy_host).reshape((n, m, oh, ow))
    b = cuda.to_device(rng.standard_normal(m).astype(np.float32))
    db_cudnn, db_ours = cuda.to_device(np.zeros(m, np.float32)), cuda.to_device(np.zeros(m, np.float32))
    sums = cuda.device_array(row_sums(m), np.float64)  # what a Net's scratch region lends the op
    cudnn.backward_bias(dy, db_cudnn)
    basic.bias_backward(dy, db_ours, n, m, oh * ow, sums)
    scale = float(np.abs(dy_host.reshape(n, m, -1)).sum(axis=(0, 2)).max())
    differs = float(np.abs(db_cudnn.copy_to_host() - db_ours.copy_to_host()).max()) / scale
    out = {"shape": [n, m, oh, ow], "mbytes": 4 * size / 1e6, "relative_difference": differs,
           "forward_ms": {"cudnnAddTensor": timer.ms(lambda: cudnn.add_bias(b, y), repeat),
                          "ours": timer.ms(lambda: basic.add_bias(y, b, n, m, oh * ow), repeat)},
           "backward_ms": {"cudnnConvolutionBackwardBias": timer.ms(lambda: cudnn.backward_bias(dy, db_cudnn), repeat),
                           "ours": timer.ms(lambda: basic.bias_backward(dy, db_ours, n, m, oh * ow, sums), repeat)}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.kernel_parser(__doc__, "vgg16")
    args = ap.parse_args(argv)
    common.parse_nets(args.net)
    from superneurons.backend import get_backend

    get_backend("cuda", 0)
    timer, rng = Timer(), np.random.default_rng()
    rows, totals = [], {"forward": [0.0, 0.0], "backward": [0.0, 0.0]}
    print(f"{args.net} convolution biases, batch {args.batch}: ms per call (median of {args.repeat})")
    print(f"{'output N x M x H x W':>24} {'layers':>6} {'AddTensor':>10} {'ours':>8} {'BwdBias':>9} {'ours':>8} "
          f"{'rel. diff':>9}")
    for key, count in sorted(bias_shapes(args.net, args.batch).items(), key=lambda kv: -kv[0][4] * kv[0][5] * kv[0][6]):
        r = run_shape(key, args.repeat, timer, rng)
        r["layers"] = count
        rows.append(r)
        f, bwd = r["forward_ms"], r["backward_ms"]
        totals["forward"][0] += count * f["cudnnAddTensor"]
        totals["forward"][1] += count * f["ours"]
        totals["backward"][0] += count * bwd["cudnnConvolutionBackwardBias"]
        totals["backward"][1] += count * bwd["ours"]
        print(f"{' x '.join(map(str, r['shape'])):>24} {count:>6} {f['cudnnAddTensor']:>10.3f} {f['ours']:>8.3f} "
              f"{bwd['cudnnConvolutionBackwardBias']:>9.3f} {bwd['ours']:>8.3f} {r['relative_difference']:>9.1e}",
              flush=True)
    print(f"{'all (x layers)':>24} {'':>6} {totals['forward'][0]:>10.3f} {totals['forward'][1]:>8.3f} "
          f"{totals['backward'][0]:>9.3f} {totals['backward'][1]:>8.3f}")
    path = Path(args.out) / f"conv_bias_{args.net}.json"
    path.write_text(json.dumps({"net": args.net, "batch": args.batch, "rows": rows, "totals_ms": totals}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
