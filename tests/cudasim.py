"""Test files that check numba-cuda kernels under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1, no GPU needed).

numba picks the simulator once per process, when it is first imported, so these tests run in a pytest run of
their own with the variable set from the start, as `make test` does beside the main run:

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


class _BareDevice:
    """A device without cuDNN, cuBLAS or streams, and without memory of its own: simulated ops run through their
    real module (flat, reshape, scalar, bits work on the simulator's arrays) and take their float64 sums from the
    scratch region the caller passes (`scratch=`), as a Net's layers do; an op that reached for the device for
    anything else would fail here."""


def activate_bare_device() -> None:
    """Make backend/cuda/device.py's current() a _BareDevice."""
    from superneurons.backend.cuda import device

    device.activate(_BareDevice())
