"""The losses: softmax cross-entropy and top-k accuracy over (outer, channels, inner) score views, then the
Euclidean, sigmoid cross-entropy, hinge, contrastive, multinomial logistic and infogain losses.

Labels come as a float array of shape (outer, inner) holding class indexes (Caffe's convention);
they are truncated toward zero like Caffe's `static_cast<int>`. A label equal to `ignore_label`
(when one is given) contributes nothing; any other label outside [0, channels) is a mistake in the
user's data: it raises UserError, which the layer prefixes with its own name.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend import scratch as need
from superneurons.errors import UserError

__all__ = ["softmax_loss_forward", "softmax_loss_backward", "accuracy_forward", "euclidean_loss_forward",
           "euclidean_loss_backward", "sigmoid_ce_loss_forward", "sigmoid_ce_loss_backward", "hinge_loss_forward",
           "hinge_loss_backward", "contrastive_loss_forward", "contrastive_loss_backward",
           "multinomial_logistic_loss_forward", "multinomial_logistic_loss_backward", "infogain_loss_forward",
           "infogain_loss_backward"]

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
                         normalization: str, scratch: Any = None) -> None:
    """loss (0-d) = -sum over counted positions of log(max(prob[label], FLT_MIN)) / normalizer."""
    need.check(scratch, need.loss_stats(), "softmax_loss_forward")
    outer, channels, inner = prob.shape
    lab, valid = _labels(label, channels, ignore_label)
    p_true = np.take_along_axis(prob, lab[:, None, :], axis=1)[:, 0, :]
    total = -np.log(np.maximum(p_true[valid], FLT_MIN)).sum()
    loss[...] = total / loss_normalizer(normalization, outer, inner, int(valid.sum()))


def softmax_loss_backward(prob: np.ndarray, label: np.ndarray, loss_diff, dx: np.ndarray,
                          ignore_label: int | None, normalization: str, scratch: Any = None) -> None:
    """dx = (prob - onehot(label)) * loss_diff / normalizer, zero at ignored positions.

    `loss_diff` is the 0-d top diff: the Net writes the loss weight there.
    """
    need.check(scratch, need.loss_stats(), "softmax_loss_backward")
    outer, channels, inner = prob.shape
    lab, valid = _labels(label, channels, ignore_label)
    np.copyto(dx, prob)
    rows, cols = np.indices(lab.shape)
    dx[rows, lab, cols] -= 1
    dx *= valid[:, None, :]
    scale = float(loss_diff) / loss_normalizer(normalization, outer, inner, int(valid.sum()))
    dx *= dx.dtype.type(scale)


def accuracy_forward(scores: np.ndarray, label: np.ndarray, top_k: int, ignore_label: int | None,
                     accuracy: np.ndarray, per_class: np.ndarray | None = None, scratch: Any = None) -> None:
    """Top-k accuracy into `accuracy` (0-d) and, if given, per-class accuracy into `per_class` (channels,).

    As in Caffe, a position is correct when fewer than `top_k` other classes score at least as high as
    the true class: ties count against it, so constant scores are never "correct".
    """
    need.check(scratch, need.accuracy_sums(scores.shape[1]), "accuracy_forward")
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


# Caffe's kLOG_THRESHOLD (loss_layer.hpp): probabilities are clamped here before the log.
LOG_THRESHOLD = 1e-20


def euclidean_loss_forward(a: np.ndarray, b: np.ndarray, loss: np.ndarray, scratch: Any = None) -> None:
    """loss = sum((a - b)^2) / (2 N), N = a.shape[0]."""
    need.check(scratch, need.row_sums(1), "euclidean_loss_forward")
    d = a - b.reshape(a.shape)
    loss[...] = float(np.dot(d.ravel(), d.ravel())) / (2.0 * a.shape[0])


def euclidean_loss_backward(a: np.ndarray, b: np.ndarray, loss_diff, da: np.ndarray | None,
                            db: np.ndarray | None) -> None:
    """da = w (a - b) / N, db = -da."""
    alpha = float(loss_diff) / a.shape[0]
    d = a - b.reshape(a.shape)
    if da is not None:
        np.multiply(d, da.dtype.type(alpha), out=da.reshape(a.shape))
    if db is not None:
        np.multiply(d, db.dtype.type(-alpha), out=db.reshape(a.shape))


def _sigmoid_valid(target: np.ndarray, ignore_label: int | None) -> np.ndarray:
    if ignore_label is None:
        return np.ones(target.shape, bool)
    with np.errstate(invalid="ignore"):
        return target.astype(np.int64) != ignore_label


def sigmoid_ce_loss_forward(x: np.ndarray, target: np.ndarray, loss: np.ndarray, ignore_label: int | None,
                            normalization: str, scratch: Any = None) -> None:
    """loss = -sum over counted elements of [t log p + (1 - t) log(1 - p)], p = sigmoid(x), in Caffe's stable
    form x (t - [x >= 0]) - log(1 + exp(x - 2 x [x >= 0])), divided by the normalizer (outer = x.shape[0])."""
    need.check(scratch, need.loss_stats(), "sigmoid_ce_loss_forward")
    t = target.reshape(x.shape)
    valid = _sigmoid_valid(t, ignore_label)
    pos = x >= 0
    terms = x * (t - pos) - np.log1p(np.exp(x - 2 * x * pos))
    outer = x.shape[0]
    inner = x.size // outer if outer else 0
    loss[...] = -float(terms[valid].sum()) / loss_normalizer(normalization, outer, inner, int(valid.sum()))


def sigmoid_ce_loss_backward(x: np.ndarray, target: np.ndarray, loss_diff, dx: np.ndarray,
                             ignore_label: int | None, normalization: str, scratch: Any = None) -> None:
    """dx = (sigmoid(x) - t) * w / normalizer, zero where the target is ignored."""
    need.check(scratch, need.loss_stats(), "sigmoid_ce_loss_backward")
    t = target.reshape(x.shape)
    valid = _sigmoid_valid(t, ignore_label)
    outer = x.shape[0]
    inner = x.size // outer if outer else 0
    p = 0.5 * np.tanh(0.5 * x) + 0.5
    scale = float(loss_diff) / loss_normalizer(normalization, outer, inner, int(valid.sum()))
    np.copyto(dx, np.where(valid, (p - t) * scale, 0))


def _hinge_margins(x: np.ndarray, label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max(0, 1 - s * x) with s = +1 at the true class and -1 elsewhere, the signs s); x is (N, dim)."""
    lab, _ = _labels(label.reshape(x.shape[0], 1), x.shape[1], None)
    sign = -np.ones_like(x)
    sign[np.arange(x.shape[0]), lab[:, 0]] = 1
    return np.maximum(0, 1 - sign * x), sign


def hinge_loss_forward(x: np.ndarray, label: np.ndarray, loss: np.ndarray, norm: str, scratch: Any = None) -> None:
    """loss = sum of margins (L1) or squared margins (L2) / N."""
    need.check(scratch, need.loss_stats(), "hinge_loss_forward")
    m, _ = _hinge_margins(x, label)
    total = m.sum() if norm == "L1" else (m * m).sum()
    loss[...] = float(total) / x.shape[0]


def hinge_loss_backward(x: np.ndarray, label: np.ndarray, loss_diff, dx: np.ndarray, norm: str) -> None:
    """dx = -s * [margin > 0] * w / N (L1) or -2 s * margin * w / N (L2)."""
    m, sign = _hinge_margins(x, label)
    scale = float(loss_diff) / x.shape[0]
    g = (m > 0) if norm == "L1" else 2 * m
    np.copyto(dx, -sign * g * scale)


def _pair_distances(a: np.ndarray, b: np.ndarray, sim: np.ndarray):
    n = a.shape[0]
    d = (a - b.reshape(a.shape)).reshape(n, -1)
    with np.errstate(invalid="ignore"):
        similar = sim.reshape(n).astype(np.int64) != 0
    return d, (d * d).sum(axis=1), similar


def contrastive_loss_forward(a: np.ndarray, b: np.ndarray, sim: np.ndarray, loss: np.ndarray, margin: float,
                             legacy: bool, scratch: Any = None) -> None:
    """loss = sum over pairs of d^2 (similar) or max(margin - d, 0)^2 (legacy: max(margin - d^2, 0)), / 2N."""
    need.check(scratch, need.contrastive_loss(a.shape[0]), "contrastive_loss_forward")
    d, d2, similar = _pair_distances(a, b, sim)
    if legacy:
        other = np.maximum(margin - d2, 0)
    else:
        other = np.maximum(margin - np.sqrt(d2), 0) ** 2
    loss[...] = float(np.where(similar, d2, other).sum()) / (2.0 * a.shape[0])


def contrastive_loss_backward(a: np.ndarray, b: np.ndarray, sim: np.ndarray, loss_diff, da: np.ndarray | None,
                              db: np.ndarray | None, margin: float, legacy: bool, scratch: Any = None) -> None:
    """Caffe's gradient, its 1e-4 guard on the distance included: for bottom a (sign +1) or b (sign -1),
    alpha = sign * w / N; similar: alpha (a - b); dissimilar with a positive margin term: legacy -alpha (a - b),
    else -alpha (margin - d) / (d + 1e-4) (a - b); zero otherwise."""
    need.check(scratch, need.row_sums(a.shape[0]), "contrastive_loss_backward")
    d, d2, similar = _pair_distances(a, b, sim)
    n = a.shape[0]
    if legacy:
        coef = np.where(similar, 1.0, np.where(margin - d2 > 0, -1.0, 0.0))
    else:
        dist = np.sqrt(d2)
        mdist = margin - dist
        coef = np.where(similar, 1.0, np.where(mdist > 0, -mdist / (dist + 1e-4), 0.0))
    g = coef[:, None] * d * (float(loss_diff) / n)
    for out, sign in ((da, 1.0), (db, -1.0)):
        if out is not None:
            np.copyto(out.reshape(g.shape), sign * g)


def multinomial_logistic_loss_forward(prob: np.ndarray, label: np.ndarray, loss: np.ndarray,
                                      scratch: Any = None) -> None:
    """loss = -sum over samples of log(max(prob[i, label_i], 1e-20)) / N; prob is (N, dim)."""
    need.check(scratch, need.loss_stats(), "multinomial_logistic_loss_forward")
    n, dim = prob.shape
    lab, _ = _labels(label.reshape(n, 1), dim, None)
    p = prob[np.arange(n), lab[:, 0]]
    loss[...] = -float(np.log(np.maximum(p, LOG_THRESHOLD)).sum()) / n


def multinomial_logistic_loss_backward(prob: np.ndarray, label: np.ndarray, loss_diff, dx: np.ndarray) -> None:
    """dx[i, label_i] = -w / max(prob[i, label_i], 1e-20) / N, zero elsewhere."""
    n, dim = prob.shape
    lab, _ = _labels(label.reshape(n, 1), dim, None)
    rows = np.arange(n)
    dx.fill(0)
    dx[rows, lab[:, 0]] = -(float(loss_diff) / n) / np.maximum(prob[rows, lab[:, 0]], LOG_THRESHOLD)


def infogain_loss_forward(prob: np.ndarray, label: np.ndarray, infogain: np.ndarray, loss: np.ndarray,
                          ignore_label: int | None, normalization: str, scratch: Any = None) -> None:
    """loss = -sum over counted positions of sum_l H[label, l] log(max(prob[l], 1e-20)) / normalizer.

    prob is the softmax (outer, C, inner), label (outer, inner), H (C, C).
    """
    need.check(scratch, need.loss_stats(), "infogain_loss_forward")
    outer, channels, inner = prob.shape
    lab, valid = _labels(label, channels, ignore_label)
    h_rows = infogain.reshape(channels, channels)[lab]  # (outer, inner, C)
    logp = np.log(np.maximum(prob, LOG_THRESHOLD)).transpose(0, 2, 1)  # (outer, inner, C)
    total = -(h_rows * logp).sum(axis=2)[valid].sum()
    loss[...] = float(total) / loss_normalizer(normalization, outer, inner, int(valid.sum()))


def infogain_loss_backward(prob: np.ndarray, label: np.ndarray, infogain: np.ndarray, loss_diff, dx: np.ndarray,
                           ignore_label: int | None, normalization: str, scratch: Any = None) -> None:
    """d loss / d scores = (prob * sum_l H[label, l] - H[label, :]) * w / normalizer, zero where ignored."""
    need.check(scratch, need.infogain_loss(prob.shape[1]), "infogain_loss_backward")
    outer, channels, inner = prob.shape
    lab, valid = _labels(label, channels, ignore_label)
    h = infogain.reshape(channels, channels)
    h_rows = h[lab].transpose(0, 2, 1)  # (outer, C, inner)
    row_sums = h.sum(axis=1)[lab][:, None, :]  # (outer, 1, inner)
    scale = float(loss_diff) / loss_normalizer(normalization, outer, inner, int(valid.sum()))
    np.copyto(dx, (prob * row_sums - h_rows) * valid[:, None, :] * scale)
