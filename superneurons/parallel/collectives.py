"""The two engines that average gradients across ranks: NCCL between GPUs, MPI between CPU processes.

Both average in place (the gradient's own memory holds the mean afterwards) and return a handle from
`start` that `wait` completes, so the reducer can start a bucket while backward still runs.

NCCL (`nccl4py`, NVIDIA's binding): one communicator per job, initialized from a unique id rank 0
creates and MPI broadcasts. Reductions run on a stream the backend makes (`Backend.make_stream`), beside
the compute stream, so they overlap the backward kernels: before a bucket starts, the stream follows the
compute issued so far (the kernels that wrote the bucket's gradients); `wait` makes compute wait for the
bucket's done event, on the GPU, so the host is never blocked. NCCL's AVG operation divides by the number
of ranks in the same pass. A bucket is one array (its gradients side by side in the pool), so one call.
The reduction kernels share the multiprocessors with backward's; SUPERNEURONS_DP_NCCL_CTAS caps how many
thread blocks each takes (NCCL's `maxCTAs`), trading reduction time, hidden behind backward, for compute, and
SUPERNEURONS_DP_STREAM_PRIORITY=high gives their stream the device's highest priority, so their blocks start
as soon as a multiprocessor frees up rather than after the backward blocks queued before them (a ring's
ranks spin until every rank's blocks run).

The reductions go through nccl4py's C-level binding (`nccl.bindings.nccl.all_reduce`) with the arrays' device
addresses, not through `Communicator.allreduce`: that one resolves each buffer's device with cuda-bindings'
`cuPointerGetAttribute(DEVICE_ORDINAL)`, which answers 0 for every pointer (NVIDIA/cuda-python#2928), so it
refuses every rank on a GPU other than 0; it also costs a resolution per call.

MPI (mpi4py) on the CPU backend: a non-blocking in-place Iallreduce per array, then a scale by 1/N.

Half arrays (`SUPERNEURONS_DP_REDUCE=backward`, parallel/reducer.py) are summed, not averaged: the reducer scales
by 1/N before it rounds into them. NCCL sums float16 and bfloat16 itself (its kernels add in float32 and round
each partial sum once); MPI has no bfloat16 type, so on the CPU the arrays travel as 16-bit words and a
user-defined MPI operation adds them the same way, in float32, rounded to the array's type (to nearest even)
after each addition: the CPU computes the device's numbers, and is the reference the tests compare with.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons import settings
from superneurons.dtypes import BFLOAT16, FLOAT32, HALF_TYPES
from superneurons.errors import UserError, require_module

CTAS_ENV = "SUPERNEURONS_DP_NCCL_CTAS"
PRIORITY_ENV = "SUPERNEURONS_DP_STREAM_PRIORITY"


def half_sum(dtype: Any) -> Any:
    """The MPI user operation that adds two runs of `dtype` (float16 or bfloat16) words, inout += in: each
    element's sum computed in float32 and rounded once into `dtype`. Exact before that rounding: float32 holds
    24 bits, at least 2p + 2 for both types' p (11, 8), so rounding the float32 sum again into `dtype` gives
    the correctly rounded sum, as the GPU's add-in-float32-and-store does."""
    dtype = np.dtype(dtype)

    def add(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=np.uint16).view(dtype)
        b = np.frombuffer(inoutbuf, dtype=np.uint16).view(dtype)
        with np.errstate(over="ignore"):  # beyond float16's range is Inf, as on the device
            b[...] = a.astype(FLOAT32) + b.astype(FLOAT32)

    return add


class MpiCollective:
    """Averaging NumPy arrays (the CPU backend's) across the ranks of `world`; summing half arrays."""

    def __init__(self, world: Any, ops: Any):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = world.comm
        self.size = world.size
        self.ops = ops
        self._half_ops: dict[np.dtype, Any] = {}  # MPI user operations, made at first use, freed by close

    def start(self, arrays: list[np.ndarray], average: bool = True) -> tuple[list[Any], list[np.ndarray], bool]:
        """`average`: the mean over the ranks (float32 and float64 arrays); else the sum (any type)."""
        MPI = self._MPI
        requests = []
        for a in arrays:
            if a.dtype in HALF_TYPES:
                if average:
                    raise ValueError("half arrays are summed (the caller scales by 1/N before rounding into them)")
                requests.append(self.comm.Iallreduce(MPI.IN_PLACE, [a.view(np.uint16), MPI.UINT16_T],
                                                     op=self._half_op(a.dtype)))
            else:
                requests.append(self.comm.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM))
        return requests, arrays, average

    def _half_op(self, dtype: np.dtype) -> Any:
        op = self._half_ops.get(dtype)
        if op is None:
            op = self._half_ops[dtype] = self._MPI.Op.Create(half_sum(dtype), commute=True)
        return op

    def wait(self, handle: tuple[list[Any], list[np.ndarray], bool]) -> None:
        requests, arrays, average = handle
        self._MPI.Request.Waitall(requests)
        if average and self.size > 1:
            for a in arrays:
                self.ops.scal(1.0 / self.size, a)

    def close(self) -> None:
        for op in self._half_ops.values():
            op.Free()
        self._half_ops.clear()


def _nccl() -> Any:
    return require_module("nccl.core", "data parallelism on GPUs needs NCCL's Python binding",
                          "install it with `pip install 'superneurons[cu12]'` or `'superneurons[cu13]'` (nccl4py "
                          "and NCCL of that CUDA major)")


def nccl_ctas_setting() -> int | None:
    """The most CTAs an NCCL kernel may take (SUPERNEURONS_DP_NCCL_CTAS), None for NCCL's own choice."""
    value = settings.get(CTAS_ENV)
    if value is not None and not 1 <= value <= 32:
        raise UserError(f"{CTAS_ENV}={value}: expected 1 to 32 thread blocks per NCCL kernel (unset: NCCL's choice)")
    return value


class NcclCollective:
    """Averaging device arrays of `backend` (GPU `device`, the current one) across the ranks of `world`
    through NCCL, on a stream of the backend's beside compute. `max_ctas`: the most thread blocks a reduction
    kernel takes (0: NCCL's choice; None: SUPERNEURONS_DP_NCCL_CTAS); `high_priority`: that stream's blocks
    start before compute's (None: SUPERNEURONS_DP_STREAM_PRIORITY)."""

    def __init__(self, world: Any, backend: Any, device: int, max_ctas: int | None = None,
                 high_priority: bool | None = None):
        nccl = _nccl()
        from nccl.bindings import nccl as nccl_c  # after _nccl(): a missing NCCL is its one line
        self._nccl, self._nccl_c = nccl, nccl_c
        self.backend = backend
        self.max_ctas = nccl_ctas_setting() if max_ctas is None else (max_ctas or None)
        config = None if self.max_ctas is None else nccl.NCCLConfig(max_ctas=self.max_ctas)
        uid = world.broadcast(bytes(nccl.get_unique_id()) if world.is_root else None)
        self.comm = nccl.Communicator.init(world.size, world.rank, nccl.UniqueId.from_bytes(uid), config)
        if self.comm.device.device_id != device:
            raise RuntimeError(f"rank {world.rank}: the NCCL communicator is on GPU {self.comm.device.device_id}, "
                               f"its arrays on GPU {device}")
        self._handle = nccl_c.Comm(self.comm.ptr)  # the C handle; owned (destroyed) by self.comm
        self._dtypes = {np.dtype(np.float32): int(nccl.FLOAT32), np.dtype(np.float64): int(nccl.FLOAT64),
                        np.dtype(np.float16): int(nccl.FLOAT16), BFLOAT16: int(nccl.BFLOAT16)}
        self._avg, self._sum = int(nccl.AVG), int(nccl.SUM)
        self.size = world.size
        self.high_priority = settings.get(PRIORITY_ENV) == "high" if high_priority is None else high_priority
        self.stream = backend.make_stream(high_priority=self.high_priority)

    def start(self, arrays: list[Any], average: bool = True) -> Any:
        """`average`: NCCL's AVG (sum and 1/N in one pass); else its SUM (half arrays: the reducer scaled them)."""
        # The communication stream starts after what compute has been given so far: the kernels that
        # wrote these gradients (or rounded them into the half arrays).
        self.stream.follow_compute()
        all_reduce, handle, stream, address = (self._nccl_c.all_reduce, self._handle, self.stream.handle,
                                               self.backend.address)
        op = self._avg if average else self._sum
        with self._nccl.group():
            for a in arrays:
                p = address(a)
                all_reduce(p, p, a.size, self._dtypes[np.dtype(a.dtype)], op, handle, stream)
        return self.stream.record()

    def wait(self, handle: Any) -> None:
        self.backend.compute_waits(handle)

    def close(self) -> None:
        """Release the communicator (all ranks, at the end of a run that did not fail)."""
        self.stream.synchronize()
        self.comm.destroy()
