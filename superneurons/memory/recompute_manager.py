"""The recompute manager (paper section 3.4): offload, plus dropping non-checkpoint outputs after forward
and replaying forward steps (with `ctx.recomputing` set) where the cost-aware plan says."""
from __future__ import annotations

from superneurons.memory.offload_manager import OffloadManager


class RecomputeManager(OffloadManager):
    name = "recompute"

    def _run(self, w: int) -> None:
        """Replay forward step `w` on the tensors the schedule has just allocated."""
        net = self.net
        step = net.forward_steps[w]
        keys = self.locks[w]
        self._lock(keys, [k for k in keys if k in self.on or k in self.host_keys])
        # Streamed parameters live on the host between steps: the replay needs the step's weights on the
        # device as the original forward did (on the CPU the host homes would silently stand in for them).
        streamed = net._param_fwd[w] if net._param_fwd is not None else ()
        for store, tensors, _changed in streamed:
            store.acquire(tensors)
        net.ctx.recomputing = True
        try:
            step.node.layer.forward([t.array for t in step.bottoms], [t.array for t in step.tops])
        finally:
            net.ctx.recomputing = False
            for store, tensors, _changed in streamed:
                store.release(tensors)  # a replay changes no parameter: BatchNorm keeps its running sums
            for k in keys:
                self.cache.unlock(k)
        self.replays += 1

    def setup(self) -> None:
        self.replays = 0
        super().setup()
