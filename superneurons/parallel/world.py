"""The ranks of a data-parallel job, as MPI started them: who this process is, and the few host-side
collectives the job needs besides the gradient reduction (agreeing on a seed, on stopping, on NCCL's id).

A process belongs to a job when an MPI launcher started it (`mpiexec`, `mpirun`, `srun` with PMI): the
launcher's environment says so, and only then is mpi4py imported (importing it initializes MPI). A
process started on its own is not part of a job and trains alone, as before.

Failure: `abort` ends every rank of the job (MPI_Abort): the launcher kills the other processes, so a rank
that fails never leaves the others waiting in a collective.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from superneurons.errors import require_module

# Set by MPI launchers in every process they start: MPICH/Intel MPI (hydra, PMI), Open MPI, PMIx, MVAPICH.
_LAUNCHER_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (then it is one rank of a job, possibly of one)."""
    return any(name in os.environ for name in _LAUNCHER_ENV)


def _mpi() -> Any:
    return require_module("mpi4py.MPI", "data parallelism needs mpi4py and an MPI runtime",
                          "install them with `pip install mpi4py mpich`")


ABORT_GRACE_S = 0.3  # seconds between a failing rank's last words and MPI_Abort


class World:
    """This process's place in the job: `rank` of `size`, and `local_rank` among the ranks on its machine
    (which picks its GPU)."""

    def __init__(self) -> None:
        MPI = _mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        # The ranks sharing this machine's memory are the ones sharing its GPUs.
        self._local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = self._local.Get_rank()
        self.local_size: int = self._local.Get_size()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any, root: int = 0) -> Any:
        """A small Python value from `root` to every rank."""
        return self.comm.bcast(value, root=root)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on some rank."""
        return bool(self.comm.allreduce(bool(flag), op=self._MPI.LOR))

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's `value` on rank 0 (None elsewhere)."""
        return self.comm.gather(value, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (this call does not return)."""
        sys.stdout.flush()
        sys.stderr.flush()
        # The launcher forwards our output asynchronously and an abort kills its forwarders: without a
        # moment's grace a failing rank's one line could be lost (seen on a loaded 2-core machine).
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)
        os._exit(code)  # MPICH's MPI_Abort may return once the launcher has the request; end here anyway
