"""SoftmaxWithLoss: softmax over the class axis, then the mean negative log-probability of the true class.

Bottoms: scores (N, C, ...) and labels holding one class index per (outer, inner) position, as floats.
Top 0 is the scalar loss; an optional top 1 receives the probabilities. Caffe's loss_param applies:
`ignore_label` drops positions, `normalization` picks the divisor (FULL, VALID (default), BATCH_SIZE,
NONE), and the legacy `normalize: false` means BATCH_SIZE. Like Caffe, backward ignores any gradient
arriving on the probability top.
"""
from __future__ import annotations

from typing import Any, Callable

from superneurons.backend import scratch as need
from superneurons.errors import UserError
from superneurons.layers.base import NEEDS_BOTTOM, Layer, Shape, canonical_axis, count, register
from superneurons.layers.softmax import axis_split
from superneurons.proto import superneurons_pb2 as pb


def loss_normalization(lp: pb.LossParameter) -> str:
    """The normalization mode's name; an explicit `normalization` wins over the legacy `normalize` flag."""
    if not lp.HasField("normalization") and lp.HasField("normalize"):
        return "VALID" if lp.normalize else "BATCH_SIZE"
    return pb.LossParameter.NormalizationMode.Name(lp.normalization)


def check_label_count(layer: Layer, label_shape: Shape, dims: tuple[int, int, int], axis: int) -> None:
    outer, channels, inner = dims
    if count(label_shape) != outer * inner:
        raise layer.fail(
            f"label blob {layer.param.bottom[1]!r} has {count(label_shape)} values, but the scores have "
            f"{outer * inner} positions ({outer} before axis {axis} x {inner} after it), each needing one label "
            f"in 0..{channels - 1}")


def run_label_op(layer: Layer, op: Callable, *args, **kwargs) -> Any:
    """Run a backend op that reads labels; a label outside the classes (UserError from the op) names this layer.
    Returns what the op returns."""
    try:
        return op(*args, **kwargs)
    except UserError as e:
        raise layer.fail(f"{e} in label blob {layer.param.bottom[1]!r}") from None


class _LabelVerdict:
    """The GPU's verdict on a forward's labels, deferred: calling it raises the error naming `layer` if a label
    was outside the classes. `rearm`: a CUDA graph replayed that forward, so wait for the verdict queued again
    (runtime/graph_replay.py)."""

    __slots__ = ("layer", "check")

    def __init__(self, layer: Layer, check: Any):
        self.layer, self.check = layer, check

    def __call__(self) -> None:
        run_label_op(self.layer, self.check)

    def rearm(self) -> None:
        self.check.rearm()


@register("SoftmaxWithLoss")
class SoftmaxWithLoss(Layer):
    is_loss = True
    label_bottoms = (1,)
    n_bottoms = (2, 2)
    n_tops = (1, 2)

    def setup(self, bottom_shapes):
        scores, labels = bottom_shapes
        axis = canonical_axis(self.param.softmax_param.axis, len(scores), self)
        self.dims = axis_split(scores, axis)
        check_label_count(self, labels, self.dims, axis)
        self.label_dims = (self.dims[0], self.dims[2])
        lp = self.param.loss_param
        self.ignore_label = int(lp.ignore_label) if lp.HasField("ignore_label") else None
        self.normalization = loss_normalization(lp)
        self.prob = self.add_buffer("prob", scores)
        return [()] + ([scores] if len(self.param.top) > 1 else [])

    def backward_needs(self):
        # The label bottom (the probabilities are in our own buffer); the contract cannot name one bottom.
        return frozenset({NEEDS_BOTTOM})

    def scratch_entries(self):
        return need.loss_stats()

    def backward_reads_bottom(self, j):
        return j in self.label_bottoms  # the probabilities are its own buffer

    def forward(self, bottom, top):
        ops = self.ops
        prob = ops.reshape(self.prob.array, self.dims)
        ops.softmax_forward(ops.reshape(bottom[0], self.dims), prob)
        check = run_label_op(self, ops.softmax_loss_forward, prob, ops.reshape(bottom[1], self.label_dims), top[0],
                             self.ignore_label, self.normalization, scratch=self.ctx.scratch)
        if check is not None:  # the GPU's verdict on the labels arrives later: the Net asks for it with the loss
            self.ctx.defer(_LabelVerdict(self, check))
        if len(top) > 1:
            ops.copy(self.prob.array, top[1])

    def backward(self, top, top_diff, propagate_down, bottom, bottom_diff):
        if propagate_down[0]:
            ops = self.ops
            # top_diff[0] holds the loss weight (the Net fills it); the op scales by it / normalizer.
            run_label_op(self, ops.softmax_loss_backward, ops.reshape(self.prob.array, self.dims),
                         ops.reshape(bottom[1], self.label_dims), top_diff[0],
                         ops.reshape(bottom_diff[0], self.dims), self.ignore_label, self.normalization,
                         scratch=self.ctx.scratch)
