"""The GPU twins of the zoo ops (backend/cuda/ops/{shape_ops,reduction,activation,loss,mvn,embed,
random_fill}.py; the activations as test_activations.OPS lists them), of the fused Eltwise SUM + ReLU
(eltwise.py) and of LRN (lrn.py) under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), against the CPU ops on
tiny fresh random inputs: the kernels' index math and the ops' host logic, on machines without a GPU.

The simulator has no real device arrays, so backend/cuda/device.py cannot import; a stand-in module gives the
ops the helpers they use from it (`flat`, `scalar`) over the simulator's arrays. Skipped without numba-cuda.
The `simulator` tests here run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run
deselects them.
"""
from __future__ import annotations


import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import IN_SIMULATOR, activate_bare_device, simulated  # noqa: E402

from superneurons.backend.cpu import CpuBackend  # noqa: E402
from superneurons.backend.cuda.ops import (activation as g_activation, embed as g_embed,  # noqa: E402
                                           eltwise as g_eltwise, loss as g_loss, lrn as g_lrn, mvn as g_mvn,
                                           random_fill as g_fill, reduction as g_red, shape_ops as g_shape)
from superneurons.backend.geometry import LRNGeometry  # noqa: E402
from superneurons.errors import UserError  # noqa: E402
from test_activations import OPS  # noqa: E402

CPU = CpuBackend().ops
GPU = {name: getattr(m, name) for m in (g_activation, g_embed, g_eltwise, g_loss, g_lrn, g_mvn, g_fill, g_red, g_shape)
       for name in m.__all__}


@pytest.fixture(autouse=True, scope="module")
def bare_device():
    """The bare device for this file's tests alone (tests/conftest.py puts the one before back): the other
    simulator files share the process."""
    if IN_SIMULATOR:
        activate_bare_device()


def run_both(op, arrays, *scalars):
    """ops.<op> on host copies (CPU) and simulator copies (GPU) of `arrays`; both results as host arrays."""
    host = [None if a is None else np.array(a, copy=True) for a in arrays]
    getattr(CPU, op)(*host, *scalars)
    dev = [None if a is None else cuda.to_device(np.array(a, copy=True)) for a in arrays]
    GPU[op](*dev, *scalars)
    return host, [None if d is None else d.copy_to_host() for d in dev]


def close(got, want, rtol=1e-9, atol=1e-12):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- neurons ---------------------------------------------------------------------------------------------

@simulated
@pytest.mark.parametrize("name,fwd_args,bwd_args,reads_top", OPS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_activations(rng, name, fwd_args, bwd_args, reads_top, dtype):
    x = rng.standard_normal((2, 3, 5)).astype(dtype)
    tol = dict(rtol=1e-9, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-6, atol=1e-6)
    (_, yc), (_, yg) = run_both(f"{name}_forward", [x, np.zeros_like(x)], *fwd_args)
    assert np.isfinite(yc).all()
    close(yg, yc, **tol)
    dy = rng.standard_normal(x.shape).astype(dtype)
    (*_, dxc), (*_, dxg) = run_both(f"{name}_backward", [yc if reads_top else x, dy, np.zeros_like(x)], *bwd_args)
    close(dxg, dxc, **tol)
    t = float(rng.standard_normal())
    (_, tc), (_, tg) = run_both("threshold_forward", [x, np.zeros_like(x)], t)
    assert np.array_equal(tg, tc)


@simulated
@pytest.mark.parametrize("shared", [False, True])
def test_prelu(rng, shared):
    outer, ch, inner = 2, 3, 10
    x = rng.standard_normal((outer, ch, inner))
    slope = rng.standard_normal(1 if shared else ch)
    (_, _, yc), (_, _, yg) = run_both("prelu_forward", [x, slope, np.zeros_like(x)], outer, ch, inner)
    close(yg, yc)
    dy = rng.standard_normal(x.shape)
    ds0 = rng.standard_normal(slope.shape)  # accumulates
    (*_, dxc, dsc), (*_, dxg, dsg) = run_both("prelu_backward", [x, slope, dy, np.zeros_like(x), ds0],
                                              outer, ch, inner)
    close(dxg, dxc)
    close(dsg, dsc)


@simulated
@pytest.mark.parametrize("n", [1, 3, 1029, 5000])  # 5000: all four elements of a trip, then a partial trip
@pytest.mark.parametrize("n_bottoms", [2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_eltwise_sum_relu(rng, n, n_bottoms, in_place):
    """The fused Eltwise SUM + ReLU (graph/fuse.py): two bottoms run one kernel each way, three fall back to
    sum + ReLU forward and pair their gradients (the odd one passed twice). In place, the top is bottom 0 and
    the last gradient is the top gradient itself, as the layer calls the ops."""
    bottoms = [rng.standard_normal(n).astype(np.float32) for _ in range(n_bottoms)]
    coeffs = [1.0] + [float(c) for c in rng.uniform(-2, 2, n_bottoms - 1)]
    dy = rng.standard_normal(n).astype(np.float32)
    results = []
    sides = ((lambda name: getattr(CPU, name), np.copy, np.asarray),
             (GPU.__getitem__, cuda.to_device, lambda a: a.copy_to_host()))
    for op, put, get in sides:
        xs = [put(b) for b in bottoms]
        top = xs[0] if in_place else put(np.full(n, np.nan, np.float32))
        op("eltwise_sum_relu")(xs, coeffs, top, 0.1)
        d = put(dy)
        outs = [put(np.full(n, np.nan, np.float32)) for _ in range(n_bottoms - in_place)] + ([d] if in_place else [])
        op("eltwise_sum_relu_backward")(top, d, coeffs, outs, 0.1)
        results.append([get(a) for a in [top, d, *outs]])
    for got, want in zip(results[1], results[0]):
        assert np.array_equal(got, want)  # the same float32 operations (the simulator has no FMA)


@simulated
@pytest.mark.parametrize("shape,size", [((2, 7, 3, 4), 5), ((1, 3, 2, 5), 5), ((2, 6, 1, 3), 3), ((1, 4, 2, 2), 1)])
@pytest.mark.parametrize("across", [True, False])
def test_lrn(rng, shape, size, across):
    """Across channels the GPU slides a running sum down the channels (fewer channels than the window, and
    size 1, included); within, one thread per element. The CPU op sums each window afresh, in float32."""
    geom = LRNGeometry(across, size, 0.3, 0.75, 1.5)
    x = rng.standard_normal(shape).astype(np.float32)
    fill = lambda: np.full(shape, np.nan, np.float32)  # noqa: E731  every element must be written
    (_, yc, sc), (_, yg, sg) = run_both("lrn_forward", [x, fill(), fill()], geom)
    close(yg, yc, rtol=2e-6, atol=1e-6)
    close(sg, sc, rtol=2e-6, atol=1e-6)
    dy = rng.standard_normal(shape).astype(np.float32)
    (*_, dxc), (*_, dxg) = run_both("lrn_backward", [x, yc, sc, dy, fill()], geom)
    close(dxg, dxc, rtol=1e-5, atol=1e-6)


# -- shape ops and reductions ----------------------------------------------------------------------------

@simulated
def test_crop_and_tile(rng):
    x = rng.standard_normal((2, 3, 7, 6))
    y = np.zeros((2, 2, 4, 3))
    offsets = (0, 1, 2, 3)
    (_, yc), (_, yg) = run_both("crop_forward", [x, y], offsets)
    assert np.array_equal(yg, yc)
    (_, dxc), (_, dxg) = run_both("crop_backward", [rng.standard_normal(y.shape), rng.standard_normal(x.shape)],
                                  offsets)
    assert np.array_equal(dxg, dxc)
    outer, tiles, inner = 3, 4, 5
    x = rng.standard_normal((outer, inner))
    (_, tc), (_, tg) = run_both("tile_forward", [x, np.zeros((outer, tiles * inner))], outer, tiles, inner)
    assert np.array_equal(tg, tc)
    (_, dc), (_, dg) = run_both("tile_backward", [rng.standard_normal(tc.shape), np.zeros_like(x)], outer, tiles,
                                inner)
    close(dg, dc)


@simulated
@pytest.mark.parametrize("big,small,offsets", [
    ((2, 3, 4, 5, 6), (2, 3, 2, 5, 3), (0, 0, 1, 0, 2)),  # kept-whole axes merge into the one before
    ((3, 2, 2, 2, 2, 2, 2, 2), (2, 1, 1, 1, 1, 1, 1, 2), (1, 1, 0, 1, 0, 1, 0, 0)),  # 8 axes, none kept whole
    ((5,), (2,), (3,)), ((4, 6), (4, 6), (0, 0))])
def test_crop_takes_its_geometry_as_arguments(rng, big, small, offsets):
    """The window's geometry is passed by value (no table on the device); N-D crops match the CPU's, and a crop
    with more axes not kept whole than the kernel's arguments describe is refused in one line."""
    from superneurons.backend.cuda.kernels import shape_ops as sk

    x = rng.standard_normal(big)
    cut = sum(1 for b, s, o in zip(big, small, offsets) if (b, o) != (s, 0))
    if cut > sk.WINDOW_AXES:
        with pytest.raises(ValueError, match="at most"):
            run_both("crop_forward", [x, np.zeros(small)], offsets)
        return
    (_, yc), (_, yg) = run_both("crop_forward", [x, np.zeros(small)], offsets)
    assert np.array_equal(yg, yc)
    (_, dxc), (_, dxg) = run_both("crop_backward", [rng.standard_normal(small), rng.standard_normal(big)], offsets)
    assert np.array_equal(dxg, dxc)


# Short rows run one thread each; long rows (ASUM here, kept to one case: the simulator is slow) run blocks.
@pytest.mark.parametrize("op,outer,inner", [("SUM", 6, 5), ("ASUM", 6, 5), ("SUMSQ", 6, 5), ("MEAN", 6, 5),
                                            ("ASUM", 1, 300)])
@simulated
def test_reduction(rng, op, outer, inner):
    x = rng.standard_normal((outer, inner))
    (_, yc), (_, yg) = run_both("reduction_forward", [x, np.zeros(outer)], op, 0.7, outer, inner)
    close(yg, yc)
    dy = rng.standard_normal(outer)
    (*_, dxc), (*_, dxg) = run_both("reduction_backward", [x, dy, np.zeros_like(x)], op, 0.7, outer, inner)
    close(dxg, dxc)


@simulated
@pytest.mark.parametrize("top_k,out_max_val", [(1, False), (3, True), (2, False)])
def test_argmax(rng, top_k, out_max_val):
    x = rng.integers(0, 4, (3, 6, 2)).astype(np.float64)  # small integers: many ties (broken to larger index)
    (_, yc), (_, yg) = run_both("argmax_forward", [x, np.zeros((3, top_k, 2))], top_k, out_max_val, True)
    assert np.array_equal(yg, yc)
    x1 = x[:, :, :1].copy()
    width = 2 if out_max_val else 1
    (_, yc), (_, yg) = run_both("argmax_forward", [x1, np.zeros((3, width, top_k))], top_k, out_max_val, False)
    assert np.array_equal(yg, yc)


@simulated
@pytest.mark.parametrize("normalize,rows,n", [(False, 4, 9), (True, 4, 9), (True, 1, 260)])
def test_mvn(rng, normalize, rows, n):
    x = rng.standard_normal((rows, n)) * 2 + 1
    sigma = np.zeros(rows) if normalize else None
    (_, yc, sc), (_, yg, sg) = run_both("mvn_forward", [x, np.zeros_like(x), sigma], rows, n, 1e-9)
    close(yg, yc, rtol=1e-8, atol=1e-10)
    if normalize:
        close(sg, sc)
    dy = rng.standard_normal(x.shape)
    (*_, dxc, _), (*_, dxg, _) = run_both("mvn_backward", [yc if normalize else None, dy, np.zeros_like(x), sc],
                                          rows, n)
    close(dxg, dxc, rtol=1e-8, atol=1e-10)


@simulated
def test_embed(rng):
    input_dim, num_output = 7, 4
    idx = rng.integers(0, input_dim, (3, 5)).astype(np.float64)
    idx[0, :2] = 2.0  # repeated rows add up in the gradient
    w, b = rng.standard_normal((input_dim, num_output)), rng.standard_normal(num_output)
    (*_, yc), (*_, yg) = run_both("embed_forward", [idx, w, b, np.zeros((15, num_output))])
    close(yg, yc)
    dy = rng.standard_normal((15, num_output))
    dw0, db0 = rng.standard_normal(w.shape), rng.standard_normal(b.shape)
    (_, _, dwc, dbc), (_, _, dwg, dbg) = run_both("embed_backward", [idx, dy, dw0, db0])
    close(dwg, dwc)
    close(dbg, dbc)
    idx[1, 1] = 2.5
    with pytest.raises(UserError, match="not an integer"):
        GPU["embed_forward"](*[cuda.to_device(a) for a in (idx, w, b, np.zeros((15, num_output)))])


@simulated
@pytest.mark.parametrize("sel", [[0, 2, 0, -1, 1e-30, 0], [0] * 6, [1] * 6])
def test_select_nonzero(sel):
    """Filter's rows: the positions of the nonzero selector values, in order, and their count."""
    sel = np.array(sel, np.float32).reshape(6, 1)
    pos_c, pos_g = np.full(6, -1.0, np.float32), cuda.to_device(np.full(6, -1.0, np.float32))
    n = CPU.select_nonzero(sel, pos_c)
    assert GPU["select_nonzero"](cuda.to_device(sel), pos_g) == n == int((sel != 0).sum())
    np.testing.assert_array_equal(pos_g.copy_to_host()[:n], pos_c[:n])
    np.testing.assert_array_equal(pos_c[:n], np.flatnonzero(sel))


# -- losses ----------------------------------------------------------------------------------------------

def _loss_pair(op_fwd, op_bwd, inputs, fwd_scalars, bwd_outputs, bwd_scalars, weight=1.7):
    """Forward then backward on both backends; the loss weight comes through the 0-d top diff."""
    (*_, lc), (*_, lg) = run_both(op_fwd, inputs + [np.zeros(())], *fwd_scalars)
    close(lg, lc)
    assert lc != 0
    k = len(bwd_outputs)
    host, dev = run_both(op_bwd, inputs + [np.array(weight)] + bwd_outputs, *bwd_scalars)
    for got, want in zip(dev[-k:], host[-k:]):
        close(got, want)


@simulated
@pytest.mark.parametrize("normalization", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
@pytest.mark.parametrize("ignore_label", [None, 2])
def test_softmax_loss_forward_computes_the_loss_on_the_device(rng, normalization, ignore_label):
    outer, channels, inner = 3, 4, 5
    logits = rng.standard_normal((outer, channels, inner)).astype(np.float32)
    prob = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(np.float32)
    label = rng.integers(0, channels, (outer, inner)).astype(np.float32)
    (*_, lc), (*_, lg) = run_both("softmax_loss_forward", [prob, label, np.zeros((), np.float32)], ignore_label,
                                  normalization)
    assert lc != 0 and lg.dtype == np.float32
    close(lg, lc, rtol=1e-6, atol=0)  # float64 sums in another order (atomics), divided, rounded into float32
    label[1, 3] = channels + 7  # a label outside the classes: the CPU op's error, from the GPU op too
    for op in (CPU.softmax_loss_forward, GPU["softmax_loss_forward"]):
        arrays = [prob, label, np.zeros((), np.float32)]
        if op is not CPU.softmax_loss_forward:
            arrays = [cuda.to_device(a) for a in arrays]
        with pytest.raises(UserError, match=r"1 label\(s\) outside the 4 classes \[0, 4\), e.g. 11"):
            op(*arrays, ignore_label, normalization)


@simulated
def test_euclidean_and_contrastive(rng):
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((5, 3))
    outs = [np.zeros_like(a), np.zeros_like(a)]
    _loss_pair("euclidean_loss_forward", "euclidean_loss_backward", [a, b], (), outs, ())
    a4, b4 = a.reshape(5, 3, 1, 1) * 0.3, b.reshape(5, 3, 1, 1) * 0.3
    sim = np.array([1.0, 0.0, 0.4, -2.0, 0.0])  # 0.4 truncates to 0: dissimilar
    for legacy in (False, True):
        _loss_pair("contrastive_loss_forward", "contrastive_loss_backward", [a4, b4, sim], (1.0, legacy),
                   [np.zeros_like(a4), np.zeros_like(a4)], (1.0, legacy))


@pytest.mark.parametrize("ignore,norm", [(None, "VALID"), (1, "VALID"), (1, "FULL"), (1, "NONE")])
@simulated
def test_sigmoid_cross_entropy(rng, ignore, norm):
    x = rng.standard_normal((4, 6)) * 3
    t = rng.random((4, 6))
    t[0, :3] = 1.0  # ignored when ignore_label is 1
    _loss_pair("sigmoid_ce_loss_forward", "sigmoid_ce_loss_backward", [x, t], (ignore, norm), [np.zeros_like(x)],
               (ignore, norm))


@simulated
@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_and_multinomial(rng, norm):
    x = rng.standard_normal((5, 4))
    label = rng.integers(0, 4, 5).astype(np.float64)
    _loss_pair("hinge_loss_forward", "hinge_loss_backward", [x, label], (norm,), [np.zeros_like(x)], (norm,))
    prob = rng.random((5, 4)) + 0.05
    _loss_pair("multinomial_logistic_loss_forward", "multinomial_logistic_loss_backward", [prob, label], (),
               [np.zeros_like(prob)], ())
    bad = label.copy()
    bad[2] = 4.0
    for op, args in (("hinge_loss_forward", (x, bad, np.zeros((), np.float64), norm)),
                     ("multinomial_logistic_loss_forward", (prob, bad, np.zeros((), np.float64)))):
        with pytest.raises(UserError, match="outside the 4 classes"):
            GPU[op](*[cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in args])


@simulated
@pytest.mark.parametrize("ignore,norm", [(None, "VALID"), (2, "VALID"), (2, "FULL")])
def test_infogain(rng, ignore, norm):
    outer, ch, inner = 2, 4, 3
    prob = rng.random((outer, ch, inner)) + 0.05
    prob /= prob.sum(axis=1, keepdims=True)
    label = rng.integers(0, ch, (outer, inner)).astype(np.float64)
    label[0, 0] = 2.0
    h = rng.random((ch, ch))
    _loss_pair("infogain_loss_forward", "infogain_loss_backward", [prob, label, h], (ignore, norm),
               [np.zeros_like(prob)], (ignore, norm))


# -- random fill -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,a,b,keep", [("uniform", -2.0, 3.0, 1.0), ("gaussian", 0.5, 2.0, 1.0),
                                           ("gaussian", 0.0, 1.0, 0.3)])
@simulated
def test_random_fill_matches_cpu(kind, a, b, keep):
    for dtype in (np.float64, np.float32):
        (yc,), (yg,) = run_both("random_fill", [np.zeros((3, 100), dtype)], kind, a, b, keep, 1701, 42, 5, 3)
        # Same 32-bit words and float64 formulas; libm and NumPy may differ in the last bit of log/cos.
        np.testing.assert_allclose(yg, yc, rtol=1e-12 if dtype == np.float64 else 1e-6, atol=1e-12)
        if dtype == np.float32:
            assert np.mean(yg == yc) > 0.98
