"""The two engines that average gradients across ranks: NCCL between GPUs, MPI between CPU processes.

Both average in place (the gradient's own memory holds the mean afterwards) and return a handle from
`start` that `wait` completes, so the reducer can start a bucket while backward still runs.

NCCL (`nccl4py`, NVIDIA's binding): one communicator per job, initialized from a unique id rank 0
creates and MPI broadcasts. Reductions run on a stream the backend makes (`Backend.make_stream`), beside
the compute stream, so they overlap the backward kernels: before a bucket starts, the stream follows the
compute issued so far (the kernels that wrote the bucket's gradients); `wait` makes compute wait for the
bucket's done event, on the GPU, so the host is never blocked. NCCL's AVG operation divides by the number
of ranks in the same pass. A bucket is one array (its gradients side by side in the pool), so one call.

The reductions go through nccl4py's C-level binding (`nccl.bindings.nccl.all_reduce`) with the arrays' device
addresses, not through `Communicator.allreduce`: that one resolves each buffer's device with cuda-bindings'
`cuPointerGetAttribute(DEVICE_ORDINAL)`, which answers 0 for every pointer (NVIDIA/cuda-python#2928), so it
refuses every rank on a GPU other than 0; it also costs a resolution per call.

MPI (mpi4py) on the CPU backend: a non-blocking in-place Iallreduce per array, then a scale by 1/N.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from superneurons.errors import require_module


class MpiCollective:
    """Averaging NumPy arrays (the CPU backend's) across the ranks of `world`."""

    def __init__(self, world: Any, ops: Any):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = world.comm
        self.size = world.size
        self.ops = ops

    def start(self, arrays: list[np.ndarray]) -> tuple[list[Any], list[np.ndarray]]:
        requests = [self.comm.Iallreduce(self._MPI.IN_PLACE, a, op=self._MPI.SUM) for a in arrays]
        return requests, arrays

    def wait(self, handle: tuple[list[Any], list[np.ndarray]]) -> None:
        requests, arrays = handle
        self._MPI.Request.Waitall(requests)
        if self.size > 1:
            for a in arrays:
                self.ops.scal(1.0 / self.size, a)


def _nccl() -> Any:
    return require_module("nccl.core", "data parallelism on GPUs needs NCCL's Python binding",
                          "install it with `pip install 'superneurons[cu12]'` or `'superneurons[cu13]'` (nccl4py "
                          "and NCCL of that CUDA major)")


class NcclCollective:
    """Averaging device arrays of `backend` (GPU `device`, the current one) across the ranks of `world`
    through NCCL, on a stream of the backend's beside compute."""

    def __init__(self, world: Any, backend: Any, device: int):
        nccl = _nccl()
        from nccl.bindings import nccl as nccl_c  # after _nccl(): a missing NCCL is its one line
        self._nccl, self._nccl_c = nccl, nccl_c
        self.backend = backend
        uid = world.broadcast(bytes(nccl.get_unique_id()) if world.is_root else None)
        self.comm = nccl.Communicator.init(world.size, world.rank, nccl.UniqueId.from_bytes(uid))
        if self.comm.device.device_id != device:
            raise RuntimeError(f"rank {world.rank}: the NCCL communicator is on GPU {self.comm.device.device_id}, "
                               f"its arrays on GPU {device}")
        self._handle = nccl_c.Comm(self.comm.ptr)  # the C handle; owned (destroyed) by self.comm
        self._dtypes = {np.dtype(np.float32): int(nccl.FLOAT32), np.dtype(np.float64): int(nccl.FLOAT64),
                        np.dtype(np.float16): int(nccl.FLOAT16)}
        self._avg = int(nccl.AVG)
        self.size = world.size
        self.stream = backend.make_stream()

    def start(self, arrays: list[Any]) -> Any:
        # The communication stream starts after what compute has been given so far: the kernels that
        # wrote these gradients.
        self.stream.follow_compute()
        all_reduce, handle, stream, avg, address = (self._nccl_c.all_reduce, self._handle, self.stream.handle,
                                                    self._avg, self.backend.address)
        with self._nccl.group():
            for a in arrays:
                p = address(a)
                all_reduce(p, p, a.size, self._dtypes[np.dtype(a.dtype)], avg, handle, stream)
        return self.stream.record()

    def wait(self, handle: Any) -> None:
        self.backend.compute_waits(handle)

    def close(self) -> None:
        """Release the communicator (all ranks, at the end of a run that did not fail)."""
        self.stream.synchronize()
        self.comm.destroy()
