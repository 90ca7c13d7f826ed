"""Slab copies: Concat's forward (each bottom into its slab of the top) and its backward (each bottom's slab
of the top diff out), also Slice's two passes.

A slab copy is `outer` rows of `length` contiguous elements; row o is read from src[o * src_pitch + src_base:]
and written to dst[o * dst_pitch + dst_base:] (for an (outer, axis, inner) view: length = width * inner,
pitch = the array's axis extent * inner, base = the slab's offset along the axis * inner).

Two walks, neither dividing per element (a 64-bit division costs tens of instructions, more than a copy's
element is worth), both with four loads per thread in flight before any store (as kernels/fused.py explains,
one outstanding load per thread leaves most of the memory bandwidth unused):

- `copy_rows`, rows of ROWS_MIN elements or more (every net's concat: a row is a bottom's channels times a
  plane): a block takes one (row, part of row) task at a time, its threads sweeping the part with flat
  indices BLOCK apart; the task's row and part are stepped by additions from block to block's next task,
  so a block divides twice in all, and the grid may be smaller than the number of tasks.
- `copy_short_rows`, shorter rows (down to one element: concatenated fc outputs): a grid-stride walk over all
  outer * length elements in which each thread keeps its (row, offset) position and steps it by additions.

Masked positions (past a row's part, or past the last row) re-read the thread's first position, which is
always valid, so the four loads need no branches; only their stores are skipped.

With `relu` set, each copied gradient goes through a ReLU's backward on the way (`leaky_grad` against `y` at
the destination position, the ReLU's output): the backward of a ReLU in place on a Concat's bottom, read
straight from the Concat's top gradient (graph/fuse.py), in the pass that would only have copied it.
"""
from __future__ import annotations

from numba import cuda, uint64

from superneurons.backend.cuda.kernels import BLOCK
from superneurons.backend.cuda.kernels.elementwise import four_indices, leaky_grad

ROWS_MIN = 4 * BLOCK  # row length from which copy_rows runs: every thread of a task has a full trip of four
PART = 16 * BLOCK  # the most elements of a row one copy_rows task takes (16 per thread: four trips)


@cuda.jit(device=True, inline=True)
def at(i):
    """Index i (never negative) as unsigned: numba then skips the wrap-around of negative indices, three
    64-bit instructions per access, a third of what a copied element costs in index arithmetic."""
    return uint64(i)


@cuda.jit(device=True, inline=True)
def copy_run(src, s, dst, d, i, end, y, slope, relu):
    """dst[d + j] = src[s + j] for j = i, i + BLOCK, ... < end (through the ReLU's backward where `relu`);
    four loads per trip."""
    while i < end:
        i1, i2, i3, valid = four_indices(i, end, BLOCK)
        v0, v1, v2, v3 = src[at(s + i)], src[at(s + i1)], src[at(s + i2)], src[at(s + i3)]
        if relu:
            v0, v1, v2, v3 = (leaky_grad(v0, y[at(d + i)], slope), leaky_grad(v1, y[at(d + i1)], slope),
                              leaky_grad(v2, y[at(d + i2)], slope), leaky_grad(v3, y[at(d + i3)], slope))
        dst[at(d + i)] = v0
        if valid > 1:
            dst[at(d + i1)] = v1
        if valid > 2:
            dst[at(d + i2)] = v2
        if valid > 3:
            dst[at(d + i3)] = v3
        i += 4 * BLOCK


@cuda.jit
def copy_rows(src, dst, outer, src_pitch, src_base, dst_pitch, dst_base, length, y, slope, relu, part, parts):
    """The slab copy as tasks (row o, part p) = elements [p * part, min((p + 1) * part, length)) of row o,
    numbered row-major; block b takes tasks b, b + grid, b + 2 grid, ..."""
    grid = cuda.gridDim.x
    o = cuda.blockIdx.x // parts
    p = cuda.blockIdx.x - o * parts
    step_o = grid // parts  # the next task, grid tasks on, is step_o rows and step_p parts further
    step_p = grid - step_o * parts
    tid = cuda.threadIdx.x
    while o < outer:
        start = p * part
        copy_run(src, o * src_pitch + src_base, dst, o * dst_pitch + dst_base, start + tid,
                 min(start + part, length), y, slope, relu)
        o += step_o
        p += step_p
        if p >= parts:
            p -= parts
            o += 1


@cuda.jit(device=True, inline=True)
def next_position(o, r, step_o, step_r, length):
    """The (row, offset) `stride` elements on from (o, r), stride = step_o * length + step_r, step_r < length."""
    o += step_o
    r += step_r
    if r >= length:
        r -= length
        o += 1
    return o, r


@cuda.jit
def copy_short_rows(src, dst, outer, src_pitch, src_base, dst_pitch, dst_base, length, y, slope, relu):
    """The slab copy as one grid-stride walk over the outer * length elements, four positions a grid
    apart per trip (launched for a quarter of the elements, as kernels.launch_unrolled)."""
    stride = cuda.gridsize(1)
    i = cuda.grid(1)
    o = i // length
    r = i - o * length
    step_o = stride // length
    step_r = stride - step_o * length
    while o < outer:
        o1, r1 = next_position(o, r, step_o, step_r, length)
        o2, r2 = next_position(o1, r1, step_o, step_r, length)
        o3, r3 = next_position(o2, r2, step_o, step_r, length)
        valid = 1 + (o1 < outer) + (o2 < outer) + (o3 < outer)
        s0 = o * src_pitch + src_base + r
        s1 = o1 * src_pitch + src_base + r1 if o1 < outer else s0
        s2 = o2 * src_pitch + src_base + r2 if o2 < outer else s0
        s3 = o3 * src_pitch + src_base + r3 if o3 < outer else s0
        v0, v1, v2, v3 = src[at(s0)], src[at(s1)], src[at(s2)], src[at(s3)]
        d0 = o * dst_pitch + dst_base + r
        d1 = o1 * dst_pitch + dst_base + r1 if o1 < outer else d0
        d2 = o2 * dst_pitch + dst_base + r2 if o2 < outer else d0
        d3 = o3 * dst_pitch + dst_base + r3 if o3 < outer else d0
        if relu:
            v0, v1, v2, v3 = (leaky_grad(v0, y[at(d0)], slope), leaky_grad(v1, y[at(d1)], slope),
                              leaky_grad(v2, y[at(d2)], slope), leaky_grad(v3, y[at(d3)], slope))
        dst[at(d0)] = v0
        if valid > 1:
            dst[at(d1)] = v1
        if valid > 2:
            dst[at(d2)] = v2
        if valid > 3:
            dst[at(d3)] = v3
        o, r = next_position(o3, r3, step_o, step_r, length)
