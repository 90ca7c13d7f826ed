"""2-D convolution through cuDNN (grouped, dilated); algorithms chosen once per shape (see cudnn.py)."""
from __future__ import annotations

from superneurons.backend.cuda.device import current
from superneurons.backend.geometry import ConvGeometry

__all__ = ["conv_forward", "conv_backward"]


def _plan(x, w, y, geom: ConvGeometry):
    return current().cudnn.conv_plan(x.shape, w.shape, y.shape, geom, x.dtype)


def conv_forward(x, w, b, y, geom: ConvGeometry) -> None:
    """y = conv(x, w) + b."""
    plan = _plan(x, w, y, geom)
    plan.forward(x, w, y)
    if b is not None:
        plan.add_bias(b, y)


def conv_backward(x, w, dy, dx, dw, db, geom: ConvGeometry) -> None:
    """dx = conv^T(dy, w) (overwritten); dw += corr(x, dy); db += per-channel sum of dy. None skips one."""
    plan = _plan(x, w, dy, geom)
    if db is not None:
        plan.backward_bias(dy, db)
    if dw is not None:
        plan.backward_filter(x, dy, dw)
    if dx is not None:
        plan.backward_data(w, dy, dx)
