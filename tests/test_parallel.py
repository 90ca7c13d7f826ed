"""Data parallelism on the CPU through MPI (what CI checks): N ranks x batch B train to the weights of 1 rank x
batch N*B; BatchNorm's per-rank statistics; rank 0 alone logs and snapshots; a failing rank ends the job with
its message; `--gpu` lists are checked against the machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from logs import GLOG, messages
from test_solver import TINY_NET, Quiet

import parallel_job as job
from superneurons.cli import main
from superneurons.commands.train import WORKER
from superneurons.errors import UserError
from superneurons.parallel import launch
from superneurons.parallel.devices import parse_gpus
from superneurons.parallel.reducer import GradientReducer, make_buckets
from superneurons.solver import Solver

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
JOB = os.path.join(HERE, "parallel_job.py")
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
ENV.pop("PMI_SIZE", None)


def mpiexec(n: int, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [launch.find_mpiexec(), "-n", str(n), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV | (env or {}), cwd=os.getcwd())


def run_job(tmp_path, ranks: int, net: str, iters: int, batch: int, layer_wise: bool = True, iter_size: int = 1,
            memory: tuple[str, int] | None = None, **env: str):
    out = str(tmp_path / f"{net}-{ranks}")
    extra = [memory[0], str(memory[1])] if memory else []
    r = mpiexec(ranks, JOB, "train", out, net, str(iters), "1" if layer_wise else "0", str(iter_size), str(batch),
                *extra, env=env)
    assert r.returncode == 0, r.stderr
    return [dict(np.load(f"{out}.{k}.npz")) for k in range(ranks)]


def single(net: str, iters: int, batch: int, iter_size: int = 1) -> dict[str, np.ndarray]:
    """The same training in this process, one rank, batch `batch`, reading every record in order."""
    solver = Solver(job.solver_param(net, iters, batch, iter_size), "job.prototxt", memory="baseline", log=Quiet())
    x, y = job.data(iters * iter_size * batch)
    solver.net.layer("data").reset(x, y)
    solver.solve()
    return job.weights(solver)


def _weights_only(saved: dict) -> dict:
    return {k: v for k, v in saved.items() if k not in ("started", "streamed", "buckets", "flat", "calls", "reduce_type",
                                                         "loss_scale")}


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-12)) for k in b)


@pytest.mark.parametrize("layer_wise", [True, False])
def test_two_ranks_train_to_the_one_rank_weights(tmp_path, layer_wise):
    ranks = run_job(tmp_path, 2, "plain", iters=6, batch=4, layer_wise=layer_wise)
    ref = single("plain", iters=6, batch=8)
    rank0 = _weights_only(ranks[0])
    assert set(rank0) == set(ref)
    assert max_rel(rank0, ref) < 1e-5
    for k in rank0:  # every rank applied the same update to the same weights
        np.testing.assert_array_equal(ranks[1][k], rank0[k])
    # Layer-wise: reductions began inside backward (one bucket per iteration here); otherwise after it.
    assert int(ranks[0]["started"]) == (6 if layer_wise else 0)
    # The run changed the weights (the comparison is not between two untouched fillings).
    untouched = job.weights(Solver(job.solver_param("plain", 0, 8), "job.prototxt", memory="baseline", log=Quiet()))
    assert max_rel(untouched, ref) > 1e-2


def test_streamed_parameters_are_reduced_after_backward(tmp_path):
    """Under a budget that keeps the parameters on the host between uses, each gradient comes to the device,
    is averaged, and goes home: the same weights as one rank on the whole batch."""
    # (13 KiB: the streamed plan's 12 KiB and the grouped update's tables, which the Net plans either way)
    ranks = run_job(tmp_path, 2, "plain", iters=4, batch=4, memory=("recompute", 13312))
    assert bool(ranks[0]["streamed"]) and int(ranks[0]["started"]) == 0
    assert max_rel(_weights_only(ranks[0]), single("plain", iters=4, batch=8)) < 1e-5


def test_iter_size_accumulates_before_the_reduction(tmp_path):
    ranks = run_job(tmp_path, 2, "plain", iters=3, batch=2, iter_size=2)
    # 2 ranks x iter_size 2 x batch 2: each update averages 4 batches of 2 records. One rank with iter_size 2
    # and batch 4 averages the same 8 records per update, in the same order of records per pass pair.
    ref = single("plain", iters=3, batch=4, iter_size=2)
    rank0 = _weights_only(ranks[0])
    # Pass j of iteration t on rank r reads records ((t*2 + j)*2 + i)*2 + r; one rank's pass j reads
    # (t*2 + j)*4 + i: the same 4 records per pass, so the same gradients up to summation order.
    assert max_rel(rank0, ref) < 1e-5


def test_batchnorm_uses_per_rank_statistics(tmp_path):
    """Each rank normalizes with its own batch's mean and variance (as Caffe): the update is the mean of the
    gradients two single-rank nets compute on the two halves, which differs from one rank on the whole batch."""
    iters, batch = 4, 4
    ranks = run_job(tmp_path, 2, "bn", iters=iters, batch=batch)
    rank0 = _weights_only(ranks[0])

    # Reference: two nets of batch 4 in this process, gradients averaged by hand before rank 0's update.
    solvers = [Solver(job.solver_param("bn", iters, batch), "job.prototxt", memory="baseline", log=Quiet())
               for _ in range(2)]
    x, y = job.data(iters * batch * 2)
    for r, s in enumerate(solvers):
        s.net.layer("data").reset(np.ascontiguousarray(x[r::2]), np.ascontiguousarray(y[r::2]))
    lead, other = solvers
    for it in range(iters):
        for s in solvers:
            s.net.clear_param_diffs()
            s.net.ctx.iteration = it
            s.net.forward_backward()
        for a, b in zip(lead.net.learnable, other.net.learnable):
            a.diff[...] = (a.diff + b.diff) * 0.5
        lead.apply_update()
        lead.iter += 1
        for a, b in zip(lead.net.learnable, other.net.learnable):
            b.data[...] = a.data
    expected = job.weights(lead)
    assert max_rel(rank0, expected) < 1e-5
    # Rank 1's running statistics are its own (not reduced), its learned weights rank 0's.
    np.testing.assert_array_equal(ranks[1]["conv.0"], rank0["conv.0"])
    assert not np.array_equal(ranks[1]["bn.0"], rank0["bn.0"])
    # And one rank on the whole batch (statistics over 8 records) trains to other weights.
    whole = single("bn", iters=iters, batch=2 * batch)
    assert max_rel(rank0, whole) > 1e-4


# ---- buckets --------------------------------------------------------------------------------------------------

SHARED = """
name: "shared"
layer { name: "data" type: "DummyData" top: "a" top: "label"
  dummy_data_param { data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 }
    shape { dim: 4 dim: 6 } shape { dim: 4 } } }
layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "h"
  param { name: "w" } param { name: "b" } inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "h" top: "h2"
  param { name: "w" } param { name: "b" } inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "ip_c" type: "InnerProduct" bottom: "h2" top: "out"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }
"""


def _solver(net_text: str) -> Solver:
    from test_solver import solver_param

    return Solver(solver_param("base_lr: 0.1", net=net_text), "s.prototxt", memory="baseline", log=Quiet())


class Recorder:
    """A collective that records which gradients each start reduced, and a hook that records where backward
    reported each gradient final; arrays are left unchanged (one rank)."""

    size = 1

    def __init__(self, net):
        self.net = net
        self.at_step: dict[int, str] = {}  # id(decl) -> the backward step that reported it
        self.starts: list[tuple[str, list]] = []  # (the step running when it started, arrays)
        self.step = ""

    def gradients_ready(self, step, params):
        self.step = step.node.name
        for d in params:
            self.at_step[id(d)] = step.node.name

    def start(self, arrays):
        self.starts.append((self.step, list(arrays)))
        return len(self.starts)

    def wait(self, handle):
        pass


def _reduce_once(net, bucket_bytes: int) -> tuple[GradientReducer, Recorder]:
    """One training pass of `net` with a reducer whose collective records what it was asked."""
    from superneurons.memory.interface import StepHooks

    rec = Recorder(net)
    hooks = type("Watch", (StepHooks,), {"gradients_ready": lambda self, step, params: rec.gradients_ready(step, params)})()
    net.add_hooks(hooks)  # before the reducer's: the recorder knows the step when a bucket starts
    reducer = GradientReducer(net, rec, bucket_bytes=bucket_bytes)
    reducer.attach()
    net.clear_param_diffs()
    net.forward_backward()
    reducer.finish()
    return reducer, rec


@pytest.mark.parametrize("bucket_bytes", [0, 1, 100, 1 << 30])
def test_a_bucket_is_one_array_over_its_gradients_and_starts_when_its_last_is_final(bucket_bytes):
    net = _solver(SHARED).net
    reducer, rec = _reduce_once(net, bucket_bytes)
    assert reducer.flat
    # Every learnable parameter in exactly one bucket; one reduction per bucket, each ONE array.
    assert sorted(id(d) for b in reducer.buckets for d in b.decls) == sorted(id(d) for d in net.learnable)
    assert len(rec.starts) == len(reducer.buckets) == reducer.calls_per_iteration
    assert all(len(arrays) == 1 for _step, arrays in rec.starts)
    order = [s.node.name for s in net.backward_steps]
    started = {id(arrays[0]): step for step, arrays in rec.starts}
    for bucket in reducer.buckets:
        flat, step = bucket.flat, started[id(bucket.flat)]
        # The flat array is the gradients' own memory: each gradient lies inside it.
        assert all(np.shares_memory(flat, d.diff) for d in bucket.decls)
        assert flat.nbytes >= bucket.nbytes
        # It started at the step that finished its last gradient, not before.
        assert step == max((rec.at_step[id(d)] for d in bucket.decls), key=order.index)
    # ip_a owns the shared w/b; ip_b (earlier in backward) also writes them: final at ip_a's step.
    shared = [d for n in net.layers_in_prototxt_order() if n.name == "ip_a" for d in n.layer.params]
    assert {rec.at_step[id(d)] for d in shared} == {"ip_a"}
    if bucket_bytes <= 1:
        assert len(reducer.buckets) == len(net.learnable)
    if bucket_bytes == 1 << 30:
        assert len(reducer.buckets) == 1 and rec.starts[0][0] == order[-1]


def test_a_bucket_boundary_falls_after_the_gradient_that_fills_it():
    net = _solver(SHARED).net
    sizes = [b.nbytes for b in make_buckets(net, 1)]  # pool order, one gradient each
    exact = make_buckets(net, sizes[0] + sizes[1])  # the first two fill the first bucket exactly
    assert [b.nbytes for b in exact][0] == sizes[0] + sizes[1]
    over = make_buckets(net, sizes[0] + 1)  # the second gradient brings the first bucket past the size
    assert over[0].nbytes == sizes[0] + sizes[1]


def test_fused_scale_gradients_are_final_after_the_batchnorm_step():
    solver = Solver(job.solver_param("bn", 1, 2), "job.prototxt", memory="baseline", log=Quiet())
    net = solver.net
    scale = net.layer("scale")
    if net.graph.fusions.forward_owner("scale") is None:
        pytest.skip("fusion is off (SUPERNEURONS_FUSE=0)")
    net.layer("data").reset(*job.data(2))
    _reducer, rec = _reduce_once(net, 0)
    assert {rec.at_step[id(d)] for d in scale.params} == {"bn"}


@pytest.mark.parametrize("bucket_bytes, env", [("0", {}), ("600", {}), ("1073741824", {}),
                                               ("600", {"SUPERNEURONS_ALLOCATOR": "malloc"})])
def test_bucket_sizes_and_allocators_train_to_the_one_rank_weights(tmp_path, bucket_bytes, env):
    """Every bucket size reduces every gradient once: one bucket per gradient, buckets of a few gradients
    (600 bytes: the first closes inside ip1's, the second holds the conv's), one bucket for all; under the
    malloc allocator the gradients are not side by side and each bucket is reduced tensor by tensor."""
    ranks = run_job(tmp_path, 2, "plain", iters=3, batch=4, JOB_BUCKET_BYTES=bucket_bytes, **env)
    assert max_rel(_weights_only(ranks[0]), single("plain", iters=3, batch=8)) < 1e-5
    flat = not env
    assert bool(ranks[0]["flat"]) == flat
    assert int(ranks[0]["calls"]) == (int(ranks[0]["buckets"]) if flat else 6)  # the net has 6 learnable tensors
    if bucket_bytes == "0":
        assert int(ranks[0]["buckets"]) == 6


@pytest.mark.parametrize("which", ["shared", "bn"])
def test_memory_plan_buckets_are_the_ones_the_net_reduces(which, capsys):
    from superneurons.parallel.reducer import bucket_plan

    solver = _solver(SHARED) if which == "shared" else Solver(job.solver_param("bn", 1, 2), "job.prototxt",
                                                              memory="baseline", log=Quiet())
    for size in (1, 200, 1 << 30):
        planned = bucket_plan(solver.net.graph, 4, bucket_bytes=size)
        made = make_buckets(solver.net, bucket_bytes=size)
        assert planned["bucket_bytes"] == [b.nbytes for b in made]
        assert planned["gradient_bytes"] == sum(d.diff_tensor.nbytes for d in solver.net.learnable)
        assert planned["extra_pool_bytes"] == 0


def test_memory_command_shows_the_reduction_per_gpu(tmp_path, capsys):
    model = os.path.join(ROOT, "models/resnet50/resnet50_dummy.prototxt")
    assert main(["memory", "--model", model, "--batch", "2", "--ranks", "8", "--memory", "liveness", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    r = doc["reduction"]
    assert r["ranks"] == 8 and r["buckets"] == len(r["bucket_bytes"]) >= 2
    assert r["gradient_bytes"] == sum(r["bucket_bytes"])
    assert 25_000_000 * 4 < r["gradient_bytes"] < 26_000_000 * 4  # ResNet-50's 25.5M learnable parameters
    assert main(["memory", "--model", model, "--batch", "2", "--ranks", "0"]) == 1
    assert "--ranks must be at least 1" in capsys.readouterr().err


# ---- the command line ----------------------------------------------------------------------------------------

@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "conf/nets").mkdir(parents=True)
    (tmp_path / "conf/nets/tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "conf/solver.prototxt").write_text(
        'net: "nets/tiny.prototxt"\ntest_iter: 1\ntest_interval: 3\nbase_lr: 0.05\nmomentum: 0.9\n'
        'lr_policy: "fixed"\ndisplay: 1\nmax_iter: 6\nsnapshot: 3\nsnapshot_prefix: "out/tiny"\nrandom_seed: 1\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cli(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return mpiexec(n, "-m", "superneurons", "train", "--no-progress", *args, timeout=timeout)


def test_mpiexec_train_on_the_cpu_logs_once_and_resumes_only_with_as_many_ranks(workdir):
    r = _cli(2, "--solver", "conf/solver.prototxt")
    assert r.returncode == 0, r.stderr
    lines = messages(r.stderr)  # glog lines on stderr
    assert lines.count("Optimization Done.") == 1  # rank 0 alone logs
    assert lines.count("Iteration 3, Testing net (#0)") == 1
    assert any(m.startswith("Data parallel: 2 rank(s)") and m.endswith("one reduction each") for m in lines)
    # After display lines: how long compute waited on the reduction, and one reduction per bucket.
    waits = [m for m in lines if "waiting on gradient reduction" in m]
    assert waits and len(waits) <= 6 and all(m.endswith("(1 buckets, 1 reductions/iter)") for m in waits), waits
    extra = json.loads((workdir / "out/tiny_iter_3.solverstate.extra").read_text())
    assert extra["ranks"] == 2
    # Another number of ranks: one line, exit 1 (here on 1 rank, the plain command).
    alone = subprocess.run([sys.executable, "-m", "superneurons", "train", "--solver", "conf/solver.prototxt",
                            "--snapshot", "out/tiny_iter_3.solverstate"], capture_output=True, text=True, env=ENV)
    assert alone.returncode == 1
    err = [line for line in alone.stderr.strip().splitlines() if not GLOG.fullmatch(line)]  # past the log lines
    assert len(err) == 1 and "taken with 2 rank(s)" in err[0] and "this run has 1" in err[0], alone.stderr
    three = _cli(3, "--solver", "conf/solver.prototxt", "--snapshot", "out/tiny_iter_3.solverstate")
    assert three.returncode != 0 and "taken with 2 rank(s)" in three.stderr and "this run has 3" in three.stderr


def test_resumed_two_rank_run_repeats_the_uninterrupted_one(workdir):
    assert _cli(2, "--solver", "conf/solver.prototxt").returncode == 0
    whole = (workdir / "out/tiny_iter_6.caffemodel").read_bytes()
    (workdir / "out/tiny_iter_6.caffemodel").unlink()
    r = _cli(2, "--solver", "conf/solver.prototxt", "--snapshot", "out/tiny_iter_3.solverstate")
    assert r.returncode == 0, r.stderr
    assert (workdir / "out/tiny_iter_6.caffemodel").read_bytes() == whole


def test_a_failing_rank_stops_every_rank_with_its_message(workdir):
    (workdir / "conf/solver.prototxt").write_text(
        'net: "nets/tiny.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\ndisplay: 0\nmax_iter: 1000000\n'
        'snapshot: 0\nsnapshot_after_train: false\nrandom_seed: 1\n')
    start = time.monotonic()
    r = mpiexec(2, JOB, "fail", "conf/solver.prototxt", "1", "5", timeout=60)
    elapsed = time.monotonic() - start
    assert r.returncode != 0, r.stdout[-500:] + r.stderr
    # Rank 0 would train for a million iterations (minutes); the bound leaves room for a loaded CI machine.
    assert elapsed < 45, elapsed
    mine = [l for l in r.stderr.splitlines() if "injected failure" in l]
    assert mine == ["superneurons train: error: rank 1: injected failure at iteration 5"], r.stderr
    assert "Optimization Done." not in messages(r.stderr)
    assert not _left_running(f"{JOB} fail conf/solver.prototxt"), "a rank outlived the job"


def _left_running(pattern: str, wait_s: float = 5.0) -> list[str]:
    """Processes whose command line contains `pattern`, still there after `wait_s` (teardown takes a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_local_launcher_relays_the_failing_rank_message(workdir, monkeypatch, capfd):
    """launch.spawn (what `--gpu 0,1` runs) with CPU workers: the first failing rank's line becomes the error,
    MPI's abort chatter is left out, nothing is left running."""
    (workdir / "conf/solver.prototxt").write_text(
        'net: "nets/tiny.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\ndisplay: 0\nmax_iter: 1000000\n'
        'snapshot: 0\nsnapshot_after_train: false\nrandom_seed: 1\n')
    monkeypatch.setattr(launch, "worker_command", lambda n, args_file, entry: [
        launch.find_mpiexec(), "-n", str(n), sys.executable, JOB, "fail", "conf/solver.prototxt", "0", "3"])
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    args = SimpleNamespace(solver="conf/solver.prototxt", gpu=None)
    with pytest.raises(UserError, match=r"^rank 0: injected failure at iteration 3$"):
        launch.spawn(args, [0, 1], entry=WORKER)
    assert not _left_running(f"{JOB} fail conf/solver.prototxt 0 3"), "a rank outlived the job"
    assert "MPI_Abort" not in capfd.readouterr().err  # the rank's line is the message, not MPI's


def rank_pid(temp_root, rank: int, timeout_s: float = 60.0) -> int:
    """The pid of `rank` of the job the local launcher started with its folder under `temp_root`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for path in sorted(temp_root.glob(f"superneurons-dp-*/rank-{rank}.pid")):
            text = path.read_text().strip()
            if text:
                return int(text)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} wrote no pid file under {temp_root} in {timeout_s:.0f} s")


def test_a_rank_killed_by_a_signal_is_named_and_ends_the_job(workdir, monkeypatch, capfd):
    """kill -9 of one rank (what the kernel's OOM killer does): the launcher names the rank and the signal in its
    one line, the other rank is stopped, nothing is left running."""
    import signal
    import tempfile
    import threading

    from superneurons.cli import build_parser

    (workdir / "conf/solver.prototxt").write_text(
        'net: "nets/tiny.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\ndisplay: 0\nmax_iter: 1000000\n'
        'snapshot: 0\nsnapshot_after_train: false\nrandom_seed: 1\n')
    (workdir / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(workdir / "tmp"))  # where the launcher makes its folder
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    victim: dict[str, float] = {}

    def kill_rank_1():
        pid = rank_pid(workdir / "tmp", 1)
        time.sleep(2.0)  # into training: rank 0 waits in the reduction for rank 1's gradients
        os.kill(pid, signal.SIGKILL)
        victim.update(pid=pid, at=time.monotonic())

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    args = build_parser().parse_args(["train", "--solver", "conf/solver.prototxt", "--no-progress"])
    with pytest.raises(UserError) as e:
        launch.spawn(args, [0, 1], entry=WORKER)
    ended = time.monotonic()
    killer.join(5)
    assert "pid" in victim, "the killer never found rank 1"
    assert ended - victim["at"] < 30, ended - victim["at"]  # MPI noticed the death and stopped rank 0
    assert str(e.value).startswith(f"rank 1 (pid {int(victim['pid'])} on "), str(e.value)
    assert "killed by signal 9 (SIGKILL)" in str(e.value) and "every rank has been stopped" in str(e.value)
    err = capfd.readouterr().err
    assert "BAD TERMINATION" not in err and "YOUR APPLICATION TERMINATED" not in err  # MPI's report is ours now
    assert not _left_running(WORKER), "a rank outlived the job"


@pytest.mark.parametrize("end", ["finalize", "abort", "kill"])
def test_a_job_leaves_no_mpich_shared_memory_however_it_ends(tmp_path, end):
    """MPICH's ranks of one machine share a named segment in /dev/shm that only MPI_Finalize unlinked: every job
    that aborted or lost a rank left 2-3 MB there. The job's ranks say which segment they mapped; after the job
    its name is gone, and while the job ran it was already unlinked (the kernel calls the mapping deleted)."""
    out = str(tmp_path / "maps")
    r = mpiexec(2, JOB, "segments", out, end, timeout=60)
    assert (r.returncode == 0) == (end == "finalize"), r.stdout[-500:] + r.stderr
    mapped = [set((tmp_path / f"maps.{k}.txt").read_text().splitlines()) for k in range(2)]
    assert mapped[0] == mapped[1] and len(mapped[0]) == 1, mapped  # one segment, shared by both ranks
    (path,) = mapped[0]
    assert path.startswith("/dev/shm/mpich_shm_"), path
    name = path.removesuffix(" (deleted)")
    assert not os.path.exists(name), f"{name} left behind"
    assert path.endswith(" (deleted)"), path


def test_unlinking_takes_only_mpich_segments_this_process_maps(tmp_path):
    from superneurons.parallel.world import mapped_mpich_segments

    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000205000 rw-s 00000000 00:1a 123 /dev/shm/mpich_shm_1ea4177_0\n"
        "7f0000300000-7f0000305000 rw-s 00000000 00:1a 124 /dev/shm/mpich_vci_1ea4177_0\n"
        "7f0000400000-7f0000405000 rw-s 00000000 00:1a 125 /dev/shm/mpich_shm_2b_0 (deleted)\n"
        "7f0000500000-7f0000505000 rw-s 00000000 00:1a 126 /dev/shm/superneurons-41-abcdefgh\n"
        "7f0000600000-7f0000605000 r-xp 00000000 08:01 127 /usr/lib/libmpi.so.12\n"
        "7f0000700000-7f0000705000 rw-p 00000000 00:00 0\n")
    assert mapped_mpich_segments(str(maps)) == {"/dev/shm/mpich_shm_1ea4177_0"}
    assert mapped_mpich_segments(str(tmp_path / "absent")) == set()


def test_local_launcher_runs_the_workers_and_waits(workdir, capfd, monkeypatch):
    from superneurons.cli import build_parser

    args = build_parser().parse_args(["train", "--solver", "conf/solver.prototxt", "--no-progress"])
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    assert launch.spawn(args, [0, 1], entry=WORKER) == 0  # the workers have no --gpu: two CPU ranks
    out = messages(capfd.readouterr().err)  # the workers' glog lines, passed on by the launcher
    assert out.count("Optimization Done.") == 1 and any(l.startswith("Data parallel: 2 rank(s)") for l in out)
    assert json.loads((workdir / "out/tiny_iter_6.solverstate.extra").read_text())["ranks"] == 2


# ---- --gpu ----------------------------------------------------------------------------------------------------

def test_gpu_lists_are_checked_against_the_machine():
    assert parse_gpus("0,1,2,3", available=4) == [0, 1, 2, 3]
    assert parse_gpus(" 2, 0 ", available=4) == [2, 0]
    assert parse_gpus("all", available=3) == [0, 1, 2]
    with pytest.raises(UserError, match=r"there is no GPU 4; this machine has 4 GPU\(s\), numbered 0\.\.3"):
        parse_gpus("0,4", available=4)
    with pytest.raises(UserError, match="GPU 1 is listed twice"):
        parse_gpus("0,1,1", available=4)
    for spec in ("all", "0"):
        with pytest.raises(UserError, match=f"--gpu {spec}: this machine has no usable NVIDIA GPU; drop --gpu"):
            parse_gpus(spec, available=0)
    with pytest.raises(UserError, match="'x' is not a device number"):
        parse_gpus("0,x", available=2)


@pytest.mark.parametrize("flag, words", [("all", "--gpu all: this machine has no usable NVIDIA GPU"),
                                         ("5", "--gpu 5: this machine has no usable NVIDIA GPU"),
                                         ("0,0", "--gpu 0,0: this machine has no usable NVIDIA GPU")])
def test_train_refuses_bad_gpu_lists_in_one_line(workdir, capsys, flag, words):
    from superneurons.parallel.devices import gpu_count

    if gpu_count() > 0:
        pytest.skip("this machine has a GPU")
    assert main(["train", "--solver", "conf/solver.prototxt", "--gpu", flag]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_plan_spawns_for_several_gpus_and_joins_an_mpi_job(monkeypatch):
    monkeypatch.setattr("superneurons.parallel.devices.gpu_count", lambda: 4)
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert launch.plan("0,1,2,3") == launch.Job(spawn=True, gpus=[0, 1, 2, 3])
    assert launch.plan("all") == launch.Job(spawn=True, gpus=[0, 1, 2, 3])
    assert launch.plan("2") == launch.Job(gpus=[2])
    assert launch.plan(None) == launch.Job()
    monkeypatch.setenv("PMI_SIZE", "2")
    assert launch.plan("all") == launch.Job(rank=True, gpus=[0, 1, 2, 3])
    assert launch.plan(None) == launch.Job(rank=True)


# ---- the LMDB Data layer through the command line --------------------------------------------------------------

LMDB_NET = job._CONV.replace(
    """layer { name: "data" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: %(batch)d channels: 3 height: 6 width: 6 } }""",
    """layer { name: "data" type: "Data" top: "data" top: "label" transform_param { scale: 0.00390625 }
  data_param { source: "%(source)s" batch_size: %(batch)d backend: LMDB } }""")


def test_two_ranks_on_an_lmdb_train_to_the_one_rank_weights(tmp_path, monkeypatch):
    """`mpiexec -n 2 superneurons train` with batch 4 per rank and `superneurons train` with batch 8 read the same
    records per iteration (Caffe's sharding: record n on rank n mod 2) and end on the same weights."""
    from test_data import write_db

    from superneurons.io.caffemodel import blob_to_array
    from superneurons.io.prototxt import read_binary
    from superneurons.proto import superneurons_pb2 as pb

    rng = np.random.default_rng(11)
    n = 48
    source = write_db(tmp_path / "train_lmdb", rng.integers(0, 256, (n, 3, 6, 6), dtype=np.uint8),
                      rng.integers(0, job.CLASSES, n))
    monkeypatch.chdir(tmp_path)
    for ranks, batch in ((1, 8), (2, 4)):
        net = LMDB_NET % {"source": source, "batch": batch, "middle": job.NETS["plain"], "classes": job.CLASSES}
        (tmp_path / f"net{ranks}.prototxt").write_text(net)
        (tmp_path / f"solver{ranks}.prototxt").write_text(
            f'net: "net{ranks}.prototxt"\nbase_lr: 0.1\nmomentum: 0.9\nweight_decay: 0.01\nlr_policy: "fixed"\n'
            f'display: 0\nmax_iter: 8\nsnapshot: 0\nsnapshot_prefix: "out{ranks}/m"\nrandom_seed: 5\n'
            'solver_mode: CPU\n')
        r = _cli(ranks, "--solver", f"solver{ranks}.prototxt", "--memory", "baseline")
        assert r.returncode == 0, r.stderr

    def blobs(path):
        model = read_binary(str(path), pb.NetParameter())
        return {f"{l.name}.{k}": blob_to_array(b, l.name) for l in model.layer for k, b in enumerate(l.blobs)}

    one, two = blobs(tmp_path / "out1/m_iter_8.caffemodel"), blobs(tmp_path / "out2/m_iter_8.caffemodel")
    assert set(one) == set(two) and one
    assert max_rel(two, one) < 1e-5


def test_one_rank_through_the_data_parallel_path_is_the_plain_run_bit_for_bit(tmp_path, monkeypatch):
    """`mpiexec -n 1 superneurons train` (communicator, buckets, broadcast) against `superneurons train`: the
    CPU twin of the one-GPU NCCL check in test_parallel_gpu.py, same net and solver."""
    import test_parallel_gpu as gpu_test

    monkeypatch.chdir(tmp_path)
    plain, dp = gpu_test._solver(tmp_path, "plain", True), gpu_test._solver(tmp_path, "dp", True)
    r = subprocess.run([sys.executable, "-m", "superneurons", "train", "--solver", plain, "--no-progress"],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 0, r.stderr
    r = _cli(1, "--solver", dp)
    assert r.returncode == 0, r.stderr
    model = f"m_iter_{gpu_test.ITERATIONS}.caffemodel"
    assert (tmp_path / "plain" / model).read_bytes() == (tmp_path / "dp" / model).read_bytes()


# ---- tools/bench/scaling.py -----------------------------------------------------------------------------------

def _scaling():
    from tools.bench import scaling

    return scaling


def test_scaling_benchmark_arguments_and_efficiency(capsys):
    scaling = _scaling()
    assert scaling.__doc__ and "python3 -m tools.bench.scaling" in scaling.__doc__
    with pytest.raises(SystemExit) as e:
        scaling.main(["--help"])
    assert e.value.code == 0
    assert scaling.parse_counts("8,1,2,2") == [1, 2, 8]
    for bad in ("0,1", "two", ""):
        with pytest.raises(SystemExit):
            scaling.parse_counts(bad)
    with pytest.raises(SystemExit, match="unknown net"):
        scaling.main(["--nets", "resnet51", "--dry-run"])
    rows = [{"net": "resnet50", "gpus": n, "batch_per_gpu": 64, "budget": None,
             "ours": {"img_per_s": speed}, "torch": {"img_per_s": ddp}}
            for n, speed, ddp in ((1, 1000.0, 1100.0), (2, 1900.0, 2000.0), (4, 3840.0, 3300.0))]
    scaling.add_efficiency(rows)
    assert [r["ours"]["efficiency"] for r in rows] == [1.0, 0.95, 0.96]
    assert rows[2]["ours_vs_ddp"] == 3840 / 3300
    met = {t["name"]: t["met"] for t in scaling.targets(rows)}
    # 0.96 >= 0.95 and >= DDP's 0.75; 1.16x DDP's img/s
    assert met == {"resnet50_efficiency_4gpu": True, "resnet50_efficiency_vs_ddp_4gpu": True,
                   "resnet50_vs_ddp_4gpu": True}
    windows = [{"ours": {"ok": True, "windows": [w], "wait_ms": m}} for w, m in ((10.0, 1.0), (30.0, 3.0), (20.0, 2.0))]
    merged = scaling.merge_windows(windows, "ours")
    assert merged["img_per_s"] == 20.0 and merged["wait_ms"] == 2.0 and merged["windows"] == [10.0, 30.0, 20.0]
    assert scaling.merge_windows([{"ok": False, "error": "x"}], "torch")["ok"] is False
    capsys.readouterr()
    assert scaling.main(["--dry-run", "--gpus", "1,4", "--budget", "12G"]) == 0
    jobs = capsys.readouterr().out.splitlines()
    assert len(jobs) == 2 * 2 * 2  # 2 nets x 2 counts x (plain + budget rows), both sides in each job
    assert any(" -n 4 " in j and "rank ours,torch --net resnet50 --batch 256" in j and "--budget" in j for j in jobs)
    assert scaling.main(["--dry-run", "--gpus", "2", "--nets", "vgg16", "--budget", "0", "--apart"]) == 0
    apart = capsys.readouterr().out.splitlines()
    assert [j.split(" rank ")[1].split()[0] for j in apart] == ["ours", "torch"] * 3  # alternating, 3 each
    with pytest.raises(SystemExit):
        scaling.main(["--dry-run", "--bucket-mb", "8,x"])
    assert scaling.parse_ctas("0,8,4,8") == [0, 8, 4]
    for bad in ("33", "-1", "8,x"):
        with pytest.raises(SystemExit, match="--nccl-ctas"):
            scaling.parse_ctas(bad)
    assert scaling.parse_priorities("high,normal,high") == [True, False]
    with pytest.raises(SystemExit, match="--nccl-priority"):
        scaling.parse_priorities("urgent")
    assert scaling.nccl_label(8, True) == "ctas 8, high priority" and scaling.nccl_label(0, None).startswith("ctas default")
    assert scaling.main(["--dry-run", "--gpus", "4", "--nets", "vgg16", "--budget", "0", "--nccl-ctas", "0,4",
                         "--nccl-priority", "normal,high"]) == 0
    assert all(j.endswith("--nccl-ctas 0,4 --nccl-priority normal,high") for j in capsys.readouterr().out.splitlines())
    # DDP as users configure it: every --torch-config is one of torch_nets' eager configurations, passed to the ranks
    configs = pytest.importorskip("tools.bench.torch_nets").TORCH_CONFIGS
    assert all(c in configs and not configs[c].compiled and configs[c].autocast != "float16"
               for c in scaling.DDP_CONFIGS)
    assert scaling.main(["--dry-run", "--gpus", "2", "--nets", "vgg16", "--budget", "0", "--torch-config",
                         "bf16-cl"]) == 0
    assert all(j.endswith("--torch-config bf16-cl") for j in capsys.readouterr().out.splitlines())
    assert scaling.main(["--dry-run", "--gpus", "2", "--nets", "vgg16", "--budget", "0"]) == 0
    assert not any("--torch-config" in j for j in capsys.readouterr().out.splitlines())
    with pytest.raises(SystemExit):
        scaling.main(["--dry-run", "--torch-config", "bf16-cl-compile"])


def test_nccl_block_cap_setting_takes_1_to_32_and_names_the_variable(monkeypatch):
    from superneurons.parallel.collectives import CTAS_ENV, nccl_ctas_setting

    monkeypatch.delenv(CTAS_ENV, raising=False)
    assert nccl_ctas_setting() is None  # NCCL's own choice
    cap = int(np.random.default_rng().integers(1, 33))
    monkeypatch.setenv(CTAS_ENV, str(cap))
    assert nccl_ctas_setting() == cap
    for bad, why in (("0", "expected 1 to 32"), ("33", "expected 1 to 32"), ("many", "whole number")):
        monkeypatch.setenv(CTAS_ENV, bad)
        with pytest.raises(UserError, match=f"{CTAS_ENV}=.*{why}"):
            nccl_ctas_setting()


def test_scaling_benchmark_runs_its_ranks_on_the_cpu(tmp_path):
    scaling = _scaling()
    code = scaling.main(["--device", "cpu", "--nets", "cifar10_quick", "--gpus", "2", "--batches", "2",
                         "--iterations", "1", "--warmup", "1", "--budget", "0", "--repeats", "2",
                         "--bucket-mb", "25,0", "--out", str(tmp_path)])
    assert code == 0
    doc = json.loads((tmp_path / "bench_scaling.json").read_text())
    (row,) = doc["rows"]
    ours = row["ours"]
    assert ours["ok"] and ours["ranks"] == 2 and ours["img_per_s"] > 0 and ours["layer_wise"]
    assert len(ours["windows"]) == 2 and ours["img_per_s"] == float(np.median(ours["windows"]))
    assert ours["flat"] and ours["bucket_mb"] == 25 and ours["buckets"] == 1 == ours["reductions_per_iter"]
    assert ours["wait_ms"] is not None and ours["wait_ms"] >= 0
    assert set(row["ours_buckets"]) == {"25", "0"} and all(v > 0 for v in row["ours_buckets"].values())
    assert "torch" not in row  # no PyTorch on the CPU


def test_local_rank_picks_its_gpu_and_other_ranks_follow_rank_0():
    from superneurons.parallel.rank import pick_device
    from superneurons.parallel.solver import follower_param
    from superneurons.proto import superneurons_pb2 as pb

    cpu = pb.SolverParameter(solver_mode=pb.SolverParameter.CPU)
    gpu = pb.SolverParameter(solver_mode=pb.SolverParameter.GPU, device_id=2)
    second = SimpleNamespace(local_rank=1, local_size=2)
    assert pick_device(second, [3, 5], cpu) == 5
    assert pick_device(second, None, cpu) is None  # CPU ranks
    with pytest.raises(UserError, match=r"2 ranks on this machine but --gpu names 1 GPU\(s\) \(0\)"):
        pick_device(second, [0], cpu)
    with pytest.raises(UserError, match="name their GPUs with --gpu"):
        pick_device(second, None, gpu)
    assert pick_device(SimpleNamespace(local_rank=0, local_size=1), None, gpu) == 2

    param = job.solver_param("plain", 10, 2)
    param.test_iter.append(3)
    param.test_interval, param.snapshot, param.display = 5, 5, 1
    follower = follower_param(param)
    assert (len(follower.test_iter), follower.test_interval, follower.snapshot, follower.display,
            follower.snapshot_after_train) == (0, 0, 0, 0, False)
    assert follower.max_iter == param.max_iter and follower.base_lr == param.base_lr
    assert len(param.test_iter) == 1  # rank 0's own parameters are untouched
