"""The counter-based random fill op (backend/cpu/random_fill.py) behind DummyData and the fillers.
"""
import numpy as np

from superneurons.backend.cpu import CpuBackend


def _fill(kind, a, b, keep=1.0, n=200_000, seed=5, iteration=3, layer=2, stream=0, dtype=np.float32):
    out = np.zeros(n, dtype)
    CpuBackend().ops.random_fill(out, kind, a, b, keep, seed, iteration, layer, stream)
    return out


def test_random_fill_distributions():
    z = _fill("gaussian", 0.5, 2.0).astype(np.float64)
    # n = 2e5: the sample mean's standard error is 2 / sqrt(n) = 0.0045, the std's 0.0032.
    assert abs(z.mean() - 0.5) < 0.03 and abs(z.std() - 2.0) < 0.02
    assert abs(np.mean(np.abs(z - 0.5) < 2.0) - 0.6827) < 0.01  # the normal's one-sigma mass
    u = _fill("uniform", -1.0, 3.0).astype(np.float64)
    assert u.min() >= -1.0 and u.max() <= 3.0 and abs(u.mean() - 1.0) < 0.02
    assert abs(u.std() - 4.0 / np.sqrt(12.0)) < 0.02
    sparse = _fill("gaussian", 0.0, 1.0, keep=0.3)
    assert abs(np.mean(sparse != 0) - 0.3) < 0.01
    assert not _fill("gaussian", 0.0, 1.0, keep=0.0).any()


def test_random_fill_is_a_pure_function_of_its_counters():
    base = _fill("gaussian", 0.0, 1.0)
    assert np.array_equal(base, _fill("gaussian", 0.0, 1.0))  # same (seed, iteration, layer, stream)
    for changed in ({"seed": 6}, {"iteration": 4}, {"layer": 3}, {"stream": 1}):
        other = _fill("gaussian", 0.0, 1.0, **changed)
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.02, changed
    # Element i does not depend on the array's size or dtype (beyond rounding).
    np.testing.assert_allclose(_fill("gaussian", 0.0, 1.0, n=1000, dtype=np.float64), base[:1000], rtol=1e-6,
                               atol=1e-6)
