"""Filter (Caffe's layer) is recognized and refused: its tops' batch size is the number of nonzero selector
values, which changes from batch to batch, and the runtime plans every tensor's memory from shapes fixed when
the net is built (Caffe reshapes the tops at each forward). A prototxt naming it gets one line saying so."""
from __future__ import annotations

from superneurons.layers.base import Layer, register


@register("Filter")
class Filter(Layer):
    n_bottoms = (2, None)
    n_tops = (1, None)

    def setup(self, bottom_shapes):
        raise self.fail("is not supported: its tops hold as many items as the selector (the last bottom) has "
                        "nonzero values in each batch, and SuperNeurons plans memory from shapes fixed when the "
                        "net is built; to leave samples out of a loss use loss_param.ignore_label or a weight")
