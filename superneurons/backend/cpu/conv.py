"""2-D convolution as im2col + one matrix product per group.

The column matrix of a chunk of images is laid out (C * kh * kw, n * OH * OW): rows are grouped
by input channel, so group g's rows are one contiguous block and each group is a single large
GEMM (weights (M/g, C/g*kh*kw) times columns), which is what BLAS is fast at. The batch is cut
into chunks so the column matrix stays near `_COL_ELEMENTS` elements: AlexNet's conv1 at batch
256 would otherwise need a 1 GB scratch matrix.

The scratch (padded input, columns) is temporary host memory, like NumPy's own temporaries; on the
GPU the equivalent is cuDNN's workspace, which the runtime sizes explicitly.

`conv_relu_forward` is a convolution fused with the ReLU in place on its top (graph/fuse.py). It repeats the
unfused layers' operations in their order (bias add, then ReLU), so a fused net trains bit-identically to an
unfused one; the CUDA twin saves a pass. The ReLU's gradient stays in the ReLU's step (layers/convolution.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from superneurons.backend import scratch as need
from superneurons.backend.cpu.activation import relu_forward
from superneurons.backend.geometry import ConvGeometry

__all__ = ["conv_forward", "conv_backward", "conv_algorithm", "conv_relu_forward", "im2col_forward", "im2col_backward"]

_COL_ELEMENTS = 1 << 23  # 32 MiB of float32 columns per chunk


def conv_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray, geom: ConvGeometry,
                 workspace: Any = None) -> None:
    """y = conv(x, w) + b; x (N, C, H, W), w (M, C/group, kh, kw), b (M,) or None, y (N, M, OH, OW).
    `workspace`: where the GPU's convolutions borrow workspace (the run's); NumPy's need none."""
    G = geom.group
    M = w.shape[0]
    wg = w.reshape(G, M // G, -1)
    for lo, hi in _chunks(x, y, geom):
        col = _im2col(x[lo:hi], y.shape[2:], geom)  # (G, Kg, n * P)
        out = np.matmul(wg, col)  # (G, M/G, n * P)
        # Back from (channel, image, pixel) to NCHW.
        y[lo:hi] = out.reshape(M, hi - lo, *y.shape[2:]).transpose(1, 0, 2, 3)
    if b is not None:
        y += b.reshape(1, M, 1, 1)


def conv_backward(x: np.ndarray, w: np.ndarray, dy: np.ndarray, dx: np.ndarray | None, dw: np.ndarray | None,
                  db: np.ndarray | None, geom: ConvGeometry, accumulate_dx: bool = False,
                  overwrite_dw: bool = False, workspace: Any = None, scratch: Any = None) -> None:
    """dx = conv^T(dy, w) (overwritten, or added to dx with `accumulate_dx`); dw += corr(x, dy) (dw = it with
    `overwrite_dw`); db += sum of dy per output channel. None skips one."""
    need.check(scratch, need.row_sums(w.shape[0]) if db is not None else 0, "conv_backward")
    if overwrite_dw and dw is not None:
        dw.fill(0)  # then the chunks add up exactly as they do into a cleared dw
    G = geom.group
    M = w.shape[0]
    wg = w.reshape(G, M // G, -1)
    if db is not None:
        db += dy.sum(axis=(0, 2, 3))
    for lo, hi in _chunks(x, dy, geom):
        # dy as (G, M/G, n * P): the same layout the forward product produced.
        dyg = dy[lo:hi].transpose(1, 0, 2, 3).reshape(G, M // G, -1)
        if dw is not None:
            col = _im2col(x[lo:hi], dy.shape[2:], geom)
            dw += np.matmul(dyg, col.transpose(0, 2, 1)).reshape(dw.shape)
        if dx is not None:
            dcol = np.matmul(wg.transpose(0, 2, 1), dyg)  # (G, Kg, n * P)
            if accumulate_dx:
                # The chunk's gradient on its own, then one add: the sum is then exactly what summing two
                # separately computed gradients gives, so aliasing changes no bit.
                part = np.empty_like(dx[lo:hi])
                _col2im(dcol, part, dy.shape[2:], geom)
                dx[lo:hi] += part
            else:
                _col2im(dcol, dx[lo:hi], dy.shape[2:], geom)


def conv_relu_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, y: np.ndarray, geom: ConvGeometry,
                      slope: float, workspace: Any = None) -> None:
    """y = relu(conv(x, w) + b) with Caffe's leaky ReLU (slope >= 0)."""
    conv_forward(x, w, b, y, geom)
    relu_forward(y, y, slope)


def im2col_forward(x: np.ndarray, col: np.ndarray, geom: ConvGeometry) -> None:
    """col (N, C * kh * kw, OH, OW) = the column buffer of x (N, C, H, W): entry [n, (c * kh + i) * kw + j, oh, ow]
    is the pixel kernel tap (i, j) of output (oh, ow) reads in channel c, 0 in the padding (Caffe's Im2col)."""
    n, _, oh, ow = col.shape
    taps = _taps(_padded(x, geom.pad), (oh, ow), geom)  # (C, kh, kw, N, OH, OW)
    col[...] = taps.transpose(3, 0, 1, 2, 4, 5).reshape(col.shape)


def im2col_backward(dcol: np.ndarray, dx: np.ndarray, geom: ConvGeometry) -> None:
    """dx = the adjoint of im2col_forward (overwritten): every column entry added back to the pixel it read."""
    n, _, oh, ow = dcol.shape
    _col2im(np.ascontiguousarray(dcol.transpose(1, 0, 2, 3)), dx, (oh, ow), geom)


def _chunks(x: np.ndarray, y: np.ndarray, geom: ConvGeometry):
    """(lo, hi) image ranges whose column matrix holds about _COL_ELEMENTS elements (at least one image)."""
    N, C = x.shape[:2]
    per_image = C * geom.kernel[0] * geom.kernel[1] * y.shape[2] * y.shape[3]
    step = max(1, _COL_ELEMENTS // max(per_image, 1))
    for lo in range(0, N, step):
        yield lo, min(N, lo + step)


def _padded(x: np.ndarray, pad: tuple[int, int]) -> np.ndarray:
    ph, pw = pad
    if ph == 0 and pw == 0:
        return x
    n, c, h, w = x.shape
    xp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), x.dtype)
    xp[:, :, ph:ph + h, pw:pw + w] = x
    return xp


def _taps(xp: np.ndarray, out_hw, geom: ConvGeometry) -> np.ndarray:
    """A (C, kh, kw, n, OH, OW) strided view of the padded input: element [c, i, j, n, oh, ow] is the
    pixel that kernel tap (i, j) of output (oh, ow) reads. No copy; read-only unless the source is written."""
    sn, sc, sh, sw = xp.strides
    (kh, kw), (th, tw), (dh, dw) = geom.kernel, geom.stride, geom.dilation
    n, c = xp.shape[:2]
    return as_strided(xp, shape=(c, kh, kw, n, out_hw[0], out_hw[1]),
                      strides=(sc, dh * sh, dw * sw, sn, th * sh, tw * sw), writeable=False)


def _im2col(x: np.ndarray, out_hw, geom: ConvGeometry) -> np.ndarray:
    taps = _taps(_padded(x, geom.pad), out_hw, geom)
    col = np.ascontiguousarray(taps)
    return col.reshape(geom.group, -1, col.shape[3] * out_hw[0] * out_hw[1])


def _col2im(dcol: np.ndarray, dx: np.ndarray, out_hw, geom: ConvGeometry) -> None:
    """dx = the adjoint of im2col: every column entry is added back to the pixel it was read from."""
    n, c, h, w = dx.shape
    (kh, kw), (th, tw), (dh, dw), (ph, pw) = geom.kernel, geom.stride, geom.dilation, geom.pad
    oh, ow = out_hw
    taps = dcol.reshape(c, kh, kw, n, oh, ow)
    if ph == 0 and pw == 0:
        dx.fill(0)
        acc = dx
    else:
        acc = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dx.dtype)
    # One strided add per kernel tap: within a tap the pixels are distinct, across taps they may repeat.
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + th * (oh - 1) + 1, th)
            cols = slice(j * dw, j * dw + tw * (ow - 1) + 1, tw)
            acc[:, :, rows, cols] += taps[:, i, j].transpose(1, 0, 2, 3)
    if acc is not dx:
        dx[...] = acc[:, :, ph:ph + h, pw:pw + w]


def conv_algorithm(x_shape, w_shape, y_shape, geom: ConvGeometry, dtype) -> str:
    """How this backend computes the convolution, for the profiler (one method on the CPU)."""
    return "im2col+gemm"
