"""Run one layer in isolation on the CPU backend, and check its gradients by finite differences.

Arrays are float64 here so central differences are accurate to ~1e-7; the CPU ops keep the
dtype they are given, so the same code paths run as in float32 training.
"""
from __future__ import annotations

import numpy as np
from google.protobuf import text_format

from superneurons.backend.cpu import CpuBackend
from superneurons.layers.base import layer_class
from superneurons.proto import superneurons_pb2 as pb
from superneurons.memory.steps import RunContext, Tensor

_BACKEND = CpuBackend()


def make_layer(prototxt: str, bottom_shapes, phase=pb.TRAIN, rng=None, dtype=np.float64, iteration=0):
    """Build and set up a layer from its prototxt text (`type: "ReLU" ...`); params get fresh random values."""
    rng = rng or np.random.default_rng(0)
    param = text_format.Parse(prototxt, pb.LayerParameter())
    if not param.name:
        param.name = "under_test"
    if not param.bottom:
        param.bottom.extend(f"b{i}" for i in range(len(bottom_shapes)))
    if not param.top:
        param.top.append("t0")
    layer = layer_class(param.type)(param, phase)
    top_shapes = layer.setup([tuple(s) for s in bottom_shapes])
    layer.ops = _BACKEND.ops
    # The scratch region a Net would plan for this layer alone: exactly its declared entries, so an op that sums
    # into more than the layer declares (backend/scratch.py) fails here, as it would on the GPU.
    layer.ctx = RunContext(seed=1234, iteration=iteration,
                           scratch_tensor=Tensor("#scratch", (layer.scratch_entries(),), np.float64, "buffer"))
    layer.ctx.scratch_tensor.array = np.zeros(layer.scratch_entries(), np.float64)
    for decl in layer.params:
        decl.data = rng.standard_normal(decl.shape).astype(dtype)
        decl.diff = np.zeros(decl.shape, dtype)
    for buf in layer.buffers.values():
        bdt = dtype if np.dtype(buf.dtype).kind == "f" else buf.dtype
        buf.array = np.zeros(buf.shape, bdt)
    return layer, [tuple(s) for s in top_shapes]


def assert_setup_refuses(prototxt: str, bottom_shapes, words, phase=pb.TRAIN) -> None:
    """Setting up the layer must fail with a UserError that names the layer (its name and type, as the
    prototxt gives them) and holds every one of `words`."""
    import pytest

    from superneurons.errors import UserError

    param = text_format.Parse(prototxt, pb.LayerParameter())
    with pytest.raises(UserError) as err:
        make_layer(prototxt, bottom_shapes, phase=phase)
    msg = str(err.value)
    assert f"'{param.name}'" in msg and param.type in msg, msg
    for word in words:
        assert word in msg, (word, msg)


def forward(layer, bottoms, top_shapes, dtype=np.float64):
    tops = [np.zeros(s, dtype) for s in top_shapes]
    layer.forward(bottoms, tops)
    return tops


def in_place(prototxt: str) -> str:
    """A one-layer prototxt with its bottom and top both 'x'."""
    return prototxt + " bottom: 'x' top: 'x'"


def cpu_net(text: str, seed: int = 5):
    """The TRAIN-phase Net of prototxt `text` on the CPU backend."""
    from superneurons.graph.build import build_graph
    from superneurons.runtime.net import Net

    return Net(build_graph(text_format.Parse(text, pb.NetParameter()), pb.TRAIN), CpuBackend(), seed=seed)


def softmax_reference(x, axis):
    """Softmax in the input's precision, shifted by the maximum for stability."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def check_gradients(prototxt, bottoms, *, phase=pb.TRAIN, check_bottoms=None, eps=1e-6, rtol=1e-4, atol=1e-6,
                    seed=0, params=True):
    """Compare analytic bottom and param gradients of sum(top * R) with central differences."""
    rng = np.random.default_rng(seed)
    bottoms = [np.array(b, dtype=np.float64) for b in bottoms]
    layer, top_shapes = make_layer(prototxt, [b.shape for b in bottoms], phase, rng)
    weights = [rng.standard_normal(s) for s in top_shapes]

    def objective():
        tops = forward(layer, [b.copy() for b in bottoms], top_shapes)
        return sum(float((t * w).sum()) for t, w in zip(tops, weights))

    tops = forward(layer, [b.copy() for b in bottoms], top_shapes)
    check_bottoms = list(range(len(bottoms))) if check_bottoms is None else check_bottoms
    bottom_diffs = [np.zeros_like(b) for b in bottoms]
    for decl in layer.params:
        decl.diff[...] = 0
    layer.backward(tops, [w.copy() for w in weights], [i in check_bottoms for i in range(len(bottoms))],
                   [b.copy() for b in bottoms], bottom_diffs)
    for i in check_bottoms:
        numeric = _numeric(objective, bottoms[i], eps)
        np.testing.assert_allclose(bottom_diffs[i], numeric, rtol=rtol, atol=atol,
                                   err_msg=f"{layer.type_name}: gradient of bottom {i}")
    if params:
        for k, decl in enumerate(layer.params):
            if not decl.learnable:
                continue
            analytic = decl.diff.copy()
            numeric = _numeric(objective, decl.data, eps)
            np.testing.assert_allclose(analytic, numeric, rtol=rtol, atol=atol,
                                       err_msg=f"{layer.type_name}: gradient of param {k}")
    return layer


def _numeric(f, x, eps):
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for j in range(flat.size):
        old = flat[j]
        flat[j] = old + eps
        fp = f()
        flat[j] = old - eps
        fm = f()
        flat[j] = old
        gflat[j] = (fp - fm) / (2 * eps)
    return grad


# ---- files shared by several test modules ------------------------------------------------------------
import importlib as _importlib  # noqa: E402
from pathlib import Path as _Path  # noqa: E402


def load_tool(name: str):
    """The module of tools/NAME.py (NAME like "data/make_digits_lmdb"), imported through the tools package."""
    return _importlib.import_module("tools." + name.replace("/", "."))


def lmdb_digest(path, records: int) -> str:
    """sha256 of the first `records` values of an LMDB, in key order: is it the data a fixture was made from?"""
    import hashlib

    import lmdb

    digest = hashlib.sha256()
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            for i, (_, value) in enumerate(txn.cursor()):
                if i == records:
                    break
                digest.update(value)
    finally:
        env.close()
    return digest.hexdigest()


def is_net_prototxt(path) -> bool:
    """True when the file parses as a NetParameter (False for solver files)."""
    try:
        text_format.Parse(_Path(path).read_text(), pb.NetParameter())
    except text_format.ParseError:
        return False
    return True


def parse_classify_output(out: str) -> dict[str, list[tuple[int, float, str]]]:
    """`superneurons classify`'s printout as {image: [(class index, probability, label), ...]} in rank order."""
    import re

    result: dict[str, list] = {}
    current = None
    for line in out.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            current = line[:-1]
            result[current] = []
            continue
        m = re.match(r"\s+\d+\. probability ([0-9.]+)  (.*)  \(#(\d+)\)$", line)
        if m:
            result[current].append((int(m.group(3)), float(m.group(1)), m.group(2)))
    return result
