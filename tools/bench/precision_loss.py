"""Does half precision train as float32 does? The same net, data, initial weights and schedule in each
precision, and the loss each ends at, over several initial weights.

    python3 -m tools.bench.precision_loss [--net resnet50|tiny] [--iterations 300] [--batch 64] [--images N]
                                          [--held-out 1280] [--seeds 1701,1702,1703] [--precisions fp32,bf16,fp16]
                                          [--label-noise 0.1] [--device cuda|cpu]
    python3 -m tools.bench.precision_loss --merge gpu0/precision_loss.json,gpu1/precision_loss.json,...

The question is whether a precision ends where float32 ends, so the number compared has to move less with
chance than the 2% asked of it. The design:

- The data set: 3xSxS images (S = 224 for ResNet-50) of 10 classes, each a smooth class template (a random
  pattern 1/16 of the side blown up to it) at half the amplitude of unit Gaussian noise, --label-noise of the
  labels (default 10%) then drawn at random. --images training images, by default --iterations x --batch: no
  image is seen twice, so the net cannot memorize the random labels (with 1280 images seen 15 times each, how
  many it happened to memorize moved float32's final loss by 48% between seeds: the measurement of
  2026-11-28 in docs/PRECISION.md), and --held-out more drawn the same way for the TEST pass. Written once to
  HDF5 as float16 (a folder named after its parameters), read by HDF5Data layers in order, no shuffling: every
  precision and seed sees the same batches in the same order.
- The training: momentum SGD (0.9, weight decay 1e-4) at base_lr 0.01 decaying linearly to 0 at the last
  iteration (lr_policy "poly", power 1), so the run ends at a point the weights have settled on rather than
  somewhere on a steep descent at full rate. --precision of train for the storage; float16 with adaptive loss
  scaling. The initial weights come from the solver's random_seed: one run per precision and seed.
- The figure: the loss of the final weights over every held-out image once, in a TEST net that shares the
  trained weights (--held-out 0: over the training images), rather than one training batch's loss. Its
  BatchNorms use the batch's statistics, as in training (the prototxt's use_global_stats: false): the running
  averages at moving_average_fraction 0.999 would mostly average the first iterations' very different weights.
  The accuracy is reported beside it.
- The comparison: for each seed, a half precision's loss against float32's with the same seed and data
  (relative difference), and the mean and standard deviation of that difference over the seeds. float32's
  own seed-to-seed spread (standard deviation over the seeds, relative to its mean) is shown beside it: a
  difference well inside that spread says the precision moves the end point less than the initial weights
  do. The random labels put a floor under the loss (their entropy, 0.50 nats at 10%), which makes any
  relative difference of the loss smaller; the same differences of the excess over the floor are reported
  beside them, the stricter view. The target: |mean relative difference of the loss| <= 2% for bf16 and fp16.

Each precision trains its seeds in a process of its own, one seed after the other (the setup once per
precision), and --jobs of those processes run at once (default 3: on one GPU the three share it, and each
waits on its own data reads and launches rather than on the others'; the losses do not depend on it, only
the seconds reported beside them do). --timeout bounds each process; one stopped by it keeps the seeds it
finished (the table compares the seeds both precisions finished). --net tiny: a two-convolution net with
BatchNorm on 16x16 images, for a quick check on the CPU. Writes precision_loss.json: every iteration's
training loss, each run's final loss and accuracy, the table.

PyTorch's runs of the same design (--precisions torch-fp32,torch-bf16,torch-fp16; precision_loss_torch.py:
the same net, initial weights, batches, schedule and held-out pass, in float32 or under autocast) are rows
of the same table, each compared with PyTorch's float32: whether a half type moves PyTorch's end point as it
moves ours tells the type's effect on this task from our implementation's.

Telling a 2% difference apart takes many seeds (the standard error of the mean difference, reported beside
it, is the seeds' standard deviation over their square root: at the 6.5% measured, 3 seeds give 3.8%, 16 give
1.6%). On a machine of several GPUs each can train its own seeds (tools/gpu/per_gpu.sh, one precision_loss
per GPU with disjoint --seeds); --merge then reads their precision_loss.json files, which must share the
design (net, batch, iterations, rate, images, held-out images, label noise) and no seed, and reports them as
one run.
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
DATA_SEED = 7  # the data set is the same for every seed of the weights
# ResNet-50 reads 224x224 images; the tiny net 16x16 ones. The class pattern is 1/16 of the side, blown up.
SIDES = {"resnet50": 224, "tiny": 16}
TARGET = 0.02  # the requirement: within 2% of float32's loss
OURS = ("fp32", "bf16", "fp16")
TORCH_RUNS = ("torch-fp32", "torch-bf16", "torch-fp16")  # PyTorch's own runs (precision_loss_torch.py)


def reference_of(precision: str) -> str:
    """The float32 run a precision's loss is compared with: ours for ours, PyTorch's for PyTorch's."""
    return "torch-fp32" if precision in TORCH_RUNS else "fp32"

TINY_NET = """
name: "tiny"
layer {{ name: "data" type: "HDF5Data" top: "data" top: "label" hdf5_data_param {{ source: "{source}" batch_size: {batch} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 bias_term: false weight_filler {{ type: "msra" }} }} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" batch_norm_param {{ use_global_stats: false }} }}
layer {{ name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param {{ bias_term: true }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param {{ num_output: 16 kernel_size: 3 pad: 1 bias_term: false weight_filler {{ type: "msra" }} }} }}
layer {{ name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" batch_norm_param {{ use_global_stats: false }} }}
layer {{ name: "scale2" type: "Scale" bottom: "conv2" top: "conv2" scale_param {{ bias_term: true }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }}
layer {{ name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param {{ pool: AVE global_pooling: true }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "pool2" top: "fc"
  inner_product_param {{ num_output: {classes} weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
"""


def make_data(folder: Path, images: int, side: int, label_noise: float, held_out: int = 0) -> tuple[Path, Path]:
    """The HDF5 files and their lists (HDF5Data's sources) of the training images and of `held_out` more drawn
    the same way (none: the TEST pass reads the training images), in a folder of `folder` named after the
    data set's parameters; written once. Stored as float16 (the reader makes float32 of it): the same values
    for every run, in half the disk and reads."""
    import h5py

    folder = folder / f"n{images}_h{held_out}_s{side}_noise{label_noise:g}_seed{DATA_SEED}"
    train, test = folder / "train.txt", folder / ("test.txt" if held_out else "train.txt")
    if train.exists() and test.exists():
        return train, test
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(DATA_SEED)
    template = max(1, side // 16)
    templates = rng.standard_normal((CLASSES, 3, template, template)).astype(np.float32)
    templates = templates.repeat(side // template, axis=2).repeat(side // template, axis=3)
    per_file = 256
    lists = {}
    for part, count in (("train", images), ("test", held_out)):
        names = []
        for start in range(0, count, per_file):
            n = min(per_file, count - start)
            labels = rng.integers(0, CLASSES, n)
            data = 0.5 * templates[labels] + rng.standard_normal((n, 3, side, side), dtype=np.float32)
            noisy = rng.random(n) < label_noise
            labels[noisy] = rng.integers(0, CLASSES, int(noisy.sum()))
            name = folder / f"{part}{start // per_file}.h5"
            with h5py.File(name, "w") as f:
                f["data"] = data.astype(np.float16)
                f["label"] = labels.astype(np.float32)
            names.append(str(name))
        lists[part] = names
    for part, names in lists.items():  # the lists last: a folder with its lists is complete
        if names:
            tmp = folder / f"{part}.txt.tmp"
            tmp.write_text("\n".join(names) + "\n")
            tmp.rename(folder / f"{part}.txt")
    return train, test


def floor_loss(label_noise: float) -> float:
    """The least expected loss on labels drawn so (the classes themselves told apart perfectly): the entropy
    of a label given its class, which keeps 1 - noise + noise / CLASSES on the class and noise / CLASSES on
    each other one."""
    if label_noise <= 0:
        return 0.0
    right, wrong = 1 - label_noise + label_noise / CLASSES, label_noise / CLASSES
    return float(-right * np.log(right) - (CLASSES - 1) * wrong * np.log(wrong))


def net_param(net: str, listing: Path, batch: int):
    """The net reading the data set, its classifier CLASSES wide, an Accuracy for the TEST pass."""
    from google.protobuf import text_format

    from superneurons.proto import superneurons_pb2 as pb

    if net == "tiny":
        param = text_format.Parse(TINY_NET.format(source=listing, batch=batch, classes=CLASSES), pb.NetParameter())
    elif net == "resnet50":
        param = common.net_param("resnet50", batch)
        data = text_format.Parse(f'name: "data" type: "HDF5Data" top: "data" top: "label" '
                                 f'hdf5_data_param {{ source: "{listing}" batch_size: {batch} }}', pb.LayerParameter())
        param.layer[0].CopyFrom(data)
        last = param.layer[-1]
        for layer in param.layer:
            if layer.type == "InnerProduct" and layer.top[0] in last.bottom:
                layer.inner_product_param.num_output = CLASSES
    else:
        raise SystemExit(f"--net {net!r}: expected one of {', '.join(SIDES)}")
    loss = param.layer[-1]
    accuracy = param.layer.add()
    text_format.Parse(f'name: "accuracy" type: "Accuracy" bottom: "{loss.bottom[0]}" bottom: "{loss.bottom[1]}" '
                      f'top: "accuracy" include {{ phase: TEST }}', accuracy)
    return param


def solver_param(net: str, data: tuple[Path, Path], batch: int, iterations: int, tested: int, seed: int,
                 base_lr: float):
    """Momentum SGD at base_lr decaying linearly to 0 at `iterations`; a TEST net over every one of the `tested`
    images of data[1] once."""
    from superneurons.proto import superneurons_pb2 as pb

    param = pb.SolverParameter()
    param.train_net_param.CopyFrom(net_param(net, data[0], batch))
    param.test_net_param.add().CopyFrom(net_param(net, data[1], batch))
    param.base_lr = base_lr
    param.lr_policy = "poly"
    param.power = 1.0
    param.momentum = 0.9
    param.weight_decay = 1e-4
    param.max_iter = iterations
    param.test_iter.append(tested // batch)
    param.test_interval = 0  # the solver tests never by itself; the worker runs the one pass at the end
    param.test_initialization = False
    param.display = 0
    param.snapshot = 0
    param.snapshot_after_train = False
    param.random_seed = seed
    return param


def train_one(precision: str, seed: int, net: str, data: tuple[Path, Path], batch: int, iterations: int, tested: int,
              base_lr: float, device: str) -> dict:
    """One precision and seed: every iteration's training loss, then the TEST pass's loss and accuracy."""
    from superneurons.solver.evaluate import evaluate
    from superneurons.solver.solver import Solver

    param = solver_param(net, data, batch, iterations, tested, seed, base_lr)
    if precision in TORCH_RUNS:
        from tools.bench import precision_loss_torch

        return precision_loss_torch.train_one(precision, seed, param, data, batch, iterations, tested, device)
    backend = common.make_backend(device, None)
    solver = Solver(param, "precision_loss", backend=backend, memory="baseline", precision=precision)
    losses: list[float] = []
    solver.callbacks.append(lambda _solver, _iteration, loss: losses.append(float(loss)))
    start = time.perf_counter()
    solver.step(iterations)
    train_s = time.perf_counter() - start
    scores, loss = evaluate(solver.test_nets[0], int(param.test_iter[0]))
    accuracy = next((s.value for s in scores if s.name == "accuracy"), None)
    seconds = time.perf_counter() - start
    del solver, scores
    common._release_device()  # the next seed's nets find the memory of these
    return {"precision": precision, "seed": seed, "losses": losses, "final_loss": float(loss),
            "accuracy": accuracy, "train_seconds": train_s, "seconds": seconds}


def summarize(runs: dict[str, dict[int, dict]], seeds: list[int], floor: float = 0.0) -> dict:
    """Per precision: the final loss per seed, its relative difference from float32's with the same seed (ours'
    for ours, PyTorch's for PyTorch's: `reference_of`), and the mean and standard deviation over the seeds;
    float32's own relative spread over the seeds. The same for the excess of the loss over `floor` (the least
    loss the labels allow), the stricter view."""
    out: dict = {}
    for precision, by_seed in runs.items():
        reference = reference_of(precision)
        ref = {s: runs.get(reference, {}).get(s, {}).get("final_loss") for s in seeds}
        ref_losses = [v for v in ref.values() if v is not None]
        ref_mean = float(np.mean(ref_losses)) if ref_losses else None
        losses = {s: r["final_loss"] for s, r in by_seed.items() if "final_loss" in r}
        diffs = {s: losses[s] / ref[s] - 1.0 for s in losses if ref.get(s)}
        excess = {s: (losses[s] - floor) / (ref[s] - floor) - 1.0 for s in losses if ref.get(s) and ref[s] > floor}
        values = list(losses.values())
        row = {"final_loss": losses, "mean_loss": float(np.mean(values)) if values else None,
               "std_loss": float(np.std(values, ddof=1)) if len(values) > 1 else None,
               "relative_difference": diffs, "excess_difference": excess}
        if precision == reference:
            # float32 against itself: how far the end point moves with the initial weights alone
            row["seed_spread"] = (row["std_loss"] / ref_mean) if row["std_loss"] is not None and ref_mean else None
            above = ref_mean - floor if ref_mean is not None else None
            row["excess_seed_spread"] = (row["std_loss"] / above) if row["std_loss"] is not None and above and above > 0 \
                else None
        else:
            d = list(diffs.values())
            row["mean_difference"] = float(np.mean(d)) if d else None
            row["std_difference"] = float(np.std(d, ddof=1)) if len(d) > 1 else None
            row["standard_error"] = row["std_difference"] / len(d) ** 0.5 if len(d) > 1 else None
            e = list(excess.values())
            row["mean_excess_difference"] = float(np.mean(e)) if e else None
        out[precision] = row
    return out


DESIGN = ("net", "batch", "iterations", "base_lr", "images", "held_out", "label_noise")  # what merged runs share


def merged(paths: list[str]) -> tuple[dict[str, dict[int, dict]], list[int], dict]:
    """The runs of several precision_loss.json files as one: (runs by precision and seed, the seeds in order,
    the design they share). Files of another design, or holding a seed another file holds too, are refused."""
    runs: dict[str, dict[int, dict]] = {}
    seeds: list[int] = []
    design: dict | None = None
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--merge: {path}: {e}") from None
        mine = {k: doc.get(k) for k in DESIGN}
        if design is None:
            design = mine
        elif mine != design:
            other = ", ".join(f"{k} {mine[k]} against {design[k]}" for k in DESIGN if mine[k] != design[k])
            raise SystemExit(f"--merge: {path} measured another design than {paths[0]} ({other})")
        for precision, by_seed in doc.get("runs", {}).items():
            for seed, run in by_seed.items():
                if int(seed) in runs.get(precision, {}):
                    raise SystemExit(f"--merge: {path}: seed {seed} of {precision} is in an earlier file too")
                runs.setdefault(precision, {})[int(seed)] = run
        seeds += [s for s in doc.get("seeds", []) if s not in seeds]
    return runs, seeds, design or {}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.2f}%"


def main(argv: list[str] | None = None) -> int:
    ap = common.base_parser(__doc__, [], iterations=300)
    ap.add_argument("--net", default="resnet50", choices=sorted(SIDES), help="the net (default %(default)s)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=0, help="training images, a multiple of --batch (default: "
                    "--iterations x --batch, so that no image is seen twice)")
    ap.add_argument("--held-out", type=int, default=1280, help="images of the TEST pass, drawn as the training ones "
                    "but never trained on, a multiple of --batch (default %(default)s; 0: the training images)")
    ap.add_argument("--label-noise", type=float, default=0.1, help="share of labels drawn at random "
                    "(default %(default)s)")
    ap.add_argument("--base-lr", type=float, default=0.01, help="the rate at iteration 0 (default %(default)s)")
    ap.add_argument("--precisions", default="fp32,bf16,fp16", help="ours (fp32, bf16, fp16) and PyTorch's "
                    "(torch-fp32, torch-bf16, torch-fp16: precision_loss_torch.py), each compared with its own "
                    "float32 (default %(default)s)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default %(default)s)")
    ap.add_argument("--data", default="", help="folder of the generated data sets (default: under --out)")
    ap.add_argument("--seeds", default="1701,1702,1703", help="the solver's random_seed values: the initial weights")
    ap.add_argument("--jobs", type=int, default=3, help="precisions training at once, each in its process "
                    "(default %(default)s: one GPU runs them side by side; the figures do not depend on it)")
    ap.add_argument("--merge", default="", help="precision_loss.json files of one design, comma-separated: report "
                    "their runs as one (no training)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.merge:
        runs, seeds, design = merged([p for p in args.merge.split(",") if p])
        for key, value in design.items():
            if value is not None:
                setattr(args, key, value)
        order = OURS + TORCH_RUNS
        report(args, runs, seeds, [p for p in order if p in runs] + [p for p in runs if p not in order], {})
        return 0
    args.images = args.images or args.iterations * args.batch
    for flag, value in (("--images", args.images), ("--held-out", args.held_out)):
        if value % args.batch:
            raise SystemExit(f"{flag} {value}: not a multiple of --batch {args.batch} (the TEST pass reads every image "
                             "once)")
    tested = args.held_out or args.images
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = [p for p in precisions if p not in OURS + TORCH_RUNS]
    if unknown:
        raise SystemExit(f"--precisions {','.join(unknown)}: expected some of {', '.join(OURS + TORCH_RUNS)}")
    data = make_data(Path(args.data or Path(args.out) / "precision_loss_data"), args.images, SIDES[args.net],
                     args.label_noise, args.held_out)
    if args.one:  # the worker: one precision, every seed, a JSON line per seed as it ends (kept if a later one is late)
        for s in seeds:
            print(json.dumps(train_one(args.one, s, args.net, data, args.batch, args.iterations, tested,
                                       args.base_lr, args.device)), flush=True)
        return 0
    runs: dict[str, dict[int, dict]] = {}
    errors: dict[str, str] = {}
    workers: dict[str, tuple[subprocess.Popen, float]] = {}
    logs = Path(args.out) / "precision_loss_workers"  # each worker's output and log, by precision
    logs.mkdir(parents=True, exist_ok=True)
    queue = list(precisions)
    while queue or workers:
        while queue and len(workers) < max(1, args.jobs):
            precision = queue.pop(0)
            command = [sys.executable, "-m", "tools.bench.precision_loss", "--one", precision, "--net", args.net,
                       "--batch", str(args.batch), "--images", str(args.images), "--held-out", str(args.held_out),
                       "--iterations", str(args.iterations),
                       "--label-noise", str(args.label_noise), "--base-lr", str(args.base_lr),
                       "--data", str(data[0].parent.parent), "--device", args.device,
                       "--seeds", ",".join(map(str, seeds)), "--out", args.out]
            # into files, not pipes: a worker's log must never wait on a full pipe while this one sleeps
            with open(logs / f"{precision}.out", "w") as out, open(logs / f"{precision}.log", "w") as err:
                workers[precision] = (subprocess.Popen(command, stdout=out, stderr=err, cwd=common.ROOT),
                                      time.monotonic())
        time.sleep(0.2)
        for precision, (worker, started) in list(workers.items()):
            late = time.monotonic() - started > args.timeout
            if worker.poll() is None and not late:
                continue
            if late and worker.poll() is None:
                worker.kill()
            worker.wait()
            del workers[precision]
            out, err = ((logs / f"{precision}.{k}").read_text() for k in ("out", "log"))
            done = [json.loads(line) for line in out.splitlines() if line.startswith('{"precision"')]
            if done:
                runs[precision] = {x["seed"]: x for x in done}
            if worker.returncode != 0 or late:
                why = f"not done within --timeout {args.timeout} s" if late else f"exit {worker.returncode}"
                print(f"{precision}: {why} after {len(done)} of {len(seeds)} seeds: "
                      f"{err.strip().splitlines()[-1:] or ''}", file=sys.stderr)
                errors[precision] = f"{why} after {len(done)} of {len(seeds)} seeds\n{err[-2000:]}"
    report(args, runs, seeds, precisions, errors)
    return 1 if errors else 0


def report(args: argparse.Namespace, runs: dict[str, dict[int, dict]], seeds: list[int], precisions: list[str],
           errors: dict[str, str]) -> None:
    """The table, the targets and precision_loss.json of these runs."""
    runs = {p: runs[p] for p in precisions if p in runs}  # the table in the order asked
    floor = floor_loss(args.label_noise)
    summary = summarize(runs, seeds, floor)
    rows = []
    for precision, row in summary.items():
        cells = [precision]
        reference = precision == reference_of(precision)
        for s in seeds:
            loss = row["final_loss"].get(s)
            cells.append("-" if loss is None else f"{loss:.4f}" + ("" if reference else
                                                                   f" ({_pct(row['relative_difference'].get(s))})"))
        if reference:
            cells += [common.fmt(row["mean_loss"], ".4f"), "(reference)",
                      f"seed-to-seed {_pct(row['seed_spread'])[1:]}" if row["seed_spread"] is not None else "-",
                      f"seed-to-seed {_pct(row['excess_seed_spread'])[1:]}" if row["excess_seed_spread"] is not None
                      else "-"]
        else:
            se = row["standard_error"]
            cells += [common.fmt(row["mean_loss"], ".4f"),
                      _pct(row["mean_difference"]) + ("" if se is None else f" (standard error {100 * se:.2f}%)"),
                      "-" if row["std_difference"] is None else f"{100 * row['std_difference']:.2f}%",
                      _pct(row["mean_excess_difference"])]
        accs = [runs[precision][s].get("accuracy") for s in seeds if s in runs[precision]]
        cells.append(common.fmt(float(np.mean(accs)), ".4f") if accs and None not in accs else "-")
        cells.append(common.fmt(sum(runs[precision][s]["seconds"] for s in runs[precision]), ".1f"))
        rows.append(cells)
    header = (["precision"] + [f"seed {s}" for s in seeds]
              + ["mean loss", "mean diff vs its fp32", "std of diff / fp32 spread",
                 f"excess over {floor:.3f}: diff / spread", "accuracy", "seconds"])
    targets = []
    for precision in (p for p in precisions if p in OURS and p != "fp32"):  # the targets are ours
        d = summary.get(precision, {}).get("mean_difference")
        spread = summary.get("fp32", {}).get("seed_spread")
        targets.append({"name": f"precision loss {precision}", "target": "final loss within 2% of float32's (mean "
                        "over the seeds)", "measured": d, "threshold": TARGET,
                        "met": d is not None and abs(d) <= TARGET,
                        "shortfall": None if d is None or abs(d) <= TARGET else abs(d) - TARGET,
                        "note": (f"standard error {_pct(summary.get(precision, {}).get('standard_error'))[1:]} over "
                                 f"{len(summary.get(precision, {}).get('relative_difference', {}))} seeds; "
                                 f"float32's seed-to-seed spread {_pct(spread)[1:]}; above the labels' floor {floor:.3f}: "
                                 f"{_pct(summary.get(precision, {}).get('mean_excess_difference'))}")
                        if spread is not None else ""})
    title = (f"{args.net} b{args.batch}, {args.iterations} iterations (lr {args.base_lr:g} linearly to 0) on "
             f"{args.images} fixed images ({args.label_noise:.0%} random labels): the loss over "
             + (f"{args.held_out} held-out images" if args.held_out else "every training image")
             + f" in a TEST pass, seeds {','.join(map(str, seeds))}")
    common.finish("precision_loss", title, args, header, rows, targets=targets,
                  extra={"runs": {p: {str(s): r for s, r in by.items()} for p, by in runs.items()},
                         "summary": {p: {k: ({str(s): x for s, x in v.items()} if isinstance(v, dict) else v)
                                         for k, v in row.items()} for p, row in summary.items()},
                         "errors": errors, "seeds": seeds, "floor": floor, "merged": args.merge or None,
                         **{k: getattr(args, k) for k in DESIGN}})


if __name__ == "__main__":
    sys.exit(main())
