"""numba-cuda kernels, one module per op family. They import only numba.cuda, math and numpy, so they also
run under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) for tests on machines without a GPU.

Every elementwise kernel walks its elements with a grid-stride loop, so `launch` can cap the grid;
`launch` caches the configured `kernel[grid, block]` object per (kernel, grid) so the hot path skips
rebuilding it. Reduction kernels use BLOCK threads and a shared float64 scratch of BLOCK entries.
"""
from __future__ import annotations

BLOCK = 256
MAX_BLOCKS = 16384

_configured: dict = {}


def launch(kernel, n: int, blocks: int | None = None):
    """`kernel[grid, BLOCK]` for `n` elements (grid-stride loops), or for exactly `blocks` blocks."""
    grid = blocks if blocks is not None else max(1, min((n + BLOCK - 1) // BLOCK, MAX_BLOCKS))
    key = (kernel, grid)
    cfg = _configured.get(key)
    if cfg is None:
        cfg = _configured[key] = kernel[grid, BLOCK]
    return cfg
