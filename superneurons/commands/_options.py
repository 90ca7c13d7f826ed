"""Flags shared by the commands that run a net: --gpu, --memory, --gpu-memory."""
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
    """--gpu (unless the command has its own), --memory and --gpu-memory."""
    if gpu:
        p.add_argument("--gpu", help="GPU id to run on (default: the CPU)")
    p.add_argument("--memory", default=memory_default, help=memory_help)
    add_gpu_memory(p)


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
