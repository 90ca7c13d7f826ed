"""Shared pieces of the GPU op tests: `run_both` runs one op on the CPU backend and on the GPU
from the same inputs.

`pytest --storage bf16` (or fp16) stores the float32 arrays these helpers hand to both backends in that half
type, so every op test also checks the op's half path: both backends then read the same half values, compute
in float32 and round their results to half, and `close` allows for results that round to neighbouring half
values (the two sum in different orders): `HALF_TOLERANCE` per type, about two units in the last place.

The `gpu` and `rng` fixtures live in conftest.py."""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cuda.probe import gpu_available
from superneurons.dtypes import PRECISIONS

GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")]
f32 = np.float32
STORAGE = np.dtype(np.float32)  # what dev() and run_both store float32 arrays in (conftest: --storage)
# rtol and atol_scale floors of `close` per half storage type: 2^-7 and 2^-10 (two units in the last place)
HALF_TOLERANCE = {PRECISIONS["bf16"]: 2.0 ** -7, PRECISIONS["fp16"]: 2.0 ** -10}


def _float32_values():
    return pytest.mark.skipif(STORAGE != np.float32, reason="its arrays hold labels, indices, running statistics or "
                                                            "exact float32 values, which a half net keeps in float32")


# Tests whose arrays hold what a half net keeps in float32 (labels and indices past 256, running statistics,
# bits compared exactly against float32 values): skipped under a half --storage. conftest sets the storage
# before the test modules import this mark.
FLOAT32_VALUES = _float32_values()


def set_storage(precision: str) -> None:
    global STORAGE, FLOAT32_VALUES
    STORAGE = PRECISIONS[precision]
    FLOAT32_VALUES = _float32_values()


def _round_in_place(a) -> None:
    if isinstance(a, np.ndarray) and a.dtype == np.float32 and STORAGE != np.float32 and a.flags.writeable:
        a[...] = a.astype(STORAGE).astype(np.float32)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _round_in_place(x)


class _ReferenceOps:
    """The CPU ops the op tests compare against. Under a half --storage each op first rounds its float32 array
    arguments, in place, to values the storage type holds (what dev() hands the GPU), then computes in float32
    and returns float32: the reference is the op on the GPU's own inputs, unrounded at the end."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if STORAGE == np.float32 or name == "reshape":
            return fn

        def run(*args, **kwargs):
            for a in (*args, *kwargs.values()):
                _round_in_place(a)
            return fn(*args, **kwargs)

        return run


CPU = CpuBackend()
CPU.ops = _ReferenceOps(CPU.ops)
NET_CPU = CpuBackend()  # whole nets: their own storage types, no rounding of their float32 masters


def stored(a):
    """`a` as the tests store it: float32 arrays in STORAGE, others (masks, indices, float64) unchanged."""
    if isinstance(a, np.ndarray) and a.dtype == np.float32 and STORAGE != np.float32:
        return a.astype(STORAGE)
    return a


def randn(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(f32)


def dev(gpu, a):
    """A device copy of host array `a` in an arena of its own."""
    a = stored(np.asarray(a))
    d = gpu.view(gpu.arena(max(a.nbytes, 1)), 0, a.shape, a.dtype)
    gpu.from_host(d, a)
    return d


def run_both(gpu, op, arrays, *scalars):
    """ops.<op> on host copies and device copies of `arrays`; (cpu arrays, gpu arrays copied to the host)."""
    host = [None if a is None else np.array(a, copy=True) for a in arrays]
    getattr(CPU.ops, op)(*host, *scalars)
    d = [None if a is None else dev(gpu, a) for a in arrays]
    getattr(gpu.ops, op)(*d, *scalars)
    return host, [None if a is None else gpu.to_host(a) for a in d]


def close(got, want, rtol=1e-5, atol_scale=1e-5) -> float:
    """assert_allclose with an absolute floor relative to the output's scale; returns the max abs error (of the
    finite entries)."""
    got, want = np.asarray(got), np.asarray(want)
    floor = HALF_TOLERANCE.get(got.dtype, HALF_TOLERANCE.get(want.dtype, 0.0))
    if got.dtype in HALF_TOLERANCE:  # a result past the half type's range is stored as +-inf: expect that
        with np.errstate(over="ignore"):
            want = np.where(np.isinf(want.astype(got.dtype)), np.copysign(np.inf, want), want)
    got, want = got.astype(np.float64), want.astype(np.float64)
    rtol, atol_scale = max(rtol, floor), max(atol_scale, floor)
    finite = np.isfinite(want)
    atol = atol_scale * max(1.0, float(np.abs(want[finite]).max(initial=0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    return float(np.abs(got[finite] - want[finite]).max(initial=0))


def dummy_images(n: int, c: int, h: int, w: int) -> str:
    """The DummyData layer of the test nets: `data` n x c x h x w standard-normal images and `label` n class
    ids of 10 classes (uniform in [0, 9.99], which the losses truncate to 0..9)."""
    return f"""layer {{ name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param {{ shape {{ dim: {n} dim: {c} dim: {h} dim: {w} }} shape {{ dim: {n} }}
    data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "uniform" min: 0 max: 9.99 }} }} }}
"""


def one_iteration_on_both(gpu, prototxt: str) -> tuple[dict, dict]:
    """Build the TRAIN net of `prototxt` on the CPU and the GPU from one seed and run forward and backward
    once; the losses must agree. Returns ({"cpu": net, "cuda": net}, {"cpu": loss, "cuda": loss})."""
    from google.protobuf import text_format

    from superneurons.graph.build import build_graph
    from superneurons.proto import superneurons_pb2 as pb
    from superneurons.runtime.net import Net

    nets = {b.name: Net(build_graph(text_format.Parse(prototxt, pb.NetParameter()), pb.TRAIN), b, seed=11)
            for b in (NET_CPU, gpu)}
    losses = {k: n.forward_backward() for k, n in nets.items()}
    assert np.isfinite(losses["cpu"]) and abs(losses["cuda"] - losses["cpu"]) <= 1e-4 * max(1, abs(losses["cpu"]))
    return nets, losses


def assert_param_grads_match(nets: dict, losses: dict, label: str, rtol: float = 2e-3) -> float:
    """Every learnable parameter's gradient, GPU against CPU, relative to its largest entry; prints the worst."""
    worst = 0.0
    for dc, dg in zip(nets["cpu"].learnable, nets["cuda"].learnable):
        want, got = nets["cpu"].backend.to_host(dc.diff), nets["cuda"].backend.to_host(dg.diff)
        err = float(np.abs(got - want).max()) / max(1e-3, float(np.abs(want).max()))
        worst = max(worst, err)
        assert err < rtol, (dc.name, err)
    print(f"{label}: loss cpu {losses['cpu']:.6f} gpu {losses['cuda']:.6f}; "
          f"worst param-grad error / max|grad| {worst:.2e}")
    return worst
