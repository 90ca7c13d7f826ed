"""numba-cuda kernels, one module per op family. They import only numba.cuda, math and numpy, so they also
run under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) for tests on machines without a GPU.

Every elementwise kernel walks its elements with a grid-stride loop, so `launch` can cap the grid.
Reduction kernels use BLOCK threads and a shared float64 scratch of BLOCK entries.

Launch cost: numba's dispatcher types every argument and marshals it on every call (~30 us), which for a
ResNet-50 iteration of ~1500 small kernels costs more than the math. `launch` returns a `_Launcher` that
takes numba's path once per distinct argument set (compiling, checking types), records the argument
block it would have passed, and afterwards calls cuLaunchKernel directly with that block (a few us).
Arrays are keyed by identity (their header is immutable: same object, same pointer, shape and strides),
scalars by type, their values written into the block at each launch (a learning rate or a dropout key that
changes every iteration then reuses one block instead of taking numba's ~300 us path each time).
SUPERNEURONS_FAST_LAUNCH=0 (or the simulator) keeps numba's own path.

Launches go to the legacy default stream 0, where all compute runs, except while a CUDA graph is being
captured (graphs.py): a captured stream cannot be the legacy one, so `set_stream` points every launch and
device copy at the capturing stream meanwhile.
"""
from __future__ import annotations

import ctypes
import os
import weakref

from superneurons import settings

BLOCK = 256
MAX_BLOCKS = 16384
_CACHE_LIMIT = 8192  # argument blocks kept per launcher (memory modes re-create views each iteration)

# Whether launches take the recorded path: None until the first launch reads the setting, False after a
# driver error.
FAST: bool | None = None
_SCALARS: frozenset = frozenset()
_cu = None
_configured: dict = {}
# The stream launches and device copies go to: None, the legacy default stream; else (handle, numba's stream
# object) of the stream a graph is being captured on (`set_stream`).
_STREAM: tuple | None = None


def set_stream(handle: int | None) -> None:
    """Queue launches and device copies on stream `handle` from now on (None: the legacy default stream)."""
    global _STREAM
    if handle is None:
        _STREAM = None
        return
    from numba import cuda

    _STREAM = (ctypes.c_void_p(handle), cuda.external_stream(handle))


def stream_handle() -> int:
    """The stream launches go to now (0: the legacy default stream)."""
    return 0 if _STREAM is None else int(_STREAM[0].value or 0)


def _fast() -> bool:
    global FAST
    if FAST is None:
        FAST = settings.get("SUPERNEURONS_FAST_LAUNCH") and os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0")
    return FAST


def _driver():
    """libcuda's cuLaunchKernel through ctypes, or None (then every launch takes numba's path)."""
    global _cu, FAST
    if _cu is None:
        try:
            from numba import config

            if config.ENABLE_CUDASIM:
                raise OSError("the CUDA simulator has no driver")
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernel
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                           ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p]
            _cu = fn
        except (OSError, AttributeError):
            FAST = False
            _cu = False
    return _cu or None


def _ctype_values(kernel, args):
    """The ctypes values numba would pass for `args` (its _prepare_args rules) and, per scalar argument,
    (its index in `args`, its ctypes value, the conversion that stores a new value there); (None, None, None)
    if unsupported."""
    from numba.core import types
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    sig = tuple(kernel.typeof_pyval(a) for a in args)
    overload = kernel.overloads.get(sig)
    if overload is None:
        return None, None, None
    out, scalars = [], []
    for i, (ty, val) in enumerate(zip(overload.argument_types, args)):
        if isinstance(ty, types.Array):
            if not isinstance(val, DeviceNDArray) or not val.is_c_contiguous():  # host arrays get copied
                return None, None, None
            out += [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(val.size),
                    ctypes.c_int64(val.dtype.itemsize), ctypes.c_void_p(val.device_ctypes_pointer.value or 0)]
            out += [ctypes.c_int64(d) for d in val.shape]
            out += [ctypes.c_int64(s) for s in val.strides]
            continue
        if isinstance(ty, types.Integer):
            slot = getattr(ctypes, f"c_{ty}")()
            # numba types a Python int by its value (beyond int64: uint64): such a launch takes numba's path
            convert = _int64 if val.__class__ is int else int
        elif ty in (types.float64, types.float32):
            slot, convert = (ctypes.c_double() if ty == types.float64 else ctypes.c_float()), float
        elif ty == types.boolean:
            slot, convert = ctypes.c_bool(), bool
        else:
            return None, None, None
        slot.value = convert(val)  # c_float stores float32(val), rounded as NumPy rounds
        out.append(slot)
        scalars.append((i, slot, convert))
    handle = overload._codelibrary.get_cufunc().handle
    # cuda-bindings' CUfunction converts with int(); numba's ctypes binding gives a c_void_p, which int()
    # would read as bytes
    return (handle.value if isinstance(handle, ctypes.c_void_p) else int(handle)), out, tuple(scalars)


class _NotInt64(Exception):
    pass


def _int64(value: int) -> int:
    if -(1 << 63) <= value < (1 << 63):
        return value
    raise _NotInt64


class _Launcher:
    __slots__ = ("kernel", "grid", "cfg", "blocks")

    def __init__(self, kernel, grid: int):
        self.kernel = kernel
        self.grid = grid
        self.cfg = kernel[grid, BLOCK]
        self.blocks: dict = {}

    def __call__(self, *args):
        if _STREAM is not None:  # a graph capture: numba's path onto the capturing stream when not recorded
            return self._launch_on(_STREAM, args)
        if not (FAST if FAST is not None else _fast()):
            # Configured afresh: the simulator's kernel object keeps only the grid it was last given, so a
            # kept configuration would launch another launcher's grid.
            return self.kernel[self.grid, BLOCK](*args)
        key = tuple([a.__class__ if a.__class__ in _SCALARS else id(a) for a in args])
        entry = self.blocks.get(key)
        if entry is not None:
            handle, params, _values, scalars, _refs = entry
            try:
                for i, slot, convert in scalars:  # cuLaunchKernel copies the block at the call: rewriting is safe
                    slot.value = convert(args[i])
            except _NotInt64:
                return self.cfg(*args)
            if _cu(handle, self.grid, 1, 1, BLOCK, 1, 1, 0, None, params, None) == 0:
                return None
            _disable()  # an unexpected driver error: numba's path reports it properly
            return self.cfg(*args)
        self.cfg(*args)  # numba's path: compiles, type-checks, launches
        if _driver() is None:
            return None
        try:
            handle, values, scalars = _ctype_values(self.kernel, args)
        except _NotInt64:
            return None
        if handle is not None:
            if len(self.blocks) >= _CACHE_LIMIT:
                self.blocks.clear()
            params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
            # Weak references to the arrays: holding them would keep their allocation (a whole pool arena)
            # alive after its Net is gone. The entry goes when one of them does, before its id can come back
            # as another array's; a dropped entry's references die with it and call nothing.
            forget = self.blocks.pop
            try:
                refs = [weakref.ref(a, lambda _ref, key=key: forget(key, None))
                        for a in args if a.__class__ not in _SCALARS]
            except TypeError:  # an argument that cannot be referenced weakly: launch through numba each time
                return None
            self.blocks[key] = (handle, params, values, scalars, refs)
        return None

    def _launch_on(self, stream: tuple, args) -> None:
        """Launch on `stream` ((handle, numba stream)): the recorded block when there is one, else numba's path."""
        key = tuple([a.__class__ if a.__class__ in _SCALARS else id(a) for a in args])
        entry = self.blocks.get(key) if FAST else None
        if entry is not None:
            handle, params, _values, scalars, _refs = entry
            try:
                for i, slot, convert in scalars:
                    slot.value = convert(args[i])
                if _cu(handle, self.grid, 1, 1, BLOCK, 1, 1, 0, stream[0], params, None) == 0:
                    return None
            except _NotInt64:
                pass
        self.kernel[self.grid, BLOCK, stream[1]](*args)
        return None


_bound: dict = {}  # libcuda functions bound through ctypes at their first call (False: no driver)


def _driver_call(name: str, argtypes: list):
    """libcuda's `name` with `argtypes` (returning a CUresult), bound once; None where there is no driver."""
    fn = _bound.get(name)
    if fn is None:
        fn = _bound[name] = False
        if _driver() is not None:
            fn = _bound[name] = getattr(ctypes.CDLL("libcuda.so.1"), name)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
    return fn or None


def _stream():
    return None if _STREAM is None else _STREAM[0]


_COPY_ARGS = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]  # dst, src, bytes, stream
_FILL_ARGS = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]  # dst, word, words, stream


def memcpy_device(dst_ptr: int, src_ptr: int, nbytes: int) -> bool:
    """Queue a device-to-device copy on the compute stream (`set_stream`) through the driver (cuMemcpyDtoDAsync), a
    few us against ~100 us for numba's copy_to_device checks. False where there is no driver (simulator)."""
    fn = _driver_call("cuMemcpyDtoDAsync_v2", _COPY_ARGS)
    return fn is not None and _fast() and fn(dst_ptr, src_ptr, nbytes, _stream()) == 0


def memset32(dst_ptr: int, value: int, count: int) -> bool:
    """Queue a fill of `count` 32-bit words at `dst_ptr` with `value` on the compute stream (cuMemsetD32Async: the
    value travels with the call, no host buffer has to outlive it). False where there is no driver (simulator)."""
    fn = _driver_call("cuMemsetD32Async", _FILL_ARGS)
    return fn is not None and fn(dst_ptr, value, count, _stream()) == 0


def _disable() -> None:
    global FAST
    FAST = False


def _init_scalars() -> None:
    global _SCALARS
    import numpy as np

    _SCALARS = frozenset({int, float, bool, np.float32, np.float64, np.int32, np.int64, np.uint64, np.uint32,
                          np.bool_})


_init_scalars()


def _unify_bfloat16_as_float32() -> None:
    """numba-cuda's bfloat16 type (0.30) cannot be unified with another number: its own rule asks the typing
    context to unify the pair, which asks bfloat16 again (recursing until Python's limit), and a float's rule
    looks the pair up in NumPy, which has no bfloat16. A kernel that merges a bfloat16 value with a float (a
    conditional expression, a variable assigned both) then failed to compile. Here bfloat16 unifies as float32,
    which it converts to exactly; on a build without the type nothing changes."""
    try:
        from numba.cuda import types as cuda_types
        from numba.cuda.types import ext_types
    except ImportError:  # numba's own CUDA target or the simulator: no bfloat16 type to fix
        return
    bfloat16 = getattr(ext_types, "Bfloat16", None)
    if bfloat16 is None or getattr(bfloat16, "_sn_unify", False):
        return
    number_unify = ext_types.Number.unify

    def as_float32(t):
        return cuda_types.float32 if isinstance(t, bfloat16) else t

    def unify(self, typingctx, other):
        if isinstance(self, bfloat16) or isinstance(other, bfloat16):
            a, b = as_float32(self), as_float32(other)
            if a == b:
                return self if self == other else a
            if isinstance(a, ext_types.Number) and isinstance(b, ext_types.Number):
                return typingctx.unify_pairs(a, b)
            return None
        return number_unify(self, typingctx, other)

    ext_types.Number.unify = unify
    bfloat16.unify = unify
    bfloat16._sn_unify = True


_unify_bfloat16_as_float32()


def launch(kernel, n: int, blocks: int | None = None):
    """A launcher of `kernel[grid, BLOCK]` for `n` elements (grid-stride loops), or exactly `blocks` blocks."""
    grid = blocks if blocks is not None else max(1, min((n + BLOCK - 1) // BLOCK, MAX_BLOCKS))
    key = (kernel, grid)
    cfg = _configured.get(key)
    if cfg is None:
        cfg = _configured[key] = _Launcher(kernel, grid)
    return cfg


UNROLL = 4  # elements per thread per trip in the unrolled elementwise kernels (elementwise.four_indices)


def launch_unrolled(kernel, n: int):
    """A launcher for a kernel that handles UNROLL elements per thread per trip: a quarter of the grid."""
    return launch(kernel, -(-n // UNROLL))
