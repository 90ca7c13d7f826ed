"""What the commands share: the parser each one starts from; the flags of the commands that run a net
(--gpu, --memory, --gpu-memory, --data-workers, --batch, --input-shape, --level, --stage); the backend
--gpu picks; the net with stand-in inputs."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from superneurons.errors import UserError

MEMORY_HELP = "memory mode: baseline, liveness, offload, recompute or auto"


def add_command(sub, name: str, run: Callable[[argparse.Namespace], int], help: str, examples: str | None = None,
                description: str | None = None) -> argparse.ArgumentParser:
    """The subcommand `name` calling `run`: its one-line help, the longer description above the flags and
    the examples below them, laid out as written."""
    p = sub.add_parser(name, help=help, description=description, epilog=examples,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=run)
    return p


def add_net_state_options(p: argparse.ArgumentParser) -> None:
    """--level and --stage: the NetState that picks a net's include/exclude rules (split_stages reads --stage)."""
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--stage", action="append", default=[], help="a net state stage (repeatable or comma-separated)")


def add_device_options(p: argparse.ArgumentParser, gpu: bool = True, memory_default: str | None = "auto",
                       memory_help: str = f"{MEMORY_HELP} (default auto: the cheapest that fits the pool)") -> None:
    """--gpu (unless the command has its own), --memory, --gpu-memory and --data-workers."""
    if gpu:
        p.add_argument("--gpu", help="GPU id to run on; -1 or leaving it out: the CPU")
    p.add_argument("--memory", default=memory_default, help=memory_help)
    add_gpu_memory(p)
    p.add_argument("--data-workers", metavar="N", type=_data_workers, dest="data_workers",
                   help="decode worker processes per Data/ImageData layer, over their decode_workers "
                        "(default: one per CPU core; 0 or 1: a thread in this process; same batches either way)")


def _data_workers(text: str) -> int:
    """--data-workers N: the commands hand it to the nets they build (RunContext.data_workers)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"takes a number of workers (0 or more), got {text!r}")
    return int(text)


def add_gpu_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="size of the device memory pool, e.g. 12G or 512M (default: on the GPU its free memory "
                        "minus a margin, on the CPU what the net needs)")


def gpu_device(gpu: str) -> int | None:
    """The device `--gpu` names: None for the CPU (-1), the first of a list (0,1), 0 for `all`."""
    first = str(gpu).split(",")[0].strip().lower()
    if first in ("-1", "cpu"):
        return None
    if first == "all":
        return 0
    try:
        return int(first)
    except ValueError:
        raise UserError(f"--gpu takes a device number (or -1 for the CPU), got {gpu!r}") from None


def pick_backend(gpu: str | None, solver_mode: int | None = None, device_id: int = 0,
                 warn: Callable[[str], None] | None = None, where: str = "the solver"):
    """The backend a command runs on, as `caffe` decides it: `--gpu N` runs on GPU N and `--gpu -1` on
    the CPU, whatever the solver says; without --gpu, the solver's `solver_mode: GPU` (device_id) asks for
    a GPU. A GPU that was asked for on the command line and cannot be used is an error; one that only the
    solver file asked for falls back to the CPU with one warning, as a Caffe built without CUDA does."""
    from superneurons.backend import get_backend
    from superneurons.proto import superneurons_pb2 as pb

    if gpu not in (None, ""):
        device = gpu_device(gpu)
        if device is None:
            return get_backend("cpu")
        try:
            return get_backend("cuda", device)
        except UserError as e:
            raise UserError(f"--gpu {gpu}: {e}; run on the CPU with --gpu -1 or without --gpu") from None
    if solver_mode == pb.SolverParameter.GPU:
        try:
            return get_backend("cuda", int(device_id))
        except UserError as e:
            say = warn or (lambda line: print(line, file=sys.stderr, flush=True))
            say(f"{where} asks for solver_mode: GPU, but {e}; running on the CPU (--gpu -1 chooses the CPU "
                "without this warning)")
    return get_backend("cpu")


def split_stages(stages: list[str] | None) -> list[str]:
    """`--stage a --stage b,c` -> [a, b, c] (Caffe's -stage takes a comma-separated list)."""
    return [s.strip() for arg in stages or () for s in arg.split(",") if s.strip()]


def add_precision_option(p: argparse.ArgumentParser) -> None:
    """--precision: the storage type of activations and gradients, in place of the net's defaults."""
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"],
                   help="store activations and gradients in float32, float16 or bfloat16 (math stays float32), "
                        "overriding the net's default_forward_type/default_backward_type; layers that set "
                        "their own forward_type keep it (docs/PRECISION.md)")


def add_input_options(p: argparse.ArgumentParser) -> None:
    """--batch and --input-shape: what `summary`, `memory` and `time` run a net's shapes with."""
    p.add_argument("--batch", type=int, help="override the batch size of the data/input layers")
    p.add_argument("--input-shape", action="append", metavar="BLOB=N,C,H,W",
                   help="the shape of an input blob, repeatable; replaces its data layer (a data layer whose "
                        "source is absent is replaced anyway, with shapes from its own fields)")


def net_state(args, net):
    """The NetState --phase/--level/--stage select in `net`, as build_graph reads them (the net's own state
    fills what the flags leave out)."""
    from superneurons.graph.state import make_state
    from superneurons.proto import superneurons_pb2 as pb

    stages = tuple(split_stages(getattr(args, "stage", None)))
    state = make_state(pb.Phase.Value(getattr(args, "phase", "TRAIN")), getattr(args, "level", 0) or 0,
                       stages or tuple(net.state.stage))
    if not stages and not state.level and net.state.HasField("level"):
        state.level = net.state.level
    return state


def read_model(args, say: Callable[[str], None] | None = None):
    """The net of --model with stand-in inputs (graph/stand_in.py) for the layers of --phase/--level/--stage,
    and --batch applied; says which shapes it assumed, one line each (default: on stderr)."""
    from superneurons.graph.batch import set_batch
    from superneurons.graph.stand_in import parse_input_shapes, stand_in_inputs
    from superneurons.io.prototxt import read_net

    if args.batch is not None and args.batch <= 0:
        raise UserError(f"--batch must be positive, got {args.batch}")
    net = read_net(args.model)
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    for note in stand_in_inputs(net, parse_input_shapes(args.input_shape), args.model, net_state(args, net),
                                batch=args.batch):
        say(f"{args.model}: {note}")
    if args.batch:
        set_batch(net, args.batch)
    return net
