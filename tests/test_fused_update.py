"""The grouped parameter update (solver/fused_update.py): one multi-tensor op for every learnable parameter's
ApplyUpdate and one for clearing the gradients, on per-parameter offsets into the pool's arena.

On the CPU the grouped ops must give the per-parameter path's results bit for bit; the table must follow
tensors that move; and whatever the grouped path does not cover must fall back to the per-parameter ops.
The CUDA kernels themselves run under the simulator in test_fused_update_sim.py; the last test here trains
on a real GPU with and without the grouped path (skipped without one).
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_harness import CPU, close
from superneurons.backend.cpu import basic, solver_ops
from superneurons.backend.cuda.probe import gpu_available
from superneurons.solver import Solver
from superneurons.solver.fused_update import ENV, GroupedUpdate, unsupported, work_split
from test_memory_modes import CONV_FAN
from test_param_offload import _dummy
from test_solver import Quiet, TINY_NET, solver_param

SGD = ('type: "SGD" base_lr: 0.05 lr_policy: "inv" gamma: 0.1 power: 0.75 momentum: 0.9 weight_decay: 0.01 '
       'snapshot_after_train: false')
SOLVERS = {
    "l2": SGD + ' max_iter: 3',
    "l1": SGD + ' regularization_type: "L1" max_iter: 3',
    "clip_iter_size": SGD + ' clip_gradients: 0.05 iter_size: 2 max_iter: 3',
    "no_decay_no_momentum": 'type: "SGD" base_lr: 0.1 lr_policy: "fixed" max_iter: 3 snapshot_after_train: false',
}


# -- the tables and the ops, on a made-up arena ------------------------------------------------------------

def random_segments(rng, lengths, max_gap: int = 3):
    """A float32 arena holding data, gradient and history of one segment per length, at shuffled offsets with
    gaps between them, plus the tables the multi ops read (lr_mult 0 and decay 0 for some segments)."""
    n = len(lengths)
    pieces = [(s, col) for s in range(n) for col in range(3)]
    order = rng.permutation(len(pieces))
    offsets = np.zeros((n, 3), np.int64)
    at = 0
    for k in order:
        s, col = pieces[k]
        at += int(rng.integers(0, max_gap + 1))
        offsets[s, col] = at
        at += lengths[s]
    arena = rng.standard_normal(at + 5).astype(np.float32)
    arena[offsets[0, 0]] = 0.0  # a zero weight: sign 0 under L1
    segments = np.column_stack([offsets, np.asarray(lengths, np.int64)])
    lr_mults = rng.choice([0.0, 0.5, 1.0, 2.0], n)
    lr_mults[0] = 0.0
    decays = rng.choice([0.0, 3e-3, 0.01], n)
    decays[1 % n] = 0.0
    return arena, segments, np.column_stack([lr_mults, decays])


def per_parameter(arena, segments, factors, rate, momentum, clip_scale, iter_scale, l1):
    """What the Solver's per-parameter path does to each segment, with the CPU's per-parameter ops."""
    for (w, g, h, n), (lr_mult, decay) in zip(segments.tolist(), factors.tolist()):
        dw = arena[g:g + n]
        if clip_scale != 1.0:
            basic.scal(clip_scale, dw)
        if iter_scale != 1.0:
            basic.scal(iter_scale, dw)
        solver_ops.regularize(arena[w:w + n], dw, decay, l1)
        solver_ops.sgd_update(arena[w:w + n], dw, arena[h:h + n], rate * lr_mult, momentum)


@pytest.mark.parametrize("l1", [False, True])
def test_cpu_multi_ops_equal_the_per_parameter_ops(rng, l1):
    arena, segments, factors = random_segments(rng, [1, 7, 300, 33, 1029, 5])
    blocks = work_split(segments[:, 3], 64)
    want = arena.copy()
    per_parameter(want, segments, factors, 0.03, 0.9, 0.37, 0.5, l1)
    got = arena.copy()
    CPU.ops.multi_sgd_update(got, segments, factors, blocks, 0.03, 0.9, 0.37, 0.5, l1)
    assert np.array_equal(got, want)
    CPU.ops.multi_zero_grads(got, segments, blocks)
    for w, g, h, n in segments.tolist():
        want[g:g + n] = 0
    assert np.array_equal(got, want)


def test_work_split_covers_every_segment_once():
    lengths = np.array([1, 4096, 4097, 0, 10000, 3], np.int64)
    blocks = work_split(lengths, 4096)
    seen = [np.zeros(n, np.int64) for n in lengths]
    for s, start, end in blocks.tolist():
        assert 0 <= start < end <= lengths[s] and end - start <= 4096
        seen[s][start:end] += 1
    assert all((c == 1).all() for c in seen)
    assert [int((blocks[:, 0] == s).sum()) for s in range(len(lengths))] == [1, 1, 2, 0, 3, 1]


# -- the Solver on the CPU: bit for bit what the per-parameter path gives --------------------------------------

def _train(text: str, net: str = TINY_NET, iters: int | None = None, **kw) -> Solver:
    solver = Solver(solver_param(text, net=net), "s.prototxt", log=Quiet(), **kw)
    solver.step(iters if iters is not None else solver.param.max_iter)
    return solver


def _state(solver: Solver) -> list[bytes]:
    return [solver.net.backend.to_host(t.array).tobytes() for t in solver.net.tensors if t.kind == "param"] + \
           [h.tobytes() for h in solver.history_blobs()]


@pytest.mark.parametrize("text", list(SOLVERS.values()), ids=list(SOLVERS))
@pytest.mark.parametrize("net", [TINY_NET, _dummy(CONV_FAN)], ids=["tiny", "fan"])
def test_grouped_update_trains_bit_identical_to_per_parameter(monkeypatch, text, net):
    grouped = _train(text, net)
    assert grouped._grouped is not None and grouped._grouped.rebuilds == 1
    monkeypatch.setenv(ENV, "0")
    plain = _train(text, net)
    assert plain._grouped is None
    assert _state(grouped) == _state(plain)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_grouped_update_divides_the_loss_scale_out_as_the_per_parameter_update(monkeypatch, precision):
    """float16 trains with adaptive loss scaling (bfloat16 here with a static scale of 1024): the grouped update
    divides the scale out with 1/iter_size and must give the per-parameter update's bits, skipped steps too."""
    net = _dummy(CONV_FAN) if precision == "fp16" else _dummy(CONV_FAN).replace('name: ', 'global_grad_scale: 1024\nname: ', 1)
    text = list(SOLVERS.values())[0]
    grouped = _train(text, net, precision=precision)
    assert grouped._grouped is not None and grouped.loss_scale.scale > 1
    monkeypatch.setenv(ENV, "0")
    plain = _train(text, net, precision=precision)
    assert plain._grouped is None
    assert _state(grouped) == _state(plain)


# -- the table follows moved tensors -------------------------------------------------------------------------

def _move(net, tensor) -> None:
    """Re-allocate `tensor` elsewhere in the pool (its values kept), as a memory manager may."""
    values = net.backend.to_host(tensor.array)
    net.pool.free(tensor.key)
    net.pool.alloc(tensor.key, tensor.nbytes, high=True)
    net.attach(tensor)
    net.backend.from_host(tensor.array, values)
    net.bind_params()


def test_table_is_rebuilt_when_tensors_move_and_only_then(monkeypatch):
    text = SOLVERS["l2"]
    solver = _train(text, iters=1, memory="liveness")  # liveness frees activations every step: no rebuild
    grouped, net = solver._grouped, solver.net
    solver.step(2)
    assert grouped.rebuilds == 1
    before = grouped._segments.copy()
    decl = net.learnable[1]
    for t in (decl.data_tensor, decl.diff_tensor, net.history[0][1]):
        _move(net, t)
    solver.step(1)
    assert grouped.rebuilds == 2
    moved = grouped._segments.copy()
    assert (moved[1, :3] != before[1, :3]).all() and np.array_equal(np.delete(moved, 1, 0), np.delete(before, 1, 0))
    assert moved[1, 0] * 4 == net.pool.offset(decl.data_tensor.key)
    assert net.compact_pool()  # the moved blocks left holes below others: compaction slides blocks down
    solver.step(2)
    assert grouped.rebuilds == 3 and not np.array_equal(grouped._segments, moved)
    monkeypatch.setenv(ENV, "0")
    plain = _train(text, iters=6, memory="liveness")
    assert _state(solver) == _state(plain)


def test_a_tensor_without_a_block_falls_back_until_it_has_one():
    solver = _train(SOLVERS["l2"], iters=1)
    grouped, net = solver._grouped, solver.net
    t = net.learnable[0].diff_tensor
    net.pool.free(t.key)
    assert not grouped.clear_grads() and not grouped.update(0.1, 1.0, 1)
    net.pool.alloc(t.key, t.nbytes)
    net.attach(t)
    net.bind_params()
    assert grouped.clear_grads() and grouped.rebuilds == 2
    assert not net.learnable[0].diff.any()


# -- when the grouped path does not apply ---------------------------------------------------------------------

@pytest.mark.parametrize("case,reason", [
    ("env", ENV), ("Adam", "Adam rule"), ("Nesterov", "Nesterov rule"), ("malloc", "single arena"),
    ("streamed", "streamed"), ("float64", "float32")])
def test_fallbacks_use_the_per_parameter_path(monkeypatch, case, reason):
    text, memory = SOLVERS["l2"], None
    if case == "env":
        monkeypatch.setenv(ENV, "0")
    elif case in ("Adam", "Nesterov"):
        text = text.replace('type: "SGD"', f'type: "{case}"')
    elif case == "malloc":
        monkeypatch.setenv("SUPERNEURONS_ALLOCATOR", "malloc")
    elif case == "streamed":
        monkeypatch.setenv("SUPERNEURONS_PARAM_OFFLOAD", "1")
        memory = "liveness"
    solver = Solver(solver_param(text), "s.prototxt", log=Quiet(), memory=memory)
    if case == "float64":
        monkeypatch.setattr(solver.net.learnable[2].data_tensor, "dtype", np.dtype(np.float64))
    assert reason in unsupported(solver.net, solver.rule.name)
    if case != "float64":
        assert solver._grouped is None
        solver.step(2)
        assert all(np.isfinite(solver.net.backend.to_host(d.data)).all() for d in solver.net.learnable)


def test_resident_sgd_is_grouped():
    solver = Solver(solver_param(SOLVERS["l2"]), "s.prototxt", log=Quiet())
    assert unsupported(solver.net, "SGD") is None and isinstance(solver._grouped, GroupedUpdate)


# -- on the GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("text", [SOLVERS["clip_iter_size"], SOLVERS["l1"]], ids=["clip_iter_size", "l1"])
def test_gpu_grouped_and_per_parameter_updates_match_the_cpu(gpu, monkeypatch, text):
    """A few iterations of a small conv net on the GPU with the grouped update and without it (the `gpu`
    fixture has FMA convolution math), against the CPU backend's weights."""
    net = _dummy(CONV_FAN)

    def weights(solver):
        return [solver.net.backend.to_host(d.data) for d in solver.net.learnable]

    ref = weights(_train(text, net))
    fast = _train(text, net, backend=gpu)
    assert fast._grouped is not None and fast._grouped.rebuilds >= 1
    monkeypatch.setenv(ENV, "0")
    plain = _train(text, net, backend=gpu)
    assert plain._grouped is None
    for k, (f, p, r) in enumerate(zip(weights(fast), weights(plain), ref)):
        close(f, r, rtol=2e-3, atol_scale=1e-4)
        close(p, r, rtol=2e-3, atol_scale=1e-4)
        close(f, p, rtol=1e-4, atol_scale=1e-5)  # the same math on one device: only FMA contraction differs
