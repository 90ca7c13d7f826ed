"""Device addresses of arrays, read once per array object (no numba import: the simulator tests use it too)."""
from __future__ import annotations


def pointer(a) -> int:
    """The device address of `a` (int), read once per array object and kept on it, as device.flat keeps its
    view: numba's `device_ctypes_pointer` builds a ctypes object on every read (~1-2 us, several per cuDNN
    call), and an array header, hence its address, never changes."""
    try:
        return a.__dict__["_sn_ptr"]
    except (KeyError, AttributeError):
        pass
    p = int(a.device_ctypes_pointer.value or 0)
    try:
        a._sn_ptr = p
    except AttributeError:
        pass
    return p
