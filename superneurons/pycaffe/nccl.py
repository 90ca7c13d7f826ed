"""pycaffe's NCCL: the solvers of a job's processes (Caffe's python/train.py: one process per GPU) train as one.

    uid = caffe.NCCL.new_uid()                       # in the parent, handed to every process
    # in process `rank` of `n`:
    caffe.set_mode_gpu(); caffe.set_device(gpus[rank])
    caffe.set_solver_count(n); caffe.set_solver_rank(rank); caffe.set_multiprocess(True)
    solver = caffe.SGDSolver('solver.prototxt')
    nccl = caffe.NCCL(solver, uid)
    nccl.bcast()                                     # every process starts from rank 0's weights
    solver.add_callback(nccl)                        # gradients averaged before every update
    if solver.param.layer_wise_reduce:
        solver.net.after_backward(nccl)              # ... each layer's as soon as its backward is done
    solver.step(solver.param.max_iter)

The communicator and the averaging are the data-parallel trainer's (superneurons/parallel/collectives.py):
the ranks and the unique id come from the solver_count / solver_rank the script set and the uid it passes,
instead of from MPI. Averaging divides by the number of processes, so the update is the one the
combined batch gives (Caffe's NCCL divides the same way).
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError, require_module
from superneurons.pycaffe import mode


def has_nccl() -> bool:
    """Whether NCCL's Python binding (nccl4py) is installed, so caffe.NCCL can work on GPUs."""
    try:
        import nccl.core  # noqa: F401
    except ImportError:
        return False
    return True


class _ScriptRanks:
    """The job as a train.py-style script describes it (solver_count, solver_rank and the uid it made), in the
    shape the parallel package's collectives read (`rank`, `size`, `is_root`, `broadcast`)."""

    def __init__(self, uid: bytes):
        self.rank, self.size = mode.solver_rank(), mode.solver_count()
        self.is_root = self.rank == 0
        self._uid = bytes(uid)

    def broadcast(self, value: Any, root: int = 0) -> bytes:
        return self._uid  # every process was handed the same id: nothing to send


class NCCL:
    """Averages `solver`'s gradients across the processes of the job (see the module's docstring)."""

    @staticmethod
    def new_uid() -> bytes:
        """A fresh NCCL unique id (bytes) for one job; make it once and give it to every process."""
        nccl = require_module("nccl.core", "caffe.NCCL needs NCCL's Python binding",
                              "pip install 'superneurons[cu12]' (or [cu13])")
        return bytes(nccl.get_unique_id())

    def __init__(self, solver: Any, uid: bytes):
        from superneurons.parallel.collectives import NcclCollective

        if not mode.is_gpu():
            raise UserError("caffe.NCCL averages gradients between GPUs: call caffe.set_mode_gpu() and "
                            "caffe.set_device(...) first")
        if mode.solver_count() < 1 or not 0 <= mode.solver_rank() < mode.solver_count():
            raise UserError(f"caffe.NCCL: solver_rank {mode.solver_rank()} is not one of solver_count "
                            f"{mode.solver_count()} processes (caffe.set_solver_count / set_solver_rank)")
        self._solver = solver
        self._net = solver.runtime.net
        self._collective = NcclCollective(_ScriptRanks(uid), self._net.backend, mode.device())
        self._layer_wise: dict[int, list[Any]] = {}  # layer index -> its learnable gradients (after_backward)
        self._pending: list[Any] = []

    def bcast(self) -> None:
        """Give every process rank 0's weights (the other ranks' values are replaced)."""
        net = self._net
        for decl in net.learnable:
            if mode.solver_rank() != 0:
                net.ops.fill(decl.data, 0.0)
        # The average of rank 0's weights and the others' zeros, scaled back by the number of processes: every
        # process ends with the same values, rank 0's (to the rounding of one division and multiplication).
        self._collective.wait(self._collective.start([d.data for d in net.learnable]))
        for decl in net.learnable:
            net.ops.scal(float(mode.solver_count()), decl.data)
        self._solver._net._host.pull()

    # -- Solver::Callback ---------------------------------------------------------------------------
    def on_start(self) -> None:
        self._pending = []

    def on_gradients_ready(self) -> None:
        if self._layer_wise:
            for handle in self._pending:
                self._collective.wait(handle)
            self._pending = []
            return
        self._collective.wait(self._collective.start([d.diff for d in self._net.learnable if d.diff is not None]))

    # -- Net::Callback (after_backward): one layer's gradients at a time --------------------------------
    def __call__(self, layer_index: int) -> None:
        if not self._layer_wise:
            self._layer_wise = _gradients_by_layer(self._net)
        diffs = self._layer_wise.get(layer_index)
        if diffs:
            self._pending.append(self._collective.start(diffs))


def _gradients_by_layer(net: Any) -> dict[int, list[Any]]:
    """Layer index -> the gradient arrays of the learnable parameters it owns."""
    owned = {id(d) for d in net.learnable}
    out: dict[int, list[Any]] = {}
    for node in net.graph.nodes:
        diffs = [d.diff for d in node.layer.params if id(d) in owned and d.diff is not None]
        if diffs:
            out[node.layer.layer_index] = diffs
    return out
