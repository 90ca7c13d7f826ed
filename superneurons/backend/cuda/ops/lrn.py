"""Local response normalization (across or within channels) as numba kernels; see backend/cpu/lrn.py."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import lrn as lk
from superneurons.backend.geometry import LRNGeometry

__all__ = ["lrn_forward", "lrn_backward"]


def lrn_forward(x, y, scale, geom: LRNGeometry) -> None:
    n, c, h, w = x.shape
    if geom.across:
        K.launch(lk.across_forward, n * h * w)(flat(x), flat(y), flat(scale), n, c, h * w, geom.size,
                                               scalar(y, geom.shift), scalar(y, geom.coeff), scalar(y, geom.beta))
        return
    K.launch(lk.forward, y.size)(flat(x), flat(y), flat(scale), c, h, w, geom.size, geom.across,
                                 scalar(y, geom.shift), scalar(y, geom.coeff), scalar(y, geom.beta))


def lrn_backward(x, y, scale, dy, dx, geom: LRNGeometry) -> None:
    n, c, h, w = x.shape
    if geom.across:
        K.launch(lk.across_backward, n * h * w)(flat(x), flat(y), flat(scale), flat(dy), flat(dx), n, c, h * w,
                                                geom.size, scalar(dx, geom.coeff), scalar(dx, geom.beta))
        return
    K.launch(lk.backward, dx.size)(flat(x), flat(y), flat(scale), flat(dy), flat(dx), c, h, w, geom.size,
                                   geom.across, scalar(dx, geom.coeff), scalar(dx, geom.beta))
