"""Softmax cross-entropy loss and top-k accuracy over (outer, channels, inner) score views.

Labels come as a float array of shape (outer, inner) holding class indexes (Caffe's convention);
they are truncated toward zero like Caffe's `static_cast<int>`. A label equal to `ignore_label`
(when one is given) contributes nothing; any other label outside [0, channels) is a mistake in the
user's data: it raises UserError, which the layer prefixes with its own name.
"""
from __future__ import annotations

import numpy as np

from superneurons.errors import UserError

__all__ = ["softmax_loss_forward", "softmax_loss_backward", "accuracy_forward"]

# Caffe clamps probabilities at FLT_MIN before the log, whatever the dtype, so log(0) never appears.
FLT_MIN = float(np.finfo(np.float32).tiny)
NORMALIZATIONS = ("FULL", "VALID", "BATCH_SIZE", "NONE")


def _labels(label: np.ndarray, channels: int, ignore_label: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(class index per position, usable for indexing even where ignored; mask of positions that count)."""
    with np.errstate(invalid="ignore"):  # NaN labels become a huge negative int and are reported below
        lab = label.astype(np.int64)
    valid = lab != ignore_label if ignore_label is not None else np.ones(lab.shape, bool)
    bad = valid & ((lab < 0) | (lab >= channels))
    if bad.any():
        raise bad_labels(int(bad.sum()), channels, float(label[bad].flat[0]))
    return np.where(valid, lab, 0), valid


def bad_labels(count: int, channels: int, first: float) -> UserError:
    """The error for `count` labels outside the classes, `first` being the first of them in memory order
    (the GPU backend reports its own count in these words)."""
    return UserError(f"{count} label(s) outside the {channels} classes [0, {channels}), e.g. {first:g}")


def loss_normalizer(normalization: str, outer: int, inner: int, valid_count: int) -> float:
    """What the summed loss is divided by (Caffe's LossLayer normalizer, never below 1)."""
    if normalization == "NONE":
        return 1.0
    by_mode = {"FULL": outer * inner, "VALID": valid_count, "BATCH_SIZE": outer}
    if normalization not in by_mode:
        raise ValueError(f"unknown loss normalization {normalization!r}; one of {', '.join(NORMALIZATIONS)}")
    return max(1.0, float(by_mode[normalization]))


def softmax_loss_forward(prob: np.ndarray, label: np.ndarray, loss: np.ndarray, ignore_label: int | None,
                         normalization: str) -> None:
    """loss (0-d) = -sum over counted positions of log(max(prob[label], FLT_MIN)) / normalizer."""
    outer, channels, inner = prob.shape
    lab, valid = _labels(label, channels, ignore_label)
    p_true = np.take_along_axis(prob, lab[:, None, :], axis=1)[:, 0, :]
    total = -np.log(np.maximum(p_true[valid], FLT_MIN)).sum()
    loss[...] = total / loss_normalizer(normalization, outer, inner, int(valid.sum()))


def softmax_loss_backward(prob: np.ndarray, label: np.ndarray, loss_diff, dx: np.ndarray,
                          ignore_label: int | None, normalization: str) -> None:
    """dx = (prob - onehot(label)) * loss_diff / normalizer, zero at ignored positions.

    `loss_diff` is the 0-d top diff: the Net writes the loss weight there.
    """
    outer, channels, inner = prob.shape
    lab, valid = _labels(label, channels, ignore_label)
    np.copyto(dx, prob)
    rows, cols = np.indices(lab.shape)
    dx[rows, lab, cols] -= 1
    dx *= valid[:, None, :]
    scale = float(loss_diff) / loss_normalizer(normalization, outer, inner, int(valid.sum()))
    dx *= dx.dtype.type(scale)


def accuracy_forward(scores: np.ndarray, label: np.ndarray, top_k: int, ignore_label: int | None,
                     accuracy: np.ndarray, per_class: np.ndarray | None = None) -> None:
    """Top-k accuracy into `accuracy` (0-d) and, if given, per-class accuracy into `per_class` (channels,).

    As in Caffe, a position is correct when fewer than `top_k` other classes score at least as high as
    the true class: ties count against it, so constant scores are never "correct".
    """
    channels = scores.shape[1]
    lab, valid = _labels(label, channels, ignore_label)
    true_score = np.take_along_axis(scores, lab[:, None, :], axis=1)
    better = (scores >= true_score).sum(axis=1) - 1  # minus the true class itself
    correct = valid & (better < top_k)
    n_valid = int(valid.sum())
    accuracy[...] = correct.sum() / n_valid if n_valid else 0.0
    if per_class is not None:
        hits = np.bincount(lab[correct], minlength=channels)
        seen = np.bincount(lab[valid], minlength=channels)
        per_class[...] = np.where(seen > 0, hits / np.maximum(seen, 1), 0.0)
