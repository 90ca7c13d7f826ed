"""SoftmaxWithLoss and Accuracy kernels over (outer, channels, inner) views with float class labels.

Labels are truncated toward zero (Caffe's static_cast<int>). `stats` is a float64 scratch: [0] the summed loss
or correct count, [1] the counted (valid) positions, [2] labels outside the classes (the host reads it). The
SoftmaxWithLoss forward also keeps [3] = size - the first such label's position (a maximum, so a zeroed
scratch means none) and [4] that label's value, so the host can name it after the labels' memory is reused.
"""
from __future__ import annotations

import math

from numba import cuda

FLT_MIN = 1.1754943508222875e-38

# Normalization modes, as the ops pass them: the index in loss.NORMALIZATIONS (FULL, VALID, BATCH_SIZE, NONE).


@cuda.jit(device=True)
def label_of(label, p, channels, ignore, has_ignore):
    """(class, status) of position p: status 0 counted, 1 ignored, 2 out of range (also NaN)."""
    v = label[p]
    if not (v > -2147483648.0 and v < 2147483648.0):  # NaN or beyond int32
        return 0, 2
    lab = int(v)
    if has_ignore and lab == ignore:
        return 0, 1
    if lab < 0 or lab >= channels:
        return 0, 2
    return lab, 0


@cuda.jit
def softmax_loss_stats(prob, label, stats, channels, inner, ignore, has_ignore):
    for p in range(cuda.grid(1), label.size, cuda.gridsize(1)):
        lab, status = label_of(label, p, channels, ignore, has_ignore)
        if status == 0:
            o = p // inner
            q = prob[(o * channels + lab) * inner + p - o * inner]
            cuda.atomic.add(stats, 0, -math.log(max(q, FLT_MIN)))
            cuda.atomic.add(stats, 1, 1.0)
        elif status == 2:
            cuda.atomic.add(stats, 2, 1.0)
            cuda.atomic.max(stats, 3, float(label.size - p))


@cuda.jit
def count_valid(label, stats, channels, ignore, has_ignore):
    for p in range(cuda.grid(1), label.size, cuda.gridsize(1)):
        lab, status = label_of(label, p, channels, ignore, has_ignore)
        if status == 0:
            cuda.atomic.add(stats, 1, 1.0)


@cuda.jit(device=True)
def normalizer(mode, outer, inner, valid):
    if mode == 3:
        return 1.0
    n = float(outer * inner) if mode == 0 else (valid if mode == 1 else float(outer))
    return max(1.0, n)


@cuda.jit
def softmax_loss_finish(stats, label, loss, outer, inner, mode):
    """loss[0] = the summed loss / the normalizer, on the device (float64 division, rounded once into the loss's
    type, as the CPU op's division then store), so the host need not write it after reading the counters;
    stats[4] = the first label outside the classes, if any."""
    if cuda.grid(1) == 0:
        loss[0] = stats[0] / normalizer(mode, outer, inner, stats[1])
        if stats[2] > 0:
            stats[4] = label[label.size - int(stats[3])]


@cuda.jit
def softmax_loss_grad(prob, label, stats, loss_diff, dx, outer, channels, inner, ignore, has_ignore, mode):
    """dx = (prob - onehot(label)) * loss_diff / normalizer; 0 at ignored positions. Run count_valid first."""
    scale = loss_diff[0] / normalizer(mode, outer, inner, stats[1])
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        ii = i % inner
        o = i // (channels * inner)
        c = (i // inner) % channels
        lab, status = label_of(label, o * inner + ii, channels, ignore, has_ignore)
        if status != 0:
            dx[i] = 0.0
        else:
            dx[i] = (prob[i] - (1.0 if c == lab else 0.0)) * scale


@cuda.jit
def accuracy_stats(scores, label, stats, hits, seen, channels, inner, top_k, ignore, has_ignore):
    """Caffe's rule: correct when fewer than top_k other classes score at least the true class's score."""
    for p in range(cuda.grid(1), label.size, cuda.gridsize(1)):
        lab, status = label_of(label, p, channels, ignore, has_ignore)
        if status == 2:
            cuda.atomic.add(stats, 2, 1.0)
        elif status == 0:
            o = p // inner
            base = o * channels * inner + p - o * inner
            true = scores[base + lab * inner]
            better = -1
            for c in range(channels):
                if scores[base + c * inner] >= true:
                    better += 1
            cuda.atomic.add(stats, 1, 1.0)
            cuda.atomic.add(seen, lab, 1.0)
            if better < top_k:
                cuda.atomic.add(stats, 0, 1.0)
                cuda.atomic.add(hits, lab, 1.0)
