"""How much pinned host memory a run may take: the bound `auto` weighs its plans against (memory/cost.py).

Offload and recomputation pin host memory for the tensors that leave the device, and streamed parameters
live there with their gradients and solver history. Pinned memory cannot be swapped, so a plan that would
pin more than the machine can spare fails midway, when a chunk cannot be pinned. `auto` therefore weighs
only plans whose bound (`MemoryPlan.host_bytes`) stays within `host_limit()`.
"""
from __future__ import annotations

import os

from superneurons import settings

# The share of the machine's RAM a run may pin by default: the OS, the process itself (the dataset, NumPy,
# the CUDA context) and the decode workers need the rest.
HOST_FRACTION = 0.8


def host_memory_bytes() -> int:
    """This machine's RAM: MemTotal of /proc/meminfo, else os.sysconf's physical pages x page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_limit() -> int:
    """SUPERNEURONS_HOST_MEMORY_MB when set, else HOST_FRACTION of this machine's RAM, in bytes."""
    mib = settings.get("SUPERNEURONS_HOST_MEMORY_MB")
    return mib << 20 if mib is not None else int(host_memory_bytes() * HOST_FRACTION)
