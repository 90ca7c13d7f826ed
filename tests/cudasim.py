"""Test files that check numba-cuda kernels under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1, no GPU needed).

numba picks the simulator once per process, when it is first imported; a normal test run has imported it
for real long before such a file is collected. So each file has one test that reruns the file in a child
process with the simulator on (`rerun_under_simulator`), and marks its other tests `simulated` (they run only
in that child):

    from cudasim import IN_SIMULATOR, rerun_under_simulator, simulated

    if not IN_SIMULATOR:
        def test_my_kernels_under_simulator():
            rerun_under_simulator(__file__)
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from numba import config

IN_SIMULATOR = bool(config.ENABLE_CUDASIM)
simulated = pytest.mark.skipif(not IN_SIMULATOR, reason="runs in this file's rerun under the CUDA simulator")


def rerun_under_simulator(path: str, timeout: float = 900) -> None:
    """Run the test file at `path` (its gpu-marked tests left out) in a child process with the simulator on;
    every test there must pass, none may be skipped."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", path],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
