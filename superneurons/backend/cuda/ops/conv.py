"""2-D convolution through cuDNN (grouped, dilated); plans and algorithms chosen once per shape (see cudnn.py)."""
from __future__ import annotations

from superneurons.backend.cuda import cudnn
from superneurons.backend.cuda.device import current
from superneurons.backend.geometry import ConvGeometry

__all__ = ["conv_forward", "conv_backward", "conv_algorithm"]


def _plan(x, w, y, geom: ConvGeometry):
    return current().cudnn.conv_plan(x.shape, w.shape, y.shape, geom, x.dtype)


def conv_forward(x, w, b, y, geom: ConvGeometry) -> None:
    """y = conv(x, w) + b."""
    plan = _plan(x, w, y, geom)
    plan.forward(x, w, y)
    if b is not None:
        plan.add_bias(b, y)


def conv_backward(x, w, dy, dx, dw, db, geom: ConvGeometry, accumulate_dx: bool = False) -> None:
    """dx = conv^T(dy, w) (overwritten; added to dx with `accumulate_dx`); dw += corr(x, dy); db += per-channel
    sum of dy. None skips one."""
    plan = _plan(x, w, dy, geom)
    if db is not None:
        plan.backward_bias(dy, db)
    if dw is not None:
        plan.backward_filter(x, dy, dw)
    if dx is not None:
        plan.backward_data(w, dy, dx, accumulate_dx)


_FWD = ("implicit_gemm", "implicit_precomp_gemm", "gemm", "direct", "fft", "fft_tiling", "winograd",
        "winograd_nonfused")
_BWD_DATA = ("algo0", "algo1", "fft", "fft_tiling", "winograd", "winograd_nonfused")
_BWD_FILTER = ("algo0", "algo1", "fft", "algo3", "winograd", "winograd_nonfused", "fft_tiling")


def conv_algorithm(x_shape, w_shape, y_shape, geom: ConvGeometry, dtype) -> str:
    """The cuDNN algorithms (and workspace) this shape ran at its last call in each direction, for the
    profiler; '-' for a direction not run yet, '~' after a name that was ranked by heuristics, not measured;
    `engN` is engine N of cuDNN's graph API."""
    plan = current().cudnn.conv_plan(tuple(x_shape), tuple(w_shape), tuple(y_shape), geom, dtype)

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

    # Backward data shows its overwriting run, or its adding one ('+': into a split blob's summed gradient).
    data = (name(_BWD_DATA, cudnn.BACKWARD_DATA) if plan.last[cudnn.BACKWARD_DATA] is not None
            else name(_BWD_DATA, cudnn.BACKWARD_DATA_ADD) + "+" if plan.last[cudnn.BACKWARD_DATA_ADD] is not None
            else "-")
    return (f"f:{name(_FWD, cudnn.FORWARD)} d:{data} "
            f"w:{name(_BWD_FILTER, cudnn.BACKWARD_FILTER)}")
