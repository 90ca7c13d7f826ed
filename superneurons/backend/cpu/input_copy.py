"""upload_async: how a data layer hands a host batch to the device (here a plain copy; the CUDA twin
goes through pinned memory on a copy stream so the host does not wait)."""
from __future__ import annotations

import numpy as np

from superneurons.backend.cpu.basic import upload

__all__ = ["upload_async"]


def upload_async(dst: np.ndarray, host: np.ndarray) -> None:
    """Copy `host` into `dst`; `host` may be reused as soon as this returns, and work queued after
    this call sees the new values."""
    upload(dst, host)
