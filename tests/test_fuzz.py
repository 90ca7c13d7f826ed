"""A small budget of the input fuzzer (tools/fuzz) on every input kind: no traceback, signal or hang.

The long runs and their numbers are in docs/ROBUSTNESS.md; this keeps what they fixed fixed. A failure
prints each finding's command line; replay it with
`python tools/fuzz/fuzz.py --kind KIND --seed 11 --first CASE --cases 1 --keep /tmp/case`.
"""
from __future__ import annotations

import importlib
import os
import random
import signal
import sys
import threading
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "tools" / "fuzz"
sys.path.insert(0, str(FUZZ))
fuzz_tool = importlib.import_module("fuzz")
mutate = importlib.import_module("mutate")
runner = importlib.import_module("runner")

CASES = 24  # per kind: 264 cases, 20-50 s on two shared cores
SEED = 11


def test_every_kind_gives_no_traceback_signal_or_hang(tmp_path):
    lines: list[str] = []
    # One decode thread per data layer: worker processes cost a start-up per case (the long runs use them).
    report = fuzz_tool.fuzz(list(fuzz_tool.KINDS), CASES, SEED, work=tmp_path, log=lines.append, data_workers=1)
    bad = {kind: r["findings"] for kind, r in report.items() if r["findings"]}
    assert not bad, "\n".join(lines)
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
        assert worker.run(slow, repo, 1.0).outcome == "hang"  # a fresh worker, stopped after the limit
        result = worker.run(missing, tmp_path, 60)
        assert result.outcome == "error" and result.detail.endswith("missing: no such file")
    finally:
        worker.stop()
