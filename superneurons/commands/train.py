"""`superneurons train`: Caffe's `caffe train` (same flags, in Caffe's spelling too: `-solver S -gpu 0`), plus
--memory, --gpu-memory, --log, --log-json and --no-progress."""
from __future__ import annotations

import argparse

from superneurons.commands._options import (MEMORY_HELP, add_device_options, parse_size, pick_backend,
                                             split_stages)
from superneurons.errors import UserError
from superneurons.io.prototxt import read_solver
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

The log is Caffe's: glog lines on stderr (`I1124 03:15:49.123456 12345 solver.py:160] ...`), which
Caffe's tools/extra/parse_log.py reads. Ctrl-C (SIGINT) finishes the current iteration, writes a
snapshot and stops (resume with --snapshot); a second Ctrl-C stops at once. `kill -HUP` writes a
snapshot and goes on. --sigint-effect / --sighup-effect change that (stop, snapshot or none).
On a terminal a progress bar (iterations, iter/s, ETA, smoothed loss) runs below the log lines; it is
left out when stderr is a file or pipe, when CI is set, or with --no-progress.
"""


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a net from a solver prototxt",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--solver", required=True, help="solver prototxt")
    p.add_argument("--snapshot", help=".solverstate to resume training from")
    p.add_argument("--weights", help="comma-separated .caffemodel files to initialize from (fine-tuning)")
    p.add_argument("--gpu", help="GPU id to train on, -1 for the CPU (overrides the solver's solver_mode)")
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
    from superneurons.solver import Solver  # builds nets: keep `--help` fast

    if args.snapshot and args.weights:
        raise UserError("give --snapshot to resume training or --weights to fine-tune, not both")
    param = read_solver(args.solver)
    if args.level is not None:  # Caffe's `caffe train -level/-stage` set the solver's train_state
        param.train_state.level = args.level
    if args.stage:
        param.train_state.ClearField("stage")
        param.train_state.stage.extend(split_stages(args.stage))
    mode = param.solver_mode if param.HasField("solver_mode") else None
    sinks = []
    if args.tensorboard:
        from superneurons.runtime.tensorboard import TensorBoardScalars

        sinks.append(TensorBoardScalars(args.tensorboard))
    with TrainLog(args.log, args.log_json, sinks=sinks) as log:
        backend = pick_backend(args.gpu, mode, param.device_id, warn=log.warning, where=args.solver)
        signals = SignalEffects(args.sigint_effect, args.sighup_effect, say=log.warning)
        solver = Solver(param, args.solver, backend=backend, memory=args.memory,
                        pool_bytes=parse_size(args.gpu_memory), log=log, signals=signals)
        progress = TrainProgress(param.max_iter, log.stream, enabled=None if args.progress else False)
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
