"""Slots of the decode workers' ring go back to the workers only after the device copies reading them.

The Data layer copies each batch to the device straight from its shared-memory slot (page-locked
once, `ops.pin_host`), asynchronously (`ops.upload_pinned` returns the copy's event). A slot handed to
the next batch while its copy is still running would send the device half of another batch; these
tests hold the copies open (fake events, or the CPU backend's SUPERNEURONS_TRANSFER_LAG) and check
that no worker rewrites a slot before its copy completed, that the pool waits for a copy only when
the batch it serves needs that slot, and that the locked memory is released only after the copies.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from superneurons.backend.cuda.probe import gpu_available
from superneurons.data.batches import BatchPlan, Seeds
from superneurons.data.transformer import DataTransformer
from superneurons.data.workers import WorkerPool
from superneurons.proto import superneurons_pb2 as pb
from tests.test_data import take
from tests.test_data_pipeline import assert_same, data_layer, jpeg_db, run

ITEM = (1, 2, 3)
SETTLE_S = 0.5  # time for a worker to rewrite a slot it was wrongly given (a batch here takes microseconds)


class CountingReader:
    """Position p is a record of pixels all equal to p % 251, label p: batch k is known without decoding."""

    def read(self, position):
        return position, np.full(ITEM, position % 251, np.uint8), position

    def close(self):
        pass


class CountingSource:
    count, where, multiprocess = 10**6, "counting source", True

    def open(self, seeds):
        return CountingReader()

    def close(self):
        pass


def expect(batch, k: int, size: int = 2) -> None:
    positions = np.arange(k * size, (k + 1) * size)
    np.testing.assert_array_equal(batch.label, positions, err_msg=f"labels of batch {k}")
    want = np.broadcast_to((positions % 251).astype(np.float32).reshape(-1, 1, 1, 1), (size,) + ITEM)
    np.testing.assert_array_equal(batch.data, want, err_msg=f"pixels of batch {k}")


class HeldCopy:
    """A copy event the test completes by hand; `waited` tells whether the pool blocked on it."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def counting_pool(**kw) -> WorkerPool:
    transformer = DataTransformer(pb.TransformationParameter(), False, "t")
    # 2 workers, depth 2: S = 3 slots
    return WorkerPool(CountingSource(), transformer, BatchPlan(2, ITEM, Seeds((1,))), 0, 2, 2, "layer 't'", **kw)


def test_a_slot_is_reused_only_after_its_copy_completed():
    pool = counting_pool()
    try:
        assert pool.slots == 3
        served = []
        for k in range(3):
            batch = pool.next()
            expect(batch, k)
            copy = HeldCopy()
            pool.reading(copy)
            served.append((batch, copy))
        time.sleep(SETTLE_S)
        for k, (batch, _) in enumerate(served):  # batches 0 and 1 are handed back, their copies still run
            expect(batch, k)

        served[1][1].done = True  # batch 1's copy ends; batch 0's (issued earlier, same stream) is still open
        third = pool.next()  # batch 3 needs slot 0: the pool must wait for batch 0's copy, and only for it
        expect(third, 3)
        assert served[0][1].waited
        assert not served[1][1].waited and not served[2][1].waited  # polled, not waited for
        pool.reading(HeldCopy())
        time.sleep(SETTLE_S)
        expect(served[2][0], 2)  # slot 2: batch 2's copy has not ended, nobody may write it

        expect(pool.next(), 4)  # slot 1, given back at the last poll without waiting
        assert not served[1][1].waited
        expect(pool.next(), 5)  # slot 2: now the pool has to wait for batch 2's copy
        assert served[2][1].waited
    finally:
        pool.close()


def test_batches_with_no_copy_reported_free_their_slot_at_the_next_request():
    pool = counting_pool()
    try:
        for k in range(10):  # more than S: every slot is reused, never waited on
            expect(pool.next(), k)
    finally:
        pool.close()


class RecordingPin:
    def __init__(self, memory: np.ndarray, copies: list[HeldCopy]):
        self.nbytes = memory.nbytes
        self.copies = copies
        self.copies_done_at_release: bool | None = None

    def release(self) -> None:
        self.copies_done_at_release = all(c.done for c in self.copies)


def test_the_ring_is_pinned_once_and_unpinned_only_after_its_copies():
    copies: list[HeldCopy] = []
    pins: list[RecordingPin] = []

    def pin(memory):
        pins.append(RecordingPin(memory, copies))
        return pins[-1]

    pool = counting_pool(pin=pin)
    try:
        assert pool.pinned and pool.pin_failure is None
        slot_bytes = (2 * int(np.prod(ITEM)) + 2) * 4
        assert len(pins) == 1 and pins[0].nbytes == pool.slots * slot_bytes
        for k in range(2):
            expect(pool.next(), k)
            copies.append(HeldCopy())
            pool.reading(copies[-1])
    finally:
        pool.close()
    assert pins[0].copies_done_at_release is True
    assert all(c.waited for c in copies)  # close() waited for both: the held batch's and the handed-back one's


def test_memory_that_cannot_be_pinned_leaves_the_staged_upload(tmp_path, capsys):
    from superneurons.backend.cpu import CpuBackend

    def refuse(memory):
        raise MemoryError("cuMemHostRegister of 1 MiB failed: out of memory")

    src = jpeg_db(tmp_path / "jpeg", n=13)
    want = run(lambda: data_layer(src, 3, 1), 5)
    layer, shapes = data_layer(src, 3, 3)
    calls = {"upload_async": 0}
    ops = CpuBackend().ops

    def counted(dst, host):
        calls["upload_async"] += 1
        ops.upload_async(dst, host)

    layer.ops = SimpleNamespace(**{**vars(ops), "pin_host": refuse, "upload_async": counted})
    try:
        assert_same(take(layer, shapes, 5), want)
        assert isinstance(layer.batch_maker, WorkerPool) and not layer.batch_maker.pinned
        assert calls["upload_async"] == 10  # data and label of 5 batches
    finally:
        layer.close()
    err = capsys.readouterr().err
    assert "cannot page-lock the decode workers' slots (cuMemHostRegister of 1 MiB failed" in err
    assert "layer 'src' (Data)" in err


class CheckedCopy:
    """Wraps a copy event; every poll before it completes checks that the slot it reads is intact."""

    def __init__(self, event, host: np.ndarray, log: dict):
        self.event, self.host, self.want, self.log = event, host, host.copy(), log

    def _check(self) -> None:
        if not np.array_equal(self.host, self.want):
            self.log["rewritten"] += 1

    def query(self) -> bool:
        self._check()
        done = self.event.query()
        self.log["pending" if not done else "completed"] += 1
        return done

    def synchronize(self) -> None:
        self._check()
        self.log["waited"] += 1
        self.event.synchronize()


@pytest.mark.parametrize("lag", [0, 3])
def test_the_layer_under_a_lagging_copy_stream_gives_the_same_batches(tmp_path, monkeypatch, lag):
    from superneurons.backend.cpu import CpuBackend

    monkeypatch.setenv("SUPERNEURONS_TRANSFER_LAG", str(lag))
    src = jpeg_db(tmp_path / "jpeg", n=17)
    want = run(lambda: data_layer(src, 3, 1), 12)
    layer, shapes = data_layer(src, 3, 2)  # 2 workers, prefetch 2: 3 slots, reused four times in 12 batches
    log = {"rewritten": 0, "pending": 0, "completed": 0, "waited": 0}
    ops = CpuBackend().ops

    def checked(dst, host):
        return CheckedCopy(ops.upload_pinned(dst, host), host, log)

    layer.ops = SimpleNamespace(**{**vars(ops), "upload_pinned": checked})
    got = []
    try:
        for _ in range(12):
            got += take(layer, shapes, 1)
            time.sleep(0.05)  # time for a worker to rewrite a slot given back too early
        assert isinstance(layer.batch_maker, WorkerPool) and layer.batch_maker.pinned
        waited_while_serving = log["waited"]  # close() waits for the last batch's copies, later
    finally:
        layer.close()
    assert_same(got, want)
    assert log["rewritten"] == 0
    if lag:
        assert log["pending"] > 0  # the copies did lag: the pool had to poll them more than once
    else:
        assert log["pending"] == 0 and waited_while_serving == 0


def test_a_batch_kept_after_close_stays_readable():
    pool = counting_pool()
    batch = pool.next()
    pool.close()  # the shared memory is unlinked; the mapping stays while the batch views it
    expect(batch, 0)
    del batch
    counting_pool().close()  # a later close() unmaps the ring the batch kept



# ---- the GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
def test_pinned_upload_from_shared_memory_is_ordered_with_the_compute(gpu, rng):
    from multiprocessing import shared_memory

    shape = (64, 3, 64, 64)
    n = int(np.prod(shape))
    shm = shared_memory.SharedMemory(create=True, size=2 * n * 4)
    try:
        ring = np.ndarray((2 * n * 4,), np.uint8, shm.buf)
        pin = gpu.ops.pin_host(ring)
        slots = [ring[s * n * 4:(s + 1) * n * 4].view(np.float32).reshape(shape) for s in range(2)]
        d = gpu.view(gpu.arena(n * 4), 0, shape)
        for step in range(5):
            x = rng.standard_normal(shape).astype(np.float32)
            host = slots[step % 2]
            host[:] = x
            gpu.ops.fill(d, 7.0)  # queued before the copy: the copy must land after it
            done = gpu.ops.upload_pinned(d, host)
            gpu.ops.scal(2.0, d)  # queued after: must see the copy
            np.testing.assert_array_equal(gpu.to_host(d), 2 * x)
            assert done.query()  # to_host waited for stream 0, which waited for the copy
        gpu.synchronize()
        pin.release()
        del slots, host, ring
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
def test_the_data_layer_on_the_gpu_copies_from_pinned_slots_the_same_bytes(gpu, tmp_path):
    src = jpeg_db(tmp_path / "jpeg", n=23)
    want = run(lambda: data_layer(src, 4, 1), 9)
    layer, shapes = data_layer(src, 4, 3)
    layer.ops = gpu.ops
    tops = [gpu.view(gpu.arena(int(np.prod(s)) * 4), 0, s) for s in shapes]
    got = []
    try:
        for _ in range(9):
            layer.forward([], tops)
            got.append([gpu.to_host(t) for t in tops])
        assert isinstance(layer.batch_maker, WorkerPool) and layer.batch_maker.pinned
    finally:
        layer.close()
    assert_same(got, want)

