"""The Backend protocol (backend/base.py) is what the runtime asks of a backend: both backends provide all of
it, and the packages above backend/ neither import a backend nor test a backend's name."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from superneurons.backend.base import Backend, Transfer, WorkspaceSource
from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cpu.transfer import CpuTransfer
from superneurons.backend.cuda import CudaBackend  # the class imports without a GPU; only its constructor needs one
from superneurons.memory.pool import HeapPool
from superneurons.memory.workspace import PoolWorkspace

PACKAGE = Path(__file__).resolve().parent.parent / "superneurons"


def members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def test_both_backends_provide_every_member_of_the_protocol():
    cpu = CpuBackend()
    assert members(Backend) >= {"arena", "view", "address", "device_memory", "make_transfer",
                                "set_workspace_source", "release_freed", "asynchronous", "synchronize",
                                "make_stream", "compute_waits", "compute_event"}
    assert sorted(m for m in members(Backend) if not hasattr(cpu, m)) == []
    instance_only = {"ops"}  # set by CudaBackend.__init__, which needs a GPU
    assert sorted(m for m in members(Backend) - instance_only if not hasattr(CudaBackend, m)) == []
    assert sorted(m for m in members(Transfer) if not hasattr(CpuTransfer, m)) == []
    assert sorted(m for m in members(WorkspaceSource) if not hasattr(PoolWorkspace, m)) == []


def test_the_cpu_backend_answers_as_a_host_backend():
    cpu = CpuBackend()
    assert cpu.device_memory() is None and cpu.asynchronous is False
    a = cpu.view(cpu.arena(4096), 1024, (4, 4), np.float32)
    assert cpu.address(a) == a.ctypes.data
    tr = cpu.make_transfer()
    host = tr.view(tr.arena(1024), 0, (4, 4), np.float32)
    a[...] = np.arange(16, dtype=np.float32).reshape(4, 4)
    tr.to_host(a, host).synchronize()
    assert np.array_equal(host, a)


def test_the_cpu_backend_streams_run_in_program_order_and_time_by_the_host_clock():
    import time

    from superneurons.backend.base import Event, Stream
    from superneurons.backend.cpu.transfer import ClockEvent, DoneStream

    assert sorted(m for m in members(Stream) if not hasattr(DoneStream, m)) == []
    assert sorted(m for m in members(Event) if not hasattr(ClockEvent, m)) == []
    cpu = CpuBackend()
    stream = cpu.make_stream()
    stream.follow_compute()
    assert stream.handle == 0 and stream.record().query()
    start = cpu.compute_event()
    time.sleep(0.02)
    end = cpu.compute_event()
    cpu.compute_waits(end)
    assert 15 <= end.elapsed_ms(start) < 2000


def test_pool_workspace_hands_out_addresses_inside_the_pool():
    cpu = CpuBackend()
    pool = HeapPool(16 * 1024, cpu)
    ws = PoolWorkspace(pool)
    pool.alloc("x", 3000)  # the workspace comes after it
    address = ws.acquire(2048)
    base = cpu.address(pool.arena)
    assert address == base + pool.offset("#workspace") == base + 3072
    ws.release()
    assert not pool.owns("#workspace")


# Every package above backend/ (the entry points cli.py and __init__.py as well).
ABOVE_THE_BACKEND = ("memory", "runtime", "solver", "layers", "graph", "data", "io", "parallel", "commands",
                     "pycaffe", "cli.py", "__init__.py")


def test_no_backend_names_or_imports_above_the_backend_package():
    offenders = []
    name_test = re.compile(r"""\.name\s*[!=]=\s*["'](cuda|cpu|gpu)["']|getattr\([^)]*backend[^)]*["']name["']""")
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.split("/")[0] not in ABOVE_THE_BACKEND:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "superneurons.backend.cuda" in line or "backend.cpu" in line or name_test.search(line):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def test_a_workspace_scope_installs_its_source_for_the_block_and_puts_back_the_last_one():
    """Device.workspace_from's block (backend/cuda/device.py), on a stand-in for the cuDNN handle's holder: the
    source is installed inside the block, the one before is back after it, also when the block raises; None
    leaves whatever is installed."""
    from superneurons.backend.cuda.device import WorkspaceScope  # numba's module imports without a GPU

    holder = SimpleNamespace(workspace_source="default")
    with WorkspaceScope(holder, "pool"):
        assert holder.workspace_source == "pool"
        with WorkspaceScope(holder, None):
            assert holder.workspace_source == "pool"
        with WorkspaceScope(holder, "test net's pool"):
            assert holder.workspace_source == "test net's pool"
        assert holder.workspace_source == "pool"
    assert holder.workspace_source == "default"
    with pytest.raises(RuntimeError):
        with WorkspaceScope(holder, "pool"):
            raise RuntimeError("a convolution failed")
    assert holder.workspace_source == "default"
