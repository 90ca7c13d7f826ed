"""Dropout with the counter-based mask of backend/cpu/dropout.py (same host keys, same bits)."""
from __future__ import annotations

import numpy as np

from superneurons.backend.cpu.dropout import keep_threshold, stream_keys
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import dropout as dk

__all__ = ["dropout_apply"]


def dropout_apply(src, dst, ratio: float, seed: int, iteration: int, layer_index: int) -> None:
    """dst = src * mask / (1 - ratio); `dst` may be `src`."""
    if not dst.size:
        return
    k1, k2 = stream_keys(seed, iteration, layer_index)
    K.launch(dk.dropout_apply, dst.size)(flat(src), flat(dst), np.uint64(k1), np.uint64(k2),
                                         np.uint64(keep_threshold(ratio)), scalar(dst, 1.0 / (1.0 - ratio)))
