"""The numba kernels on float16 and bfloat16 arrays under the CUDA simulator: they load half values, compute in
float32 (the scalars `device.scalar` passes are float32) and round once when they store, so each result is the
float64 reference rounded to the storage type, within one unit in the last place where float32 arithmetic rounds
on the way (two for a sum). Also the float32-copies path (`half_math.on_float32_copies`) that ops without a half
path take. Runs in `make test`'s simulator pass (tests/cudasim.py)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

if "numba" not in sys.modules:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
cuda = pytest.importorskip("numba.cuda")
from cudasim import simulated  # noqa: E402

from superneurons.backend.cuda import kernels as K  # noqa: E402
from superneurons.backend.cuda.device import scalar  # noqa: E402
from superneurons.backend.cuda.kernels import elementwise as ek  # noqa: E402
from superneurons.dtypes import BFLOAT16, FLOAT16  # noqa: E402

ULP = {FLOAT16: 2.0 ** -10, BFLOAT16: 2.0 ** -7}  # relative spacing of the type's values at 1


def _half(rng, dtype, *shape):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _close(got, want64, dtype, ulps=1):
    """got (half) equals want64 rounded to `dtype`, within `ulps` units in the last place of each value."""
    assert got.dtype == dtype
    rounded = want64.astype(np.float32).astype(dtype).astype(np.float64)
    err = np.abs(got.astype(np.float64) - rounded)
    assert (err <= ulps * ULP[dtype] * np.maximum(np.abs(rounded), 2.0 ** -14) + 1e-30).all(), err.max()


@simulated
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["fp16", "bf16"])
def test_elementwise_kernels_compute_in_float32_and_round_once(dtype):
    rng = np.random.default_rng()
    a, b = _half(rng, dtype, 500), _half(rng, dtype, 500)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    y = np.empty_like(a)
    K.launch(ek.scale_copy, y.size)(scalar(y, 0.3), a, y)
    _close(y, 0.3 * a64, dtype)
    y = b.copy()
    K.launch(ek.axpby, y.size)(scalar(y, 1.5), a, scalar(y, -0.25), y)
    _close(y, 1.5 * a64 - 0.25 * b64, dtype, ulps=2)
    y = np.empty_like(a)
    K.launch_unrolled(ek.weighted_sum2_relu, y.size)(scalar(y, 1.0), a, scalar(y, 1.0), b, y, scalar(y, 0.0))
    _close(y, np.maximum(a64 + b64, 0.0), dtype)
    K.launch(ek.fill, y.size)(y, scalar(y, 3.3))
    assert (y == np.float32(3.3).astype(dtype)).all()


@simulated
@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16], ids=["fp16", "bf16"])
def test_a_cast_between_float32_and_half_rounds_to_nearest_even(dtype):
    """ops.copy across types (the working copies of the weights) is scale_copy by 1: NumPy's own rounding."""
    rng = np.random.default_rng()
    master = (rng.standard_normal(1000) * 10).astype(np.float32)
    copy = np.empty(1000, dtype)
    K.launch(ek.scale_copy, copy.size)(scalar(copy, 1.0), master, copy)
    np.testing.assert_array_equal(copy.view(np.uint16), master.astype(dtype).view(np.uint16))
    back = np.empty(1000, np.float32)
    K.launch(ek.scale_copy, back.size)(scalar(back, 1.0), copy, back)
    np.testing.assert_array_equal(back, copy.astype(np.float32))


@simulated
def test_an_op_without_a_half_path_runs_on_float32_copies_rounded_back():
    """The fallback widens each half argument once (one copy for two views of the same memory), runs the float32
    op, and rounds every copy back: an in-place op sees one array, read-only inputs come back unchanged."""
    from superneurons.backend.cuda import half_math

    rng = np.random.default_rng()
    x = _half(rng, BFLOAT16, 64)
    before = x.copy()
    y = np.zeros(64, BFLOAT16)
    seen = {}

    def float32_only(src, dst, also_dst):
        seen["types"] = (src.dtype, dst.dtype)
        seen["same"] = dst is also_dst
        K.launch(ek.scale_copy, dst.size)(np.float32(1.0 / 3.0), src, dst)

    half_math.on_float32_copies(float32_only, (x, y, y), {})
    assert seen == {"types": (np.float32, np.float32), "same": True}
    np.testing.assert_array_equal(x.view(np.uint16), before.view(np.uint16))
    np.testing.assert_array_equal(y, (before.astype(np.float32) * np.float32(1.0 / 3.0)).astype(BFLOAT16))


@simulated
def test_an_op_that_refuses_half_arrays_falls_back_and_is_remembered_per_types(monkeypatch):
    """`half_fallback`: the first call with half arguments tries the op, which refuses; the call runs on float32
    copies and the op's types are remembered, so later calls with those types go straight to the copies, while
    other types still try the op. An op refusing arguments none of which is half raises its own error."""
    from superneurons.backend.cuda import half_math

    monkeypatch.setattr(half_math, "_refused", {})
    monkeypatch.setattr(half_math, "_refusing", set())
    calls = []

    def float32_only(src, dst):
        calls.append(src.dtype)
        if src.dtype != np.float32:
            raise half_math.Unsupported("float32 only")
        K.launch(ek.scale_copy, dst.size)(np.float32(2.0), src, dst)

    run = half_math.half_fallback("doubled", float32_only)
    rng = np.random.default_rng()
    x, y = _half(rng, BFLOAT16, 16), np.zeros(16, BFLOAT16)
    run(x, y)
    assert calls == [BFLOAT16, np.float32]  # tried, refused, then on the copies
    np.testing.assert_array_equal(y, (x.astype(np.float32) * 2).astype(BFLOAT16))
    run(x, y)
    assert calls[2:] == [np.float32]  # remembered: straight to the copies
    assert set(half_math.refused()) == {("doubled", ("bfloat16", "bfloat16"))}
    f = np.ones(16, np.float32)
    run(f, np.zeros(16, np.float32))  # float32 arguments: the op itself
    assert calls[3:] == [np.float32]
    h = _half(rng, FLOAT16, 16)
    run(h, np.zeros(16, FLOAT16))  # other half types are tried again
    assert calls[4:] == [FLOAT16, np.float32]

    def refuses_anything(a):
        raise half_math.Unsupported("never")

    with pytest.raises(half_math.Unsupported, match="never"):
        half_math.half_fallback("never", refuses_anything)(f)
    assert "never" not in half_math._refusing


@simulated
def test_in_a_net_the_float32_copies_come_from_the_planned_room_or_say_they_are_outside_it(capfd):
    """Inside a Net's step (copy_room.install) the copies are views of the step's room, given back when the op
    returns; past a room too small for them (or a step with none) the op still runs, on the module's own
    buffers, and one line per layer and op names the bytes SUPERNEURONS_COPY_RESERVE would plan (a refusal
    would stop the run midway); outside a Net (NO_NET) the module's own buffers serve, as before."""
    from superneurons.backend.cuda import copy_room, half_math

    rng = np.random.default_rng(1)
    x = _half(rng, BFLOAT16, 64)
    y = np.zeros(64, BFLOAT16)
    seen = []
    want = (x.astype(np.float32) * 2).astype(BFLOAT16)

    def float32_only(src, dst):
        seen.append((src, dst))
        K.launch(ek.scale_copy, dst.size)(np.float32(2.0), src, dst)

    room = np.zeros(2 * copy_room.ALIGN, np.uint8)  # two float32 copies of 64 values, each aligned
    try:
        copy_room.install(room, "loss")
        half_math.on_float32_copies(float32_only, (x, y), {})
        src, dst = seen[-1]
        assert np.shares_memory(src, room) and np.shares_memory(dst, room) and not np.shares_memory(src, dst)
        assert copy_room.mark() == 0  # given back
        np.testing.assert_array_equal(y, want)
        capfd.readouterr()
        for region, layer, planned in ((room[:copy_room.ALIGN], "loss", 256), (None, "ip", 0)):
            copy_room.install(region, layer)
            y[:] = 0
            half_math.on_float32_copies(float32_only, (x, y), {})
            np.testing.assert_array_equal(y, want)
            assert not np.shares_memory(seen[-1][1], room)  # the second copy did not fit: the module's buffer
            assert copy_room.mark() == 0
            half_math.on_float32_copies(float32_only, (x, y), {})  # logged once per layer and op
            lines = [ln for ln in capfd.readouterr().err.splitlines() if "outside the plan" in ln]
            assert len(lines) == 1 and lines[0].startswith("W"), lines
            assert (f"layer '{layer}': GPU op float32_only needs 512 bytes of device copies" in lines[0]
                    and f"the net planned {planned} for this step" in lines[0]
                    and "SUPERNEURONS_COPY_RESERVE=512" in lines[0])
    finally:
        copy_room.install(copy_room.NO_NET, "")
    half_math.on_float32_copies(float32_only, (x, y), {})
    assert not np.shares_memory(seen[-1][0], room)
