"""Accuracy: the fraction of labelled positions whose true class is among the top_k scores (Caffe's rule:
ties with the true class count against it). An optional second top holds the accuracy of each class."""
from __future__ import annotations

from superneurons.backend import scratch as need
from superneurons.layers.base import Layer, canonical_axis, register
from superneurons.layers.softmax import axis_split
from superneurons.layers.softmax_loss import check_label_count, run_label_op


@register("Accuracy")
class Accuracy(Layer):
    float32_only = True

    has_backward = False
    label_bottoms = (1,)
    n_bottoms = (2, 2)
    n_tops = (1, 2)

    def setup(self, bottom_shapes):
        ap = self.param.accuracy_param
        scores, labels = bottom_shapes
        axis = canonical_axis(ap.axis, len(scores), self)
        self.dims = axis_split(scores, axis)
        check_label_count(self, labels, self.dims, axis)
        self.label_dims = (self.dims[0], self.dims[2])
        channels = self.dims[1]
        self.top_k = int(ap.top_k)
        if not 1 <= self.top_k <= channels:
            raise self.fail(f"top_k is {self.top_k}, but must be between 1 and the {channels} classes")
        self.ignore_label = int(ap.ignore_label) if ap.HasField("ignore_label") else None
        return [()] + ([(channels,)] if len(self.param.top) > 1 else [])

    def backward_needs(self):
        return frozenset()

    def scratch_entries(self):
        return need.accuracy_sums(self.dims[1])

    def forward(self, bottom, top):
        ops = self.ops
        run_label_op(self, ops.accuracy_forward, ops.reshape(bottom[0], self.dims),
                     ops.reshape(bottom[1], self.label_dims), self.top_k, self.ignore_label, top[0],
                     top[1] if len(top) > 1 else None, scratch=self.ctx.scratch)
