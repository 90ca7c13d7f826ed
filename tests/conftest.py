"""Fixtures shared by the test modules."""
from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def gpu():
    """The CUDA backend with FMA convolution math (cuDNN's default TF32 would be ~1e-3 off the CPU).
    Only requested by gpu-marked tests, which are skipped where there is no GPU."""
    from superneurons.backend.cuda import CudaBackend

    return CudaBackend(0, tf32=False)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name and the process's hash seed: fresh random data per test."""
    return np.random.default_rng(abs(hash(request.node.name)) % (1 << 32))
