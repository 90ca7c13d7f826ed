"""The losses' GPU ops (kernels/loss.py): softmax cross-entropy and top-k accuracy over (outer, channels,
inner) views, then the Euclidean, sigmoid cross-entropy, hinge, contrastive, multinomial logistic and infogain
losses.

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
from numba import config as numba_config

from superneurons.backend.cpu import loss as cpu_loss
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import loss as lk, rows as rk
from superneurons.backend.cuda.ops._rows import row_sums, take, zero
from superneurons.backend.cuda.ops.basic import download, upload
from superneurons.backend.scratch import accuracy_sums, loss_stats, row_sums as row_sums_entries

__all__ = ["softmax_loss_forward", "softmax_loss_backward", "accuracy_forward", "euclidean_loss_forward",
           "euclidean_loss_backward", "sigmoid_ce_loss_forward", "sigmoid_ce_loss_backward", "hinge_loss_forward",
           "hinge_loss_backward", "contrastive_loss_forward", "contrastive_loss_backward",
           "multinomial_logistic_loss_forward", "multinomial_logistic_loss_backward", "infogain_loss_forward",
           "infogain_loss_backward"]


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
        from superneurons.backend.cuda.transfer import STREAM0, CudaEvent, compute_stream, copy_to_host_async

        cls = LabelCheck
        if cls._slots is None:
            from numba import cuda

            cls._slots = cuda.pinned_array((cls.RING, 3), np.float64)
        self._host = cls._slots[cls._next]
        cls._next = (cls._next + 1) % cls.RING
        self.channels = channels
        stream = compute_stream()
        copy_to_host_async(stats[2:5], self._host, stream)
        self._done = CudaEvent(stream)
        self._rearmed = lambda: CudaEvent(STREAM0)

    def rearm(self) -> None:
        """Wait for the copy as queued again since (a CUDA graph's replay of the forward that queued it writes the
        same slot): the next call waits for the compute queued on stream 0 until now."""
        self._done = self._rearmed()

    def __call__(self) -> None:
        self._done.synchronize()
        count, _position, first = self._host
        if count:
            raise cpu_loss.bad_labels(int(count), self.channels, float(first))


def softmax_loss_forward(prob, label, loss, ignore_label: int | None, normalization: str,
                         scratch=None) -> "LabelCheck | None":
    """Queues the loss; returns the LabelCheck to run once the host needs the verdict (None in the simulator,
    where a label outside the classes raises here)."""
    outer, channels, inner = prob.shape
    stats = _stats(scratch)
    K.launch(lk.softmax_loss_stats, label.size)(flat(prob), flat(label), stats, channels, inner,
                                                *_ignore(ignore_label))
    K.launch(lk.softmax_loss_finish, 1)(stats, flat(label), flat(loss), outer, inner,
                                        cpu_loss.NORMALIZATIONS.index(normalization))
    if numba_config.ENABLE_CUDASIM:  # no driver to queue a copy on
        count, _position, first = stats.copy_to_host()[2:5]
        if count:
            raise cpu_loss.bad_labels(int(count), channels, float(first))
        return None
    return LabelCheck(stats, channels)


def softmax_loss_backward(prob, label, loss_diff, dx, ignore_label: int | None, normalization: str,
                          scratch=None) -> None:
    outer, channels, inner = prob.shape
    stats = _stats(scratch)
    ignore = _ignore(ignore_label)
    K.launch(lk.count_valid, label.size)(flat(label), stats, channels, *ignore)
    K.launch(lk.softmax_loss_grad, dx.size)(flat(prob), flat(label), stats, flat(loss_diff), flat(dx), outer,
                                            channels, inner, *ignore, cpu_loss.NORMALIZATIONS.index(normalization))


def accuracy_forward(scores, label, top_k: int, ignore_label: int | None, accuracy, per_class=None,
                     scratch=None) -> None:
    channels, inner = scores.shape[1], scores.shape[2]
    buf = take(scratch, accuracy_sums(channels))
    zero(buf)
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


_NONE = cpu_loss.NORMALIZATIONS.index("NONE")


def _stats(scratch, at: int = 0):
    """A loss's float64 running sums (backend/scratch.py: loss_stats()) in the scratch region from `at`, zeroed."""
    stats = take(scratch, loss_stats(), at)
    zero(stats)
    return stats


def _reduce(kernel, n: int, *args) -> None:
    """Launch a stats kernel over n items (grid-stride; every thread reaches the block-wide sum at the end)."""
    K.launch(kernel, max(n, 1))(*args)


def _finish(stats, loss, scale: float, mode: int = _NONE, outer: int = 1, inner: int = 1) -> None:
    K.launch(lk.finish, 1)(stats, flat(loss), float(scale), mode, outer, inner)


def _check_labels(stats, label, channels: int, ignore_label: int | None) -> None:
    if stats.copy_to_host()[2]:
        cpu_loss._labels(download(label), channels, ignore_label)  # raises the UserError naming the labels
        raise AssertionError("the GPU found labels outside the classes that the CPU check accepts")


def euclidean_loss_forward(a, b, loss, scratch=None) -> None:
    """loss = sum((a - b)^2) / (2 N), N = a.shape[0]."""
    sums = row_sums(a, b, 1, 1, a.size, rk.SQDIFF, scratch)
    K.launch(rk.total_into, 1)(sums, flat(loss), 0.5 / a.shape[0], False)


def euclidean_loss_backward(a, b, loss_diff, da, db) -> None:
    """da = w (a - b) / N, db = -da."""
    for out, sign in ((da, 1.0), (db, -1.0)):
        if out is not None and out.size:
            K.launch(lk.diff_scaled, out.size)(flat(a), flat(b), flat(loss_diff), flat(out), sign / a.shape[0])


def _outer_inner(x) -> tuple[int, int]:
    outer = x.shape[0]
    return outer, (x.size // outer if outer else 0)


def sigmoid_ce_loss_forward(x, target, loss, ignore_label: int | None, normalization: str, scratch=None) -> None:
    stats = _stats(scratch)
    _reduce(lk.sigmoid_ce_stats, x.size, flat(x), flat(target), stats, *_ignore(ignore_label))
    _finish(stats, loss, 1.0, cpu_loss.NORMALIZATIONS.index(normalization), *_outer_inner(x))


def sigmoid_ce_loss_backward(x, target, loss_diff, dx, ignore_label: int | None, normalization: str,
                             scratch=None) -> None:
    stats = _stats(scratch)
    ignore = _ignore(ignore_label)
    _reduce(lk.target_count, x.size, flat(target), stats, *ignore)
    if dx.size:
        K.launch(lk.sigmoid_ce_grad, dx.size)(flat(x), flat(target), stats, flat(loss_diff), flat(dx), *ignore,
                                              cpu_loss.NORMALIZATIONS.index(normalization), *_outer_inner(x))


def hinge_loss_forward(x, label, loss, norm: str, scratch=None) -> None:
    n, dim = x.shape
    stats = _stats(scratch)
    _reduce(lk.hinge_stats, x.size, flat(x), flat(label), stats, dim, norm == "L2")
    _check_labels(stats, label, dim, None)
    _finish(stats, loss, 1.0 / n)


def hinge_loss_backward(x, label, loss_diff, dx, norm: str) -> None:
    n, dim = x.shape
    if dx.size:
        K.launch(lk.hinge_grad, dx.size)(flat(x), flat(label), flat(loss_diff), flat(dx), dim, norm == "L2", 1.0 / n)


def _pair_d2(a, b, scratch):
    n = a.shape[0]
    return row_sums(a, b, 1, n, a.size // n if n else 0, rk.SQDIFF, scratch)


def contrastive_loss_forward(a, b, sim, loss, margin: float, legacy: bool, scratch=None) -> None:
    d2 = _pair_d2(a, b, scratch)
    stats = _stats(scratch, row_sums_entries(a.shape[0]))  # after the pairs' sums
    _reduce(lk.contrastive_stats, sim.size, d2, flat(sim), stats, float(margin), bool(legacy))
    _finish(stats, loss, 0.5 / a.shape[0])


def contrastive_loss_backward(a, b, sim, loss_diff, da, db, margin: float, legacy: bool, scratch=None) -> None:
    n = a.shape[0]
    d2 = _pair_d2(a, b, scratch)
    for out, sign in ((da, 1.0), (db, -1.0)):
        if out is not None and out.size:
            K.launch(lk.contrastive_grad, out.size)(flat(a), flat(b), d2, flat(sim), flat(loss_diff), flat(out),
                                                    a.size // n, float(margin), bool(legacy), sign / n)


def multinomial_logistic_loss_forward(prob, label, loss, scratch=None) -> None:
    n, dim = prob.shape
    stats = _stats(scratch)
    _reduce(lk.multinomial_stats, n, flat(prob), flat(label), stats, dim)
    _check_labels(stats, label, dim, None)
    _finish(stats, loss, 1.0 / n)


def multinomial_logistic_loss_backward(prob, label, loss_diff, dx) -> None:
    n, dim = prob.shape
    if dx.size:
        K.launch(lk.multinomial_grad, dx.size)(flat(prob), flat(label), flat(loss_diff), flat(dx), dim, 1.0 / n)


def infogain_loss_forward(prob, label, infogain, loss, ignore_label: int | None, normalization: str,
                          scratch=None) -> None:
    outer, channels, inner = prob.shape
    stats = _stats(scratch)
    _reduce(lk.infogain_stats, outer * inner, flat(prob), flat(label), flat(infogain), stats, channels, inner,
            *_ignore(ignore_label))
    _check_labels(stats, label, channels, ignore_label)
    _finish(stats, loss, 1.0, cpu_loss.NORMALIZATIONS.index(normalization), outer, inner)


def infogain_loss_backward(prob, label, infogain, loss_diff, dx, ignore_label: int | None,
                           normalization: str, scratch=None) -> None:
    outer, channels, inner = prob.shape
    ignore = _ignore(ignore_label)
    stats = _stats(scratch)
    _reduce(lk.label_stats, outer * inner, flat(label), stats, channels, *ignore)
    h_sums = row_sums(infogain, None, 1, channels, channels, rk.SUM, scratch, loss_stats())  # after the stats
    if dx.size:
        K.launch(lk.infogain_grad, dx.size)(flat(prob), flat(label), flat(infogain), h_sums, stats, flat(loss_diff),
                                            flat(dx), channels, inner, *ignore,
                                            cpu_loss.NORMALIZATIONS.index(normalization), outer)
