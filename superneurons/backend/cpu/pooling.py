"""2-D max / average / stochastic(TEST) pooling over NCHW arrays, with Caffe's window rules.

Window (oh, ow) covers rows [oh*sh - ph, oh*sh - ph + kh) of the input, clipped to the input for
max pooling. Average pooling divides by the window clipped to the *padded* input (so padding
counts, but the ceil-mode overhang past the padding does not), as Caffe does. Every op loops over
the kh*kw kernel taps and does one vectorized step per tap, so a tap is a strided view of a padded
copy of the input that is large enough for every window, overhang included.

The max mask holds, per output, the flat index h * W + w of the chosen input pixel in its plane
(Caffe's layout); on ties the first pixel in row-major window order wins, as in Caffe.
"""
from __future__ import annotations

import numpy as np

from superneurons.backend.geometry import PoolGeometry

__all__ = ["pool_forward", "pool_backward"]


def pool_forward(x: np.ndarray, y: np.ndarray, mask: np.ndarray | None, geom: PoolGeometry,
                 top_mask: np.ndarray | None = None) -> None:
    """y = pool(x). For "max", `mask` (int32, shape of y) receives the argmax and `top_mask`, if given,
    the same indices as floats (Caffe's optional second top)."""
    if geom.method == "max":
        _max_forward(x, y, mask, geom)
        if top_mask is not None:
            np.copyto(top_mask, mask, casting="unsafe")
    elif geom.method == "ave":
        xp = _padded(x, y.shape, geom, 0.0)
        y.fill(0)
        for tap in _taps(xp, y.shape, geom):
            y += tap
        y /= _ave_divisor(x.shape, y.shape, geom).astype(y.dtype)
    elif geom.method == "stochastic":
        _stochastic_test_forward(x, y, geom)
    else:
        raise ValueError(f"unknown pooling method {geom.method!r}")


def pool_backward(dy: np.ndarray, mask: np.ndarray | None, dx: np.ndarray, geom: PoolGeometry) -> None:
    """dx = the gradient of pool_forward (overwritten); "max" routes each dy to its mask pixel."""
    n, c, h, w = dx.shape
    if geom.method == "max":
        # Overlapping windows may pick the same pixel: a histogram adds all their gradients.
        plane = (np.arange(n * c, dtype=np.int64) * (h * w)).reshape(n, c, 1, 1)
        acc = np.bincount((mask + plane).ravel(), weights=dy.ravel(), minlength=dx.size)
        np.copyto(dx, acc.reshape(dx.shape), casting="same_kind")
    elif geom.method == "ave":
        acc = np.zeros(_padded_shape(dx.shape, dy.shape, geom), dx.dtype)
        share = dy / _ave_divisor(dx.shape, dy.shape, geom).astype(dy.dtype)
        for tap in _taps(acc, dy.shape, geom):
            tap += share
        ph, pw = geom.pad
        dx[...] = acc[:, :, ph:ph + h, pw:pw + w]
    else:
        raise ValueError(f"pooling method {geom.method!r} has no backward")


def _max_forward(x: np.ndarray, y: np.ndarray, mask: np.ndarray, geom: PoolGeometry) -> None:
    w = x.shape[3]
    # Padding never wins: -inf is not greater than anything, including the -inf y starts from.
    xp = _padded(x, y.shape, geom, -np.inf)
    y.fill(-np.inf)
    mask.fill(-1)
    oh, ow = y.shape[2:]
    (th, tw), (ph, pw) = geom.stride, geom.pad
    corner = ((np.arange(oh) * th - ph)[:, None] * w + (np.arange(ow) * tw - pw)[None, :]).astype(np.int32)
    kw = geom.kernel[1]
    for t, tap in enumerate(_taps(xp, y.shape, geom)):
        better = tap > y
        np.copyto(y, tap, where=better)
        i, j = divmod(t, kw)
        np.copyto(mask, corner + np.int32(i * w + j), where=better)


def _stochastic_test_forward(x: np.ndarray, y: np.ndarray, geom: PoolGeometry) -> None:
    """Caffe's TEST-time stochastic pooling: the activation-weighted mean sum(x^2) / sum(x) of each window."""
    xp = _padded(x, y.shape, geom, 0.0)
    total = np.full(y.shape, np.finfo(y.dtype).tiny, y.dtype)  # Caffe starts the sum at FLT_MIN
    y.fill(0)
    for tap in _taps(xp, y.shape, geom):
        total += tap
        y += tap * tap
    y /= total


def _padded_shape(x_shape, y_shape, geom: PoolGeometry) -> tuple[int, int, int, int]:
    """Padded input big enough for the last window, which ceil rounding may push past the padding."""
    n, c, h, w = x_shape
    (kh, kw), (th, tw), (ph, pw) = geom.kernel, geom.stride, geom.pad
    oh, ow = y_shape[2:]
    return n, c, max(h + 2 * ph, (oh - 1) * th + kh), max(w + 2 * pw, (ow - 1) * tw + kw)


def _padded(x: np.ndarray, y_shape, geom: PoolGeometry, fill: float) -> np.ndarray:
    ph, pw = geom.pad
    xp = np.full(_padded_shape(x.shape, y_shape, geom), fill, x.dtype)
    xp[:, :, ph:ph + x.shape[2], pw:pw + x.shape[3]] = x
    return xp


def _taps(xp: np.ndarray, y_shape, geom: PoolGeometry):
    """For each kernel tap (i, j) in row-major order, the (n, c, OH, OW) view of the pixels it reads."""
    (kh, kw), (th, tw) = geom.kernel, geom.stride
    oh, ow = y_shape[2:]
    for i in range(kh):
        for j in range(kw):
            yield xp[:, :, i:i + th * (oh - 1) + 1:th, j:j + tw * (ow - 1) + 1:tw]


def _ave_divisor(x_shape, y_shape, geom: PoolGeometry) -> np.ndarray:
    """(OH, OW) window sizes: each window clipped at the far edge of the padded input (not at the image)."""
    sizes = []
    for n_in, n_out, k, s, p in zip(x_shape[2:], y_shape[2:], geom.kernel, geom.stride, geom.pad):
        start = np.arange(n_out) * s - p
        sizes.append(np.minimum(start + k, n_in + p) - start)
    return (sizes[0][:, None] * sizes[1][None, :]).astype(np.float64)
