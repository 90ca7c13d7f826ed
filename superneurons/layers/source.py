"""The base of the layers that make a net's inputs from nothing below them (a database, HDF5 files, the
caller's arrays, fillers): no bottoms and no backward pass."""
from __future__ import annotations

from superneurons.layers.base import Layer


class SourceLayer(Layer):
    is_data = True
    has_backward = False
    n_bottoms = (0, 0)
