"""Decode worker processes: the same bytes as the in-process path, resumable, sharded, and fault-tolerant."""
from __future__ import annotations

import io
import os
import signal
import time

import numpy as np
import pytest
from PIL import Image

from superneurons.backend.cuda.probe import gpu_available
from superneurons.data.datum import array_to_datum, encoded_datum
from superneurons.data.lmdb_source import write_lmdb
from superneurons.data.workers import WorkerPool
from superneurons.dtypes import BFLOAT16, FLOAT16
from superneurons.errors import UserError
from superneurons.proto import superneurons_pb2 as pb
from tests.harness import make_layer
from tests.test_data import take

TRAIN_TRANSFORM = "crop_size: 24 mirror: true mean_value: 104 mean_value: 117 mean_value: 123 scale: 0.5"


def jpeg(rng, h=32, w=28) -> bytes:
    # Smooth noise upscaled, so the JPEG codec has edges and flat areas to work on, as in a photo.
    small = rng.integers(0, 256, size=(h // 4, w // 4, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h), Image.BILINEAR).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def jpeg_db(path, n=23, seed=0, corrupt: int | None = None) -> str:
    rng = np.random.default_rng(seed)

    def records():
        for i in range(n):
            data = jpeg(rng)
            if i == corrupt:
                data = data[:20] + b"\x00" * 40  # a JPEG header, then garbage
            yield b"%08d" % i, encoded_datum(data, label=i).SerializeToString()

    write_lmdb(str(path), records())
    return str(path)


def raw_db(path, n=19, seed=1) -> tuple[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 3, 9, 7), dtype=np.uint8)
    write_lmdb(str(path), ((b"%08d" % i, array_to_datum(images[i], i).SerializeToString()) for i in range(n)))
    return str(path), images


def data_layer(source, batch, workers, transform=TRAIN_TRANSFORM, phase=pb.TRAIN, extra=""):
    text = (f'name: "src" type: "Data" top: "data" top: "label" transform_param {{ {transform} }} '
            f'data_param {{ source: "{source}" batch_size: {batch} backend: LMDB decode_workers: {workers} '
            f'prefetch: 2 {extra} }}')
    layer, shapes = make_layer(text, [], phase=phase)
    layer.ctx.seed = 77
    return layer, shapes


def image_data_layer(list_file, batch, workers):
    text = (f'name: "src" type: "ImageData" top: "data" top: "label" transform_param {{ {TRAIN_TRANSFORM} }} '
            f'image_data_param {{ source: "{list_file}" batch_size: {batch} shuffle: true '
            f'new_height: 30 new_width: 26 decode_workers: {workers} }}')
    layer, shapes = make_layer(text, [], phase=pb.TRAIN)
    layer.ctx.seed = 5
    return layer, shapes


def run(make, n):
    layer, shapes = make()
    try:
        return take(layer, shapes, n)
    finally:
        layer.close()


def assert_same(a, b):
    assert len(a) == len(b)
    for (da, la), (db, lb) in zip(a, b):
        assert da.tobytes() == db.tobytes()
        assert la.tobytes() == lb.tobytes()


# ---- the same bytes --------------------------------------------------------------------------------
def test_jpeg_lmdb_same_batches_for_1_and_3_workers(tmp_path):
    src = jpeg_db(tmp_path / "jpeg")
    # 9 batches of 5 from 23 records: wraps around the database twice, and crosses workers 3 times.
    one = run(lambda: data_layer(src, 5, 1), 9)
    three = run(lambda: data_layer(src, 5, 3), 9)
    assert_same(one, three)
    assert not np.isnan(three[-1][0]).any()
    assert [int(x) for x in three[4][1]] == [(4 * 5 + i) % 23 for i in range(5)]


def test_raw_lmdb_same_batches_and_the_records_expected(tmp_path):
    src, images = raw_db(tmp_path / "raw")
    one = run(lambda: data_layer(src, 4, 1, transform="mean_value: 10", phase=pb.TEST), 7)
    three = run(lambda: data_layer(src, 4, 3, transform="mean_value: 10", phase=pb.TEST), 7)
    assert_same(one, three)
    for k, (data, label) in enumerate(three):  # independent of the code: batch k is records 4k..4k+3 mod 19
        numbers = [(4 * k + i) % 19 for i in range(4)]
        np.testing.assert_array_equal(data, images[numbers].astype(np.float32) - 10)
        np.testing.assert_array_equal(label, numbers)


def test_image_data_same_batches_for_1_and_3_workers(tmp_path):
    rng = np.random.default_rng(3)
    lines = []
    for i in range(11):
        (tmp_path / f"im{i}.jpg").write_bytes(jpeg(rng, 40, 36))
        lines.append(f"{tmp_path}/im{i}.jpg {i}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    one = run(lambda: image_data_layer(tmp_path / "list.txt", 4, 1), 6)
    three = run(lambda: image_data_layer(tmp_path / "list.txt", 4, 3), 6)
    assert_same(one, three)
    # shuffle: each pass of 11 is a permutation of all 11 images
    labels = np.concatenate([b[1] for b in three])
    assert sorted(labels[:11].tolist()) == list(range(11))


def test_resume_at_batch_k_sees_the_uninterrupted_batches(tmp_path):
    src = jpeg_db(tmp_path / "jpeg")
    whole = run(lambda: data_layer(src, 4, 3), 8)
    layer, shapes = data_layer(src, 4, 3)
    try:
        take(layer, shapes, 2)
        layer.restore({"batch": 5})  # jump forward: the workers restart at 5
        assert_same(take(layer, shapes, 3), whole[5:8])
        layer.restore({"batch": 1})  # and back
        assert_same(take(layer, shapes, 2), whole[1:3])
        assert layer.state() == {"batch": 3}
    finally:
        layer.close()


def test_ranks_partition_the_one_rank_batch(tmp_path):
    src, _ = raw_db(tmp_path / "raw", n=29)
    ranks, b = 3, 2
    whole = run(lambda: data_layer(src, ranks * b, 2, transform="", phase=pb.TEST), 4)
    per_rank = []
    for r in range(ranks):
        layer, shapes = data_layer(src, b, 2, transform="", phase=pb.TEST)
        layer.ctx.rank, layer.ctx.ranks = r, ranks
        try:
            per_rank.append(take(layer, shapes, 4))
        finally:
            layer.close()
    for k in range(4):
        union = sorted(int(x) for r in range(ranks) for x in per_rank[r][k][1])
        assert union == sorted(int(x) for x in whole[k][1])
        assert [int(x) for x in per_rank[1][k][1]] == [(k * b + i) * ranks + 1 for i in range(b)]


# ---- faults --------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 3])
def test_corrupt_jpeg_record_names_layer_source_and_record(tmp_path, workers):
    src = jpeg_db(tmp_path / "jpeg", n=12, corrupt=7)
    layer, shapes = data_layer(src, 3, workers)
    try:
        take(layer, shapes, 2)  # records 0..5
        with pytest.raises(UserError) as info:
            take(layer, shapes, 1)
        message = str(info.value)
        assert "'src'" in message and src in message and "record 7" in message and "'00000007'" in message
        assert "cannot decode" in message and "\n" not in message
    finally:
        layer.close()


def test_killed_worker_ends_the_run_with_a_clear_error_fast(tmp_path):
    src = jpeg_db(tmp_path / "jpeg")
    layer, shapes = data_layer(src, 2, 3)
    try:
        take(layer, shapes, 1)
        pool = layer.batch_maker
        assert isinstance(pool, WorkerPool)
        os.kill(pool.pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(UserError, match=r"decode worker 1 of 3 .* died \(killed by SIGKILL"):
            take(layer, shapes, pool.slots + 3)
        assert time.monotonic() - started < 5
    finally:
        layer.close()


def test_close_leaves_no_process_and_no_shared_memory(tmp_path):
    src = jpeg_db(tmp_path / "jpeg")
    layer, shapes = data_layer(src, 2, 3)
    take(layer, shapes, 2)
    pool = layer.batch_maker
    pids, name = pool.pids, pool.shared_memory_name
    assert len(pids) == 3 and os.path.exists(f"/dev/shm/{name}")
    layer.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # exited and reaped, not a zombie
            os.kill(pid, 0)


def test_slots_bound_the_memory():
    from superneurons.data.batches import BatchPlan, Seeds
    from superneurons.data.workers import SlotRing

    ring = SlotRing(BatchPlan(8, (3, 5, 5), Seeds((1,))), 6)
    try:
        assert ring.shm.size >= 6 * 8 * (3 * 5 * 5 + 1) * 4
        assert ring.shm.size < 6 * 8 * (3 * 5 * 5 + 1) * 4 + 4096
    finally:
        ring.close()
        ring.shm.unlink()


def test_data_workers_flag_overrides_the_prototxt(tmp_path):
    from superneurons.commands._options import add_device_options
    import argparse

    src = jpeg_db(tmp_path / "jpeg", n=4)
    parser = argparse.ArgumentParser()
    add_device_options(parser)
    args = parser.parse_args(["--data-workers", "0"])
    layer, _ = data_layer(src, 2, 5)
    layer.ctx.data_workers = args.data_workers  # what the nets the commands build carry
    assert layer.workers == 0
    layer.close()
    layer, _ = data_layer(src, 2, 5)
    assert layer.workers == 5
    layer.close()
    # A Net hands the count to its data layers through its run context.
    from google.protobuf import text_format

    from superneurons.backend.cpu import CpuBackend
    from superneurons.graph.build import build_graph
    from superneurons.runtime.net import Net

    text = (f'layer {{ name: "src" type: "Data" top: "data" top: "label" data_param {{ source: "{src}" '
            f'batch_size: 2 backend: LMDB decode_workers: 5 }} }}')
    for given, want in ((args.data_workers, 0), (None, 5)):
        net = Net(build_graph(text_format.Parse(text, pb.NetParameter()), pb.TEST), CpuBackend(), train=False,
                  data_workers=given)
        assert net.layer("src").workers == want
        net.layer("src").close()


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_workers_do_not_outlive_their_run(tmp_path, how):
    """Ctrl-C, or the run killed outright: no decode worker is left behind. The run is a script without
    an `if __name__ == "__main__":` guard, which the workers must not run again."""
    import subprocess
    import sys

    src = jpeg_db(tmp_path / "jpeg")
    script = (
        "import sys, time\n"
        "from tests.test_data_pipeline import data_layer, take\n"
        f"layer, shapes = data_layer({src!r}, 2, 3)\n"
        "take(layer, shapes, 1)\n"
        "print(*layer.batch_maker.pids, layer.batch_maker.shared_memory_name, flush=True)\n"
        "time.sleep(60)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    (tmp_path / "run.py").write_text(script)
    run = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           cwd=root, env=env, text=True)
    try:
        line = run.stdout.readline().split()
        assert len(line) == 4, run.stderr.read()
        *pids, name = line
        run.send_signal(how)
        run.wait(10)
        deadline = time.monotonic() + 5
        alive = [int(p) for p in pids]
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.05)
        assert not alive
        if how == signal.SIGINT:  # an orderly exit unlinks its memory; after SIGKILL the resource tracker does
            assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        run.kill()
        run.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited; its parent reaps it later
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


# ---- the device copy ---------------------------------------------------------------------------
def test_upload_async_on_the_cpu_is_a_copy(rng):
    from superneurons.backend.cpu import CpuBackend

    ops = CpuBackend().ops
    dst = np.zeros((4, 3), np.float32)
    host = rng.standard_normal((4, 3)).astype(np.float32)
    ops.upload_async(dst, host)
    host[:] = 0  # the caller may reuse its array at once
    assert dst.any() and not np.shares_memory(dst, host)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an NVIDIA GPU")
def test_upload_async_is_ordered_with_the_compute_on_the_gpu(gpu, rng):
    shape = (64, 3, 64, 64)
    d = gpu.view(gpu.arena(int(np.prod(shape)) * 4), 0, shape)
    host = np.empty(shape, np.float32)
    want = []
    got = []
    for step in range(5):  # more uploads than staging buffers, each followed by compute on the result
        x = rng.standard_normal(shape).astype(np.float32)
        host[:] = x
        gpu.ops.fill(d, 7.0)  # queued before the copy: the copy must land after it
        gpu.ops.upload_async(d, host)
        host[:] = np.nan  # the host array is free again once upload_async returns
        gpu.ops.scal(2.0, d)  # queued after: must see the copy
        got.append(gpu.to_host(d))
        want.append(2 * x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_too_little_shared_memory_falls_back_to_the_thread(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")(64 << 20, 64 << 20, 1000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    _makes_the_same_batches_in_a_thread(tmp_path, capsys, "/dev/shm has 0 MiB free, the decode workers")


def _makes_the_same_batches_in_a_thread(tmp_path, capsys, said: str) -> None:
    """A layer asking for 3 decode workers that cannot have them makes the batches one thread makes, in its
    own thread, and `said` is in its warning."""
    from superneurons.data.prefetch import Prefetcher

    src = jpeg_db(tmp_path / "jpeg", n=9)
    want = run(lambda: data_layer(src, 3, 1), 4)
    layer, shapes = data_layer(src, 3, 3)
    try:
        assert_same(take(layer, shapes, 4), want)
        assert isinstance(layer.batch_maker, Prefetcher)
    finally:
        layer.close()
    assert said in capsys.readouterr().err


def test_a_file_size_limit_below_the_slots_falls_back_to_the_thread(tmp_path):
    """`ulimit -f` caps shared memory too: the slots' segment cannot be made. The run warns in one line and
    decodes in its own thread: no OSError, no resource-tracker traceback, nothing left in /dev/shm."""
    import resource
    import subprocess
    import sys

    src = jpeg_db(tmp_path / "jpeg", n=9)
    script = ("from tests.test_data_pipeline import data_layer, take\n"
              f"layer, shapes = data_layer({src!r}, 3, 3)\n"
              "take(layer, shapes, 2)\n"
              "print(type(layer.batch_maker).__name__, flush=True)\n"
              "layer.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.path.join(root, "tests"),
                                                        os.environ.get("PYTHONPATH", "")])}
    from superneurons.data.workers import RING_PREFIX

    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))  # noqa: E731
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=root, env=env, preexec_fn=limit)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert out.strip() == "Prefetcher"
    assert "Traceback" not in err and "file-size limit (ulimit -f) is 16384 bytes" in err
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{RING_PREFIX}{run.pid}-")]


def test_workers_that_cannot_start_fall_back_to_the_thread(tmp_path, monkeypatch, capsys):
    """A Ctrl-C that reaches the fork server before it ignores the signal kills it: starting a worker then
    fails with EOFError. The layer makes its batches in its own thread instead (the run stops as the Ctrl-C
    asked, after the batch), with one warning, and nothing of the half-started pool stays."""
    def server_died(self, *args):
        raise EOFError("unexpected EOF")

    monkeypatch.setattr(WorkerPool, "_start_workers", server_died)
    _makes_the_same_batches_in_a_thread(tmp_path, capsys, "the decode worker processes could not be started")


def test_a_segment_the_system_refuses_falls_back_to_the_thread(monkeypatch):
    import errno
    from multiprocessing import shared_memory

    from superneurons.data import workers

    def refuse(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_memory, "SharedMemory", refuse)
    with pytest.raises(workers.SharedMemoryShort, match="No space left on device"):
        workers._create_segment(4096, "layer 'd'")


def test_ctrl_c_during_close_is_acted_on_after_the_clean_up(tmp_path, monkeypatch):
    """A second Ctrl-C while the workers are being stopped (at exit) must not cut the clean-up short: every
    worker is stopped and the shared memory unlinked, then the interrupt is raised."""
    src = jpeg_db(tmp_path / "jpeg")
    layer, shapes = data_layer(src, 2, 3)
    try:
        take(layer, shapes, 1)
        pool = layer.batch_maker
        pids, name = pool.pids, pool.shared_memory_name
        first = pool._procs[0]
        terminate = first.terminate

        def ctrl_c_then_terminate():
            os.kill(os.getpid(), signal.SIGINT)
            terminate()

        monkeypatch.setattr(first, "terminate", ctrl_c_then_terminate)
        with pytest.raises(KeyboardInterrupt):
            pool.close()
        assert not os.path.exists(f"/dev/shm/{name}")
        assert not [p for p in pids if _alive(p)]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        layer.close()


def test_a_decode_worker_ignores_ctrl_c_before_it_imports_anything_heavy():
    """The terminal's Ctrl-C reaches the workers too; one still importing when it came died, and the run
    reported a worker death instead of stopping as interrupted. The worker's entry module ignores SIGINT
    first thing while it is being unpickled in the new process, and imports nothing heavy before."""
    import subprocess
    import sys

    from superneurons.data import worker_start

    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # the parent imported it: no effect here
    code = ("import signal, sys\n"
            "from multiprocessing import process\n"
            "process.current_process()._inheriting = True\n"
            "import superneurons.data.worker_start\n"
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, 'numpy' in sys.modules)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=60,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.split() == ["True", "False"], out.stderr
    assert callable(worker_start.run)


def test_ctrl_c_while_the_workers_start_leaves_none_running(tmp_path, monkeypatch):
    """Ctrl-C (the second: stop at once) right after a worker was forked: the start completes, then the
    interrupt comes, and closing the half-made pool stops every worker (one forked but not yet tracked
    outlived it, and failed with a traceback opening the ring that close had unlinked)."""
    from multiprocessing.process import BaseProcess

    src = jpeg_db(tmp_path / "jpeg")
    started: list[int] = []
    real_start = BaseProcess.start

    def start_then_ctrl_c(self):
        real_start(self)
        started.append(self.pid)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(BaseProcess, "start", start_then_ctrl_c)
    layer, shapes = data_layer(src, 2, 3)
    try:
        with pytest.raises(KeyboardInterrupt):
            take(layer, shapes, 1)
    finally:
        layer.close()
    deadline = time.monotonic() + 5
    while [p for p in started if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(started) == 3 and not [p for p in started if _alive(p)]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_the_fork_server_and_the_workers_never_see_ctrl_c(tmp_path):
    """The fork server is started with SIGINT blocked: a Ctrl-C while it imports killed it with a traceback
    (and the workers it had not started yet). The mask reaches the workers it forks."""
    import multiprocessing.forkserver as forkserver

    def blocked(pid: int) -> bool:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line for line in f if line.startswith("SigBlk:")).split()[1]
        return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))

    src = jpeg_db(tmp_path / "jpeg")
    layer, shapes = data_layer(src, 2, 3)
    try:
        take(layer, shapes, 1)
        assert all(blocked(pid) for pid in layer.batch_maker.pids)
        assert blocked(forkserver._forkserver._forkserver_pid)
        assert not blocked(os.getpid())
    finally:
        layer.close()


def test_the_next_pool_removes_the_shared_memory_a_killed_run_left(tmp_path, capsys):
    import subprocess
    import sys

    from superneurons.data import workers

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = f"/dev/shm/{workers.RING_PREFIX}{int(dead.stdout)}-deadbeef"
    alive = f"/dev/shm/{workers.RING_PREFIX}{os.getpid()}-cafecafe"
    for path in (left, alive):
        with open(path, "wb") as f:
            f.write(b"\0" * 2048)
    src = jpeg_db(tmp_path / "jpeg")
    layer, shapes = data_layer(src, 2, 3)
    try:
        take(layer, shapes, 1)
        assert isinstance(layer.batch_maker, WorkerPool)
        assert not os.path.exists(left) and os.path.exists(alive)
        assert "removed 1 shared-memory segment(s) (2048 bytes) that killed runs left" in capsys.readouterr().err
    finally:
        layer.close()
        os.unlink(alive)


# ---- the benchmark -----------------------------------------------------------------------------
def test_input_benchmark_runs_small_on_the_cpu(tmp_path):
    import json

    from tools.bench import input as tool

    assert tool.main(["--images", "20", "--batch", "4", "--workers", "1,2", "--warmup", "1", "--iterations", "3",
                      "--no-torch", "--no-net", "--cpu", "--db", str(tmp_path / "db"), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "input.json").read_text())
    assert result["database"]["images"] == 20
    runs = {r["workers"]: r for r in result["data_layer"]}
    assert runs[1]["maker"] == "Prefetcher" and runs[2]["maker"] == "WorkerPool"
    assert runs[1]["pinned"] is None and runs[2]["pinned"] is True  # workers' slots go straight to the device
    assert all(r["img_per_s"] > 0 for r in runs.values())


def test_default_workers_share_the_cores_among_ranks(tmp_path):
    src = jpeg_db(tmp_path / "jpeg", n=4)
    text = (f'name: "src" type: "Data" top: "data" top: "label" '
            f'data_param {{ source: "{src}" batch_size: 2 backend: LMDB }}')
    layer, _ = make_layer(text, [], phase=pb.TRAIN)
    try:
        cores = len(os.sched_getaffinity(0))
        assert layer.workers == cores
        layer.ctx.ranks = 2
        assert layer.workers == max(1, cores // 2)
    finally:
        layer.close()


class RaisingReader:
    """A reader with a bug at position 5 (not bad input): the worker must hand its traceback over."""

    def read(self, position):
        if position == 5:
            raise ValueError("a bug on purpose")
        return position, np.full((3, 4, 4), position, np.uint8), position

    def close(self):
        pass


class RaisingSource:
    count, where = 100, "raising source"

    def open(self, seeds):
        return RaisingReader()

    def close(self):
        pass


def test_a_bug_in_a_worker_reaches_the_consumer_with_its_traceback():
    from superneurons.data.batches import BatchPlan, Seeds
    from superneurons.data.transformer import DataTransformer

    transformer = DataTransformer(pb.TransformationParameter(), False, "t")
    pool = WorkerPool(RaisingSource(), transformer, BatchPlan(2, (3, 4, 4), Seeds((1,))), 0, 2, 2, "layer 't'")
    try:
        first = pool.next()  # positions 0, 1
        np.testing.assert_array_equal(first.label, [0, 1])
        pool.next()  # 2, 3
        with pytest.raises(RuntimeError, match=r"(?s)decode worker 0 failed on batch 2.*ValueError: a bug on purpose"):
            pool.next()  # 4, 5
        with pytest.raises(RuntimeError):  # and it stays failed
            pool.next()
    finally:
        pool.close()


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT16], ids=["bf16", "fp16"])
def test_a_half_data_top_gets_batches_made_in_its_type(tmp_path, dtype):
    """A half net's data top: the workers (and the single-thread maker) round each transformed item into the
    top's type where they make it, so the batch crosses to the device as it is stored (the slots hold half
    values); the values are the float32 batch's rounded to nearest even."""
    src = jpeg_db(tmp_path / "jpeg")

    def take_half(workers):
        layer, shapes = data_layer(src, 5, workers)
        try:
            out = []
            for _ in range(4):
                tops = [np.zeros(shapes[0], dtype), np.zeros(shapes[1], np.float32)]
                layer.forward([], tops)
                out.append(tops)
                assert layer.batch_maker is not None
            if workers > 1:
                assert layer.batch_maker._ring.slot(0)[0].dtype == dtype  # the slots themselves are half
            return out
        finally:
            layer.close()

    full = run(lambda: data_layer(src, 5, 1), 4)
    for workers in (1, 3):
        half = take_half(workers)
        for (d, label), (want, want_label) in zip(half, full):
            np.testing.assert_array_equal(d.view(np.uint16), want.astype(dtype).view(np.uint16))
            np.testing.assert_array_equal(label, want_label)
