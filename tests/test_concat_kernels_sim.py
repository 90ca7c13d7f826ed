"""The GPU Concat/Slice slab copies (kernels/slab.py through ops/concat.py) under the CUDA simulator
(NUMBA_ENABLE_CUDASIM=1), no GPU needed: concat forward and the backward's slice at every offset (also through a
ReLU's backward, relu_backward_slab) against NumPy slicing on fresh random inputs, for axes 0-3, rows of one element, rows shorter than a block, rows not a multiple
of four, rows of several tasks, and grids smaller than the number of rows or tasks.

The `simulator` tests here run in `make test`'s simulator pass (tests/cudasim.py); a plain pytest run
deselects them. Skipped without numba-cuda. The gpu-marked tests at the end run the same ops on a real device
against the CPU op.
"""
from __future__ import annotations


import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from cudasim import simulated  # noqa: E402


from superneurons.backend.cuda.kernels import slab as sk  # noqa: E402
from superneurons.backend.cuda.ops import concat as gcat  # noqa: E402

# (bottom shapes, axis). Row length = width * inner: 1 (fc outputs, axis 1 of (N, C)); a few elements; below a
# block; between a block and ROWS_MIN (the short-row walk wraps rows within a trip); ROWS_MIN and more, not a
# multiple of four, and past PART (several tasks per row, the last one short); axis 0 (one row per bottom).
CASES = [
    ([(5, 1), (5, 3)], 1),
    ([(3, 2, 1, 1), (3, 1, 1, 1), (3, 4, 1, 1), (3, 1, 1, 1)], 1),
    ([(2, 3, 5, 7), (2, 5, 5, 7)], 1),
    ([(2, 3, 10, 13), (2, 1, 10, 13), (2, 2, 10, 13)], 1),
    ([(2, 5, 15, 15), (2, 3, 15, 15)], 1),
    ([(2, 3, 41, 37), (2, 1, 41, 37)], 1),
    ([(3, 2, 5), (2, 2, 5), (1, 2, 5)], 0),
    ([(2, 3, 17, 31), (1, 3, 17, 31)], 0),
    ([(2, 3, 4, 5), (2, 3, 7, 5)], 2),
    ([(2, 3, 4, 5), (2, 3, 4, 1), (2, 3, 4, 3)], 3),
    ([(3, 2, 1), (3, 2, 2)], 2),
]


def _fresh(rng, shapes):
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def _top_shape(shapes, axis):
    top = list(shapes[0])
    top[axis] = sum(s[axis] for s in shapes)
    return tuple(top)


def _check_forward_and_backward(rng, shapes, axis, max_blocks=None):
    """concat_forward into a NaN-filled top equals np.concatenate (every element written, none outside its slab);
    concat_backward at each bottom's offset equals NumPy's slice of a fresh top diff."""
    limit = {} if max_blocks is None else {"max_blocks": max_blocks}
    xs = _fresh(rng, shapes)
    top = cuda.to_device(np.full(_top_shape(shapes, axis), np.nan, np.float32))
    offset = 0
    for x in xs:
        gcat.slab_copy(cuda.to_device(x), top, axis, 0, offset, x.shape[axis], **limit)
        offset += x.shape[axis]
    np.testing.assert_array_equal(top.copy_to_host(), np.concatenate(xs, axis=axis))

    dtop = rng.standard_normal(_top_shape(shapes, axis)).astype(np.float32)
    d_dtop = cuda.to_device(dtop)
    offset = 0
    for x in xs:
        width = x.shape[axis]
        got = cuda.to_device(np.full(x.shape, np.nan, np.float32))
        gcat.slab_copy(d_dtop, got, axis, offset, 0, width, **limit)
        index = [slice(None)] * dtop.ndim
        index[axis] = slice(offset, offset + width)
        np.testing.assert_array_equal(got.copy_to_host(), dtop[tuple(index)])
        # through a ReLU's backward on the way (a ReLU in place on this bottom reading its slice itself)
        y = np.maximum(x, 0)
        want = dtop[tuple(index)] * np.where(y > 0, np.float32(1), np.float32(0.25))
        masked = cuda.to_device(np.full(x.shape, np.nan, np.float32))
        gcat.slab_copy(d_dtop, masked, axis, offset, 0, width, **limit, relu_output=cuda.to_device(y), slope=0.25)
        np.testing.assert_array_equal(masked.copy_to_host(), want)
        offset += width
    np.testing.assert_array_equal(d_dtop.copy_to_host(), dtop)  # the source is only read


@simulated
@pytest.mark.parametrize("shapes,axis", CASES)
def test_slab_copies_match_numpy(rng, shapes, axis):
    _check_forward_and_backward(rng, shapes, axis)


@simulated
@pytest.mark.parametrize("shapes,axis", [
    ([(7, 1, 3), (7, 2, 3)], 1),  # short rows: each thread's walk wraps over rows many times
    ([(5, 1, 1024), (5, 3, 1024)], 1),  # one task per row of the first bottom: each block takes several rows
    ([(5, 1, 1100), (5, 2, 1100)], 1),  # rows of 1024 + 76 and 1024 + 1024 + 152: blocks step part and row
    ([(3, 4, 1030), (3, 1, 1030)], 1),  # rows of five tasks, the last of 24 elements
])
@pytest.mark.parametrize("max_blocks", [1, 2, 3])
def test_grids_smaller_than_the_work(rng, shapes, axis, max_blocks):
    _check_forward_and_backward(rng, shapes, axis, max_blocks)


@simulated
def test_the_walk_each_length_takes(monkeypatch):
    """Rows below ROWS_MIN take the short-row walk, longer ones copy_rows with one block per task."""
    launched = []
    real = gcat.K.launch

    def recording(kernel, n, blocks=None):
        launched.append((kernel, blocks))
        return real(kernel, n, blocks=blocks)

    monkeypatch.setattr(gcat.K, "launch", recording)
    length = sk.ROWS_MIN + sk.PART + 1
    gcat.slab_copy(cuda.to_device(np.zeros((2, 1, length), np.float32)),
                   cuda.to_device(np.zeros((2, 2, length), np.float32)), 1, 0, 1, 1)
    gcat.slab_copy(cuda.to_device(np.zeros((2, 1, sk.ROWS_MIN - 1), np.float32)),
                   cuda.to_device(np.zeros((2, 3, sk.ROWS_MIN - 1), np.float32)), 1, 0, 2, 1)
    assert launched == [(sk.copy_rows, 2 * gcat.row_parts(2, length)[1]), (sk.copy_short_rows, 2)]


@pytest.mark.parametrize("outer,length,want", [
    (64, 193600, (4096, 48)),  # SqueezeNet fire2's bottoms at batch 64: parts of PART
    (64, 16384, (1024, 16)),  # Inception-C's 256 x 8 x 8 at batch 64: split finer to make TASKS_MIN tasks
    (4096, 4100, (3072, 2)),  # equal parts in whole trips, not 4096 + 4
    (1, 4100, (1024, 5)),
    (3000, 1024, (1024, 1)),
    (1, 10 ** 8, (4096, 24415)),  # axis 0: one huge row
])
def test_row_parts(outer, length, want):
    part, parts = gcat.row_parts(outer, length)
    assert (part, parts) == want
    trip = gcat.K.UNROLL * gcat.K.BLOCK
    assert part % trip == 0 and part <= sk.PART and (parts - 1) * part < length <= parts * part


# ---- on a real device, against the CPU op ------------------------------------------------------------------

GPU_CASES = CASES + [([(64, 64, 55, 55), (64, 64, 55, 55)], 1), ([(16, 384, 8, 8), (16, 256, 8, 8)], 1),
                     ([(8, 512, 7, 7), (8, 32, 7, 7)], 1), ([(64, 10), (64, 7)], 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("shapes,axis", GPU_CASES)
def test_ops_match_the_cpu_op(gpu, rng, shapes, axis):
    from gpu_harness import CPU, dev

    cpu = CPU.ops
    xs = _fresh(rng, shapes)
    want = np.full(_top_shape(shapes, axis), np.nan, np.float32)
    cpu.concat_forward(xs, want, axis)
    top = dev(gpu, np.full(want.shape, np.nan, np.float32))
    gpu.ops.concat_forward([dev(gpu, x) for x in xs], top, axis)
    np.testing.assert_array_equal(gpu.to_host(top), want)

    dtop = rng.standard_normal(want.shape).astype(np.float32)
    d_dtop = dev(gpu, dtop)
    offset = 0
    for x in xs:
        expect, got = np.full(x.shape, np.nan, np.float32), dev(gpu, np.full(x.shape, np.nan, np.float32))
        cpu.concat_backward(dtop, expect, axis, offset)
        gpu.ops.concat_backward(d_dtop, got, axis, offset)
        np.testing.assert_array_equal(gpu.to_host(got), expect)
        y = np.maximum(x, 0)
        for slope in (0.0, 0.25):
            cpu.relu_backward_slab(y, dtop, expect, axis, offset, slope)
            gpu.ops.relu_backward_slab(dev(gpu, y), d_dtop, got, axis, offset, slope)
            np.testing.assert_array_equal(gpu.to_host(got), expect)
        offset += x.shape[axis]
