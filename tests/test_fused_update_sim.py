"""The multi-tensor solver kernels (backend/cuda/kernels/solver.py multi_sgd and multi_zero_grads, through the
CUDA ops that launch them) under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), against the CPU's per-parameter
ops on fresh random inputs: several segments of odd lengths at shuffled offsets of one flat arena, L1 and L2,
decay 0 and lr_mult 0 for some, iter_size 2 and a clip scale; and a CPU Solver whose grouped update runs the
CUDA ops. The simulator runs kernels on NumPy arrays, so the arena is a NumPy array here.

The `simulator` tests here run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run
deselects them. Skipped without numba-cuda.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import IN_SIMULATOR, simulated  # noqa: E402


if IN_SIMULATOR:
    from superneurons.backend.cuda.ops import solver_ops as gpu_solver_ops  # noqa: E402

from superneurons.solver import fused_update  # noqa: E402
from superneurons.solver.fused_update import ENV, GroupedUpdate, work_split  # noqa: E402
from test_fused_update import SOLVERS, _state, _train, per_parameter, random_segments  # noqa: E402


@simulated
@pytest.mark.parametrize("l1", [False, True])
@pytest.mark.parametrize("clip_scale,iter_scale", [(1.0, 1.0), (0.37, 0.5)])
def test_multi_sgd_kernel_matches_the_per_parameter_ops(rng, l1, clip_scale, iter_scale):
    arena, segments, factors = random_segments(rng, [1, 7, 300, 33, 1029, 5])
    blocks = work_split(segments[:, 3], 128)  # several blocks for the long segments, one for the short ones
    want = arena.copy()
    per_parameter(want, segments, factors, 0.03, 0.9, clip_scale, iter_scale, l1)
    got = arena.copy()
    gpu_solver_ops.multi_sgd_update(got, segments, factors, blocks, 0.03, 0.9, clip_scale, iter_scale, l1)
    # The simulator computes in NumPy float32 in the per-parameter ops' order: the same bits (a GPU may
    # contract multiply-adds, so test_fused_update.py's GPU test compares with a tolerance).
    np.testing.assert_array_equal(got, want)


@simulated
def test_multi_zero_grads_kernel_zeroes_the_gradients_only(rng):
    arena, segments, _ = random_segments(rng, [3, 1, 260, 129])
    want = arena.copy()
    for w, g, h, n in segments.tolist():
        want[g:g + n] = 0
    gpu_solver_ops.multi_zero_grads(arena, segments, work_split(segments[:, 3], 128))
    np.testing.assert_array_equal(arena, want)


@simulated
@pytest.mark.parametrize("name", ["clip_iter_size", "l1"])
def test_solver_with_the_cuda_multi_ops_trains_like_the_per_parameter_path(monkeypatch, name):
    """The CPU Solver with its grouped update's ops swapped for the CUDA ones: the tables built from a real
    Net's pool, split in blocks smaller than its tensors, drive the kernels to the per-parameter weights."""
    text = SOLVERS[name]
    monkeypatch.setattr(fused_update, "CHUNK", 16)  # the Net plans the tables of the smaller blocks
    solver = _train(text, iters=0)
    solver._grouped = GroupedUpdate(solver.net, solver.param, chunk=16)
    solver._grouped.ops = types.SimpleNamespace(multi_sgd_update=gpu_solver_ops.multi_sgd_update,
                                                multi_zero_grads=gpu_solver_ops.multi_zero_grads)
    solver.step(3)
    monkeypatch.setenv(ENV, "0")
    plain = _train(text, iters=3)
    assert plain._grouped is None
    assert _state(solver) == _state(plain)
