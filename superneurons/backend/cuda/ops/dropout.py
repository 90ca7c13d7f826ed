"""Dropout with the counter-based mask of backend/cpu/dropout.py (same keys, same bits).

The pass's key lives in one device word, which the kernel reads: rewritten (on the compute
stream) when a pass with another seed or iteration calls `dropout_apply`, or, for a pass a CUDA graph replays,
by `dropout_pass` before the launch (layers/dropout.py `prepare_replay`). While a graph is being recorded the
word is only read: a write recorded into the graph would pin every replay to the recording pass's mask.
"""
from __future__ import annotations

import numpy as np
from numba import config as numba_config, cuda

from superneurons.backend.cpu.dropout import keep_threshold, pass_key
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import dropout as dk
from superneurons.backend.cuda.pointers import pointer

__all__ = ["dropout_apply", "dropout_pass"]

# [the uint32[1] key word, the key last queued into it (None: none)]; one per process, as every buffer of the ops
# is (a process drives one GPU)
_KEY: list = []


def dropout_pass(seed: int, iteration: int) -> None:
    """Queue the key of pass (`seed`, `iteration`) into the word the kernels read, unless it is there already."""
    _key_word(seed, iteration, write=True)


def dropout_apply(src, dst, ratio: float, seed: int, iteration: int, layer_index: int) -> None:
    """dst = src * mask / (1 - ratio); `dst` may be `src`."""
    if not dst.size:
        return
    word = _key_word(seed, iteration, write=K.stream_handle() == 0)  # not while a graph is being recorded
    K.launch(dk.dropout_apply, dst.size)(flat(src), flat(dst), word, np.uint64(layer_index & 0xFFFFFFFF),
                                         np.uint64(keep_threshold(ratio)), scalar(dst, 1.0 / (1.0 - ratio)))


def _key_word(seed: int, iteration: int, write: bool):
    entry = _KEY
    if not entry:
        entry += [cuda.device_array(1, np.uint32), None]
    key = pass_key(seed, iteration)
    if write and entry[1] != key:
        if numba_config.ENABLE_CUDASIM:  # no driver to queue a fill on
            entry[0].copy_to_device(np.array([key], np.uint32))
        elif not K.memset32(pointer(entry[0]), key, 1):
            raise RuntimeError("cuMemsetD32Async failed on dropout's key word")
        entry[1] = key
    return entry[0]
