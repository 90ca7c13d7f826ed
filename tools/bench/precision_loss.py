"""Does half precision train as float32 does? ResNet-50 on a fixed, generated data set, the same iterations in
each precision, and the loss each ends at.

    python3 -m tools.bench.precision_loss [--iterations 300] [--batch 64] [--images 1280] [--precisions fp32,bf16,fp16]
                                          [--device cuda] [--tail 50]

The data set: --images 3x224x224 images of 10 classes, each a smooth class template (a 14x14 random pattern
blown up to 224x224) under twice its amplitude of Gaussian noise, 30% of the labels then drawn at random
(so the loss stays well above 0 over a few hundred iterations and a ratio of losses means something), written once to HDF5 and read by an HDF5Data
layer in order (no shuffling), so every precision sees the same batches. The net: models/resnet50's prototxt with
that data layer, the solver's momentum SGD (base_lr 0.01), the same random_seed (the same initial weights) and
--precision of train for the storage (float16 with adaptive loss scaling). Each precision trains in a process of
its own. The figure: the mean loss of the last --tail iterations, and its ratio to float32's. Writes
precision_loss.json (every iteration's loss per precision).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tools.bench import common

CLASSES = 10
TEMPLATE = 14  # the class pattern's side before it is blown up to the image's
SIDE = 224
# The share of labels drawn at random instead: the net cannot drive the loss to ~0 in a few hundred iterations
# (it would have to memorize the noise), so the losses compared are far from 0 and their ratio means something.
LABEL_NOISE = 0.3


def make_data(folder: Path, images: int, seed: int = 7) -> Path:
    """The HDF5 files and their list (HDF5Data's source); written once per folder."""
    import h5py

    listing = folder / "train.txt"
    if listing.exists():
        return listing
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((CLASSES, 3, TEMPLATE, TEMPLATE)).astype(np.float32)
    templates = templates.repeat(SIDE // TEMPLATE, axis=2).repeat(SIDE // TEMPLATE, axis=3)
    names = []
    per_file = 256
    for start in range(0, images, per_file):
        n = min(per_file, images - start)
        labels = rng.integers(0, CLASSES, n)
        data = 0.5 * templates[labels] + rng.standard_normal((n, 3, SIDE, SIDE), dtype=np.float32)
        noisy = rng.random(n) < LABEL_NOISE
        labels[noisy] = rng.integers(0, CLASSES, int(noisy.sum()))
        name = folder / f"part{start // per_file}.h5"
        with h5py.File(name, "w") as f:
            f["data"] = data
            f["label"] = labels.astype(np.float32)
        names.append(str(name))
    listing.write_text("\n".join(names) + "\n")
    return listing


def solver_param(listing: Path, batch: int, iterations: int, seed: int = 1701):
    from google.protobuf import text_format

    from superneurons.io.prototxt import read_solver
    from superneurons.proto import superneurons_pb2 as pb

    spec = common.NETS["resnet50"]
    param = read_solver(str(common.ROOT / spec.solver))
    net = common.net_param("resnet50", batch)
    data = text_format.Parse(f'name: "data" type: "HDF5Data" top: "data" top: "label" '
                             f'hdf5_data_param {{ source: "{listing}" batch_size: {batch} }}', pb.LayerParameter())
    net.layer[0].CopyFrom(data)
    last = net.layer[-1]  # the classifier's width: the data set's classes
    for layer in net.layer:
        if layer.type == "InnerProduct" and layer.top[0] in last.bottom:
            layer.inner_product_param.num_output = CLASSES
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    param.max_iter = iterations
    param.display = 0
    param.snapshot = 0
    param.snapshot_after_train = False
    param.random_seed = seed
    return param


def train_one(precision: str, listing: Path, batch: int, iterations: int, device: str, seed: int = 1701) -> dict:
    """One precision's losses, every iteration (runs in the worker process)."""
    from superneurons.solver.solver import Solver

    backend = common.make_backend(device, None)
    solver = Solver(solver_param(listing, batch, iterations, seed), "precision_loss", backend=backend, memory="baseline",
                    precision=precision)
    losses: list[float] = []
    solver.callbacks.append(lambda _solver, _iteration, loss: losses.append(float(loss)))
    start = time.perf_counter()
    solver.step(iterations)
    return {"precision": precision, "losses": losses, "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, [], iterations=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=1280, help="images in the data set (default %(default)s)")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default %(default)s)")
    ap.add_argument("--tail", type=int, default=50, help="iterations the final loss is averaged over")
    ap.add_argument("--data", default="", help="folder of the generated data set (default: under --out)")
    ap.add_argument("--seed", type=int, default=1701, help="the solver's random_seed: the initial weights")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    listing = make_data(Path(args.data or Path(args.out) / "precision_loss_data"), args.images)
    if args.one:  # the worker: one precision, its result as JSON on the last line
        print(json.dumps(train_one(args.one, listing, args.batch, args.iterations, args.device, args.seed)))
        return 0
    results = {}
    for precision in args.precisions.split(","):
        r = subprocess.run([sys.executable, "-m", "tools.bench.precision_loss", "--one", precision, "--batch",
                            str(args.batch), "--iterations", str(args.iterations), "--data", str(listing.parent),
                            "--device", args.device, "--seed", str(args.seed)], capture_output=True, text=True, timeout=args.timeout,
                           cwd=common.ROOT)
        if r.returncode != 0:
            print(f"{precision}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}", file=sys.stderr)
            results[precision] = {"error": r.stderr[-2000:]}
            continue
        results[precision] = json.loads(r.stdout.strip().splitlines()[-1])
    final = {p: float(np.mean(r["losses"][-args.tail:])) for p, r in results.items() if r.get("losses")}
    reference = final.get("fp32")
    rows = [[p, common.fmt(results[p]["losses"][0], ".4f"), common.fmt(final[p], ".4f"),
             common.fmt(common.ratio(final[p], reference), ".4f"), common.fmt(results[p]["seconds"], ".1f")]
            for p in final]
    common.finish("precision_loss", f"ResNet-50 b{args.batch}, {args.iterations} iterations on {args.images} fixed "
                  f"images: the mean loss of the last {args.tail}", args,
                  ["precision", "first loss", "final loss", "/ fp32", "seconds"], rows, extra={"runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
