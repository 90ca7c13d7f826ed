"""One rank's solver: Caffe's training loop with the data-parallel rules on top.

- Every rank starts from rank 0's weights and solver history (filled, `--weights` or `--snapshot`),
  broadcast after they are set; the random seed is rank 0's (from the clock when random_seed is -1), and
  the training net of rank r draws its Dropout masks and DummyData from seed + r, as Caffe's workers do.
- Before each update the gradients are averaged over the ranks (reducer.py), so every rank applies the
  same update to the same weights and the learning rate means what it means in Caffe; in the net's half
  gradient type where `reduce` (or SUPERNEURONS_DP_REDUCE) says "backward", which the training net's plan then
  holds a buffer for (`gradient_reduce_type`). Each display line
  is followed by how long compute waited for that averaging, per iteration.
- The training net's `RunContext` carries rank and ranks: data layers read their share of the records.
  Test nets keep rank 0 of 1: only rank 0 tests, on the whole test set (as Caffe's Data layer in TEST).
- Rank 0 alone logs, tests and writes snapshots; the other ranks' solver parameters say so
  (`follower_param`). A snapshot records the number of ranks; resuming needs the same number.
- A stop (Ctrl-C, SIGTERM through the launcher) is agreed after every iteration, so every rank stops
  after the same one and rank 0's snapshot holds it.
"""
from __future__ import annotations

from typing import Any

from superneurons.errors import UserError
from superneurons.parallel.reducer import GradientReducer, reduce_type
from superneurons.proto import superneurons_pb2 as pb
from superneurons.solver import Solver


def follower_param(param: pb.SolverParameter) -> pb.SolverParameter:
    """The solver parameters of a rank other than 0: no test nets, no snapshots, no display."""
    out = pb.SolverParameter()
    out.CopyFrom(param)
    for name in ("test_net", "test_net_param", "test_iter", "test_state"):
        out.ClearField(name)
    out.test_interval = 0
    out.test_initialization = False
    out.snapshot = 0
    out.snapshot_after_train = False
    out.display = 0
    return out


class RankSolver(Solver):
    """A Solver that is one rank of `world`; `collective` averages gradients (NCCL or MPI) in buckets of
    `bucket_bytes` (None: SUPERNEURONS_DP_BUCKET_MB), in the net's half gradient type where `reduce` is
    "backward" ("fp32": in float32; None: SUPERNEURONS_DP_REDUCE)."""

    steps_hooked = True  # the reducer runs after every backward step, so training passes run eagerly

    def __init__(self, param: pb.SolverParameter, solver_path: str, *, world: Any, collective: Any,
                 bucket_bytes: int | None = None, reduce: str | None = None, **kwargs: Any):
        self.world = world
        self.reduce_choice = reduce
        super().__init__(param if world.is_root else follower_param(param), solver_path, **kwargs)
        self.net.ctx.rank, self.net.ctx.ranks = world.rank, world.size
        self.set_seed(world.broadcast(self.seed))
        self.collective = collective
        self.reducer = GradientReducer(self.net, collective, self.iter_size, layer_wise=param.layer_wise_reduce,
                                       bucket_bytes=bucket_bytes)
        self._agree_on_buckets()
        self.reducer.attach()
        self._waits_shown = 0  # reducer.wait_ms entries already in a display line
        self._local_stop = False
        self.callbacks.append(_agree_on_stop)

    def gradient_reduce_type(self, graph: Any) -> Any:
        return reduce_type(self.reduce_choice, graph.precision)

    def set_seed(self, seed: int) -> None:
        super().set_seed(seed)
        self.net.ctx.seed = seed + self.world.rank

    def share_rank0_state(self) -> None:
        """Every rank takes rank 0's weights (all parameters, running statistics too) and solver history."""
        net = self.net
        arrays = [decl.data for node in net.layers_in_prototxt_order() for decl in node.layer.params
                  if decl.owner is None]
        arrays += self.history_blobs()
        for array in arrays:
            host = net.backend.to_host(array)
            self.world.comm.Bcast(host, root=0)
            if not self.world.is_root:
                net.backend.from_host(array, host)

    def _agree_on_buckets(self) -> None:
        """Every rank reduces the same arrays: flat buckets of the same sizes on all, or per tensor on all; and
        in the same type (a setting that differs between ranks would pair float32 with half words)."""
        mine = self.reducer.reduce_type_name
        types = self.world.gather(mine)
        if self.world.is_root:
            assert types is not None
            odd = [(r, t) for r, t in enumerate(types) if t != mine]
            message = (f"rank {odd[0][0]} reduces gradients in {odd[0][1]}, rank 0 in {mine}: give every rank the "
                       f"same --reduce-type and SUPERNEURONS_DP_REDUCE") if odd else ""
        message = self.world.broadcast(message if self.world.is_root else None)
        if message:
            raise UserError(message)
        sizes = [b.flat.size if b.flat is not None else -1 for b in self.reducer.buckets]
        if self.world.any(sizes != self.world.broadcast(sizes)):
            self.reducer.per_tensor()

    def apply_update(self, display: bool = False) -> float:
        self.reducer.finish()
        if display:
            self._display_waits()
        return super().apply_update(display)

    def _display_waits(self) -> None:
        """How long compute waited for the gradient reduction, per iteration since the last display."""
        waits = self.reducer.wait_ms[self._waits_shown:]
        if not waits:
            return
        self._waits_shown += len(waits)
        self.log.info(f"Iteration {self.iter}, waiting on gradient reduction {sum(waits) / len(waits):.3g} ms/iter "
                      f"({len(self.reducer.buckets)} buckets, {self.reducer.calls_per_iteration} reductions/iter)")

    def snapshot(self) -> tuple[str, str]:
        if not self.world.is_root:
            return "", ""
        return super().snapshot()

    def request_stop(self) -> None:
        self._local_stop = True  # acted on once every rank agrees, after this iteration

    def agree_on_stop(self) -> None:
        if self.world.any(self._local_stop):
            super().request_stop()


def _agree_on_stop(solver: RankSolver, iteration: int, loss: float) -> None:
    solver.agree_on_stop()
