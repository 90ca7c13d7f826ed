"""Loss kernels: SoftmaxWithLoss and Accuracy over (outer, channels, inner) views with float class labels, then
the Euclidean, sigmoid cross-entropy, hinge, contrastive, multinomial logistic and infogain losses.

Labels are truncated toward zero (Caffe's static_cast<int>). `stats` is a float64 scratch: [0] the summed loss
or correct count, [1] the counted (valid) positions, [2] labels outside the classes (the host reads it). The
SoftmaxWithLoss forward also keeps [3] = size - the first such label's position (a maximum, so a zeroed
scratch means none) and [4] that label's value, so the host can name it after the labels' memory is reused.
"""
from __future__ import annotations

import math

from numba import cuda, float64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.reduce import block_sum

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


LOG_THRESHOLD = 1e-20  # Caffe's kLOG_THRESHOLD


@cuda.jit(device=True)
def block_add(stats, k, value, shared):
    """stats[k] += the block's sum of `value` (every thread of the block must call this)."""
    total = block_sum(value, shared)
    if cuda.threadIdx.x == 0 and total != 0.0:
        cuda.atomic.add(stats, k, total)


@cuda.jit
def finish(stats, loss, scale, mode, outer, inner):
    """loss[0] = stats[0] * scale / normalizer (mode as kernels/loss.py; 3 = NONE divides by 1)."""
    if cuda.grid(1) == 0:
        loss[0] = stats[0] * scale / normalizer(mode, outer, inner, stats[1])


@cuda.jit
def diff_scaled(a, b, loss_diff, out, scale):
    """out = (a - b) * loss weight * scale (Euclidean's gradient, scale = +-1/N)."""
    w = float64(loss_diff[0]) * scale
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = (a[i] - b[i]) * w


# -- sigmoid cross-entropy -----------------------------------------------------------------------------

@cuda.jit(device=True)
def target_counts(t, ignore, has_ignore):
    """Whether a target counts: not equal to ignore_label after truncation (NaN and huge values count)."""
    if not has_ignore:
        return True
    if not (t > -2147483648.0 and t < 2147483648.0):
        return True
    return int(t) != ignore


@cuda.jit
def sigmoid_ce_stats(x, t, stats, ignore, has_ignore):
    """stats[0] += x (t - [x >= 0]) - log(1 + exp(x - 2 x [x >= 0])) (Caffe's stable form), stats[1] += 1."""
    shared = cuda.shared.array(BLOCK, float64)
    acc = 0.0
    n = 0.0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        tv = float64(t[i])
        if target_counts(tv, ignore, has_ignore):
            v = float64(x[i])
            pos = 1.0 if v >= 0 else 0.0
            acc += v * (tv - pos) - math.log1p(math.exp(v - 2.0 * v * pos))
            n += 1.0
    block_add(stats, 0, -acc, shared)
    block_add(stats, 1, n, shared)


@cuda.jit
def target_count(t, stats, ignore, has_ignore):
    shared = cuda.shared.array(BLOCK, float64)
    n = 0.0
    for i in range(cuda.grid(1), t.size, cuda.gridsize(1)):
        if target_counts(float64(t[i]), ignore, has_ignore):
            n += 1.0
    block_add(stats, 1, n, shared)


@cuda.jit
def sigmoid_ce_grad(x, t, stats, loss_diff, dx, ignore, has_ignore, mode, outer, inner):
    """dx = (sigmoid(x) - t) * w / normalizer, 0 where the target is ignored. Run target_count first."""
    scale = float64(loss_diff[0]) / normalizer(mode, outer, inner, stats[1])
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        tv = t[i]
        if target_counts(float64(tv), ignore, has_ignore):
            p = 0.5 * math.tanh(0.5 * x[i]) + 0.5
            dx[i] = (p - tv) * scale
        else:
            dx[i] = 0.0


# -- hinge ---------------------------------------------------------------------------------------------

@cuda.jit(device=True)
def hinge_margin(x, label, i, dim):
    """(margin max(0, 1 - s x), sign s, label status) of element i of the (N, dim) scores."""
    p = i // dim
    lab, status = label_of(label, p, dim, 0, False)
    s = 1.0 if i - p * dim == lab else -1.0
    return max(0.0, 1.0 - s * float64(x[i])), s, status


@cuda.jit
def hinge_stats(x, label, stats, dim, squared):
    shared = cuda.shared.array(BLOCK, float64)
    acc = 0.0
    bad = 0.0
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        m, s, status = hinge_margin(x, label, i, dim)
        if status != 0:
            if i % dim == 0:
                bad += 1.0
        else:
            acc += m * m if squared else m
    block_add(stats, 0, acc, shared)
    block_add(stats, 2, bad, shared)


@cuda.jit
def hinge_grad(x, label, loss_diff, dx, dim, squared, scale):
    """dx = -s [m > 0] w / N (L1) or -2 s m w / N (L2); scale = 1 / N."""
    w = float64(loss_diff[0]) * scale
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        m, s, status = hinge_margin(x, label, i, dim)
        g = 2.0 * m if squared else (1.0 if m > 0 else 0.0)
        dx[i] = -s * g * w


# -- contrastive (per-pair squared distances d2 come from kernels/rows.py) ------------------------------

@cuda.jit(device=True)
def is_similar(v):
    """Caffe's static_cast<int>(sim) != 0: |v| >= 1, or NaN."""
    return not (v > -1.0 and v < 1.0)


@cuda.jit
def contrastive_stats(d2, sim, stats, margin, legacy):
    shared = cuda.shared.array(BLOCK, float64)
    acc = 0.0
    for p in range(cuda.grid(1), sim.size, cuda.gridsize(1)):
        d = d2[p]
        if is_similar(sim[p]):
            acc += d
        elif legacy:
            acc += max(margin - d, 0.0)
        else:
            m = max(margin - math.sqrt(d), 0.0)
            acc += m * m
    block_add(stats, 0, acc, shared)


@cuda.jit
def contrastive_grad(a, b, d2, sim, loss_diff, out, dim, margin, legacy, scale):
    """out = coef(pair) * (a - b) * w * scale, scale = +-1/N; coef per the CPU op's docstring."""
    w = float64(loss_diff[0]) * scale
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        p = i // dim
        d = d2[p]
        if is_similar(sim[p]):
            coef = 1.0
        elif legacy:
            coef = -1.0 if margin - d > 0 else 0.0
        else:
            dist = math.sqrt(d)
            mdist = margin - dist
            coef = -mdist / (dist + 1e-4) if mdist > 0 else 0.0
        out[i] = coef * (float64(a[i]) - float64(b[i])) * w


# -- multinomial logistic and infogain (class labels, status from kernels/loss.py label_of) ------------

@cuda.jit
def multinomial_stats(prob, label, stats, dim):
    shared = cuda.shared.array(BLOCK, float64)
    acc = 0.0
    bad = 0.0
    for p in range(cuda.grid(1), label.size, cuda.gridsize(1)):
        lab, status = label_of(label, p, dim, 0, False)
        if status != 0:
            bad += 1.0
        else:
            acc -= math.log(max(float64(prob[p * dim + lab]), LOG_THRESHOLD))
    block_add(stats, 0, acc, shared)
    block_add(stats, 2, bad, shared)


@cuda.jit
def multinomial_grad(prob, label, loss_diff, dx, dim, scale):
    """dx[p, label_p] = -w / max(prob, 1e-20) * scale (scale = 1/N), zero elsewhere."""
    w = float64(loss_diff[0]) * scale
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        p = i // dim
        lab, status = label_of(label, p, dim, 0, False)
        if status == 0 and i - p * dim == lab:
            dx[i] = -w / max(float64(prob[i]), LOG_THRESHOLD)
        else:
            dx[i] = 0.0


@cuda.jit
def label_stats(label, stats, channels, ignore, has_ignore):
    """stats[1] += counted positions, stats[2] += labels outside the classes."""
    shared = cuda.shared.array(BLOCK, float64)
    n = 0.0
    bad = 0.0
    for p in range(cuda.grid(1), label.size, cuda.gridsize(1)):
        lab, status = label_of(label, p, channels, ignore, has_ignore)
        if status == 0:
            n += 1.0
        elif status == 2:
            bad += 1.0
    block_add(stats, 1, n, shared)
    block_add(stats, 2, bad, shared)


@cuda.jit
def infogain_stats(prob, label, h, stats, channels, inner, ignore, has_ignore):
    """stats[0] += -sum_l H[label, l] log(max(prob[l], 1e-20)) per counted position (prob is (outer, C, inner))."""
    shared = cuda.shared.array(BLOCK, float64)
    acc = 0.0
    n = 0.0
    bad = 0.0
    for p in range(cuda.grid(1), label.size, cuda.gridsize(1)):
        lab, status = label_of(label, p, channels, ignore, has_ignore)
        if status == 2:
            bad += 1.0
        elif status == 0:
            o = p // inner
            base = o * channels * inner + p - o * inner
            for c in range(channels):
                acc -= float64(h[lab * channels + c]) * math.log(max(float64(prob[base + c * inner]), LOG_THRESHOLD))
            n += 1.0
    block_add(stats, 0, acc, shared)
    block_add(stats, 1, n, shared)
    block_add(stats, 2, bad, shared)


@cuda.jit
def infogain_grad(prob, label, h, h_sums, stats, loss_diff, dx, channels, inner, ignore, has_ignore, mode, outer):
    """dx = (prob * sum_l H[label, l] - H[label, c]) * w / normalizer, 0 where ignored; h_sums[k] = sum of H's
    row k. Run label_stats first (the VALID count)."""
    scale = float64(loss_diff[0]) / normalizer(mode, outer, inner, stats[1])
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        r = i % inner
        o = i // (channels * inner)
        c = (i // inner) % channels
        lab, status = label_of(label, o * inner + r, channels, ignore, has_ignore)
        if status != 0:
            dx[i] = 0.0
        else:
            dx[i] = (float64(prob[i]) * h_sums[lab] - float64(h[lab * channels + c])) * scale
