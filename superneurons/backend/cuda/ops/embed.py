"""GPU twin of backend/cpu/embed.py: a gather, and a scatter-add with atomics for the table's gradient.

The forward counts bad indices on the device and reads that one number back; when it is not zero the CPU
check runs on the downloaded indices, so the UserError names the same values as on the CPU.
Filter's selection (`select_nonzero`) lives here too: it picks the rows those ops gather and scatter.
"""
from __future__ import annotations

import numpy as np

from superneurons.backend.cpu import embed as cpu_embed
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import embed as ek, rows as rk
from superneurons.backend.cuda.ops._rows import row_sums, take, zero
from superneurons.backend.cuda.ops.basic import download, upload
from superneurons.backend.scratch import total

__all__ = ["embed_forward", "embed_backward", "select_nonzero"]


def embed_forward(idx, w, b, y, scratch=None) -> None:
    """y (count(idx), num_output) = w[idx] (+ b)."""
    input_dim, num_output = w.shape
    if not y.size:
        return
    bad = take(scratch, total())
    zero(bad)
    K.launch(ek.embed_forward, y.size)(flat(idx), flat(w), flat(b) if b is not None else flat(w), flat(y),
                                       input_dim, num_output, b is not None, bad)
    if bad.copy_to_host()[0]:
        cpu_embed._indices(download(idx), input_dim)  # raises the UserError naming the bad values
        raise AssertionError("the GPU found bad embedding indices that the CPU check accepts")


def embed_backward(idx, dy, dw, db, scratch=None) -> None:
    """dw[idx] += dy rows (repeated indices add up); db += the sum of dy rows."""
    input_dim, num_output = dw.shape
    if dy.size:
        K.launch(ek.embed_backward, dy.size)(flat(idx), flat(dy), flat(dw), input_dim, num_output)
    if db is not None and dy.size:
        # Column sums of dy viewed as (rows, num_output): the rows of the (rows, num_output, 1) view.
        sums = row_sums(dy, None, dy.size // num_output, num_output, 1, rk.SUM, scratch)
        K.launch(rk.scaled_rows, num_output)(sums, flat(db), 1.0, True)


def select_nonzero(selector, positions) -> int:
    """positions[:count] = the positions of selector's nonzero values, in order; returns count. The count sizes
    Filter's tops, so the host reads the selector (N values) and sends back the positions it picks."""
    picked = np.flatnonzero(download(selector).reshape(-1))
    if picked.size:
        upload(positions[:picked.size], picked)
    return int(picked.size)
