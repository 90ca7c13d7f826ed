"""Caffe's command line: its flag spellings, --gpu against solver_mode, and what SIGINT/SIGHUP do
(Caffe's -sigint_effect/-sighup_effect), run as a user runs them: `python -m superneurons ...` in a subprocess."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from logs import GLOG, messages
from test_solver import TINY_NET

from superneurons.cli import CaffeFlagParser, build_parser, main

REPO = Path(__file__).resolve().parents[1]

SOLVER = """net: "tiny.prototxt"
base_lr: 0.01
lr_policy: "fixed"
display: 100
max_iter: {max_iter}
snapshot_prefix: "out/tiny"
random_seed: 1
{extra}
"""


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER.format(max_iter=6, extra=""))
    return tmp_path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "superneurons", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


# -- flag spellings ------------------------------------------------------------------------------------------

def test_caffe_spellings_are_rewritten_for_the_options_a_command_has():
    train = build_parser()
    args = train.parse_args(["train", "-solver", "s.prototxt", "-gpu=-1", "--sighup_effect", "none",
                             "-sigint_effect=snapshot", "-weights", "w.caffemodel", "-level", "2", "-stage", "a,b"])
    assert (args.solver, args.gpu, args.sighup_effect, args.sigint_effect, args.weights, args.level, args.stage) == \
        ("s.prototxt", "-1", "none", "snapshot", "w.caffemodel", 2, ["a,b"])
    args = build_parser().parse_args(["time", "-model", "m.prototxt", "-iterations", "3", "-phase", "TEST",
                                      "-gpu", "-1", "-level", "1", "-stage", "deploy"])
    assert (args.model, args.iterations, args.phase, args.gpu, args.level, args.stage) == \
        ("m.prototxt", 3, "TEST", "-1", 1, ["deploy"])
    args = build_parser().parse_args(["test", "-model", "m", "-weights", "w", "-iterations", "5"])
    assert (args.model, args.weights, args.iterations) == ("m", "w", 5)
    # Options added through argument groups too (Caffe's tools: `-resize_height 256`).
    group_parser = CaffeFlagParser()
    group_parser.add_argument_group("resizing").add_argument("--resize-height", type=int)
    assert group_parser.parse_args(["-resize_height=256"]).resize_height == 256
    # A value that looks like a flag of another command, and what follows `--`, stay as they are.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["summary", "--model", "m", "-solver", "x"])


def test_train_with_caffe_flags_end_to_end(workdir):
    proc = _run(workdir, "train", "-solver=solver.prototxt", "-gpu", "-1", "-sighup_effect", "stop")
    assert proc.returncode == 0, proc.stderr
    assert "Optimization Done." in messages(proc.stderr)
    assert (workdir / "out/tiny_iter_6.caffemodel").exists()
    bad = _run(workdir, "train", "-solver", "solver.prototxt", "-sigint_effect", "explode")
    assert bad.returncode == 2 and "invalid choice: 'explode'" in bad.stderr and "Traceback" not in bad.stderr


# -- --gpu against solver_mode ------------------------------------------------------------------------------

def _no_gpu() -> bool:
    from superneurons.backend.cuda.probe import gpu_available

    return not gpu_available()


@pytest.mark.skipif(not _no_gpu(), reason="this machine has a usable GPU: the fallback cannot be seen here")
def test_solver_mode_gpu_without_a_gpu_runs_on_the_cpu_with_one_warning(workdir):
    (workdir / "solver.prototxt").write_text(SOLVER.format(max_iter=4, extra="solver_mode: GPU"))
    proc = _run(workdir, "train", "-solver", "solver.prototxt")
    assert proc.returncode == 0, proc.stderr
    warnings = [l for l in proc.stderr.splitlines() if l.startswith("W")]
    assert len(warnings) == 1 and GLOG.fullmatch(warnings[0]), warnings
    assert "solver.prototxt asks for solver_mode: GPU" in warnings[0] and "running on the CPU" in warnings[0]
    assert "drop --gpu" not in proc.stderr

    quiet = _run(workdir, "train", "-solver", "solver.prototxt", "-gpu", "-1")  # the CPU, as asked: no warning
    assert quiet.returncode == 0 and not [l for l in quiet.stderr.splitlines() if l.startswith("W")]

    asked = _run(workdir, "train", "-solver", "solver.prototxt", "--gpu", "0")  # asked on the command line: error
    assert asked.returncode == 1 and "Traceback" not in asked.stderr
    error = asked.stderr.strip().splitlines()[-1]
    assert error.startswith("superneurons train: error: --gpu 0: ") and "no usable NVIDIA GPU" in error
    assert "drop --gpu" in error or "--gpu -1" in error  # what to change, as --gpu was given


# -- signals -------------------------------------------------------------------------------------------------

class Training:
    """`superneurons train` in a subprocess whose stderr is read line by line."""

    def __init__(self, cwd: Path, *flags: str):
        (cwd / "solver.prototxt").write_text(SOLVER.format(max_iter=10**8, extra=""))
        self.proc = subprocess.Popen([sys.executable, "-m", "superneurons", "train", "-solver", "solver.prototxt",
                                      *flags], cwd=cwd, env=_env(), stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []

    def wait_for(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-20:]))

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self, timeout: float = 60) -> int:
        _, rest = self.proc.communicate(timeout=timeout)
        self.lines += rest.splitlines()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _iteration(line: str) -> int:
    return int(re.search(r"_iter_(\d+)\.", line).group(1))


def test_sighup_snapshots_and_goes_on_sigint_snapshots_and_stops(workdir):
    run = Training(workdir)
    try:
        run.wait_for(r"\] Iteration 200 ")
        run.send(signal.SIGHUP)
        hup = _iteration(run.wait_for(r"Snapshotting solver state to .*_iter_\d+\.solverstate"))
        run.wait_for(rf"\] Iteration {(hup // 100 + 2) * 100} ")  # training went on after the snapshot
        run.send(signal.SIGINT)
        assert run.finish() == 0
    finally:
        run.kill()
    msgs = messages("\n".join(run.lines))
    assert "SIGHUP received: writing a snapshot after this iteration" in msgs
    stopped = [m for m in msgs if m.startswith("Optimization stopped early.")]
    assert len(stopped) == 1
    last = _iteration(stopped[0])
    assert last > hup
    for it in (hup, last):
        assert (workdir / f"out/tiny_iter_{it}.caffemodel").exists()
        assert (workdir / f"out/tiny_iter_{it}.solverstate").exists()
    assert "Traceback" not in "\n".join(run.lines)


def test_sighup_stop_and_sigint_snapshot_and_none(workdir):
    run = Training(workdir, "-sigint_effect", "snapshot", "-sighup_effect", "stop")
    try:
        run.wait_for(r"\] Iteration 100 ")
        run.send(signal.SIGINT)  # a snapshot, and training goes on
        first = _iteration(run.wait_for(r"Snapshotting solver state"))
        run.wait_for(rf"\] Iteration {(first // 100 + 2) * 100} ")
        run.send(signal.SIGHUP)
        assert run.finish() == 0
    finally:
        run.kill()
    assert any(m.startswith("Optimization stopped early.") for m in messages("\n".join(run.lines)))

    ignored = Training(workdir, "--sighup-effect", "none")
    try:
        ignored.wait_for(r"\] Iteration 100 ")
        ignored.send(signal.SIGHUP)
        ignored.wait_for(r"\] Iteration 400 ")
        assert ignored.proc.poll() is None  # still training
        ignored.send(signal.SIGINT)
        assert ignored.finish() == 0
    finally:
        ignored.kill()
    text = "\n".join(ignored.lines)
    assert "SIGHUP" not in text and text.count("Snapshotting solver state") == 1


SECOND_CTRL_C = """
import os, signal, sys
from superneurons.proto import superneurons_pb2 as pb
from google.protobuf import text_format
from superneurons.solver.solver import Solver
param = text_format.Parse('base_lr: 0.01 max_iter: 1000 snapshot_prefix: "out/x" random_seed: 1', pb.SolverParameter())
param.net_param.CopyFrom(text_format.Parse(open("tiny.prototxt").read(), pb.NetParameter()))
solver = Solver(param, "s.prototxt")
def twice(s, it, loss):
    if it == 3:
        signal.raise_signal(signal.SIGINT)  # the first asks for a stop after this iteration...
        signal.raise_signal(signal.SIGINT)  # ...the second, before that happened, stops at once
        print("not reached", file=sys.stderr)
solver.callbacks.append(twice)
try:
    solver.solve()
except KeyboardInterrupt:  # what the command line reports as "interrupted", exit code 130
    print("KeyboardInterrupt at iteration", solver.iter, file=sys.stderr)
    sys.exit(130)
"""


def test_a_second_ctrl_c_stops_at_once_without_a_traceback_or_snapshot(workdir):
    proc = subprocess.run([sys.executable, "-c", SECOND_CTRL_C], cwd=workdir, env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "not reached" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == "KeyboardInterrupt at iteration 3"
    msgs = messages(proc.stderr)
    assert msgs[-2:] == ["SIGINT received: stopping after this iteration (Ctrl-C again to stop at once)",
                         "SIGINT again: stopping now, without a snapshot"]
    assert not (workdir / "out").exists()


def test_two_ctrl_c_from_the_terminal_end_training_without_a_traceback(workdir):
    """As a terminal sends it: SIGINT to the whole process group, twice in quick succession."""
    (workdir / "solver.prototxt").write_text(SOLVER.format(max_iter=10**8, extra=""))
    proc = subprocess.Popen([sys.executable, "-m", "superneurons", "train", "-solver", "solver.prototxt"],
                            cwd=workdir, env=_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while "Iteration 100 " not in (proc.stderr.readline() or "Iteration 100 "):
            pass
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err and "Warning" not in err, err
    assert proc.returncode in (0, 130), err  # 0: both handled as one request (signals coalesce)


def test_ctrl_c_during_start_up_is_one_line(monkeypatch, capsys):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr("superneurons.cli.build_parser", interrupted)
    assert main(["train", "-solver", "s.prototxt"]) == 130
    assert capsys.readouterr().err == "superneurons: interrupted\n"


# `superneurons` as the program runs it (cli.run), with a stand-in for the command; DRIVE is what it does.
PROGRAM = """
import atexit, signal, sys
from superneurons import cli

class Late:  # a global of the program: deleted as Python tears its modules down, after the exit handlers
    def __init__(self):
        self.raise_signal, self.sigint = signal.raise_signal, signal.SIGINT
        self.armed = False
    def __del__(self):
        if self.armed:
            self.raise_signal(self.sigint)

late = Late()

def command(argv=None):
{drive}

cli.main = command
cli.run()
"""


def _program(tmp_path, drive: str) -> subprocess.CompletedProcess:
    # Run with -m, as `python -m superneurons`: Python ends a module's run otherwise than a `-c` string's.
    (tmp_path / "program.py").write_text(PROGRAM.format(drive="\n".join("    " + line
                                                                        for line in drive.strip().splitlines())))
    return subprocess.run([sys.executable, "-m", "program"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=60)


def test_ctrl_c_while_python_runs_its_exit_handlers_stops_with_the_line(tmp_path):
    """The run stopped on a first Ctrl-C (a snapshot, status 0); a second one lands while Python runs its exit
    handlers. It printed "Exception ignored in atexit callback" and a KeyboardInterrupt traceback there."""
    r = _program(tmp_path, """
atexit.register(signal.raise_signal, signal.SIGINT)  # runs in the exit, after the command returned
print("Optimization stopped early.", file=sys.stderr)
return 0""")
    assert (r.returncode, r.stderr) == (130, "Optimization stopped early.\nsuperneurons: interrupted\n")


def test_ctrl_c_while_python_tears_down_is_not_a_death_by_sigint(tmp_path):
    """Later in the exit, after the exit handlers, Python puts back SIGINT's default action: a Ctrl-C there
    killed the process (status -2) without a word, which a shell takes for a run stopped half-way."""
    r = _program(tmp_path, """
late.armed = True
print("Optimization stopped early.", file=sys.stderr)
return 0""")
    assert (r.returncode, r.stderr) == (0, "Optimization stopped early.\n")


def test_an_interrupt_caught_after_it_left_exec_code_keeps_the_exit_status(tmp_path):
    """CPython takes a KeyboardInterrupt that left code run by exec() of a string (numba's compiler, dataclasses)
    for unhandled although the command caught it, and ended the process with SIGINT instead of 130."""
    r = _program(tmp_path, """
try:
    exec("raise KeyboardInterrupt")  # a Ctrl-C inside code made at run time
except KeyboardInterrupt:
    print("superneurons train: interrupted", file=sys.stderr)
    return 130""")
    assert (r.returncode, r.stderr) == (130, "superneurons train: interrupted\n")


@pytest.mark.parametrize("delay", [0.3, 0.8])
def test_ctrl_c_at_any_moment_of_a_real_start_up_leaves_no_traceback(workdir, delay):
    (workdir / "solver.prototxt").write_text(SOLVER.format(max_iter=10**8, extra=""))
    proc = subprocess.Popen([sys.executable, "-m", "superneurons", "train", "-solver", "solver.prototxt"],
                            cwd=workdir, env=_env(), stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # interrupted before Python's own handler exists (-2), in start-up (130) or while training (0, a snapshot)
    assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)
