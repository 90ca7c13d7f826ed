"""The GPU ops that sum into float64 entries take them from the scratch region their caller passes (`scratch=`: a
Net's planned `#scratch` tensor, backend/scratch.py) and allocate no device memory; under the CUDA simulator
(NUMBA_ENABLE_CUDASIM=1), against the CPU ops, which check the same region against the same numbers.

Each op gets a region of exactly what its layer declares plus a tail of NaNs: the op must write inside its
entries, leave the tail alone, and never call numba's device_array (patched to fail); the results must equal the
CPU op's. Without a region (an op called outside a Net) the op takes an array of its own, which the patch sees.
"""
from __future__ import annotations

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import IN_SIMULATOR, activate_bare_device, simulated  # noqa: E402

from superneurons.backend import scratch as need  # noqa: E402
from superneurons.backend.cpu import CpuBackend  # noqa: E402
from superneurons.backend.cuda.ops import (_rows, activation, basic, batch_norm, embed, fused, loss,  # noqa: E402
                                           mvn, reduction, scale)

CPU = CpuBackend().ops
TAIL = 3  # NaN entries after the declared ones: nothing may write them


@pytest.fixture(autouse=True, scope="module")
def bare_device():
    """The bare device for this file's tests alone (tests/conftest.py puts the one before back): the other
    simulator files share the process."""
    if IN_SIMULATOR:
        activate_bare_device()


class Allocated(AssertionError):
    pass


def _no_allocation(*_args, **_kwargs):
    raise Allocated("a GPU op allocated device memory of its own")


def _cases(rng):
    """(op, GPU module, arrays, scalars, declared entries): one call each, shaped so that every op takes the
    path that sums into the region (several blocks per channel: SUPERNEURONS_CUDA_SPREAD's default)."""
    n, c, hw = 3, 4, 70
    x, dy = rng.standard_normal((n, c, hw)), rng.standard_normal((n, c, hw))
    mean, var = rng.standard_normal(c), rng.random(c) + 0.5
    inv = 1 / np.sqrt(var + 1e-5)
    stats = [np.zeros(c) for _ in range(6)]  # mean, var, inv_std, mean_sum, var_sum, (scale_factor below)
    stats[5] = np.ones(1)
    gamma, beta = rng.standard_normal(c), rng.standard_normal(c)
    prob = rng.random((n, c, 5)) + 0.05
    prob /= prob.sum(axis=1, keepdims=True)
    label = rng.integers(0, c, (n, 5)).astype(np.float64)
    a, b = rng.standard_normal((n, 6, 1, 1)), rng.standard_normal((n, 6, 1, 1))
    sim = np.array([1.0, 0.0, 1.0])
    idx = rng.integers(0, 7, (2, 5)).astype(np.float64)
    w, bias = rng.standard_normal((7, 4)), rng.standard_normal(4)
    h = rng.random((c, c))
    rows = need.row_sums
    return [
        ("bias_backward", basic, [dy, np.zeros(c)], (n, c, hw), rows(c)),
        ("channel_mul_grad", scale, [x, dy, np.zeros(c)], (n, c, hw, True), rows(c)),
        ("bn_batch_stats", batch_norm, [x, np.zeros(c), np.zeros(c)], (n, c, hw), rows(c)),
        ("bn_backward", batch_norm, [x, mean, inv, dy, np.zeros_like(x)], (n, c, hw), rows(c)),
        ("bn_affine_forward", fused, [x, np.zeros_like(x), np.zeros_like(x), stats[0], stats[1], stats[2], gamma,
                                      beta, stats[3], stats[4], stats[5]],
         (n, c, hw, 1e-5, False, True, 0.9, 1.0, 0.0), rows(c)),
        ("bn_affine_backward", fused, [x, mean, inv, gamma, beta, dy, np.zeros_like(x), np.zeros(c), np.zeros(c)],
         (n, c, hw, False, None), rows(c)),
        ("prelu_backward", activation, [x, rng.standard_normal(c), dy, None, np.zeros(c)], (n, c, hw), rows(c)),
        ("mvn_forward", mvn, [x.reshape(n * c, hw), np.zeros((n * c, hw)), np.zeros(n * c)], (n * c, hw, 1e-9),
         rows(n * c)),
        ("mvn_backward", mvn, [x.reshape(n * c, hw), dy.reshape(n * c, hw), np.zeros((n * c, hw)),
                               np.ones(n * c)], (n * c, hw), rows(n * c)),
        ("reduction_forward", reduction, [x.reshape(n, -1), np.zeros(n)], ("SUMSQ", 0.5, n, c * hw), rows(n)),
        ("embed_forward", embed, [idx, w, bias, np.zeros((10, 4))], (), need.total()),
        ("embed_backward", embed, [idx, rng.standard_normal((10, 4)), np.zeros_like(w), np.zeros(4)], (), rows(4)),
        ("softmax_loss_forward", loss, [prob, label, np.zeros(())], (None, "VALID"), need.loss_stats()),
        ("softmax_loss_backward", loss, [prob, label, np.array(1.5), np.zeros_like(prob)], (None, "VALID"),
         need.loss_stats()),
        ("accuracy_forward", loss, [prob, label, 2, None, np.zeros(()), np.zeros(c)], (), need.accuracy_sums(c)),
        ("euclidean_loss_forward", loss, [x, dy, np.zeros(())], (), rows(1)),
        ("sigmoid_ce_loss_forward", loss, [x, rng.random(x.shape), np.zeros(())], (None, "VALID"),
         need.loss_stats()),
        ("hinge_loss_forward", loss, [x.reshape(n, -1)[:, :c], label[:, 0], np.zeros(())], ("L2",),
         need.loss_stats()),
        ("contrastive_loss_forward", loss, [a, b, sim, np.zeros(())], (1.0, False), need.contrastive_loss(n)),
        ("contrastive_loss_backward", loss, [a, b, sim, np.array(1.0), np.zeros_like(a), np.zeros_like(b)],
         (1.0, False), rows(n)),
        ("multinomial_logistic_loss_forward", loss, [prob[:, :, 0], label[:, 0], np.zeros(())], (),
         need.loss_stats()),
        ("infogain_loss_forward", loss, [prob, label, h, np.zeros(())], (None, "VALID"), need.loss_stats()),
        ("infogain_loss_backward", loss, [prob, label, h, np.array(1.0), np.zeros_like(prob)], (None, "VALID"),
         need.infogain_loss(c)),
        ("asum", basic, [x], (), need.total()),
        ("sumsq", basic, [x], (), need.total()),
        ("dot", basic, [x, dy], (), need.total()),
        ("all_finite", basic, [[x, dy]], (), need.total()),
    ]


def _device(a):
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.array(a, copy=True))
    if isinstance(a, list):
        return [_device(v) for v in a]
    return a


def _host(a):
    if a is None or isinstance(a, (int, float, str, bool)):
        return a
    if isinstance(a, list):
        return [_host(v) for v in a]
    return a.copy_to_host()


CASE_NAMES = [case[0] for case in _cases(np.random.default_rng(0))]


@simulated
@pytest.mark.parametrize("name", CASE_NAMES)
def test_an_op_sums_in_the_region_it_is_given_and_allocates_nothing(rng, monkeypatch, name):
    op, module, arrays, scalars, entries = next(case for case in _cases(rng) if case[0] == name)
    host = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in arrays]
    want = getattr(CPU, op)(*host, *scalars, scratch=np.zeros(entries))
    dev = [_device(a) for a in arrays]
    region = cuda.to_device(np.full(entries + TAIL, np.nan))
    monkeypatch.setattr(_rows.cuda, "device_array", _no_allocation)
    got = getattr(module, op)(*dev, *scalars, scratch=region)
    monkeypatch.undo()
    if want is not None:
        assert got == pytest.approx(want, rel=1e-9)
    for d, h in zip(dev, host):
        if isinstance(h, np.ndarray):
            np.testing.assert_allclose(_host(d), h, rtol=1e-7, atol=1e-9)
    used = region.copy_to_host()
    assert np.isnan(used[entries:]).all(), f"{op} wrote past the {entries} entries its layer declares"
    assert not np.isnan(used[:entries]).all(), f"{op} did not sum in the region it was given"


@simulated
def test_without_a_region_an_op_takes_memory_of_its_own_and_a_short_region_is_refused(rng, monkeypatch):
    x = cuda.to_device(rng.standard_normal(50))
    monkeypatch.setattr(_rows.cuda, "device_array", _no_allocation)
    with pytest.raises(Allocated):
        basic.sumsq(x)  # no region: the patch sees the op's own array
    monkeypatch.undo()
    dy = cuda.to_device(rng.standard_normal((2, 4, 70)))
    with pytest.raises(RuntimeError, match="scratch_entries"):
        basic.bias_backward(dy, cuda.to_device(np.zeros(4)), 2, 4, 70, scratch=cuda.to_device(np.zeros(7)))
    with pytest.raises(RuntimeError, match="scratch_entries"):
        CPU.bias_backward(np.zeros((2, 4, 70)), np.zeros(4), 2, 4, 70, scratch=np.zeros(7))
