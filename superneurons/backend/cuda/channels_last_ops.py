"""The channels-last paths of the ops whose NCHW kernels index channels (layout.py runs them for NHWC arrays).

Each takes the op's own arguments. The layers pass (outer, dim, inner) = (N, C, H*W) views; for an NHWC array
that is (rows, C, 1) with rows = N*H*W, so the per-channel elementwise passes are the NCHW ops' kernels over
that view, and the per-channel sums are kernels/channels_last.py's (the NCHW ones would read one element per
row). Arguments of other shapes (a Scale over other axes) raise LayoutUnsupported before any work.
"""
from __future__ import annotations

from superneurons.backend.cuda import kernels as K
from superneurons.backend.cuda.device import flat, scalar
from superneurons.backend.cuda.kernels import batch_norm as bk, channels_last as lk, fused as fk
from superneurons.backend.cuda.layout import TRANSPOSABLE, LayoutUnsupported, convert, layout_of, transpose
from superneurons.backend.cuda.ops import basic, batch_norm, concat, pooling, scale
from superneurons.backend.cuda.ops._rows import take
from superneurons.backend.geometry import PoolGeometry, check_signed_mask
from superneurons.backend.scratch import row_sums

THREADS = 1 << 17  # threads bn_backward_sums aims for (each sums its channel over a run of rows)


def _rows(x, outer: int, dim: int, inner: int) -> int:
    """N*H*W for an NHWC `x` viewed as (N, C, H*W); else LayoutUnsupported."""
    shape = tuple(x.shape)
    if len(shape) != 4 or (outer, dim, inner) != (shape[0], shape[1], shape[2] * shape[3]):
        raise LayoutUnsupported(f"(outer, dim, inner) ({outer}, {dim}, {inner}) is no channel view of {shape}")
    return outer * inner


def _run(rows: int, dim: int) -> int:
    return max(8, -(-rows * dim // THREADS))


def _zeroed(n: int, scratch):
    """n float64 entries of the run's scratch region (backend/scratch.py), zeroed."""
    buf = take(scratch, n)
    basic.fill(buf, 0.0)
    return buf


def channel_sums(x, y, rows: int, dim: int, mode: int, scratch):
    """float64 sums[2 * dim] of kernels/channels_last.channel_sums over an NHWC (rows, dim) array, in the scratch
    region (row_sums(dim) entries)."""
    sums = _zeroed(row_sums(dim), scratch)
    fx = flat(x)
    K.launch(lk.channel_sums, 0, blocks=lk.tiled_blocks(rows, dim))(fx, flat(y) if y is not None else fx, sums,
                                                                    rows, dim, mode)
    return sums


# ---- copies, bias, Scale --------------------------------------------------------------------------
def copy(src, dst) -> None:
    """Across layouts (a weight master into its KRSC working copy and back): one conversion pass."""
    if layout_of(src) == layout_of(dst):
        basic.copy(src, dst)
    else:
        convert(src, dst)


def axpy(alpha: float, x, y) -> None:
    """y += alpha * x across layouts (a weight gradient left in its KRSC working copy, added into the KCRS
    master gradient): one pass."""
    if layout_of(x) == layout_of(y) or x.ndim != 4:
        basic.axpy(alpha, x, y)
    elif y.size and x.dtype in TRANSPOSABLE and y.dtype in TRANSPOSABLE:
        transpose(scalar(y, alpha), flat(x), flat(y), y.shape, layout_of(x) == "NHWC", lk.AXPY)
    elif y.size:
        _n, c, h, w = y.shape
        K.launch(lk.convert_axpy, y.size)(scalar(y, alpha), flat(x), flat(y), c, h * w, layout_of(x) == "NHWC",
                                          layout_of(y) == "NHWC")


def add_bias(y, b, outer: int, dim: int, inner: int) -> None:
    rows = _rows(y, outer, dim, inner)
    if y.size:
        K.launch(lk.bias_relu, 0, blocks=lk.blocks_for(rows, dim))(flat(y), flat(b), rows, dim, False, scalar(y, 0.0))


def bias_backward(dy, db, outer: int, dim: int, inner: int, scratch=None) -> None:
    """db += per-channel sum of dy."""
    rows = _rows(dy, outer, dim, inner)
    if dy.size:
        K.launch(lk.sums_finish, dim)(channel_sums(dy, None, rows, dim, lk.SUM, scratch), flat(db), True)


def bias_relu(y, b, n: int, m: int, plane: int, slope: float) -> None:
    """The fused Convolution + ReLU's pass, y = leaky(y + b[c]) (ops/conv.py)."""
    if y.size:
        rows = y.size // m
        K.launch(lk.bias_relu, 0, blocks=lk.blocks_for(rows, m))(flat(y), flat(b), rows, m, True, scalar(y, slope))


def channel_mul(x, s, y, outer: int, dim: int, inner: int) -> None:
    scale.channel_mul(x, s, y, _rows(x, outer, dim, inner), dim, 1)


def channel_mul_grad(x, dy, ds, outer: int, dim: int, inner: int, accumulate: bool, scratch=None) -> None:
    rows = _rows(x, outer, dim, inner)
    if x.size:
        K.launch(lk.sums_finish, dim)(channel_sums(x, dy, rows, dim, lk.DOT, scratch), flat(ds), bool(accumulate))
    elif not accumulate:
        basic.fill(ds, 0.0)


# ---- BatchNorm --------------------------------------------------------------------------------------
def bn_batch_stats(x, mean, var, outer: int, channels: int, inner: int, scratch=None) -> None:
    rows = _rows(x, outer, channels, inner)
    sums = channel_sums(x, None, rows, channels, lk.SUM_SQUARES, scratch)
    K.launch(bk.stats_finish, channels)(sums, flat(mean), flat(var), float(outer * inner))


def bn_normalize(x, mean, var, eps: float, inv_std, y, outer: int, channels: int, inner: int) -> None:
    batch_norm.bn_normalize(x, mean, var, eps, inv_std, y, _rows(x, outer, channels, inner), channels, 1)


def bn_backward(x, mean, inv_std, dy, dx, outer: int, channels: int, inner: int, scratch=None) -> None:
    batch_norm.bn_backward(x, mean, inv_std, dy, dx, _rows(x, outer, channels, inner), channels, 1, scratch)


def bn_affine_forward(x, y, x_hat, mean, var, inv_std, gamma, beta, mean_sum, var_sum, scale_factor, outer: int,
                      channels: int, inner: int, eps: float, use_global_stats: bool, update_running: bool,
                      moving_average_fraction: float, var_correction: float, relu_slope: float | None,
                      scratch=None) -> None:
    rows = _rows(x, outer, channels, inner)
    if not y.size:
        return
    mode = fk.GLOBAL if use_global_stats else fk.BATCH_UPDATE if update_running else fk.BATCH
    stats = (flat(mean_sum), flat(var_sum), flat(scale_factor), flat(mean), flat(var), flat(inv_std))
    constants = (float(outer * inner), float(eps), float(moving_average_fraction), float(var_correction), mode)
    sums = flat(mean_sum) if use_global_stats else channel_sums(x, None, rows, channels, lk.SUM_SQUARES, scratch)
    K.launch(fk.channel_stats, channels)(sums, *stats, *constants)
    fy = flat(y)
    fh = flat(x_hat) if x_hat is not None else fy
    K.launch(lk.bn_forward_apply, 0, blocks=lk.blocks_for(rows, channels))(
        flat(x), flat(mean), flat(inv_std), flat(gamma), flat(beta), fh, fy, rows, channels, x_hat is not None,
        relu_slope is not None, scalar(y, relu_slope or 0.0))


def bn_affine_backward(kept, mean, inv_std, gamma, beta, dy, dx, dgamma, dbeta, outer: int, channels: int,
                       inner: int, use_global_stats: bool, relu_slope: float | None, scratch=None) -> None:
    """`kept`: x_hat (`mean` None) or the forward's input x (backend/cpu/fused.py)."""
    rows = _rows(dy, outer, channels, inner)
    if not dy.size:
        return
    relu, slope = relu_slope is not None, scalar(dy, relu_slope or 0.0)
    fkept, fdy, finv = flat(kept), flat(dy), flat(inv_std)
    from_x = mean is not None
    fmean = flat(mean) if from_x else finv  # the placeholder mean is never read
    sums = _zeroed(row_sums(channels), scratch)
    run = _run(rows, channels)
    K.launch(lk.bn_backward_sums, channels * (-(-rows // run)))(fkept, fmean, finv, from_x, flat(gamma), flat(beta),
                                                                fdy, sums, rows, channels, run, relu, slope)
    if dgamma is not None and dbeta is not None:
        K.launch(fk.param_grads, channels)(sums, flat(dgamma), flat(dbeta))
    if dx is not None:
        K.launch(lk.bn_backward_apply, 0, blocks=lk.blocks_for(rows, channels))(
            fkept, fmean, finv, from_x, flat(gamma), flat(beta), sums, fdy, flat(dx), rows, channels,
            float(outer * inner), not use_global_stats, relu, slope)


# ---- pooling ----------------------------------------------------------------------------------------
def _dims(x_shape, y_shape, geom: PoolGeometry) -> tuple[int, ...]:
    return (x_shape[0], x_shape[1], x_shape[2], x_shape[3], y_shape[2], y_shape[3], *geom.kernel, *geom.stride,
            *geom.pad)


def _row_blocks(n: int, rows: int) -> int:
    return max(1, min(n * rows, K.MAX_BLOCKS))


def pool_forward(x, y, mask, geom: PoolGeometry, top_mask=None, signed_mask: bool = False) -> None:
    dims = _dims(x.shape, y.shape, geom)
    if not y.size:
        return
    if geom.method == "max":
        check_signed_mask(signed_mask, top_mask)
        blocks = _row_blocks(y.shape[0], y.shape[2])
        if pooling.tiles(x.shape, y.shape, geom):
            K.launch(lk.max_forward_tiles, 0, blocks=blocks)(flat(x), flat(y), flat(mask), *dims[:6], *geom.kernel,
                                                             signed_mask)
        else:
            kernel = lk.max_forward_small if max(geom.kernel) <= 3 else lk.max_forward
            K.launch(kernel, 0, blocks=blocks)(flat(x), flat(y), flat(mask), *dims, signed_mask)
        if top_mask is not None:
            convert(mask, top_mask)
    elif geom.method in ("ave", "stochastic"):
        K.launch(lk.ave_forward, 0, blocks=_row_blocks(y.shape[0], y.shape[2]))(flat(x), flat(y), *dims,
                                                                               geom.method == "stochastic")
    else:
        pooling.pool_forward(x, y, mask, geom, top_mask, signed_mask)  # its error


def pool_backward(dy, mask, dx, geom: PoolGeometry, relu_slope: float | None = None) -> None:
    dims = _dims(dx.shape, dy.shape, geom)
    if not dx.size:
        return
    if geom.method == "max":
        relu = (relu_slope is not None, scalar(dx, relu_slope or 0.0))
        if pooling.tiles(dx.shape, dy.shape, geom):
            K.launch(lk.max_backward_tiles, 0, blocks=_row_blocks(dy.shape[0], dy.shape[2]))(
                flat(dy), flat(mask), flat(dx), *dims[:6], *geom.kernel, *relu)
        else:
            pairs = all(k <= 2 * st for k, st in zip(geom.kernel, geom.stride))
            kernel = lk.max_backward_pairs if pairs else lk.max_backward
            K.launch(kernel, 0, blocks=_row_blocks(dx.shape[0], dx.shape[2]))(flat(dy), flat(mask), flat(dx), *dims,
                                                                              *relu)
    elif geom.method == "ave":
        K.launch(lk.ave_backward, 0, blocks=_row_blocks(dx.shape[0], dx.shape[2]))(flat(dy), flat(dx), *dims)
    else:
        pooling.pool_backward(dy, mask, dx, geom, relu_slope)  # its error


# ---- Concat and Slice ------------------------------------------------------------------------------------
# Channels last stores (N, C, H, W) as (N, H, W, C): a slab along the channels is a run of C_i values in every
# pixel's row of C, so joining along them is ops/concat.py's row copy over N*H*W rows (and along H or W, over
# fewer, longer rows). Every array here is NHWC or of a shape whose layouts coincide (layout_conversion.py
# converts the others first), so one order holds for all.
STORED = (0, 2, 3, 1)  # the logical axes of an NHWC array in memory order


def concat_forward(bottoms, top, axis: int) -> None:
    offset = 0
    for b in bottoms:
        concat.slab_copy(b, top, axis, 0, offset, b.shape[axis], order=STORED)
        offset += b.shape[axis]


def concat_backward(top_diff, bottom_diff, axis: int, offset: int) -> None:
    concat.slab_copy(top_diff, bottom_diff, axis, offset, 0, bottom_diff.shape[axis], order=STORED)


def relu_backward_slab(y, top_diff, dx, axis: int, offset: int, slope: float) -> None:
    concat.slab_copy(top_diff, dx, axis, offset, 0, dx.shape[axis], relu_output=y, slope=slope, order=STORED)


# The ops these functions stand in for (layout.py looks them up by the op's name).
NAMES = ("copy", "axpy", "add_bias", "bias_backward", "channel_mul", "channel_mul_grad", "bn_batch_stats", "bn_normalize",
         "bn_backward", "bn_affine_forward", "bn_affine_backward", "pool_forward", "pool_backward", "concat_forward",
         "concat_backward", "relu_backward_slab")
