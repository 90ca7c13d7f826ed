"""Max pooling's kernels alone, on a net's max-pooling shapes, beside PyTorch's max_pool2d (GPU).

    python3 -m tools.bench.pool_kernels [--net squeezenet] [--batch 64] [--repeat 20] [--out DIR]
    python3 -m tools.bench.pool_kernels --layout nhwc [--dtype bfloat16] [--net resnet50] ...

For every max Pooling of --net (models/NET/NET_dummy.prototxt) at --batch, times with CUDA events our
forward as `pool_forward` runs it (the column walker) and with one thread per output (kernels/pooling.py:
max_forward, the per-output statement of the rules, launched directly), our `pool_backward` (signed mask
and ReLU where the pooling takes its ReLU's backward, as in training), and PyTorch's max_pool2d forward
(with indices) and backward on the same input, ceil_mode as Caffe rounds.
Checks that both forwards give the same output and mask. The totals weight each shape by its layers.

With --layout nhwc, the channels-last kernels (kernels/channels_last.py) in --dtype: the ops' choice (for
windows up to 3x3 the walk that issues a window's loads first; backward, where a pixel lies in at most two
windows per axis, the one that loads its four candidates together) beside the general loops, launched directly,
and PyTorch's max_pool2d on a channels_last tensor of that dtype. Both of ours must give the same output, mask
and gradient bit for bit.

Writes pool_kernels_NET_bBATCH.json to --out (default $OUT or .).
"""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from tools.bench import common
from tools.bench.bn_kernels import Timer


def pool_shapes(net: str, batch: int) -> Counter:
    """(bottom shape, top shape, kernel, stride, pad, takes the ReLU's backward) of every max Pooling, with
    multiplicity."""
    graph = common.train_graph(net, batch)
    shapes: Counter = Counter()
    for n in graph.nodes:
        layer = n.layer
        if layer.type_name == "Pooling" and layer.geom.method == "max":
            bottom = tuple(graph.blob_shapes[n.bottoms[0]])
            top = tuple(n.top_shapes[0])
            takes_relu = any(m.pattern == "ReLU+Pooling" and m.layers[0] == n.name for m in graph.fusions.matches)
            shapes[(bottom, top, layer.geom.kernel, layer.geom.stride, layer.geom.pad, takes_relu)] += 1
    return shapes


def run_shape(key, repeat: int, timer: Timer, rng) -> dict:
    import torch
    from numba import cuda

    from superneurons.backend.cuda import kernels as K
    from superneurons.backend.cuda.device import flat
    from superneurons.backend.cuda.kernels import pooling as pk
    from superneurons.backend.cuda.ops import pooling
    from superneurons.backend.geometry import PoolGeometry

    bottom, top, kernel, stride, pad, relu = key
    geom = PoolGeometry("max", kernel, stride, pad)
    x_host = rng.standard_normal(bottom).astype(np.float32)
    x = cuda.to_device(x_host)
    dy = cuda.to_device(rng.standard_normal(top).astype(np.float32))
    y, mask = cuda.device_array(top, np.float32), cuda.device_array(top, np.int32)
    dx = cuda.device_array(bottom, np.float32)
    results, outputs = {}, {}
    dims = (*bottom[2:], *top[2:], *kernel, *stride, *pad)
    # The ops' column walker (one thread per output column) and the per-output kernel that states the rules
    # (one thread per output), launched directly: a faster second would become the op's forward.
    forwards = {"columns": lambda: pooling.pool_forward(x, y, mask, geom, signed_mask=relu),
                "outputs": lambda: K.launch(pk.max_forward, y.size)(flat(x), flat(y), flat(mask), *dims, relu)}
    for name, forward in forwards.items():
        results[f"forward {name}"] = timer.ms(forward, repeat)
        outputs[name] = (y.copy_to_host(), mask.copy_to_host())
    same = all(np.array_equal(a, b) for a, b in zip(outputs["columns"], outputs["outputs"]))
    results["backward"] = timer.ms(lambda: pooling.pool_backward(dy, mask, dx, geom, 0.0 if relu else None), repeat)
    tx = torch.from_numpy(x_host).cuda().requires_grad_(True)
    tdy = torch.from_numpy(dy.copy_to_host()).cuda()

    def torch_forward():
        return torch.nn.functional.max_pool2d(tx, kernel, stride, pad, ceil_mode=True, return_indices=True)

    ty, _ = torch_forward()
    assert tuple(ty.shape) == top, (ty.shape, top)
    results["torch forward"] = timer.ms(torch_forward, repeat)
    results["torch backward"] = timer.ms(lambda: torch.autograd.grad(ty, tx, tdy, retain_graph=True), repeat)
    return {"bottom": list(bottom), "top": list(top), "kernel": kernel, "stride": stride, "pad": pad, "relu": relu, "ms": results,
            "forwards_agree": same}


def run_shape_nhwc(key, repeat: int, timer: Timer, rng, dtype) -> dict:
    import torch
    from numba import cuda

    from superneurons.backend.cuda import channels_last_ops as ops
    from superneurons.backend.cuda import kernels as K
    from superneurons.backend.cuda.device import flat, make, scalar
    from superneurons.backend.cuda.kernels import channels_last as lk
    from superneurons.backend.geometry import PoolGeometry

    bottom, top, kernel, stride, pad, relu = key
    geom = PoolGeometry("max", kernel, stride, pad)
    keep = []

    def device(host, dt, shape):
        raw = np.ascontiguousarray(host.transpose(0, 2, 3, 1)).astype(dt)  # N, H, W, C in memory
        buf = cuda.to_device(raw.view(np.uint8).reshape(-1))
        keep.append(buf)
        return make(buf.gpu_data, shape, dt, "NHWC")

    x_host = rng.standard_normal(bottom).astype(np.float32)
    x, dy = device(x_host, dtype, bottom), device(rng.standard_normal(top).astype(np.float32), dtype, top)
    y, mask = device(np.zeros(top), dtype, top), device(np.zeros(top), np.int32, top)
    dx = device(np.zeros(bottom), dtype, bottom)
    dims = (*bottom, *top[2:], *kernel, *stride, *pad)
    slope = (relu, scalar(dx, 0.0))
    sides = {"ops": (lambda: ops.pool_forward(x, y, mask, geom, signed_mask=relu),
                     lambda: ops.pool_backward(dy, mask, dx, geom, 0.0 if relu else None)),
             "loops": (lambda: K.launch(lk.max_forward, 0, blocks=min(top[0] * top[2], K.MAX_BLOCKS))(
                           flat(x), flat(y), flat(mask), *dims, relu),
                       lambda: K.launch(lk.max_backward, 0, blocks=min(bottom[0] * bottom[2], K.MAX_BLOCKS))(
                           flat(dy), flat(mask), flat(dx), *dims, *slope))}
    results, outputs = {}, {}
    for name, (forward, backward) in sides.items():
        results[f"forward {name}"] = timer.ms(forward, repeat)
        results[f"backward {name}"] = timer.ms(backward, repeat)
        forward()
        backward()
        cuda.synchronize()
        outputs[name] = [keep[i].copy_to_host() for i in (2, 3, 4)]  # y, mask, dx bytes
    same = all(np.array_equal(a, b) for a, b in zip(outputs["ops"], outputs["loops"]))
    torch_dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}.get(np.dtype(dtype),
                                                                                                 torch.bfloat16)
    tx = torch.from_numpy(x_host).cuda().to(torch_dtype).contiguous(memory_format=torch.channels_last)
    tx.requires_grad_(True)

    def torch_forward():
        return torch.nn.functional.max_pool2d(tx, kernel, stride, pad, ceil_mode=True, return_indices=True)

    ty, _ = torch_forward()
    tdy = torch.randn_like(ty).contiguous(memory_format=torch.channels_last)
    results["torch forward"] = timer.ms(torch_forward, repeat)
    results["torch backward"] = timer.ms(lambda: torch.autograd.grad(ty, tx, tdy, retain_graph=True), repeat)
    return {"bottom": list(bottom), "top": list(top), "kernel": kernel, "stride": stride, "pad": pad, "relu": relu,
            "ms": results, "forwards_agree": same}


def main(argv: list[str] | None = None) -> int:
    ap = common.kernel_parser(__doc__, "squeezenet")
    ap.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw", help="default %(default)s")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="storage type of the channels-last run (default %(default)s)")
    args = ap.parse_args(argv)
    timer, rng = Timer(), np.random.default_rng()
    rows, raw, totals = [], [], Counter()
    from superneurons.dtypes import BFLOAT16

    dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": BFLOAT16}[args.dtype]
    for key, layers in pool_shapes(args.net, args.batch).items():
        if args.layout == "nhwc":
            r = run_shape_nhwc(key, args.repeat, timer, rng, dtype)
        else:
            r = run_shape(key, args.repeat, timer, rng)
        r["layers"] = layers
        raw.append(r)
        for name, ms in r["ms"].items():
            totals[name] += layers * ms
        rows.append([f"{'x'.join(map(str, key[0]))} k{key[2][0]} s{key[3][0]} p{key[4][0]}", layers, key[5],
                     *[f"{ms:.3f}" for ms in r["ms"].values()], r["forwards_agree"]])
    names = list(raw[0]["ms"]) if raw else []
    rows.append(["all (x layers)", sum(r["layers"] for r in raw), "", *[f"{totals[n]:.3f}" for n in names], ""])
    print(f"\nMax pooling kernels, {args.net} batch {args.batch}, {args.layout} {args.dtype} (ms per call)")
    print(common.text_table(["bottom, window", "layers", "ReLU taken", *names, "forwards agree"], rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.layout == "nchw" else f"_nhwc_{args.dtype}"
    path = out / f"pool_kernels_{args.net}_b{args.batch}{suffix}.json"
    path.write_text(json.dumps({"net": args.net, "batch": args.batch, "shapes": raw, "totals_ms": totals,
                                "device": common.device_info()}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
