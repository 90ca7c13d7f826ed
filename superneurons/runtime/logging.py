"""Caffe's training log: glog lines on stderr (and optionally a file), plus a JSON-lines record.

Every line is what Caffe's glog writes, `I1124 03:15:49.123456 12345 solver.py:160] Iteration 100, lr = 0.01`:
severity letter, month and day, time with microseconds, thread id, the source file and line that logged
it. The message texts are Caffe's ("Iteration 100 (25.1 iter/s, 3.98s/100 iters), loss = 0.21",
"    Train net output #0: loss = 0.21 (* 1 = 0.21 loss)", "Iteration 100, Testing net (#0)", ...) so
scripts written for Caffe logs (tools/extra/parse_log.py, plot_training_log.py) read ours unchanged.
The JSON-lines file holds one object per display or test result for tools that would rather not parse
text.

Two limits keep a log readable where Caffe's would not be: a net output with many values prints the
first `MAX_OUTPUT_VALUES` of them and one line saying how many were left out (Caffe prints every
element), and `DisplayGate` thins displays that come faster than a person can read (`display: 1` at
thousands of iterations a second).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import threading
import time
from datetime import datetime
from typing import Any, Iterable, Sequence, TextIO

from superneurons.errors import UserError

MAX_OUTPUT_VALUES = 20  # values printed per output blob per display or test


def num(x: float) -> str:
    """A number as C++'s ostream prints it by default (6 significant digits)."""
    return f"{float(x):.6g}"


def glog_prefix(severity: str, where: tuple[str, int], when: float | None = None, thread: int | None = None) -> str:
    """`I1124 03:15:49.123456 12345 solver.py:160] `: glog's line header (local time, as glog's default)."""
    now = time.time() if when is None else when
    stamp = datetime.fromtimestamp(now)
    tid = threading.get_native_id() if thread is None else thread
    return f"{severity}{stamp:%m%d %H:%M:%S.%f} {tid:5d} {where[0]}:{where[1]}] "


def _caller(depth: int) -> tuple[str, int]:
    """(file name, line) of the code `depth` frames above the caller of this function."""
    frame = inspect.currentframe()
    for _ in range(depth + 1):
        if frame is None or frame.f_back is None:
            break
        frame = frame.f_back
    if frame is None:
        return "?", 0
    return os.path.basename(frame.f_code.co_filename), frame.f_lineno


class TrainLog:
    """Where the solver's and `train`'s lines go: `stream` (default stderr, as glog) and a `--log` file.
    A stream that can no longer be written (a closed terminal) is dropped; training does not stop for it."""

    def __init__(self, log_path: str | None = None, json_path: str | None = None, stream: TextIO | None = None,
                 sinks: list[Any] | None = None):
        """`sinks`: objects with `record(fields)` and `close()` that also get every record (TensorBoard)."""
        self.stream = stream if stream is not None else sys.stderr
        self._file = _open(log_path) if log_path else None
        self._json = _open(json_path) if json_path else None
        self.sinks = list(sinks or [])

    def info(self, line: str) -> None:
        self._emit("I", line)

    def warning(self, line: str) -> None:
        self._emit("W", line)

    def _emit(self, severity: str, line: str) -> None:
        text = glog_prefix(severity, _caller(2)) + line
        if self.stream is not None:
            try:
                print(text, file=self.stream, flush=True)
            except (OSError, ValueError):  # the terminal hung up (SIGHUP's usual cause) or was closed:
                self.stream = None  # training goes on, logging to --log only, as glog does
        if self._file is not None:
            print(text, file=self._file, flush=True)

    def record(self, **fields: Any) -> None:
        """One JSON object per line (display and test results)."""
        if self._json is not None:
            self._json.write(json.dumps(fields, sort_keys=False) + "\n")
            self._json.flush()
        for sink in self.sinks:
            sink.record(fields)

    def close(self) -> None:
        for f in (self._file, self._json):
            if f is not None:
                f.close()
        self._file = self._json = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> "TrainLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: str) -> TextIO:
    try:
        return open(path, "a", encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot open the log file ({e.strerror or e})") from None


def score_line(name: str, value: float, loss_weight: float) -> str:
    """`loss = 0.3 (* 1 = 0.3 loss)`; the suffix only for outputs that count as loss."""
    line = f"{name} = {num(value)}"
    if loss_weight:
        line += f" (* {num(loss_weight)} = {num(loss_weight * value)} loss)"
    return line


def output_line(kind: str, index: int, name: str, value: float, loss_weight: float) -> str:
    """`    Train net output #0: loss = 0.3 (* 1 = 0.3 loss)`."""
    return f"    {kind} net output #{index}: {score_line(name, value, loss_weight)}"


def capped_outputs(blobs: Iterable[tuple[str, Sequence[float], float]], cap: int = MAX_OUTPUT_VALUES
                   ) -> tuple[list[tuple[int, str, float, float]], list[str]]:
    """Caffe numbers every element of every output blob (#0, #1, ...) and prints each. Of each
    (name, values, loss weight) blob the first `cap` values are kept, with their Caffe numbers; returns
    (index, name, value, loss weight) of those and, per blob cut short, a note saying how many were left out."""
    kept: list[tuple[int, str, float, float]] = []
    notes: list[str] = []
    index = 0
    for name, values, weight in blobs:
        n = len(values)
        kept += [(index + k, name, float(values[k]), weight) for k in range(min(n, cap))]
        if n > cap:
            notes.append(f"    ({n - cap} more values of output {name!r} not shown: {n} in all, the first {cap} "
                         "above)")
        index += n
    return kept, notes


class DisplayGate:
    """Lets displays through at most `per_second` a second on average, after a first `burst` (a token
    bucket): `display: 1` on a tiny net runs thousands of iterations a second, which no terminal or
    reader keeps up with. Training itself is untouched; only the lines are thinned."""

    def __init__(self, per_second: float = 10.0, burst: int = 50, clock=time.monotonic):
        self.per_second = float(per_second)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.clock = clock
        self.last = clock()
        self.thinned = False  # True once a display was held back (the solver says so once)

    def allow(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_second)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
