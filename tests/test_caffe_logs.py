"""Caffe's log conventions: glog lines on stderr, read by the regular expressions of Caffe's
tools/extra/parse_log.py into the same tables Caffe's own log gives; long outputs capped; fast displays thinned."""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from logs import GLOG, messages
from test_solver import TINY_NET, make_solver
from test_train_cli import SOLVER  # display 2, test_interval 4, step lr 0.05 halved every 3, max_iter 6

from superneurons.runtime.logging import DisplayGate, capped_outputs, glog_prefix

REPO = Path(__file__).resolve().parents[1]
CAFFE_TRAIN_LOG = REPO / "tests/fixtures/caffe/caffe_train.log"


# -- parse_log.py's behaviour, written from its documentation --------------------------------------------------
# It keeps the last "Iteration N" seen; a "Train net output #k: NAME = VALUE" (or Test) line adds a NAME column to
# the row of that iteration, with the time since the "Solving" line and the last "lr = X" seen; a row is complete
# when it has as many columns as the first row. Times come from the glog header (MMDD HH:MM:SS.micro).
RE_ITERATION = re.compile(r"Iteration (\d+)")
RE_TRAIN = re.compile(r"Train net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_TEST = re.compile(r"Test net output #(\d+): (\S+) = ([\.\deE+-]+)")
RE_LR = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")


def glog_time(line: str, year: int) -> datetime.datetime:
    month, day = int(line[1:3]), int(line[3:5])
    clock = datetime.datetime.strptime(line.split()[1], "%H:%M:%S.%f")
    return clock.replace(year=year, month=month, day=day)


def parse_log_tables(text: str, year: int):
    lines = text.splitlines()
    start = next(glog_time(l, year) for l in lines if "Solving" in l)
    tables = {"train": ([], None), "test": ([], None)}
    iteration, lr = -1, float("nan")

    def add(kind, regex, line, seconds):
        rows, row = tables[kind]
        m = regex.search(line)
        if m:
            if not row or row["NumIters"] != iteration:
                if row:
                    rows.append(row)
                row = OrderedDict(NumIters=iteration, Seconds=seconds, LearningRate=lr)
            row[m.group(2)] = float(m.group(3))
        if row and rows and len(row) == len(rows[0]):
            rows.append(row)
            row = None
        tables[kind] = (rows, row)

    for line in lines:
        if m := RE_ITERATION.search(line):
            iteration = int(m.group(1))
        if iteration == -1:
            continue
        try:
            seconds = (glog_time(line, year) - start).total_seconds()
        except (ValueError, IndexError):
            continue
        if m := RE_LR.search(line):
            lr = float(m.group(1))
        add("train", RE_TRAIN, line, seconds)
        add("test", RE_TEST, line, seconds)
    out = {}
    for kind, (rows, row) in tables.items():
        if row:
            rows.append(row)
        if len(rows) > 1 and math.isnan(rows[0]["LearningRate"]):  # parse_log's fix for the first row
            rows[0]["LearningRate"] = rows[1]["LearningRate"]
        out[kind] = rows
    return out


@pytest.fixture
def trained(tmp_path):
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets/tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "superneurons", "train", "-solver", "solver.prototxt",
                           "--log-json", "train.jsonl"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(l) for l in (tmp_path / "train.jsonl").read_text().splitlines()]
    return proc, records


def test_every_line_is_a_glog_line_on_stderr_naming_the_logging_source_line(trained):
    proc, _ = trained
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) > 15
    today = datetime.datetime.now()
    for line in lines:
        m = GLOG.fullmatch(line)
        assert m, line
        assert m.group(1) == "I" and abs(int(m.group(3)) - today.day) <= 1, line
        # file:line is where the line was logged (a few modules share a file name: one of them)
        codes = [f.read_text().splitlines()[int(m.group(10)) - 1:int(m.group(10))]
                 for f in REPO.glob(f"superneurons/**/{m.group(9)}")]
        assert any(re.search(r"\.(info|warning)\(", "".join(c)) for c in codes), (line, codes)


def test_parse_log_regexes_read_our_log_into_the_tables_caffe_log_gives(trained, tmp_path):
    proc, records = trained
    year = datetime.datetime.now().year
    ours = parse_log_tables(proc.stderr, year)
    # Caffe's own LeNet log (its glog prints the year; parse_log.py was written for MMDD, so drop it).
    caffe_text = re.sub(r"^([IWEF])\d{4}(\d{4} )", r"\1\2", CAFFE_TRAIN_LOG.read_text(), flags=re.M)
    caffe = parse_log_tables(caffe_text, 2026)
    assert [r["NumIters"] for r in caffe["train"]] == [0, 100, 200, 300]
    for kind in ("train", "test"):
        assert list(ours[kind][0]) == list(caffe[kind][0]), kind  # the same columns, in the same order
    assert list(ours["test"][0]) == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]

    # The numbers are the run's: the JSON record holds them at full precision.
    train = {r["iter"]: r for r in records if r["event"] == "train" and "outputs" in r}
    assert [r["NumIters"] for r in ours["train"]] == [0, 2, 4]
    for row in ours["train"]:
        assert row["loss"] == pytest.approx(train[row["NumIters"]]["outputs"]["loss"], rel=1e-5)
    test = {r["iter"]: r for r in records if r["event"] == "test"}
    assert [r["NumIters"] for r in ours["test"]] == [0, 4]
    for row in ours["test"]:
        for name in ("accuracy", "loss"):
            assert row[name] == pytest.approx(test[row["NumIters"]]["outputs"][name], rel=1e-5, abs=1e-7)
    for kind in ("train", "test"):
        seconds = [r["Seconds"] for r in ours[kind]]
        assert seconds == sorted(seconds) and seconds[0] >= 0
        assert {r["LearningRate"] for r in ours[kind]} <= {0.05, 0.025}  # step policy, stepsize 3
    # Caffe's loss line and lr line, as parse_log.sh greps them.
    msgs = messages(proc.stderr)
    assert [m for m in msgs if re.fullmatch(r"Iteration \d+, lr = \S+", m)] == \
        ["Iteration 0, lr = 0.05", "Iteration 2, lr = 0.05", "Iteration 4, lr = 0.025"]
    assert sum(bool(re.fullmatch(r"Iteration \d+ \(.* iter/s, .*s/2 iters\), loss = \S+", m)) for m in msgs) == 3
    assert "Iteration 6, loss = " in "\n".join(msgs)


def test_glog_prefix_format():
    when = datetime.datetime(2026, 3, 7, 4, 5, 6, 789).timestamp()
    assert glog_prefix("W", ("solver.py", 42), when, 123) == "W0307 04:05:06.000789   123 solver.py:42] "


def test_a_large_output_prints_its_first_values_and_says_how_many_were_left_out():
    blobs = [("loss", np.array([0.5]), 1.0), ("probs", np.arange(1000.0), 0.0), ("acc", [0.25, 0.75], 0.0)]
    kept, notes = capped_outputs(blobs, cap=20)
    assert [(i, n) for i, n, _, _ in kept] == [(0, "loss")] + [(k, "probs") for k in range(1, 21)] + \
        [(1001, "acc"), (1002, "acc")]  # Caffe's numbering goes on across what was left out
    assert [v for _, n, v, _ in kept if n == "probs"] == list(range(20))
    assert notes == ["    (980 more values of output 'probs' not shown: 1000 in all, the first 20 above)"]


BIG_OUTPUT_NET = TINY_NET.replace(
    'layer { name: "loss"',
    'layer { name: "spread" type: "InnerProduct" bottom: "data" top: "spread" '
    'inner_product_param { num_output: 500 weight_filler { type: "xavier" } } }\nlayer { name: "loss"')


def test_training_log_never_prints_a_large_blob_element_by_element():
    solver = make_solver("base_lr: 0.01 display: 1 max_iter: 3 snapshot_after_train: false", net=BIG_OUTPUT_NET)
    solver.solve()
    lines = solver.log.lines
    outputs = [l for l in lines if "Train net output #" in l]
    assert len(outputs) == 3 * 21  # per display: loss and 20 of the 4000 values of 'spread'
    assert sum("3980 more values of output 'spread' not shown: 4000 in all" in l for l in lines) == 3


def test_display_gate_lets_a_burst_through_then_a_steady_rate():
    now = [0.0]
    gate = DisplayGate(per_second=10, burst=5, clock=lambda: now[0])
    assert [gate.allow() for _ in range(7)] == [True] * 5 + [False] * 2
    now[0] += 0.35  # 3.5 tokens
    assert [gate.allow() for _ in range(5)] == [True] * 3 + [False] * 2


def test_display_every_iteration_at_high_speed_is_thinned_with_one_note():
    solver = make_solver("base_lr: 0.01 display: 1 max_iter: 400 snapshot_after_train: false")
    solver.display_gate = DisplayGate(per_second=0.001, burst=10)  # as if thousands of iterations a second
    solver.solve()
    lines = solver.log.lines
    assert sum(bool(re.match(r"Iteration \d+ \(", l)) for l in lines) == 10
    notes = [l for l in lines if "displays come faster than" in l]
    assert len(notes) == 1 and notes[0].startswith("Iteration 10: ")
    assert solver.iter == 400


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in `logdir` (TFRecord framing of tensorboardX's Event)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack_from("<Q", data, pos)
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_scalars_hold_what_the_log_shows(trained, tmp_path):
    pytest.importorskip("tensorboardX", reason="--tensorboard needs tensorboardX")
    proc = subprocess.run([sys.executable, "-m", "superneurons", "train", "-solver", "solver.prototxt",
                           "--tensorboard", "runs"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr
    scalars = _scalars(tmp_path / "runs")
    _, records = trained  # the same seeded run, recorded as JSON
    train = [r for r in records if r["event"] == "train"]  # the displays, and the final loss at iteration 6
    assert [s for s, _ in scalars["train/loss"]] == [r["iter"] for r in train] == [0, 2, 4, 6]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [s for s, _ in scalars["train/lr"]] == [0, 2, 4]
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([0.05, 0.05, 0.025])  # float32 in the file
    test = [r for r in records if r["event"] == "test"]
    assert [v for _, v in scalars["test/accuracy"]] == pytest.approx([r["outputs"]["accuracy"] for r in test])


class HungUpTerminal:
    def write(self, text):
        raise OSError(5, "Input/output error")

    def flush(self):
        raise OSError(5, "Input/output error")

    def isatty(self):
        return True


def test_a_terminal_that_hung_up_does_not_stop_training(tmp_path):
    """SIGHUP usually means the terminal is gone; Caffe snapshots and goes on, and so does its log file."""
    from superneurons.runtime.logging import TrainLog
    from superneurons.runtime.progress import TrainProgress

    log = TrainLog(str(tmp_path / "train.log"), stream=HungUpTerminal())
    log.info("first")
    log.warning("second")
    assert log.stream is None
    assert messages((tmp_path / "train.log").read_text()) == ["first", "second"]
    progress = TrainProgress(10, HungUpTerminal(), enabled=True)
    try:
        log.stream = progress.line_stream()
        for i in range(1, 4):
            progress.update(i, 0.5)  # no exception reaches the solver's callback
            log.info(f"line {i}")
    finally:
        progress.close()
    assert messages((tmp_path / "train.log").read_text())[-1] == "line 3"
