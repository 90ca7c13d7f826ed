"""The memory modes' managers (memory/interface.py's MemoryManager), one module per mode.

- `BaselineManager` (`baseline_manager.py`): every tensor placed at setup; nothing moves.
- `LivenessManager` (`liveness_manager.py`): allocate before first use, free after last use; places
  or streams the parameters.
- `OffloadManager` (`offload_manager.py`): liveness, plus the Tensor Cache of checkpoint outputs and
  asynchronous copies to the host store.
- `RecomputeManager` (`recompute_manager.py`): offload, plus dropping and replaying forward steps.
"""
from __future__ import annotations

from superneurons.memory.baseline_manager import BaselineManager
from superneurons.memory.interface import MemoryManager
from superneurons.memory.liveness_manager import LivenessManager
from superneurons.memory.offload_manager import OffloadManager, _without_moves
from superneurons.memory.recompute_manager import RecomputeManager

MANAGERS: dict[str, type[MemoryManager]] = {"baseline": BaselineManager, "liveness": LivenessManager,
                                             "offload": OffloadManager, "recompute": RecomputeManager}

__all__ = ["MANAGERS", "BaselineManager", "LivenessManager", "OffloadManager", "RecomputeManager", "_without_moves"]
