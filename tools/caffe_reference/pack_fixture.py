"""Pack what Caffe computed into tests/fixtures/caffe/caffe_lenet_outputs.npz (run by make_fixture.sh).

Reads, with our own Datum/LMDB code, the LMDBs that Caffe's extract_features wrote (one Datum of
float_data per image, or per batch for the scalar blobs loss/accuracy; keys are zero-padded indices)
and the test LMDB Caffe read, and stores:

  images     (N, 28, 28) uint8   the test records Caffe's Data layer read, in cursor order
  labels     (N,) int64          their labels
  ip2        (N, 10) float32     Caffe's logits
  prob       (N, 10) float32     Caffe's softmax output
  batch_loss, batch_accuracy     (iterations,) float32: the loss/accuracy tops of each test batch
  batch_size, scale              the Data layer's settings the outputs were made with

It also checks that Caffe's `data` and `label` blobs are exactly the LMDB records times `scale`, so
the stored uint8 images are a faithful copy of Caffe's input.

With --resume-*, it also packs Caffe's run resumed from its own .solverstate into --resume-out:

  iterations, losses             each iteration's training loss as Caffe logged it (display: 1)
  keys                           "<layer>/<k>" of every parameter blob of the final model
  sum_<i>, sumsq_<i>, shape_<i>  float64 sum and sum of squares and the shape of parameter i
  head_<i>                       parameter i itself, or its first HEAD_ROWS rows when it is larger than
                                 FULL_MAX values (keeps the pack small)
  hist_sum_<i>, hist_absmax_<i>  the same for the momentum history in the final .solverstate
  iter                           the final iteration
  train_sha256, train_records    sha256 over the serialized train records the resumed run read (Caffe's
                                 Data layer restarts at the first record), so a test can check that it
                                 regenerated the same data
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import lmdb
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from superneurons.data.datum import datum_to_array, parse_datum  # noqa: E402
from superneurons.io.caffemodel import blob_to_array, read_weights  # noqa: E402
from superneurons.proto import superneurons_pb2 as pb  # noqa: E402

FULL_MAX = 6000
HEAD_ROWS = 10


def read_feature_db(path: str) -> np.ndarray:
    """extract_features' output: (records, values) float32, in key order."""
    rows = []
    env = lmdb.open(path, readonly=True, lock=False)
    with env.begin() as txn:
        for key, value in txn.cursor():
            datum = parse_datum(value, f"{path}[{key!r}]")
            rows.append(np.asarray(datum.float_data, dtype=np.float32))
    env.close()
    return np.stack(rows)


def read_images(path: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    env = lmdb.open(path, readonly=True, lock=False)
    with env.begin() as txn:
        for i, (key, value) in enumerate(txn.cursor()):
            if i == n:
                break
            datum = parse_datum(value, f"{path}[{key!r}]")
            images.append(datum_to_array(datum, path)[0])
            labels.append(datum.label)
    env.close()
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def train_records_sha256(path: str, n: int) -> str:
    digest = hashlib.sha256()
    env = lmdb.open(path, readonly=True, lock=False)
    with env.begin() as txn:
        for i, (_, value) in enumerate(txn.cursor()):
            if i == n:
                break
            digest.update(value)
    env.close()
    return digest.hexdigest()


def pack_resume(args) -> None:
    lines = open(args.resume_log, encoding="utf-8").read().splitlines()
    losses = {}
    for line in lines:
        m = re.search(r"solver\.cpp:\d+\] Iteration (\d+), loss = (\S+)$", line)
        if m:
            losses.setdefault(int(m.group(1)), float(m.group(2)))
    state = pb.SolverState()
    with open(args.resume_state, "rb") as f:
        state.ParseFromString(f.read())
    final = int(state.iter)
    its = sorted(i for i in losses if i < final)  # the line at `final` repeats the last smoothed loss
    model = read_weights(args.resume_model)
    out = {"iterations": np.asarray(its, dtype=np.int64), "losses": np.asarray([losses[i] for i in its]),
           "iter": np.int64(final)}
    keys = []
    for lp in model.layer:
        for k, blob in enumerate(lp.blobs):
            i = len(keys)
            keys.append(f"{lp.name}/{k}")
            w = blob_to_array(blob, lp.name)
            out[f"sum_{i}"] = np.float64(w.astype(np.float64).sum())
            out[f"sumsq_{i}"] = np.float64((w.astype(np.float64) ** 2).sum())
            out[f"shape_{i}"] = np.asarray(w.shape, dtype=np.int64)
            out[f"head_{i}"] = w if w.size <= FULL_MAX else w[:HEAD_ROWS]
    for i, blob in enumerate(state.history):
        h = blob_to_array(blob, "history").astype(np.float64)
        out[f"hist_sum_{i}"] = np.float64(h.sum())
        out[f"hist_absmax_{i}"] = np.float64(np.abs(h).max())
    out["keys"] = np.asarray(keys)
    n_records = len(its) * args.train_batch
    out["train_records"] = np.int64(n_records)
    out["train_sha256"] = np.asarray(train_records_sha256(args.train_lmdb, n_records))
    np.savez_compressed(args.resume_out, **out)
    print(f"{args.resume_out}: iterations {its[0]}..{its[-1]}, final iter {final}, {len(keys)} parameter blobs")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", required=True, help="folder holding feat_{data,label,ip2,prob,loss,accuracy}")
    p.add_argument("--test-lmdb", required=True)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--scale", type=float, default=0.00390625)
    p.add_argument("--out", required=True)
    p.add_argument("--resume-log", help="log of `caffe train --snapshot=...` with display: 1")
    p.add_argument("--resume-model", help="the .caffemodel that resumed run wrote at its end")
    p.add_argument("--resume-state", help="the .solverstate that resumed run wrote at its end")
    p.add_argument("--resume-out", help="where to write the resume pack")
    p.add_argument("--train-lmdb", help="the train LMDB the resumed run read")
    p.add_argument("--train-batch", type=int, default=64)
    args = p.parse_args()

    feat = {name: read_feature_db(os.path.join(args.features, f"feat_{name}"))
            for name in ("data", "label", "ip2", "prob", "loss", "accuracy")}
    n = feat["prob"].shape[0]
    images, labels = read_images(args.test_lmdb, n)
    if images.shape[0] != n:
        raise SystemExit(f"{args.test_lmdb}: {images.shape[0]} records, Caffe extracted {n}")
    expected = images.reshape(n, -1).astype(np.float32) * np.float32(args.scale)
    if not np.array_equal(feat["data"], expected):
        raise SystemExit("Caffe's data blob differs from LMDB pixels * scale")
    if not np.array_equal(feat["label"][:, 0].astype(np.int64), labels):
        raise SystemExit("Caffe's label blob differs from the LMDB labels")
    np.savez_compressed(
        args.out, images=images, labels=labels, ip2=feat["ip2"], prob=feat["prob"],
        batch_loss=feat["loss"][:, 0], batch_accuracy=feat["accuracy"][:, 0],
        batch_size=np.int64(args.batch_size), scale=np.float32(args.scale))
    pred = feat["prob"].argmax(axis=1)
    print(f"{args.out}: {n} images, top-1 accuracy {np.mean(pred == labels):.6f}, "
          f"batch loss {feat['loss'][:, 0].tolist()}, batch accuracy {feat['accuracy'][:, 0].tolist()}")
    if args.resume_out:
        pack_resume(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
