"""The resumable position of a data layer whose batch k is a pure function of k.

The whole position is the number of batches served: `state()` returns it and `restore()` sets it;
a solver stores it in its snapshot's sidecar, so a resumed run sees the batches an uninterrupted
one would.
"""
from __future__ import annotations

import numpy as np


class BatchPosition:
    """Mixin for a Layer: `next_batch` is the index of the batch the next forward serves."""

    next_batch: int = 0

    def state(self) -> dict[str, int]:
        """The layer's position: how many batches it has served."""
        return {"batch": self.next_batch}

    def restore(self, state: dict[str, int]) -> None:
        """Continue from a position `state()` returned; the next forward serves batch state['batch']."""
        k = state.get("batch") if isinstance(state, dict) else None
        if not isinstance(k, (int, np.integer)) or k < 0:
            raise self.fail(f"cannot restore the data position from {state!r}; expected {{'batch': n}} with n >= 0")
        self.next_batch = int(k)
        self.position_changed()

    def position_changed(self) -> None:
        """Drop whatever belongs to the old position (a subclass's hook)."""
