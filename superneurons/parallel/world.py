"""The ranks of a data-parallel job, as MPI started them: who this process is, and the few host-side
collectives the job needs besides the gradient reduction (agreeing on a seed, on stopping, on NCCL's id).

A process belongs to a job when an MPI launcher started it (`mpiexec`, `mpirun`, `srun` with PMI): the
launcher's environment says so, and only then is mpi4py imported (importing it initializes MPI). A
process started on its own is not part of a job and trains alone, as before.

Failure: `abort` ends every rank of the job (MPI_Abort): the launcher kills the other processes, so a rank
that fails never leaves the others waiting in a collective.

Shared memory: MPICH's ranks on one machine talk through a POSIX segment, `/dev/shm/mpich_shm_<job>_<node>`,
which the last rank to reach MPI_Finalize unlinks. A job that ends otherwise (MPI_Abort after a failing rank,
a rank killed, Ctrl-C during exit) left it behind, 2 to 3 MB each. Every local rank has it mapped once MPI_Init
returns (MPICH waits for all of them while it sets up the world communicator), so local rank 0 unlinks
the name as soon as the job is set up: the memory stays shared by the mappings and goes with the last
process, however it ends. MPICH's own unlink at finalize then finds no name, which it ignores.
"""
from __future__ import annotations

import os
import re
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


# The segment MPICH's shared-memory transport opens by name at MPI_Init (the slab of its queues). Its per-VCI
# slabs (`mpich_vci_*`, several VCIs only) may be opened later by some ranks: those are left to MPICH.
_MPICH_SEGMENT = re.compile(r"/dev/shm/mpich_shm_[0-9a-f]+_\d+")


def mapped_mpich_segments(maps: str = "/proc/self/maps") -> set[str]:
    """The paths of MPICH's named shared-memory segments this process has mapped (and not yet unlinked)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:  # no /proc (not Linux): nothing to do
        return set()
    found = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _MPICH_SEGMENT.fullmatch(fields[5]):
            found.add(fields[5])
    return found


def unlink_mpich_segments() -> list[str]:
    """Unlink the names of MPICH's shared-memory segments this process maps (the memory stays shared by the
    mappings and is freed with the last process); the names removed."""
    removed = []
    for path in sorted(mapped_mpich_segments()):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # gone already
            pass
    return removed


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
        # Every rank of this machine has the segment mapped by now (see the module docstring); the barrier keeps
        # that true should an MPI open it lazily, at a communicator's first use.
        self._local.Barrier()
        if self.local_rank == 0:
            unlink_mpich_segments()

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
