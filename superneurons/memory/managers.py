"""Runtime memory managers: execute a plan's per-step actions on the Net's pool, one module per mode.

- `LivenessManager` (`liveness_manager.py`): allocate before first use, free after last use; places
  or streams the parameters.
- `OffloadManager` (`offload_manager.py`): liveness, plus the Tensor Cache of checkpoint outputs and
  asynchronous copies to the host store.
- `RecomputeManager` (`recompute_manager.py`): offload, plus dropping and replaying forward steps.
"""
from __future__ import annotations

from superneurons.memory.liveness_manager import LivenessManager
from superneurons.memory.offload_manager import OffloadManager, _without_moves
from superneurons.memory.recompute_manager import RecomputeManager

MANAGERS = {"liveness": LivenessManager, "offload": OffloadManager, "recompute": RecomputeManager}

__all__ = ["MANAGERS", "LivenessManager", "OffloadManager", "RecomputeManager", "_without_moves"]
