"""A small budget of the input fuzzer (tools/fuzz) on every input kind: no traceback, signal or hang.

The long runs and their numbers are in docs/ROBUSTNESS.md; this keeps what they fixed fixed. A failure
prints each finding's command line; replay it with
`python tools/fuzz/fuzz.py --kind KIND --seed 11 --first CASE --cases 1 --keep /tmp/case`. Then `--jobs`:
the same outcome for every case as one job, and a run stopped by Ctrl-C or a dead shard leaves nothing.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "tools" / "fuzz"
sys.path.insert(0, str(FUZZ))
fuzz_tool = importlib.import_module("fuzz")
mutate = importlib.import_module("mutate")
runner = importlib.import_module("runner")
signals_tool = importlib.import_module("signals")
shard_tool = importlib.import_module("shard")

CASES = 16  # per kind: 176 cases, 15-35 s on two shared cores
SEED = 11


# Every kind, in two halves that test runners on two cores can take side by side (each builds its own corpus).
HALVES = [list(fuzz_tool.KINDS)[0::2], list(fuzz_tool.KINDS)[1::2]]


@pytest.mark.parametrize("kinds", HALVES, ids=["even", "odd"])
def test_every_kind_gives_no_traceback_signal_or_hang(tmp_path, kinds):
    lines: list[str] = []
    # One decode thread per data layer: worker processes cost a start-up per case (the long runs use them).
    # A hang is a case that never ends; the limit only has to exceed the slowest case on a busy machine (cifar10
    # quick's `solver` cases train 40-50 s on two cores under a load of 15, forked or fresh).
    report = fuzz_tool.fuzz(kinds, CASES, SEED, timeout=180.0, work=tmp_path, log=lines.append, data_workers=1)
    bad = {kind: r["findings"] for kind, r in report.items() if r["findings"]}
    assert not bad, "\n".join(lines)
    assert sorted(report) == sorted(kinds)
    for kind, r in report.items():
        assert sum(r["counts"].values()) == CASES
        assert r["counts"]["error"] > 0, f"{kind}: no case reached an error; the mutations do nothing"


def test_mutations_are_a_function_of_the_seed():
    data = b'layer { name: "a" type: "ReLU" bottom: "x" top: "x" }\nlayer { name: "b" }\n' * 4
    first = [mutate.mutate_text(data, random.Random(f"1:k:{i}")) for i in range(20)]
    again = [mutate.mutate_text(data, random.Random(f"1:k:{i}")) for i in range(20)]
    assert first == again
    assert len(set(first)) > 10  # and they differ from case to case


@pytest.mark.parametrize("answer, outcome", [
    ({"rc": 0, "err": "", "exc": None}, "ok"),
    ({"rc": 1, "err": "superneurons test: error: f.prototxt:3:1: bad\n", "exc": None}, "error"),
    ({"rc": 1, "err": "I1124 log line\nsuperneurons test: error: x\n", "exc": None}, "error"),
    ({"rc": 1, "err": "Traceback (most recent call last):\nsuperneurons test: error: x\n", "exc": None}, "traceback"),
    ({"rc": 1, "err": "something else\n", "exc": None}, "traceback"),
    ({"rc": None, "err": "", "exc": "Traceback ...\nKeyError: 'x'"}, "traceback"),
])
def test_classification(answer, outcome):
    assert runner.classify(answer)[0] == outcome


def test_worker_reports_tracebacks_deaths_and_hangs(tmp_path):
    repo = FUZZ.parents[1]
    slow = ["time", "--model", "models/lenet/lenet.prototxt", "--iterations", "1000000"]  # minutes
    missing = ["summary", "--model", str(tmp_path / "missing")]
    worker = runner.Worker(repo, 2 << 30)
    try:
        result = worker.run(missing + ["--debug"], tmp_path, 60)  # --debug lets the UserError out of main
        assert result.outcome == "traceback" and "UserError" in result.detail
        threading.Timer(1.0, os.kill, (worker.proc.pid, signal.SIGBUS)).start()
        result = worker.run(slow, repo, 60)
        assert (result.outcome, result.detail) == ("signal", "SIGBUS")
        # A fresh worker in place of the dead one. Its first `time` imports what the command needs (numba among
        # them: seconds on a loaded machine), so the one-iteration run comes first and the 3 s limit below
        # finds the run in its loop rather than in an import.
        result = worker.run(slow[:-1] + ["1"], repo, 60)
        assert (result.outcome, result.rc) == ("ok", 0), result.detail
        result = worker.run(slow, repo, 3.0)  # stopped after the limit
        assert result.outcome == "hang"
        assert "its threads:" in result.detail and "commands/time.py" in result.detail  # where it was, for the report
        result = worker.run(missing, tmp_path, 60)
        assert result.outcome == "error" and result.detail.endswith("missing: no such file")
    finally:
        worker.stop()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_fork_server_reports_tracebacks_deaths_and_hangs_and_outlives_them(tmp_path):
    repo = FUZZ.parents[1]
    slow = ["time", "--model", "models/lenet/lenet.prototxt", "--iterations", "1000000"]  # minutes
    missing = ["summary", "--model", str(tmp_path / "missing")]
    server = runner.ForkServer(repo, 2 << 30)
    try:
        result = server.run(missing + ["--debug"], tmp_path, 60)  # --debug lets the UserError out of the program
        assert (result.outcome, result.rc) == ("traceback", 1) and "UserError" in result.detail
        pid = server.proc.pid
        threading.Timer(1.5, lambda: [os.kill(c, signal.SIGBUS) for c in _children(pid)]).start()
        result = server.run(slow, repo, 60)
        assert (result.outcome, result.detail, result.rc) == ("signal", "SIGBUS", -signal.SIGBUS)
        result = server.run(slow, repo, 3.0)
        assert result.outcome == "hang"
        assert "its threads:" in result.detail and "commands/time.py" in result.detail  # where it was, for the report
        assert _children(pid) == []  # the hung case is gone, the server is not
        result = server.run(missing, tmp_path, 60)
        assert (result.outcome, result.rc) == ("error", 1) and result.detail.endswith("missing: no such file")
        assert server.proc.pid == pid
    finally:
        server.close()


def test_fork_server_gives_each_case_the_outcome_of_a_fresh_process(tmp_path):
    """The same cases through the fork server and through `python -m superneurons`: the same outcome, exit
    status and message, case by case, including cases that start decode worker processes (lmdb, image), which
    must leave nothing in /dev/shm (an outcome of its own, `leak`)."""
    corpus = fuzz_tool.build_corpus(tmp_path / "corpus", tmp_path / "corpus.pickle", 0)
    events: dict[str, list] = {}
    for mode in ("fork", "fresh"):
        events[mode] = []
        for kind, first, data_workers in (("prototxt", 0, 1), ("extra", 5, 1), ("lmdb", 0, 2), ("image", 0, 2)):
            shard = shard_tool.Shard(kind, SEED, first, first + 2, str(tmp_path / f"{mode}-{kind}"), 60.0, 2 << 30, 0,
                                     data_workers, None, False, mode)
            shard_tool.run_shard(shard, corpus, lambda e, kind=kind: events[mode].append(
                (kind, e["case"], e["outcome"], e["rc"], e["detail"])))
    assert events["fork"] == events["fresh"]
    assert {"ok", "error"} <= {e[2] for e in events["fork"]}


def test_jobs_report_the_outcome_of_every_case_as_one_job_does(tmp_path):
    # lmdb: each shard must have folders of its own (LMDB knows environments by inode); solver: its cases
    # write snapshots into the corpus.
    outcomes = {}
    for jobs in (1, 2):
        report = tmp_path / f"jobs{jobs}.json"
        argv = ["--kind", "solver", "--kind", "lmdb", "--cases", "4", "--first", "2", "--seed", "5",
                "--data-workers", "1", "--jobs", str(jobs), "--work", str(tmp_path / "work"), "--json", str(report)]
        assert fuzz_tool.main(argv) == 0
        assert not (tmp_path / "work/shards").exists()
        outcomes[jobs] = json.loads(report.read_text())
    for kind in ("solver", "lmdb"):
        one, two = outcomes[1][kind], outcomes[2][kind]
        assert len(one["outcomes"]) == 4 and sum(one["counts"].values()) == 4
        assert (two["outcomes"], two["counts"], two["findings"]) == (one["outcomes"], one["counts"], one["findings"])
    assert {"ok", "error"} <= set(outcomes[1]["solver"]["outcomes"] + outcomes[1]["lmdb"]["outcomes"])


def test_split_covers_every_case_once():
    assert fuzz_tool.split(10, 7, 3) == [(10, 12), (12, 14), (14, 17)]
    assert fuzz_tool.split(0, 2, 16) == [(0, 1), (1, 2)]
    assert fuzz_tool.split(5, 1, 4) == [(5, 6)]


def test_keep_replays_one_case_under_jobs(tmp_path):
    argv = ["--kind", "lmdb", "--cases", "1", "--first", "3", "--seed", "5", "--data-workers", "1", "--jobs", "2",
            "--keep", str(tmp_path / "kept")]
    fuzz_tool.main(argv)
    assert (tmp_path / "kept/lmdb-3/lenet.prototxt").is_file() and (tmp_path / "kept/lmdb-3/db").is_dir()


def _processes_in(folder: Path) -> list[tuple[int, str, str]]:
    """(pid, working folder, command line) of the live processes working in `folder` or naming it in their
    command. A zombie (an orphaned worker's child that has exited and waits for init to reap it) runs nothing
    and holds nothing, so it does not count."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X"):
                continue
            cwd = os.readlink(entry / "cwd")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        if cwd.startswith(str(folder)) or str(folder) in cmd:
            found.append((int(entry.name), cwd, cmd))
    return found


def _left_behind(folder: Path, seconds: float = 10.0) -> list[tuple[int, str, str]]:
    """The processes of `_processes_in(folder)` still there after up to `seconds`: a killed worker's child may
    still be on its way out (its memory released, its command line empty) when the run returns."""
    deadline = time.monotonic() + seconds
    while (found := _processes_in(folder)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _start_long_run(tmp_path: Path, jobs: int) -> subprocess.Popen:
    """A run of many cases, returned once a worker runs cases (it works in its shard's folder)."""
    proc = subprocess.Popen([sys.executable, str(FUZZ / "fuzz.py"), "--kind", "solver", "--cases", "400",
                             "--data-workers", "1", "--jobs", str(jobs), "--work", str(tmp_path / "work"),
                             "--progress", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(cwd.startswith(str(tmp_path / "work/shards")) for _, cwd, _ in _processes_in(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start its cases"
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("jobs", [1, 2])
def test_ctrl_c_stops_every_worker_in_one_line(tmp_path, jobs):
    proc = _start_long_run(tmp_path, jobs)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "fuzz.py: interrupted\n")
    assert _left_behind(tmp_path) == []
    assert not (tmp_path / "work/shards").exists()


def test_a_dead_shard_stops_the_run(tmp_path):
    proc = _start_long_run(tmp_path, 2)
    shard = next(pid for pid, _, cmd in _processes_in(tmp_path) if "shard.py" in cmd)
    os.kill(shard, signal.SIGKILL)  # as the OOM killer would
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.startswith("fuzz.py: error: the shard of solver cases [") and "(killed by SIGKILL)" in err
    assert err.count("\n") == 1
    assert _left_behind(tmp_path) == []
    assert not (tmp_path / "work/shards").exists()


def test_a_shard_that_cannot_run_stops_the_run(capsys):
    # Too little memory for the worker to import SuperNeurons: every shard fails as it starts.
    # (--progress 0: on a loaded machine the shards may take past the first progress line to fail)
    assert fuzz_tool.main(["--kind", "solver", "--cases", "4", "--jobs", "2", "--max-memory", str(1 << 20),
                           "--progress", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fuzz.py: error: the shard of solver cases [") and "did not start" in err


def test_ctrl_c_trials_tell_cpythons_start_up_from_ours(tmp_path):
    """The Ctrl-C trials count a stop in CPython's own initialization apart: there no code of ours has run. A
    KeyboardInterrupt in `site` (which runs sitecustomize) is one, as CPython reports it; the same interrupt in
    our start-up (the command line importing argparse) is ours to answer: one line, exit 130."""
    repo = str(Path(__file__).resolve().parents[1])
    for name in ("sitecustomize", "argparse"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.py").write_text("raise KeyboardInterrupt\n")
    runs = {name: subprocess.run([sys.executable, "-m", "superneurons", "--version"], capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / name), repo])),
                                 cwd=tmp_path, timeout=60) for name in ("sitecustomize", "argparse")}
    cpython, ours = runs["sitecustomize"], runs["argparse"]
    assert signals_tool.in_cpython_start_up(cpython.returncode, cpython.stderr), (cpython.returncode, cpython.stderr)
    assert (ours.returncode, ours.stderr) == (130, "superneurons: interrupted\n")
    assert not signals_tool.in_cpython_start_up(ours.returncode, ours.stderr)
    assert not signals_tool.in_cpython_start_up(-signal.SIGINT, "I1128 ... Solving digits\n")
    assert signals_tool.in_cpython_start_up(-signal.SIGINT, "")  # killed before Python's handler existed
