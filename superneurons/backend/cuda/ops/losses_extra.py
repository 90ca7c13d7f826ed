"""GPU twins of backend/cpu/losses_extra.py (kernels/losses_extra.py).

Losses are finished on the device (loss = stats[0] * scale / normalizer). The label-reading forwards also
read back the count of labels outside the classes, as softmax_loss_forward does: when it is not zero the
CPU check runs on the downloaded labels and raises the same UserError.
"""
from __future__ import annotations

from superneurons.backend.cpu import loss as cpu_loss
from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat
from superneurons.backend.cuda.kernels import losses_extra as lk, rows as rk
from superneurons.backend.cuda.ops._rows import row_sums, scratch, zero
from superneurons.backend.cuda.ops.basic import download

__all__ = ["euclidean_loss_forward", "euclidean_loss_backward", "sigmoid_ce_loss_forward",
           "sigmoid_ce_loss_backward", "hinge_loss_forward", "hinge_loss_backward", "contrastive_loss_forward",
           "contrastive_loss_backward", "multinomial_logistic_loss_forward", "multinomial_logistic_loss_backward",
           "infogain_loss_forward", "infogain_loss_backward"]

_NONE = cpu_loss.NORMALIZATIONS.index("NONE")


def _stats():
    stats = scratch("loss_stats", 3)
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


def _ignore(ignore_label: int | None) -> tuple[int, bool]:
    return (0, False) if ignore_label is None else (int(ignore_label), True)


def euclidean_loss_forward(a, b, loss) -> None:
    """loss = sum((a - b)^2) / (2 N), N = a.shape[0]."""
    sums = row_sums(a, b, 1, 1, a.size, rk.SQDIFF, "euclidean")
    K.launch(rk.total_into, 1)(sums, flat(loss), 0.5 / a.shape[0], False)


def euclidean_loss_backward(a, b, loss_diff, da, db) -> None:
    """da = w (a - b) / N, db = -da."""
    for out, sign in ((da, 1.0), (db, -1.0)):
        if out is not None and out.size:
            K.launch(lk.diff_scaled, out.size)(flat(a), flat(b), flat(loss_diff), flat(out), sign / a.shape[0])


def _outer_inner(x) -> tuple[int, int]:
    outer = x.shape[0]
    return outer, (x.size // outer if outer else 0)


def sigmoid_ce_loss_forward(x, target, loss, ignore_label: int | None, normalization: str) -> None:
    stats = _stats()
    _reduce(lk.sigmoid_ce_stats, x.size, flat(x), flat(target), stats, *_ignore(ignore_label))
    _finish(stats, loss, 1.0, cpu_loss.NORMALIZATIONS.index(normalization), *_outer_inner(x))


def sigmoid_ce_loss_backward(x, target, loss_diff, dx, ignore_label: int | None, normalization: str) -> None:
    stats = _stats()
    ignore = _ignore(ignore_label)
    _reduce(lk.target_count, x.size, flat(target), stats, *ignore)
    if dx.size:
        K.launch(lk.sigmoid_ce_grad, dx.size)(flat(x), flat(target), stats, flat(loss_diff), flat(dx), *ignore,
                                              cpu_loss.NORMALIZATIONS.index(normalization), *_outer_inner(x))


def hinge_loss_forward(x, label, loss, norm: str) -> None:
    n, dim = x.shape
    stats = _stats()
    _reduce(lk.hinge_stats, x.size, flat(x), flat(label), stats, dim, norm == "L2")
    _check_labels(stats, label, dim, None)
    _finish(stats, loss, 1.0 / n)


def hinge_loss_backward(x, label, loss_diff, dx, norm: str) -> None:
    n, dim = x.shape
    if dx.size:
        K.launch(lk.hinge_grad, dx.size)(flat(x), flat(label), flat(loss_diff), flat(dx), dim, norm == "L2", 1.0 / n)


def _pair_d2(a, b, tag: str):
    n = a.shape[0]
    return row_sums(a, b, 1, n, a.size // n if n else 0, rk.SQDIFF, tag)


def contrastive_loss_forward(a, b, sim, loss, margin: float, legacy: bool) -> None:
    d2 = _pair_d2(a, b, "contrastive")
    stats = _stats()
    _reduce(lk.contrastive_stats, sim.size, d2, flat(sim), stats, float(margin), bool(legacy))
    _finish(stats, loss, 0.5 / a.shape[0])


def contrastive_loss_backward(a, b, sim, loss_diff, da, db, margin: float, legacy: bool) -> None:
    n = a.shape[0]
    d2 = _pair_d2(a, b, "contrastive")
    for out, sign in ((da, 1.0), (db, -1.0)):
        if out is not None and out.size:
            K.launch(lk.contrastive_grad, out.size)(flat(a), flat(b), d2, flat(sim), flat(loss_diff), flat(out),
                                                    a.size // n, float(margin), bool(legacy), sign / n)


def multinomial_logistic_loss_forward(prob, label, loss) -> None:
    n, dim = prob.shape
    stats = _stats()
    _reduce(lk.multinomial_stats, n, flat(prob), flat(label), stats, dim)
    _check_labels(stats, label, dim, None)
    _finish(stats, loss, 1.0 / n)


def multinomial_logistic_loss_backward(prob, label, loss_diff, dx) -> None:
    n, dim = prob.shape
    if dx.size:
        K.launch(lk.multinomial_grad, dx.size)(flat(prob), flat(label), flat(loss_diff), flat(dx), dim, 1.0 / n)


def infogain_loss_forward(prob, label, infogain, loss, ignore_label: int | None, normalization: str) -> None:
    outer, channels, inner = prob.shape
    stats = _stats()
    _reduce(lk.infogain_stats, outer * inner, flat(prob), flat(label), flat(infogain), stats, channels, inner,
            *_ignore(ignore_label))
    _check_labels(stats, label, channels, ignore_label)
    _finish(stats, loss, 1.0, cpu_loss.NORMALIZATIONS.index(normalization), outer, inner)


def infogain_loss_backward(prob, label, infogain, loss_diff, dx, ignore_label: int | None,
                           normalization: str) -> None:
    outer, channels, inner = prob.shape
    ignore = _ignore(ignore_label)
    stats = _stats()
    _reduce(lk.label_stats, outer * inner, flat(label), stats, channels, *ignore)
    h_sums = row_sums(infogain, None, 1, channels, channels, rk.SUM, "infogain")
    if dx.size:
        K.launch(lk.infogain_grad, dx.size)(flat(prob), flat(label), flat(infogain), h_sums, stats, flat(loss_diff),
                                            flat(dx), channels, inner, *ignore,
                                            cpu_loss.NORMALIZATIONS.index(normalization), outer)

