"""Test files that check numba-cuda kernels under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1, no GPU needed).

numba picks the simulator once per process, when it is first imported, so these tests run in a pytest run of
their own with the variable set from the start, as `make test` does after the main run:

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -q -m "simulator and not gpu" tests/*_sim.py

Each such test carries the `simulator` mark (`simulated` below); a run without the variable deselects them
(tests/conftest.py), so they neither run against the real numba nor show as skipped.

    from cudasim import IN_SIMULATOR, simulated

    @simulated
    def test_my_kernel(): ...
"""
from __future__ import annotations

import pytest
from numba import config

IN_SIMULATOR = bool(config.ENABLE_CUDASIM)
simulated = pytest.mark.simulator


class _ScratchOnly:
    """The one Device service simulated ops may use: float64 scratch (no cuDNN, cuBLAS or streams)."""

    def scratch(self, n):
        from numba import cuda
        import numpy as np

        return cuda.device_array(n, np.float64)


def activate_scratch_device() -> None:
    """Make backend/cuda/device.py's current() a device that only lends scratch, so ops whose kernels need no
    library run under the simulator through their real module (flat, reshape, scalar, bits work on its arrays)."""
    from superneurons.backend.cuda import device

    device.activate(_ScratchOnly())
