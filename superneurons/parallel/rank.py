"""`superneurons train` as one rank of an MPI job: its device, its solver, and how it fails.

The local rank picks the GPU (`--gpu 0,1,2,3`: local rank i trains on the i-th id; `--gpu all`: on GPU i);
without `--gpu` (and a CPU solver_mode) every rank trains on the CPU and MPI averages the gradients.

A rank that fails (a bad record, out of memory, a bug) reports its message once and ends the whole job at
once (MPI_Abort), so no rank waits forever in a reduction and no process outlives the job.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Any, Callable

from superneurons.errors import UserError
from superneurons import settings
from superneurons.parallel.launch import ERRORS_ENV, error_file, pid_file
from superneurons.parallel.world import World
from superneurons.proto import superneurons_pb2 as pb


def pick_device(world: World, gpus: list[int] | None, param: pb.SolverParameter) -> int | None:
    """This rank's GPU (None: the CPU)."""
    if gpus is None:
        if not (param.HasField("solver_mode") and param.solver_mode == pb.SolverParameter.GPU):
            return None
        if world.local_size > 1:
            raise UserError(f"{world.local_size} ranks on this machine and the solver says GPU: name their GPUs "
                            "with --gpu 0,1,... or --gpu all")
        return int(param.device_id)
    if world.local_rank >= len(gpus):
        raise UserError(f"{world.local_size} ranks on this machine but --gpu names {len(gpus)} GPU(s) "
                        f"({','.join(map(str, gpus))}); start one rank per GPU")
    return gpus[world.local_rank]


def train_rank(args: Any, param: pb.SolverParameter, gpus: list[int] | None, pool_bytes: int | None,
               train: Callable[[Callable[[Any], Any], bool], int]) -> int:
    """`train(make_solver, root)`: the command's training loop, run with this rank's solver."""
    world = World()
    _announce_pid(world)
    try:
        return _train(args, param, gpus, world, pool_bytes, train)
    except BaseException as e:  # noqa: BLE001 - every failure must end the whole job, not hang it
        if world.size == 1 and not settings.get(ERRORS_ENV):
            raise  # a job of one: the command line reports it as usual
        _report(world, e, getattr(args, "debug", False))
        world.abort(1)
        raise  # not reached: abort ends the process


def _train(args: Any, param: pb.SolverParameter, gpus: list[int] | None, world: World, pool_bytes: int | None,
           train: Callable[[Callable[[Any], Any], bool], int]) -> int:
    from superneurons.backend import get_backend
    from superneurons.parallel.solver import RankSolver

    device = pick_device(world, gpus, param)
    backend = get_backend("cpu") if device is None else get_backend("cuda", device)
    if device is None:
        from superneurons.parallel.collectives import MpiCollective

        collective: Any = MpiCollective(world, backend.ops)
    else:
        from superneurons.parallel.collectives import NcclCollective

        collective = NcclCollective(world, backend, device)

    def make_solver(log):
        solver = RankSolver(param, args.solver, world=world, collective=collective, backend=backend,
                            memory=args.memory, pool_bytes=pool_bytes, log=log,
                            precision=getattr(args, "precision", None), data_workers=args.data_workers,
                            reduce=getattr(args, "reduce_type", None))
        where = "CPU" if device is None else f"GPU {device}"
        reducer = solver.reducer
        log.info(f"Data parallel: {world.size} rank(s), batch_size per rank; rank 0 on {where}, "
                 f"gradients averaged in {reducer.reduce_type_name} {'during' if reducer.layer_wise else 'after'} backward "
                 f"in {len(reducer.buckets)} bucket(s) of about {reducer.bucket_bytes >> 20} MiB, "
                 f"{'one reduction each' if reducer.flat else 'tensor by tensor'}"
                 + (f", NCCL kernels of at most {collective.max_ctas} blocks"
                    if getattr(collective, "max_ctas", None) else "")
                 + (", NCCL on a high-priority stream" if getattr(collective, "high_priority", False) else ""))
        return solver

    code = train(make_solver, world.is_root)
    if hasattr(collective, "close"):
        collective.close()
    return code


def _announce_pid(world: World) -> None:
    """Under the local launcher: this rank's pid, so a rank that dies without a word can be named."""
    folder = settings.get(ERRORS_ENV)
    if folder:
        try:
            with open(pid_file(folder, world.rank), "w", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
        except OSError:
            pass


def describe(e: BaseException) -> str:
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return f"{type(e).__name__}: {e}"


def _report(world: World, e: BaseException, debug: bool) -> None:
    """The failure's one line, once: into the launcher's folder when the local launcher started us, else on
    stderr. A bug (not a user's mistake) also shows its traceback."""
    if debug or not isinstance(e, (UserError, KeyboardInterrupt)):
        traceback.print_exception(e, file=sys.stderr)
    line = f"rank {world.rank}: {describe(e)}"
    folder = settings.get(ERRORS_ENV)
    if folder:
        try:
            with open(error_file(folder, world.rank), "w", encoding="utf-8") as f:
                f.write(line + "\n")
            return
        except OSError:
            pass
    print(f"superneurons train: error: {line}", file=sys.stderr, flush=True)
