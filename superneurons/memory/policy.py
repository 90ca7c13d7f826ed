"""The memory policy switches of the solver's `memory_param` (MemoryParameter), with the environment
variables that override them for diagnostics (superneurons/settings.py) applied."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from superneurons import settings
from superneurons.proto import superneurons_pb2 as pb


@dataclass(frozen=True)
class MemoryPolicy:
    fuse_layers: bool = True  # graph/fuse.py runs (read by graph.build)
    diff_alias: bool = True  # memory/aliases.py shares gradients (read through the Graph)
    tensor_cache: bool = True  # offload keeps on the device what fits
    allocator: str = "pool"  # memory/pool.ALLOCATORS
    param_offload: bool | None = None  # None: stream the parameters only when they do not fit


def memory_policy(memory_param: Any = None) -> MemoryPolicy:
    """The policy of `memory_param` (None: MemoryParameter's defaults), where no environment variable
    overrides a field; the variables are read now."""
    p = memory_param if memory_param is not None else pb.MemoryParameter()
    allocator = pb.MemoryParameter.Allocator.Name(p.allocator).lower()
    return MemoryPolicy(
        fuse_layers=settings.override("SUPERNEURONS_FUSE", p.fuse_layers),
        diff_alias=settings.override("SUPERNEURONS_DIFF_ALIAS", p.diff_alias),
        tensor_cache=settings.override("SUPERNEURONS_CACHE", p.tensor_cache),
        allocator=settings.override("SUPERNEURONS_ALLOCATOR", allocator),
        param_offload=settings.override("SUPERNEURONS_PARAM_OFFLOAD",
                                        p.param_offload if p.HasField("param_offload") else None),
    )
