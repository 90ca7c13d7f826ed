"""Max / average / stochastic(TEST) pooling with Caffe's windows and argmax mask, as numba kernels
(cuDNN pooling has no argmax output, and Caffe's ceil-mode windows and divisors are exact here)."""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import pooling as pk
from superneurons.backend.cuda.ops.basic import copy
from superneurons.backend.geometry import PoolGeometry, check_signed_mask

__all__ = ["pool_forward", "pool_backward"]


def _dims(x_shape, y_shape, geom: PoolGeometry) -> tuple[int, ...]:
    return (x_shape[2], x_shape[3], y_shape[2], y_shape[3], *geom.kernel, *geom.stride, *geom.pad)


def tiles(x_shape, y_shape, geom: PoolGeometry) -> bool:
    """Whether the windows tile the planes exactly (kernels/pooling.py: max_backward_tiles)."""
    return (geom.kernel == geom.stride and geom.pad == (0, 0) and x_shape[2] == y_shape[2] * geom.kernel[0]
            and x_shape[3] == y_shape[3] * geom.kernel[1])


def pool_forward(x, y, mask, geom: PoolGeometry, top_mask=None, signed_mask: bool = False) -> None:
    """`signed_mask`: see backend/cpu/pooling.py."""
    dims = _dims(x.shape, y.shape, geom)
    if geom.method == "max":
        check_signed_mask(signed_mask, top_mask)
        planes = y.shape[0] * y.shape[1]
        K.launch(pk.max_forward_columns, planes * y.shape[3])(flat(x), flat(y), flat(mask), planes, *dims,
                                                              signed_mask)
        if top_mask is not None:
            copy(mask, top_mask)
    elif geom.method in ("ave", "stochastic"):
        planes = y.shape[0] * y.shape[1]
        K.launch(pk.ave_forward_columns, planes * y.shape[3])(flat(x), flat(y), planes, *dims,
                                                              geom.method == "stochastic")
    else:
        raise ValueError(f"unknown pooling method {geom.method!r}")


def pool_backward(dy, mask, dx, geom: PoolGeometry, relu_slope: float | None = None) -> None:
    """`relu_slope`: see backend/cpu/pooling.py (max only)."""
    dims = _dims(dx.shape, dy.shape, geom)
    if geom.method == "max":
        relu = (relu_slope is not None, scalar(dx, relu_slope or 0.0))
        if tiles(dx.shape, dy.shape, geom):
            K.launch(pk.max_backward_tiles, dy.size)(flat(dy), flat(mask), flat(dx), *dims[:6], *relu)
            return
        planes = dx.shape[0] * dx.shape[1]
        K.launch(pk.max_backward_columns, planes * dx.shape[3])(flat(dy), flat(mask), flat(dx), planes, *dims, *relu)
    elif geom.method == "ave":
        planes = dx.shape[0] * dx.shape[1]
        K.launch(pk.ave_backward_columns, planes * dx.shape[3])(flat(dy), flat(dx), planes, *dims)
    else:
        raise ValueError(f"pooling method {geom.method!r} has no backward")
