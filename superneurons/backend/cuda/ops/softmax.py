"""Softmax over axis 1 of an (outer, channels, inner...) view: cuDNN, mode CHANNEL, accurate algorithm."""
from __future__ import annotations

from math import prod

from superneurons.backend.cuda.device import current
from superneurons.backend.cuda.half_math import require_one_type

__all__ = ["softmax_forward", "softmax_backward"]


def _dims(a) -> tuple[int, int, int]:
    return a.shape[0], a.shape[1], prod(a.shape[2:])


def softmax_forward(x, y) -> None:
    require_one_type(x, y)
    current().cudnn.softmax_forward(x, y, _dims(x))


def softmax_backward(y, dy, dx) -> None:
    require_one_type(y, dy, dx)
    current().cudnn.softmax_backward(y, dy, dx, _dims(y))
