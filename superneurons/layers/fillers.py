"""Caffe's weight fillers, computed on the host with a seeded generator (then copied to the device), and
`random_spec`: the random fillers as parameters of the device-side `random_fill` op (DummyData)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    # Caffe: fan_in = count / num, fan_out = count / channels (blob axes 0 and 1).
    total = int(np.prod(shape)) if shape else 1
    fan_in = total // shape[0] if len(shape) >= 1 and shape[0] else total
    fan_out = total // shape[1] if len(shape) >= 2 and shape[1] else total
    return fan_in, fan_out


def _variance_n(f: pb.FillerParameter, shape) -> float:
    fan_in, fan_out = _fans(shape)
    if f.variance_norm == pb.FillerParameter.FAN_OUT:
        return fan_out
    if f.variance_norm == pb.FillerParameter.AVERAGE:
        return (fan_in + fan_out) / 2.0
    return fan_in


# Values drawn at a time. The generator draws float64, twice the float32 parameter, so a large parameter is
# drawn in pieces into its float32 array: a Generator's draws concatenate, so the values are the same.
DRAW_CHUNK = 1 << 20


def _drawn(shape: tuple[int, ...], draw) -> np.ndarray:
    """A float32 array of `shape` holding draw(n)'s values, DRAW_CHUNK at a time, in order."""
    out = np.empty(shape, np.float32)
    flat = out.reshape(-1)
    for start in range(0, flat.size, DRAW_CHUNK):
        flat[start:start + DRAW_CHUNK] = draw(min(DRAW_CHUNK, flat.size - start))
    return out


def fill(f: pb.FillerParameter, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 array of `shape` filled as FillerParameter `f` says."""
    kind = f.type or "constant"
    if kind == "constant":
        return np.full(shape, f.value, dtype=np.float32)
    if kind == "uniform":
        return _drawn(shape, lambda n: rng.uniform(f.min, f.max, size=n))
    if kind == "gaussian":
        if not f.std >= 0:
            raise UserError(f"gaussian filler: std {f.std:g} must be 0 or above")
        std = abs(f.std)  # -0.0 is a std of 0, which NumPy refuses by its sign bit
        out = _drawn(shape, lambda n: rng.normal(f.mean, std, size=n))
        if f.sparse >= 0 and len(shape) >= 2:
            # Keep each weight with probability sparse / num_outputs, as Caffe does.
            num_outputs = shape[0]
            out *= _drawn(shape, lambda n: rng.random(size=n) < (f.sparse / num_outputs))
        return out
    if kind == "xavier":
        scale = np.sqrt(3.0 / _variance_n(f, shape))
        return _drawn(shape, lambda n: rng.uniform(-scale, scale, size=n))
    if kind == "msra":
        std = np.sqrt(2.0 / _variance_n(f, shape))
        return _drawn(shape, lambda n: rng.normal(0.0, std, size=n))
    if kind == "positive_unitball":
        out = _drawn(shape, lambda n: rng.uniform(0.0, 1.0, size=n))
        flat = out.reshape(shape[0], -1)
        flat /= flat.sum(axis=1, keepdims=True)
        return out
    if kind == "bilinear":
        if len(shape) != 4 or shape[2] != shape[3]:
            raise UserError(f"bilinear filler needs a 4-D square kernel, got shape {shape}")
        k = shape[3]
        f_ = np.ceil(k / 2.0)
        c = (2 * f_ - 1 - f_ % 2) / (2.0 * f_)
        w1d = 1 - np.abs(np.arange(k) / f_ - c)
        kernel = np.outer(w1d, w1d).astype(np.float32)
        return np.broadcast_to(kernel, shape).copy()
    raise UserError(f"unknown filler type {kind!r}; known: constant, uniform, gaussian, xavier, msra, "
                    "positive_unitball, bilinear")


KNOWN = ("constant", "uniform", "gaussian", "xavier", "msra", "positive_unitball", "bilinear")


def filler_problem(f: pb.FillerParameter, shape: tuple[int, ...]) -> str | None:
    """What is wrong with filling `shape` as `f` says, or None; layers ask when they declare a parameter,
    so a mistake is reported when the net is built, naming the layer, not when training starts."""
    kind = f.type or "constant"
    if kind not in KNOWN:
        return f"unknown filler type {kind!r}; known: {', '.join(KNOWN)}"
    if kind == "gaussian" and not f.std >= 0:
        return f"gaussian filler needs std >= 0, got {f.std:g}"
    if kind == "bilinear" and (len(shape) != 4 or shape[2] != shape[3]):
        return f"bilinear filler needs a 4-D square kernel, got shape {shape}"
    return None


class RandomSpec(NamedTuple):
    """Arguments of ops.random_fill, plus whether each row (axis 0) is then scaled to sum 1 (positive_unitball)."""

    kind: str  # "uniform" (a = min, b = max) or "gaussian" (a = mean, b = std)
    a: float
    b: float
    keep: float  # probability a gaussian value is kept (Caffe's sparse); 1 = dense
    unit_rows: bool = False


def random_spec(f: pb.FillerParameter, shape: tuple[int, ...]) -> RandomSpec | None:
    """The random_fill arguments of a random filler, with the distributions of `fill`; None for the
    deterministic ones (constant, bilinear). Raises UserError for an unknown type."""
    kind = f.type or "constant"
    problem = filler_problem(f, shape)
    if problem:
        raise UserError(problem)
    if kind == "uniform":
        return RandomSpec("uniform", float(f.min), float(f.max), 1.0)
    if kind == "gaussian":
        keep = 1.0
        if f.sparse >= 0 and len(shape) >= 2:
            keep = min(1.0, f.sparse / shape[0]) if shape[0] else 1.0
        return RandomSpec("gaussian", float(f.mean), float(f.std), keep)
    if kind == "xavier":
        scale = float(np.sqrt(3.0 / _variance_n(f, shape)))
        return RandomSpec("uniform", -scale, scale, 1.0)
    if kind == "msra":
        return RandomSpec("gaussian", 0.0, float(np.sqrt(2.0 / _variance_n(f, shape))), 1.0)
    if kind == "positive_unitball":
        return RandomSpec("uniform", 0.0, 1.0, 1.0, unit_rows=True)
    return None
