"""Embedding lookup: rows of a (input_dim, num_output) table picked by integer-valued indices."""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need
from superneurons.errors import UserError

__all__ = ["embed_forward", "embed_backward", "select_nonzero"]


def _indices(idx: np.ndarray, input_dim: int) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        ind = idx.reshape(-1).astype(np.int64)
    bad = (ind < 0) | (ind >= input_dim) | (ind != idx.reshape(-1))
    if bad.any():
        raise UserError(f"{int(bad.sum())} index value(s) not an integer in [0, {input_dim}), "
                        f"e.g. {float(idx.reshape(-1)[bad][0]):g}")
    return ind


def embed_forward(idx: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray, scratch: Any = None) -> None:
    """y (count(idx), num_output) = w[idx] (+ b)."""
    need.check(scratch, need.total(), "embed_forward")
    ind = _indices(idx, w.shape[0])
    y2 = y.reshape(ind.size, w.shape[1])
    np.take(w, ind, axis=0, out=y2)
    if b is not None:
        y2 += b.reshape(1, -1)


def embed_backward(idx: np.ndarray, dy: np.ndarray, dw: np.ndarray, db: np.ndarray | None, scratch: Any = None) -> None:
    """dw[idx] += dy rows (repeated indices add up); db += the sum of dy rows."""
    need.check(scratch, need.row_sums(dw.shape[1]) if db is not None else 0, "embed_backward")
    ind = _indices(idx, dw.shape[0])
    dy2 = dy.reshape(ind.size, dw.shape[1])
    np.add.at(dw, ind, dy2)
    if db is not None:
        db += dy2.sum(axis=0).reshape(db.shape)


def select_nonzero(selector: np.ndarray, positions: np.ndarray) -> int:
    """positions[:count] = the positions of selector's nonzero values, in order; returns count. Filter's rows
    to gather and scatter: the count sizes its tops, so the host needs it."""
    picked = np.flatnonzero(selector.reshape(-1))
    positions[:picked.size] = picked
    return int(picked.size)
