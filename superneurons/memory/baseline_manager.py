"""The baseline manager: every tensor allocated up front and kept for the whole run, the reference every
other mode must match byte for byte."""
from __future__ import annotations

from superneurons.errors import UserError
from superneurons.memory.interface import MemoryManager
from superneurons.memory.pool import format_bytes


class BaselineManager(MemoryManager):
    name = "baseline"  # nothing moves; checkpoint types are only reported, like the other modes'
    static_placement = True

    def setup(self) -> None:
        net = self.net
        need = net.baseline_bytes()
        if need > net.pool.capacity:  # say so before anything is placed, with the bytes a mode would need
            raise UserError(f"a {net.pool.capacity}-byte pool ({format_bytes(net.pool.capacity)}) cannot train "
                            f"{net.name or 'this net'} under --memory baseline, which holds every tensor at once: "
                            f"{need} bytes ({format_bytes(need)}); give a larger pool/--gpu-memory or --memory auto")
        for t in net.tensors:
            if t.base is None:
                net.materialize(t)
        for t in net.tensors:
            if t.base is not None:
                net.materialize(t)
