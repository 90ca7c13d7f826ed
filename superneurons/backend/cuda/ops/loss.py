"""Softmax cross-entropy loss and top-k accuracy over (outer, channels, inner) views.

SoftmaxWithLoss' forward computes the loss and counts the labels outside the classes on the device, and
reads nothing back: the count and the first bad label are copied into pinned memory on the compute stream,
and the op returns a `LabelCheck` that the Net runs once it has the loss (runtime/net.py). Reading the count
at once made the host wait for the whole forward in every step, so the device sat idle while the host then
queued backward's first kernels (SqueezeNet b64 on an H100: 4.5 ms of the host's 14.8 ms per step were that
wait, tools/bench/speed.py). The backward stays on the device too (the loss weight is read from the 0-d top
diff there). Accuracy, which runs in test nets, still reads its counts at once.
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


class LabelCheck:
    """The labels' verdict of one SoftmaxWithLoss forward, on its way to the host: calling it waits for the
    copy (queued after the forward's kernels) and raises the CPU op's UserError if any label was outside the
    classes. The counts land in one of RING pinned slots, reused RING checks later: run a check before
    RING more forwards have been queued (the Net runs them every pass)."""

    RING = 256
    _slots: np.ndarray | None = None  # pinned float64[RING, 3]: bad count, size - first position, first value
    _next = 0

    def __init__(self, stats, channels: int):
        from superneurons.backend.cuda.transfer import STREAM0, CudaEvent, copy_to_host_async

        cls = LabelCheck
        if cls._slots is None:
            from numba import cuda

            cls._slots = cuda.pinned_array((cls.RING, 3), np.float64)
        self._host = cls._slots[cls._next]
        cls._next = (cls._next + 1) % cls.RING
        self.channels = channels
        copy_to_host_async(stats[2:5], self._host, STREAM0)
        self._done = CudaEvent(STREAM0)

    def __call__(self) -> None:
        self._done.synchronize()
        count, _position, first = self._host
        if count:
            raise cpu_loss.bad_labels(int(count), self.channels, float(first))


def softmax_loss_forward(prob, label, loss, ignore_label: int | None, normalization: str) -> "LabelCheck | None":
    """Queues the loss; returns the LabelCheck to run once the host needs the verdict (None in the simulator,
    where a label outside the classes raises here)."""
    outer, channels, inner = prob.shape
    stats = current().scratch(5)
    fill(stats, 0.0)
    K.launch(lk.softmax_loss_stats, label.size)(flat(prob), flat(label), stats, channels, inner,
                                                *_ignore(ignore_label))
    K.launch(lk.softmax_loss_finish, 1)(stats, flat(label), flat(loss), outer, inner,
                                        cpu_loss.NORMALIZATIONS.index(normalization))
    from numba import config

    if config.ENABLE_CUDASIM:  # no driver to queue a copy on
        count, _position, first = stats.copy_to_host()[2:5]
        if count:
            raise cpu_loss.bad_labels(int(count), channels, float(first))
        return None
    return LabelCheck(stats, channels)


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
