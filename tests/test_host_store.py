"""The offload host store pins host memory chunk by chunk as tensors leave the device (memory/offload.py:
HostChunks): nothing when nothing leaves, a clear error when the pinned allocation fails, and the same
bytes back whichever chunk holds them. CHUNK is made small here so that several chunks are exercised."""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.backend.cpu import CpuBackend
from superneurons.errors import UserError
from superneurons.memory import offload
from superneurons.memory.offload import HostChunks, HostMemoryError, HostStore, host_store_limit
from superneurons.memory.plan import make_plan
from superneurons.runtime.net import Net
from test_memory_modes import CONV_FAN, _graph, train

CPU = CpuBackend()
KiB = 1024


class PinFailed(Exception):
    """Stands in for numba's CudaAPIError from cuMemHostAlloc (not a RuntimeError or MemoryError)."""


def fail_pinning_past(store: HostStore, nbytes: int) -> list[int]:
    """Make `store`'s pinned allocations fail once more than `nbytes` would be pinned; returns the sizes
    asked for (failed ones included)."""
    asked: list[int] = []
    real = store.transfer.arena

    def arena(n: int):
        asked.append(n)
        if sum(asked) > nbytes:
            asked[-1] = 0  # nothing was pinned
            raise PinFailed(f"cuMemHostAlloc failed: CUDA_ERROR_OUT_OF_MEMORY ({n} bytes)")
        return real(n)

    store.transfer.arena = arena
    return asked


def tight_pool(text: str) -> int:
    """One block under liveness's peak: offload must move tensors."""
    plan = make_plan(_graph(text), plan_backward=False)
    return Net(_graph(text), CPU, memory="liveness").memory.param_bytes + plan.peak("liveness")[0] - KiB


def test_chunks_are_added_only_when_needed(monkeypatch):
    monkeypatch.setattr(offload, "CHUNK", 4 * KiB)
    store = HostStore(None, CPU)
    assert store.pinned_bytes == 0  # nothing pinned up front
    dev = np.ones(256, np.float32)  # 1 KiB
    for i in range(4):
        store.save(f"a{i}", dev)
    assert [c.capacity for c in store.pool.chunks] == [4 * KiB]  # four fit one chunk
    store.save("b", dev)
    assert store.pinned_bytes == 8 * KiB and len(store.pool.chunks) == 2
    store.save("big", np.ones(2560, np.float32))  # 10 KiB: a chunk of its own size
    assert [c.capacity for c in store.pool.chunks] == [4 * KiB, 4 * KiB, 10 * KiB]
    store.drop("a1")
    store.save("c", dev)  # first fit: the hole in the first chunk
    assert store.pool.chunks[0].owns("c") and store.pinned_bytes == 18 * KiB
    assert store.pool.used_bytes == 15 * KiB


def test_the_limit_bounds_the_rounding_up_not_a_save(monkeypatch):
    monkeypatch.setattr(offload, "CHUNK", 4 * KiB)
    store = HostStore(6 * KiB, CPU)
    dev = np.ones(256, np.float32)
    store.save("a", dev)
    store.save("b", np.ones(768, np.float32))
    store.save("c", dev)  # the first chunk is full; only 2 KiB of the limit are left
    assert [c.capacity for c in store.pool.chunks] == [4 * KiB, 2 * KiB]
    store.save("d", np.ones(768, np.float32))  # past the limit, it still gets exactly its own bytes
    assert [c.capacity for c in store.pool.chunks] == [4 * KiB, 2 * KiB, 3 * KiB]
    assert host_store_limit([1, 1024, 1025]) == 4 * KiB  # whole blocks


@pytest.mark.parametrize("lag", [0, 3])
def test_many_tensors_round_trip_across_chunks(monkeypatch, rng, lag):
    monkeypatch.setattr(offload, "CHUNK", 16 * KiB)
    store = HostStore(None, CPU)
    store.transfer.lag = lag
    dtypes = (np.float32, np.float16, np.int32, np.uint8, np.float64)
    tensors = {f"t{i}": rng.standard_normal(int(rng.integers(1, 3000))).astype(dtypes[i % len(dtypes)])
               for i in range(60)}
    expect = {k: v.tobytes() for k, v in tensors.items()}
    for k, v in tensors.items():
        store.save(k, v)
    store.drain()
    assert len(store.pool.chunks) > 3 and all(k in store for k in tensors)
    for v in tensors.values():
        v[...] = 0  # the device copies are gone: only the host copies hold the bytes
    keys = list(tensors)
    for k in keys[::2]:  # half come back (their blocks retire once the copy has read them)...
        store.load(k, tensors[k])
        store.ready(k)
    for k in keys[1::4]:
        store.drop(k)  # ...a quarter die on the host...
    store.drain()
    pinned = store.pinned_bytes
    for k in keys[::2]:  # ...and what came back leaves again, into the freed blocks
        store.save(k, tensors[k])
    store.drain()
    assert store.pinned_bytes == pinned
    for k in keys[::2] + keys[3::4]:
        tensors[k][...] = 0
        store.load(k, tensors[k])
        store.ready(k)
        assert tensors[k].tobytes() == expect[k], k
    store.drain()
    assert store.pool.used_bytes == 0 and not store.busy and not any(k in store for k in keys)


def test_failing_pinned_allocation_names_the_bytes_and_what_to_do(monkeypatch):
    monkeypatch.setattr(offload, "CHUNK", 4 * KiB)
    store = HostStore(None, CPU)
    asked = fail_pinning_past(store, 8 * KiB)
    kept = np.arange(1024, dtype=np.float32)  # 4 KiB
    store.save("kept", kept)
    store.save("also", np.ones(256, np.float32))
    with pytest.raises(HostMemoryError) as e:
        store.save("conv9", np.ones(1280, np.float32))  # 5 KiB: a third chunk past what can be pinned
    assert isinstance(e.value, UserError) and isinstance(e.value.__cause__, PinFailed)
    msg = str(e.value)
    assert "could not pin 5120 bytes" in msg and "'conv9'" in msg and "8192 bytes (8.0 KiB) already pinned" in msg
    assert "CUDA_ERROR_OUT_OF_MEMORY" in msg
    assert "smaller batch" in msg and "more host memory" in msg and "--memory recompute" in msg
    assert asked == [4 * KiB, 4 * KiB, 0] and store.pinned_bytes == 8 * KiB and "conv9" not in store
    out = np.zeros_like(kept)
    store.load("kept", out)  # what was saved before the failure is intact
    store.ready("kept")
    assert (out == kept).all()


def test_offload_in_a_tight_pool_matches_baseline_across_many_chunks(monkeypatch):
    monkeypatch.setattr(offload, "CHUNK", 2 * KiB)
    monkeypatch.setenv("SUPERNEURONS_TRANSFER_LAG", "2")
    _, ref, ref_losses = train(CONV_FAN, "baseline")
    net, got, losses = train(CONV_FAN, "offload", pool_bytes=tight_pool(CONV_FAN))
    assert got == ref and losses == ref_losses
    host, stats = net.memory.host, net.memory.stats()
    assert net.memory.bytes_offloaded > 0 and len(host.pool.chunks) > 1
    assert stats["total"]["host_pinned_bytes"] == host.pinned_bytes == sum(c.capacity for c in host.pool.chunks)
    assert stats["iteration"]["host_pinned_bytes"] == 0  # chunks pinned in the first iteration are reused
    assert host.pinned_bytes <= host.pool.limit
    fits, _, _ = train(CONV_FAN, "offload")  # the net fits: nothing leaves, nothing is pinned
    assert fits.memory.host.pinned_bytes == 0 and fits.memory.stats()["total"]["host_pinned_bytes"] == 0


def test_pinning_failure_mid_training_is_a_user_error_and_keeps_the_snapshots(tmp_path, monkeypatch):
    # Without the cache every planned move happens, so the host store is used every iteration. After the
    # 4th iteration its chunks are swapped for ones that cannot be pinned: the 5th fails, and snapshot 4
    # resumes to the weights the 4th iteration left.
    from test_solver import Quiet, solver_param

    from superneurons.solver import Solver
    from superneurons.solver.snapshot import snapshot_paths

    monkeypatch.setenv("SUPERNEURONS_CACHE", "0")
    monkeypatch.chdir(tmp_path)
    net = ('name: "c" layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param { '
           'data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } '
           'shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }\n' + CONV_FAN.split("\n", 1)[1])
    text = 'base_lr: 0.01 momentum: 0.9 max_iter: 6 snapshot: 2 snapshot_prefix: "snap/f" random_seed: 5'

    def make_solver(text):
        return Solver(solver_param(text, net=net), "s.prototxt", memory="offload", log=Quiet())

    solver = make_solver(text)
    at_4: list[bytes] = []

    def no_more_pinning(s, it, loss):
        if it == 4:
            host = s.net.memory.host
            at_4.extend(d.data.tobytes() for d in s.net.learnable)  # what snapshot 4 is about to hold
            assert host.pinned_bytes > 0 and host.pool.used_bytes == 0  # used, and empty between iterations
            host.pool = HostChunks(host.transfer, host.pool.limit)
            fail_pinning_past(host, 0)

    solver.callbacks.append(no_more_pinning)
    with pytest.raises(HostMemoryError) as e:
        solver.solve()
    assert "could not pin" in str(e.value) and solver.iter == 4
    resumed = make_solver(text)
    resumed.restore(snapshot_paths(solver.prefix, 4, False)[1])
    assert resumed.iter == 4 and [d.data.tobytes() for d in resumed.net.learnable] == at_4 != []
