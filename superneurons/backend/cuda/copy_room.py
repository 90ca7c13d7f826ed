"""Where the ops' fallback copies come from: the float32 copies of half arrays an op refuses (half_math.py) and
the layout-converted copies of a channels-last net (layout_conversion.py).

In a Net every such copy is pool memory the plan counts. Before each step the Net installs the region the step's
copies come from (`install`): the layer's own buffer for them where its layouts are known to mix at setup
(`Layer.use_layout_copies`, declared by graph/layout.py, a buffer of that step alone), else the net's reserve
`#copies` (memory/tensors.py: SUPERNEURONS_COPY_RESERVE bytes, resident), or nothing. An op call takes its copies
one after the other from the region's start and gives them back when it returns (ops run one at a time on one
stream, so the next call may reuse the bytes once this one is queued). A call that needs more than the region
holds (an op that refuses its types, known only when it refuses) takes its copies from the module's own buffers
instead, outside the plan, and says so once per layer and op with the bytes that SUPERNEURONS_COPY_RESERVE
would plan: refusing there would stop a run midway, which the plan promises never happens. Outside a Net
(`install` never called, or `NO_NET` installed: tests, benchmarks) the modules keep buffers of their own.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.backend.base import COPY_ALIGN
from superneurons.backend.log_line import log_line

ALIGN = COPY_ALIGN  # every copy starts on such a boundary (backend/base.py)
NO_NET = object()  # installed outside a Net: the callers' own buffers


class _Room:
    __slots__ = ("region", "where", "used", "short")

    def __init__(self) -> None:
        self.region: Any = NO_NET  # a uint8 device array, None (a Net step with no room), or NO_NET
        self.where = ""
        self.used = 0  # bytes this op call asked for so far, those past the region's end included
        self.short: tuple[str, str] | None = None  # (op, why) of this call's first copy past the region's end


_room = _Room()


def install(region: Any, where: str) -> None:
    """Copies from now on come from `region` (a uint8 array of pool memory; None: this step planned none, so any
    copy goes outside the plan), for messages `where` (the layer). NO_NET: the callers' own buffers."""
    _room.region, _room.where, _room.used, _room.short = region, where, 0, None


def in_net() -> bool:
    """Whether a Net has installed a room (copies then come from it or are refused)."""
    return _room.region is not NO_NET


def mark() -> int:
    """The bytes taken so far in this op call (give them back with `release`)."""
    return _room.used


def release(at: int) -> None:
    """Give back the bytes taken since `at` (the call's `mark()`); a call whose copies went past the region says
    so here, once per layer and op, with all the bytes it asked for."""
    if _room.short is not None and at == 0:
        op, why = _room.short
        if (_room.where, op) not in _unplanned:
            _unplanned.add((_room.where, op))
            have = 0 if _room.region is None else int(_room.region.size)
            log_line("W", "copy_room.py", f"layer {_room.where!r}: GPU op {op} needs {_room.used} bytes of device "
                     f"copies ({why}), the net planned {have} for this step: they live outside the plan; "
                     f"SUPERNEURONS_COPY_RESERVE={_room.used} (bytes) plans them")
        _room.short = None
    _room.used = at


_unplanned: set[tuple[str, str]] = set()  # (layer, op) already logged as copying outside the plan


def take(shape: tuple, dtype: Any, layout: str, op: str, why: str) -> Any:
    """An array of `shape` and `dtype` (NHWC strides for `layout` NHWC) over the next bytes of the installed
    region, for op `op`; None past the region's end (the caller then copies into buffers of its own, and
    `release` logs it)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    at = _room.used
    end = at + -(-max(nbytes, 1) // ALIGN) * ALIGN
    region = _room.region
    have = 0 if region is None else int(region.size)
    _room.used = end
    if end > have:  # the caller copies into its own buffer; release() says so
        _room.short = _room.short or (op, why)
        return None
    # The views are kept on the region's array, as device.reshape keeps its views: the same step's copies are the
    # same objects every iteration, so kernel launches keep their fast path (they key arrays by identity).
    views = getattr(region, "_sn_room_views", None)
    if views is None:
        views = {}
        try:
            region._sn_room_views = views
        except AttributeError:  # a NumPy array (the simulator's): nothing to keep
            pass
    key = (at, tuple(shape), dtype.str, layout)
    view = views.get(key)
    if view is None:
        piece = region[at:at + nbytes]
        if hasattr(piece, "gpu_data"):
            from superneurons.backend.cuda.device import make

            view = make(piece.gpu_data, shape, dtype, layout)
        else:  # the simulator's arrays are NumPy arrays
            view = piece.view(dtype).reshape(shape)
        views[key] = view
    return view
