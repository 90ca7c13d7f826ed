"""Training progress: the live bar of `superneurons train` (terminal only) and `superneurons plot` of its logs."""
from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from logs import messages
from test_solver import TINY_NET

from superneurons.cli import main
from superneurons.commands.plot import parse_log
from superneurons.runtime.progress import TrainProgress, progress_wanted

REPO = Path(__file__).resolve().parents[1]
BAR = re.compile(r"\d+/\d+ \[")  # tqdm's "12/30 [00:01<00:02, 9.5iter/s, loss=0.3]"

SOLVER = """net: "tiny.prototxt"
base_lr: 0.1
momentum: 0.9
lr_policy: "fixed"
display: 5
max_iter: 30
test_iter: 2
test_interval: 10
random_seed: 1
snapshot_after_train: false
solver_mode: CPU
"""


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "tiny.prototxt").write_text(TINY_NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def segments(text: str) -> list[str]:
    """What a terminal would show as separate pieces: split at carriage returns and newlines."""
    return re.split(r"[\r\n]+", text)


def test_bar_only_on_a_terminal_outside_ci():
    assert progress_wanted(FakeTTY(), environ={})
    assert progress_wanted(FakeTTY(), environ={"CI": "0"})
    assert not progress_wanted(FakeTTY(), environ={"CI": "true"})
    assert not progress_wanted(FakeTTY(), environ={"TERM": "dumb"})
    assert not progress_wanted(io.StringIO(), environ={})
    assert not TrainProgress(10, FakeTTY(), enabled=False).enabled


def test_fake_terminal_shows_the_bar_and_keeps_log_lines_whole():
    tty = FakeTTY()
    progress = TrainProgress(20, tty, environ={}, mininterval=0)
    assert progress.enabled
    lines = progress.line_stream()
    print("Solving tiny", file=lines, flush=True)
    for i in range(1, 21):
        progress.update(i, 1.0 / i)
        if i == 10:
            print("Iteration 10 (99 iter/s, 0.1s/10 iters), loss = 0.1", file=lines, flush=True)
    print("Optimization Done.", file=lines, flush=True)
    progress.close()
    out = tty.getvalue()
    assert "\r" in out and "20/20" in out and "iter/s" in out and "loss=0.05" in out
    assert BAR.search(out)
    pieces = segments(out)
    for line in ("Solving tiny", "Iteration 10 (99 iter/s, 0.1s/10 iters), loss = 0.1", "Optimization Done."):
        assert line in pieces, line  # printed whole, on a line of its own, not inside the bar
    # The log line written mid-run comes after a bar drawn earlier and before the final 20/20.
    assert out.index("10/20") < out.index("Iteration 10 (") < out.index("20/20")
    assert out.endswith("Optimization Done.\n")  # the bar closed when max_iter was reached


def test_disabled_progress_writes_plain_lines():
    stream = io.StringIO()
    progress = TrainProgress(5, stream, environ={})
    assert not progress.enabled
    lines = progress.line_stream()
    for i in range(1, 6):
        progress.update(i, 0.5)
        print(f"line {i}", file=lines)
    progress.close()
    assert stream.getvalue() == "".join(f"line {i}\n" for i in range(1, 6))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TERM"] = "xterm"
    return env


def _train_in_pty(cwd: Path, *flags: str, timeout: float = 30) -> str:
    """`superneurons train` with stdout and stderr on a pseudo-terminal, as a person running it sees it."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "superneurons", "train", "--solver", "solver.prototxt", *flags],
                            cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=_env())
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, b"".join(chunks).decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return b"".join(chunks).decode("utf-8", errors="replace")


def test_piped_train_has_no_bar(workdir):
    proc = subprocess.run([sys.executable, "-m", "superneurons", "train", "--solver", "solver.prototxt",
                           "--log", "train.log"], cwd=workdir, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for stream in (proc.stdout, proc.stderr):
        assert "\r" not in stream and "\x1b" not in stream and "\u2588" not in stream
        assert not BAR.search(stream) and "Training:" not in stream
    assert proc.stdout == ""  # the log is glog's, on stderr
    assert proc.stderr.splitlines() == (workdir / "train.log").read_text().splitlines()
    assert "Optimization Done." in messages(proc.stderr)


def test_train_on_a_terminal_shows_the_bar_and_whole_log_lines(workdir):
    out = _train_in_pty(workdir, "--log", "train.log")
    assert "Training:" in out and "30/30" in out and "iter/s" in out and "loss=" in out
    assert BAR.search(out)
    pieces = {p.rstrip() for p in segments(out)}
    log_lines = (workdir / "train.log").read_text().splitlines()
    assert len(log_lines) > 20 and "Optimization Done." in messages("\n".join(log_lines))
    for line in log_lines:  # every Caffe line reached the terminal whole
        assert line.rstrip() in pieces, line

    quiet = _train_in_pty(workdir, "--no-progress")
    assert "Training:" not in quiet and not BAR.search(quiet) and "Optimization Done." in quiet


def test_plot_reads_text_log_and_json_record(workdir, capsys):
    assert main(["train", "--solver", "solver.prototxt", "--log", "train.log", "--log-json", "train.jsonl"]) == 0
    capsys.readouterr()
    text, record = parse_log("train.log"), parse_log("train.jsonl")
    for series in (text, record):
        its, losses = zip(*series["loss"])
        assert list(its) == [0, 5, 10, 15, 20, 25, 30]
        assert losses[-1] < 0.1 * losses[0]  # DummyData with constant labels: the loss collapses
        assert losses[len(losses) // 2] < losses[0]
        assert [i for i, _ in series["test/accuracy"]] == [0, 10, 20, 30]
        assert series["test/accuracy"][-1][1] == 1.0
    # Text lines carry 6 significant digits, the record full precision: the same numbers.
    assert [v for _, v in text["loss"]] == pytest.approx([v for _, v in record["loss"]], rel=1e-5, abs=1e-12)
    for log in ("train.log", "train.jsonl"):
        png = workdir / f"{log}.png"
        assert main(["plot", log, "--out", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert "test/accuracy" in capsys.readouterr().out  # the test-output panel was drawn
