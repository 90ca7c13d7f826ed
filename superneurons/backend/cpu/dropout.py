"""Dropout without a stored mask: the mask is a pure function of (seed, iteration, layer, element index).

Recomputing a forward step (the recompute memory mode) or running the backward therefore reproduces
the mask exactly, and the CUDA kernel produces the same bits as this NumPy code. The formula, all
arithmetic on unsigned 32-bit integers with wraparound (`mod 2**32`), `^` xor, `>>` logical shift:

    fmix32(h):  h ^= h >> 16;  h *= 0x85EBCA6B;  h ^= h >> 13;  h *= 0xC2B2AE35;  h ^= h >> 16
                (MurmurHash3's finalizer, a bijection on 32-bit words with full avalanche)
    G = 0x9E3779B9
    Per (seed, iteration, layer_index), each first reduced mod 2**32, two stream keys:
        p  = fmix32((fmix32(seed + G) ^ iteration) + G)        the pass key (one word per pass)
        k1 = fmix32((p ^ layer_index) + G)
        k2 = fmix32(k1 + G)
    Per element at flat row-major index i (a tensor has fewer than 2**32 elements):
        h = fmix32(fmix32(i ^ k1) + k2)
        u = (h >> 8) / 2**24                      uniform in [0, 1), 24 bits (exact in float32)
        keep  iff  (h >> 8) >= T,  T = ceil(dropout_ratio * 2**24)   (integer compare: u >= ratio)
    out = in * scale where kept, 0 elsewhere, with scale = 1 / (1 - dropout_ratio) (Caffe's inverted dropout).

Two hash rounds around the key addition make masks of different streams unrelated (a single
`fmix32(i ^ k)` would only permute one stream's values into another's).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["dropout_apply", "dropout_pass"]

_M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def fmix32(h: int) -> int:
    """The 32-bit finalizer on one Python int (host side: the stream keys)."""
    h &= _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h


def _fmix32_array(h: np.ndarray) -> np.ndarray:
    """fmix32 on a uint32 array, in place; NumPy's uint32 multiply wraps mod 2**32 as the kernel's does."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


def pass_key(seed: int, iteration: int) -> int:
    """The part of k1 that (seed, iteration) decide: the GPU keeps it in device memory, where a replayed pass's
    kernels read it, and derives each layer's keys in the kernel."""
    k = fmix32((seed & _M32) + GOLDEN)
    return fmix32((k ^ (iteration & _M32)) + GOLDEN)


def layer_keys(key: int, layer_index: int) -> tuple[int, int]:
    """(k1, k2) of the module docstring from a pass's `pass_key`."""
    k1 = fmix32((key ^ (layer_index & _M32)) + GOLDEN)
    return k1, fmix32(k1 + GOLDEN)


def stream_keys(seed: int, iteration: int, layer_index: int) -> tuple[int, int]:
    """(k1, k2) of the module docstring."""
    return layer_keys(pass_key(seed, iteration), layer_index)


def keep_threshold(ratio: float) -> int:
    """T of the module docstring: keep iff the 24-bit hash value is >= T."""
    return math.ceil(ratio * (1 << 24))


def keep_mask(n: int, ratio: float, seed: int, iteration: int, layer_index: int) -> np.ndarray:
    """Boolean keep mask of `n` elements (flat order)."""
    k1, k2 = stream_keys(seed, iteration, layer_index)
    h = np.arange(n, dtype=np.uint32)
    h ^= np.uint32(k1)
    _fmix32_array(h)
    h += np.uint32(k2)
    _fmix32_array(h)
    return (h >> np.uint32(8)) >= np.uint32(keep_threshold(ratio))


def dropout_pass(seed: int, iteration: int) -> None:
    """Nothing to prepare: the host derives the keys at each call (the GPU keeps the pass's key on the device)."""


def dropout_apply(src: np.ndarray, dst: np.ndarray, ratio: float, seed: int, iteration: int,
                  layer_index: int) -> None:
    """dst = src * mask / (1 - ratio); `dst` may be `src`.

    Forward (x -> y) and backward (dy -> dx) are this same map with the same mask.
    """
    keep = keep_mask(src.size, ratio, seed, iteration, layer_index).reshape(src.shape)
    np.multiply(src, keep, out=dst)
    dst *= dst.dtype.type(1.0 / (1.0 - ratio))
