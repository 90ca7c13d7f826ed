"""The fused BatchNorm + Scale + ReLU kernels alone, on a net's BatchNorm shapes (GPU).

    python3 -m tools.bench.bn_kernels [--net resnet50] [--batch 64] [--repeat 20] [--out DIR]

For every fused BatchNorm of --net (models/NET/NET_dummy.prototxt) at --batch, times the forward
(`bn_affine_forward`: statistics and y) and the backward (`bn_affine_backward` from the kept input x, as the
out-of-place fused BatchNorm runs) with CUDA events, under each of --configs:
`NAME=ROWS_MIN:MIN_BLOCK[:CHANNEL_MIN[:CHANNEL_MAX]]`, the shortest plane the plain-sweep kernels take (0:
never), the fewest elements per block (0: the plain 4096-block chunking), and the fewest channels and most
elements per channel of the one-launch, one-block-per-channel kernels (0 or left out: never); see
backend/cuda/ops/fused.py.

Per shape: ms per call, the effective bandwidth (forward 3 passes over the activation: read x twice, write
y; backward 5: read x and dy twice, write dx) against a device-to-device copy measured in the same run, and
the largest difference from the first configuration's outputs on fresh random data (they must agree to
rounding). The totals, weighted by how many layers have each shape, are what one training iteration spends
in these kernels.

Writes bn_kernels_NET_bBATCH.json to --out (default $OUT or .).
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from tools.bench import common

FORWARD_PASSES, BACKWARD_PASSES = 3, 5


def bn_shapes(net: str, batch: int) -> Counter:
    """(outer, channels, inner) of every fused BatchNorm of `net` at `batch`, with multiplicity."""
    graph = common.train_graph(net, batch)
    fused = {m.layers[0] for m in graph.fusions.matches if m.pattern == "BatchNorm+Scale+ReLU"}
    return Counter((n.layer.outer, n.layer.channels, n.layer.inner) for n in graph.nodes if n.name in fused)


class Timer:
    def __init__(self):
        from numba import cuda

        self.cuda = cuda
        self.start, self.end = cuda.event(), cuda.event()

    def ms(self, fn, repeat: int) -> float:
        fn()  # compile, pick launch blocks
        self.cuda.synchronize()
        times = []
        for _ in range(repeat):
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(self.cuda.event_elapsed_time(self.start, self.end))
        return float(np.median(times))


KNOBS = ("SUPERNEURONS_BN_ROWS_MIN", "SUPERNEURONS_BN_MIN_BLOCK", "SUPERNEURONS_BN_CHANNEL_MIN",
         "SUPERNEURONS_BN_CHANNEL_MAX")


def parse_configs(text: str) -> dict[str, tuple[int, int, int, int]]:
    """'walk=0:0,chan=1024:8192:256' -> {name: (rows_min_inner, min_block_elements, channel_min, channel_max)}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, values = item.partition("=")
        numbers = [int(v) for v in values.split(":")]
        if not 2 <= len(numbers) <= 4:
            raise SystemExit(f"--configs: {item!r} is not NAME=ROWS_MIN:MIN_BLOCK[:CHANNEL_MIN[:CHANNEL_MAX]]")
        out[name] = tuple(numbers + [0, 1 << 30][len(numbers) - 2:])
    return out


def run_shape(shape: tuple[int, int, int], configs: dict[str, tuple[int, int, int, int]], repeat: int, timer: Timer,
              rng) -> dict:
    from numba import cuda

    from superneurons.backend.cuda.ops import fused
    from superneurons.backend.scratch import row_sums

    outer, c, inner = shape
    n = outer * c * inner
    x = cuda.to_device((rng.standard_normal(n) * 1.5 + 0.3).astype(np.float32))
    dy = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    gamma = cuda.to_device(rng.standard_normal(c).astype(np.float32))
    beta = cuda.to_device(rng.standard_normal(c).astype(np.float32))
    out: dict = {"shape": list(shape), "mbytes": 4 * n / 1e6, "configs": {}}
    first = None
    knobs = ("SUPERNEURONS_BN_ROWS", *KNOBS)
    saved = {k: os.environ.get(k) for k in knobs}
    for name, numbers in configs.items():
        os.environ.update(zip(knobs, ("1" if numbers[0] > 0 else "0", *map(str, numbers))))
        y, dx = (cuda.device_array(n, np.float32) for _ in range(2))
        stats = [cuda.device_array(c, np.float32) for _ in range(3)]
        running = [cuda.to_device(np.zeros(c, np.float32)), cuda.to_device(np.zeros(c, np.float32)),
                   cuda.to_device(np.zeros(1, np.float32))]
        dgamma, dbeta = cuda.to_device(np.zeros(c, np.float32)), cuda.to_device(np.zeros(c, np.float32))
        sums = cuda.device_array(row_sums(c), np.float64)  # what a Net's scratch region lends the ops

        def forward():
            fused.bn_affine_forward(x, y, None, *stats, gamma, beta, *running, outer, c, inner, 1e-5, False, True,
                                    0.9, 1.0, 0.0, scratch=sums)

        def backward():
            fused.bn_affine_backward(x, stats[0], stats[2], gamma, beta, dy, dx, dgamma, dbeta, outer, c, inner,
                                     False, 0.0, scratch=sums)

        fwd, bwd = timer.ms(forward, repeat), timer.ms(backward, repeat)
        got = [y.copy_to_host(), dx.copy_to_host()]
        first = first or got
        out["configs"][name] = {"forward_ms": fwd, "backward_ms": bwd,
                                "one_block_per_channel": fused.one_block_per_channel(outer, c, inner),
                                "forward_gbs": FORWARD_PASSES * 4 * n / fwd / 1e6,
                                "backward_gbs": BACKWARD_PASSES * 4 * n / bwd / 1e6,
                                "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in zip(got, first))}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return out


def copy_gbs(timer: Timer, repeat: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), the ceiling for these passes."""
    from numba import cuda

    n = 256 << 20  # 1 GiB of float32
    a, b = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
    a[:] = 1.0
    ms = timer.ms(lambda: b.copy_to_device(a), repeat)
    return 2 * 4 * n / ms / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = common.kernel_parser(__doc__, "resnet50")
    ap.add_argument("--configs", default="spread=1024:8192,chan128=1024:8192:128:65536,"
                    "chan256=1024:8192:256:65536,chan256_max256k=1024:8192:256:262144")
    args = ap.parse_args(argv)
    configs = parse_configs(args.configs)
    timer = Timer()
    rng = np.random.default_rng()
    ceiling = copy_gbs(timer, args.repeat)
    shapes = bn_shapes(args.net, args.batch)
    totals = {name: [0.0, 0.0] for name in configs}
    raw, rows = [], []
    for shape, layers in sorted(shapes.items(), key=lambda kv: -kv[0][2]):
        r = run_shape(shape, configs, args.repeat, timer, rng)
        r["layers"] = layers
        raw.append(r)
        cells = []
        for name, v in r["configs"].items():
            totals[name][0] += layers * v["forward_ms"]
            totals[name][1] += layers * v["backward_ms"]
            cells.append(f"{v['forward_ms']:.3f}/{v['backward_ms']:.3f}")
        diff = max(v["max_abs_diff"] for v in r["configs"].values())
        rows.append(["x".join(map(str, shape)), layers, *cells, diff])
    rows.append(["all (x layers)", sum(shapes.values()), *[f"{f:.2f}/{b:.2f}" for f, b in totals.values()], None])
    header = ["outer x C x inner", "layers", *[f"{name} fwd/bwd ms" for name in configs], "max |diff|"]
    print(f"\nFused BatchNorm+Scale+ReLU kernels, {args.net} batch {args.batch}; device copy {ceiling:.0f} GB/s")
    print(common.text_table(header, rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bn_kernels_{args.net}_b{args.batch}.json"
    path.write_text(json.dumps({"net": args.net, "batch": args.batch, "copy_gbs": ceiling, "configs": configs,
                                "shapes": raw, "totals_ms": totals, "device": common.device_info()}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
