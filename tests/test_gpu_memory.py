"""The memory runtime on the GPU: every mode trains to baseline's weights, offload really moves
bytes through pinned memory when the budget requires it and nothing when the net fits, the pool's
per-step usage equals the plan's, and the copy streams overlap compute.

Weights are compared within float tolerance, not bit for bit: the pool's free bytes differ between modes,
so cuDNN may pick a different convolution algorithm (the dynamic workspace), which rounds differently.
A broken transfer (a block reused before its copy finished, a tensor read before its prefetch landed)
shows up as a difference many orders of magnitude larger. Convolutions use FMA math (tf32=False).

Every test prints one `REPORT|name|value|detail` line; tools/gpu/memory_acceptance.sh turns them into a table.
Run with `make gpu-test` (or `pytest -q -s -m gpu tests/test_gpu_memory.py`) on a GPU machine.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time

import numpy as np
import pytest
from google.protobuf import text_format

from superneurons import settings
from superneurons.backend.cuda.probe import gpu_available
from superneurons.graph.batch import set_batch
from superneurons.graph.build import build_graph
from superneurons.io.prototxt import read_net
from superneurons.memory.liveness import simulate
from superneurons.memory.managers import _without_moves
from superneurons.memory.plan import make_plan
from superneurons.proto import superneurons_pb2 as pb
from superneurons.runtime.net import Net

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")]

HERE = os.path.dirname(os.path.abspath(__file__))
RESNET50 = os.path.join(HERE, "..", "models", "resnet50", "resnet50_dummy.prototxt")
RESNET_BATCH = int(os.environ.get("SN_ACCEPT_BATCH", "8"))
RESNET_ITERS = int(os.environ.get("SN_ACCEPT_ITERS", "20"))
RTOL = 2e-3  # per parameter tensor: max |w - w_ref| <= RTOL * max(|w_ref|) + 1e-6


def report(name: str, value, detail: str = "") -> None:
    print(f"\nREPORT|{name}|{value}|{detail}", flush=True)


def _layer(name, type_, bottoms, tops, extra=""):
    b = "".join(f' bottom: "{x}"' for x in bottoms)
    t = "".join(f' top: "{x}"' for x in tops)
    return f'layer {{ name: "{name}" type: "{type_}"{b}{t} {extra} }}\n'


W = 'weight_filler { type: "gaussian" std: 0.05 } bias_filler { type: "constant" value: 0.1 }'


def _conv(name, bottom, top, n):
    return _layer(name, "Convolution", [bottom], [top], f"convolution_param {{ num_output: {n} kernel_size: 3 pad: 1 {W} }}")


# Fans and joins (Split + Eltwise + Concat), BatchNorm, in-place ReLU and Dropout, max and average pooling.
SMALL = (
    _layer("data", "DummyData", [], ["data", "label"],
           'dummy_data_param { shape { dim: 8 dim: 3 dim: 32 dim: 32 } shape { dim: 8 } '
           'data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } }')
    + _conv("conv1", "data", "conv1", 16) + _layer("relu1", "ReLU", ["conv1"], ["conv1"])
    + _conv("conva", "conv1", "conva", 16) + _layer("relua", "ReLU", ["conva"], ["conva"])
    + _layer("poolb", "Pooling", ["conv1"], ["poolb"], "pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }")
    + _conv("convb", "poolb", "convb", 16)
    + _layer("sum", "Eltwise", ["conva", "convb"], ["sum"])
    + _layer("bn", "BatchNorm", ["sum"], ["bn"])
    + _layer("relu2", "ReLU", ["bn"], ["bn"])
    + _conv("conv2", "bn", "conv2", 16)
    + _layer("cat", "Concat", ["conv2", "sum"], ["cat"])
    + _layer("pool", "Pooling", ["cat"], ["pool"], "pooling_param { pool: AVE kernel_size: 2 stride: 2 }")
    + _layer("fc1", "InnerProduct", ["pool"], ["fc1"], f"inner_product_param {{ num_output: 32 {W} }}")
    + _layer("drop", "Dropout", ["fc1"], ["fc1"], "dropout_param { dropout_ratio: 0.3 }")
    + _layer("fc2", "InnerProduct", ["fc1"], ["fc2"], f"inner_product_param {{ num_output: 5 {W} }}")
    + _layer("loss", "SoftmaxWithLoss", ["fc2", "label"], ["loss"])
)


def small_graph():
    return build_graph(text_format.Parse('name: "small"\n' + SMALL, pb.NetParameter()), pb.TRAIN)


def resnet_graph():
    net = read_net(RESNET50)
    set_batch(net, RESNET_BATCH)
    return build_graph(net, pb.TRAIN)


class Run:
    """What a training run leaves behind (the Net itself is dropped: its pool is a large device arena)."""

    def __init__(self, net, weights, losses):
        self.mode = net.memory.name
        self.stats = net.memory.stats()
        self.trace = list(getattr(net.memory, "trace", []))
        self.capacity = net.pool.capacity
        self.streamed = bool(getattr(getattr(net.memory, "param_store", None), "offloaded", False))
        self.replays = int(getattr(net.memory, "replays", 0))
        self.recompute_limit = net.memory.recompute_limit
        self.checkpoint_types = tuple(getattr(net, "checkpoint_types", ()))
        self.weights = weights
        self.losses = losses
        memory = net.memory
        self.no_move_trace = (simulate(memory.program, _without_moves(memory.plan.schedules[memory.name])).bytes
                              if hasattr(memory, "plan") else None)
        self.liveness_trace = make_plan(net.graph, plan_backward=False, layout=net.layout).traces["liveness"].bytes


def unconstrained(graph_fn) -> int:
    """A pool with room for baseline and 1 GiB of convolution workspace."""
    plan = make_plan(graph_fn(), plan_backward=False)
    return plan.param_bytes + plan.peak("baseline")[0] + (1 << 30)


def train(gpu, graph_fn, mode, iters, pool_bytes=None, lr=0.002) -> Run:
    """Plain SGD on the GPU from the same seed and data."""
    gc.collect()  # the previous run's Net (and its arena) must be gone first
    net = Net(graph_fn(), gpu, train=True, seed=11, memory=mode,
              pool_bytes=pool_bytes if pool_bytes is not None else unconstrained(graph_fn))
    losses, first = [], None
    for it in range(iters):
        net.ctx.iteration = it
        net.clear_param_diffs()
        losses.append(net.forward_backward())
        sgd_step(net, lr)
        if it == 0:
            first = _weights(gpu, net)
    gpu.synchronize()
    run = Run(net, _weights(gpu, net), losses)
    run.first_weights = first
    del net
    gc.collect()
    return run


def sgd_step(net, lr: float) -> None:
    """w -= lr * dw on the device. Streamed parameters (memory/params.py) live on the host between uses:
    each is brought in, updated and sent home, as the solver's streamed update does."""
    store = getattr(net.memory, "param_store", None)
    streamed = store is not None and store.offloaded
    for decl in net.learnable:
        pair = [decl.data_tensor, decl.diff_tensor]
        if streamed:
            store.acquire(pair)
        net.ops.axpy(-lr, decl.diff, decl.data)
        if streamed:
            store.release(pair, changed=[decl.data_tensor])
    if streamed:
        store.settle()


def _weights(gpu, net) -> list:
    # net.backend reads a streamed parameter's host copy directly
    return [net.backend.to_host(t.array) for t in net.tensors if t.kind == "param" and t.array is not None]


@contextlib.contextmanager
def no_workspace():
    """Every convolution gets zero workspace bytes, in every mode: the algorithm choice then no longer
    depends on what the pool has free, so a difference between modes is the memory runtime's alone."""
    from superneurons.memory.workspace import PoolWorkspace

    saved = PoolWorkspace.available
    PoolWorkspace.available = lambda self: 0
    try:
        yield
    finally:
        PoolWorkspace.available = saved


def weight_error(got, ref) -> tuple[float, int]:
    """(worst relative difference over parameter tensors, index of that tensor)."""
    worst, where = 0.0, -1
    for i, (a, b) in enumerate(zip(got, ref)):
        err = float(np.abs(a.astype(np.float64) - b).max(initial=0)) / (float(np.abs(b).max(initial=0)) + 1e-6)
        if not np.isfinite(err):
            return float("inf"), i  # NaN/inf weights in one run only (or both): never a match
        if err > worst:
            worst, where = err, i
    return worst, where


def assert_weights_match(label: str, run: Run, ref: Run) -> None:
    assert len(run.weights) == len(ref.weights), \
        f"{label}: {len(run.weights)} parameter tensors, baseline has {len(ref.weights)}"
    err, where = weight_error(run.weights, ref.weights)
    report(f"weights {label}", f"{err:.2e}", f"worst tensor #{where}; final loss {run.losses[-1]:.6f} "
                                             f"vs baseline {ref.losses[-1]:.6f}")
    assert err <= RTOL, (f"{label}: parameter tensor #{where} differs from baseline by {err:.3e} of its scale "
                         f"(tolerance {RTOL}); losses {run.losses} vs baseline {ref.losses}")


def budgets(graph_fn):
    plan = make_plan(graph_fn(), plan_backward=False)
    return plan, plan.param_bytes


# -- (a) every mode trains to baseline's weights ----------------------------------------------------
def test_every_mode_matches_baseline_small_net(gpu, monkeypatch):
    ref = train(gpu, small_graph, "baseline", 10)
    plan, params = budgets(small_graph)
    live = plan.peak("liveness")[0]
    runs = [(m, None) for m in ("liveness", "offload", "recompute", "auto")]
    # Below what each mode needs when nothing moves (offload: liveness's peak; recompute: its replays
    # alone), above its planned peak with moves: the bytes must go through pinned memory.
    for m in ("offload", "recompute"):
        still = max(simulate(plan.program, _without_moves(plan.schedules[m])).bytes)
        runs.append((m + " tight", params + (still + plan.peak(m)[0]) // 2))
    for label, pool in runs:
        run = train(gpu, small_graph, label.split()[0], 10, pool_bytes=pool)
        assert_weights_match(label, run, ref)
        if pool is not None:
            moved = run.stats["total"]
            report(f"bytes moved {label}", moved["bytes_offloaded"] + moved["bytes_prefetched"], str(moved))
            assert moved["bytes_offloaded"] > 0, f"{label}: a {pool}-byte pool (liveness needs {params + live}) moved nothing"
    monkeypatch.setenv("SUPERNEURONS_CACHE", "0")  # no Tensor Cache: every planned checkpoint moves
    for mode in ("offload", "recompute"):
        run = train(gpu, small_graph, mode, 10)
        assert_weights_match(f"{mode} no-cache", run, ref)
        moved = run.stats["total"]
        report(f"bytes moved {mode} no-cache", moved["bytes_offloaded"] + moved["bytes_prefetched"], str(moved))
        assert moved["bytes_prefetched"] > 0, f"{mode} without the cache prefetched nothing: {moved}"


# -- (b) ResNet-50 in a budget below baseline's, trained by auto -------------------------------------
def test_resnet50_trains_under_a_budget_that_needs_offload(gpu, monkeypatch):
    if settings.get("SUPERNEURONS_LAYOUT") == "auto":  # it picks the layout by the memory a run needs: the
        monkeypatch.setenv("SUPERNEURONS_LAYOUT", "nchw")  # modes compare in one layout
    plan, params = budgets(resnet_graph)
    live, off = plan.peak("liveness")[0], plan.peak("offload")[0]
    budget = params + (live + off) // 2  # below liveness's (and so baseline's) need, above offload's
    report("resnet50 budget", budget, f"batch {RESNET_BATCH}: params {params}, baseline peak "
                                      f"{plan.peak('baseline')[0]}, liveness {live}, offload {off}, "
                                      f"recompute {plan.peak('recompute')[0]}")
    with no_workspace():
        t0 = time.perf_counter()
        ref = train(gpu, resnet_graph, "baseline", RESNET_ITERS)
        t_ref = time.perf_counter() - t0
        # Run-to-run noise of the same mode: cuDNN's zero-workspace backward algorithms and the float64
        # atomics of the per-channel reductions add in a different order every run.
        again = train(gpu, resnet_graph, "baseline", RESNET_ITERS)
        noise = weight_error(again.weights, ref.weights)[0]
        noise_first = weight_error(again.first_weights, ref.first_weights)[0]
        t0 = time.perf_counter()
        run = train(gpu, resnet_graph, "auto", RESNET_ITERS, pool_bytes=budget)
        t_auto = time.perf_counter() - t0
    assert run.mode in ("offload", "recompute"), f"auto picked {run.mode} for a {budget}-byte pool"
    moved = run.stats
    report("resnet50 auto mode", f"{run.mode} ({','.join(run.checkpoint_types)})",
           f"{RESNET_ITERS} iterations: {t_auto:.1f}s vs baseline {t_ref:.1f}s, {run.replays} forward steps replayed")
    report("resnet50 bytes moved/iter", moved["iteration"]["bytes_offloaded"] + moved["iteration"]["bytes_prefetched"],
           str(moved["iteration"]))
    first_err, first_at = weight_error(run.first_weights, ref.first_weights)
    report("resnet50 after 1 iteration", f"{first_err:.2e}",
           f"worst tensor #{first_at}; baseline vs baseline {noise_first:.2e}")
    report("resnet50 baseline vs baseline", f"{noise:.2e}", f"after {RESNET_ITERS} iterations (the noise floor)")
    tolerance = max(RTOL, 10 * noise)
    err, where = weight_error(run.weights, ref.weights)
    report(f"weights resnet50 auto({run.mode})", f"{err:.2e}",
           f"worst tensor #{where}; tolerance {tolerance:.1e}; final loss {run.losses[-1]:.6f} vs {ref.losses[-1]:.6f}")
    first_tol = max(1e-4, 10 * noise_first)
    assert first_err <= first_tol, (f"one iteration of auto({run.mode}) already differs from baseline by "
                                    f"{first_err:.3e} (tolerance {first_tol:.1e}, run-to-run noise {noise_first:.1e})")
    assert err <= tolerance, (f"auto({run.mode}): parameter tensor #{where} differs from baseline by {err:.3e} of "
                              f"its scale (tolerance {tolerance:.1e}, baseline's own run-to-run noise {noise:.1e}); "
                              f"losses {run.losses} vs baseline {ref.losses}")
    # auto weighs moving against replaying (memory/cost.py): one of them must have happened.
    assert moved["total"]["bytes_offloaded"] + run.replays > 0, \
        f"auto ({run.mode}) in a {budget}-byte pool neither moved nor replayed anything"
    assert run.capacity <= budget
    # With the dynamic workspace on, the algorithms differ between the runs: reported, not asserted.
    dyn = train(gpu, resnet_graph, "auto", RESNET_ITERS, pool_bytes=budget)
    report("resnet50 auto, dynamic workspace", f"{weight_error(dyn.weights, ref.weights)[0]:.2e}",
           "vs the zero-workspace baseline (different conv algorithms round differently)")


def test_auto_replay_limit_on_gpu(gpu):
    """ResNet-50 in a budget where recompute is needed but leaves room: auto picks a plan with a replay
    limit (memory/cost.py), which replays fewer steps than the floor's plan; on the GPU its pool trace is
    the plan's (nothing moves) and its weights are baseline's within the run-to-run noise."""
    from superneurons.memory import BLOCK_CHECKPOINTS
    from superneurons.memory.plan import replay_count

    plan = make_plan(resnet_graph(), plan_backward=False, checkpoint_types=BLOCK_CHECKPOINTS)
    params = plan.param_bytes
    budget = params + (plan.peak("recompute")[0] + plan.peak("offload")[0]) // 2  # recompute needed, with room
    with no_workspace():
        ref = train(gpu, resnet_graph, "baseline", RESNET_ITERS)
        noise = weight_error(train(gpu, resnet_graph, "baseline", RESNET_ITERS).weights, ref.weights)[0]
        run = train(gpu, resnet_graph, "auto", RESNET_ITERS, pool_bytes=budget)
    floor = replay_count(plan.schedules["recompute"])
    report("resnet50 auto replay limit", run.recompute_limit,
           f"mode {run.mode} ({','.join(run.checkpoint_types)}), {run.replays / RESNET_ITERS:.0f} replays per "
           f"iteration against {floor} for the floor's plan; budget {budget}")
    assert run.mode == "recompute" and run.recompute_limit > 0
    assert 0 < run.replays / RESNET_ITERS < floor
    assert run.stats["total"]["bytes_offloaded"] == 0 and run.trace == run.no_move_trace
    err, where = weight_error(run.weights, ref.weights)
    tolerance = max(RTOL, 10 * noise)
    report("weights resnet50 auto (replay limit)", f"{err:.2e}", f"worst tensor #{where}; tolerance {tolerance:.1e}")
    assert err <= tolerance, f"parameter tensor #{where} differs from baseline by {err:.3e} (tolerance {tolerance:.1e})"


# -- (c) a budget that fits: nothing moves -----------------------------------------------------------
@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_resnet50_that_fits_moves_nothing(gpu, mode):
    plan, params = budgets(resnet_graph)
    budget = params + plan.peak("liveness")[0] + (256 << 20)
    moved = train(gpu, resnet_graph, mode, 3, pool_bytes=budget).stats["total"]
    report(f"resnet50 fits, {mode}: bytes moved", moved["bytes_offloaded"] + moved["bytes_prefetched"], str(moved))
    assert moved["bytes_offloaded"] == 0 and moved["bytes_prefetched"] == 0, \
        f"{mode} in a {budget}-byte pool (liveness needs {params + plan.peak('liveness')[0]}) moved bytes: {moved}"


# -- (d) the pool's measured per-step bytes equal the plan's (workspace excluded) ---------------------
@pytest.mark.parametrize("which", ["small", "resnet50"])
def test_pool_trace_equals_plan_on_gpu(gpu, which):
    graph_fn = small_graph if which == "small" else resnet_graph
    for mode in ("liveness", "recompute"):
        run = train(gpu, graph_fn, mode, 2)
        # recompute with the cache and room: nothing moves, everything else (drops, replays) as planned; the
        # plan is of the Net's own tensors (channels-last ones add filter copies and conversion rooms)
        want = run.liveness_trace if mode == "liveness" else run.no_move_trace
        got = run.trace
        diff = [(s, g, w) for s, (g, w) in enumerate(zip(got, want)) if g != w]
        report(f"trace == plan, {which} {mode}", "yes" if not diff and len(got) == len(want) else "NO",
               f"{len(got)} steps, peak {max(got)} bytes; first differences (step, pool, plan): {diff[:3]}")
        assert len(got) == len(want) and not diff, \
            f"{which} {mode}: {len(diff)} of {len(want)} steps differ (step, pool bytes, plan bytes): {diff[:5]}"


# -- (e) the copy streams overlap compute (reported, not asserted) ----------------------------------
def test_pinned_copies_overlap_compute(gpu):
    from superneurons.backend.cuda.transfer import CudaTransfer

    tr = CudaTransfer(gpu)
    nbytes = 256 << 20
    src = gpu.view(gpu.arena(nbytes), 0, (nbytes // 4,), np.float32)
    host = tr.view(tr.arena(nbytes), 0, (nbytes // 4,), np.float32)
    n = 4096
    a = gpu.view(gpu.arena(n * n * 4), 0, (n, n), np.float32)
    c = gpu.view(gpu.arena(n * n * 4), 0, (n, n), np.float32)
    gpu.ops.fill(a, 0.001)
    expected = np.random.default_rng().standard_normal(nbytes // 4).astype(np.float32)
    gpu.from_host(src, expected)

    def compute():
        for _ in range(8):
            gpu.ops.gemm(False, False, 1.0, a, a, 0.0, c)

    def timed(fn) -> float:
        gpu.synchronize()
        t = time.perf_counter()
        fn()
        gpu.synchronize()
        return time.perf_counter() - t

    timed(compute)  # warm up cuBLAS
    t_copy = timed(lambda: tr.to_host(src, host).synchronize())
    t_compute = timed(compute)

    def both_ordered():  # the copy issued before the compute: it waits for nothing and runs beside it
        ev = tr.to_host(src, host)
        compute()
        ev.synchronize()

    np.asarray(host)[:] = 0
    t_both = min(timed(both_ordered), timed(both_ordered))
    # The timing is reported, not asserted (machines differ); what must hold is that the copy that ran
    # beside the compute delivered every byte.
    assert np.array_equal(np.asarray(host), expected), "the pinned D2H copy beside the compute lost bytes"
    hidden = max(0.0, t_copy + t_compute - t_both) / min(t_copy, t_compute)
    report("overlap", f"{hidden:.0%}", f"D2H 256 MiB alone {t_copy * 1e3:.1f} ms ({nbytes / t_copy / 1e9:.1f} GB/s), "
                                        f"8 sgemm 4096^3 alone {t_compute * 1e3:.1f} ms, both {t_both * 1e3:.1f} ms "
                                        f"(share of the shorter one hidden)")


# -- (f) parameters streamed from pinned host memory ---------------------------------------------------
@pytest.mark.parametrize("which", ["small", "resnet50"])
def test_streamed_parameters_match_baseline(gpu, monkeypatch, which):
    """SUPERNEURONS_PARAM_OFFLOAD=1: weights, gradients and history live in pinned host memory and each step
    brings in its own layer's (the path that lets depth exceed the device); training must not change."""
    graph_fn = small_graph if which == "small" else resnet_graph
    iters = 10 if which == "small" else 3
    with no_workspace():
        ref = train(gpu, graph_fn, "baseline", iters)
        noise = weight_error(train(gpu, graph_fn, "baseline", iters).weights, ref.weights)[0]
        monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "1")
        t0 = time.perf_counter()
        run = train(gpu, graph_fn, "liveness", iters)  # baseline keeps everything resident by definition
        seconds = time.perf_counter() - t0
    assert run.streamed, "SUPERNEURONS_PARAM_OFFLOAD=1 did not stream the parameters"
    err, where = weight_error(run.weights, ref.weights)
    tolerance = max(RTOL, 10 * noise)
    report(f"streamed params {which}", f"{err:.2e}", f"worst tensor #{where}, noise {noise:.1e}, mode {run.mode}, "
                                                     f"{iters} iterations in {seconds:.1f}s")
    assert err <= tolerance, f"streamed parameters: tensor #{where} differs from baseline by {err:.3e}"
