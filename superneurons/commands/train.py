"""`superneurons train`: Caffe's `caffe train` (same flags), plus --memory, --gpu-memory, --log, --log-json and
--no-progress."""
from __future__ import annotations

import argparse

from superneurons.backend import get_backend
from superneurons.commands._options import MEMORY_HELP, add_device_options, parse_size
from superneurons.errors import UserError
from superneurons.io.prototxt import read_solver
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.logging import TrainLog
from superneurons.runtime.progress import TrainProgress

EXAMPLES = """examples:
  superneurons train --solver models/lenet/lenet_solver.prototxt
  superneurons train --solver S.prototxt --weights pretrained.caffemodel      # fine-tune
  superneurons train --solver S.prototxt --snapshot lenet_iter_5000.solverstate   # resume
  superneurons train --solver S.prototxt --gpu 0 --log train.log --log-json train.jsonl
  superneurons train --solver S.prototxt --gpu 0 --memory auto --gpu-memory 12G   # train within 12 GiB

Ctrl-C finishes the current iteration, writes a snapshot and stops; resume from it with --snapshot.
On a terminal a progress bar (iterations, iter/s, ETA, smoothed loss) runs below the log lines; it is
left out when stdout is a file or pipe, when CI is set, or with --no-progress.
"""


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a net from a solver prototxt",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--solver", required=True, help="solver prototxt")
    p.add_argument("--snapshot", help=".solverstate to resume training from")
    p.add_argument("--weights", help="comma-separated .caffemodel files to initialize from (fine-tuning)")
    p.add_argument("--gpu", help="GPU id to train on (overrides solver_mode; only one GPU is used)")
    add_device_options(p, gpu=False, memory_default=None,
                       memory_help=f"{MEMORY_HELP} (default: the solver's memory_param.mode, else auto)")
    p.add_argument("--log", help="also append the log lines to this file")
    p.add_argument("--log-json", dest="log_json", help="append one JSON object per display/test result to this file")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (shown only when stdout is a terminal and CI is unset)")
    p.set_defaults(func=run)
    return p


def pick_backend(gpu: str | None, solver_mode: int | None = None, device_id: int = 0):
    """--gpu N wins; else the solver's solver_mode (when it says GPU); else the CPU."""
    if gpu is not None:
        first = gpu.split(",")[0].strip()
        if first == "all":
            first = "0"
        try:
            device = int(first)
        except ValueError:
            raise UserError(f"--gpu {gpu!r}: expected a device number") from None
        return get_backend("cuda", device)
    if solver_mode == pb.SolverParameter.GPU:
        return get_backend("cuda", device_id)
    return get_backend("cpu")


def run(args) -> int:
    from superneurons.solver import Solver  # builds nets: keep `--help` fast

    if args.snapshot and args.weights:
        raise UserError("give --snapshot to resume training or --weights to fine-tune, not both")
    param = read_solver(args.solver)
    mode = param.solver_mode if param.HasField("solver_mode") else None
    backend = pick_backend(args.gpu, mode, param.device_id)
    with TrainLog(args.log, args.log_json) as log:
        solver = Solver(param, args.solver, backend=backend, memory=args.memory,
                        pool_bytes=parse_size(args.gpu_memory), log=log)
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
