"""2-D convolution through cuDNN (grouped, dilated); plans and algorithms chosen once per shape (see cudnn.py).

Fused with the ReLU in place on its top (graph/fuse.py, `conv_relu_forward`), the bias add and the ReLU are one
pass after cuDNN's convolution (kernels/conv_relu.py) instead of cuDNN's bias add and the ReLU's pass. The
ReLU's gradient stays in the ReLU's own step (layers/convolution.py says why).
"""
from __future__ import annotations

from superneurons import settings
from superneurons.backend.cuda import channels_last_ops, cudnn, kernels as K
from superneurons.backend.cuda.kernels import conv_relu as ck, im2col as ik, reduce as rk
from superneurons.backend.cuda.ops import activation, basic
from superneurons.backend.cuda.device import current, flat, scalar
from superneurons.backend.cuda.half_math import require_one_type
from superneurons.backend.cuda.layout import NHWC, layout_of
from superneurons.backend.geometry import ConvGeometry
from superneurons.dtypes import FLOAT32

__all__ = ["conv_forward", "conv_backward", "conv_algorithm", "conv_relu_forward", "im2col_forward", "im2col_backward"]


def _nhwc(*arrays) -> bool:
    """Whether the operands are stored channels last (layout.py hands a convolution one layout: arrays whose
    layouts coincide in memory, 1x1 filters among them, go with the rest)."""
    return any(layout_of(a) == NHWC for a in arrays if a is not None)


def _plan(x, w, y, geom: ConvGeometry, nhwc: bool = False):
    if nhwc:
        return current().cudnn.conv_plan(x.shape, w.shape, y.shape, geom, x.dtype, nhwc=True)
    return current().cudnn.conv_plan(x.shape, w.shape, y.shape, geom, x.dtype)


def conv_forward(x, w, b, y, geom: ConvGeometry, workspace=None) -> None:
    """y = conv(x, w) + b. `workspace`: the WorkspaceSource cuDNN borrows from (the run's: RunContext.workspace;
    None: the device's own)."""
    require_one_type(x, w, y)
    nhwc = _nhwc(x, w, y)
    plan = _plan(x, w, y, geom, nhwc)
    with current().workspace_from(workspace):
        plan.forward(x, w, y)
    if b is not None:
        if nhwc:  # channel = element % C: the per-channel kernel over (N*H*W, C, 1)
            n, m, oh, ow = y.shape
            basic.add_bias(y, b, n * oh * ow, m, 1)
        elif b.dtype == y.dtype == FLOAT32:
            plan.add_bias(b, y)
        else:  # half storage: our kernel adds in float32 and rounds once (cuDNN has no bfloat16 bias ops)
            n, m, oh, ow = y.shape
            basic.add_bias(y, b, n, m, oh * ow)


def conv_backward(x, w, dy, dx, dw, db, geom: ConvGeometry, accumulate_dx: bool = False,
                  overwrite_dw: bool = False, workspace=None, scratch=None) -> None:
    """dx = conv^T(dy, w) (overwritten; added to dx with `accumulate_dx`); dw += corr(x, dy) (dw = it with
    `overwrite_dw`, for a dw that holds zeros); db += per-channel sum of dy (our sum's partials in `scratch`, the
    run's float64 region). None skips one."""
    require_one_type(x, w, dy, dx, dw)
    nhwc = _nhwc(x, w, dy, dx, dw)
    plan = _plan(x, w, dy, geom, nhwc)
    if db is not None:
        n, m, oh, ow = dy.shape
        if nhwc:
            channels_last_ops.bias_backward(dy, db, n, m, oh * ow, scratch)
        elif own_bias_sum(m, oh * ow) or dy.dtype != FLOAT32 or db.dtype != FLOAT32:
            basic.bias_backward(dy, db, n, m, oh * ow, scratch)
        else:
            plan.backward_bias(dy, db)
    with current().workspace_from(workspace):
        if dw is not None:
            plan.backward_filter(x, dy, dw, accumulate=not overwrite_dw)
        if dx is not None:
            plan.backward_data(w, dy, dx, accumulate_dx)


def conv_relu_forward(x, w, b, y, geom: ConvGeometry, slope: float, workspace=None) -> None:
    """y = relu(conv(x, w) + b) (Caffe's leaky ReLU, slope >= 0)."""
    require_one_type(x, w, y)
    nhwc = _nhwc(x, w, y)
    with current().workspace_from(workspace):
        _plan(x, w, y, geom, nhwc).forward(x, w, y)
    if b is not None:
        n, m, oh, ow = y.shape
        if nhwc:
            channels_last_ops.bias_relu(y, b, n, m, oh * ow, slope)
        else:
            bias_relu(y, b, n, m, oh * ow, slope)
    else:
        activation.relu_forward(y, y, slope)


def _window(geom: ConvGeometry):
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = geom.kernel, geom.stride, geom.pad, geom.dilation
    return kh, kw, sh, sw, ph, pw, dh, dw


def im2col_forward(x, col, geom: ConvGeometry) -> None:
    """col (N, C * kh * kw, OH, OW) = the column buffer of x (N, C, H, W) (Caffe's Im2col), one thread per entry."""
    if col.size:
        _n, c, h, w = x.shape
        K.launch(ik.im2col, col.size)(flat(x), flat(col), c, h, w, col.shape[2], col.shape[3], *_window(geom))


def im2col_backward(dcol, dx, geom: ConvGeometry) -> None:
    """dx = the adjoint of im2col_forward (overwritten); one thread per pixel sums the entries that read it."""
    if dx.size:
        _n, c, h, w = dx.shape
        K.launch(ik.col2im, dx.size)(flat(dcol), flat(dx), c, h, w, dcol.shape[2], dcol.shape[3], *_window(geom))


# The pass of the fused forward over y viewed as (outer, dim, inner) = (N, C, H*W) (not an op of its own: no
# `__all__` entry). A block takes MIN_BLOCK_ELEMENTS elements at least where the planes allow, as the fused
# BatchNorm's passes do (SUPERNEURONS_BN_MIN_BLOCK's measurement: on 7x7 and 14x14 planes, thousands of blocks
# of one or two elements per thread spent their time starting up).
MIN_BLOCK_ELEMENTS = 8192


def bias_relu(y, b, outer: int, dim: int, inner: int, slope: float) -> None:
    """y = relu(y + b[c]) in place."""
    if not y.size:
        return
    chunk, blocks = rk.chunking(outer, dim, inner, MIN_BLOCK_ELEMENTS)
    kernel = ck.bias_relu_rows if inner >= ck.ROWS_MIN else ck.bias_relu
    K.launch(kernel, 0, blocks=blocks)(flat(y), flat(b), outer, dim, inner, chunk, scalar(y, slope))


# tools/bench/conv_bias.py, batch 64 on an H100 (ms): cudnnConvolutionBackwardBias is slow on large planes,
# 2.89 on 96 x 111x111 against the per-channel sum kernel's 0.22, 0.73 vs 0.11 on 128 x 55x55, 0.20 vs 0.08
# on 256 x 27x27, but ahead on small planes of many channels: 0.076 vs 0.119 on 512 x 28x28, 0.024 vs 0.057
# on 512 x 14x14, 0.087 vs 0.103 on 1000 x 15x15 (SqueezeNet spent 10.3 ms of a 28 ms step in it, VGG16 7.3).
OWN_BIAS_SUM_PLANE = 2500  # pixels per channel from which our kernel sums every bias gradient
OWN_BIAS_SUM_SMALL_PLANE, OWN_BIAS_SUM_SMALL_CHANNELS = 700, 256  # and on planes this large, up to this many


def own_bias_sum(channels: int, plane: int) -> bool:
    """Whether a convolution's bias gradient over `channels` planes of `plane` pixels runs our per-channel
    sum (True) or cuDNN's (SUPERNEURONS_CONV_BIAS_SUM chooses; `auto` by the measurements above)."""
    choice = settings.get("SUPERNEURONS_CONV_BIAS_SUM")
    if choice != "auto":
        return choice == "own"
    return plane >= OWN_BIAS_SUM_PLANE or (plane >= OWN_BIAS_SUM_SMALL_PLANE and channels <= OWN_BIAS_SUM_SMALL_CHANNELS)


_FWD = ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct", "fft", "fft_tiling", "winograd",
        "winograd_nonfused")
_BWD_DATA = ("algo0", "algo1", "fft", "fft_tiling", "winograd", "winograd_nonfused")
_BWD_FILTER = ("algo0", "algo1", "fft", "algo3", "winograd", "winograd_nonfused", "fft_tiling")


def conv_algorithm(x_shape, w_shape, y_shape, geom: ConvGeometry, dtype) -> str:
    """The cuDNN algorithms (and workspace) this shape ran at its last call in each direction, for the
    profiler; '-' for a direction not run yet, '~' after a name that was ranked by heuristics, not measured;
    `engN` is engine N of cuDNN's graph API; `nhwc ` first where the shape ran channels last."""
    h = current().cudnn
    plan = h.existing_conv_plan(x_shape, w_shape, y_shape, geom) or h.conv_plan(
        tuple(x_shape), tuple(w_shape), tuple(y_shape), geom, dtype)
    nhwc = plan.nhwc

    def name(table, direction):
        choice = plan.last[direction]
        if choice is None:
            return "-"
        engine = getattr(choice, "engine", None)
        if engine is not None:
            label = f"eng{engine}"
        else:
            label = table[choice.algo] if 0 <= choice.algo < len(table) else str(choice.algo)
        if not plan.tables[direction].measured:
            label += "~"
        return label + (f"({choice.workspace >> 20}M)" if choice.workspace >= 1 << 20 else "")

    def first_run(table, *directions: tuple[int, str]) -> str:
        """The first of (direction, mark) that has run, labelled and marked, else '-'."""
        for direction, mark in directions:
            if plan.last[direction] is not None:
                return name(table, direction) + mark
        return "-"

    # Backward data: its overwriting run, else its adding one ('+': into a split blob's summed gradient).
    # Backward filter: its overwriting run ('=': into a dw just cleared, what training runs), else adding.
    data = first_run(_BWD_DATA, (cudnn.BACKWARD_DATA, ""), (cudnn.BACKWARD_DATA_ADD, "+"))
    filt = first_run(_BWD_FILTER, (cudnn.BACKWARD_FILTER_SET, "="), (cudnn.BACKWARD_FILTER, ""))
    return f"{'nhwc ' if nhwc else ''}f:{name(_FWD, cudnn.FORWARD)} d:{data} w:{filt}"
