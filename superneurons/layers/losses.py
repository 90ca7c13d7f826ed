"""EuclideanLoss, SigmoidCrossEntropyLoss, HingeLoss, ContrastiveLoss, MultinomialLogisticLoss, InfogainLoss.

Top 0 is the scalar loss; the top diff the backward reads holds the loss weight (the Net writes it).
"""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.errors import UserError
from superneurons.io.binaryproto import read_blob
from superneurons.layers.base import NEEDS_BOTTOM, Layer, canonical_axis, count, register
from superneurons.layers.softmax import axis_split
from superneurons.layers.softmax_loss import check_label_count, loss_normalization, run_label_op
from superneurons.proto import superneurons_pb2 as pb


class _Loss(Layer):
    is_loss = True
    n_bottoms = (2, 2)

    def backward_needs(self):
        return frozenset({NEEDS_BOTTOM})

    def _per_sample_labels(self, scores, labels):
        n = scores[0] if scores else 1
        if count(labels) != n:
            raise self.fail(f"label blob {self.param.bottom[1]!r} has {count(labels)} values for the {n} samples "
                            f"of {self.param.bottom[0]!r} (one label per sample)")
        self.dims = (n, count(scores) // n if n else 0)


@register("EuclideanLoss")
class EuclideanLoss(_Loss):
    """sum((a - b)^2) / 2N; both bottoms get gradients."""

    def setup(self, bottom_shapes):
        a, b = bottom_shapes
        if count(a) != count(b) or (a and b and a[0] != b[0]):
            raise self.fail(f"bottoms have shapes {a} and {b}; they need the same number of samples and values")
        self.a_shape = a
        return [()]

    def scratch_entries(self):
        return need.row_sums(1)  # the squared differences' sum

    def forward(self, bottom, top):
        self.ops.euclidean_loss_forward(bottom[0], self.ops.reshape(bottom[1], self.a_shape), top[0],
                                        scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        ops = self.ops
        ops.euclidean_loss_backward(bottom[0], ops.reshape(bottom[1], self.a_shape), top_diff[0],
                                    bottom_diff[0] if propagate_down[0] else None,
                                    ops.reshape(bottom_diff[1], self.a_shape) if propagate_down[1] else None)


@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(_Loss):
    """Cross-entropy of sigmoid(scores) against targets in [0, 1]; loss_param's ignore_label and normalization
    (default VALID; FULL counts every element, BATCH_SIZE the first axis) as in Caffe."""

    label_bottoms = (1,)

    def setup(self, bottom_shapes):
        x, t = bottom_shapes
        if count(x) != count(t):
            raise self.fail(f"the target blob {self.param.bottom[1]!r} has {count(t)} values but the scores have "
                            f"{count(x)}; they must match")
        if not x:
            raise self.fail("the scores need at least one axis (the batch)")
        lp = self.param.loss_param
        self.ignore_label = int(lp.ignore_label) if lp.HasField("ignore_label") else None
        self.normalization = loss_normalization(lp)
        self.x_shape = x
        return [()]

    def scratch_entries(self):
        return need.loss_stats()

    def forward(self, bottom, top):
        self.ops.sigmoid_ce_loss_forward(bottom[0], self.ops.reshape(bottom[1], self.x_shape), top[0],
                                         self.ignore_label, self.normalization, scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            self.ops.sigmoid_ce_loss_backward(bottom[0], self.ops.reshape(bottom[1], self.x_shape), top_diff[0],
                                              bottom_diff[0], self.ignore_label, self.normalization,
                                              scratch=self.ctx.scratch)


@register("HingeLoss")
class HingeLoss(_Loss):
    """One-vs-all hinge: sum of max(0, 1 - s x) (L1) or its square (L2) over classes, / N; s = +1 at the label."""

    label_bottoms = (1,)

    def setup(self, bottom_shapes):
        self._per_sample_labels(*bottom_shapes)
        self.norm = pb.HingeLossParameter.Norm.Name(self.param.hinge_loss_param.norm)
        return [()]

    def scratch_entries(self):
        return need.loss_stats()

    def forward(self, bottom, top):
        ops = self.ops
        run_label_op(self, ops.hinge_loss_forward, ops.reshape(bottom[0], self.dims), bottom[1], top[0], self.norm,
                     scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            ops = self.ops
            run_label_op(self, ops.hinge_loss_backward, ops.reshape(bottom[0], self.dims), bottom[1], top_diff[0],
                         ops.reshape(bottom_diff[0], self.dims), self.norm)


@register("ContrastiveLoss")
class ContrastiveLoss(_Loss):
    """Bottoms: two feature blobs (N, C, 1, 1) and a similarity label per pair (nonzero = similar)."""

    n_bottoms = (3, 3)
    label_bottoms = (2,)

    def setup(self, bottom_shapes):
        a, b, sim = bottom_shapes
        if a != b:
            raise self.fail(f"the two feature bottoms have shapes {a} and {b}; they must match")
        if not a or count(sim) != a[0]:
            raise self.fail(f"the similarity blob {self.param.bottom[2]!r} has {count(sim)} values for "
                            f"{a[0] if a else 0} pairs (one per pair)")
        p = self.param.contrastive_loss_param
        self.margin, self.legacy = float(p.margin), bool(p.legacy_version)
        self.pairs = int(a[0])
        return [()]

    def scratch_entries(self):
        return need.contrastive_loss(self.pairs)

    def forward(self, bottom, top):
        self.ops.contrastive_loss_forward(bottom[0], bottom[1], bottom[2], top[0], self.margin, self.legacy,
                                          scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0] or propagate_down[1]:
            self.ops.contrastive_loss_backward(bottom[0], bottom[1], bottom[2], top_diff[0],
                                               bottom_diff[0] if propagate_down[0] else None,
                                               bottom_diff[1] if propagate_down[1] else None, self.margin,
                                               self.legacy, scratch=self.ctx.scratch)


@register("MultinomialLogisticLoss")
class MultinomialLogisticLoss(_Loss):
    """-log(prob of the true class) averaged over samples; bottom 0 already holds probabilities."""

    label_bottoms = (1,)

    def setup(self, bottom_shapes):
        self._per_sample_labels(*bottom_shapes)
        return [()]

    def scratch_entries(self):
        return need.loss_stats()

    def forward(self, bottom, top):
        ops = self.ops
        run_label_op(self, ops.multinomial_logistic_loss_forward, ops.reshape(bottom[0], self.dims), bottom[1],
                     top[0], scratch=self.ctx.scratch)

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            ops = self.ops
            run_label_op(self, ops.multinomial_logistic_loss_backward, ops.reshape(bottom[0], self.dims),
                         bottom[1], top_diff[0], ops.reshape(bottom_diff[0], self.dims))


@register("InfogainLoss")
class InfogainLoss(_Loss):
    """Softmax over `axis`, then -sum_l H[label, l] log p_l per position (Caffe's current InfogainLoss).

    H (classes x classes) comes from infogain_loss_param.source (.binaryproto) or a third bottom; neither
    the labels nor H get a gradient. loss_param's ignore_label and normalization apply; an optional second
    top receives the probabilities.
    """

    n_bottoms = (2, 3)
    n_tops = (1, 2)
    label_bottoms = (1, 2)

    def setup(self, bottom_shapes):
        p = self.param.infogain_loss_param
        scores, labels = bottom_shapes[:2]
        axis = canonical_axis(p.axis, len(scores), self)
        self.dims = axis_split(scores, axis)
        check_label_count(self, labels, self.dims, axis)
        self.label_dims = (self.dims[0], self.dims[2])
        c = self.dims[1]
        if len(bottom_shapes) == 3:
            if count(bottom_shapes[2]) != c * c:
                raise self.fail(f"the infogain bottom {self.param.bottom[2]!r} has {count(bottom_shapes[2])} "
                                f"values; {c} classes need a {c} x {c} matrix ({c * c})")
            self.h_host = None
        else:
            if not p.source:
                raise self.fail("needs the infogain matrix: infogain_loss_param.source or a third bottom")
            try:
                h = read_blob(p.source)
            except (OSError, UserError) as e:
                raise self.fail(f"cannot read infogain_loss_param.source {p.source!r}: {e}") from None
            if h.size != c * c:
                raise self.fail(f"the infogain matrix in {p.source!r} has shape {tuple(h.shape)} ({h.size} values); "
                                f"{c} classes need {c} x {c}")
            self.h_host = h.reshape(c, c)
        self.h = self.add_buffer("infogain", (c, c)) if self.h_host is not None else None
        lp = self.param.loss_param
        self.ignore_label = int(lp.ignore_label) if lp.HasField("ignore_label") else None
        self.normalization = loss_normalization(lp)
        self.prob = self.add_buffer("prob", scores)
        return [()] + ([scores] if len(self.param.top) > 1 else [])

    def scratch_entries(self):
        return need.infogain_loss(self.dims[1])

    def backward_reads_bottom(self, j):
        return j in self.label_bottoms  # the probabilities are its own buffer

    def _matrix(self, bottom):
        if self.h is None:
            return bottom[2]
        self.ops.upload(self.h.array, self.h_host)  # c x c values: cheaper than tracking when it was last set
        return self.h.array

    def forward(self, bottom, top):
        ops = self.ops
        prob = ops.reshape(self.prob.array, self.dims)
        ops.softmax_forward(ops.reshape(bottom[0], self.dims), prob)
        run_label_op(self, ops.infogain_loss_forward, prob, ops.reshape(bottom[1], self.label_dims),
                     self._matrix(bottom), top[0], self.ignore_label, self.normalization, scratch=self.ctx.scratch)
        if len(top) > 1:
            ops.copy(self.prob.array, top[1])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            ops = self.ops
            run_label_op(self, ops.infogain_loss_backward, ops.reshape(self.prob.array, self.dims),
                         ops.reshape(bottom[1], self.label_dims), self._matrix(bottom), top_diff[0],
                         ops.reshape(bottom_diff[0], self.dims), self.ignore_label, self.normalization,
                         scratch=self.ctx.scratch)
