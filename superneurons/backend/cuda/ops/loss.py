"""Softmax cross-entropy loss and top-k accuracy over (outer, channels, inner) views.

SoftmaxWithLoss' forward computes the loss on the device and reads back only the count of labels outside the
classes (into pinned memory): one that is not 0 raises the CPU backend's UserError, computed from the labels on
the host. That read waits for the forward to finish, so what the host does after it is time the GPU sits idle
before backward: it is kept to the one copy into a pinned buffer (when the host also allocated the read's
array, divided and uploaded the loss, the layer's forward spanned 0.45-0.94 ms of GPU time per step in
tools/bench/speed.py's profiles on an H100, for microseconds of kernels). The backward stays on the
device (the loss weight is read from the 0-d top diff there).
"""
from __future__ import annotations

import numpy as np

from superneurons.backend.cpu import loss as cpu_loss
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import current, flat
from superneurons.backend.cuda.kernels import loss as lk
from superneurons.backend.cuda.ops.basic import download, fill, upload

__all__ = ["softmax_loss_forward", "softmax_loss_backward", "accuracy_forward"]


def _ignore(ignore_label: int | None) -> tuple[int, bool]:
    return (0, False) if ignore_label is None else (int(ignore_label), True)


def _raise_bad_labels(label, channels: int, ignore_label: int | None) -> None:
    cpu_loss._labels(download(label), channels, ignore_label)  # raises the UserError naming the labels
    raise AssertionError("the GPU found labels outside the classes that the CPU check accepts")


_bad_count = None  # pinned float64[1]: where the forward's count of bad labels is read into


def _read_bad_count(stats) -> float:
    global _bad_count
    if _bad_count is None:
        from numba import cuda

        _bad_count = cuda.pinned_array(1, np.float64)
    stats[2:3].copy_to_host(_bad_count)
    return float(_bad_count[0])


def softmax_loss_forward(prob, label, loss, ignore_label: int | None, normalization: str) -> None:
    outer, channels, inner = prob.shape
    stats = current().scratch(3)
    fill(stats, 0.0)
    K.launch(lk.softmax_loss_stats, label.size)(flat(prob), flat(label), stats, channels, inner,
                                                *_ignore(ignore_label))
    K.launch(lk.softmax_loss_finish, 1)(stats, flat(loss), outer, inner, cpu_loss.NORMALIZATIONS.index(normalization))
    if _read_bad_count(stats):
        _raise_bad_labels(label, channels, ignore_label)


def softmax_loss_backward(prob, label, loss_diff, dx, ignore_label: int | None, normalization: str) -> None:
    outer, channels, inner = prob.shape
    stats = current().scratch(3)
    fill(stats, 0.0)
    ignore = _ignore(ignore_label)
    K.launch(lk.count_valid, label.size)(flat(label), stats, channels, *ignore)
    K.launch(lk.softmax_loss_grad, dx.size)(flat(prob), flat(label), stats, flat(loss_diff), flat(dx), outer,
                                            channels, inner, *ignore, cpu_loss.NORMALIZATIONS.index(normalization))


def accuracy_forward(scores, label, top_k: int, ignore_label: int | None, accuracy, per_class=None) -> None:
    channels, inner = scores.shape[1], scores.shape[2]
    buf = current().scratch(3 + 2 * channels)
    fill(buf, 0.0)
    stats, hits, seen = buf[:3], buf[3:3 + channels], buf[3 + channels:]
    K.launch(lk.accuracy_stats, label.size)(flat(scores), flat(label), stats, hits, seen, channels, inner,
                                            int(top_k), *_ignore(ignore_label))
    host = buf.copy_to_host()
    correct, valid, bad = host[:3]
    if bad:
        _raise_bad_labels(label, channels, ignore_label)
    upload(accuracy, np.array(correct / valid if valid else 0.0))
    if per_class is not None:
        h, s = host[3:3 + channels], host[3 + channels:]
        upload(per_class, np.where(s > 0, h / np.maximum(s, 1), 0.0))
