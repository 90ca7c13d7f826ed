"""The real inputs the fuzzer mutates, built once in a folder that every shard of a run copies.

The repository's nets and solvers (models/), a tiny Datum LMDB (random 28x28 digits-shaped records), a
LeNet trained two iterations on it whose snapshot gives a .caffemodel, a .solverstate and its .extra
sidecar (binary and HDF5), a mean .binaryproto, PNG/JPEG/BMP images with an image list, and the
Caffe-written LeNet snapshot in tests/fixtures. Paths inside the nets are relative to the corpus folder;
every case runs in its shard's copy of it (cases write there: a solver's snapshots can overwrite the
corpus's own, which the next kind would then mutate).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from superneurons.cli import main as cli_main
from superneurons.data.datum import array_to_datum, encode_image, encoded_datum
from superneurons.data.lmdb_source import write_lmdb
from superneurons.io.binaryproto import write_mean

RECORDS = 24  # per LMDB: batches of 8 wrap around it
BATCH = 8

SOLVER = """net: "nets/lenet.prototxt"
test_iter: 1
test_interval: 2
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 1
max_iter: {max_iter}
snapshot: 2
snapshot_prefix: "out/{prefix}"
solver_mode: CPU
random_seed: 1701
{extra}"""

IMAGE_NET = """name: "images"
layer { name: "img" type: "ImageData" top: "data" top: "label"
  transform_param { scale: 0.00390625 }
  image_data_param { source: "LIST" batch_size: 2 new_height: 12 new_width: 12 is_color: false } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@dataclass
class Corpus:
    root: Path
    nets: list[Path] = field(default_factory=list)  # every net prototxt (repository and work folder)
    small_nets: list[Path] = field(default_factory=list)  # cheap enough to run `time`/`test` on
    solvers: list[Path] = field(default_factory=list)  # solvers whose nets are cheap to train
    caffemodels: list[Path] = field(default_factory=list)
    caffemodels_h5: list[Path] = field(default_factory=list)
    solverstates: list[Path] = field(default_factory=list)  # with .extra beside where written here
    solverstates_h5: list[Path] = field(default_factory=list)
    binaryprotos: list[Path] = field(default_factory=list)
    images: list[Path] = field(default_factory=list)
    lmdb: Path | None = None
    records: list[tuple[bytes, bytes]] = field(default_factory=list)  # what `lmdb` holds
    encoded_records: list[tuple[bytes, bytes]] = field(default_factory=list)  # data/encoded_lmdb's
    lenet: Path | None = None  # nets/lenet.prototxt: the net the weights belong to
    resume_solver: Path | None = None

    def rel(self, path: Path) -> str:
        return os.path.relpath(path, self.root)

    def moved(self, root: Path) -> Corpus:
        """This corpus as it reads once its folder is copied to `root` (every path re-rooted)."""
        def move(path: Path) -> Path:
            return root / path.relative_to(self.root)

        changes: dict = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                changes[f.name] = move(value)
            elif isinstance(value, list) and value and isinstance(value[0], Path):
                changes[f.name] = [move(p) for p in value]
        return replace(self, **changes)


def _quiet_cli(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = cli_main(argv)
    if rc != 0:
        raise RuntimeError(f"building the fuzz corpus: superneurons {' '.join(argv)} failed: {err.getvalue()}")
    return rc


def _digits(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, int]]:
    return [(rng.integers(0, 256, (1, 28, 28), dtype=np.uint8), int(rng.integers(10))) for _ in range(n)]


def build(root: Path, repo: Path) -> Corpus:
    """Create the work folder's inputs (idempotent for one root)."""
    root.mkdir(parents=True, exist_ok=True)
    c = Corpus(root)
    rng = np.random.default_rng(0)
    # The repository's nets and solvers, as they ship.
    shutil.copytree(repo / "models", root / "models", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    for path in sorted((root / "models").rglob("*.prototxt")):
        (c.solvers if "solver" in path.name else c.nets).append(path)
    c.solvers = [p for p in c.solvers if "lenet" in p.name or "cifar10_quick" in p.name]
    c.small_nets += [p for p in c.nets if p.parent.name in ("lenet", "cifar10_quick")]
    # Databases where the LeNet prototxt expects them, and one of encoded (PNG) Datums.
    digits = _digits(rng, RECORDS)
    c.records = [(b"%08d" % i, array_to_datum(a, lab).SerializeToString()) for i, (a, lab) in enumerate(digits)]
    for name in ("train_lmdb", "test_lmdb"):
        write_lmdb(str(root / "data/digits" / name), c.records)
    c.lmdb = root / "data/digits/test_lmdb"
    import h5py  # the HDF5Data layer's rows: the same digits as float data and labels

    with h5py.File(root / "data/rows.h5", "w") as f:
        f.create_dataset("data", data=np.stack([a for a, _ in digits]).astype(np.float32) / 255)
        f.create_dataset("label", data=np.array([lab for _, lab in digits], dtype=np.float32))
    c.encoded_records = [(b"%08d" % i, encoded_datum(encode_image(a), lab).SerializeToString())
                         for i, (a, lab) in enumerate(digits[:4])]
    write_lmdb(str(root / "data/encoded_lmdb"), c.encoded_records)
    # CIFAR-10 quick's databases and mean (3x32x32), so the repository's prototxt runs as it ships.
    colour = [(rng.integers(0, 256, (3, 32, 32), dtype=np.uint8), int(rng.integers(10))) for _ in range(RECORDS)]
    for name in ("cifar10_train_lmdb", "cifar10_test_lmdb"):
        write_lmdb(str(root / "data/cifar10" / name),
                   [(b"%08d" % i, array_to_datum(a, lab).SerializeToString()) for i, (a, lab) in enumerate(colour)])
    write_mean(str(root / "data/cifar10/mean.binaryproto"), np.stack([a for a, _ in colour]).mean(axis=0))
    c.binaryprotos.append(root / "data/cifar10/mean.binaryproto")
    # LeNet with small batches (train and test read the tiny databases), and variants reading a mean file.
    lenet = (root / "models/lenet/lenet_train_test.prototxt").read_text()
    lenet = lenet.replace("batch_size: 64", f"batch_size: {BATCH}").replace("batch_size: 100", f"batch_size: {BATCH}")
    (root / "nets").mkdir(exist_ok=True)
    c.lenet = root / "nets/lenet.prototxt"
    c.lenet.write_text(lenet)
    write_mean(str(root / "data/mean.binaryproto"), np.stack([a for a, _ in digits]).mean(axis=0))
    c.binaryprotos.append(root / "data/mean.binaryproto")
    (root / "nets/lenet_mean.prototxt").write_text(
        lenet.replace("scale: 0.00390625", 'scale: 0.00390625\n    mean_file: "data/mean.binaryproto"'))
    c.small_nets += [c.lenet, root / "nets/lenet_mean.prototxt"]
    c.nets += [c.lenet, root / "nets/lenet_mean.prototxt"]
    # Images in three formats and a list naming them.
    (root / "images").mkdir(exist_ok=True)
    for i, (fmt, ext) in enumerate((("PNG", "png"), ("JPEG", "jpg"), ("BMP", "bmp"))):
        path = root / "images" / f"img{i}.{ext}"
        path.write_bytes(encode_image(np.repeat(digits[i][0], 3, axis=0), fmt))
        c.images.append(path)
    (root / "images/list.txt").write_text("".join(f"{p.name} {i}\n" for i, p in enumerate(c.images)))
    (root / "nets/images.prototxt").write_text(IMAGE_NET.replace("LIST", "images/list.txt")
                                               .replace('is_color: false }', 'is_color: false root_folder: "images/" }'))
    c.small_nets.append(root / "nets/images.prototxt")
    c.nets.append(root / "nets/images.prototxt")
    # Two iterations of training: a snapshot in both formats.
    for prefix, extra in (("lenet", ""), ("lenet_h5", "snapshot_format: HDF5\n")):
        path = root / f"nets/solver_{prefix}.prototxt"
        path.write_text(SOLVER.format(max_iter=2, prefix=prefix, extra=extra))
        c.solvers.append(path)
        cwd = os.getcwd()
        os.chdir(root)
        try:
            _quiet_cli(["train", "--solver", c.rel(path)])
        finally:
            os.chdir(cwd)
    c.caffemodels.append(root / "out/lenet_iter_2.caffemodel")
    c.solverstates.append(root / "out/lenet_iter_2.solverstate")
    c.caffemodels_h5.append(root / "out/lenet_h5_iter_2.caffemodel.h5")
    c.solverstates_h5.append(root / "out/lenet_h5_iter_2.solverstate.h5")
    c.resume_solver = root / "nets/solver_resume.prototxt"
    c.resume_solver.write_text(SOLVER.format(max_iter=3, prefix="resumed", extra=""))
    # Caffe's own LeNet snapshot (written by BVLC Caffe, tests/fixtures/caffe).
    fixture = repo / "tests/fixtures/caffe/lenet_iter_400.caffemodel"
    if fixture.exists():
        shutil.copy(fixture, root / "data/caffe_lenet_iter_400.caffemodel")
        c.caffemodels.append(root / "data/caffe_lenet_iter_400.caffemodel")
    return c


if __name__ == "__main__":  # python corpus.py ROOT FILE: build in ROOT, pickle the Corpus to FILE
    import corpus  # this module under its own name, where the pickle's reader finds the class

    Path(sys.argv[2]).write_bytes(pickle.dumps(corpus.build(Path(sys.argv[1]), Path(__file__).resolve().parents[2])))
