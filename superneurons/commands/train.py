"""`superneurons train`: Caffe's `caffe train` (same flags, in Caffe's spelling too: `-solver S -gpu 0`), plus
--memory, --gpu-memory, --log, --log-json, --tensorboard and --no-progress."""
from __future__ import annotations

import argparse

from superneurons.commands._options import (MEMORY_HELP, add_device_options, add_precision_option, pick_backend,
                                             split_stages)
from superneurons.errors import UserError
from superneurons.io.prototxt import read_solver
from superneurons.memory.pool import parse_size
from superneurons.runtime.logging import TrainLog
from superneurons.runtime.progress import TrainProgress
from superneurons.solver.signals import DEFAULT_SIGHUP, DEFAULT_SIGINT, EFFECTS, SignalEffects

EXAMPLES = """examples:
  superneurons train --solver models/lenet/lenet_solver.prototxt
  superneurons train --solver S.prototxt --weights pretrained.caffemodel      # fine-tune
  superneurons train --solver S.prototxt --snapshot lenet_iter_5000.solverstate   # resume
  superneurons train --solver S.prototxt --gpu 0 --log train.log --log-json train.jsonl
  superneurons train --solver S.prototxt --tensorboard runs/lenet     # then: tensorboard --logdir runs
  superneurons train --solver S.prototxt --gpu 0 --memory auto --gpu-memory 12G   # train within 12 GiB
  superneurons train -solver S.prototxt -gpu -1 -sighup_effect stop   # Caffe's spelling; -1: the CPU
  superneurons train --solver S.prototxt --gpu 0,1,2,3          # data parallel: one process per GPU
  superneurons train --solver S.prototxt --gpu all --gpu-memory 12G   # every GPU, 12 GiB budget on each
  mpiexec -n 8 superneurons train --solver S.prototxt --gpu all      # ranks across machines (MPI)
  mpiexec -n 2 superneurons train --solver S.prototxt                # two CPU processes

With several GPUs (or under mpiexec) batch_size is per GPU and gradients are averaged over the ranks before
each update, as in Caffe; rank 0 logs, tests and snapshots (docs/PARALLEL.md).

The log is Caffe's: glog lines on stderr (`I1124 03:15:49.123456 12345 solver.py:160] ...`), which
Caffe's tools/extra/parse_log.py reads. Ctrl-C (SIGINT) finishes the current iteration, writes a
snapshot and stops (resume with --snapshot); a second Ctrl-C stops at once. `kill -HUP` writes a
snapshot and goes on. --sigint-effect / --sighup-effect change that (stop, snapshot or none).
On a terminal a progress bar (iterations, iter/s, ETA, smoothed loss) runs below the log lines; it is
left out when stderr is a file or pipe, when CI is set, or with --no-progress.
"""


WORKER = "superneurons.commands._train_worker"  # what each process of a local data-parallel job runs


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a net from a solver prototxt",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--solver", required=True, help="solver prototxt")
    p.add_argument("--snapshot", help=".solverstate to resume training from")
    p.add_argument("--weights", help="comma-separated .caffemodel files to initialize from (fine-tuning)")
    p.add_argument("--gpu", help="GPU ids to train on, e.g. 0 or 0,1,2,3 or all, or -1 for the CPU (overrides the "
                                 "solver's solver_mode; several GPUs train data parallel, one process each)")
    add_precision_option(p)
    p.add_argument("--reduce-type", dest="reduce_type", choices=["fp32", "backward"],
                   help="data parallel: sum the gradients across ranks in float32 (fp32) or, where the net stores "
                        "gradients in float16/bfloat16, in that type (backward: half the bytes; docs/PARALLEL.md); "
                        "default: SUPERNEURONS_DP_REDUCE, else fp32")
    p.add_argument("--level", type=int, help="the train net's state level (overrides the solver's train_state)")
    p.add_argument("--stage", action="append", help="a train net state stage (repeatable or comma-separated)")
    p.add_argument("--sigint-effect", default=DEFAULT_SIGINT, choices=EFFECTS,
                   help="what Ctrl-C does: stop (default: snapshot per snapshot_after_train and stop), snapshot "
                        "(and go on) or none")
    p.add_argument("--sighup-effect", default=DEFAULT_SIGHUP, choices=EFFECTS,
                   help="what SIGHUP does: snapshot (default, and go on), stop or none")
    add_device_options(p, gpu=False, memory_default=None,
                       memory_help=f"{MEMORY_HELP} (default: the solver's memory_param.mode, else auto)")
    p.add_argument("--log", help="also append the log lines to this file")
    p.add_argument("--log-json", dest="log_json", help="append one JSON object per display/test result to this file")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the displayed and test values as TensorBoard scalars into DIR (needs tensorboardX)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (shown only when stderr is a terminal and CI is unset)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from superneurons.parallel import launch

    if args.snapshot and args.weights:
        raise UserError("give --snapshot to resume training or --weights to fine-tune, not both")
    param = read_solver(args.solver)
    if args.level is not None:  # Caffe's `caffe train -level/-stage` set the solver's train_state
        param.train_state.level = args.level
    if args.stage:
        param.train_state.ClearField("stage")
        param.train_state.stage.extend(split_stages(args.stage))
    job = launch.plan(args.gpu)
    if job.spawn:  # several GPUs, started from one command: one process per GPU under mpiexec
        return launch.spawn(args, job.gpus, entry=WORKER)
    if job.rank:  # this process is one rank of an MPI job
        from superneurons.parallel.rank import train_rank

        return train_rank(args, param, job.gpus, parse_size(args.gpu_memory),
                          lambda make_solver, root: train(args, param, make_solver, root=root))
    return train(args, param, lambda log: _solver(args, param, log))


def _solver(args, param, log):
    from superneurons.solver import Solver  # builds nets: keep `--help` fast

    mode = param.solver_mode if param.HasField("solver_mode") else None
    backend = pick_backend(args.gpu, mode, param.device_id, warn=log.warning, where=args.solver)
    return Solver(param, args.solver, backend=backend, memory=args.memory, pool_bytes=parse_size(args.gpu_memory),
                  log=log, precision=args.precision, data_workers=args.data_workers)


def train(args, param, make_solver, root: bool = True) -> int:
    """Caffe's train: build the solver (`make_solver(log)`), fine-tune from --weights or the solver's
    `weights:`, resume from --snapshot, solve. `root`: this process logs (data-parallel ranks other than 0
    do not)."""
    import contextlib
    import os

    with contextlib.ExitStack() as stack:
        sink = None if root else stack.enter_context(open(os.devnull, "w"))
        sinks = []
        if root and getattr(args, "tensorboard", None):
            from superneurons.runtime.tensorboard import TensorBoardScalars

            sinks.append(TensorBoardScalars(args.tensorboard))
        log = stack.enter_context(TrainLog(args.log, args.log_json, sinks=sinks) if root else TrainLog(stream=sink))
        solver = make_solver(log)
        solver.signals = SignalEffects(getattr(args, "sigint_effect", DEFAULT_SIGINT),
                                       getattr(args, "sighup_effect", DEFAULT_SIGHUP), say=log.warning)
        progress = TrainProgress(param.max_iter, log.stream,
                                 enabled=None if args.progress and root else False)
        progress.attach(solver, log)
        # The solver's own `weights:` entries (Caffe >= 1.0) apply unless the flag or a resume says otherwise.
        weights = args.weights or ("" if args.snapshot else ",".join(param.weights))
        if weights:
            log.info(f"Finetuning from {weights}")
            solver.load_weights(weights)
        if args.snapshot:
            log.info(f"Resuming from {args.snapshot}")
        with progress:
            solver.solve(resume=args.snapshot)
    return 0
