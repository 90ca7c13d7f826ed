"""Fixtures shared by the test modules."""
from __future__ import annotations

import os
import signal
import zlib

import numpy as np
import pytest

# Reproduce a failing random test with `pytest --rng-seed N` or TEST_RNG_SEED=N (the seed its report printed).
SEED_ENV = "TEST_RNG_SEED"


def pytest_configure(config):
    # A suite started in the background by a shell without job control (`make test &` in a script) inherits
    # SIGINT ignored, and so does every process it starts until that process sets a handler: a Ctrl-C test
    # whose signal lands early in a child's start-up would then wait forever. Run as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    import gpu_harness

    gpu_harness.set_storage(config.getoption("--storage"))


def pytest_addoption(parser):
    parser.addoption("--storage", default="fp32", choices=("fp32", "bf16", "fp16"),
                     help="the GPU op tests (gpu_harness.run_both, dev) store their arrays in this type: every op's "
                          "half path against the CPU backend's on the same half inputs")
    parser.addoption("--rng-seed", type=int, default=None,
                     help=f"seed every test's `rng` fixture with this value (default: a CRC of the test's node id; "
                          f"also settable with {SEED_ENV})")


@pytest.fixture(scope="module")
def gpu():
    """The CUDA backend with FMA convolution math (cuDNN's default TF32 would be ~1e-3 off the CPU).
    Only requested by gpu-marked tests, which are skipped where there is no GPU."""
    from superneurons.backend.cuda import CudaBackend

    return CudaBackend(0, tf32=False)


@pytest.fixture(autouse=True, scope="module")
def _device_stand_in_per_file():
    """Under the CUDA simulator every *_sim.py file runs in the same worker processes (`make test`): a device
    stand-in that one file activates (tests/cudasim.py) is put back to the one before when its tests end."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") in ("", "0"):
        yield
        return
    from superneurons.backend.cuda import device

    before = device._current
    yield
    device._current = before


def rng_seed(config, nodeid: str) -> int:
    """--rng-seed, else TEST_RNG_SEED, else a CRC-32 of the node id: the same on every run and machine, and
    independent of PYTHONHASHSEED (which salts Python's hash())."""
    chosen = config.getoption("--rng-seed")
    if chosen is None and os.environ.get(SEED_ENV, "").strip():
        chosen = int(os.environ[SEED_ENV])
    return zlib.crc32(nodeid.encode()) if chosen is None else chosen


@pytest.fixture
def rng(request):
    """A NumPy generator with a per-test seed; a failing test's report shows the seed and how to rerun with it."""
    seed = rng_seed(request.config, request.node.nodeid)
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, seed in item.user_properties:
            if name == "rng_seed":
                report.sections.append(
                    ("rng seed", f"{seed} (rerun with --rng-seed {seed} or {SEED_ENV}={seed})"))


def pytest_collection_modifyitems(config, items):
    """Tests marked `simulator` run only in a process that started numba under the CUDA simulator
    (NUMBA_ENABLE_CUDASIM=1, tests/cudasim.py): elsewhere they are deselected, not skipped."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        return
    chosen, simulated = [], []
    for item in items:
        (simulated if item.get_closest_marker("simulator") else chosen).append(item)
    if simulated:
        config.hook.pytest_deselected(items=simulated)
        items[:] = chosen
