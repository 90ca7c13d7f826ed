"""The recompute manager (paper section 3.4): offload, plus dropping non-checkpoint outputs after forward
and replaying forward steps (with `ctx.recomputing` set) where the cost-aware plan says."""
from __future__ import annotations

from superneurons.memory.offload_manager import OffloadManager


class RecomputeManager(OffloadManager):
    name = "recompute"

    def _run(self, w: int) -> None:
        """Replay forward step `w` on the tensors the schedule has just allocated, through the Net's own
        forward path (its streamed parameters come in for it as for the original step)."""
        keys = self.locks[w]
        self._lock(keys, [k for k in keys if k in self.on or k in self.host_keys])
        try:
            self.net.run_forward_step(w, replay=True)
        finally:
            for k in keys:
                self.cache.unlock(k)
        self.replays += 1

    def setup(self) -> None:
        self.replays = 0
        super().setup()
