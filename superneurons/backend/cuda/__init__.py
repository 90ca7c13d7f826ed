"""The CUDA backend: cuDNN and cuBLAS through ctypes, numba-cuda kernels, numba device arrays for memory.

`CudaBackend(device)` mirrors CpuBackend: `ops` holds a GPU twin of every op in backend/cpu (same
names and signatures, collected from the modules of `ops/`), `arena` is ONE device allocation, and
`view` is a zero-copy array over arena bytes. All work runs on the default stream, in order.

Tensors may be stored in float32, float16 or bfloat16 (half_math.py: what computes on half arrays directly and
what runs on float32 copies). cuDNN may use TF32 tensor cores for float32 convolutions (its default math, as
PyTorch allows); pass tf32=False, or set SUPERNEURONS_TF32=0, for FMA-only math that matches the CPU to ~1e-5.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from superneurons import settings
from superneurons.backend.base import collect_ops
# Imported here, not in the two methods a Net calls around every step: a function-level import costs ~1 us each
# time it runs (980 of them per ResNet-50 iteration).
from superneurons.backend.cuda import copy_room
from superneurons.dtypes import BFLOAT16, FLOAT16, FLOAT32, tensor_bytes
from superneurons.errors import UserError

DEFAULT_WORKSPACE_LIMIT = 1 << 30  # bytes of cuDNN workspace an algorithm may ask for


def _collect_ops() -> SimpleNamespace:
    from superneurons.backend.cuda import ops as package

    return collect_ops(package)


def _env_tf32() -> bool:
    return settings.get("SUPERNEURONS_TF32")


class CudaBackend:
    name = "cuda"
    asynchronous = True  # kernels are queued on the default stream: timers synchronize
    storage_types = (FLOAT32, FLOAT16, BFLOAT16)  # half storage computes in float32 (half_math.py)
    layouts = ("NCHW", "NHWC")  # 4-D tensors may be stored channels last (graph/layout.py, layout.py)

    def __init__(self, device: int = 0, tf32: bool | None = None, workspace_limit: int = DEFAULT_WORKSPACE_LIMIT):
        try:
            from numba import config as numba_config, cuda

            # Small layers launch small grids by design; numba's occupancy warning would flood the log.
            numba_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
        except ImportError as e:
            raise UserError(f"the GPU backend needs numba-cuda ({e}); install it with "
                            "`pip install 'superneurons[cu12]'` (or [cu13] for a CUDA 13 driver)") from None
        from superneurons.backend.cuda import device as dev, libs
        from superneurons.backend.cuda.probe import device_count

        count = device_count()
        if count == 0 or not cuda.is_available():
            raise UserError("no usable NVIDIA GPU (driver or device missing)")
        if not 0 <= device < count:
            raise UserError(f"--gpu {device}: this machine has {count} GPU(s), numbered 0..{count - 1}")
        libs.load("cudnn")
        libs.load("cublas")
        self.device = dev.Device(device, _env_tf32() if tf32 is None else tf32, workspace_limit)
        dev.activate(self.device)
        self._dev = dev
        self._cuda = cuda
        from superneurons.backend.cuda import pointers, streams, transfer

        # Kept here for the methods a run calls at every step or bucket (a function-level import there costs
        # Python's import machinery each time: see copy_room's import above)
        self._pointers, self._streams, self._transfer = pointers, streams, transfer
        from superneurons.backend.cuda.half_math import with_half_fallback

        self._float32_ops = _collect_ops()
        # Every op checks its arguments for half arrays (half_math.py): a few microseconds a call, which a
        # float32 net is spared (`ops_for`).
        self.ops = with_half_fallback(self._float32_ops)
        self._layout_ops: dict = {}

    def ops_for(self, storage: frozenset, channels_last: bool = False):
        """The plain ops for a net that stores only float32; the half-checking ones otherwise. `channels_last`:
        the net stores NHWC tensors, so its ops convert where they have no path for their arguments' layouts."""
        ops = self._float32_ops if set(storage) <= {FLOAT32} else self.ops
        if not channels_last:
            return ops
        from superneurons.backend.cuda.layout_conversion import with_layout_conversion

        key = id(ops)
        wrapped = self._layout_ops.get(key)
        if wrapped is None:
            wrapped = self._layout_ops[key] = with_layout_conversion(ops, half=ops is self.ops)
        return wrapped

    def install_copy_room(self, region, where: str) -> None:
        """Where the ops' fallback copies come from until the next call (copy_room.py): a Net's step installs its
        planned room (`region`, a uint8 pool array; None: none planned, so a copy is refused) for layer `where`,
        and leaves it after the step (`leave_copy_room`)."""
        copy_room.install(region, where)

    def leave_copy_room(self) -> None:
        """Copies outside a Net's steps come from the ops' own buffers again."""
        copy_room.install(copy_room.NO_NET, "")

    def layout_conversions(self) -> int:
        """Op calls so far that converted arrays between NCHW and NHWC (layout_conversion.py; the profiler's)."""
        from superneurons.backend.cuda.layout_conversion import conversions

        return sum(conversions().values())

    def set_workspace_source(self, source) -> None:
        """Where convolutions take cuDNN workspace from (a base.WorkspaceSource); None: the default
        FixedWorkspace (one private buffer of at most `workspace_limit` bytes)."""
        self.device.workspace_source = source

    def address(self, array) -> int:
        return self._pointers.pointer(array)

    def device_memory(self) -> tuple[int, int]:
        return self._transfer.device_memory()

    def make_transfer(self):
        """Pinned host memory and two copy streams of its own (transfer.CudaTransfer)."""
        from superneurons.backend.cuda.transfer import CudaTransfer

        return CudaTransfer(self)

    def release_freed(self) -> None:
        """numba defers cudaFree of dropped device arrays; run the pending frees now."""
        self._transfer.release_freed_allocations()

    def graph_recorder(self):
        """The recorder of CUDA graphs for this device's handles (graphs.GraphRecorder), made at the first call."""
        recorder = getattr(self, "_recorder", None)
        if recorder is None:
            from superneurons.backend.cuda.graphs import GraphRecorder

            recorder = self._recorder = GraphRecorder(self.device)
        return recorder

    def make_stream(self, high_priority: bool = False):
        """A NON_BLOCKING stream beside stream 0 (streams.CudaStream), of the device's highest priority if
        `high_priority`."""
        from superneurons.backend.cuda.streams import CudaStream

        return CudaStream(high_priority)

    def compute_waits(self, event) -> None:
        self._streams.compute_waits(event)

    def compute_event(self):
        return self._streams.compute_event()

    def arena(self, nbytes: int):
        """One device allocation of `nbytes` (uint8); the pool carves every tensor out of it."""
        return self._cuda.device_array(max(int(nbytes), 1), np.uint8)

    def view(self, arena, offset: int, shape: tuple[int, ...], dtype=np.float32, layout: str = "NCHW"):
        """`layout` NHWC: a 4-D (N, C, H, W) view stored channels last (graph/layout.py)."""
        dtype = np.dtype(dtype)
        n = tensor_bytes(shape, dtype)
        if offset < 0 or offset + n > arena.size:
            raise ValueError(f"view [{offset}, {offset + n}) outside the {arena.size}-byte arena")
        if layout not in self.layouts or (layout != "NCHW" and len(shape) != 4):
            raise ValueError(f"no {layout} view of shape {tuple(shape)}")
        return self._dev.make(arena.gpu_data.view(offset, offset + n), shape, dtype, layout)

    def from_host(self, dst, src: np.ndarray) -> None:
        self.ops.upload(dst, src)

    def to_host(self, src) -> np.ndarray:
        return self.ops.download(src)

    def synchronize(self) -> None:
        self._cuda.synchronize()
