"""Random fills computed from a counter-based hash: every value is a pure function of (seed, iteration,
layer, stream, element index), so DummyData's batch k is the same on the CPU and the GPU, after a resume,
and when the recompute manager replays a forward. The GPU kernel (backend/cuda/kernels/random_fill.py)
computes the same integers and the same float64 formulas, so the values agree up to float rounding.

With fmix32 and the stream keys of backend/cpu/dropout.py (unsigned 32-bit arithmetic, wrapping):

    k = fmix32((dropout k1 of (seed, iteration, layer) ^ stream) + G)
    k0, ka, kb, kc = four successive k = fmix32(k + G)
    per element i:  base = fmix32(i ^ k0);  A, B, C = fmix32(base + ka), fmix32(base + kb), fmix32(base + kc)
    uniform:   a + (b - a) * A / 2**32                                          in [a, b)
    gaussian:  a + b * sqrt(-2 ln((A + 1) / 2**32)) * cos(2 pi B / 2**32)       (Box-Muller, mean a, std b)
               set to 0 unless (C >> 8) < ceil(keep * 2**24): kept with probability `keep` (Caffe's sparse)

The formulas run in float64 and the result is cast to the array's dtype once.
"""
from __future__ import annotations

import math

import numpy as np

from superneurons.backend.cpu.dropout import GOLDEN, _fmix32_array, fmix32, stream_keys

__all__ = ["random_fill"]

KINDS = ("uniform", "gaussian")
TWO_POW_M32 = 2.0 ** -32
_CHUNK = 1 << 20  # elements per step: bounds the temporaries on big batches


def fill_keys(seed: int, iteration: int, layer_index: int, stream: int) -> tuple[int, int, int, int]:
    """(k0, ka, kb, kc) of the module docstring; the GPU op passes the same four words to its kernel."""
    k, _ = stream_keys(seed, iteration, layer_index)
    k = fmix32((k ^ (stream & 0xFFFFFFFF)) + GOLDEN)
    k0 = fmix32(k + GOLDEN)
    ka = fmix32(k0 + GOLDEN)
    kb = fmix32(ka + GOLDEN)
    kc = fmix32(kb + GOLDEN)
    return k0, ka, kb, kc


def keep_threshold(keep: float) -> int:
    """Keep an element iff its 24-bit word is below this (2**24: every element)."""
    return min(1 << 24, max(0, math.ceil(keep * (1 << 24))))


def _word(base: np.ndarray, key: int) -> np.ndarray:
    h = base + np.uint32(key)
    return _fmix32_array(h)


def random_values(start: int, n: int, kind: str, a: float, b: float, keep: float,
                  keys: tuple[int, int, int, int]) -> np.ndarray:
    """float64 values of elements start .. start + n - 1."""
    k0, ka, kb, kc = keys
    base = np.arange(start, start + n, dtype=np.uint32)
    base ^= np.uint32(k0)
    _fmix32_array(base)
    wa = _word(base, ka).astype(np.float64)
    if kind == "uniform":
        return a + (b - a) * (wa * TWO_POW_M32)
    if kind != "gaussian":
        raise ValueError(f"unknown random fill {kind!r}; one of {', '.join(KINDS)}")
    wb = _word(base, kb).astype(np.float64)
    z = np.sqrt(-2.0 * np.log((wa + 1.0) * TWO_POW_M32)) * np.cos((2.0 * math.pi) * (wb * TWO_POW_M32))
    out = a + b * z
    threshold = keep_threshold(keep)
    if threshold < 1 << 24:
        out[(_word(base, kc) >> np.uint32(8)) >= np.uint32(threshold)] = 0.0
    return out


def random_fill(dst: np.ndarray, kind: str, a: float, b: float, keep: float, seed: int, iteration: int,
                layer_index: int, stream: int) -> None:
    """dst = uniform in [a, b) or gaussian (mean a, std b, kept with probability `keep`), per the docstring."""
    keys = fill_keys(seed, iteration, layer_index, stream)
    flat = dst.reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        n = min(_CHUNK, flat.size - start)
        flat[start:start + n] = random_values(start, n, kind, a, b, keep, keys)
