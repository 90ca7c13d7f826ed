"""An MPI program the data-parallel tests start with `mpiexec -n N python tests/parallel_job.py ...`.

  train OUT NET ITERS LAYER_WISE ITER_SIZE BATCH [MEMORY POOL_BYTES]
                                                   every rank trains NET (see NETS) on its share of DATA with
                                                   batch BATCH per rank; rank r writes OUT.r.npz (its weights);
                                                   JOB_BUCKET_BYTES: gradient bytes per bucket;
                                                   JOB_PRECISION: --precision; JOB_REDUCE: --reduce-type
  halfsum OUT NET PRECISION ALLOCATOR [DEVICE]     every rank builds NET's RankSolver in PRECISION with the half
                                                   reduction (allocator pool: flat buckets; malloc: per tensor),
                                                   fills its float32 gradients with `rank_gradients`, reduces
                                                   them once, and writes them to OUT.r.npz; DEVICE cpu (MPI, the
                                                   default) or cuda (GPU local rank, NCCL)
  fail SOLVER RANK ITER                            `superneurons train --solver SOLVER`, where rank RANK raises
                                                   a UserError at iteration ITER (a rank failing mid-run)
  segments OUT END                                 every rank joins the World, sums its rank over MPI, and writes
                                                   the MPICH shared-memory files it maps to OUT.r.txt (one
                                                   path a line, as /proc/self/maps names it); then the job
                                                   ends by END: `finalize` (a normal exit), `abort` (rank 1
                                                   calls World.abort) or `kill` (rank 1 kills itself, SIGKILL)

The share of rank r of N is records r, r + N, r + 2N, ...: batch k on rank r holds records (k*B + i)*N + r,
the sharding Caffe's Data layer uses, so the N batches of one iteration are the 1-rank batch of N*B records.
"""
from __future__ import annotations

import os
import sys

import numpy as np
from google.protobuf import text_format

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from superneurons.errors import UserError  # noqa: E402
from superneurons.proto import superneurons_pb2 as pb  # noqa: E402

SHAPE = (3, 6, 6)  # one record
CLASSES = 5

_CONV = """
layer { name: "data" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: %(batch)d channels: 3 height: 6 width: 6 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" }
                      bias_filler { type: "constant" value: 0.1 } } }
%(middle)s
layer { name: "ip1" type: "InnerProduct" bottom: "act" top: "ip1"
  inner_product_param { num_output: 8 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  inner_product_param { num_output: %(classes)d weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
NETS = {
    # no batch statistics: N ranks x batch B train to 1 rank x batch N*B's weights
    "plain": """layer { name: "relu1" type: "ReLU" bottom: "conv" top: "act" }""",
    # BatchNorm -> Scale -> ReLU (fused): each rank normalizes with its own batch's statistics
    "bn": """layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "bn" }
layer { name: "scale" type: "Scale" bottom: "bn" top: "bn" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "bn" top: "act" }""",
}
SOLVER = """base_lr: 0.1 momentum: 0.9 weight_decay: 0.01 lr_policy: "fixed" max_iter: %(iters)d
display: 0 snapshot: 0 snapshot_after_train: false random_seed: 7 iter_size: %(iter_size)d
clip_gradients: %(clip)s layer_wise_reduce: %(layer_wise)s"""
CLIP = 2.0  # small enough that clipping happens in the first iterations (on the averaged gradients)


def data(records: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2024)
    return (rng.standard_normal((records,) + SHAPE).astype(np.float32),
            rng.integers(0, CLASSES, records).astype(np.float32))


def solver_param(net: str, iters: int, batch: int, iter_size: int = 1, layer_wise: bool = True) -> pb.SolverParameter:
    param = text_format.Parse(SOLVER % {"iters": iters, "iter_size": iter_size, "clip": CLIP,
                                        "layer_wise": str(layer_wise).lower()}, pb.SolverParameter())
    param.net_param.CopyFrom(text_format.Parse(_CONV % {"batch": batch, "middle": NETS[net], "classes": CLASSES},
                                               pb.NetParameter()))
    return param


def weights(solver) -> dict[str, np.ndarray]:
    net = solver.net
    return {f"{node.name}.{k}": net.backend.to_host(decl.data)
            for node in net.layers_in_prototxt_order() for k, decl in enumerate(node.layer.params)
            if decl.owner is None}


def train(out: str, net: str, iters: int, layer_wise: bool, iter_size: int, batch: int, memory: str = "baseline",
          pool_bytes: int | None = None) -> None:
    from superneurons.backend.cpu import CpuBackend
    from superneurons.parallel.collectives import MpiCollective
    from superneurons.parallel.solver import RankSolver
    from superneurons.parallel.world import World
    from superneurons.runtime.logging import TrainLog

    world = World()
    backend = CpuBackend()
    with open(os.devnull, "w") as sink:
        bucket = os.environ.get("JOB_BUCKET_BYTES")
        solver = RankSolver(solver_param(net, iters, batch, iter_size, layer_wise), "job.prototxt", world=world,
                            collective=MpiCollective(world, backend.ops), backend=backend, memory=memory,
                            pool_bytes=pool_bytes, log=TrainLog(stream=sink),
                            bucket_bytes=int(bucket) if bucket else None,
                            precision=os.environ.get("JOB_PRECISION") or None,
                            reduce=os.environ.get("JOB_REDUCE") or None)
        x, y = data(iters * iter_size * batch * world.size)
        solver.net.layer("data").reset(np.ascontiguousarray(x[world.rank::world.size]), np.ascontiguousarray(y[world.rank::world.size]))
        solver.solve()
    reducer = solver.reducer
    np.savez(f"{out}.{world.rank}.npz", started=reducer.started_during_backward,
             streamed=solver.net.params.offloaded, buckets=len(reducer.buckets), flat=reducer.flat,
             calls=reducer.calls_per_iteration, reduce_type=reducer.reduce_type_name,
             loss_scale=solver.loss_scale.scale, **weights(solver))


def rank_gradients(shape: tuple[int, ...], rank: int, index: int) -> np.ndarray:
    """Rank `rank`'s float32 gradient of learnable parameter `index`: normal values over several octaves (so
    1/N and the sum round differently from element to element), and, at the front, values that only the order
    1/N-then-sum keeps finite in float16 (60000 on every rank: 30000 + 30000 fits, 60000 + 60000 does not),
    ones beyond float16 even after 1/N (140000), and ones float16 holds only as subnormals after 1/N."""
    rng = np.random.default_rng(1000 * rank + index)
    g = (rng.standard_normal(shape) * np.exp2(rng.integers(-12, 6, shape))).astype(np.float32).ravel()
    special = np.array([60000.0, -60000.0, 140000.0, 3e-6, -7e-7, 1e-9], np.float32)
    k = min(g.size, special.size)
    g[:k] = special[:k]
    return g.reshape(shape)


def halfsum(out: str, net: str, precision: str, allocator: str, device: str = "cpu") -> None:
    from superneurons.backend import get_backend
    from superneurons.parallel.collectives import MpiCollective, NcclCollective
    from superneurons.parallel.solver import RankSolver
    from superneurons.parallel.world import World
    from superneurons.runtime.logging import TrainLog

    os.environ["SUPERNEURONS_ALLOCATOR"] = allocator
    world = World()
    if device == "cuda":
        backend = get_backend("cuda", world.local_rank)
        collective = NcclCollective(world, backend, world.local_rank)
    else:
        backend = get_backend("cpu")
        collective = MpiCollective(world, backend.ops)
    with open(os.devnull, "w") as sink:
        solver = RankSolver(solver_param(net, 1, 2), "job.prototxt", world=world, collective=collective,
                            backend=backend, memory="baseline", log=TrainLog(stream=sink), precision=precision,
                            reduce="backward")
    reducer, net_backend = solver.reducer, solver.net.backend
    for i, decl in enumerate(solver.net.learnable):
        net_backend.from_host(decl.diff, rank_gradients(tuple(decl.diff.shape), world.rank, i))
    reducer.finish()
    np.savez(f"{out}.{world.rank}.npz", reduce_type=reducer.reduce_type_name, flat=reducer.flat,
             calls=reducer.calls_per_iteration,
             **{str(i): np.array(net_backend.to_host(decl.diff)) for i, decl in enumerate(solver.net.learnable)})
    if hasattr(collective, "close"):
        collective.close()


def fail(solver_path: str, rank: int, at: int) -> int:
    from superneurons.cli import main
    from superneurons.parallel import solver as rank_solver

    update = rank_solver.RankSolver.apply_update

    def failing_update(self, display=False):
        if self.world.rank == rank and self.iter == at:
            raise UserError(f"injected failure at iteration {at}")
        return update(self, display)

    rank_solver.RankSolver.apply_update = failing_update
    return main(["train", "--solver", solver_path, "--no-progress"])


def segments(out: str, end: str) -> None:
    import signal

    from superneurons.parallel.world import World

    world = World()
    assert world.comm.allreduce(world.rank) == world.size * (world.size - 1) // 2
    with open("/proc/self/maps", encoding="utf-8") as f:
        mapped = sorted({line.split(maxsplit=5)[5].strip() for line in f
                         if len(line.split(maxsplit=5)) == 6 and "/dev/shm/mpich_" in line})
    with open(f"{out}.{world.rank}.txt", "w", encoding="utf-8") as f:
        f.write("".join(p + "\n" for p in mapped))
    world.barrier()  # both files are written before the job ends, however it ends
    if end != "finalize" and world.rank == 1:
        if end == "abort":
            world.abort(1)
        os.kill(os.getpid(), signal.SIGKILL)
    world.barrier()  # rank 0 waits here for a rank that never comes, until the launcher stops it


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "train":
        memory, pool = (rest[6], int(rest[7])) if len(rest) > 6 else ("baseline", None)
        train(rest[0], rest[1], int(rest[2]), rest[3] == "1", int(rest[4]), int(rest[5]), memory, pool)
    elif what == "halfsum":
        halfsum(*rest)
    elif what == "segments":
        segments(rest[0], rest[1])
    elif what == "fail":
        sys.exit(fail(rest[0], int(rest[1]), int(rest[2])))
    else:
        sys.exit(f"unknown job {what!r}")
