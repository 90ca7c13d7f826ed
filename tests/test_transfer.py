"""The offload path's moving parts on the CPU: lagging copies, the host store, the allocator switch, the
pool-backed convolution workspace, the counters, memory options and error messages. The same manager code
runs on the GPU (backend/cuda/transfer.py); tests/test_gpu_memory.py checks it there."""
from __future__ import annotations

import numpy as np
import pytest

from superneurons.backend.cpu import CpuBackend
from superneurons.backend.cpu.transfer import CpuTransfer
from superneurons.errors import PoolExhausted, UserError
from superneurons.memory import resolve_memory
from superneurons.memory.offload import HostStore
from superneurons.memory.plan import make_plan
from superneurons.memory.pool import HeapPool, MallocPool
from superneurons.memory.workspace import PoolWorkspace
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net
from test_memory_modes import CONV_FAN, _graph, _mlp_with_loss, train

CPU = CpuBackend()


def test_lagging_copies_complete_in_order_after_n_polls():
    tr = CpuTransfer(lag=2)
    src = np.arange(4, dtype=np.float32)
    a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
    ea, eb = tr.to_host(src, a), tr.to_host(src * 2, b)
    assert not ea.query() and not a.any()  # first poll: still in flight, nothing copied
    assert not eb.query() and eb.query()  # the second copy's N-th poll runs the stream up to it, the first too
    assert ea.complete and (a == src).all() and (b == src * 2).all()
    c = np.zeros(4, np.float32)
    tr.join(tr.to_device(src, c))  # compute waits for the copy: it has landed
    assert (c == src).all()


def test_host_store_save_load_cancel_with_lag():
    store = HostStore(1 << 16, CPU)
    store.transfer.lag = 3
    dev = np.arange(256, dtype=np.float32)
    store.save("x", dev)
    assert "x" in store and store.saving("x")
    store.settle("x")
    assert store.poll() == ["x"] and not store.saving("x")
    out = np.zeros_like(dev)
    store.load("x", out)
    assert "x" not in store and not out.any()  # the host copy is given up at once, the bytes land later
    store.ready("x")
    assert (out == dev).all()
    store.save("y", dev)
    store.cancel("y")  # the device copy stayed valid: the host block goes once the copy has read... finished
    assert "y" not in store
    store.drain()
    assert store.pool.used_bytes == 0 and not store.busy


@pytest.mark.parametrize("lag", [1, 3])
def test_every_mode_is_byte_identical_with_lagging_copies(monkeypatch, lag):
    # Copies that finish late: a block freed before its copy ends, or a tensor read before its prefetch
    # is joined, would change the weights.
    monkeypatch.setenv("SUPERNEURONS_TRANSFER_LAG", str(lag))
    text = CONV_FAN
    _, ref, ref_losses = train(text, "baseline")
    plan = make_plan(_graph(text), plan_backward=False)
    params = Net(_graph(text), CPU, memory="liveness").memory.param_bytes
    for mode in ("offload", "recompute"):
        for pool in (None, params + plan.peak("liveness")[0] - 1024):
            net, got, losses = train(text, mode, pool_bytes=pool)
            assert got == ref and losses == ref_losses, f"{mode}, pool {pool}, lag {lag}"
            assert not net.memory.leaving and not net.memory.host.busy  # nothing in flight between iterations


def test_without_the_cache_every_planned_move_happens_and_the_trace_is_the_plans(monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_CACHE", "0")
    text = CONV_FAN
    _, ref, _ = train(text, "baseline", iters=2)
    net, got, _ = train(text, "offload", iters=2)
    plan = make_plan(_graph(text), plan_backward=False)
    assert got == ref
    assert net.memory.trace == plan.traces["offload"].bytes
    moved = net.memory.stats()
    planned = sum(plan.program.tensors[k].nbytes for k in plan.schedules["offload"].info["offloaded"])
    assert moved["iteration"]["bytes_offloaded"] == moved["iteration"]["bytes_prefetched"] == planned > 0
    assert moved["total"]["bytes_offloaded"] == 2 * planned


def test_counters_per_iteration_and_total():
    text = CONV_FAN
    plan = make_plan(_graph(text), plan_backward=False)
    params = Net(_graph(text), CPU, memory="liveness").memory.param_bytes
    net, _, _ = train(text, "offload", iters=3, pool_bytes=params + plan.peak("liveness")[0] - 1024)
    s = net.memory.stats()
    assert set(s) == {"iteration", "total"}
    for k in ("bytes_offloaded", "bytes_prefetched", "hits", "misses"):
        assert 0 <= s["iteration"][k] <= s["total"][k]
    assert 0 < s["iteration"]["bytes_offloaded"] < s["total"]["bytes_offloaded"]
    fits, _, _ = train(text, "offload")
    assert fits.memory.stats()["total"]["bytes_offloaded"] == 0  # the net fits: nothing moves
    assert Net(_graph(text), CPU).memory.stats()["total"]["bytes_prefetched"] == 0  # baseline reads as zeros


def test_malloc_allocator_trains_identically(monkeypatch):
    _, ref, _ = train(CONV_FAN, "baseline")
    monkeypatch.setenv("SUPERNEURONS_ALLOCATOR", "malloc")
    for mode in ("baseline", "liveness", "offload", "recompute"):
        net, got, _ = train(CONV_FAN, mode)
        assert isinstance(net.pool, MallocPool) and got == ref, mode
    monkeypatch.setenv("SUPERNEURONS_ALLOCATOR", "slab")
    with pytest.raises(UserError, match="SUPERNEURONS_ALLOCATOR='slab': expected one of pool, malloc"):
        train(CONV_FAN, "baseline")


def test_malloc_pool_enforces_the_budget():
    pool = MallocPool(4096, CPU)
    pool.alloc("a", 3000)
    with pytest.raises(PoolExhausted, match="need 2.0 KiB"):
        pool.alloc("b", 1025)
    pool.free("a")
    assert pool.used_bytes == 0 and pool.largest_free() == 4096


def test_pool_workspace_borrows_the_largest_free_extent():
    pool = HeapPool(16 * 1024, CPU)
    pool.alloc("a", 4096)
    pool.alloc("b", 4096)
    pool.free("a")  # free: [0, 4K) and [8K, 16K)
    ws = PoolWorkspace(pool)
    assert ws.available() == 8192 == pool.largest_free()
    ptr = ws.acquire(5000)
    assert ptr == pool.arena.ctypes.data + 8192 and pool.used_bytes == 4096 + 5120
    ws.release()
    assert pool.used_bytes == 4096 and ws.acquire(0) == 0
    with pytest.raises(PoolExhausted):
        ws.acquire(9000)


def test_memory_param_gives_mode_checkpoints_and_pool():
    mp = pb.MemoryParameter(mode=pb.MemoryParameter.RECOMPUTE, pool_bytes=123 << 20, checkpoint_type=["Pooling"])
    assert resolve_memory(None, mp) == ("recompute", ("Pooling",), 123 << 20)
    assert resolve_memory("liveness", mp, ["Convolution"]) == ("liveness", ("Convolution",), 123 << 20)
    assert resolve_memory(None, None) == ("auto", ("Convolution",), None)  # MemoryParameter's default
    net = Net(_graph(CONV_FAN), CPU, memory=None, memory_param=mp)
    assert net.memory.name == "recompute" and net.memory.checkpoint_types == ("Pooling",)
    assert net.pool.capacity == 123 << 20


def test_pool_too_small_for_the_parameters_says_setup(monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "0")  # resident parameters: they fail to fit at setup
    with pytest.raises(UserError) as e:
        Net(_graph(_mlp_with_loss()), CPU, memory="liveness", pool_bytes=2048)
    assert "cannot train this net" in str(e.value) and "20480 bytes of parameters" in str(e.value)
    monkeypatch.delenv("SUPERNEURONS_PARAM_OFFLOAD")
    # Streamed parameters need only the largest step's own: the error names that layer and its bytes (its
    # activations, 3072, and the net's resident scratch region, 1024 after rounding) and the total.
    with pytest.raises(UserError) as e:
        Net(_graph(_mlp_with_loss()), CPU, memory="liveness", pool_bytes=2048)
    msg = str(e.value)
    assert "'fc3' (backward) needs 4096 bytes" in msg and "4096 bytes of its parameters streamed in" in msg
    assert "= 8192 bytes" in msg


def test_pool_below_the_largest_layer_fails_before_training(monkeypatch):
    monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "0")
    text = _mlp_with_loss()
    plan = make_plan(_graph(text), plan_backward=False)
    params = Net(_graph(text), CPU, memory="liveness").memory.param_bytes
    s, need = plan.max_layer
    with pytest.raises(UserError) as e:
        Net(_graph(text), CPU, memory="recompute", pool_bytes=params + need - 1024)
    msg = str(e.value)
    assert repr(plan.program.steps[s].node.name) in msg and str(need) in msg and str(params + need) in msg
