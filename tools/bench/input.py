"""Input pipeline speed: the Data layer on a JPEG LMDB, alone and under ResNet-50, beside PyTorch's
DataLoader on the same LMDB, same run.

    python3 -m tools.bench.input [--images 5000] [--batch 64] [--workers 1,4,8,all] [--iterations 150]
                                 [--net-iterations 30] [--no-net] [--no-torch] [--cpu] [--out DIR]

1. The database: `--images` ImageNet-like pictures (smooth colour fields, edges and grain, 500x375, 375x500
   or 500x333 as ImageNet's photos mostly are), each saved as a JPEG file's bytes, then converted as Caffe's
   ImageNet recipe does (`convert_imageset --resize_height 256 --resize_width 256 --encoded --encode_type
   jpg`): decoded, resized to 256x256 (bilinear), re-encoded as JPEG, stored as an encoded Datum with a
   label in 0..999 -- the project's own functions for each step (`superneurons.data.datum`, `write_lmdb`).
   Kept under --db and reused when it already holds --images records.
2. (a) The Data layer alone: `crop_size: 224`, `mirror: true`, three `mean_value`s, TRAIN, batch --batch,
   forward into tops on the device (the GPU unless --cpu or none is there), at each --workers count
   (decode_workers; 1 is the in-process prefetch thread). After --warmup batches (worker start-up), img/s
   over --iterations batches, the device synchronized at the end. Beside it, the same batches made by as
   many threads of one process (no upload): the measurement behind using processes.
3. (c) PyTorch's DataLoader, same LMDB, same workers (num_workers = the count), the same decode (Pillow,
   BGR like Caffe) and transform (random 224 crop, mirror, mean subtraction, float32) in the Dataset, batch
   --batch, pin_memory and .cuda(non_blocking=True) on the GPU, timed the same way. In its own process.
4. (b) ResNet-50 b64 training (models/resnet50/resnet50_dummy.prototxt, SGD from its solver, memory mode
   baseline), once with its DummyData and once with that layer replaced by the Data layer above at the
   machine's worker count; each in its own process. img/s after --net-warmup iterations.

Prints the tables last and writes input.json under --out (default $OUT or .).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.common import ROOT, child_env, finish, ratio, target

MEAN = (104.0, 117.0, 123.0)
SIZES = ((500, 375), (375, 500), (500, 333))  # (width, height)
RESULT = "INPUT_RESULT "


# ---- the database ------------------------------------------------------------------------------
def photo(i: int) -> bytes:
    """A JPEG file of a synthetic photo: smooth colour fields, a few sharp edges, texture, sensor grain.
    After conversion a record is ~14 KiB, near an ImageNet photo at 256x256 and Pillow's JPEG quality 75."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(i)
    w, h = SIZES[i % len(SIZES)]
    coarse = rng.integers(0, 256, size=(rng.integers(3, 9), rng.integers(3, 9), 3), dtype=np.uint8)
    img = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 12))):
        box = sorted(rng.integers(0, w, 2).tolist()), sorted(rng.integers(0, h, 2).tolist())
        draw.ellipse((box[0][0], box[1][0], box[0][1], box[1][1]), fill=tuple(rng.integers(0, 256, 3).tolist()))
    texture = Image.fromarray(rng.integers(0, 256, size=(h // 6, w // 6, 3), dtype=np.uint8)).resize((w, h))
    pixels = (np.asarray(img, dtype=np.int16) * 3 + np.asarray(texture, dtype=np.int16)) // 4
    pixels += rng.normal(0, 10, size=(h, w, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def record(i: int) -> tuple[bytes, bytes]:
    """convert_imageset's steps for one photo: decode, resize to 256x256 (bilinear), JPEG, encoded Datum."""
    from PIL import Image

    from superneurons.data.datum import encode_image, encoded_datum, pil_to_array

    with Image.open(io.BytesIO(photo(i))) as img:
        pixels = pil_to_array(img.convert("RGB").resize((256, 256), Image.BILINEAR), force_color=True)
    datum = encoded_datum(encode_image(pixels, "JPEG"), label=(i * 7919) % 1000)
    return b"%08d_synthetic/%08d.JPEG" % (i, i), datum.SerializeToString()


def make_db(path: Path, images: int, workers: int) -> dict:
    from multiprocessing import get_context

    from superneurons.data.lmdb_source import count_records, write_lmdb

    if count_records(str(path)) == images:
        return {"path": str(path), "images": images, "made_s": 0.0, "reused": True}
    t0 = time.perf_counter()
    with get_context("fork").Pool(workers) as pool:  # nothing CUDA has started yet in this process
        n = write_lmdb(str(path), pool.imap(record, range(images), chunksize=16))
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"path": str(path), "images": n, "made_s": time.perf_counter() - t0, "reused": False,
            "mean_record_kib": size / n / 1024}


# ---- (a) the Data layer alone ------------------------------------------------------------------
def data_layer_text(db: str, batch: int, crop: int, workers: int) -> str:
    means = " ".join(f"mean_value: {m:g}" for m in MEAN)
    return (f'name: "data" type: "Data" top: "data" top: "label" '
            f'transform_param {{ crop_size: {crop} mirror: true {means} }} '
            f'data_param {{ source: "{db}" batch_size: {batch} backend: LMDB decode_workers: {workers} }}')


def rss_kib(pids: list[int]) -> dict:
    """Private (RssAnon) resident KiB summed over `pids`, and their shared memory counted once: the
    proportional share (Pss_Shmem of smaps_rollup) summed, since every worker maps the same slot ring and
    RssShmem would count its pages once per process."""
    out = {"anon": 0, "shmem": 0}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        out["anon"] += int(line.split()[1])
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss_Shmem:"):
                        out["shmem"] += int(line.split()[1])
        except OSError:
            pass
    return out


def layer_alone(db: str, batch: int, crop: int, workers: int, warmup: int, iterations: int, gpu: bool) -> dict:
    import numpy as np
    from google.protobuf import text_format

    from superneurons.backend import get_backend
    from superneurons.data.workers import WorkerPool
    from superneurons.layers.base import layer_class
    from superneurons.proto import superneurons_pb2 as pb
    from superneurons.memory.steps import RunContext

    backend = get_backend("cuda", 0) if gpu else get_backend("cpu")
    param = text_format.Parse(data_layer_text(db, batch, crop, workers), pb.LayerParameter())
    layer = layer_class("Data")(param, pb.TRAIN)
    shapes = layer.setup([])
    layer.ops = backend.ops
    layer.ctx = RunContext(seed=1)
    tops = [backend.view(backend.arena(int(np.prod(s)) * 4), 0, s) for s in shapes]
    try:
        for _ in range(warmup):
            layer.forward([], tops)
        backend.synchronize()
        t0 = time.perf_counter()
        for _ in range(iterations):
            layer.forward([], tops)
        backend.synchronize()
        elapsed = time.perf_counter() - t0
        maker = layer.batch_maker
        pool = maker if isinstance(maker, WorkerPool) else None
        rss = rss_kib([os.getpid()] + (pool.pids if pool else []))
        ring = pool.slots * (batch * (int(np.prod(shapes[0][1:])) + 1) * 4) if pool else None
        pinned = pool.pinned if pool else None  # batches copied to the device straight from the slots
    finally:
        layer.close()
    return {"workers": workers, "img_per_s": batch * iterations / elapsed, "ms_per_batch": 1e3 * elapsed / iterations,
            "maker": type(maker).__name__, "slots": pool.slots if pool else None,
            "pinned": pinned,
            "ring_mib": ring / 2**20 if ring else None,
            "rss_anon_mib": rss["anon"] / 1024, "rss_shmem_mib": rss["shmem"] / 1024}


def threads_alone(db: str, batch: int, crop: int, workers: int, warmup: int, iterations: int, gpu: bool) -> dict:
    """The same batches made by `workers` threads of one process instead of processes (no upload): what
    the choice of processes is measured against."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from superneurons.data.batches import BatchPlan, Seeds, fill_batch, new_batch
    from superneurons.data.records import DatumRecords
    from superneurons.data.transformer import DataTransformer
    from superneurons.proto import superneurons_pb2 as pb

    source = DatumRecords(db, "lmdb", "bench", False, False)
    transformer = DataTransformer(pb.TransformationParameter(crop_size=crop, mirror=True, mean_value=MEAN), True,
                                  "bench")
    plan = BatchPlan(batch, (3, crop, crop), Seeds.for_layer(1, pb.TRAIN, 0))
    local = threading.local()

    def make(k: int) -> int:
        if not hasattr(local, "reader"):
            local.reader = source.open(plan.seeds)  # one LMDB transaction per thread
        b = new_batch(plan, k)
        fill_batch(local.reader, transformer, plan, k, b.data, b.label, "bench")
        return k

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(make, range(warmup)))
        t0 = time.perf_counter()
        list(pool.map(make, range(warmup, warmup + iterations)))
        elapsed = time.perf_counter() - t0
    source.close()
    return {"workers": workers, "img_per_s": batch * iterations / elapsed}


# ---- (c) PyTorch's DataLoader ------------------------------------------------------------------
class LmdbImages:
    """A map-style torch Dataset over the same LMDB: Pillow decode (BGR, as Caffe), random crop, mirror, mean."""

    def __init__(self, path: str, crop: int):
        import lmdb

        self.path, self.crop, self.env = path, crop, None
        env = lmdb.open(path, readonly=True, lock=False, readahead=False)
        with env.begin() as txn:
            self.keys = [k for k, _ in txn.cursor()]
        env.close()

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int):
        import lmdb
        import numpy as np
        import torch
        from PIL import Image

        from superneurons.proto import superneurons_pb2 as pb

        if self.env is None:  # opened in the worker, after the fork
            self.env = lmdb.open(self.path, readonly=True, lock=False, readahead=False)
            self.rng = np.random.default_rng(torch.initial_seed() % 2**32)
            self.mean = np.asarray(MEAN, np.float32).reshape(3, 1, 1)
        with self.env.begin() as txn:
            datum = pb.Datum.FromString(txn.get(self.keys[i]))
        with Image.open(io.BytesIO(datum.data)) as img:
            bgr = np.asarray(img.convert("RGB"))[:, :, ::-1].transpose(2, 0, 1)
        _, h, w = bgr.shape
        y, x = int(self.rng.integers(h - self.crop + 1)), int(self.rng.integers(w - self.crop + 1))
        out = np.subtract(bgr[:, y:y + self.crop, x:x + self.crop], self.mean, dtype=np.float32)
        if self.rng.integers(2):
            out = out[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(out)), datum.label


def torch_loader(db: str, batch: int, crop: int, workers: int, warmup: int, iterations: int, gpu: bool) -> dict:
    import torch
    from torch.utils.data import DataLoader

    dataset = LmdbImages(db, crop)
    n = warmup + iterations
    order = [i % len(dataset) for i in range(n * batch)]  # sequential with wrap, as the Data layer reads
    loader = DataLoader(dataset, batch_size=batch, sampler=order, num_workers=workers, pin_memory=gpu,
                        drop_last=True, persistent_workers=workers > 0)
    it = iter(loader)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    for _ in range(warmup):
        x, y = next(it)
        if gpu:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(iterations):
        x, y = next(it)
        if gpu:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
    sync()
    elapsed = time.perf_counter() - t0
    del it
    return {"workers": workers, "img_per_s": batch * iterations / elapsed, "ms_per_batch": 1e3 * elapsed / iterations,
            "torch": torch.__version__}


# ---- (b) ResNet-50 from the LMDB against DummyData ------------------------------------------------
def resnet(source: str, db: str, batch: int, crop: int, workers: int, warmup: int, iterations: int,
           gpu: bool) -> dict:
    from google.protobuf import text_format

    from superneurons.backend import get_backend
    from superneurons.graph.batch import set_batch
    from superneurons.io.prototxt import read_net, read_solver
    from superneurons.proto import superneurons_pb2 as pb
    from superneurons.solver.solver import Solver

    os.chdir(ROOT)
    solver_file = ROOT / "models/resnet50/resnet50_dummy_solver.prototxt"
    param = read_solver(str(solver_file))
    param.display = 0
    param.max_iter = warmup + iterations
    net = read_net(str(ROOT / param.net))
    set_batch(net, batch)
    if source == "lmdb":
        index = next(i for i, layer in enumerate(net.layer) if layer.type == "DummyData")
        data = text_format.Parse(data_layer_text(db, batch, crop, workers), pb.LayerParameter())
        net.layer[index].CopyFrom(data)
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    backend = get_backend("cuda", 0) if gpu else get_backend("cpu")
    solver = Solver(param, str(solver_file), backend=backend, memory="baseline")
    losses: list[float] = []
    solver.callbacks.append(lambda s, it, loss: losses.append(float(loss)))
    solver.step(warmup)
    backend.synchronize()
    t0 = time.perf_counter()
    solver.step(iterations)
    backend.synchronize()
    elapsed = time.perf_counter() - t0
    pinned = None
    for node in solver.net.graph.nodes:
        maker = getattr(node.layer, "batch_maker", None)
        if maker is not None:
            pinned = getattr(maker, "pinned", False)
        if node.layer.is_data and hasattr(node.layer, "close"):
            node.layer.close()
    return {"source": source, "workers": workers if source == "lmdb" else None, "pinned": pinned,
            "img_per_s": batch * iterations / elapsed, "ms_per_iter": 1e3 * elapsed / iterations,
            "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}


# ---- running the parts -----------------------------------------------------------------------------
TASKS = {"layer": layer_alone, "threads": threads_alone, "torch": torch_loader, "resnet": resnet}


def in_process(task: str, timeout: int, **kw) -> dict:
    """Run one measurement in a fresh process (its own CUDA context, nothing left from the last one)."""
    cmd = [sys.executable, "-m", "tools.bench.input", "--task", json.dumps({"task": task, **kw})]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", **kw}
    for line in run.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (run.stderr or run.stdout).strip().splitlines()[-12:]
    return {"error": f"exit {run.returncode}: " + " | ".join(tail), **kw}


def worker_counts(text: str, cores: int) -> list[int]:
    counts = []
    for part in text.split(","):
        n = cores if part.strip() == "all" else int(part)
        if n not in counts:
            counts.append(n)
    return counts


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000, help="pictures in the database (default %(default)s)")
    ap.add_argument("--db", default="", help="where the LMDB is kept (default: in the temporary folder, not --out: "
                    "it is ~70 MB)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--workers", default="1,4,8,all", help="worker counts for (a) and (c) (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed batches first (default %(default)s)")
    ap.add_argument("--iterations", type=int, default=150, help="timed batches of (a) and (c) (default %(default)s)")
    ap.add_argument("--net-batch", type=int, default=64, help="ResNet-50 batch (default %(default)s)")
    ap.add_argument("--net-warmup", type=int, default=5)
    ap.add_argument("--net-iterations", type=int, default=30)
    ap.add_argument("--no-net", action="store_true", help="skip (b), the ResNet-50 runs")
    ap.add_argument("--no-torch", action="store_true", help="skip (c), PyTorch's DataLoader")
    ap.add_argument("--cpu", action="store_true", help="tops and ResNet-50 on the CPU backend even with a GPU")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per measurement process")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for input.json (default $OUT or .)")
    ap.add_argument("--task", help=argparse.SUPPRESS)  # internal: one measurement, in this process
    args = ap.parse_args(argv)
    if args.task:
        spec = json.loads(args.task)
        print(RESULT + json.dumps(TASKS[spec.pop("task")](**spec)), flush=True)
        return 0

    from superneurons.backend.cuda.probe import gpu_available

    gpu = not args.cpu and gpu_available()
    cores = len(os.sched_getaffinity(0))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    db = Path(args.db or Path(tempfile.gettempdir()) / f"superneurons_input_{args.images}_lmdb").resolve()
    database = make_db(db, args.images, cores)
    print(f"database {db}: {database}", flush=True)
    counts = worker_counts(args.workers, cores)
    shared = dict(db=str(db), batch=args.batch, crop=args.crop, warmup=args.warmup, iterations=args.iterations,
                  gpu=gpu)
    layer_runs, thread_runs, torch_runs = [], [], []
    for w in counts:
        layer_runs.append(in_process("layer", args.timeout, workers=w, **shared))
        print(f"data layer, {w} workers: {layer_runs[-1]}", flush=True)
        thread_runs.append(in_process("threads", args.timeout, workers=w, **shared))
        print(f"the same batches from {w} threads: {thread_runs[-1]}", flush=True)
        if not args.no_torch:
            torch_runs.append(in_process("torch", args.timeout, workers=w, **shared))
            print(f"PyTorch DataLoader, {w} workers: {torch_runs[-1]}", flush=True)
    net_runs = []
    if not args.no_net:
        for source in ("dummy", "lmdb"):
            net_runs.append(in_process("resnet", args.timeout, source=source, db=str(db), batch=args.net_batch,
                                       crop=args.crop, workers=cores, warmup=args.net_warmup,
                                       iterations=args.net_iterations, gpu=gpu))
            print(f"ResNet-50 from {source}: {net_runs[-1]}", flush=True)

    rows = []
    for i, w in enumerate(counts):
        ours = layer_runs[i].get("img_per_s")
        theirs = torch_runs[i].get("img_per_s") if torch_runs else None
        rows.append([w, ours, theirs, ratio(ours, theirs), thread_runs[i].get("img_per_s"),
                     layer_runs[i].get("ring_mib"), layer_runs[i].get("rss_anon_mib")])
    header = ["workers", "Data layer img/s", "PyTorch DataLoader img/s", "ratio", "threads instead img/s",
              "slot ring MiB", "private RSS MiB"]
    tables = []
    if net_runs:
        dummy, lmdb_run = net_runs[0].get("img_per_s"), net_runs[1].get("img_per_s")
        tables.append({"title": f"ResNet-50 b{args.net_batch} training ({cores} workers for the LMDB)",
                       "header": ["input", "img/s", "of DummyData"],
                       "rows": [["DummyData", dummy, 1.0 if dummy else None],
                                ["Data layer on the JPEG LMDB", lmdb_run, ratio(lmdb_run, dummy)]]})
    all_ours = layer_runs[counts.index(cores)].get("img_per_s") if cores in counts else None
    all_torch = torch_runs[counts.index(cores)].get("img_per_s") if torch_runs and cores in counts else None
    targets = [target("data_layer", ">= 5000 img/s, all workers", all_ours, 5000.0),
               target("vs_dataloader", ">= 1.2x PyTorch DataLoader, same workers", ratio(all_ours, all_torch), 1.2)]
    if net_runs:
        targets.append(target("resnet50_lmdb", ">= 0.95x DummyData speed",
                              ratio(net_runs[1].get("img_per_s"), net_runs[0].get("img_per_s")), 0.95))
    notes = [f"{r['workers']} workers ran as {r['maker']}: /dev/shm too small for the slot ring?"
             for r in layer_runs if r.get("workers", 0) > 1 and r.get("maker") not in (None, "WorkerPool")]
    device = "GPU (tops on the device)" if gpu else "CPU backend"
    finish("input", f"Data layer alone on a {args.images}-image JPEG LMDB, batch {args.batch}, crop {args.crop}, "
           f"mirror, mean; {cores} cores, {device}", args, header, rows,
           extra={"database": database, "data_layer": layer_runs, "threads": thread_runs, "dataloader": torch_runs,
                  "resnet50": net_runs,
                  "cores": cores, "gpu": gpu},
           targets=targets, tables=tables, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
