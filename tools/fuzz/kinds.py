"""The input kinds the fuzzer covers. A kind takes a seeded Random, the corpus and a fresh case folder,
writes its mutated file(s) there and returns the `superneurons` command line to run on them (run in the
corpus folder, so the nets' relative paths resolve). Adding a kind is adding one function to KINDS.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

from google.protobuf import message, text_format

sys.path.append(str(Path(__file__).resolve().parents[2] / "tests"))  # random_nets: the generator the tests use

from corpus import Corpus  # noqa: E402
from mutate import mutate_bytes, mutate_message, mutate_text  # noqa: E402
from superneurons.data.lmdb_source import write_lmdb  # noqa: E402
from superneurons.proto import superneurons_pb2 as pb  # noqa: E402

Kind = Callable[[random.Random, Corpus, Path], list[str]]


def _run_net(rng: random.Random, c: Corpus, net: str, small: bool) -> list[str]:
    """A command that reads a net: `summary` for any net; `time`/`test` (which allocate and run) for small ones."""
    choice = rng.randrange(4) if small else 0
    if choice == 0:
        return ["summary", "--model", net, "--phase", rng.choice(["TRAIN", "TEST"])]
    if choice == 1:
        return ["time", "--model", net, "--iterations", "1"]
    if choice == 2:
        return ["test", "--model", net, "--iterations", "1"]
    return ["memory", "--model", net, "--batch", str(rng.choice([1, 2, 8]))]


def _mutate_prototxt(data: bytes, cls: type[message.Message], rng: random.Random) -> bytes:
    """Half the cases edit the text (typos, stray bytes, lost lines), half edit fields of the parsed message
    and write it back: valid syntax, so the values reach the layers, the graph and the solver."""
    if rng.random() < 0.5:
        return mutate_text(data, rng)
    msg = text_format.Parse(data.decode("utf-8"), cls())
    mutate_message(msg, rng)
    return text_format.MessageToString(msg).encode()


def prototxt(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    seed = rng.choice(c.nets)
    path = case / seed.name
    path.write_bytes(_mutate_prototxt(seed.read_bytes(), pb.NetParameter, rng))
    return _run_net(rng, c, c.rel(path), seed in c.small_nets)


def _bounded_solver(data: bytes) -> bytes:
    """Keep a mutated solver's run short (a run as long as the user asks for is allowed, not a hang) and its
    snapshots inside the work folder; everything else stays as mutated."""
    text = data.decode("utf-8", "replace") if b"\0" not in data else None
    if text is None:
        return data
    param = pb.SolverParameter()
    try:
        text_format.Merge(text, param)
    except Exception:  # noqa: BLE001 - not parseable: the program must say so, leave it as is
        return data
    clamps = {"max_iter": 3, "iter_size": 2, "display": 10**6, "average_loss": 1000}
    for name, most in clamps.items():
        if getattr(param, name) > most:
            data = re.sub(rb"\b" + name.encode() + rb"\s*:\s*\S+", f"{name}: {most}".encode(), data)
    if any(t > 2 for t in param.test_iter):
        data = re.sub(rb"\btest_iter\s*:\s*\S+", b"test_iter: 2", data)
    if os.path.isabs(param.snapshot_prefix) or ".." in param.snapshot_prefix:
        data = re.sub(rb"\bsnapshot_prefix\s*:\s*\"[^\"]*\"", b'snapshot_prefix: "out/fz"', data)
    return data


def solver(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    seed = rng.choice(c.solvers)
    path = case / seed.name
    path.write_bytes(_bounded_solver(_mutate_prototxt(seed.read_bytes(), pb.SolverParameter, rng)))
    return ["train", "--solver", c.rel(path)]


def _mutate_proto(data: bytes, cls: type[message.Message], rng: random.Random) -> bytes:
    """Half the cases edit fields of the parsed message, half the raw bytes."""
    if rng.random() < 0.5:
        return mutate_bytes(data, rng)
    msg = cls()
    try:
        msg.ParseFromString(data)
    except message.DecodeError:  # already damaged by an earlier edit of this case
        return mutate_bytes(data, rng)
    mutate_message(msg, rng)
    return msg.SerializePartialToString()


def caffemodel(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    seed = rng.choice(c.caffemodels)
    path = case / seed.name
    path.write_bytes(_mutate_proto(seed.read_bytes(), pb.NetParameter, rng))
    if rng.random() < 0.2:
        return ["convert", c.rel(path), c.rel(case / "converted.prototxt")]
    return ["test", "--model", c.rel(c.lenet), "--weights", c.rel(path), "--iterations", "1"]


def caffemodel_h5(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    seed = rng.choice(c.caffemodels_h5)
    path = case / seed.name
    path.write_bytes(mutate_bytes(seed.read_bytes(), rng))
    return ["test", "--model", c.rel(c.lenet), "--weights", c.rel(path), "--iterations", "1"]


def _resume(c: Corpus, state: Path) -> list[str]:
    return ["train", "--solver", c.rel(c.resume_solver), "--snapshot", c.rel(state)]


def solverstate(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    if rng.random() < 0.2:
        seed = rng.choice(c.solverstates_h5)
        path = case / seed.name
        path.write_bytes(mutate_bytes(seed.read_bytes(), rng))
        return _resume(c, path)
    seed = rng.choice(c.solverstates)
    path = case / seed.name
    path.write_bytes(_mutate_proto(seed.read_bytes(), pb.SolverState, rng))
    shutil.copy(str(seed) + ".extra", str(path) + ".extra")
    return _resume(c, path)


def _mutate_json(value, rng: random.Random):
    """Replace one value somewhere in a JSON document with one of another type or range."""
    replacements = [None, -1, 0, 2**64, 1.5, "x", [], {}, [1, 2], {"batch": -3}, True, float("nan")]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        if rng.random() < 0.2:
            del value[key]
        else:
            value[key] = _mutate_json(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        value[i] = _mutate_json(value[i], rng)
        return value
    return rng.choice(replacements)


def extra(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    seed = rng.choice(c.solverstates)
    path = case / seed.name
    shutil.copy(seed, path)
    sidecar = Path(str(seed) + ".extra").read_bytes()
    if rng.random() < 0.3:
        mutated = mutate_bytes(sidecar, rng)
    else:
        mutated = json.dumps(_mutate_json(json.loads(sidecar), rng)).encode()
    Path(str(path) + ".extra").write_bytes(mutated)
    return _resume(c, path)


def binaryproto(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    seed = rng.choice(c.binaryprotos)
    path = case / seed.name
    path.write_bytes(_mutate_proto(seed.read_bytes(), pb.BlobProto, rng))
    reader = c.root / ("models/cifar10_quick/cifar10_quick_train_test.prototxt" if "cifar10" in str(seed)
                       else "nets/lenet_mean.prototxt")  # the net whose data layer subtracts this mean
    net = case / reader.name
    net.write_text(reader.read_text().replace(c.rel(seed), c.rel(path)))
    return ["test", "--model", c.rel(net), "--iterations", "1"]


def lmdb_db(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    """Datum records edited field by field or byte by byte and written as a new LMDB; or the data.mdb file
    itself truncated or given bit flips (in its B-tree pages as much as in the records)."""
    assert c.lmdb is not None
    db = case / "db"
    choice = rng.random()
    if choice < 0.35:
        shutil.copytree(c.lmdb, db)
        mdb = db / "data.mdb"
        if choice < 0.2:
            os.truncate(mdb, rng.randrange(os.path.getsize(mdb)))
        else:
            data = bytearray(mdb.read_bytes())
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
            mdb.write_bytes(bytes(data))
    else:
        write_lmdb(str(db), _mutated_records(rng, c))
    net = case / "lenet.prototxt"
    net.write_text(c.lenet.read_text().replace("data/digits/test_lmdb", c.rel(db)))
    return ["test", "--model", c.rel(net), "--iterations", "3"]


def _mutated_records(rng: random.Random, c: Corpus) -> list[tuple[bytes, bytes]]:
    records = list(c.records)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(records))
        key, value = records[i]
        records[i] = (key, _mutate_proto(value, pb.Datum, rng))
    if rng.random() < 0.1:
        records = records[:rng.randrange(len(records) + 1)]  # fewer records, possibly none
    return records


def leveldb(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    """Datum records edited and written as a LevelDB, or one of the database's files truncated or flipped."""
    from superneurons.data.leveldb_source import write_leveldb

    db = case / "db"
    if rng.random() < 0.35:
        write_leveldb(str(db), c.records)
        files = sorted(p for p in db.iterdir() if p.is_file() and p.stat().st_size)
        victim = rng.choice(files)
        victim.write_bytes(mutate_bytes(victim.read_bytes(), rng))
    else:
        write_leveldb(str(db), _mutated_records(rng, c))
    net = case / "lenet.prototxt"
    net.write_text(c.lenet.read_text().replace('source: "data/digits/test_lmdb"\n    batch_size: 8\n    backend: LMDB',
                                               f'source: "{c.rel(db)}"\n    batch_size: 8\n    backend: LEVELDB'))
    return ["test", "--model", c.rel(net), "--iterations", "3"]


def hdf5_data(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    """An HDF5Data layer's .h5 file with its bytes damaged, or rewritten with datasets of other shapes,
    types or values, or missing; sometimes its list file damaged."""
    import h5py
    import numpy as np

    h5 = case / "rows.h5"
    seed_bytes = (c.root / "data/rows.h5").read_bytes()
    if rng.random() < 0.4:
        h5.write_bytes(mutate_bytes(seed_bytes, rng))
    else:
        n = rng.choice([0, 1, 5, 24, 24, 24])
        shapes = {"data": (n, 1, 28, 28), "label": (n,)}
        name = rng.choice(list(shapes))
        shape = list(shapes[name])
        if shape and rng.random() < 0.7:
            shape[rng.randrange(len(shape))] = rng.choice([0, 1, 2, 3, 27, 100])
        else:
            shape = shape[:rng.randrange(len(shape) + 1)]
        shapes[name] = tuple(shape)
        dtype = rng.choice(["f4", "f8", "i4", "u1", "S3"])
        with h5py.File(h5, "w") as f:
            for key, sh in shapes.items():
                if key == name and rng.random() < 0.15:
                    continue  # missing
                values = np.full(sh, rng.choice([0.0, 1.0, float("nan"), 1e30, -5.0]))
                with np.errstate(invalid="ignore", over="ignore"):  # NaN and 1e30 cast to integers on purpose
                    values = values.astype(dtype if key == name else "f4")
                f.create_dataset(key, data=values)
    listing = f"{c.rel(h5)}\n".encode()
    if rng.random() < 0.2:
        listing = mutate_text(listing, rng)
    (case / "list.txt").write_bytes(listing)
    net = case / "hdf5.prototxt"
    net.write_text(HDF5_NET.replace("LIST", c.rel(case / "list.txt")))
    return ["test", "--model", c.rel(net), "--iterations", "2"]


HDF5_NET = """name: "rows"
layer { name: "rows" type: "HDF5Data" top: "data" top: "label" hdf5_data_param { source: "LIST" batch_size: 8 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def image(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    """A damaged image read by ImageData from a list, or stored in an encoded Datum read by Data."""
    seed = rng.choice(c.images)
    data = mutate_bytes(seed.read_bytes(), rng)
    if rng.random() < 0.5:
        (case / seed.name).write_bytes(data)
        good = c.images[0]
        shutil.copy(good, case / ("good" + good.suffix))
        listing = f"good{good.suffix} 0\n{seed.name} 1\n".encode()
        if rng.random() < 0.3:  # the list itself damaged
            listing = mutate_text(listing, rng)
        (case / "list.txt").write_bytes(listing)
        net = case / "images.prototxt"
        net.write_text((c.root / "nets/images.prototxt").read_text()
                       .replace("images/list.txt", c.rel(case / "list.txt"))
                       .replace('root_folder: "images/"', f'root_folder: "{c.rel(case)}/"'))
        return ["test", "--model", c.rel(net), "--iterations", "1"]
    records = list(c.encoded_records)
    datum = pb.Datum()
    datum.ParseFromString(records[-1][1])
    datum.data = data
    records[-1] = (records[-1][0], datum.SerializeToString())
    write_lmdb(str(case / "db"), records)
    net = case / "encoded.prototxt"
    net.write_text(c.lenet.read_text().replace("data/digits/test_lmdb", c.rel(case / "db")))
    return ["test", "--model", c.rel(net), "--iterations", "1"]


def budget(rng: random.Random, c: Corpus, case: Path) -> list[str]:
    """A random valid net (tests/random_nets.py), its activations stored in float32, float16 or bfloat16,
    trained two iterations with momentum SGD in one memory mode, at one of 8 pool sizes from the smallest plan's need to baseline's, or at a mode's need or one block
    under it: the run is refused at setup or trains to the end (runner.classify calls a pool that runs out
    after setup `midway`)."""
    from random_nets import PRECISIONS, SOLVER, SWEEP_MODES, random_net, sweep_budgets, sweep_needs, with_dummy_data

    net = random_net(rng.randrange(1 << 20))
    precision = rng.choice(PRECISIONS)
    (case / "net.prototxt").write_text(with_dummy_data(net, precision))
    (case / "solver.prototxt").write_text(f'net: "{c.rel(case / "net.prototxt")}"\n{SOLVER}\n')
    mode = rng.choice(SWEEP_MODES)
    return ["train", "--solver", c.rel(case / "solver.prototxt"), "--memory", mode, "--gpu-memory",
            str(rng.choice(sweep_budgets(sweep_needs(net, precision)))), "--no-progress"]


KINDS: dict[str, Kind] = {
    "prototxt": prototxt,
    "solver": solver,
    "caffemodel": caffemodel,
    "caffemodel_h5": caffemodel_h5,
    "solverstate": solverstate,
    "extra": extra,
    "binaryproto": binaryproto,
    "lmdb": lmdb_db,
    "leveldb": leveldb,
    "hdf5_data": hdf5_data,
    "image": image,
    "budget": budget,
}
