"""Flags shared by the commands that run a net: --gpu, --memory, --gpu-memory, --data-workers."""
from __future__ import annotations

import argparse
import re

from superneurons.errors import UserError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str | None) -> int | None:
    """'12G', '512M', '1.5GiB' or a byte count -> bytes; None stays None."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise UserError(f"cannot read memory size {text!r}; use a number with an optional unit, e.g. 12G or 512M")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


MEMORY_HELP = "memory mode: baseline, liveness, offload, recompute or auto"


def add_device_options(p: argparse.ArgumentParser, gpu: bool = True, memory_default: str | None = "auto",
                       memory_help: str = f"{MEMORY_HELP} (default auto: the cheapest that fits the pool)") -> None:
    """--gpu (unless the command has its own), --memory, --gpu-memory and --data-workers."""
    if gpu:
        p.add_argument("--gpu", help="GPU id to run on (default: the CPU)")
    p.add_argument("--memory", default=memory_default, help=memory_help)
    add_gpu_memory(p)
    p.add_argument("--data-workers", metavar="N", type=_data_workers, dest="data_workers",
                   help="decode worker processes per Data/ImageData layer, over their decode_workers "
                        "(default: one per CPU core; 0 or 1: a thread in this process; same batches either way)")


def _data_workers(text: str) -> int:
    """--data-workers N: applies to every data layer built afterwards in this process."""
    from superneurons.data.workers import request_workers

    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"takes a number of workers (0 or more), got {text!r}")
    request_workers(int(text))
    return int(text)


def add_gpu_memory(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="size of the device memory pool, e.g. 12G or 512M (default: on the GPU its free memory "
                        "minus a margin, on the CPU what the net needs)")


def make_backend(args):
    from superneurons.backend import get_backend

    if getattr(args, "gpu", None) not in (None, "", "-1"):
        try:
            device = int(str(args.gpu).split(",")[0])
        except ValueError:
            raise UserError(f"--gpu takes a device number, got {args.gpu!r}") from None
        return get_backend("cuda", device)
    return get_backend("cpu")
