"""GPU twin of backend/cpu/random_fill.py: the same hash keys, one kernel, no host work per element."""
from __future__ import annotations

import numpy as np

from superneurons.backend.cpu.random_fill import KINDS, fill_keys, keep_threshold
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import random_fill as rk

__all__ = ["random_fill"]


def random_fill(dst, kind: str, a: float, b: float, keep: float, seed: int, iteration: int, layer_index: int,
                stream: int) -> None:
    """dst = uniform in [a, b) or gaussian (mean a, std b, kept with probability `keep`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown random fill {kind!r}; one of {', '.join(KINDS)}")
    if not dst.size:
        return
    k0, ka, kb, kc = (np.uint64(k) for k in fill_keys(seed, iteration, layer_index, stream))
    K.launch(rk.random_fill, dst.size)(flat(dst), k0, ka, kb, kc, kind == "gaussian", float(a), float(b),
                                       np.uint64(keep_threshold(keep)))
